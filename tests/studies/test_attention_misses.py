"""Where the maps of words that miss their object look (studies/attention/misses.py)."""

from __future__ import annotations

import numpy as np
import pytest

from captioner.evaluation.grounding import ShapeObject
from studies.attention import cli, misses
from tests.tiny import tiny_captioner

# A 4 x 4 grid over 64 x 64 px (16-px cells, centres at 8, 24, 40, 56).
# The circle's box (x, y 12-32) holds cell (1, 1)'s centre and overlaps cell (0, 0)'s corner.
RED_CIRCLE = ShapeObject("circle", "red", "small", (12.0, 12.0, 20.0, 20.0))
BLUE_SQUARE = ShapeObject("square", "blue", "small", (48.0, 0.0, 16.0, 16.0))  # cell (0, 3)
GREEN_STAR = ShapeObject("star", "green", "small", (48.0, 48.0, 16.0, 16.0))  # cell (3, 3)
OBJECTS = [RED_CIRCLE, BLUE_SQUARE, GREEN_STAR]
WORDS = "a red circle a blue square and a green star".split()


def _maps(peaks: dict[int, tuple[int, int]]) -> np.ndarray:
    maps = np.full((len(WORDS), 4, 4), 1 / 16)
    for t, (r, c) in peaks.items():
        maps[t] = 0.0
        maps[t, r, c] = 1.0
    return maps


def test_each_missing_word_is_told_by_where_its_map_peaks():
    # red (1) on the square, named next; circle (2) on the cell that straddles its box's
    # corner; blue (4) on its square; square (5) on the circle, named before it; green (8)
    # on cell (1, 3), which no box overlaps; star (9) on its star.
    peaks = {1: (0, 3), 2: (0, 0), 4: (0, 3), 5: (1, 1), 8: (1, 3), 9: (3, 3)}
    where = misses.classify(WORDS, _maps(peaks), OBJECTS, (64, 64))
    assert where == ["next", "edge", "hit", "previous", "background", "hit"]


def test_a_map_on_an_object_named_neither_just_before_nor_after_is_other():
    peaks = {1: (3, 3), 2: (1, 1), 4: (0, 3), 5: (0, 3), 8: (3, 3), 9: (3, 3)}
    where = misses.classify(WORDS, _maps(peaks), OBJECTS, (64, 64))
    assert where[:2] == ["other", "hit"]


def test_shares_add_to_one_and_name_every_place():
    shares = misses.shares(["hit", "hit", "edge", "next"])
    assert shares == {"hit": 0.5, "edge": 0.25, "previous": 0.0, "next": 0.25, "other": 0.0, "background": 0.0}
    with pytest.raises(ValueError, match="no scored words"):
        misses.shares([])


def test_the_subcommand_prints_a_row_per_checkpoint(tmp_path, capsys, shapes_test_sets):
    weights = tmp_path / "tiny.pt"
    tiny_captioner(seed=3).save(weights)
    shapes_test_sets([7001], 3, tmp_path / "tests")
    assert cli.main(["misses", str(weights), str(weights), "--data", str(tmp_path / "tests" / "shapes-test7001-3"),
                     "--images", "3"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(f"| {weights} |")]
    assert len(rows) == 2 and rows[0] == rows[1]  # the same model twice: the same figures
    cells = [float(x) for x in rows[0].strip("|").split("|")[1:7]]
    assert sum(cells) == pytest.approx(1.0, abs=0.01)
    with pytest.raises(SystemExit):
        cli.main(["misses", str(weights), "--data", str(tmp_path / "nowhere")])
