"""CHAIR on shapes data: shapes named that the image does not hold, from the generator's own
object lists, by shape and by colour and shape."""

import torch

import captioner.evaluation.evaluate as evaluation
from captioner.data.coco import load_split
from captioner.data.shapes import generate_dataset
from captioner.data.vocab import tokenize
from captioner.evaluation.grounding import (
    ImageObjects,
    ShapeObject,
    evaluate_caption,
    object_accuracy,
    summarize_grounding,
)
from captioner.search.decoding import CaptionResult
from tests.tiny import tiny_captioner

RED_CIRCLE = ShapeObject("circle", "red", "large", (0, 0, 10, 10))
GREEN_STAR = ShapeObject("star", "green", "small", (20, 20, 5, 5))


def test_hallucinated_shapes_by_shape_and_by_colour_and_shape():
    acc = object_accuracy("a red circle and a blue star and a square".split(), [RED_CIRCLE, GREEN_STAR])
    # square: no such shape; blue star: a star, but not blue
    assert (acc.n_mentions, acc.hallucinated, acc.hallucinated_with_color) == (3, 1, 2)
    assert object_accuracy("a red circle".split(), [RED_CIRCLE, GREEN_STAR]).hallucinated_with_color == 0
    assert object_accuracy("a circle".split(), [RED_CIRCLE]).hallucinated_with_color == 0  # no colour given


def test_split_chair_counts_captions_and_mentions():
    objects = [RED_CIRCLE, GREEN_STAR]
    captions = ["a red circle and a green star", "a red square", "a blue circle", "a green star"]
    accuracies = [evaluate_caption(c.split(), None, _image(objects))[1] for c in captions]
    g = summarize_grounding([[] for _ in captions], accuracies)
    # mentions: 2 + 1 + 1 + 1 = 5; by shape only the square is not there; by colour too, the blue circle
    assert g.chair_s == 1 / 4 and g.chair_i == 1 / 5
    assert g.chair_s_with_color == 2 / 4 and g.chair_i_with_color == 2 / 5
    assert g.pointing_accuracy is None  # no maps given: no pointing
    assert summarize_grounding([], []).chair_i is None


def _image(objects):
    return ImageObjects(1, "x.png", 64, 64, objects)


def test_evaluate_on_shapes_reports_chair_for_right_and_wrong_captions(tmp_path, monkeypatch):
    """Images 0-2 get their own first reference; 3-5 that of an image with other shapes."""
    data = tmp_path / "shapes"
    generate_dataset(data, {"test": 6}, seed=9)
    records = load_split(data, "test")
    shapes = [set(tokenize(r.captions[0])) & {"circle", "square", "triangle", "star", "cross"} for r in records]
    donors = [i if i < 3 else next(j for j in range(6) if not shapes[j] <= shapes[i]) for i in range(6)]

    def decoded(cap, recs, *a, **k):
        words = [tokenize(records[d].captions[0]) for d in donors]
        return [CaptionResult(w, torch.full((len(w), 4, 4), 1 / 16), torch.ones(len(w)), -1.0) for w in words]

    monkeypatch.setattr(evaluation, "decode_records", decoded)
    report = evaluation.evaluate(tiny_captioner(), data, "test", meteor=False, progress=False)
    assert report.grounding.chair_s == 3 / 6
    assert report.chair is None  # COCO's CHAIR needs COCO's instances files
    table = evaluation.format_table(report)
    assert "CHAIRs / CHAIRi, shapes" in table and "0.5000 / " in table
