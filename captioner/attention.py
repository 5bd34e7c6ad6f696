"""One attention module over the annotation vectors, with the options of the seeds.

Legend: B batch, L locations (H*W grid cells), D annotation size, Q query (LSTM hidden)
size, A attention size.

    score       additive (default, Show Attend and Tell: w^T tanh(W_a a_i + W_h h)),
                concat (v^T tanh(W [h; a_i]), built literally per step), dot, scaled_dot,
                general (bilinear h^T W a_i), cosine
    normalizer  softmax (default) or sparsemax (exact zeros)
    mode        soft: z = sum_i alpha_i a_i; hard: z = a_s with s ~ Multinoulli(alpha);
                mean: z = mean_i a_i (no attention; the baseline that shows what attention adds)
    local_window  > 0: alpha reweighted by a 2-D Gaussian window of that half-width (cells)
                around a predicted centre (local attention)
    local_width fixed (default): the half-width is local_window; learned: the centre network
                also predicts it, 0.1 + softplus(.) cells, starting at local_window
    cosine      cos(h, a_i) / tau with a learned temperature tau (stored as log tau, starts
                at 1): at tau = 1 a softmax over a 16x16 grid puts at most e/(e + 255/e),
                under 3%, on one cell; a small tau lets it point at one

Whatever depends only on the image (W_a a_i and the like) is computed once per image by
``prepare``, not once per step.

Queries may come k to an image (beam search: k beams per image): h then has B*k rows,
image-major, and each query attends over its own image's annotations and keys, which are
held once per image rather than copied k times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SCORES = ("additive", "concat", "dot", "scaled_dot", "general", "cosine")
NORMALIZERS = ("softmax", "sparsemax")
MODES = ("soft", "hard", "mean")
LOCAL_WIDTHS = ("fixed", "learned")
# A learned half-width never goes below this many cells: the window's log, -d^2 / (2 sigma^2),
# stays finite (and its gradient too) however far the centre network pushes the width down.
MIN_HALF_WIDTH = 0.1
# The cosine temperature never goes below this: scores stay within +-100, softmax finite.
MIN_TEMPERATURE = 0.01


def _inverse_softplus(y: float) -> float:
    """x with softplus(x) = y > 0, without overflow for large y."""
    return y + math.log(-math.expm1(-y))


@dataclass
class AttentionStep:
    context: torch.Tensor  # (B, D) the attended annotation (before the beta gate)
    alpha: torch.Tensor  # (B, L) attention weights, >= 0, summing to 1
    sample: torch.Tensor | None = None  # (B,) hard attention: the sampled location
    sample_log_prob: torch.Tensor | None = None  # (B,) log p(s_t | a), with gradient to alpha
    entropy: torch.Tensor | None = None  # (B,) H[alpha_t]
    alpha_heads: torch.Tensor | None = None  # (B, h, L) each head's weights (multi-head only)


def sparsemax(scores: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Euclidean projection of ``scores`` onto the probability simplex (Martins & Astudillo 2016)."""
    return _Sparsemax.apply(scores, dim)


class _Sparsemax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor, dim: int) -> torch.Tensor:
        z = z.transpose(dim, -1)
        z_sorted, _ = torch.sort(z, dim=-1, descending=True)
        k = torch.arange(1, z.shape[-1] + 1, device=z.device, dtype=z.dtype)
        cumsum = z_sorted.cumsum(-1)
        support = 1 + k * z_sorted > cumsum  # the k largest entries stay positive
        k_z = support.sum(-1, keepdim=True)  # support size, >= 1
        tau = (cumsum.gather(-1, k_z - 1) - 1) / k_z.to(z.dtype)
        p = torch.clamp(z - tau, min=0).transpose(dim, -1)
        ctx.save_for_backward(p)
        ctx.dim = dim
        return p

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (p,) = ctx.saved_tensors
        dim = ctx.dim
        # Jacobian = diag(s) - s s^T / |S| with s the support indicator.
        support = (p > 0).to(grad.dtype)
        g = grad * support
        v = g.sum(dim, keepdim=True) / support.sum(dim, keepdim=True)
        return support * (grad - v), None


# Size of the slice of the (B, k, L, A) additive-attention sum handled at once when no
# gradient is needed: about 1 MiB, so the sum is made, squashed and reduced while it sits
# in the CPU's cache.
BLOCK_BYTES = 1 << 20


def _blocked_ok(keys: torch.Tensor, q: torch.Tensor) -> bool:
    """keys (B, L, A), q (B, k, A): is the sum of the two big enough to block, and may it be?"""
    return (not torch.is_grad_enabled() and keys.device.type == "cpu" and keys.dtype == q.dtype
            and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()
            and keys.numel() * q.shape[1] * keys.element_size() > BLOCK_BYTES)


def _additive_blocked(keys: torch.Tensor, q: torch.Tensor, v: nn.Linear) -> torch.Tensor:
    """w^T tanh(keys + q): keys (B, L, A), q (B, k, A) -> (B, k, L), a few images at a time
    into one reused buffer. The plain expression writes and rereads two (B, k, L, A) tensors
    per decoding step (at the paper's sizes with beam 3: 96 x 196 x 512 floats, 38 MB each);
    this keeps the work in cache. It also uses tanh(u) = 2 sigmoid(2u) - 1, so
    w^T tanh(u) = 2 w^T sigmoid(2u) - sum(w): a CPU's sigmoid is about 4x faster than its
    tanh. Same values up to float rounding; inference only (no autograd through the buffer)."""
    return _additive_blocked_w(keys, q, v.weight[0], v.bias)


def _additive_blocked_w(keys: torch.Tensor, q: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """_additive_blocked with the weights given: w (A,), bias (1,)."""
    b, n, d = keys.shape
    k = q.shape[1]
    rows = max(1, BLOCK_BYTES // (k * n * d * keys.element_size()))
    out = keys.new_empty(b, k, n)
    buf = keys.new_empty(min(rows, b), k, n, d)
    q2 = (2 * q).unsqueeze(2)  # (B, k, 1, A)
    k2 = keys.unsqueeze(1)  # (B, 1, L, A)
    w_rows = w.view(1, 1, d)
    for i in range(0, b, rows):
        j = min(i + rows, b)
        blk = buf[: j - i]
        torch.add(q2[i:j], k2[i:j], alpha=2, out=blk)  # 2u = 2q + 2 keys
        blk.sigmoid_()
        _per_image_mm(w_rows.expand(j - i, 1, d), blk.view(j - i, k * n, d).transpose(1, 2),
                      out[i:j].view(j - i, 1, k * n))  # (b, 1, A) x (b, A, k L)
    return out.mul_(2).add_(bias - w.sum())


def _per_image_mm(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """torch.bmm over a block's images, for the products inside the cache-blocked loops.
    A batched product gives each thread whole images, as the element-wise operations around
    it split the block; one (1, b k L) x (b k L, A) product or a matrix-vector product splits
    it another way, and each core then reads what the other just wrote (with two threads
    that made the element-wise operation after it several times slower)."""
    return torch.bmm(x, y, out=out)


def _grad_blocked_ok(keys: torch.Tensor, q: torch.Tensor) -> bool:
    """May training's additive scores take the cache-blocked autograd path (CPU, fp32 or fp64)?"""
    return (torch.is_grad_enabled() and keys.device.type == "cpu" and keys.dtype == q.dtype
            and keys.dtype in (torch.float32, torch.float64) and not torch.is_autocast_enabled("cpu")
            and not torch.compiler.is_compiling())


class _AdditiveScore(torch.autograd.Function):
    """e = w^T tanh(keys + q) + b with its gradient, a cache-sized block of images at a time:
    keys (B, L, A), q (B, k, A), w (A,), b (1,) -> e (B, k, L).

    Autograd's plain expression keeps the (B, k, L, A) activation of every step and makes
    several passes over tensors of that size in the backward (the outer product with w,
    tanh's derivative, the sums over k and L); at the paper's sizes that is some 13 MB a pass
    and most of the attention's time. Here nothing of that size is kept: the backward
    recomputes s = sigmoid(2u), u = keys + q, block by block while it sits in cache, and
    uses tanh(u) = 2 s - 1, d tanh(u) / du = 4 s (1 - s)."""

    @staticmethod
    def forward(ctx, keys: torch.Tensor, q: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(keys, q, w)
        return _additive_blocked_w(keys, q, w, b)

    @staticmethod
    def backward(ctx, de: torch.Tensor):
        keys, q, w = ctx.saved_tensors
        bsz, n, d = keys.shape
        k = q.shape[1]
        rows = max(1, BLOCK_BYTES // (k * n * d * keys.element_size()))
        de = de.contiguous()
        dkeys = torch.empty_like(keys)
        dq = torch.empty_like(q)
        ds_sum = keys.new_zeros(d)  # sum over (B, k, L) of de * s
        # One query an image (training): the block is worked in dkeys itself, which it ends as.
        buf = keys.new_empty(min(rows, bsz), k, n, d) if k > 1 else None
        q2, k2, w4 = (2 * q).unsqueeze(2), keys.unsqueeze(1), 4 * w
        for i in range(0, bsz, rows):
            j = min(i + rows, bsz)
            s = buf[: j - i] if buf is not None else dkeys[i:j].unsqueeze(1)
            torch.add(q2[i:j], k2[i:j], alpha=2, out=s)
            s.sigmoid_()  # (b, k, L, A)
            de_blk = de[i:j]  # (b, k, L)
            # (b, 1, k L) x (b, k L, A), summed over the block's images
            ds_sum += _per_image_mm(de_blk.reshape(j - i, 1, k * n), s.view(j - i, k * n, d)).sum((0, 1))
            s.addcmul_(s, s, value=-1)  # s (1 - s)
            s.mul_(de_blk.unsqueeze(-1)).mul_(w4)  # de_u = de * w * 4 s (1 - s)
            if buf is not None:
                torch.sum(s, dim=1, out=dkeys[i:j])  # (b, L, A): the k queries of an image
            torch.sum(s, dim=2, out=dq[i:j])  # (b, k, A)
        dw = 2 * ds_sum - de.sum()  # e = 2 w^T s - sum(w) + b
        return dkeys, dq, dw, de.sum().reshape(1)


class Attention(nn.Module):
    def __init__(self, key_dim: int, query_dim: int, attn_dim: int, *, score: str = "additive",
                 normalizer: str = "softmax", mode: str = "soft", local_window: float = 0.0,
                 local_width: str = "fixed", project_query: bool = False):
        """``project_query``: the dot-product scores (dot, scaled_dot, cosine) project the query
        even when its size is the key size (the heads of a multi-head attention differ by it)."""
        super().__init__()
        if score not in SCORES:
            raise ValueError(f"unknown attention score {score!r}; choose from {', '.join(SCORES)}")
        if normalizer not in NORMALIZERS:
            raise ValueError(f"unknown normalizer {normalizer!r}; choose from {', '.join(NORMALIZERS)}")
        if mode not in MODES:
            raise ValueError(f"unknown attention mode {mode!r}; choose from {', '.join(MODES)}")
        if local_width not in LOCAL_WIDTHS:
            raise ValueError(f"unknown local_width {local_width!r}; choose from {', '.join(LOCAL_WIDTHS)}")
        if local_width == "learned" and not local_window > 0:
            raise ValueError("local_width 'learned' needs local_window > 0 (its starting half-width, in cells)")
        self.score, self.normalizer, self.mode = score, normalizer, mode
        self.local_window = float(local_window)
        self.local_width = local_width
        self.num_heads = 1
        self.key_dim = key_dim
        if score == "additive":
            self.key_proj = nn.Linear(key_dim, attn_dim)  # W_a, applied once per image
            self.query_proj = nn.Linear(query_dim, attn_dim)  # W_h
            self.v = nn.Linear(attn_dim, 1)  # w
        elif score == "concat":
            self.joint = nn.Linear(query_dim + key_dim, attn_dim)  # W [h; a_i]
            self.v = nn.Linear(attn_dim, 1)
        elif score == "general":
            self.bilinear = nn.Linear(key_dim, query_dim, bias=False)  # W a_i, once per image
        elif score in ("dot", "scaled_dot", "cosine") and (query_dim != key_dim or project_query):
            self.query_proj = nn.Linear(query_dim, key_dim, bias=False)  # sizes differ: project h
        if score == "cosine":
            self.log_temperature = nn.Parameter(torch.zeros(()))  # log tau: tau = 1 at the start
        if self.local_window > 0:
            # (row, col) of the centre, and with a learned width its half-width's softplus input
            outputs = 3 if local_width == "learned" else 2
            self.centre = nn.Sequential(nn.Linear(query_dim, attn_dim), nn.Tanh(), nn.Linear(attn_dim, outputs))
            if local_width == "learned":
                # half-width = MIN + softplus(raw): exactly local_window for every query at the start
                start = max(self.local_window - MIN_HALF_WIDTH, 1e-3)
                with torch.no_grad():
                    self.centre[2].weight[2].zero_()
                    self.centre[2].bias[2] = _inverse_softplus(start)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "log_temperature"
        if self.score == "cosine" and key not in state_dict:
            # Saved before cosine had a temperature: tau = 1, the scores it was trained with.
            state_dict[key] = torch.zeros(())
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def prepare(self, a: torch.Tensor) -> torch.Tensor:
        """Per-image part of the score: (B, L, D) -> keys (B, L, K)."""
        if self.score == "additive":
            return self.key_proj(a)  # (B, L, A)
        if self.score == "general":
            return self.bilinear(a)  # (B, L, Q)
        if self.score == "cosine":
            return F.normalize(a, dim=-1)
        return a

    def scores(self, keys: torch.Tensor, a: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """e_ti = f_att(a_i, h_{t-1}): keys (B, L, K), a (B, L, D), h (B*k, Q) -> (B*k, L)."""
        b, n = a.shape[:2]
        hq = h.view(b, -1, h.shape[-1])  # (B, k, Q): the k queries of each image
        return self._scores(keys, a, hq).reshape(-1, n)

    def _scores(self, keys: torch.Tensor, a: torch.Tensor, hq: torch.Tensor) -> torch.Tensor:
        """(B, k, L) from queries grouped by image, hq (B, k, Q)."""
        if self.score == "additive":
            q = self.query_proj(hq)  # (B, k, A)
            if _blocked_ok(keys, q):
                return _additive_blocked(keys, q, self.v)
            if _grad_blocked_ok(keys, q):
                return _AdditiveScore.apply(keys, q, self.v.weight[0], self.v.bias)
            return self.v(torch.tanh(keys.unsqueeze(1) + q.unsqueeze(2))).squeeze(-1)
        if self.score == "concat":
            k, n = hq.shape[1], a.shape[1]
            joint = torch.cat([hq.unsqueeze(2).expand(-1, -1, n, -1), a.unsqueeze(1).expand(-1, k, -1, -1)], dim=-1)
            return self.v(torch.tanh(self.joint(joint))).squeeze(-1)  # (B, k, L)
        if self.score == "general":
            return torch.einsum("blq,bkq->bkl", keys, hq)
        q = self.query_proj(hq) if hasattr(self, "query_proj") else hq  # (B, k, D)
        if self.score == "cosine":
            scale = torch.exp(-self.log_temperature.clamp(min=math.log(MIN_TEMPERATURE)))  # 1 / tau
            return torch.einsum("bld,bkd->bkl", keys, F.normalize(q, dim=-1)) * scale
        e = torch.einsum("bld,bkd->bkl", keys, q)
        return e / math.sqrt(self.key_dim) if self.score == "scaled_dot" else e

    def weights(self, keys: torch.Tensor, a: torch.Tensor, h: torch.Tensor,
                grid: tuple[int, int]) -> torch.Tensor:
        """alpha_t: (B*k, L), non-negative, summing to 1."""
        if self.mode == "mean":
            return a.new_full((h.shape[0], a.shape[1]), 1.0 / a.shape[1])
        e = self.scores(keys, a, h)
        if self.local_window > 0:
            return self._local(e, h, grid)
        return torch.softmax(e, dim=-1) if self.normalizer == "softmax" else sparsemax(e, dim=-1)

    def _log_window(self, h: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """log of the 2-D Gaussian window, -d^2 / (2 sigma^2): (B, L). The centre is
        p_t = grid * sigmoid(v^T tanh(W h)) per axis, in cell units (cell i spans [i, i+1]);
        sigma is half the half-width: local_window, or with a learned width
        MIN_HALF_WIDTH + softplus(the centre network's third output), per query."""
        gh, gw = grid
        size = torch.tensor([gh, gw], device=h.device, dtype=h.dtype)
        out = self.centre(h)  # (B, 2) or (B, 3)
        centre = size * torch.sigmoid(out[:, :2])  # (B, 2) in cell units, (row, col)
        rows = torch.arange(gh, device=h.device, dtype=h.dtype) + 0.5
        cols = torch.arange(gw, device=h.device, dtype=h.dtype) + 0.5
        d2 = (rows.view(1, gh, 1) - centre[:, 0].view(-1, 1, 1)) ** 2 + \
             (cols.view(1, 1, gw) - centre[:, 1].view(-1, 1, 1)) ** 2  # (B, H, W)
        if self.local_width == "learned":
            sigma = ((MIN_HALF_WIDTH + F.softplus(out[:, 2])) / 2).view(-1, 1, 1)  # (B, 1, 1) cells
        else:
            sigma = self.local_window / 2
        return (-d2 / (2 * sigma**2)).flatten(1)

    def _local(self, e: torch.Tensor, h: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """Local attention in 2-D: alpha'_i = alpha_i * exp(-d_i^2 / (2 sigma^2)), sigma =
        half-width / 2, renormalised; computed in the log domain so that a narrow window or
        peaked scores cannot underflow every product to zero."""
        log_window = self._log_window(h, grid)  # (B, L)
        if self.normalizer == "softmax":
            # softmax(e) * window, renormalised, is exactly softmax(e + log window).
            return torch.softmax(e + log_window, dim=-1)
        alpha = sparsemax(e, dim=-1)
        # Rescale the window so that its largest value on the support of alpha is 1 (the
        # scale cancels in the renormalisation); then the weighted total is never below the
        # smallest non-zero alpha, and alpha' keeps the exact zeros of alpha.
        shift = log_window.masked_fill(alpha <= 0, float("-inf")).amax(-1, keepdim=True).detach()
        window = torch.exp((log_window - shift).clamp_max(0.0))
        weighted = alpha * window
        total = weighted.sum(-1, keepdim=True)
        tiny = torch.finfo(alpha.dtype).tiny
        # Only if even that underflows: fall back to the window itself.
        fallback = torch.softmax(log_window, dim=-1)
        return torch.where(total > tiny, weighted / total.clamp_min(tiny), fallback)

    def forward(self, keys: torch.Tensor, a: torch.Tensor, h: torch.Tensor, grid: tuple[int, int],
                *, sample: bool = False, argmax: bool = False,
                generator: torch.Generator | None = None) -> AttentionStep:
        """One step: keys and a hold B images, h holds B*k queries (k per image, image-major).
        Hard mode: ``sample`` draws s_t ~ Multinoulli(alpha_t) and returns a_{s_t};
        ``argmax`` returns the most likely location's a_i; otherwise (and in soft mode) the
        expected context sum_i alpha_i a_i."""
        alpha = self.weights(keys, a, h, grid)  # (B*k, L)
        b, n, d = a.shape
        if self.mode == "hard" and (sample or argmax):
            image = torch.div(torch.arange(h.shape[0], device=a.device), h.shape[0] // b, rounding_mode="floor")
            if not sample:
                s = alpha.argmax(-1)
                return AttentionStep(a[image, s], alpha, s)
            s = torch.multinomial(alpha.detach(), 1, generator=generator).squeeze(1)  # (B*k,)
            context = a[image, s]  # (B*k, D): exactly one a_i
            log_alpha = torch.log(alpha.clamp_min(1e-12))
            log_p = log_alpha.gather(1, s.unsqueeze(1)).squeeze(1)
            entropy = -(alpha * log_alpha).sum(-1)
            return AttentionStep(context, alpha, s, log_p, entropy)
        # (B, k, L) x (B, L, D) -> (B, k, D): every image's annotations read once for its k queries
        context = torch.bmm(alpha.view(b, -1, n), a).view(-1, d)
        return AttentionStep(context, alpha)
