"""The training data read once into a DataSet: each annotation file and the config parsed once at
start-up, the tokenizer and the name taken from what the files say, the optional test split."""

from __future__ import annotations

import builtins
import json
from collections import Counter
from pathlib import Path

import pytest

from captioner.cli.main import main as captioner_main
from captioner.data.coco import SplitNotFoundError, load_splits
from captioner.train.config import to_toml
from captioner.train.data_cli import main as data_main
from captioner.train.datainfo import load_dataset
from tests.builders import coco_config, tiny_train_config


@pytest.fixture
def opened(monkeypatch) -> Counter:
    """File name -> how many times it was opened from here on (pycocotools, json and tomllib
    readers all open through ``open``)."""
    counts: Counter = Counter()
    real = builtins.open

    def counting(file, *args, **kwargs):
        if isinstance(file, (str, Path)):
            counts[Path(file).name] += 1
        return real(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting)
    return counts


def test_training_reads_each_annotation_file_and_its_config_once(tiny_coco, tmp_path, opened, capsys):
    cfg = tiny_train_config(tiny_coco, **{"optim.max_steps": 1, "val.every_epochs": 0, "hard.entropy": 0.01})
    (tmp_path / "base.toml").write_text(to_toml(cfg))
    (tmp_path / "top.toml").write_text('base = "base.toml"\n[optim]\nmax_steps = 1\n')
    opened.clear()
    assert captioner_main(["train", "--config", str(tmp_path / "top.toml"), "--run-dir", str(tmp_path / "run"),
                           "--quiet"]) == 0
    assert opened["top.toml"] == 1 and opened["base.toml"] == 1
    assert opened["captions_train.json"] == 1 and opened["captions_val.json"] == 1
    assert opened["captions_test.json"] == 0
    # Read once, the file's own keys are still told from its base's: ignored in a base, a note ...
    assert "note: ignored, REINFORCE is for hard attention" in capsys.readouterr().err

    # ... and in the file itself, a refusal.
    (tmp_path / "top.toml").write_text('base = "base.toml"\n[hard]\nentropy = 0.02\n')
    assert captioner_main(["train", "--config", str(tmp_path / "top.toml"), "--run-dir", str(tmp_path / "run2"),
                           "--quiet"]) == 2
    assert "hard.entropy (from the config file) has no effect" in capsys.readouterr().err


def test_data_check_reads_a_karpathy_split_file_once_for_all_three_splits(tmp_path, photos, opened, capsys):
    config = coco_config(tmp_path, photos)
    opened.clear()
    assert data_main(["check", "--config", str(config), "--workers", "0", "--quiet"]) == 0
    assert opened["dataset_coco.json"] == 1
    assert "test: 2 images" in capsys.readouterr().out


def _captions_file(path: Path, info: dict, captions: list[str], pad: int = 0) -> None:
    """A COCO captions file of one image; ``pad``: that many more captions, to push ``info``
    (written last) far from the file's start."""
    anns = [{"id": i, "image_id": 1, "caption": c} for i, c in enumerate(captions + ["a filler caption"] * pad)]
    path.write_text(json.dumps({"images": [{"id": 1, "file_name": "a.png", "width": 4, "height": 4}],
                                "annotations": anns, "info": info}, ensure_ascii=False))


def test_the_tokenizer_and_the_title_come_from_the_first_split_s_captions_file(tmp_path):
    _captions_file(tmp_path / "captions_train.json", {"tokenizer": "chars2", "description": " 我的照片 "},
                   ["一只猫"], pad=5000)  # over 64 KB: the info far from both ends of the file
    _captions_file(tmp_path / "captions_val.json", {"tokenizer": "whitespace", "description": "other"}, ["x"])
    found = load_splits(tmp_path, ["train", "val"])
    assert (found.tokenizer, found.title, found.split_file) == ("chars2", "我的照片", None)
    assert [r.captions[0] for r in found.records["train"]] == ["一只猫"] and len(found.records["val"]) == 1
    assert load_splits(tmp_path, ["val", "train"]).tokenizer == "whitespace"

    data = load_dataset(tiny_train_config(tmp_path).data)
    assert (data.tokenizer, data.name, data.split_file) == ("chars2", "我的照片, split train", None)


def test_a_file_that_names_nothing_is_ptb_and_named_by_its_folder(tmp_path):
    for split in ("train", "val"):
        _captions_file(tmp_path / f"captions_{split}.json", {"tokenizer": 7, "description": ["no"]}, ["a cat"])
    found = load_splits(tmp_path, ["train", "val"])
    assert (found.tokenizer, found.title) == ("ptb", "")
    assert load_dataset(tiny_train_config(tmp_path).data).name == f"{tmp_path.name}, split train"


def _split_file(path: Path, **top: object) -> None:
    images = [{"filename": f"{i}.jpg", "imgid": i, "split": split, "sentences": [{"raw": "a dog"}]}
              for i, split in enumerate(["train", "train", "val"])]
    path.write_text(json.dumps({**top, "images": images}))


def test_a_split_file_gives_its_tokenizer_and_dataset_and_an_optional_split_only_when_it_has_it(tmp_path):
    _split_file(tmp_path / "dataset_flickr8k.json", dataset="flickr8k", tokenizer="whitespace")
    found = load_splits(tmp_path, ["train", "val"], tmp_path / "dataset_flickr8k.json", optional=["test", "val"])
    assert (found.tokenizer, found.title, found.split_file) == ("whitespace", "flickr8k",
                                                                tmp_path / "dataset_flickr8k.json")
    assert list(found.records) == ["train", "val"] and len(found.records["train"]) == 2  # no test split: left out
    with pytest.raises(SplitNotFoundError, match="'test'"):  # a split asked for, not optional, must be there
        load_splits(tmp_path, ["train", "test"], tmp_path / "dataset_flickr8k.json")

    cfg = tiny_train_config(tmp_path, **{"data.karpathy": "dataset_flickr8k.json"})
    assert list(load_dataset(cfg.data, test=True).splits) == ["train", "val"]
    assert load_dataset(cfg.data).name == "Flickr8k"


def test_a_folder_holding_only_an_imported_dataset_json_is_named_own_data(tmp_path):
    _split_file(tmp_path / "dataset.json", dataset="holiday photos", tokenizer="ptb")
    data = load_dataset(tiny_train_config(tmp_path).data)  # data.karpathy not set: dataset.json found
    assert data.split_file == tmp_path / "dataset.json"
    assert data.name == "holiday photos (own data)"
    assert load_dataset(tiny_train_config(tmp_path, **{"data.karpathy": "dataset.json"}).data).name == data.name


def test_the_test_split_is_read_only_for_data_check_and_only_from_a_split_file(tiny_coco, tiny_karpathy):
    coco_layout = tiny_train_config(tiny_coco).data  # captions_test.json is there, but not asked for
    assert list(load_dataset(coco_layout).splits) == list(load_dataset(coco_layout, test=True).splits) == ["train",
                                                                                                          "val"]
    karpathy = tiny_train_config(tiny_coco, **{"data.karpathy": str(tiny_karpathy)}).data
    assert list(load_dataset(karpathy).splits) == ["train", "val"]
    assert [r.image_id for r in load_dataset(karpathy, test=True).splits["test"]] == [301, 302]


def test_generated_shapes_are_named_synthetic_shapes_by_their_captions_file(tmp_path):
    for split in ("train", "val"):
        _captions_file(tmp_path / f"captions_{split}.json", {"description": "synthetic shapes, seed 3"}, ["a cat"])
    assert load_dataset(tiny_train_config(tmp_path).data).name == "synthetic shapes"
