"""Shared fixtures: a tiny COCO-format data set on disk, its Karpathy split file, a tiny
model's weights file, the studies' shapes test sets, and the kernels' switch set one way or the
other."""

from __future__ import annotations

import gc
import json
import os
import shutil
from pathlib import Path

import pytest

# torch, the library and tests.tiny are imported where a fixture needs them: pytest-xdist's
# controller loads this file too, and starts its workers only once the file is loaded.


def _xdist_worker() -> bool:
    return bool(os.environ.get("PYTEST_XDIST_WORKER"))


def pytest_configure(config):
    """Under pytest-xdist (pyproject's addopts) the tests run in several processes side by side,
    one a core: each keeps to one torch thread, and so do the processes it starts, so that the
    threads of one process do not wait on cores another one holds."""
    if _xdist_worker():
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """The processes' exits are the run's last wait: pytest-xdist's controller ends only when
    every worker has, and an interpreter's shutdown runs full garbage collections over all it
    still holds (torch, the test modules, their fixtures' models). Collected once here and
    frozen, what is left is out of those collections' sight, as the captioner command does
    (captioner.cli.main.run)."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, the files that hold a test marked slow first, each file's tests in
    their own order: pyproject's `--dist loadfile --no-loadscope-reorder` hands out whole files
    in this order, so the long ones start at once and the workers share out the short files
    around them, rather than one worker meeting a long test when the others are nearly done. A
    file stays whole on one worker, so its module fixtures (a trained model, an ONNX export) are
    made once a run, not once a worker."""
    if _xdist_worker():
        slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
        items.sort(key=lambda item: item.path not in slow_files)


@pytest.fixture(scope="session")
def onnx_registry_once():
    """torch's ONNX exporter builds its table of ONNX functions afresh for every graph it
    exports: about 2 s of parsing onnxscript's sources, for a tiny graph's 4 s. The tests export
    dozens of graphs of one opset, so each test process builds the table once and hands the same
    one to every export (the exporter only reads it; `captioner export` itself is unchanged).
    Where torch has moved that builder, the exports build it each time, as before."""
    try:
        from torch.onnx._internal.exporter import _registration
    except ImportError:
        yield
        return
    build = _registration.ONNXRegistry.__dict__.get("from_torchlib")
    if not isinstance(build, classmethod):
        yield
        return
    built: dict = {}

    def once(cls, *args, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        if key not in built:
            built[key] = build.__func__(cls, *args, **kwargs)
        return built[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_registration.ONNXRegistry, "from_torchlib", classmethod(once))
        yield


@pytest.fixture
def tiny_coco(tmp_path: Path) -> Path:
    """A folder with captions_{train,val,test}.json (6/2/2 images, 2-3 captions each) and images/."""
    from tests.tiny import write_tiny_coco

    return write_tiny_coco(tmp_path / "tiny_coco")


@pytest.fixture
def tiny_karpathy(tiny_coco: Path) -> Path:
    """A Karpathy-style ``dataset_coco.json`` over the tiny_coco images; returns the file's path.

    Splits: the first four COCO-train images are "train", the other two "restval";
    val and test as in tiny_coco. Image paths are ``<its folder>/<filepath>/<filename>``.
    """
    from tests.tiny import TINY_COCO

    split_of = {}
    for image_id, *_ in TINY_COCO["train"]:
        split_of[image_id] = "train" if len(split_of) < 4 else "restval"
    for split in ("val", "test"):
        split_of.update({image_id: split for image_id, *_ in TINY_COCO[split]})

    images = []
    for imgid, (image_id, file_name, _size, _colour, captions) in enumerate(
            e for entries in TINY_COCO.values() for e in entries):
        images.append({
            "filepath": "images",
            "filename": file_name,
            "imgid": imgid,
            "cocoid": image_id,
            "split": split_of[image_id],
            "sentids": list(range(len(captions))),
            "sentences": [{"raw": c, "tokens": c.lower().rstrip(".").split()} for c in captions],
        })
    path = tiny_coco / "dataset_coco.json"
    path.write_text(json.dumps({"dataset": "coco", "images": images}), encoding="utf-8")
    return path


PHOTOS = Path(__file__).parent / "fixtures" / "photos"


@pytest.fixture
def photos(tmp_path: Path) -> Path:
    """A copy of the photo fixture (real photographs in COCO 2014 and Flickr8k layouts):
    ``coco/`` (train2014/, val2014/, annotations/, dataset_coco.json) and ``flickr8k/``
    (Flicker8k_Dataset/, dataset_flickr8k.json). See tests/fixtures/photos/NOTICE.md."""
    import shutil

    return Path(shutil.copytree(PHOTOS, tmp_path / "photos"))


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> str:
    """A tiny model (tiny.tiny_captioner, seed 1) saved once per test module: its path."""
    from tests.tiny import tiny_captioner

    path = tmp_path_factory.mktemp("w") / "tiny.pt"
    tiny_captioner(seed=1).save(path)
    return str(path)


@pytest.fixture(scope="session")
def shapes_test_sets(tmp_path_factory):
    """``studies.attention.scoring.ensure_test_sets`` for the tests, as a function of (seeds,
    n_images, root): each set is made once a run (`captioner shapes` called in the worker's own
    process; under pytest-xdist by whichever worker asks first, the others wait for it), then
    copied into ``root``, where ensure_test_sets finds it and makes nothing. Returns what
    ensure_test_sets returns for ``root``."""
    import fcntl

    from studies.attention import scoring

    base = tmp_path_factory.getbasetemp()
    made = (base.parent if _xdist_worker() else base) / "shapes-test-sets"  # the workers' common folder
    made.mkdir(exist_ok=True)

    def shapes(args: list[str]) -> None:  # `captioner shapes` in this process: no torch imported again
        from captioner.cli.main import main

        assert main(args) == 0

    def ensure(seeds: list[int], n_images: int, root: Path) -> dict[str, Path]:
        with open(made / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            sets = scoring.ensure_test_sets(seeds, n_images, made, make=shapes)
        for folder in sets.values():
            shutil.copytree(folder, root / folder.name, dirs_exist_ok=True)
        return scoring.ensure_test_sets(seeds, n_images, root)

    return ensure


@pytest.fixture(params=[True, False], ids=["kernels", "plain"])
def kernels_switch(request) -> bool:
    """Runs a test with captioner.kernels' fast forms on, then with them off (the plain torch
    forms); the switch is put back afterwards. The test gets the setting."""
    from captioner.model import kernels

    before = kernels.set_enabled(request.param)
    yield request.param
    kernels.set_enabled(before)


@pytest.fixture
def kernels_on():
    """For a test of a fast form itself: the kernels on, whatever the environment says."""
    from captioner.model import kernels

    before = kernels.set_enabled(True)
    yield
    kernels.set_enabled(before)
