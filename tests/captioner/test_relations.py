"""Relation direction accuracy: spatial relations stated in a caption, checked against the
boxes, over the relations whose two objects are named right."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from captioner.data.shapes import generate_split
from captioner.data.vocab import tokenize
from captioner.evaluation.grounding import (
    ImageObjects,
    RelationAccuracy,
    ShapeObject,
    evaluate_caption,
    load_shape_objects,
    parse_relations,
    relation_accuracy,
    summarize_grounding,
)

# Centres: circle (16, 16) top-left, square (48, 48) bottom-right, star (50, 10) top-right.
RED_CIRCLE = ShapeObject("circle", "red", "small", (0, 0, 32, 32))
BLUE_SQUARE = ShapeObject("square", "blue", "large", (32, 32, 32, 32))
RED_STAR = ShapeObject("star", "red", "large", (40, 0, 20, 20))
OBJECTS = [RED_CIRCLE, BLUE_SQUARE, RED_STAR]


@pytest.mark.parametrize("caption,stated,named,true", [
    ("a red circle above a blue square", 1, 1, 1),
    ("a blue square above a red circle", 1, 1, 0),
    ("a blue square below a red circle", 1, 1, 1),
    ("a red circle below a blue square", 1, 1, 0),
    ("a red circle to the left of a red star", 1, 1, 1),
    ("a red star to the left of a red circle", 1, 1, 0),
    ("a red star to the right of a red circle", 1, 1, 1),
    ("an image with a red circle on the left of a blue square", 1, 1, 1),
    ("from left to right: a red circle, a blue square and a red star", 2, 2, 2),
    ("from left to right: a red star and a red circle", 1, 1, 0),
    ("from left to right: a red circle, a red star and a blue square", 2, 2, 1),
    ("from top to bottom: a red star, a red circle and a blue square", 2, 2, 2),
    ("from top to bottom: a blue square and a red circle", 1, 1, 0),
    ("a green circle above a blue square", 1, 0, 0),  # names no object: not true
    ("a large red circle above a blue square", 1, 0, 0),  # the circle is small
    ("a small red circle above a large blue square", 1, 1, 1),
    ("a red circle and a blue square", 0, 0, 0),
    ("two objects: a red circle and a blue square", 0, 0, 0),
    ("a red star above", 0, 0, 0),
])
def test_relations_stated_named_and_true(caption: str, stated: int, named: int, true: int) -> None:
    assert relation_accuracy(tokenize(caption), OBJECTS) == RelationAccuracy(stated, named, true)


def test_relations_are_normalised_to_left_of_and_above() -> None:
    (below,) = parse_relations(tokenize("a blue square below a red circle"))
    assert (below.first.shape, below.relation, below.second.shape) == ("circle", "above", "square")
    (right,) = parse_relations(tokenize("a red star to the right of a red circle"))
    assert (right.first.shape, right.relation, right.second.shape) == ("circle", "left_of", "star")


def test_two_objects_of_one_kind_need_distinct_objects() -> None:
    left = ShapeObject("star", "red", "small", (0, 0, 10, 10))
    right = ShapeObject("star", "red", "small", (50, 0, 10, 10))
    words = tokenize("a red star to the left of a red star")
    assert relation_accuracy(words, [left, right]) == RelationAccuracy(1, n_relations_named=1, relations_true=1)
    assert relation_accuracy(words, [left]) == RelationAccuracy(1, n_relations_named=0, relations_true=0)


def test_summary_micro_averages_relations_with_chance_and_count() -> None:
    image = ImageObjects(1, "x.png", 64, 64, OBJECTS)
    captions = ["a red circle above a blue square",  # 1 of 1
                "from left to right: a red circle, a red star and a blue square",  # 1 of 2
                "a green circle above a blue square",  # misnamed: not a direction error
                "a large red circle above a blue square",  # misnamed (the circle is small)
                "a red circle and a blue square"]  # none stated
    per_image = [evaluate_caption(words, np.full((len(words), 2, 2), 0.25), image)
                 for words in map(tokenize, captions)]
    summary = summarize_grounding([p for p, _ in per_image], [a for _, a in per_image])
    assert summary.n_relations == 5
    assert summary.n_relations_misnamed == 2
    assert summary.relation_accuracy == pytest.approx(2 / 3)  # directions of the 3 rightly named
    assert summary.relation_chance == 0.5
    assert summarize_grounding([], []).relation_accuracy is None
    only_misnamed = evaluate_caption(tokenize(captions[2]), np.full((7, 2, 2), 0.25), image)
    assert summarize_grounding([only_misnamed[0]], [only_misnamed[1]]).relation_accuracy is None


def test_a_random_direction_between_named_objects_scores_one_half() -> None:
    """Chance is 0.5 over rightly named pairs: a caption stating each pair of two objects
    in a random direction, over many random layouts, is right about half the time, while
    misnamed relations never enter the figure."""
    rng = np.random.default_rng(0)
    per_image = []
    for _ in range(400):
        a = ShapeObject("circle", "red", "small", (*rng.uniform(0, 50, 2), 8, 8))
        b = ShapeObject("square", "blue", "small", (*rng.uniform(0, 50, 2), 8, 8))
        word = rng.choice(["above", "below"])
        stated = f"a red circle {word} a blue square and a green star {word} a red circle"
        per_image.append(evaluate_caption(tokenize(stated), np.full((20, 2, 2), 0.25),
                                          ImageObjects(1, "x.png", 64, 64, [a, b]))[1])
    summary = summarize_grounding([[]] * len(per_image), per_image)
    assert summary.n_relations_misnamed == 400  # "a green star" names nothing
    assert 0.43 < summary.relation_accuracy < 0.57


def test_generated_reference_captions_state_only_true_relations(tmp_path: Path) -> None:
    """Every relation in the generator's own captions is true of its own boxes, and
    the same captions scored against another image's objects are not all true."""
    generate_split(tmp_path, "val", 40, seed=3, image_size=64)
    objects = load_shape_objects(tmp_path / "instances_val.json")
    captions = json.loads((tmp_path / "captions_val.json").read_text())["annotations"]
    own = [relation_accuracy(tokenize(c["caption"]), objects[c["image_id"]].objects) for c in captions]
    stated = sum(r.n_relations for r in own)
    assert stated >= 20
    assert sum(r.relations_true for r in own) == stated
    # The same captions with the image's objects mirrored left-right and top-bottom.
    mirrored = {i: [ShapeObject(o.shape, o.color, o.size, (64 - o.bbox[0] - o.bbox[2], 64 - o.bbox[1] - o.bbox[3],
                                                            o.bbox[2], o.bbox[3])) for o in im.objects]
                for i, im in objects.items()}
    flipped = [relation_accuracy(tokenize(c["caption"]), mirrored[c["image_id"]]) for c in captions]
    assert sum(r.relations_true for r in flipped) == 0


def test_generated_top_to_bottom_captions_state_true_vertical_order(tmp_path: Path) -> None:
    """With the option the generator adds "from top to bottom" captions, each naming the
    objects highest first (every relation they state stands); without it, the same images
    and captions as ever."""
    plain, extra = tmp_path / "plain", tmp_path / "extra"
    generate_split(plain, "val", 60, seed=3, image_size=64)
    generate_split(extra, "val", 60, seed=3, image_size=64, top_to_bottom=True)
    assert (plain / "instances_val.json").read_bytes() == (extra / "instances_val.json").read_bytes()
    assert (plain / "images/val/val_000007.png").read_bytes() == (extra / "images/val/val_000007.png").read_bytes()
    objects = load_shape_objects(extra / "instances_val.json")
    downward = [c for c in json.loads((extra / "captions_val.json").read_text())["annotations"]
                if c["caption"].startswith("from top to bottom: ")]
    assert len(downward) >= 10
    scored = [relation_accuracy(tokenize(c["caption"]), objects[c["image_id"]].objects) for c in downward]
    assert all(r.n_relations == len(objects[c["image_id"]].objects) - 1 for r, c in zip(scored, downward))
    assert sum(r.relations_true for r in scored) == sum(r.n_relations for r in scored)
    # Off, the captions are byte for byte those made before the option existed (the
    # comparison's test sets are made this way and must not change).
    digest = hashlib.sha256((plain / "captions_val.json").read_bytes()).hexdigest()
    assert digest == "60ad94594af4dddacfa1a6b69b68c53884f7cb72211ee6bce6bb20634460e5f2"
