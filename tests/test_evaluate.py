"""`captioner evaluate` end to end on generated shapes data."""

import json

import torch

import captioner.evaluation as evaluation
from captioner.cli import main
from captioner.data.shapes import generate_dataset
from captioner.decoding import CaptionResult
from captioner.grounding import load_shape_objects
from captioner.vocab import tokenize
from tiny import tiny_captioner


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
    assert report.grounding["object_accuracy"] == 1.0
    assert report.grounding["pointing_accuracy"] == 1.0
    assert report.grounding["alpha_mass_in_box"] == 1.0
    assert 0 < report.grounding["pointing_chance"] < 0.5


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
