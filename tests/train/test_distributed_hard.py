"""Hard attention on two ranks (gloo, two CPU processes set up as torchrun sets them up): the REINFORCE baseline and the
expected-context coin are saved and restored, so a resumed two-rank run matches the
uninterrupted one exactly."""

import pytest
import torch

from captioner.io.checkpoint import load_checkpoint
from captioner.train.config import to_toml
from tests.builders import tiny_train_config
from tests.ranks import one_and_two_ranks, two_ranks_ok


@pytest.mark.slow
def test_two_rank_hard_attention_run_resumes_exactly(tiny_coco, tmp_path):
    cfg = tiny_train_config(tiny_coco, **{"model.attention": "hard", "optim.max_steps": 6, "optim.batch_size": 4,
                                          "model.dropout": 0.0, "model.freeze_encoder": True,
                                          "data.feature_cache": True, "val.every_epochs": 0, "optim.save_every": 0})
    path = tmp_path / "cfg.toml"
    path.write_text(to_toml(cfg))
    straight, split = tmp_path / "straight", tmp_path / "split"
    two_ranks_ok(["train", "--quiet", "--config", path, "--run-dir", straight], tmp_path)
    two_ranks_ok(["train", "--quiet", "--config", path, "--run-dir", split, "--set", "optim.max_steps=3"], tmp_path)
    two_ranks_ok(["train", "--quiet", "--resume", split, "--set", "optim.max_steps=6"], tmp_path)

    a, b = load_checkpoint(straight / "last.pt"), load_checkpoint(split / "last.pt")
    assert a.train_state.step == b.train_state.step == 6
    for k, v in a.state_dict.items():
        assert torch.equal(b.state_dict[k], v), k
    assert a.train_state.objective["baseline"] == b.train_state.objective["baseline"] != 0.0
    assert torch.equal(a.train_state.objective["hard"]["coin"], b.train_state.objective["hard"]["coin"])


@pytest.mark.slow
def test_two_ranks_train_hard_attention_like_one_process_over_the_global_batch(tiny_coco, tmp_path):
    """Hard attention's per-caption objective under torchrun: each rank holds half of every
    minibatch and the run must follow the whole minibatch's objective, as one process does:
    the same weights, and the REINFORCE baseline moved by the global batch's mean reward
    (a rank's own mean fails here). The expected context on every minibatch (the coin
    always shows it) keeps the ranks' own draws of attention cells out of the comparison;
    the weighting of the sampled terms across shares is tests/train/test_reinforce.py's (near a
    fresh model's flat maps the entropy bonus moves the weights by under 1e-4, too little
    to tell apart here). Set up as the soft two-rank test (SAME_AS_ONE)."""
    _, a, b = one_and_two_ranks(tiny_coco, tmp_path, **{"model.attention": "hard", "hard.entropy": 0.05,
                                                         "hard.expected_context_prob": 1.0})
    assert b.train_state.objective["baseline"] == pytest.approx(a.train_state.objective["baseline"], rel=1e-5)
