"""The README's install trains and evaluates: a fresh virtual environment gets `pip install
-e .` of a copy of the repository, then runs the README's training and evaluation commands on
a few generated shapes.

The environment gets only what that install brings: the distributions the project's own
dependencies need (followed through their requirements), pip and the build backend are lent
from the environment running the tests, and pip installs with --no-index, so that nothing is
downloaded and a package the install forgets (pycocoevalcap, once) fails here as it fails a new
user. Where the tests' setuptools is older than the build needs, pip builds in isolation and
fetches the build backend alone from the package index."""

import os
import re
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def _closure(requirements: list[str]) -> dict[str, metadata.Distribution]:
    """The installed distributions ``requirements`` need, their own requirements followed (with
    the extras asked for, markers evaluated for this machine), by normalised name."""
    found: dict[str, metadata.Distribution] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        key = re.sub(r"[-_.]+", "-", req.name).lower()
        if (key, frozenset(req.extras)) in seen:
            continue
        seen.add((key, frozenset(req.extras)))
        found[key] = dist = metadata.distribution(req.name)  # PackageNotFoundError: the tests' install lacks it
        todo += [(Requirement(r), e) for r in dist.requires or [] for e in ("", *req.extras)]
    return found


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "0"


def _lend(dists: list[metadata.Distribution], view: Path) -> None:
    """Link each distribution's top-level files and folders into ``view``."""
    view.mkdir()
    for dist in dists:
        for file in dist.files or []:
            top = file.parts[0]
            if top in ("..", "__pycache__") or top.endswith(".pth") or (view / top).exists():
                continue
            source = Path(dist.locate_file(top))
            if source.exists():
                (view / top).symlink_to(source)


def _copy_of_the_repository(dest: Path) -> Path:
    """The repository's tracked files, as a clone has them."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_the_readme_s_install_trains_validates_and_evaluates(tmp_path):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    backend = [Requirement(r) for r in project["build-system"]["requires"]]
    lent = _closure(project["project"]["dependencies"] + ["pip"])
    backend_here = all(r.specifier.contains(_version(r.name), prereleases=True) for r in backend)
    if backend_here:
        lent.update(_closure([str(r) for r in backend]))
    view = tmp_path / "lent"
    _lend(list(lent.values()), view)
    venv = tmp_path / "venv"
    # No pip of its own (Python 3.11's would bring an old setuptools too): the lent one.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = subprocess.run([str(venv / "bin" / "python"), "-c", "import site; print(site.getsitepackages()[0])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "lent.pth").write_text(f"{view}\n")
    repo = _copy_of_the_repository(tmp_path / "captioner")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"

    def run(*argv: str) -> str:
        done = subprocess.run(list(argv), cwd=repo, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{' '.join(argv)}: exit {done.returncode}\n{done.stderr[-3000:]}"
        return done.stdout + done.stderr

    # The README's set-up (`pip install -e .`), offline: only what was lent can satisfy it.
    offline = ["--no-index", "--no-build-isolation"] if backend_here else []
    run("python", "-m", "pip", "install", "-q", *offline, "-e", ".")
    # The README's "Train and evaluate", on a few images and steps.
    trained = run("captioner", "train", "--config", "train/configs/shapes-soft.toml", "--run-dir", "runs/readme",
                  "--quiet", "--set", "data.shapes_train=12", "--set", "data.shapes_val=3", "--set",
                  "optim.max_steps=2", "--set", "optim.batch_size=4", "--set", "val.limit=3")
    assert "first validation: saved as best.pt" in trained
    # On the images the training made (its validation split). METEOR is left out: it is Java's
    # start and tables, seconds that test_metrics.py spends once; the metrics' packages still load.
    report = run("captioner", "evaluate", "--weights", "runs/readme/best.pt", "--data", "data/shapes",
                 "--split", "val", "--no-meteor")
    assert "CIDEr" in report and "pointing game" in report
