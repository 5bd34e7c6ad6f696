"""tools/mutate.py stays runnable: every module it mutates and every test file it runs exists,
each module's installed name is the file it mutates, the copy it mutates is the one imported,
and cosmic-ray stays an optional extra. (Mutation testing itself is not run here.)"""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

import pytest

from tools.mutate import MODULES, OPERATORS, check_imports_from, link_packages, module_name

ROOT = Path(__file__).resolve().parents[2]


def test_every_module_and_its_own_test_files_exist():
    wanted = {"train/startup.py", "train/config.py", "captioner/cli/batch.py", "captioner/data/jpeg_device.py"}
    assert wanted <= set(MODULES)
    for module, tests in MODULES.items():
        assert (ROOT / module).is_file(), module
        assert tests and all((ROOT / t).is_file() and Path(t).name.startswith("test_") for t in tests), (module, tests)


def test_each_module_s_installed_name_is_the_file_mutated():
    assert module_name("train/startup.py") == "captioner.train.startup"
    assert module_name("app/serving.py") == "captioner.app.serving"
    assert module_name("captioner/data/coco.py") == "captioner.data.coco"
    for module in MODULES:
        assert Path(importlib.util.find_spec(module_name(module)).origin).resolve() == (ROOT / module).resolve()


def test_the_tests_import_the_copy_not_the_working_tree(tmp_path):
    """The editable install maps captioner.train to the working tree's train/: in the copy,
    the links put the copy's train/startup.py first (check_imports_from exits otherwise)."""
    for f in ("captioner/__init__.py", "train/__init__.py", "train/startup.py", "app/__init__.py"):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("")
    with pytest.raises(SystemExit, match="not the mutated copy"):
        check_imports_from(tmp_path, "train/startup.py")
    link_packages(tmp_path)
    check_imports_from(tmp_path, "train/startup.py")


def test_cosmic_ray_is_an_optional_extra_and_its_operators_exist():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("cosmic-ray") for d in extras["mutation"])
    assert not any(d.startswith("cosmic-ray") for name, ds in extras.items() if name != "mutation" for d in ds)
    plugins = pytest.importorskip("cosmic_ray.plugins")
    assert OPERATORS <= set(plugins.operator_names())


def test_only_function_annotations_never_evaluated_are_left_unmutated():
    from tools.mutate import _inside, unevaluated_annotations

    body = ("class C:\n    x: int | None = None\n\n"
            "def f(a: int | None, *b: str, **c: int) -> dict | None:\n    return a | 1\n")
    assert unevaluated_annotations(body) == []  # evaluated when the module is imported
    spans = unevaluated_annotations("from __future__ import annotations\n" + body)
    assert len(spans) == 4
    assert _inside(spans, (5, 13)) and _inside(spans, (5, 43))  # int | None, dict | None
    assert not _inside(spans, (3, 7)) and not _inside(spans, (6, 11))  # the class field, the body's a | 1


def test_a_sample_is_spread_evenly_and_an_offset_draws_another_between_its_mutants():
    from tools.mutate import _sample

    items = list(range(100))
    first, second = _sample(items, 10), _sample(items, 10, 0.5)
    assert first == list(range(0, 100, 10)) and second == list(range(5, 100, 10))
    assert _sample(items, 0) == items and _sample(items[:5], 10) == items[:5]
    assert _sample(list(range(7)), 3, 0.99) == [2, 4, 6]  # never past the end
