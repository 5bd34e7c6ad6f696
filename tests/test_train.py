"""Training on the tiny COCO-format fixture: the loss falls, resume is exact, configs load."""

import json
from pathlib import Path

import pytest
import torch

from captioner.checkpoint import load_checkpoint
from captioner.inference import Captioner
from train.config import TrainConfig, apply_overrides, load_config
from train.loop import train

CONFIGS = sorted((Path(__file__).parent.parent / "train" / "configs").glob("*.toml"))


def tiny_config(data_dir, **sets):
    base = [
        f"data.dir={data_dir}", "data.min_count=1", "data.workers=0", "data.cache_images=true",
        "model.encoder=small", "model.image_size=32", "model.embed_dim=16", "model.hidden_dim=24",
        "model.attention_dim=12", "model.dropout=0.2", "optim.batch_size=4", "optim.lr=0.01",
        "optim.encoder_lr=0.01", "optim.log_every=1", "optim.save_every=2", "optim.epochs=50",
        "optim.lr_decay_every=1", "optim.lr_decay=0.9", "val.metric=BLEU-1", "val.max_len=8", "val.patience=0",
    ]
    return load_config(None, base + [f"{k}={v}" for k, v in sets.items()])


def _nll_log(run_dir):
    return [r["nll"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "nll" in r]


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.name == path.stem
    assert cfg.model.attention in ("soft", "hard", "mean")


def test_overrides_are_typed_and_checked(tmp_path):
    cfg = tiny_config(tmp_path, **{"optim.epochs": 3})
    assert cfg.optim.epochs == 3 and isinstance(cfg.optim.lr, float)
    with pytest.raises(ValueError, match="unknown config key"):
        apply_overrides(cfg, ["optim.epoch=3"])
    with pytest.raises(ValueError, match="must be a int"):
        apply_overrides(cfg, ["optim.epochs=many"])


def test_fixture_trains_and_the_loss_falls(tiny_coco, tmp_path):
    run = tmp_path / "run"
    outcome = train(tiny_config(tiny_coco, **{"optim.max_steps": 60, "val.every_epochs": 0}), run, progress=False)
    assert outcome.reason == "max_steps" and outcome.step == 60
    nll = _nll_log(run)
    assert sum(nll[-8:]) / 8 < 0.5 * sum(nll[:8]) / 8
    # The best checkpoint rebuilds a captioner on its own.
    cap = Captioner.load(run / "best.pt")
    assert cap.vocab.words[:4] == ["<pad>", "<start>", "<end>", "<unk>"]
    assert (run / "config.toml").read_text().startswith('name = "run"')


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_resume_reproduces_the_uninterrupted_run_exactly(tiny_coco, tmp_path, attention):
    sets = {"model.attention": attention, "optim.max_steps": 9}
    straight = tmp_path / "straight"
    train(tiny_config(tiny_coco, **sets), straight, progress=False)

    split = tmp_path / "split"
    first = train(tiny_config(tiny_coco, **{**sets, "optim.max_steps": 5}), split, progress=False)
    assert first.step == 5
    again = train(tiny_config(tiny_coco, **sets), split, resume=True, progress=False)
    assert again.step == 9

    a = load_checkpoint(straight / "last.pt")
    b = load_checkpoint(split / "last.pt")
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for k in a["state_dict"]:
        assert torch.equal(a["state_dict"][k], b["state_dict"][k]), k
    assert a["train_state"]["epoch"] == b["train_state"]["epoch"] >= 1  # an epoch boundary was crossed
    if attention == "hard":
        assert a["train_state"]["baseline"] == b["train_state"]["baseline"] != 0.0


def test_configs_of_older_runs_with_amp_still_load(tmp_path):
    saved = tiny_config(tmp_path).to_dict()
    del saved["optim"]["precision"]
    for amp, precision in ((True, "auto"), (False, "fp32")):
        saved["optim"]["amp"] = amp
        assert TrainConfig.from_dict(saved).optim.precision == precision
