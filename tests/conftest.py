"""Shared fixtures: a tiny COCO-format data set on disk, its Karpathy split file, and the
kernels' switch set one way or the other."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from captioner import kernels

# split -> [(image_id, file_name, (width, height), rgb colour, captions)]. Image ids are
# unique across splits, as in COCO. "zebra" appears only in a validation caption and
# "giraffe" only in a test caption, so tests can check that neither leaks into the
# training vocabulary.
TINY_COCO: dict[str, list[tuple[int, str, tuple[int, int], tuple[int, int, int], list[str]]]] = {
    "train": [
        (101, "train_101.png", (20, 16), (255, 0, 0), ["A red square on a table.", "a red box", "red square"]),
        (102, "train_102.png", (18, 16), (0, 255, 0), ["A green circle.", "a green ball on grass"]),
        (103, "train_103.png", (16, 20), (0, 0, 255), ["a blue square", "the blue box is small", "blue"]),
        (104, "train_104.png", (16, 16), (255, 255, 0), ["A yellow star in the sky.", "a yellow star"]),
        (105, "train_105.png", (24, 16), (255, 0, 255), ["a purple circle", "purple ball on a table"]),
        (106, "train_106.png", (16, 24), (0, 255, 255), ["a cyan square and a red circle", "two shapes"]),
    ],
    "val": [
        (201, "val_201.png", (16, 16), (128, 0, 0), ["a zebra on a table", "a dark red square"]),
        (202, "val_202.png", (16, 16), (0, 128, 0), ["a dark green circle", "a green ball", "green"]),
    ],
    "test": [
        (301, "test_301.png", (16, 16), (0, 0, 128), ["a giraffe and a dark blue square", "a blue box"]),
        (302, "test_302.png", (16, 16), (128, 128, 128), ["a grey circle", "a grey ball on a table"]),
    ],
}


def write_tiny_coco(root: Path) -> Path:
    """Write TINY_COCO under ``root`` as images/ + captions_<split>.json; return ``root``."""
    (root / "images").mkdir(parents=True, exist_ok=True)
    ann_id = 1
    for split, entries in TINY_COCO.items():
        images, annotations = [], []
        for image_id, file_name, (w, h), colour, captions in entries:
            Image.new("RGB", (w, h), colour).save(root / "images" / file_name)
            images.append({"id": image_id, "file_name": file_name, "width": w, "height": h})
            for caption in captions:
                annotations.append({"id": ann_id, "image_id": image_id, "caption": caption})
                ann_id += 1
        data = {"info": {"description": f"tiny test set, {split}"}, "licenses": [],
                "images": images, "annotations": annotations}
        (root / f"captions_{split}.json").write_text(json.dumps(data), encoding="utf-8")
    return root


@pytest.fixture
def tiny_coco(tmp_path: Path) -> Path:
    """A folder with captions_{train,val,test}.json (6/2/2 images, 2-3 captions each) and images/."""
    return write_tiny_coco(tmp_path / "tiny_coco")


@pytest.fixture
def tiny_karpathy(tiny_coco: Path) -> Path:
    """A Karpathy-style ``dataset_coco.json`` over the tiny_coco images; returns the file's path.

    Splits: the first four COCO-train images are "train", the other two "restval";
    val and test as in tiny_coco. Image paths are ``<its folder>/<filepath>/<filename>``.
    """
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


@pytest.fixture(params=[True, False], ids=["kernels", "plain"])
def kernels_switch(request) -> bool:
    """Runs a test with captioner.kernels' fast forms on, then with them off (the plain torch
    forms); the switch is put back afterwards. The test gets the setting."""
    before = kernels.set_enabled(request.param)
    yield request.param
    kernels.set_enabled(before)


@pytest.fixture
def kernels_on():
    """For a test of a fast form itself: the kernels on, whatever the environment says."""
    before = kernels.set_enabled(True)
    yield
    kernels.set_enabled(before)
