"""The photo fixture in the published layouts: COCO 2014, Karpathy's split files, Flickr8k."""

from __future__ import annotations

import json
from pathlib import Path

from captioner.data.coco import load_split


def test_official_layout_and_karpathy_split_agree(photos: Path) -> None:
    coco = photos / "coco"
    val2014 = {r.image_id: r for r in load_split(coco, "val2014")}
    train2014 = load_split(coco, "train2014")
    assert len(train2014) == 7 and len(val2014) == 5
    assert all(r.path.is_file() and r.path.parent.name == "train2014" for r in train2014)
    karpathy = coco / "dataset_coco.json"
    train = load_split(coco, "train", karpathy)
    test = load_split(coco, "test", karpathy)
    assert {r.image_id for r in train} == {r.image_id for r in train2014} | {73}  # restval folded in
    assert [r.image_id for r in test] == [136, 139]
    for r in test:  # same file and captions as the official val2014 annotations
        assert r.path == val2014[r.image_id].path and r.path.is_file()
        assert r.captions == val2014[r.image_id].captions


def test_flickr8k_split_file(photos: Path) -> None:
    folder = photos / "flickr8k" / "Flicker8k_Dataset"
    split_file = photos / "flickr8k" / "dataset_flickr8k.json"
    sizes = {s: len(load_split(folder, s, split_file)) for s in ("train", "val", "test")}
    assert sizes == {"train": 5, "val": 1, "test": 2}
    assert all(r.path.is_file() for r in load_split(folder, "train", split_file))


def test_captions_are_written_as_coco_writes_them(photos: Path) -> None:
    # The fixture is only useful if it has COCO's untidiness.
    anns = json.loads((photos / "coco" / "annotations" / "captions_train2014.json").read_text())
    captions = [a["caption"] for a in anns["annotations"]]
    assert set(anns) == {"info", "licenses", "images", "annotations"}
    assert any(c.endswith("\n") for c in captions) and any("  " in c for c in captions)
    assert any(". " in c.strip() for c in captions) and any("," in c for c in captions)
