"""End to end and offline, on real photographs in COCO's published layout.

Train a torchvision-encoder config from "ImageNet" weights (random weights saved under
torchvision's own file names in a TORCH_HOME made here), then with an empty TORCH_HOME and
downloads refused: evaluate the checkpoint on the Karpathy test split and on the official
val2014 layout, and caption a folder, getting the captions evaluation decoded.
ResNet-18 stands in for VGG-19 here to keep the test fast: the same code path (torchvision
weights API, frozen pretrained trunk); VGG-19's own cut is tested in test_encoders.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from captioner.cli.main import main
from captioner.data.coco import load_split
from captioner.evaluation.evaluate import decode_records
from captioner.inference import Captioner, DecodeOptions
from tests.pretrained import fake_torch_home, forbid_downloads


@pytest.mark.slow
def test_train_with_pretrained_weights_then_evaluate_and_caption_offline(tmp_path, photos, monkeypatch, capsys):
    coco = photos / "coco"
    split_file = coco / "dataset_coco.json"
    fake_torch_home(tmp_path / "torch-home", monkeypatch, "resnet18")
    sets = ["model.encoder=resnet18", "model.encoder_pretrained=true", "model.image_size=64", "model.resize=73",
            "model.embed_dim=16", "model.hidden_dim=16", "model.attention_dim=16", "optim.max_steps=6",
            "optim.batch_size=8", "optim.threads=1", "data.workers=0", "data.min_count=1", "val.limit=2",
            "val.max_len=6", f"data.dir={coco}", f"data.karpathy={split_file}"]
    config = tmp_path / "c.toml"
    config.write_text('name = "offline"\n')
    run = tmp_path / "run"
    args = ["train", "--config", str(config), "--run-dir", str(run), "--quiet"]
    assert main(args + [a for s in sets for a in ("--set", s)]) == 0
    assert "resnet18 encoder (ImageNet weights)" in capsys.readouterr().err

    # A machine without the ImageNet weights: empty hub cache, no network.
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "empty"))
    asked = forbid_downloads(monkeypatch)
    weights = str(run / "best.pt")
    common = ["--weights", weights, "--beam-size", "1", "--max-len", "6", "--no-meteor", "--device", "cpu"]
    assert main(["evaluate", "--data", str(coco), "--karpathy", str(split_file), "--split", "test",
                 "--out", str(tmp_path / "test.json")] + common) == 0
    test_results = json.loads((tmp_path / "test.results.json").read_text())
    assert [r["image_id"] for r in test_results] == [136, 139]
    assert main(["evaluate", "--data", str(coco), "--split", "val2014", "--batch-size", "4",
                 "--out", str(tmp_path / "val.json")] + common) == 0
    by_id = {r["image_id"]: r["caption"] for r in json.loads((tmp_path / "val.results.json").read_text())}
    assert sorted(by_id) == [73, 74, 133, 136, 139]

    lines = tmp_path / "captions.jsonl"
    assert main(["caption", str(coco / "val2014"), "--weights", weights, "--beam-size", "1", "--max-len", "6",
                 "--batch-size", "4", "--device", "cpu", "--out", str(lines), "--quiet"]) == 0
    captions = [json.loads(line) for line in lines.read_text().splitlines()]
    assert len(captions) == 5 and not any("error" in c for c in captions)
    for c in captions:  # the same caption from `caption` as from `evaluate`, image by image
        assert c["caption"] == by_id[int(Path(c["image"]).stem.rsplit("_", 1)[1])]
    # And the same log-probability: a barely trained model says the same words for any
    # picture, but its scores move with every pixel, so this catches a different decoding.
    records = load_split(coco, "val2014")
    results = decode_records(Captioner.load(weights), records, DecodeOptions(beam_size=1, max_len=6),
                             batch_size=4, progress=False)
    scores = {str(r.path): round(res.score, 4) for r, res in zip(records, results)}
    assert {c["image"]: c["score"] for c in captions} == scores
    assert asked == []
