"""A training step leaves its figures on the device, and the loop asks the ranks one question
per step, not two: each conversion to a Python number and each collective waits for the GPU
(and every rank), so they are done when the figures are read, not on every step."""

from __future__ import annotations

import torch
import torch.distributed as dist

from captioner.distributed import DistContext
from captioner.train.config import HardConfig
from captioner.train.loop import _stop_reason
from captioner.train.losses import HardAttentionObjective, soft_loss
from tests.tiny import tiny_captioner, tiny_image, token_batch


def _batch(cap):
    tokens, lengths = token_batch(cap.vocab, ["a red circle", "a small blue square and a star"])
    images = torch.stack([cap.preprocess(tiny_image(seed=i)) for i in range(2)])
    return images, tokens, lengths


def test_soft_and_hard_losses_leave_their_figures_as_device_tensors(monkeypatch):
    cap = tiny_captioner(seed=0)
    images, tokens, lengths = _batch(cap)

    def no_item(self):
        raise AssertionError("a host synchronisation inside the training step")

    monkeypatch.setattr(torch.Tensor, "item", no_item)
    parts = soft_loss(cap.model.train(), images, tokens, lengths, 1.0)
    for figure in (parts.nll, parts.penalty, parts.tokens):
        assert isinstance(figure, torch.Tensor) and not figure.requires_grad
    hard = tiny_captioner(seed=0, attention="hard")
    objective = HardAttentionObjective(HardConfig(expected_context_prob=0.0), 1.0, seed=0)
    parts = objective(hard.model.train(), images, tokens, lengths)
    assert isinstance(parts.nll, torch.Tensor) and isinstance(parts.entropy, torch.Tensor)
    monkeypatch.undo()
    assert float(parts.nll) > 0


class _Run:
    def __init__(self, ctx, max_minutes: float):
        from captioner.train.config import TrainConfig
        self.cfg = TrainConfig()
        self.cfg.optim.max_minutes = max_minutes
        self.cfg.optim.max_steps = 0
        self.ctx = ctx


class _State:
    step, train_seconds = 5, 0.0


class _Stop:
    signal = None


def test_the_stop_question_is_one_collective_per_step(monkeypatch):
    calls = []

    def all_reduce(t, op=None):
        calls.append(t.numel())

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
    ctx = DistContext(rank=0, world=2, grouped=True)
    assert _stop_reason(_Run(ctx, max_minutes=30), _State(), _Stop()) is None
    assert calls == [2]  # the time budget and the signal, in one all-reduce
