"""`captioner evaluate` end to end on generated shapes data."""

import json

import pytest
import torch

import captioner.evaluation.evaluate as evaluation
from captioner.cli.main import main
from captioner.data.coco import load_split
from captioner.data.images import Preprocess
from captioner.data.shapes import generate_dataset
from captioner.data.vocab import tokenize
from captioner.evaluation.grounding import load_shape_objects
from captioner.search.decoding import CaptionResult
from tests.tiny import tiny_captioner


def _perfect(records, objects, grid=(8, 8)):
    """The first reference caption, each colour/shape word looking at a cell inside its object."""
    results = []
    for r in records:
        image = objects[r.image_id]
        words = tokenize(r.captions[0])
        alphas = torch.full((len(words), *grid), 1.0 / (grid[0] * grid[1]))
        for t, w in enumerate(words):
            for o in image.objects:
                if w in (o.color, o.shape):
                    x, y, bw, bh = o.bbox
                    col = int((x + bw / 2) / image.width * grid[1])
                    row = int((y + bh / 2) / image.height * grid[0])
                    alphas[t] = 0
                    alphas[t, row, col] = 1.0
        results.append(CaptionResult(words, alphas, torch.ones(len(words)), -1.0))
    return results


def test_perfect_captions_and_pointing_score_one(tmp_path, monkeypatch):
    data = tmp_path / "shapes"
    generate_dataset(data, {"test": 6}, seed=9)
    objects = load_shape_objects(data / "instances_test.json")
    monkeypatch.setattr(evaluation, "decode_records", lambda cap, records, *a, **k: _perfect(records, objects))
    report = evaluation.evaluate(tiny_captioner(), data, "test", meteor=False, progress=False)
    assert report.n_images == 6
    assert abs(report.metrics["BLEU-4"] - 1.0) < 1e-6
    assert report.grounding.object_accuracy == 1.0
    assert report.grounding.pointing_accuracy == 1.0
    assert report.grounding.alpha_mass_in_box == 1.0
    assert 0 < report.grounding.pointing_chance < 0.5


def _cell_outside(image, grid=(8, 8)):
    """A cell whose centre lies in no object's box."""
    for row in range(grid[0]):
        for col in range(grid[1]):
            x, y = (col + 0.5) * image.width / grid[1], (row + 0.5) * image.height / grid[0]
            if not any(bx <= x <= bx + bw and by <= y <= by + bh for bx, by, bw, bh in (o.bbox for o in image.objects)):
                return row, col
    raise AssertionError("no free cell")


def _pointed_words(words, image):
    """Words the pointing game scores: a shape or colour owned by exactly one object."""
    return [w for w in words if sum(o.shape == w for o in image.objects) == 1
            or sum(o.color == w for o in image.objects) == 1]


def test_wrong_captions_and_misplaced_attention_are_scored_as_such(tmp_path, monkeypatch):
    """Images 0-1: the reference caption, looking at its objects. 2-3: the reference caption,
    looking at empty background. 4-5: another image's objects named, looking at background.
    Object accuracy must be 4/6, and pointing the share of scored words of images 0-1."""
    data = tmp_path / "shapes"
    generate_dataset(data, {"test": 6}, seed=9)
    objects = load_shape_objects(data / "instances_test.json")
    records = load_split(data, "test")
    results = _perfect(records, objects)
    kinds = lambda r: sorted((o.color, o.shape) for o in objects[r.image_id].objects)  # noqa: E731
    for i in range(2, 6):
        if i >= 4:  # name another image's objects
            donor = next(j for j in range(len(records)) if kinds(records[j]) != kinds(records[i]))
            results[i] = _perfect([records[donor]], objects)[0]
        row, col = _cell_outside(objects[records[i].image_id])
        alphas = torch.zeros_like(results[i].alphas)
        alphas[:, row, col] = 1.0
        results[i] = CaptionResult(results[i].words, alphas, results[i].betas, -1.0)
    monkeypatch.setattr(evaluation, "decode_records", lambda cap, recs, *a, **k: results)
    report = evaluation.evaluate(tiny_captioner(), data, "test", meteor=False, progress=False)

    assert report.grounding.object_accuracy == 4 / 6
    scored = [len(_pointed_words(r.words, objects[rec.image_id])) for rec, r in zip(records, results)]
    assert scored[0] + scored[1] > 0 and sum(scored[2:]) > 0
    assert abs(report.grounding.pointing_accuracy - (scored[0] + scored[1]) / sum(scored)) < 1e-9
    assert report.grounding.n_words == sum(scored)
    assert report.captions == {rec.image_id: r.caption for rec, r in zip(records, results)}
    assert 0 < report.metrics["BLEU-4"] < 1


def test_evaluate_command_writes_metrics_and_coco_results(tmp_path, capsys):
    data = tmp_path / "shapes"
    generate_dataset(data, {"test": 4}, seed=2)
    weights = tmp_path / "tiny.pt"
    tiny_captioner(image_size=(64, 64)).save(weights)
    out = tmp_path / "eval" / "metrics.json"
    code = main(["evaluate", "--weights", str(weights), "--data", str(data), "--split", "test",
                 "--beam-size", "2", "--max-len", "6", "--out", str(out), "--no-meteor", "--device", "cpu"])
    assert code == 0
    table = capsys.readouterr().out
    assert "BLEU-4" in table and "pointing game" in table and "chance" in table
    report = json.loads(out.read_text())
    assert report["n_images"] == 4 and "CIDEr" in report["metrics"] and "METEOR" not in report["metrics"]
    results = json.loads((out.parent / "metrics.results.json").read_text())
    assert sorted(r["image_id"] for r in results) == [1, 2, 3, 4]
    assert all(isinstance(r["caption"], str) for r in results)


def test_evaluate_missing_split_is_a_usage_error(tmp_path, capsys):
    weights = tmp_path / "tiny.pt"
    tiny_captioner().save(weights)
    assert main(["evaluate", "--weights", str(weights), "--data", str(tmp_path), "--split", "test"]) == 2
    assert "no split" in capsys.readouterr().err


def test_pointing_under_a_centre_crop_uses_the_region_the_model_saw(tmp_path, monkeypatch):
    """A captioner that sees the central half of each 128 px image (shorter side to 64 px,
    centre 32 px cropped: pixels 32 to 96), its maps a 16 x 16 grid over that crop (4 px
    cells). Each named word looks at a cell whose centre, in the crop, lies in its
    object's box: every scored word is a hit, but for the few boxes that reach into the
    crop by less than half a cell (no cell centre in them). A word whose object lies
    wholly outside the crop is not scored but counted apart."""
    data = tmp_path / "shapes"
    generate_dataset(data, {"test": 24}, seed=9)
    objects = load_shape_objects(data / "instances_test.json")
    records = load_split(data, "test")
    cap = tiny_captioner()
    cap.preprocess = Preprocess(size=(32, 32), resize=64)
    assert cap.preprocess.crop_box((128, 128)) == (32, 32, 96, 96)
    centres = [32 + 4 * (i + 0.5) for i in range(16)]  # of the cells, in the image's pixels
    results, unseen, blind = [], 0, 0
    for r in records:
        image = objects[r.image_id]
        words = tokenize(r.captions[0])
        alphas = torch.full((len(words), 16, 16), 1.0 / 256)
        for t, w in enumerate(words):
            if not _pointed_words([w], image):
                continue
            (x, y, bw, bh), = [o.bbox for o in image.objects if w in (o.color, o.shape)]
            cells = [(i, j) for i, cy in enumerate(centres) for j, cx in enumerate(centres)
                     if x <= cx < x + bw and y <= cy < y + bh]
            alphas[t] = 0
            alphas[t][cells[0] if cells else (0, 0)] = 1.0
            outside = x + bw <= 32 or x >= 96 or y + bh <= 32 or y >= 96
            unseen += outside
            blind += not cells and not outside
        results.append(CaptionResult(words, alphas, torch.ones(len(words)), -1.0))
    monkeypatch.setattr(evaluation, "decode_records", lambda c, recs, *a, **k: results)
    g = evaluation.evaluate(cap, data, "test", meteor=False, progress=False).grounding
    assert unseen > 0 and g.n_words > 20 and blind < 0.1 * g.n_words
    assert g.n_words_unseen == unseen
    assert g.pointing_accuracy == pytest.approx(1 - blind / g.n_words)
