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

Each score is a small class (``Score``), registered by name (``register_score``) and
chosen once when the module is built; it adds its layers to the module under the names
checkpoints hold. Whatever depends only on the image (W_a a_i and the like) is computed
once per image by ``prepare``, not once per step. The normaliser (``NORMALIZERS``), the
local width (``LOCAL_WIDTHS``) and the mode, the paper's phi (``MODES``), are objects too,
chosen once by name; whoever asks about a mode (the training objective, the config checks,
the app) asks its object (``attention_mode(name).stochastic``), never its name, and the
config's lists of names are these registries' keys.

A step returns every head's map, (B, h, L) with h = 1 here (several heads: multihead.py);
the map alpha is their mean. The fast forms of the additive scores and of sparsemax's
gradient are in kernels.py, behind its switch.

Queries may come k to an image (beam search: k beams per image): h then has B*k rows,
image-major, and each query attends over its own image's annotations and keys, which are
held once per image rather than copied k times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from captioner.model import kernels

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
    alpha_heads: torch.Tensor  # (B, h, L) each head's weights, >= 0, summing to 1; h = 1 for one head
    sample: torch.Tensor | None = None  # hard attention: the sampled location, (B,) one head, (B, h) several
    sample_log_prob: torch.Tensor | None = None  # (B,) log p(s_t | a), with gradient to alpha
    entropy: torch.Tensor | None = None  # (B,) H[alpha_t]

    @property
    def alpha(self) -> torch.Tensor:
        """(B, L) the heads' mean map (one head: its map)."""
        return self.alpha_heads.mean(1)


def sparsemax(scores: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Euclidean projection of ``scores`` onto the probability simplex (Martins & Astudillo 2016):
    p = max(z - tau, 0), tau such that p sums to 1. Its gradient is autograd's through the
    projection, or with the kernels on the same in closed form (kernels.sparsemax_gradient).

    Computed in float32 at least, whatever the scores' dtype, and returned so (as autocast
    does for softmax): in bf16 the sort, the cumulative sums and the threshold round to 8
    bits, and the support and the sum of the map drift."""
    z = scores.to(torch.promote_types(scores.dtype, torch.float32))  # (..., L), float32 or float64
    if kernels.enabled():
        with torch.no_grad():
            p = _simplex_projection(z, dim)
        return kernels.sparsemax_gradient(z, p, dim)
    return _simplex_projection(z, dim)


def _simplex_projection(z: torch.Tensor, dim: int) -> torch.Tensor:
    z = z.transpose(dim, -1)
    z_sorted, _ = torch.sort(z, dim=-1, descending=True)
    k = torch.arange(1, z.shape[-1] + 1, device=z.device, dtype=z.dtype)
    cumsum = z_sorted.cumsum(-1)
    support = 1 + k * z_sorted > cumsum  # the k largest entries stay positive
    k_z = support.sum(-1, keepdim=True)  # support size, >= 1
    tau = (cumsum.gather(-1, k_z - 1) - 1) / k_z.to(z.dtype)
    return torch.clamp(z - tau, min=0).transpose(dim, -1)


# ---------------------------------------------------------------------------- scores

_SCORES: dict[str, type["Score"]] = {}


def register_score(name: str):
    """Class decorator: the score class chosen by ``score = name``."""
    def deco(cls):
        cls.name = name
        _SCORES[name] = cls
        return cls
    return deco


class Score:
    """A score function e_i = f_att(a_i, h), the ``score`` option, chosen once by name.

    It adds its layers to the attention module that uses it, under the names checkpoints
    hold, and reads them from there (``att``): ``prepare`` computes what depends on the
    image alone, once per image; a call scores the queries of a step."""

    name: str

    def __init__(self, key_dim: int, query_dim: int, attn_dim: int, *, project_query: bool = False):
        self.key_dim, self.query_dim, self.attn_dim = key_dim, query_dim, attn_dim
        self.project_query = project_query

    def build(self, att: nn.Module) -> None:
        """Add the score's layers to ``att``."""

    def prepare(self, att: nn.Module, a: torch.Tensor) -> torch.Tensor:
        """Per-image part of the score: (B, L, D) -> keys (B, L, K)."""
        return a

    def __call__(self, att: nn.Module, keys: torch.Tensor, a: torch.Tensor, hq: torch.Tensor) -> torch.Tensor:
        """e: keys (B, L, K), a (B, L, D), queries grouped by image hq (B, k, Q) -> (B, k, L)."""
        raise NotImplementedError


@register_score("additive")
class Additive(Score):
    """Show, Attend and Tell's f_att: w^T tanh(W_a a_i + W_h h)."""

    def build(self, att: nn.Module) -> None:
        att.key_proj = nn.Linear(self.key_dim, self.attn_dim)  # W_a, applied once per image
        att.query_proj = nn.Linear(self.query_dim, self.attn_dim)  # W_h
        att.v = nn.Linear(self.attn_dim, 1)  # w

    def prepare(self, att: nn.Module, a: torch.Tensor) -> torch.Tensor:
        return att.key_proj(a)  # (B, L, A)

    def __call__(self, att: nn.Module, keys: torch.Tensor, a: torch.Tensor, hq: torch.Tensor) -> torch.Tensor:
        q = att.query_proj(hq)  # (B, k, A)
        if kernels.additive_ok(keys, q):
            return kernels.additive_scores(keys, q, att.v.weight[0], att.v.bias)
        return att.v(torch.tanh(keys.unsqueeze(1) + q.unsqueeze(2))).squeeze(-1)


@register_score("concat")
class Concat(Score):
    """v^T tanh(W [h; a_i]), built literally per step."""

    def build(self, att: nn.Module) -> None:
        att.joint = nn.Linear(self.query_dim + self.key_dim, self.attn_dim)  # W [h; a_i]
        att.v = nn.Linear(self.attn_dim, 1)

    def __call__(self, att: nn.Module, keys: torch.Tensor, a: torch.Tensor, hq: torch.Tensor) -> torch.Tensor:
        k, n = hq.shape[1], a.shape[1]
        joint = torch.cat([hq.unsqueeze(2).expand(-1, -1, n, -1), a.unsqueeze(1).expand(-1, k, -1, -1)], dim=-1)
        return att.v(torch.tanh(att.joint(joint))).squeeze(-1)  # (B, k, L)


@register_score("dot")
class Dot(Score):
    """h^T a_i, with h projected to D when the sizes differ (or ``project_query``)."""

    def __init__(self, key_dim: int, query_dim: int, attn_dim: int, *, project_query: bool = False):
        super().__init__(key_dim, query_dim, attn_dim, project_query=project_query)
        self.projects = query_dim != key_dim or project_query

    def build(self, att: nn.Module) -> None:
        if self.projects:
            att.query_proj = nn.Linear(self.query_dim, self.key_dim, bias=False)  # project h

    def query(self, att: nn.Module, hq: torch.Tensor) -> torch.Tensor:
        return att.query_proj(hq) if self.projects else hq  # (B, k, D)

    def __call__(self, att: nn.Module, keys: torch.Tensor, a: torch.Tensor, hq: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bld,bkd->bkl", keys, self.query(att, hq))


@register_score("scaled_dot")
class ScaledDot(Dot):
    """h^T a_i / sqrt(D)."""

    def __call__(self, att: nn.Module, keys: torch.Tensor, a: torch.Tensor, hq: torch.Tensor) -> torch.Tensor:
        return super().__call__(att, keys, a, hq) / math.sqrt(self.key_dim)


@register_score("general")
class General(Score):
    """The bilinear h^T W a_i, W a_i computed once per image."""

    def build(self, att: nn.Module) -> None:
        att.bilinear = nn.Linear(self.key_dim, self.query_dim, bias=False)  # W a_i, once per image

    def prepare(self, att: nn.Module, a: torch.Tensor) -> torch.Tensor:
        return att.bilinear(a)  # (B, L, Q)

    def __call__(self, att: nn.Module, keys: torch.Tensor, a: torch.Tensor, hq: torch.Tensor) -> torch.Tensor:
        return torch.einsum("blq,bkq->bkl", keys, hq)


@register_score("cosine")
class Cosine(Dot):
    """cos(h, a_i) / tau, the temperature tau learned (stored as log tau, starting at 1)."""

    def build(self, att: nn.Module) -> None:
        super().build(att)
        att.log_temperature = nn.Parameter(torch.zeros(()))  # log tau: tau = 1 at the start

    def prepare(self, att: nn.Module, a: torch.Tensor) -> torch.Tensor:
        return F.normalize(a, dim=-1)

    def __call__(self, att: nn.Module, keys: torch.Tensor, a: torch.Tensor, hq: torch.Tensor) -> torch.Tensor:
        scale = torch.exp(-att.log_temperature.clamp(min=math.log(MIN_TEMPERATURE)))  # 1 / tau
        return torch.einsum("bld,bkd->bkl", keys, F.normalize(self.query(att, hq), dim=-1)) * scale


SCORES = tuple(_SCORES)  # the built-in scores, in the order of their definitions


# ---------------------------------------------------------------------------- normalizers

class Normalizer:
    """alpha = normalize(e) over the L locations, the ``normalizer`` option, chosen once by
    name; ``windowed`` is the same under a local window's log-weights (local attention)."""

    name: str

    def __call__(self, e: torch.Tensor) -> torch.Tensor:
        """e (B, L) -> alpha (B, L), non-negative, summing to 1."""
        raise NotImplementedError

    def windowed(self, e: torch.Tensor, log_window: torch.Tensor) -> torch.Tensor:
        """alpha'_i = alpha_i * window_i renormalised: e, log_window (B, L) -> (B, L)."""
        raise NotImplementedError


class Softmax(Normalizer):
    """alpha = softmax(e)."""

    name = "softmax"

    def __call__(self, e: torch.Tensor) -> torch.Tensor:
        return torch.softmax(e, dim=-1)

    def windowed(self, e: torch.Tensor, log_window: torch.Tensor) -> torch.Tensor:
        # softmax(e) * window, renormalised, is exactly softmax(e + log window).
        return torch.softmax(e + log_window, dim=-1)


class Sparsemax(Normalizer):
    """alpha = sparsemax(e): exact zeros."""

    name = "sparsemax"

    def __call__(self, e: torch.Tensor) -> torch.Tensor:
        return sparsemax(e, dim=-1)

    def windowed(self, e: torch.Tensor, log_window: torch.Tensor) -> torch.Tensor:
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


NORMALIZERS: dict[str, Normalizer] = {n.name: n for n in (Softmax(), Sparsemax())}


# ---------------------------------------------------------------------------- local widths

class LocalWidth:
    """The half-width of the local window, the ``local_width`` option, chosen once by name;
    the centre network has ``outputs`` outputs, (row, col) of the centre and what else the
    width needs."""

    name: str
    learned: bool  # predicted per query rather than local_window
    outputs: int

    def start(self, centre: nn.Linear, local_window: float) -> None:
        """Set the centre network's last layer so that the width starts at local_window."""

    def half_width(self, out: torch.Tensor, local_window: float) -> torch.Tensor | float:
        """The centre network's outputs (B, outputs) -> the half-width in cells: a number,
        or (B, 1, 1) one per query."""
        raise NotImplementedError


class FixedWidth(LocalWidth):
    """half-width = local_window."""

    name, learned, outputs = "fixed", False, 2

    def half_width(self, out: torch.Tensor, local_window: float) -> float:
        return local_window


class LearnedWidth(LocalWidth):
    """half-width = MIN_HALF_WIDTH + softplus(the centre network's third output), per query."""

    name, learned, outputs = "learned", True, 3

    def start(self, centre: nn.Linear, local_window: float) -> None:
        # half-width = MIN + softplus(raw): exactly local_window for every query at the start
        start = max(local_window - MIN_HALF_WIDTH, 1e-3)
        with torch.no_grad():
            centre.weight[2].zero_()
            centre.bias[2] = _inverse_softplus(start)

    def half_width(self, out: torch.Tensor, local_window: float) -> torch.Tensor:
        return (MIN_HALF_WIDTH + F.softplus(out[:, 2])).view(-1, 1, 1)  # (B, 1, 1) cells


LOCAL_WIDTHS: dict[str, LocalWidth] = {w.name: w for w in (FixedWidth(), LearnedWidth())}


# ---------------------------------------------------------------------------- modes (phi)

class AttentionMode:
    """phi, the ``attention`` option: how the context z_t = phi({a_i}, {alpha_ti}) is formed
    (the paper's notation), chosen once by name. What depends on the mode is asked of it:

    stochastic  z_t may be one location drawn from alpha_t: REINFORCE trains it (the hard
                objective and the [hard] section), and decoding chooses how it picks its
                context (HARD_INFERENCE: the app's menu, --hard-attention)
    attends     alpha_t comes from the scores; if not, alpha_ti = 1/L for every query: the
                scores' layers take no gradient, the doubly stochastic penalty is a
                constant (skipped), several heads could not differ, nothing is pointed at
    """

    name: str
    stochastic: bool = False
    attends: bool = True

    def context(self, alpha: torch.Tensor, a: torch.Tensor, *, sample: bool = False, argmax: bool = False,
                generator: torch.Generator | None = None) -> AttentionStep:
        """The expected context z_t = sum_i alpha_ti a_i: alpha (B*k, L), a (B, L, D)."""
        b, n, d = a.shape
        # (B, k, L) x (B, L, D) -> (B, k, D): every image's annotations read once for its k queries
        context = torch.bmm(alpha.view(b, -1, n), a).view(-1, d)
        return AttentionStep(context, alpha.unsqueeze(1))


class Soft(AttentionMode):
    """Deterministic soft attention: z_t = sum_i alpha_ti a_i."""

    name = "soft"


class Hard(AttentionMode):
    """Stochastic hard attention: z_t = a_{s_t}, s_t ~ Multinoulli(alpha_t) (``sample``), or
    the most likely location (``argmax``); otherwise the expected context, as soft."""

    name, stochastic = "hard", True

    def context(self, alpha: torch.Tensor, a: torch.Tensor, *, sample: bool = False, argmax: bool = False,
                generator: torch.Generator | None = None) -> AttentionStep:
        if not (sample or argmax):
            return super().context(alpha, a)
        b = a.shape[0]
        image = torch.div(torch.arange(alpha.shape[0], device=a.device), alpha.shape[0] // b, rounding_mode="floor")
        if not sample:
            s = alpha.argmax(-1)
            return AttentionStep(a[image, s], alpha.unsqueeze(1), s)
        s = torch.multinomial(alpha.detach(), 1, generator=generator).squeeze(1)  # (B*k,)
        context = a[image, s]  # (B*k, D): exactly one a_i
        log_alpha = torch.log(alpha.clamp_min(1e-12))
        log_p = log_alpha.gather(1, s.unsqueeze(1)).squeeze(1)
        entropy = -(alpha * log_alpha).sum(-1)
        return AttentionStep(context, alpha.unsqueeze(1), s, log_p, entropy)


class Mean(AttentionMode):
    """No attention: alpha_ti = 1/L, z_t = mean_i a_i (the baseline that shows what attention adds)."""

    name, attends = "mean", False


MODES: dict[str, AttentionMode] = {m.name: m for m in (Soft(), Hard(), Mean())}


@dataclass(frozen=True)
class HardInference:
    """How a stochastic mode picks its context at inference, one of ``HARD_INFERENCE``."""

    sample: bool  # s_t ~ Multinoulli(alpha_t)
    argmax: bool  # the most likely location
    describes: str  # in words, for a menu


# "expected" (the default): the alpha-weighted mean of the annotations, the deterministic
# expectation a hard model is also trained on (half of its minibatches).
HARD_INFERENCE: dict[str, HardInference] = {
    "expected": HardInference(sample=False, argmax=False, describes="the expected mix of regions"),
    "argmax": HardInference(sample=False, argmax=True, describes="the most likely region"),
    "sample": HardInference(sample=True, argmax=False, describes="a random draw"),
}

# The names, once: ModelConfig's fields are annotated with these (a training config is checked
# against them), derived from the registries so that the lists cannot drift apart.
ScoreName = Literal[SCORES]
NormalizerName = Literal[tuple(NORMALIZERS)]
ModeName = Literal[tuple(MODES)]
LocalWidthName = Literal[tuple(LOCAL_WIDTHS)]


def _chosen(registry: dict, name: str, what: str):
    """``registry[name]``, or a one-line ValueError naming the choices."""
    if not isinstance(name, str) or name not in registry:
        raise ValueError(f"unknown {what} {name!r}; choose from {', '.join(registry)}")
    return registry[name]


def attention_mode(name: str) -> AttentionMode:
    """The mode (phi) named ``name``: what a config's ``model.attention`` names."""
    return _chosen(MODES, name, "attention mode")


class OptionName:
    """A read-only attribute: the ``name`` of the option object an attention holds in ``held``
    (its score, normaliser, mode or width), as configs and checkpoints write it."""

    def __init__(self, held: str):
        self.held = held

    def __get__(self, obj, owner=None):
        return self if obj is None else getattr(obj, self.held).name


class FirstHead:
    """A read-only attribute of a multi-head attention: its first head's attribute of the same
    name (the heads share their options)."""

    def __set_name__(self, owner, name: str):
        self.name = name

    def __get__(self, obj, owner=None):
        return self if obj is None else getattr(obj.heads[0], self.name)


class Attention(nn.Module):
    def __init__(self, key_dim: int, query_dim: int, attn_dim: int, *, score: str = "additive",
                 normalizer: str = "softmax", mode: str = "soft", local_window: float = 0.0,
                 local_width: str = "fixed", project_query: bool = False):
        """``project_query``: the dot-product scores (dot, scaled_dot, cosine) project the query
        even when its size is the key size (the heads of a multi-head attention differ by it)."""
        super().__init__()
        score_class = _chosen(_SCORES, score, "attention score")
        self.normalize = _chosen(NORMALIZERS, normalizer, "normalizer")
        self.phi = attention_mode(mode)
        self.width = _chosen(LOCAL_WIDTHS, local_width, "local_width")
        if self.width.learned and not local_window > 0:
            raise ValueError(f"local_width {local_width!r} needs local_window > 0 (its starting half-width, in cells)")
        self.local_window = float(local_window)
        self.num_heads = 1
        self.key_dim = key_dim
        self.f_att = score_class(key_dim, query_dim, attn_dim, project_query=project_query)
        self.f_att.build(self)
        if self.local_window > 0:
            # (row, col) of the centre, and what the width needs
            self.centre = nn.Sequential(nn.Linear(query_dim, attn_dim), nn.Tanh(),
                                        nn.Linear(attn_dim, self.width.outputs))
            self.width.start(self.centre[2], self.local_window)
        if not self.phi.attends:
            # The mean map never reads the scores: their layers stay in the state dict (files load
            # either way) but take no gradient, so that DistributedDataParallel, which waits for a
            # gradient of every parameter that wants one, does not wait for theirs.
            self.requires_grad_(False)

    # The options' names, as configs and checkpoints write them.
    score, normalizer, mode, local_width = (OptionName(held) for held in ("f_att", "normalize", "phi", "width"))

    def prepare(self, a: torch.Tensor) -> torch.Tensor:
        """Per-image part of the score: (B, L, D) -> keys (B, L, K)."""
        return self.f_att.prepare(self, a)

    def scores(self, keys: torch.Tensor, a: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """e_ti = f_att(a_i, h_{t-1}): keys (B, L, K), a (B, L, D), h (B*k, Q) -> (B*k, L)."""
        b, n = a.shape[:2]
        hq = h.view(b, -1, h.shape[-1])  # (B, k, Q): the k queries of each image
        return self.f_att(self, keys, a, hq).reshape(-1, n)

    def weights(self, keys: torch.Tensor, a: torch.Tensor, h: torch.Tensor,
                grid: tuple[int, int]) -> torch.Tensor:
        """alpha_t: (B*k, L), non-negative, summing to 1."""
        if not self.phi.attends:  # alpha_ti = 1/L
            return a.new_full((h.shape[0], a.shape[1]), 1.0 / a.shape[1])
        e = self.scores(keys, a, h)
        if self.local_window > 0:
            return self._local(e, h, grid)
        return self.normalize(e)

    def head_weights(self, keys: torch.Tensor, a: torch.Tensor, h: torch.Tensor,
                     grid: tuple[int, int]) -> torch.Tensor:
        """alpha_t as the one head's map: (B*k, 1, L)."""
        return self.weights(keys, a, h, grid).unsqueeze(1)

    def _log_window(self, h: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """log of the 2-D Gaussian window, -d^2 / (2 sigma^2): (B, L). The centre is
        p_t = grid * sigmoid(v^T tanh(W h)) per axis, in cell units (cell i spans [i, i+1]);
        sigma is half the half-width: local_window, or with a learned width
        MIN_HALF_WIDTH + softplus(the centre network's third output), per query."""
        gh, gw = grid
        out = self.centre(h)  # (B, 2) or (B, 3)
        unit = torch.sigmoid(out[:, :2])  # (B, 2) in [0, 1], (row, col)
        centre = torch.stack([unit[:, 0] * gh, unit[:, 1] * gw], dim=1)  # in cell units; no host tensor to copy
        rows = torch.arange(gh, device=h.device, dtype=h.dtype) + 0.5
        cols = torch.arange(gw, device=h.device, dtype=h.dtype) + 0.5
        d2 = (rows.view(1, gh, 1) - centre[:, 0].view(-1, 1, 1)) ** 2 + \
             (cols.view(1, 1, gw) - centre[:, 1].view(-1, 1, 1)) ** 2  # (B, H, W)
        sigma = self.width.half_width(out, self.local_window) / 2  # a number, or (B, 1, 1) cells
        return (-d2 / (2 * sigma**2)).flatten(1)

    def _local(self, e: torch.Tensor, h: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """Local attention in 2-D: alpha'_i = alpha_i * exp(-d_i^2 / (2 sigma^2)), sigma =
        half-width / 2, renormalised; computed in the log domain so that a narrow window or
        peaked scores cannot underflow every product to zero (``Normalizer.windowed``)."""
        return self.normalize.windowed(e, self._log_window(h, grid))  # (B, L)

    def forward(self, keys: torch.Tensor, a: torch.Tensor, h: torch.Tensor, grid: tuple[int, int],
                *, sample: bool = False, argmax: bool = False,
                generator: torch.Generator | None = None) -> AttentionStep:
        """One step: keys and a hold B images, h holds B*k queries (k per image, image-major):
        alpha_t, then z_t = phi({a_i}, {alpha_ti}). Hard mode: ``sample`` draws
        s_t ~ Multinoulli(alpha_t) and returns a_{s_t}; ``argmax`` returns the most likely
        location's a_i; otherwise (and in soft mode) the expected context sum_i alpha_i a_i."""
        alpha = self.weights(keys, a, h, grid)  # (B*k, L)
        return self.phi.context(alpha, a, sample=sample, argmax=argmax, generator=generator)
