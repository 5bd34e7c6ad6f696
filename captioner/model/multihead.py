"""Multi-head decoder attention: h heads over the same annotations, one context.

Legend: B batch, k queries per image (beams), h heads, L locations, D annotation size,
K key size (per head, as the head's score makes it), V = D // h value size per head.

Each head is a whole ``Attention`` (attention.py) with its own projections, and with the
model's score, normaliser and local window (its own centre, and width where learned).
As the seeds define multi-head attention (and the Transformer), queries, keys and values
are projected per head, the values to D / h, and the concatenated values back to D:

    alpha^j_t = head_j.weights(a, h_{t-1})                       (B, L), j = 1..h
    v^j_t     = W_v^j sum_i alpha^j_ti a_i                       (B, D) -> (B, V)
                (hard: W_v^j a_{s^j_t}, s^j_t ~ Multinoulli(alpha^j_t))
    z_t       = W_o [v^1_t; ..; v^h_t] + b_o                     (B, h V) -> (B, D)

(W_v^j is linear, so projecting the attended annotation equals attending over projected
annotations, at a cost per query rather than per location.) z_t then goes through the
beta gate as a single head's context does. The size stays the same whatever h: the value
and output projections hold 2 D^2 + D parameters when h divides D, and the additive and
concat heads get attention_dim // h units each. The dot-product scores project the query
in every head, or all heads would be the same.

Hard attention draws one cell per head, independently: log p(s_t | a) is the sum of the
heads' log-probabilities, and the entropy reported is the sum of the heads' entropies
(the entropy of the joint draw). A step returns each head's map, ``alpha_heads``
(B, h, L), as a single ``Attention`` returns its one (h = 1); ``alpha``, derived from them,
is their mean, which is what the doubly stochastic penalty, the overlays and the metrics
read by default.
"""

from __future__ import annotations

import torch
from torch import nn

from captioner.model.attention import Attention, AttentionStep, FirstHead, attention_mode


class MultiHeadAttention(nn.Module):
    def __init__(self, key_dim: int, query_dim: int, attn_dim: int, *, heads: int, score: str = "additive",
                 normalizer: str = "softmax", mode: str = "soft", local_window: float = 0.0,
                 local_width: str = "fixed"):
        super().__init__()
        if heads < 2:
            raise ValueError(f"MultiHeadAttention needs heads >= 2, got {heads} (one head is Attention)")
        if not attention_mode(mode).attends:
            raise ValueError(f"attention {mode!r} has no weights for several heads to differ in: use heads = 1")
        head_dim = max(1, attn_dim // heads)
        self.heads = nn.ModuleList(
            Attention(key_dim, query_dim, head_dim, score=score, normalizer=normalizer, mode=mode,
                      local_window=local_window, local_width=local_width, project_query=True)
            for _ in range(heads))
        self.value_dim = max(1, key_dim // heads)
        # W_v^j: each head's attended annotation to its value, (D -> V); no bias, as b_o adds one.
        self.value_proj = nn.ModuleList(nn.Linear(key_dim, self.value_dim, bias=False) for _ in range(heads))
        self.out_proj = nn.Linear(heads * self.value_dim, key_dim)  # W_o: the heads' values back to D
        self.local_window = float(local_window)
        self.key_dim = key_dim
        self.num_heads = heads

    # The heads' options, all alike: the first head's objects and names.
    phi, score, normalizer, mode, local_width = (FirstHead() for _ in range(5))

    def prepare(self, a: torch.Tensor) -> torch.Tensor:
        """Per-image part of every head's score, once per image: (B, L, D) -> (B, h, L, K)."""
        return torch.stack([head.prepare(a) for head in self.heads], 1)

    def head_weights(self, keys: torch.Tensor, a: torch.Tensor, h: torch.Tensor,
                     grid: tuple[int, int]) -> torch.Tensor:
        """Each head's alpha_t: keys (B, h, L, K), a (B, L, D), h (B*k, Q) -> (B*k, h, L)."""
        return torch.stack([head.weights(keys[:, j], a, h, grid) for j, head in enumerate(self.heads)], 1)

    def weights(self, keys: torch.Tensor, a: torch.Tensor, h: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """The heads' mean map: (B*k, L), non-negative, summing to 1."""
        return self.head_weights(keys, a, h, grid).mean(1)

    def forward(self, keys: torch.Tensor, a: torch.Tensor, h: torch.Tensor, grid: tuple[int, int],
                *, sample: bool = False, argmax: bool = False,
                generator: torch.Generator | None = None) -> AttentionStep:
        """One step for B images and B*k queries, as ``Attention.forward``; hard ``sample``
        and ``argmax`` pick one cell per head (``sample`` (B*k, h))."""
        steps = [head(keys[:, j], a, h, grid, sample=sample, argmax=argmax, generator=generator)
                 for j, head in enumerate(self.heads)]
        values = [w_v(s.context) for w_v, s in zip(self.value_proj, steps)]  # h x (B*k, V)
        context = self.out_proj(torch.cat(values, -1))  # (B*k, h V) -> (B*k, D)
        alpha_heads = torch.cat([s.alpha_heads for s in steps], 1)  # h x (B*k, 1, L) -> (B*k, h, L)
        picked = torch.stack([s.sample for s in steps], 1) if steps[0].sample is not None else None  # (B*k, h)
        log_p = entropy = None
        if steps[0].sample_log_prob is not None:  # independent draws: log-probabilities and entropies add
            log_p = torch.stack([s.sample_log_prob for s in steps], 1).sum(1)  # (B*k,)
            entropy = torch.stack([s.entropy for s in steps], 1).sum(1)
        return AttentionStep(context, alpha_heads, picked, log_p, entropy)


def build_attention(key_dim: int, query_dim: int, attn_dim: int, *, heads: int = 1,
                    **options) -> Attention | MultiHeadAttention:
    """One head: exactly the single ``Attention`` (its parameter names and numbers, so every
    checkpoint saved before heads existed loads); more: ``MultiHeadAttention``."""
    if not isinstance(heads, int) or heads < 1:
        raise ValueError(f"heads must be a whole number >= 1, got {heads!r}")
    if heads == 1:
        return Attention(key_dim, query_dim, attn_dim, **options)
    return MultiHeadAttention(key_dim, query_dim, attn_dim, heads=heads, **options)
