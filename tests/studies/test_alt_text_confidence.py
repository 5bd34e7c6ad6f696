"""The study behind --min-confidence: what counts as a right caption, the three confidences,
and the table's two shares."""

import math
from types import SimpleNamespace

import pytest

from captioner.evaluation.grounding import ShapeObject
from studies.alt_text_confidence import Scored, at_threshold, by_held_back, confidences, is_right, report

RED_CIRCLE = ShapeObject("circle", "red", "large", (0.0, 0.0, 10.0, 10.0))
BLUE_SQUARE = ShapeObject("square", "blue", "small", (50.0, 50.0, 10.0, 10.0))


def test_a_caption_is_right_when_it_names_every_object_rightly_and_its_relations_stand():
    both = [RED_CIRCLE, BLUE_SQUARE]
    assert is_right("a large red circle and a blue square".split(), both)
    assert is_right("a red circle above a blue square".split(), both)
    assert not is_right("a red circle below a blue square".split(), both)  # the relation does not stand
    assert not is_right("a small red circle and a blue square".split(), both)  # a wrong size
    assert not is_right("a red circle".split(), both)  # an object left out
    assert not is_right("a green circle and a blue square".split(), both)


def test_the_three_confidences_come_from_the_word_and_end_probabilities():
    result = SimpleNamespace(word_probs=(0.5, 0.8), end_prob=0.25, score=math.log(0.5 * 0.8 * 0.25))
    got = confidences(result)
    assert got["sequence_p"] == pytest.approx(0.1)
    assert got["mean_word_p"] == pytest.approx(0.1 ** (1 / 3))
    assert got["min_word_p"] == 0.25


def _scored(right: list[float], wrong: list[float]) -> list[Scored]:
    return [Scored(True, p, p, p) for p in right] + [Scored(False, p, p, p) for p in wrong]


def test_a_threshold_stops_the_wrong_captions_below_it_and_holds_back_the_right_ones_below_it():
    scored = _scored(right=[0.2, 0.3, 0.4, 0.5], wrong=[0.1, 0.25, 0.6])
    assert at_threshold(scored, 0.3) == (pytest.approx(2 / 3), 0.25)
    assert at_threshold(scored, 0.1) == (0.0, 0.0)  # below, not at
    flagged = [*scored, Scored(True, 0.9, 0.9, 0.9, unfamiliar=True), Scored(False, 0.9, 0.9, 0.9, unfamiliar=True)]
    assert at_threshold(flagged, 0.3) == (pytest.approx(2 / 4), pytest.approx(1 / 5))
    assert at_threshold(flagged, 0.3, unfamiliar=True) == (pytest.approx(3 / 4), pytest.approx(2 / 5))


def test_the_held_back_rows_put_the_threshold_at_the_right_captions_quantile():
    scored = _scored(right=[i / 100 for i in range(1, 101)], wrong=[0.005, 0.03, 0.5])
    rows = by_held_back(scored, "sequence_p")
    share, threshold, stopped = rows[2]  # 5% of the right ones held back
    assert share == pytest.approx(0.05) and threshold == pytest.approx(0.0595)
    assert stopped == pytest.approx(2 / 3)


def test_the_report_has_a_row_per_share_and_per_threshold():
    text = report("m", _scored(right=[i / 100 for i in range(1, 101)], wrong=[0.005, 0.5]))
    assert text.startswith("### m: 102 images, 2 captions wrong (2.0%), 0 flagged unfamiliar")
    assert "| 0.01 | 50% | 0.0% | 50% | 0.0% |" in text
