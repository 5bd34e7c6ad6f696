"""Training objectives: soft attention (cross-entropy + doubly stochastic penalty) and
hard attention trained with REINFORCE on the variational lower bound L_s.

Legend: B captions in the batch, T steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

import torch

from captioner.model import kernels
from captioner.model.attention import attention_mode
from captioner.model.decoder import CaptionModel, DecoderOutput, attention_penalty
from captioner.model.encoders import Annotations

from .config import HardConfig, Reduction, Reward

REWARDS, REDUCTIONS = get_args(Reward), get_args(Reduction)


@dataclass
class LossParts:
    """A step's loss and the figures it reports. The figures may stay 0-d tensors on the
    training device (detached): turning them into Python numbers waits for the GPU, so that
    is left to whoever reads them (a log line, the progress bar), not done every step."""

    loss: torch.Tensor  # what backward() is called on
    nll: torch.Tensor | float  # mean over captions of -log p(y | .), summed over words
    penalty: torch.Tensor | float  # doubly stochastic term (before lambda)
    tokens: torch.Tensor | int
    sampled: bool | None = None  # hard attention: this minibatch used a sampled context
    baseline: float | None = None
    entropy: torch.Tensor | float | None = None  # hard attention: a device tensor, like nll
    reward: float | None = None  # self-critical training: the mean reward of the samples
    reinforce_reward: float | None = None  # hard attention: the minibatch's mean REINFORCE reward r


def caption_log_likelihood(out: DecoderOutput, targets: torch.Tensor) -> torch.Tensor:
    """log p(y | ., a) per caption, summed over its real words: (B,)."""
    token_logp = token_log_prob(out.logits.float(), targets)  # (B, T)
    return (token_logp * out.mask).sum(1)


def token_log_prob(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] along the last dimension: logits (..., V), targets (...)
    -> (...). With the kernels on (captioner.kernels, the one switch), the same values and
    gradients without the (..., V) log-softmax: kernels.token_log_prob."""
    if kernels.enabled():
        return kernels.token_log_prob(logits, targets)
    return torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def soft_loss(model: CaptionModel, images: torch.Tensor | Annotations, tokens: torch.Tensor, lengths: torch.Tensor,
              doubly_stochastic: float, *, steps: int | None = None) -> LossParts:
    """-log p(y|a) summed over words (mean over captions) + lambda * sum_i (1 - sum_t alpha_ti)^2,
    as in the paper; with a mode that does not attend ('mean') the penalty is constant and skipped.
    ``steps``: a fixed number of decoder steps (Decoder.forward), for a CUDA graph (graphed.py)."""
    out = model(images, tokens, lengths) if steps is None else model(images, tokens, lengths, steps=steps)
    ll = caption_log_likelihood(out, tokens[:, 1:])
    nll = -ll.mean()
    penalty = attention_penalty(out.alphas.float(), out.mask)
    mode = attention_mode(getattr(model, "module", model).config.attention)  # model may be wrapped in DDP
    loss = nll + doubly_stochastic * penalty if mode.attends else nll
    return LossParts(loss, nll.detach(), penalty.detach(), out.mask.sum())


class HardAttentionObjective:
    """REINFORCE for stochastic hard attention (Xu et al. 2015, sec. 4.1): the authors' code's
    reward, baseline and weights (capgen.py), averaged over the captions as the paper's
    estimator (its eq. 12) averages over the samples (the defaults of ``HardConfig``).

    Per minibatch of B captions (the global batch under torchrun), with r_i the reward of
    caption i and b the baseline, the loss whose gradient is followed is

        mean_i -log p(y_i|s_i,a) + lambda_ds * penalty
          - c * sum_i [ lambda_r (r_i - b) log p(s_i|a) + lambda_e H[alpha_i] ]

    with c = 1/B (``reduction = "mean"``, the default): every term a mean over the captions,
    so lambda_r and lambda_e mean the same at any batch size and under torchrun (B is then
    the global batch).

    - r_i = mean over the caption's real words of log p(y_t|s,a) (``reward = "word_mean"``;
      the authors' ``-masked_cost.mean(0)``, whose minibatches hold captions of one length),
      or the whole caption's log p(y|s,a) (``reward = "caption"``). (r_i - b) is a constant.
    - lambda_r = 0.1: the authors' "/10.".
    - c = 1 with ``reduction = "sum"``: capgen gives these two terms as known gradients with
      no 1/B beside a minibatch-mean NLL, so they add over the captions and their weight
      grows with B (16 by default there, 64 in its COCO script, less in a short last batch).
    - H[alpha_i] = sum over real steps of the entropy of alpha_t (nats; with several heads,
      the sum of the heads' entropies, as log p(s|a) sums theirs); lambda_e = 0.002.
    - b <- decay * b + (1 - decay) * mean_i r_i, on every minibatch (the authors: 0.9).

    With probability ``expected_context_prob`` a minibatch uses the expected context
    sum_i alpha_i a_i instead of a sample (the authors' 0.5 coin): then there is no
    score-function term (their known gradient is constant over the locations, which the
    softmax ignores), but the entropy bonus and the baseline update are applied as on
    every minibatch. The coin comes from its own generator seeded from ``seed``, so every
    rank flips the same coin and a resumed run the same sequence (``state_dict``).

    ``dist`` (a ``DistContext``) makes the baseline's minibatch mean the global batch's.
    """

    def __init__(self, cfg: HardConfig, doubly_stochastic: float = 0.0, baseline: float = 0.0, *,
                 seed: int = 0, dist=None):
        if cfg.reward not in REWARDS:
            raise ValueError(f"hard.reward must be one of {', '.join(REWARDS)}, got {cfg.reward!r}")
        if cfg.reduction not in REDUCTIONS:
            raise ValueError(f"hard.reduction must be one of {', '.join(REDUCTIONS)}, got {cfg.reduction!r}")
        self.cfg = cfg
        self.doubly_stochastic = doubly_stochastic
        self.baseline = baseline
        self.dist = dist
        self.coin = torch.Generator().manual_seed(seed)

    def state_dict(self) -> dict:
        return {"baseline": self.baseline, "coin": self.coin.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.baseline = float(state["baseline"])
        self.coin.set_state(state["coin"])

    def use_expected_context(self) -> bool:
        """The per-minibatch coin."""
        return bool(torch.rand((), generator=self.coin) < self.cfg.expected_context_prob)

    def __call__(self, model: CaptionModel, images: torch.Tensor | Annotations, tokens: torch.Tensor,
                 lengths: torch.Tensor, global_batch: int | None = None) -> LossParts:
        """``global_batch``: the number of captions in the whole minibatch when this process
        holds a share of it (under torchrun); the loop's gradient averaging then adds up
        the shares' sums."""
        sampled = not self.use_expected_context()
        out = model(images, tokens, lengths, sample=sampled)
        ll = caption_log_likelihood(out, tokens[:, 1:])  # (B,) log p(y|s,a)
        mask = out.mask.to(ll.dtype)  # (B, T)
        words = mask.sum(1)  # (B,) real steps, the end token included
        reward = ll.detach() / words if self.cfg.reward == "word_mean" else ll.detach()  # (B,)
        alphas = out.alphas.float()  # (B, T, L)
        # Several heads draw independently: the entropy of the draw is the sum of theirs.
        drawn = out.alphas_heads.float()  # (B, T, h, L)
        plogp = (drawn * torch.log(drawn.clamp_min(1e-12))).flatten(2).sum(-1)  # (B, T)
        entropy = (-plogp * mask).sum(1)  # (B,)
        extra = self.cfg.entropy * entropy  # (B,) what each caption adds to the surrogate
        if sampled:
            log_ps = (out.sample_log_probs * mask).sum(1)  # (B,) log p(s|a)
            extra = extra + self.cfg.lambda_r * (reward - self.baseline) * log_ps
        scale = (global_batch or len(ll)) if self.cfg.reduction == "sum" else 1.0
        penalty = attention_penalty(alphas, out.mask)
        loss = -ll.mean() + self.doubly_stochastic * penalty - scale * extra.mean()
        batch_reward = float(reward.mean())
        if self.dist is not None and self.dist.active:  # the global batch's mean
            batch_reward = self.dist.sum(float(reward.sum())) / self.dist.sum(float(len(reward)))
        d = self.cfg.baseline_decay
        self.baseline = d * self.baseline + (1 - d) * batch_reward
        return LossParts(loss, -ll.mean().detach(), penalty.detach(), out.mask.sum(), sampled, self.baseline,
                         entropy.mean().detach(), reinforce_reward=batch_reward)
