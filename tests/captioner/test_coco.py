"""COCO-format loading, Karpathy splits, and the dataset of images that decoding reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from captioner.data.coco import (
    ImageDataset,
    ImageRecord,
    SplitNotFoundError,
    load_records,
    load_split,
)
from captioner.data.images import Preprocess

PRE = Preprocess(size=(8, 8))  # tiny, so image work costs nothing


def expected_split(data_dir: Path, split: str) -> dict[int, tuple[str, list[str]]]:
    """image_id -> (file_name, captions in annotation order), read with plain json."""
    data = json.loads((data_dir / f"captions_{split}.json").read_text(encoding="utf-8"))
    out = {im["id"]: (im["file_name"], []) for im in data["images"]}
    for ann in sorted(data["annotations"], key=lambda a: a["id"]):
        out[ann["image_id"]][1].append(ann["caption"])
    return out


def test_load_split_reads_captions_paths_and_sizes(tiny_coco: Path) -> None:
    for split, count in (("train", 6), ("val", 2), ("test", 2)):
        records = load_split(tiny_coco, split)
        expected = expected_split(tiny_coco, split)
        assert len(records) == count
        assert [r.image_id for r in records] == sorted(expected)
        for r in records:
            file_name, captions = expected[r.image_id]
            assert r.path == tiny_coco / "images" / file_name
            assert r.path.is_file()
            assert r.captions == captions
            with Image.open(r.path) as im:
                assert im.size == (r.width, r.height)


def test_load_records_prints_nothing(tiny_coco: Path, capsys: pytest.CaptureFixture[str]) -> None:
    load_records(tiny_coco / "captions_val.json", tiny_coco / "images")
    assert capsys.readouterr().out == ""


def test_official_coco_layout(tiny_coco: Path) -> None:
    # annotations/captions_<split>.json with images under <split>/, as COCO ships it.
    (tiny_coco / "annotations").mkdir()
    (tiny_coco / "captions_val.json").rename(tiny_coco / "annotations" / "captions_val2014.json")
    records = load_split(tiny_coco, "val2014")
    assert [r.image_id for r in records] == [201, 202]
    assert records[0].path == tiny_coco / "val2014" / "val_201.png"


def test_missing_split_lists_available(tiny_coco: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        load_split(tiny_coco, "validation")
    message = str(info.value)
    assert "'validation'" in message
    assert "test, train, val" in message
    with pytest.raises(SplitNotFoundError, match="none"):
        load_split(tiny_coco / "nowhere", "train")


def test_karpathy_split_folds_restval_into_train(tiny_coco: Path, tiny_karpathy: Path) -> None:
    train = load_split(tiny_coco, "train", karpathy=tiny_karpathy)
    restval = load_split(tiny_coco, "restval", karpathy=tiny_karpathy)
    val = load_split(tiny_coco, "val", karpathy=tiny_karpathy)
    test = load_split(tiny_coco, "test", karpathy=tiny_karpathy)

    train_ids = {r.image_id for r in train}
    assert train_ids == {101, 102, 103, 104, 105, 106}  # 4 train + 2 restval
    assert {r.image_id for r in restval} == {105, 106} <= train_ids
    assert {r.image_id for r in val} == {201, 202}
    assert {r.image_id for r in test} == {301, 302}
    assert not train_ids & {r.image_id for r in test + val}

    coco_test = {r.image_id: r for r in load_split(tiny_coco, "test")}
    for r in test:
        # Same files and captions as the COCO-format copy; sizes are not in Karpathy's file.
        assert r.path == coco_test[r.image_id].path and r.path.is_file()
        assert r.captions == coco_test[r.image_id].captions
        assert r.width is None and r.height is None


def test_karpathy_flickr_form(tmp_path: Path) -> None:
    # Flickr8k/30k files: no filepath, no cocoid; ids are imgid, images beside data_dir.
    split_file = tmp_path / "dataset_flickr8k.json"
    split_file.write_text(json.dumps({"images": [
        {"filename": "1.jpg", "imgid": 0, "split": "test", "sentences": [{"raw": "A dog ."}]},
        {"filename": "2.jpg", "imgid": 1, "split": "train", "sentences": [{"raw": "A cat ."}]},
    ]}))
    [record] = load_split(tmp_path / "Flickr8k_Dataset", "test", karpathy=split_file)
    assert record == ImageRecord(0, tmp_path / "Flickr8k_Dataset" / "1.jpg", ["A dog ."], None, None)
    with pytest.raises(FileNotFoundError, match="test, train"):
        load_split(tmp_path, "val", karpathy=split_file)


def test_image_dataset(tiny_coco: Path) -> None:
    records = load_split(tiny_coco, "test")
    ds = ImageDataset(records, PRE)
    assert len(ds) == 2
    images, indices = next(iter(DataLoader(ds, batch_size=2)))
    assert images.shape == (2, 3, 8, 8)
    assert indices.tolist() == [0, 1]
    # Different images give different tensors (each tiny image has its own colour).
    assert not torch.equal(images[0], images[1])
