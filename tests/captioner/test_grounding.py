"""Grounded measures on tiny hand-checked cases."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from captioner.data.images import Preprocess
from captioner.evaluation.grounding import (
    CaptionAccuracy,
    ImageObjects,
    Mention,
    ShapeObject,
    cells_inside,
    evaluate_caption,
    load_shape_objects,
    object_accuracy,
    parse_mentions,
    pointing_game,
    relation_accuracy,
    summarize_grounding,
)

RED_CIRCLE = ShapeObject("circle", "red", "small", (0, 0, 32, 32))  # top-left quadrant of 64x64
BLUE_SQUARE = ShapeObject("square", "blue", "large", (32, 32, 32, 32))  # bottom-right quadrant
RED_STAR = ShapeObject("star", "red", "large", (40, 0, 20, 20))  # top-right, inside cell (0, 1)


def _peaked(t: int, cells: list[tuple[int, int]], peak: float = 0.7, grid: tuple[int, int] = (2, 2)) -> np.ndarray:
    """(t, H, W) maps, map k with ``peak`` at cells[k] and the rest spread evenly."""
    h, w = grid
    maps = np.full((t, h, w), (1 - peak) / (h * w - 1))
    for k, (r, c) in enumerate(cells):
        maps[k, r, c] = peak
    return maps


# ------------------------------------------------------------------------- parsing

def test_parse_mentions_orders_and_missing_parts() -> None:
    words = "a large red circle and a blue large square near a star".split()
    assert parse_mentions(words) == [
        Mention("circle", "red", "large", shape_index=3, color_index=2, size_index=1),
        Mention("square", "blue", "large", shape_index=8, color_index=6, size_index=7),
        Mention("star", None, None, shape_index=11, color_index=None, size_index=None),
    ]


def test_parse_mentions_ignores_unattached_colours() -> None:
    assert parse_mentions("red and blue things".split()) == []
    assert [m.color for m in parse_mentions("red , circle".split())] == [None]


# ----------------------------------------------------------------- object accuracy

@pytest.mark.parametrize("caption, exact, exact_full, matched", [
    ("a red circle and a blue square", True, True, 2),
    ("a blue square to the right of a small red circle", True, True, 2),
    ("a small red circle and a large blue square", True, True, 2),
    ("a large red circle and a blue square", True, False, 2),  # wrong size
    ("a green circle and a blue square", False, False, 1),  # wrong colour
    ("a red circle", False, False, 1),  # missing object
    ("a red circle , a blue square and a red star", False, False, 2),  # extra object
    ("a red circle and a blue circle", False, False, 1),  # wrong shape
    ("a circle and a blue square", False, False, 1),  # colour not given
])
def test_object_accuracy(caption: str, exact: bool, exact_full: bool, matched: int) -> None:
    acc = object_accuracy(caption.split(), [RED_CIRCLE, BLUE_SQUARE])
    assert (acc.exact_color_shape, acc.exact_full, acc.matched) == (exact, exact_full, matched)
    assert acc.n_objects == 2
    assert acc.recall == matched / 2
    assert acc.precision == matched / acc.n_mentions


def test_object_accuracy_duplicates_are_counted() -> None:
    two_red = [RED_CIRCLE, ShapeObject("circle", "red", "large", (40, 40, 20, 20))]
    assert object_accuracy("a red circle and a red circle".split(), two_red).exact_color_shape
    one = object_accuracy("a red circle".split(), two_red)
    assert not one.exact_color_shape and one.recall == 0.5
    three = object_accuracy("a red circle , a red circle and a red circle".split(), two_red)
    assert not three.exact_color_shape and three.matched == 2
    # Sizes must be assignable one-to-one: both "small" cannot match.
    assert object_accuracy("a small red circle and a large red circle".split(), two_red).exact_full
    assert not object_accuracy("a small red circle and a small red circle".split(), two_red).exact_full
    # A mention without size can take the object a sized mention leaves over.
    assert object_accuracy("a red circle and a small red circle".split(), two_red).exact_full


def _accuracy(words: list[str], objects: list[ShapeObject]) -> CaptionAccuracy:
    return CaptionAccuracy(object_accuracy(words, objects), relation_accuracy(words, objects))


# -------------------------------------------------------------------- pointing game

def test_pointing_hit_mass_and_chance() -> None:
    words = ["a", "red", "circle"]
    maps = _peaked(3, [(1, 1), (0, 0), (0, 0)], peak=0.7)
    records = pointing_game(words, maps, [RED_CIRCLE], (64, 64))
    assert [(r.step, r.word, r.kind, r.hit) for r in records] == [(1, "red", "color", True),
                                                                  (2, "circle", "shape", True)]
    for r in records:
        assert r.mass == pytest.approx(0.7)
        assert r.chance == pytest.approx(0.25)


def test_pointing_miss_when_peak_elsewhere() -> None:
    maps = _peaked(2, [(0, 1), (1, 0)], peak=0.4)
    records = pointing_game(["red", "circle"], torch.tensor(maps), [RED_CIRCLE], (64, 64))
    assert [r.hit for r in records] == [False, False]
    assert [r.mass for r in records] == pytest.approx([0.2, 0.2])


def test_pointing_skips_non_unique_and_absent() -> None:
    objects = [RED_CIRCLE, RED_STAR, BLUE_SQUARE]
    words = "a red circle , a red star and a green square".split()
    maps = _peaked(len(words), [(0, 0)] * len(words))
    records = pointing_game(words, maps, objects, (64, 64))
    # "red" names two objects and "green" none: only the three shape words are scored.
    assert [(r.word, r.hit) for r in records] == [("circle", True), ("star", False), ("square", False)]
    # The star's box holds one cell centre (48, 16) of four.
    assert records[1].chance == pytest.approx(0.25)


def test_pointing_rectangular_grid_and_image() -> None:
    # 4 columns over a 200-px-wide image: centres at x = 25, 75, 125, 175; 1 row over 100 px.
    obj = ShapeObject("cross", "white", "large", (60, 10, 70, 80))
    maps = np.zeros((1, 1, 4))
    maps[0, 0, 2] = 1.0
    (rec,) = pointing_game(["cross"], maps, [obj], (200, 100))
    assert rec.hit and rec.mass == 1.0 and rec.chance == pytest.approx(0.5)


def test_pointing_uses_leading_maps_and_checks_shapes() -> None:
    maps = _peaked(4, [(0, 0)])  # an extra map (e.g. for the end token) is ignored
    assert len(pointing_game(["circle"], maps, [RED_CIRCLE], (64, 64))) == 1
    with pytest.raises(ValueError):
        pointing_game(["red", "circle"], maps[:1], [RED_CIRCLE], (64, 64))
    with pytest.raises(ValueError):
        pointing_game(["circle"], maps[0], [RED_CIRCLE], (64, 64))


# ---------------------------------------------------------------------- summary

def test_summarize_grounding() -> None:
    image = ImageObjects(1, "x.png", 64, 64, [RED_CIRCLE, BLUE_SQUARE])
    good = evaluate_caption("a red circle and a blue square".split(),
                            _peaked(7, [(0, 0), (0, 0), (0, 0), (0, 0), (0, 0), (1, 1), (1, 1)]), image)
    bad = evaluate_caption("a red circle".split(), _peaked(3, [(0, 0), (1, 1), (1, 1)]), image)
    summary = summarize_grounding([good[0], bad[0]], [good[1], bad[1]])
    assert summary.n_images == 2
    assert summary.object_accuracy == 0.5
    assert summary.object_recall == pytest.approx(3 / 4)
    assert summary.object_precision == 1.0
    # Scored words: red, circle, blue, square (all hits); then red, circle (both misses).
    assert summary.n_words == 6
    assert summary.pointing_accuracy == pytest.approx(4 / 6)
    assert summary.pointing_accuracy_color == pytest.approx(2 / 3)
    assert summary.pointing_chance == summary.alpha_mass_chance == pytest.approx(0.25)
    assert summary.alpha_mass_in_box == pytest.approx((4 * 0.7 + 2 * 0.1) / 6)


def test_summarize_empty_gives_none() -> None:
    summary = summarize_grounding([], [])
    assert summary.n_words == 0 and summary.pointing_accuracy is None
    assert summary.object_accuracy is None


def test_load_shape_objects(tmp_path: Path) -> None:
    data = {
        "images": [{"id": 1, "file_name": "t/a.png", "width": 64, "height": 48},
                   {"id": 2, "file_name": "t/b.png", "width": 64, "height": 48}],
        "categories": [{"id": 1, "name": "circle", "supercategory": "shape"},
                       {"id": 4, "name": "star", "supercategory": "shape"}],
        "annotations": [{"id": 1, "image_id": 1, "category_id": 4, "bbox": [1, 2, 3, 4], "area": 12,
                         "iscrowd": 0, "attributes": {"color": "white", "size": "small"}}],
    }
    path = tmp_path / "instances_t.json"
    path.write_text(json.dumps(data))
    images = load_shape_objects(path)
    assert images[1].size == (64, 48) and images[1].file_name == "t/a.png"
    assert images[1].objects == [ShapeObject("star", "white", "small", (1.0, 2.0, 3.0, 4.0))]
    assert images[2].objects == []


def test_pointing_touch_counts_a_cell_straddling_the_edge() -> None:
    # 4x4 grid over 64x64 px (16 px cells, centres at 8, 24, 40, 56); the box x 10-30,
    # y 10-30 holds one cell centre, (1, 1)'s (24, 24), and overlaps cells (0..1, 0..1).
    obj = ShapeObject("circle", "red", "small", (10.0, 10.0, 20.0, 20.0))
    maps = np.zeros((2, 4, 4))
    maps[0, 0, 0] = 1.0  # straddles the box's top-left corner: centre outside, area overlapping
    maps[1, 2, 3] = 1.0  # cell x 48-64, y 32-48: nowhere near
    rec = pointing_game(["red", "circle"], maps, [obj], (64, 64))
    assert [(r.hit, r.hit_touch) for r in rec] == [(False, True), (False, False)]
    assert rec[0].chance == pytest.approx(1 / 16)  # only (1, 1) has its centre inside
    assert rec[0].chance_touch == pytest.approx(4 / 16)  # (0..1, 0..1) overlap the box
    summary = summarize_grounding([rec], [_accuracy(["red", "circle"], [obj])])
    assert summary.pointing_accuracy_touch == pytest.approx(0.5)
    assert summary.pointing_chance_touch == pytest.approx(0.25)


def test_mass_on_touching_cells_and_entropy_of_the_maps_on_the_named_words() -> None:
    # As above: the box x 10-30, y 10-30 holds cell (1, 1)'s centre and overlaps (0..1, 0..1).
    obj = ShapeObject("circle", "red", "small", (10.0, 10.0, 20.0, 20.0))
    maps = np.zeros((3, 4, 4))
    maps[0, 0, 0], maps[0, 1, 1] = 0.6, 0.4  # on the object's edge and on its centre cell
    maps[1, 2, 3] = 1.0  # elsewhere, and sure of it
    maps[2] = 1 / 16  # "a": not a named word, its flat map is not scored
    rec = pointing_game(["red", "circle", "a"], maps, [obj], (64, 64))
    assert [r.mass for r in rec] == pytest.approx([0.4, 0.0])
    assert [r.mass_touch for r in rec] == pytest.approx([1.0, 0.0])
    h = -(0.6 * np.log(0.6) + 0.4 * np.log(0.4))
    assert [r.entropy for r in rec] == pytest.approx([h, 0.0])
    summary = summarize_grounding([rec], [_accuracy(["red", "circle"], [obj])])
    assert summary.alpha_mass_touch == pytest.approx(0.5)
    assert summary.alpha_entropy_named == pytest.approx(h / 2)


# ------------------------------------------------------------------ under a centre crop

# A 128 px image seen through Preprocess(size=(96, 96), resize=144): shorter side to 144 px,
# centre 96 px cropped, i.e. the central 85.3 px of the original (21.3 to 106.7). A 4 x 4 grid
# over the crop has cells of 21.3 px, centres at 32, 53.3, 74.7 and 96; over the whole image
# the centres would be at 16, 48, 80 and 112.
CROP = Preprocess(size=(96, 96), resize=144).crop_box((128, 128))
IN_FIRST_CELL = ShapeObject("circle", "red", "small", (24, 24, 16, 16))  # holds crop cell (0, 0)'s centre only
OUT_OF_VIEW = ShapeObject("star", "blue", "small", (0, 110, 18, 18))  # wholly outside the crop


def test_the_grid_covers_only_the_centre_crop() -> None:
    assert CROP == pytest.approx((128 / 6, 128 / 6, 128 * 5 / 6, 128 * 5 / 6))
    inside = cells_inside(IN_FIRST_CELL.bbox, (4, 4), (128, 128), crop=CROP)
    assert inside.sum() == 1 and inside[0, 0]
    assert cells_inside(IN_FIRST_CELL.bbox, (4, 4), (128, 128)).sum() == 0  # the whole image's grid
    # A box over the crop's middle half holds the four middle cells, not the whole grid's.
    middle = cells_inside((43, 43, 42, 42), (4, 4), (128, 128), crop=CROP)
    assert middle.sum() == 4 and middle[1:3, 1:3].all()


def test_pointing_under_a_crop_scores_the_cell_the_model_saw() -> None:
    maps = np.full((3, 4, 4), 0.2 / 15)
    maps[:, 0, 0] = 0.8  # every word looks at the crop's top-left cell
    (red, circle) = pointing_game(["a", "red", "circle"], maps, [IN_FIRST_CELL], (128, 128), crop=CROP)
    for r in (red, circle):
        assert r.seen and r.hit
        assert r.mass == pytest.approx(0.8) and r.chance == pytest.approx(1 / 16)
    # Mapped onto the whole image, the same map misses a box that holds no cell centre.
    assert not any(r.hit for r in pointing_game(["red", "circle"], maps, [IN_FIRST_CELL], (128, 128)))


def test_a_box_outside_the_crop_is_not_scored_but_counted_apart() -> None:
    maps = np.full((6, 4, 4), 1 / 16)
    words = "a red circle and blue star".split()
    image = ImageObjects(1, "x.png", 128, 128, [IN_FIRST_CELL, OUT_OF_VIEW])
    records, _ = evaluate_caption(words, maps, image, crop=CROP)
    assert [(r.word, r.seen) for r in records] == [("red", True), ("circle", True), ("blue", False), ("star", False)]
    summary = summarize_grounding([records], [evaluate_caption(words, maps, image, crop=CROP)[1]])
    assert summary.n_words == 2 and summary.n_words_unseen == 2
    assert summary.alpha_mass_in_box == pytest.approx(1 / 16)  # the unseen words' zeros are not in it
    whole, _ = evaluate_caption(words, maps, image)  # no crop: every box is in view
    assert all(r.seen for r in whole) and len(whole) == 4


def test_a_chinese_caption_points_with_the_map_of_each_words_first_character() -> None:
    # "红色" is chosen at step 2 (红), "圆形" at 5 (圆), "蓝色" at 10, "正方形" at 13 (正).
    words = list("一个红色的圆形和一个蓝色的正方形")
    cells = [(1, 1)] * len(words)
    cells[2], cells[5] = (0, 0), (0, 0)  # 红, 圆: the red circle's quadrant
    cells[10], cells[13] = (1, 1), (0, 1)  # 蓝: the blue square's; 正: elsewhere
    image = ImageObjects(1, "x.png", 64, 64, [RED_CIRCLE, BLUE_SQUARE])
    records, accuracy = evaluate_caption(words, _peaked(len(words), cells), image)
    assert accuracy.objects.exact_color_shape and accuracy.objects.n_mentions == 2
    assert [(r.word, r.hit) for r in records] == [("red", True), ("circle", True), ("blue", True),
                                                   ("square", False)]
