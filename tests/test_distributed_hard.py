"""Hard attention under torchrun (gloo, two CPU processes): the REINFORCE baseline and the
expected-context coin are saved and restored, so a resumed two-rank run matches the
uninterrupted one exactly."""

import pytest
import torch

from captioner.checkpoint import load_checkpoint
from test_distributed import TORCHRUN, _run
from test_train import tiny_config
from captioner.train.config import to_toml


@pytest.mark.slow
def test_two_rank_hard_attention_run_resumes_exactly(tiny_coco, tmp_path):
    cfg = tiny_config(tiny_coco, **{"model.attention": "hard", "optim.max_steps": 6, "optim.batch_size": 4,
                                    "model.dropout": 0.0, "model.freeze_encoder": True, "data.feature_cache": True,
                                    "val.every_epochs": 0, "optim.save_every": 0})
    path = tmp_path / "cfg.toml"
    path.write_text(to_toml(cfg))
    straight, split = tmp_path / "straight", tmp_path / "split"
    train = [*TORCHRUN, "-m", "captioner.cli", "train", "--quiet"]
    _run([*train, "--config", str(path), "--run-dir", str(straight)])
    _run([*train, "--config", str(path), "--run-dir", str(split), "--set", "optim.max_steps=3"])
    _run([*train, "--resume", str(split), "--set", "optim.max_steps=6"])

    a, b = load_checkpoint(straight / "last.pt"), load_checkpoint(split / "last.pt")
    assert a["train_state"]["step"] == b["train_state"]["step"] == 6
    for k, v in a["state_dict"].items():
        assert torch.equal(b["state_dict"][k], v), k
    assert a["train_state"]["baseline"] == b["train_state"]["baseline"] != 0.0
    assert torch.equal(a["train_state"]["hard"]["coin"], b["train_state"]["hard"]["coin"])
