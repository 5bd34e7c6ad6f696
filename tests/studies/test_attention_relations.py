"""Why a model states a relation wrong (studies/attention/relations.py)."""

from __future__ import annotations

import pytest
import torch

from captioner.data.coco import ImageRecord
from captioner.data.images import Preprocess
from captioner.data.vocab import Vocabulary
from captioner.evaluation.grounding import ShapeObject
from captioner.inference import Captioner
from captioner.model.decoder import CaptionModel
from studies.attention import cli, relations
from tests.tiny import tiny_captioner, tiny_config, tiny_image

# 128 x 128 px. The red circle is up and to the left of the blue square; the green star sits
# level with the circle (centres 4 px apart in y, far apart in x).
RED_CIRCLE = ShapeObject("circle", "red", "small", (10.0, 10.0, 20.0, 20.0))  # centre (20, 20)
BLUE_SQUARE = ShapeObject("square", "blue", "small", (70.0, 80.0, 20.0, 20.0))  # centre (80, 90)
GREEN_STAR = ShapeObject("star", "green", "small", (90.0, 14.0, 20.0, 20.0))  # centre (100, 24)
OBJECTS = [RED_CIRCLE, BLUE_SQUARE, GREEN_STAR]


def outcomes(caption: str) -> list[tuple[str, str]]:
    return relations.outcomes(caption.split(), OBJECTS)


def test_a_relation_that_stands_is_right_on_either_axis():
    assert outcomes("a red circle above a blue square") == [("above", "right")]
    assert outcomes("a blue square to the right of a red circle") == [("left_of", "right")]


def test_a_wrong_relation_whose_order_follows_the_other_axis_is_told_apart():
    # The square is below and right of the circle: naming them left to right and joining
    # them with "below" would be right; "above" keeps the left-to-right order and is wrong.
    assert outcomes("a red circle below a blue square") == [("above", "other-axis order")]
    # Listed top to bottom but said to run right to left: wrong, in the vertical order.
    assert outcomes("a red circle to the right of a blue square") == [("left_of", "other-axis order")]


def test_a_wrong_relation_on_centres_closer_than_the_tie_is_a_tie():
    # The star is 4 px lower than the circle: "the star above the circle" is wrong by 4 px.
    assert outcomes("a green star above a red circle") == [("above", "tie")]
    assert relations.outcomes("a green star above a red circle".split(), OBJECTS, tie_px=2.0) == [
        ("above", "other")]


def test_relations_on_misnamed_objects_are_left_out():
    assert outcomes("a red square above a blue circle") == []
    assert outcomes("a red circle and a blue square") == []


def test_the_table_counts_each_kind_and_each_outcome():
    counts = relations.tally([("above", "right"), ("above", "other-axis order"), ("left_of", "right"),
                              ("left_of", "tie"), ("above", "other")])
    assert counts == {"above": 3, "above right": 1, "left_of": 2, "left_of right": 1, "right": 2,
                      "other-axis order": 1, "tie": 1, "other": 1}


def test_the_subcommand_prints_a_row_per_checkpoint(tmp_path, capsys, shapes_test_sets):
    weights = tmp_path / "tiny.pt"
    tiny_captioner(seed=3).save(weights)
    shapes_test_sets([7001], 3, tmp_path / "tests")
    assert cli.main(["relation", str(weights), str(weights), "--data",
                     str(tmp_path / "tests" / "shapes-test7001-3"), "--images", "3"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(f"| {weights} |")]
    assert len(rows) == 4 and rows[0] == rows[1] and rows[2] == rows[3]  # the same model twice: the same figures
    assert len(rows[0].split("|")) == 10 and len(rows[2].split("|")) == 5  # the outcomes, then the forced choices
    assert "| weights | stated |" in out and "| weights | above/below: right / captions |" in out


def test_the_row_counts_every_test_set_given(tmp_path, capsys, monkeypatch, shapes_test_sets):
    weights = tmp_path / "tiny.pt"
    tiny_captioner(seed=3).save(weights)
    sets = shapes_test_sets([7001, 7002], 3, tmp_path / "tests")  # 2 images of each are counted
    found = {sets["test7001"]: [("above", "right"), ("left_of", "tie")],
             sets["test7002"]: [("above", "other-axis order")]}
    monkeypatch.setattr(relations, "outcomes_of", lambda cap, folder, *a: found[folder])
    monkeypatch.setattr(relations, "forced_choices", lambda cap, records: [("above", True)] * len(records))
    assert cli.main(["relation", str(weights), "--data", str(sets["test7001"]), "--data", str(sets["test7002"]),
                     "--images", "2"]) == 0
    row, forced = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"| {weights} |")]
    assert [c.strip() for c in row.strip("|").split("|")[1:]] == ["3", "0.333", "1 / 2", "0 / 1", "1", "1", "0"]
    assert [c.strip() for c in forced.strip("|").split("|")[1:]] == ["4 / 4", "0 / 0"]  # 2 images of each set


def test_direction_words_are_those_that_set_a_relation():
    assert relations.direction_words("a red circle above a blue square".split()) == [(3, "above")]
    assert relations.direction_words("a star to the right of a circle".split()) == [(4, "left_of")]
    assert relations.direction_words("from left to right a star and a circle".split()) == []
    assert relations.direction_words("a circle on the left".split()) == []  # no "of": no relation


def test_a_forced_choice_is_right_when_the_references_word_outscores_its_opposite(tmp_path):
    """A model that always prefers "above" and "left": right on the references that use them,
    wrong on those with "below" and "right"."""
    words = "a red blue circle square above below to the left right of and".split()
    vocab = Vocabulary.build([" ".join(words)], min_count=1)
    torch.manual_seed(0)
    model = CaptionModel(tiny_config(vocab_size=len(vocab)))
    with torch.no_grad():
        model.decoder.L_o.weight.zero_()
        for w, bias in (("above", 5.0), ("below", -5.0), ("left", 5.0), ("right", -5.0)):
            model.decoder.L_o.bias[vocab.index(w)] = bias
    cap = Captioner(model, vocab, Preprocess(size=(32, 32)))
    image = tmp_path / "i.png"
    tiny_image(0).save(image)
    record = ImageRecord(1, image, ["a red circle above a blue square", "a blue square below a red circle",
                                    "a red circle to the left of a blue square", "a red circle and a blue square"])
    assert relations.forced_choices(cap, [record]) == [("above", True), ("above", False), ("left_of", True)]


def test_a_folder_that_is_not_a_test_set_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        cli.main(["relation", str(tmp_path / "x.pt"), "--data", str(tmp_path)])
