"""Fast forms of a few of the model's and the loss's operations, kept apart from the equations.

Each entry point here computes what a plain torch expression beside its equation computes,
with the same values up to float rounding and the same gradients, arranged for speed:
custom autograd functions that keep less for the backward, products from weights laid out
once for oneDNN, loops over cache-sized blocks. What each gains, and how that was measured,
is in docs/benchmarks.md.

    fast form (here)                       plain form (where)                    taken when
    deferred_lstm: the LSTM's [z; h]       torch.addmm(pre, [z; h], W_zh) per    training, a weight of at least
      weight gradient as one product over  step (model.py, Decoder.forward)      DEFERRED_MIN_WEIGHT elements,
      all steps; its per-step product                                            no autocast, step not compiled
      from a packed weight (CPU, fp32)
    additive_scores: w^T tanh(keys + q)    v(tanh(keys + q))                     CPU, no autocast, not compiled;
      + b a block of images at a time      (attention.py, Additive)              without gradient only when large
    sparsemax_gradient: sparsemax's        autograd through the projection       always
      closed-form Jacobian                 (attention.py, sparsemax)
    token_log_prob: log softmax(x)[y]      log_softmax(x).gather(y)              always
      from one log-sum-exp per row         (train/losses.py, token_log_prob)
    channels_last_ok: the encoder's        NCHW (torch's default layout)         training on CUDA with bf16 or
      weights and the images in NHWC       (train/loop.py, open_run;             fp16 autocast, the encoder in
      memory: the same values, in the      inference.py, Captioner.encode)       the step (no feature cache);
      order cuDNN computes them in                                               captioning on CUDA in bf16/fp16
    search_graph: the beam search as one   decoding.beam_search: each image      captioning on CUDA, kernels on,
      fixed program of all steps, its      leaves the batch when it is done,     a deterministic search, the
      captions read once at the end,       a host wait after every step          decoder's step not compiled
      replayed as a CUDA graph
      (captioner/search/graph.py)

The switch: ``CAPTIONER_KERNELS=0`` (or ``false``, ``off``, ``no``) in the environment when
this module is first imported, or ``set_enabled(False)`` from code, turns every fast form
off; each caller then runs its plain form, which is what the equations say. The tests hold
every fast form to its plain form with the switch both ways, and check that with it off a
training step runs no custom autograd function.

Legend: B batch, k queries per image, L locations, A attention size, K and N a weight's
rows and columns, T steps, V vocabulary size.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

ENVIRONMENT_VARIABLE = "CAPTIONER_KERNELS"


def _from_environment() -> bool:
    return os.environ.get(ENVIRONMENT_VARIABLE, "1").strip().lower() not in ("0", "false", "off", "no")


_enabled = _from_environment()


def enabled() -> bool:
    """Whether the fast forms may run: the one switch every caller reads."""
    return _enabled


def set_enabled(on: bool) -> bool:
    """Turn the fast forms on or off from code (over the environment's choice); returns the
    setting it replaces, so that a caller can put it back."""
    global _enabled
    before, _enabled = _enabled, bool(on)
    return before


def channels_last_ok(device: torch.device, dtype: torch.dtype | None) -> bool:
    """May training or captioning put the encoder's weights and its images in channels-last
    (NHWC) memory? On CUDA under bf16 or fp16 autocast: there cuDNN computes convolutions and batch norm in
    NHWC, and on NCHW tensors it turns the layout around each convolution and leaves batch norm
    to a slower kernel of torch's (docs/benchmarks.md, "On a GPU, second session"). Only the
    order of the values in memory changes. ``dtype``: the autocast's, None for fp32."""
    return _enabled and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------- the LSTM's weights

# Weights of at least this many elements get their gradient over all steps at once
# (_DeferredWeightGrad), and on a CPU their product from a packed layout (_PackedWeight):
# the paper's LSTM (2560 x 2048) does, the demo models' do not. A small weight's T gradient
# sums stay in cache, and the deferred form's Python bookkeeping would cost more than it saves.
DEFERRED_MIN_WEIGHT = 1 << 20


def deferred_lstm_ok(w_ih: torch.Tensor, w_hh: torch.Tensor, e: int) -> bool:
    """May the teacher-forced loop take the LSTM's weights through ``deferred_lstm``?
    w_ih (4H, E + D), w_hh (4H, H), e = E: training (the weights need a gradient), no
    autocast, and a [z; h] weight of at least DEFERRED_MIN_WEIGHT elements."""
    return (_enabled and torch.is_grad_enabled() and w_ih.requires_grad
            and (w_ih.shape[1] - e + w_hh.shape[1]) * w_ih.shape[0] >= DEFERRED_MIN_WEIGHT
            and not torch.is_autocast_enabled(w_ih.device.type))


def deferred_lstm(w_ih: torch.Tensor, w_hh: torch.Tensor, e: int, rows: int):
    """The LSTM's weights as the teacher-forced loop uses them, as the plain form's
    ``w_ih[:, :e], cat([w_ih[:, e:], w_hh], 1).t(), torch.addmm``: the embedding's columns
    w_e (4H, E), the [z; h] columns W_zh (D + H, 4H), and the per-step product
    ``product(bias, x, W_zh)`` = bias + x W_zh whose weight gradient is formed once at the
    end of the backward. ``rows``: the steps' batch size."""
    w_e, w_zh = _LSTMWeights.apply(w_ih, w_hh, e)
    return w_e, w_zh, _DeferredWeightGrad(w_zh, rows)


class _DeferredWeightGrad:
    """x_t @ W for every step t of a recurrence, with W's gradient sum_t x_t^T dy_t computed
    once at the end of the backward as one product over all steps, (D + H, T B) x (T B, 4H),
    rather than T products over B rows each added into a (D + H, 4H) buffer: at the paper's
    sizes the T small products and their sums were a tenth of the training step.

    The steps use W without gradient; each links itself to a scalar token made from W, whose
    gradient arrives only after every step's backward has run (the engine counts the uses),
    and that is when W's gradient is formed from what the steps left in ``store``."""

    def __init__(self, w: torch.Tensor, rows: int):
        """w (K, N); ``rows``: the steps' batch size."""
        self.w = w.detach()
        self.store: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.token = _CollectWeightGrad.apply(w, self.store)  # () zero, linked to W
        self.packed = None
        if _packing_ok(self.w):
            try:
                self.packed = _PackedWeight(self.w, rows)
            except RuntimeError:  # oneDNN's private operators as this torch build has them
                pass

    def __call__(self, bias: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """bias + x @ W: bias (B, N), x (B, K) -> (B, N); ``w`` is the W it was made for,
        taken as torch.addmm takes it (the steps use their own detached copy)."""
        return _StepProduct.apply(bias, x, self.w, self.token, self.store, self.packed)


def _packing_ok(w: torch.Tensor) -> bool:
    """May the recurrent product use oneDNN with the weight packed once (CPU, fp32)?"""
    return (w.device.type == "cpu" and w.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and torch.backends.mkldnn.enabled and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class _PackedWeight:
    """W (K, N) laid out once for oneDNN's product, both ways round: x @ W for the steps'
    forward and dy @ W^T for their backward.

    At the paper's sizes each of the 2 T recurrent products is (32, 2560) x (2560, 2048):
    the general product lays out the 21 MB weight again at every call; from the layout made
    once per training step it runs nearer the machine's peak (docs/benchmarks.md has the
    figures). Rounding differs from torch.mm's at the level of float32 sums."""

    def __init__(self, w: torch.Tensor, rows: int):
        reorder = torch.ops.mkldnn._reorder_linear_weight
        self.forward = reorder(w.t().contiguous(), rows)  # as a linear layer's (N, K) weight
        self.backward = reorder(w.contiguous(), rows)  # (K, N): dy @ W^T

    @staticmethod
    def product(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")


class _CollectWeightGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: torch.Tensor, store: list) -> torch.Tensor:
        ctx.store = store
        return w.new_zeros(())

    @staticmethod
    def backward(ctx, _token_grad: torch.Tensor):
        xs, dys = zip(*ctx.store)
        ctx.store.clear()
        # (N, T B) x (T B, K), handed on transposed: (K, N) with N-major storage, the layout
        # of the LSTM's weight matrices, so that _LSTMWeights writes their gradients in one pass
        return (torch.cat(dys).t() @ torch.cat(xs)).t(), None


class _LSTMWeights(torch.autograd.Function):
    """The LSTM's weights as the teacher-forced step uses them: w_ih (4H, E + D), w_hh (4H, H)
    -> the embedding's columns (4H, E) and [z; h]'s, transposed, (D + H, 4H). Its backward
    writes each weight's gradient whole, once; autograd's slices and concatenation would
    zero-fill two (4H, E + D) buffers, copy into them and add them."""

    @staticmethod
    def forward(ctx, w_ih: torch.Tensor, w_hh: torch.Tensor, e: int):
        ctx.shapes = e, w_ih.shape, w_hh.shape
        return w_ih[:, :e].contiguous(), torch.cat([w_ih[:, e:], w_hh], 1).t()

    @staticmethod
    def backward(ctx, d_e: torch.Tensor | None, d_zh: torch.Tensor | None):
        e, ih, hh = ctx.shapes
        ref = d_zh if d_zh is not None else d_e
        if d_e is None:
            d_e = ref.new_zeros(ih[0], e)
        if d_zh is None:
            d_zh = ref.new_zeros(ih[1] - e + hh[1], ih[0])
        g = d_zh.t()  # (4H, D + H); contiguous as _CollectWeightGrad hands it on
        split = ih[1] - e
        return torch.cat([d_e, g[:, :split]], 1), g[:, split:], None


class _StepProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, bias, x, w, token, store, packed):
        ctx.save_for_backward(x, w)
        ctx.store, ctx.packed = store, packed
        if packed is None:
            return torch.addmm(bias, x, w)
        return _PackedWeight.product(x, packed.forward).add_(bias)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w = ctx.saved_tensors
        ctx.store.append((x, dy))
        dx = None
        if ctx.needs_input_grad[1]:
            dx = dy @ w.t() if ctx.packed is None else _PackedWeight.product(dy, ctx.packed.backward)
        return dy, dx, None, dy.new_zeros(()), None, None


# ---------------------------------------------------------------------------- additive scores

# Size of the slice of the (B, k, L, A) additive-attention sum handled at once: about 1 MiB,
# so the sum is made, squashed and reduced while it sits in the CPU's cache.
BLOCK_BYTES = 1 << 20


def additive_ok(keys: torch.Tensor, q: torch.Tensor) -> bool:
    """May the additive scores of keys (B, L, A) and queries q (B, k, A) take
    ``additive_scores``?"""
    return _enabled and (_blocked_ok(keys, q) or _grad_blocked_ok(keys, q))


def additive_scores(keys: torch.Tensor, q: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """e = w^T tanh(keys + q) + b: keys (B, L, A), q (B, k, A), w (A,), b (1,) -> (B, k, L),
    the plain form's ``v(tanh(keys.unsqueeze(1) + q.unsqueeze(2))).squeeze(-1)``, where
    ``additive_ok`` allows it: with a gradient through _AdditiveScore, without one into
    a reused buffer."""
    if torch.is_grad_enabled():
        return _AdditiveScore.apply(keys, q, w, b)
    return _additive_blocked(keys, q, w, b)


def _blocked_ok(keys: torch.Tensor, q: torch.Tensor) -> bool:
    """keys (B, L, A), q (B, k, A): is the sum of the two big enough to block, and may it be?"""
    return (not torch.is_grad_enabled() and keys.device.type == "cpu" and keys.dtype == q.dtype
            and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()
            and keys.numel() * q.shape[1] * keys.element_size() > BLOCK_BYTES)


def _grad_blocked_ok(keys: torch.Tensor, q: torch.Tensor) -> bool:
    """May training's additive scores take the cache-blocked autograd path (CPU, fp32 or fp64)?"""
    return (torch.is_grad_enabled() and keys.device.type == "cpu" and keys.dtype == q.dtype
            and keys.dtype in (torch.float32, torch.float64) and not torch.is_autocast_enabled("cpu")
            and not torch.compiler.is_compiling())


def _additive_blocked(keys: torch.Tensor, q: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """w^T tanh(keys + q) + bias: keys (B, L, A), q (B, k, A), w (A,), bias (1,) -> (B, k, L),
    a few images at a time into one reused buffer. The plain expression writes and rereads
    two (B, k, L, A) tensors per decoding step (at the paper's sizes with beam 3:
    96 x 196 x 512 floats, 38 MB each); this keeps the work in cache. It also uses
    tanh(u) = 2 sigmoid(2u) - 1, so w^T tanh(u) = 2 w^T sigmoid(2u) - sum(w): a CPU's sigmoid
    is faster than its tanh. Same values up to float rounding; no autograd through the buffer."""
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
        return _additive_blocked(keys, q, w, b)

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


# ---------------------------------------------------------------------------- sparsemax


def sparsemax_gradient(z: torch.Tensor, p: torch.Tensor, dim: int) -> torch.Tensor:
    """p = sparsemax(z) along ``dim``, computed without autograd by the caller, given the
    closed-form gradient diag(s) - s s^T / |S| (s the support's indicator) in place of
    autograd's through the sort and the cumulative sum of the projection."""
    return _SparsemaxGradient.apply(z, p, dim)


class _SparsemaxGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor, p: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.save_for_backward(p)
        ctx.dim = dim
        return p

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (p,) = ctx.saved_tensors
        dim = ctx.dim
        support = (p > 0).to(grad.dtype)
        v = (grad * support).sum(dim, keepdim=True) / support.sum(dim, keepdim=True)
        return support * (grad - v), None, None


# ---------------------------------------------------------------------------- the loss's log-probabilities

# Rows of the (N, V) logits handled at once by the log-sum-exp and its gradient: about 1 MiB.
ROW_BLOCK_BYTES = 1 << 20


def token_log_prob(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] along the last dimension: logits (..., V), targets (...)
    -> (...), the plain form's ``log_softmax(logits).gather(targets)`` without the (..., V)
    log-softmax: the forward keeps one log-sum-exp per row, and the backward writes the
    logits' gradient softmax * g - onehot * g in one pass, a block of rows at a time while
    the block is in cache (at COCO sizes the log-softmax and its gradient are two 27 MB
    tensors a step)."""
    v = logits.shape[-1]
    return _TokenLogProb.apply(logits.reshape(-1, v), targets.reshape(-1)).view(targets.shape)


def _exp_shifted_blocks(x: torch.Tensor, shift: torch.Tensor,
                        dest: torch.Tensor | None = None) -> Iterator[tuple[int, int, torch.Tensor]]:
    """exp(x - shift[:, None]) for x (N, V), a cache-sized block of rows at a time: yields
    (i, j, the block of rows i..j), written into ``dest[i:j]`` when given, else into one
    reused buffer, so that each block is shifted, exponentiated and used while in cache."""
    n, v = x.shape
    rows = max(1, ROW_BLOCK_BYTES // (v * x.element_size()))
    buf = x.new_empty(min(rows, n), v) if dest is None else None
    for i in range(0, n, rows):
        j = min(i + rows, n)
        blk = dest[i:j] if dest is not None else buf[: j - i]
        torch.sub(x[i:j], shift[i:j].unsqueeze(1), out=blk)
        yield i, j, blk.exp_()


def _logsumexp_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.logsumexp(x, -1) for x (N, V) with no (N, V) temporary: torch's form writes
    x - max to fresh memory (27 MB a step at COCO sizes)."""
    if not x.is_cpu:
        return torch.logsumexp(x, -1)
    m = x.amax(1)  # (N,)
    # a row of -inf only (every word masked): shift by 0, so that the result is -inf, not nan
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    out = x.new_empty(x.shape[0])
    for i, j, e in _exp_shifted_blocks(x, m):
        torch.sum(e, 1, out=out[i:j])
    return out.log_().add_(m)


class _TokenLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        lse = _logsumexp_rows(logits)  # (N,)
        ctx.save_for_backward(logits, targets, lse)
        return logits.gather(1, targets.unsqueeze(1)).squeeze(1) - lse

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        g = g.contiguous()
        d = torch.empty_like(logits)  # (N, V)
        for i, j, softmax in _exp_shifted_blocks(logits, lse, d):
            softmax.mul_(g[i:j].neg().unsqueeze(1))  # -g softmax
        d.scatter_add_(1, targets.unsqueeze(1), g.unsqueeze(1).to(d.dtype))  # + g at the target
        return d, None


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous tensor that is no view of another (a copy only where it is): the one
    layout a compiled step sees (a view and a copy of the same shape are different inputs to the
    compiler)."""
    return t if t._base is None and t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)
