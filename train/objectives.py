"""The training objective, chosen once per run: soft (cross-entropy with the doubly stochastic
penalty), hard (REINFORCE, ``losses.HardAttentionObjective``) or self-critical
(``scst.ScstObjective``).

Each one is an object with the same four parts, so that the loop never asks which it has:
its loss on a batch, what it saves in ``last.pt`` for an exact resume, how it takes that back,
and the fields it adds to a log line. The checkpoint keys are those the loop always wrote
(``baseline`` and ``hard`` for hard attention, ``scst`` for each rank's sampler), so runs
saved before this module resume unchanged; ``TrainingState.objective`` holds them, older forms
upgraded (captioner.checkpoint).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from captioner.distributed import DistContext
from captioner.io.checkpoint import TrainingState
from captioner.model.attention import attention_mode
from captioner.model.encoders import Annotations

from .config import TrainConfig
from .losses import HardAttentionObjective, LossParts, soft_loss
from .scst import ScstObjective


class Objective(Protocol):
    name: str  # "soft", "hard" or "scst"

    def loss(self, net: nn.Module, inputs: torch.Tensor | Annotations, batch, global_size: int) -> LossParts:
        """This rank's loss on its share of a global batch of ``global_size`` captions."""

    def save(self, ctx: DistContext) -> dict:
        """Entries for last.pt's training state (every rank calls it: it may gather)."""

    def restore(self, train_state: TrainingState, rank: int) -> list[str]:
        """Take back what ``save`` wrote; what could not be restored, in words."""

    def log_fields(self, parts: LossParts, ctx: DistContext) -> dict:
        """Fields for a metrics.jsonl line (every rank calls it: it may average over ranks)."""


class Soft:
    """-log p(y|a) + lambda * sum_i (1 - sum_t alpha_ti)^2: no state beyond the model's."""

    name = "soft"

    def __init__(self, doubly_stochastic: float):
        self.doubly_stochastic = doubly_stochastic

    def loss(self, net, inputs, batch, global_size):
        return soft_loss(net, inputs, batch.tokens, batch.lengths, self.doubly_stochastic)

    def save(self, ctx):
        return {}

    def restore(self, train_state, rank):
        return []

    def log_fields(self, parts, ctx):
        return {}


class Hard:
    """REINFORCE for hard attention; its moving-average baseline and expected-context coin are
    state (the same on every rank)."""

    name = "hard"

    def __init__(self, objective: HardAttentionObjective):
        self.objective = objective

    def loss(self, net, inputs, batch, global_size):
        return self.objective(net, inputs, batch.tokens, batch.lengths, global_size)

    def save(self, ctx):
        return {"baseline": self.objective.baseline, "hard": self.objective.state_dict()}

    def restore(self, train_state, rank):
        saved = train_state.objective.get("hard")
        if saved is not None:  # else its baseline and coin start from here
            self.objective.load_state_dict(saved)
        return []

    def log_fields(self, parts, ctx):
        # r (the minibatch's, already the global batch's mean) against b, and the maps' entropy
        return {"reward": round(parts.reinforce_reward, 4), "baseline": round(self.objective.baseline, 4),
                "entropy": round(ctx.mean(float(parts.entropy)), 4)}


class SelfCritical:
    """Self-critical training; each rank's sampling generator is state of its own."""

    name = "scst"

    def __init__(self, objective: ScstObjective):
        self.objective = objective

    def loss(self, net, inputs, batch, global_size):
        return self.objective(net, inputs, batch.image_indices)

    def save(self, ctx):
        return {"scst": ctx.gather(self.objective.state_dict())}

    def restore(self, train_state, rank):
        saved = train_state.objective.get("scst")
        if saved is None:  # else its samples start from here
            return []
        if not self.objective.load_state_dict(saved[rank]):
            return ["the SCST sampler's random state (saved on another kind of device)"]
        return []

    def log_fields(self, parts, ctx):
        return {"reward": round(ctx.mean(float(parts.reward)), 4)}


def choose_objective(cfg: TrainConfig, attention: str, vocab, references, ctx: DistContext) -> Objective:
    """Self-critical training when ``[scst]`` is enabled (it replaces the others), REINFORCE for
    a model whose attention mode is stochastic (hard), else the soft objective."""
    o = cfg.optim
    if cfg.scst.enabled:
        return SelfCritical(ScstObjective(cfg.scst, vocab, references, seed=o.seed, rank=ctx.rank,
                                          device=ctx.device))
    if attention_mode(attention).stochastic:
        return Hard(HardAttentionObjective(cfg.hard, o.doubly_stochastic, seed=o.seed, dist=ctx))
    return Soft(o.doubly_stochastic)
