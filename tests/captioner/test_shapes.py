"""The synthetic shapes dataset: determinism, and annotations that match the pixels."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from captioner.data.shapes import COLORS, SHAPES, SIZES, generate_dataset
from captioner.data.vocab import tokenize
from captioner.evaluation.grounding import load_shape_objects, parse_mentions

COUNTS = {"train": 24, "val": 6}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shapes")
    generate_dataset(out, COUNTS, seed=3)
    return out


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _load(dataset: Path, kind: str, split: str) -> dict:
    return json.loads((dataset / f"{kind}_{split}.json").read_text())


def test_same_seed_gives_identical_files(dataset: Path, tmp_path: Path) -> None:
    summary = generate_dataset(tmp_path, COUNTS, seed=3)
    assert summary["splits"]["train"]["images"] == 24
    assert _files(tmp_path) == _files(dataset)


def test_different_seed_or_split_differs(dataset: Path, tmp_path: Path) -> None:
    generate_dataset(tmp_path, {"train": 6}, seed=4)
    a = np.asarray(Image.open(dataset / "images/train/train_000000.png"))
    b = np.asarray(Image.open(tmp_path / "images/train/train_000000.png"))
    assert not np.array_equal(a, b)
    first = [a["caption"] for a in _load(dataset, "captions", "train")["annotations"] if a["image_id"] <= 6]
    other = [a["caption"] for a in _load(tmp_path, "captions", "train")["annotations"]]
    assert first != other
    # Splits draw from separate streams: val image 0 is not train image 0.
    v = np.asarray(Image.open(dataset / "images/val/val_000000.png"))
    assert not np.array_equal(a, v)


def test_larger_count_extends_smaller(dataset: Path, tmp_path: Path) -> None:
    generate_dataset(tmp_path, {"train": 3}, seed=3)
    for i in range(3):
        name = f"images/train/train_{i:06d}.png"
        assert (tmp_path / name).read_bytes() == (dataset / name).read_bytes()


@pytest.mark.parametrize("split", list(COUNTS))
def test_coco_structure(dataset: Path, split: str) -> None:
    caps, inst = _load(dataset, "captions", split), _load(dataset, "instances", split)
    assert caps["images"] == inst["images"]
    assert len(caps["images"]) == COUNTS[split]
    assert len({img["id"] for img in caps["images"]}) == COUNTS[split]
    for img in caps["images"]:
        assert img["file_name"].startswith(f"{split}/")
        assert (dataset / "images" / img["file_name"]).is_file()
        assert (img["width"], img["height"]) == (128, 128)
    per_image = Counter(a["image_id"] for a in caps["annotations"])
    assert set(per_image.values()) == {5}
    assert len({a["id"] for a in caps["annotations"]}) == len(caps["annotations"])
    assert [c["name"] for c in inst["categories"]] == list(SHAPES)
    objects = Counter(a["image_id"] for a in inst["annotations"])
    assert set(objects) == {img["id"] for img in inst["images"]}
    assert set(objects.values()) <= {1, 2, 3}
    for a in inst["annotations"]:
        assert a["iscrowd"] == 0 and a["attributes"]["color"] in COLORS and a["attributes"]["size"] in SIZES


def test_boxes_inside_and_disjoint(dataset: Path) -> None:
    for split in COUNTS:
        for image in load_shape_objects(dataset / f"instances_{split}.json").values():
            boxes = [o.bbox for o in image.objects]
            for x, y, w, h in boxes:
                assert x >= 0 and y >= 0 and x + w <= image.width and y + h <= image.height
            for i, (ax, ay, aw, ah) in enumerate(boxes):
                for bx, by, bw, bh in boxes[i + 1:]:
                    assert ax + aw < bx or bx + bw < ax or ay + ah < by or by + bh < ay


def test_object_sizes_follow_size_word(dataset: Path) -> None:
    for image in load_shape_objects(dataset / "instances_train.json").values():
        for o in image.objects:
            extent = max(o.bbox[2], o.bbox[3])
            assert (16 <= extent <= 27) if o.size == "small" else (32 <= extent <= 47)


def test_every_caption_mentions_every_object(dataset: Path) -> None:
    objects = load_shape_objects(dataset / "instances_train.json")
    caps = _load(dataset, "captions", "train")
    for ann in caps["annotations"]:
        image = objects[ann["image_id"]]
        words = tokenize(ann["caption"])
        mentions = parse_mentions(words)
        assert Counter((m.color, m.shape) for m in mentions) == \
            Counter((o.color, o.shape) for o in image.objects), ann["caption"]
        # Colour and shape words occur only inside mentions, and sizes given are right.
        used = {i for m in mentions for i in (m.shape_index, m.color_index, m.size_index) if i is not None}
        assert all(i in used for i, w in enumerate(words) if w in COLORS or w in SHAPES or w in SIZES)
        for m in mentions:
            if m.size is not None:
                assert any((o.color, o.shape, o.size) == (m.color, m.shape, m.size) for o in image.objects)


def test_relations_and_order_are_true(dataset: Path) -> None:
    objects = load_shape_objects(dataset / "instances_train.json")
    for ann in _load(dataset, "captions", "train")["annotations"]:
        image = objects[ann["image_id"]]
        words = tokenize(ann["caption"])
        centre = {(o.color, o.shape): (o.bbox[0] + o.bbox[2] / 2, o.bbox[1] + o.bbox[3] / 2)
                  for o in image.objects}
        named = [centre[(m.color, m.shape)] for m in parse_mentions(words)]
        if "above" in words:
            assert named[0][1] < named[1][1]
        elif "below" in words:
            assert named[0][1] > named[1][1]
        elif " to the right of " in ann["caption"]:
            assert named[0][0] > named[1][0]
        else:  # every other template lists objects left to right
            assert [c[0] for c in named] == sorted(c[0] for c in named), ann["caption"]


def test_pixels_match_boxes(dataset: Path) -> None:
    for image in load_shape_objects(dataset / "instances_val.json").values():
        pixels = np.asarray(Image.open(dataset / "images" / image.file_name).convert("RGB")).astype(int)
        covered = np.zeros(pixels.shape[:2], dtype=bool)
        for o in image.objects:
            x, y, w, h = (int(v) for v in o.bbox)
            crop = pixels[y:y + h, x:x + w]
            near = np.abs(crop - np.array(COLORS[o.color])).max(axis=-1) <= 20
            # Every shape fills a good part of its box, and touches all four box edges.
            assert near.mean() > 0.25, (image.file_name, o)
            assert near[0].any() and near[-1].any() and near[:, 0].any() and near[:, -1].any()
            covered[y:y + h, x:x + w] = True
        # Outside the boxes there is only dark background.
        assert pixels[~covered].max() < 100


# ------------------------------------------------------------------------------ Chinese

@pytest.fixture(scope="module")
def chinese(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shapes-zh")
    generate_dataset(out, COUNTS, seed=3, language="zh", top_to_bottom=True)
    return out


def test_chinese_shapes_are_the_same_images_and_objects_with_chinese_captions(dataset: Path, chinese: Path) -> None:
    files, zh = _files(dataset), _files(chinese)
    assert {k: v for k, v in files.items() if k.startswith("images")} == \
        {k: v for k, v in zh.items() if k.startswith("images")}
    assert _load(dataset, "instances", "train")["annotations"] == _load(chinese, "instances", "train")["annotations"]
    caps = _load(chinese, "captions", "train")
    assert caps["info"]["tokenizer"] == "chars2" and caps["info"]["description"].startswith("synthetic shapes")
    texts = [a["caption"] for a in caps["annotations"]]
    assert all(not any(c.isascii() and c.isalpha() for c in t) for t in texts)
    assert len(texts) == 5 * COUNTS["train"]
    assert len(set(texts)) > 0.8 * len(texts)  # several phrasings, as the English ones have
    assert any("的大" in t for t in texts) and any("从左到右" in t for t in texts)


def test_every_chinese_caption_parses_to_its_objects_and_true_relations(chinese: Path) -> None:
    from captioner.data.shapes import english_words
    from captioner.data.vocab import tokenizer_named
    from captioner.evaluation.grounding import object_accuracy, relation_accuracy

    chars = tokenizer_named("chars2")  # the data set's: its punctuation marks stay tokens
    objects = load_shape_objects(chinese / "instances_train.json")
    relations = 0
    for ann in _load(chinese, "captions", "train")["annotations"]:
        image = objects[ann["image_id"]]
        words, steps = english_words(chars.tokenize(ann["caption"]))
        accuracy = object_accuracy(words, image.objects)
        assert accuracy.exact_color_shape and accuracy.exact_full, ann["caption"]
        stated = relation_accuracy(words, image.objects)
        assert stated.relations_true == stated.n_relations_named == stated.n_relations, ann["caption"]
        relations += stated.n_relations
        assert steps == sorted(steps)  # each English word at the step of its first character
    assert relations > 10


def test_english_words_keep_each_words_first_character_step() -> None:
    from captioner.data.shapes import english_words

    words, steps = english_words(list("一个红色的大圆形在一个蓝色的三角形的左边"))
    assert words == ["一", "个", "red", "large", "circle", "在", "一", "个", "blue", "triangle", "left"]
    assert steps == [0, 1, 2, 5, 6, 8, 9, 10, 11, 14, 18]
    assert english_words(["a", "red", "circle"]) == (["a", "red", "circle"], [0, 1, 2])


def test_shapes_command_writes_chinese_captions_that_name_their_tokenizer(tmp_path: Path) -> None:
    from captioner.cli.main import main as captioner_main
    from captioner.data.coco import dataset_tokenizer

    assert captioner_main(["shapes", "--out", str(tmp_path), "--train", "2", "--val", "0", "--test", "1",
                           "--language", "zh"]) == 0
    assert dataset_tokenizer(tmp_path) == "chars2" and dataset_tokenizer(tmp_path, split="test") == "chars2"
    assert "形" in _load(tmp_path, "captions", "test")["annotations"][0]["caption"]
