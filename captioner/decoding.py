"""Greedy and beam-search decoding, batched across images.

Legend: B images, k beams, L locations, V vocabulary, T steps.

Beam search runs B images x k beams as one (B*k)-row tensor program. A beam that has
emitted <end> is kept, frozen: it may only continue with <pad> at zero cost, so it still
competes with the open beams. The search stops when every beam has ended or at
``max_len`` steps; with no <end> by then, the best open beam is returned (no crash).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .encoders import Annotations
from .model import Decoder


@dataclass
class CaptionResult:
    """A caption and, for every word, where the model looked."""

    words: list[str]
    alphas: torch.Tensor  # (T, H, W), T = len(words); each map sums to 1
    betas: torch.Tensor  # (T,) the gate beta_t of each word's step
    score: float  # log-probability of the whole caption (its end token included, if any)

    @property
    def caption(self) -> str:
        return " ".join(self.words)

    def to_json(self, image: str | None = None, with_attention: bool = False, digits: int = 4) -> dict:
        out: dict = {} if image is None else {"image": image}
        out.update(caption=self.caption, words=list(self.words), score=round(float(self.score), digits))
        if with_attention:
            out["alphas"] = torch.round(self.alphas.float(), decimals=digits).tolist()
            out["betas"] = torch.round(self.betas.float(), decimals=digits).tolist()
        return out


@dataclass
class DecodedIds:
    """Raw decoder output for one image, before the vocabulary turns ids into words."""

    ids: list[int]  # generated token ids, without <start>; ends with <end> if it ended
    alphas: torch.Tensor  # (len(ids), L)
    betas: torch.Tensor  # (len(ids),)
    score: float


HARD_INFERENCE = ("expected", "argmax", "sample")


def _hard_kwargs(hard: str) -> dict:
    """How a hard-attention model picks its context at inference (soft models ignore it)."""
    if hard not in HARD_INFERENCE:
        raise ValueError(f"hard attention inference must be one of {', '.join(HARD_INFERENCE)}, got {hard!r}")
    return {"argmax": hard == "argmax", "sample": hard == "sample"}


@torch.no_grad()
def greedy(decoder: Decoder, ann: Annotations, *, start: int, end: int, pad: int,
           max_len: int, hard: str = "expected") -> list[DecodedIds]:
    a = ann.vectors
    kw = _hard_kwargs(hard)
    b = a.shape[0]
    keys = decoder.attention.prepare(a)
    h, c = decoder.init_state(a)
    y = torch.full((b,), start, dtype=torch.long, device=a.device)
    done = torch.zeros(b, dtype=torch.bool, device=a.device)
    ids, alphas, betas, logps = [], [], [], []
    for _ in range(max_len):
        o = decoder.step(y, h, c, a, keys, ann.grid, **kw)
        h, c = o.h, o.c
        logp = _never_emit(F.log_softmax(o.logits.float(), dim=-1), start, pad)
        y = logp.argmax(-1)
        ids.append(y)
        alphas.append(o.alpha)
        betas.append(o.beta)
        logps.append(torch.where(done, torch.zeros_like(y, dtype=logp.dtype), logp.gather(1, y[:, None]).squeeze(1)))
        done = done | (y == end)
        if bool(done.all()):
            break
    ids_t = torch.stack(ids, 1)  # (B, T)
    alphas_t, betas_t = torch.stack(alphas, 1), torch.stack(betas, 1)  # (B, T, L), (B, T)
    total = torch.stack(logps, 1).sum(1)
    return [_trim(ids_t[i].tolist(), alphas_t[i], betas_t[i], float(total[i]), end) for i in range(b)]


@torch.no_grad()
def beam_search(decoder: Decoder, ann: Annotations, *, start: int, end: int, pad: int, beam_size: int,
                max_len: int, length_penalty: float = 0.0, hard: str = "expected") -> list[DecodedIds]:
    """``length_penalty`` > 0 ranks finished captions by score / length**length_penalty.

    B images x k beams run as one tensor program; the k beams of an image share one copy of
    its annotations and keys. Each step records, per beam, its word, the beam it extends and
    the attention map it was computed with; a caption is read back along these pointers when
    its image is done, so no history is copied as beams are reordered. An image leaves the
    batch as soon as all its beams have ended: the remaining steps only cost what is still
    being decoded."""
    kw = _hard_kwargs(hard)
    if beam_size < 1:
        raise ValueError("beam_size must be >= 1")
    a = ann.vectors
    b, n, _ = a.shape
    k = beam_size
    dev = a.device
    keys = decoder.attention.prepare(a)  # once per image, shared by its beams
    h, c = decoder.init_state(a)
    h, c = h.repeat_interleave(k, 0), c.repeat_interleave(k, 0)  # (B*k, H)

    scores = torch.full((b, k), float("-inf"), device=dev)
    scores[:, 0] = 0.0  # all beams start identical: let only the first one expand
    finished = torch.zeros(b, k, dtype=torch.bool, device=dev)
    lengths = torch.zeros(b, k, dtype=torch.long, device=dev)
    # Per step, indexed by the original image: the chosen words, the beam each extends
    # (its parent) and the maps and gates the parents' step computed.
    words = torch.full((max_len, b, k), pad, dtype=torch.long, device=dev)
    parents = torch.zeros(max_len, b, k, dtype=torch.long, device=dev)
    alpha_steps = torch.zeros(max_len, b, k, n, device=dev)
    beta_steps = torch.zeros(max_len, b, k, device=dev)
    y = torch.full((b * k,), start, dtype=torch.long, device=dev)
    active = torch.arange(b, device=dev)  # original index of each image still in the batch
    out: list[DecodedIds | None] = [None] * b

    def emit(rows: torch.Tensor, last: int) -> None:
        """Store the best caption of these (batch-relative) images, read back from step ``last``."""
        sc, fin, ln = scores[rows], finished[rows], lengths[rows]
        rank = sc / ln.clamp_min(1).float() ** length_penalty if length_penalty > 0 else sc.clone()
        # A caption that ended beats one cut off by the length limit.
        rank = torch.where(fin.any(1, keepdim=True) & ~fin, torch.full_like(rank, float("-inf")), rank)
        best = rank.argmax(1)
        img = active[rows]
        ids = torch.empty(len(img), last + 1, dtype=torch.long, device=dev)
        alphas = torch.empty(len(img), last + 1, n, device=dev)
        betas = torch.empty(len(img), last + 1, device=dev)
        j = best
        for t in range(last, -1, -1):
            ids[:, t] = words[t, img, j]
            j = parents[t, img, j]
            alphas[:, t], betas[:, t] = alpha_steps[t, img, j], beta_steps[t, img, j]
        m = ln.gather(1, best[:, None]).squeeze(1).tolist()
        score = sc.gather(1, best[:, None]).squeeze(1).tolist()
        for r, i in enumerate(img.tolist()):
            out[i] = _trim(ids[r, :m[r]].tolist(), alphas[r, :m[r]], betas[r, :m[r]], score[r], end)

    for t in range(max_len):
        bb = len(active)
        o = decoder.step(y, h, c, a, keys, ann.grid, **kw)
        logp = _never_emit(F.log_softmax(o.logits.float(), dim=-1), start, pad).view(bb, k, -1)  # (b', k, V)
        v = logp.shape[-1]
        frozen = torch.full_like(logp[0, 0], float("-inf"))
        frozen[pad] = 0.0
        logp = torch.where(finished.unsqueeze(-1), frozen, logp)
        cand = (scores.unsqueeze(-1) + logp).view(bb, k * v)  # (b', k*V)
        scores, idx = cand.topk(k, dim=1)  # (b', k)
        beam = torch.div(idx, v, rounding_mode="floor")  # the parent beam of each new beam
        word = idx % v
        words[t, active], parents[t, active] = word, beam
        alpha_steps[t, active] = o.alpha.view(bb, k, n).float()
        beta_steps[t, active] = o.beta.view(bb, k).float()
        was_finished = finished.gather(1, beam)
        lengths = lengths.gather(1, beam) + (~was_finished).long()
        finished = was_finished | (word == end)
        rows = (torch.arange(bb, device=dev).unsqueeze(1) * k + beam).view(-1)  # (b'*k,) parent rows
        h, c = o.h[rows], o.c[rows]
        y = word.view(-1)
        done = finished.all(1)
        if bool(done.any()):
            emit(done.nonzero().flatten(), t)
            keep = (~done).nonzero().flatten()
            if keep.numel() == 0:
                break
            kept_rows = (keep.unsqueeze(1) * k + torch.arange(k, device=dev)).view(-1)
            active, a, keys = active[keep], a[keep], keys[keep]
            scores, finished, lengths = scores[keep], finished[keep], lengths[keep]
            h, c, y = h[kept_rows], c[kept_rows], y[kept_rows]
    else:
        emit(torch.arange(len(active), device=dev), max_len - 1)  # the length limit: the best of what is there
    return out  # type: ignore[return-value]


def _never_emit(logp: torch.Tensor, *tokens: int) -> torch.Tensor:
    """<start> and <pad> are never words of a caption."""
    logp = logp.clone()
    logp[:, list(tokens)] = float("-inf")
    return logp


def _trim(ids: list[int], alphas: torch.Tensor, betas: torch.Tensor, score: float, end: int) -> DecodedIds:
    if end in ids:
        m = ids.index(end) + 1
        ids, alphas, betas = ids[:m], alphas[:m], betas[:m]
    return DecodedIds(ids, alphas, betas, score)
