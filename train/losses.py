"""Training objectives: soft attention (cross-entropy + doubly stochastic penalty) and
hard attention trained with REINFORCE on the variational lower bound L_s.

Legend: B captions in the batch, T steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from captioner.encoders import Annotations
from captioner.model import CaptionModel, DecoderOutput, attention_penalty

from .config import HardConfig


@dataclass
class LossParts:
    loss: torch.Tensor  # what backward() is called on
    nll: float  # mean over captions of -log p(y | .), summed over words
    penalty: float  # doubly stochastic term (before lambda)
    tokens: int
    sampled: bool | None = None  # hard attention: this minibatch used a sampled context
    baseline: float | None = None
    entropy: float | None = None


def caption_log_likelihood(out: DecoderOutput, targets: torch.Tensor) -> torch.Tensor:
    """log p(y | ., a) per caption, summed over its real words: (B,)."""
    logp = F.log_softmax(out.logits.float(), dim=-1)  # (B, T, V)
    token_logp = logp.gather(2, targets.unsqueeze(-1)).squeeze(-1)  # (B, T)
    return (token_logp * out.mask).sum(1)


def soft_loss(model: CaptionModel, images: torch.Tensor | Annotations, tokens: torch.Tensor, lengths: torch.Tensor,
              doubly_stochastic: float) -> LossParts:
    """-log p(y|a) summed over words (mean over captions) + lambda * sum_i (1 - sum_t alpha_ti)^2,
    as in the paper; with the 'mean' (no attention) mode the penalty is constant and skipped."""
    out = model(images, tokens, lengths)
    ll = caption_log_likelihood(out, tokens[:, 1:])
    nll = -ll.mean()
    penalty = attention_penalty(out.alphas.float(), out.mask)
    mode = getattr(model, "module", model).config.attention  # model may be wrapped in DDP
    loss = nll + doubly_stochastic * penalty if mode != "mean" else nll
    return LossParts(loss, nll.item(), penalty.item(), int(out.mask.sum()))


class HardAttentionObjective:
    """REINFORCE for stochastic hard attention (Xu et al. 2015, sec. 4.1; authors' code).

    Per minibatch, sample s_t ~ Multinoulli(alpha_t) and follow the gradient of
        log p(y|s,a) + lambda_r (log p(y|s,a) - b) log p(s|a) + lambda_e H[s]
    where the reward factor (log p(y|s,a) - b) is a constant (no gradient), b is a moving
    average b <- 0.9 b + 0.1 log p(y|s,a), and H[s] is the entropy of the attention
    distributions. With probability ``expected_context_prob`` the minibatch instead uses the
    expected context sum_i alpha_i a_i (the soft model's), which lowers the variance.
    """

    def __init__(self, cfg: HardConfig, doubly_stochastic: float = 0.0, baseline: float = 0.0):
        self.cfg = cfg
        self.doubly_stochastic = doubly_stochastic
        self.baseline = baseline

    def use_expected_context(self) -> bool:
        """The per-minibatch coin (global torch RNG, so a resumed run flips the same coins)."""
        return bool(torch.rand(()) < self.cfg.expected_context_prob)

    def __call__(self, model: CaptionModel, images: torch.Tensor, tokens: torch.Tensor,
                 lengths: torch.Tensor) -> LossParts:
        if self.use_expected_context():
            parts = soft_loss(model, images, tokens, lengths, self.doubly_stochastic)
            parts.sampled, parts.baseline = False, self.baseline
            return parts
        out = model(images, tokens, lengths, sample=True)
        ll = caption_log_likelihood(out, tokens[:, 1:])  # (B,) log p(y|s,a)
        mask = out.mask.to(ll.dtype)
        log_ps = (out.sample_log_probs * mask).sum(1)  # (B,) log p(s|a)
        entropy = (out.entropies * mask).sum(1)  # (B,)
        reward = (ll.detach() - self.baseline)
        surrogate = ll + self.cfg.lambda_r * reward * log_ps + self.cfg.entropy * entropy
        penalty = attention_penalty(out.alphas.float(), out.mask)
        loss = -surrogate.mean() + self.doubly_stochastic * penalty
        self.baseline = self.cfg.baseline_decay * self.baseline + (1 - self.cfg.baseline_decay) * ll.mean().item()
        return LossParts(loss, -ll.mean().item(), penalty.item(), int(out.mask.sum()), True, self.baseline,
                         entropy.mean().item())
