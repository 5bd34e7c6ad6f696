"""Greedy and beam search in numpy, for the torch-free runtime (captioner.onnx).

The same searches as captioner.decoding, rule for rule (read its docstrings for the why):
<start> and <pad> are never emitted; ``max_len`` counts words, and after the ``max_len``-th
word only <end> may come; beam search keeps k open beams and, apart from them, a pool of the
best k finished captions, and an image is done only when no open beam can still beat the
pool's N-th best (N = ``num_captions``; N = 1: its best), or at the length limit. Only the
decoder step differs: a function (an ONNX graph's session) taking one row per open beam.

Legend: B images, k beams, N = B*k rows, L locations, D annotation size, A attention size,
V vocabulary, h attention heads, T steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

# (word (N,), h (N, H), c (N, H), annotations (N, L, D), keys (N, L, A))
#   -> log_probs (N, V), h, c, alpha (N, h, L), beta (N,)
Step = Callable[..., tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]
NINF = np.float32(-np.inf)


@dataclass
class Decoded:
    """One image's caption as ids, as decoding.DecodedIds holds it, in numpy."""

    ids: list[int]  # without <start>; ends with <end> if it ended
    heads: np.ndarray  # (len(ids), h, L)
    betas: np.ndarray  # (len(ids),)
    score: float
    log_probs: np.ndarray  # (len(ids),)
    runners_up: list["Decoded"] = field(default_factory=list)


def _check(max_len: int) -> None:
    if not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len counts the words of a caption and must be >= 1, got {max_len!r}")


def _never_emit(logp: np.ndarray, *tokens: int) -> np.ndarray:
    logp = logp.copy()
    logp[:, list(tokens)] = NINF
    return logp


def _only_end(logp: np.ndarray, end: int) -> np.ndarray:
    out = np.full_like(logp, NINF)
    out[:, end] = logp[:, end]
    return out


def _trim(ids: list[int], heads: np.ndarray, betas: np.ndarray, score: float, end: int, pad: int,
          log_probs: np.ndarray) -> Decoded:
    m = ids.index(end) + 1 if end in ids else ids.index(pad) if pad in ids else len(ids)
    return Decoded(ids[:m], heads[:m], betas[:m], score, log_probs[:m])


def _topk(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest of each row, largest first (ties: the lower index first)."""
    return np.argsort(-x, axis=1, kind="stable")[:, :k]


def greedy(step: Step, ann: np.ndarray, keys: np.ndarray, h: np.ndarray, c: np.ndarray, *, start: int, end: int,
           pad: int, max_len: int) -> list[Decoded]:
    """The most likely next word at every step, up to ``max_len`` words and <end>."""
    _check(max_len)
    b = len(ann)
    rows = np.arange(b)
    y = np.full(b, start, dtype=np.int64)
    done = np.zeros(b, dtype=bool)
    ids, heads, betas, logps = [], [], [], []
    for t in range(max_len + 1):
        logp, h, c, alpha, beta = step(y, h, c, ann, keys)
        logp = _never_emit(logp, start, pad)
        if t == max_len:
            logp = _only_end(logp, end)
        y = logp.argmax(-1)
        counted = ~done
        if t == max_len:  # <end> cannot come (p = 0): the caption is cut off at max_len words
            counted = counted & np.isfinite(logp[:, end])
            y = np.where(counted, y, pad)
        ids.append(y)
        heads.append(alpha)
        betas.append(beta)
        logps.append(np.where(counted, logp[rows, y], np.float32(0)))
        done = done | (y == end)
        if done.all():
            break
    ids_ = np.stack(ids, 1).tolist()  # (B, T)
    heads_, betas_, logps_ = np.stack(heads, 1), np.stack(betas, 1), np.stack(logps, 1).astype(np.float32)
    total = logps_.sum(1, dtype=np.float32).tolist()
    return [_trim(ids_[i], heads_[i], betas_[i], total[i], end, pad, logps_[i]) for i in range(b)]


def beam_search(step: Step, ann: np.ndarray, keys: np.ndarray, h0: np.ndarray, c0: np.ndarray, *, start: int,
                end: int, pad: int, beam_size: int, max_len: int, length_penalty: float = 0.0,
                num_captions: int = 1) -> list[Decoded]:
    """The caption of highest rank per image (rank = log p, or log p / length**length_penalty),
    and with ``num_captions`` N > 1 the pool's next N - 1 (``runners_up``), the search going on
    until no open beam can beat the pool's N-th best. decoding.beam_search, in numpy."""
    if beam_size < 1:
        raise ValueError("beam_size must be >= 1")
    if not 1 <= num_captions <= beam_size:
        raise ValueError(f"num_captions must be from 1 to the beam size {beam_size}, got {num_captions}")
    _check(max_len)
    b, n, _ = ann.shape
    k, steps = beam_size, max_len + 1
    a, kk = np.repeat(ann, k, 0), np.repeat(keys, k, 0)  # (B*k, L, D), (B*k, L, A): one row per beam
    h, c = np.repeat(h0, k, 0), np.repeat(c0, k, 0)  # (B*k, H)
    scores = np.full((b, k), NINF, dtype=np.float32)
    scores[:, 0] = 0.0  # all beams start identical: let only the first one expand
    pool_rank = np.full((b, k), NINF, dtype=np.float32)
    pool_score = np.full((b, k), NINF, dtype=np.float32)
    pool_step = np.zeros((b, k), dtype=np.int64)
    pool_parent = np.zeros((b, k), dtype=np.int64)
    words = np.full((steps, b, k), pad, dtype=np.int64)
    parents = np.zeros((steps, b, k), dtype=np.int64)
    score_steps = np.zeros((steps, b, k), dtype=np.float32)
    head_steps: np.ndarray | None = None  # (T, B, k, h, L), made at the first step (h is known then)
    beta_steps = np.zeros((steps, b, k), dtype=np.float32)
    y = np.full(b * k, start, dtype=np.int64)
    active = np.arange(b)
    out: list[Decoded | None] = [None] * b
    best_possible = steps ** length_penalty if length_penalty > 0 else 1.0
    width = 2 * k

    def read_back(rows: np.ndarray, places: np.ndarray, last: int) -> list[Decoded]:
        img = active[rows]
        r = np.arange(len(rows))
        cut = min(last, max_len - 1)
        ended = np.isfinite(pool_rank[rows, places])
        slot = scores[rows].argmax(1)
        step_ = np.where(ended, pool_step[rows, places], cut)
        word = np.where(ended, end, words[cut, img, slot])
        j = np.where(ended, pool_parent[rows, places], parents[cut, img, slot])
        score = np.where(ended, pool_score[rows, places], scores[rows, slot])
        ids = np.full((len(img), last + 1), pad, dtype=np.int64)
        heads = np.zeros((len(img), last + 1, *head_steps.shape[3:]), dtype=np.float32)
        betas = np.zeros((len(img), last + 1), dtype=np.float32)
        running = np.zeros((len(img), last + 1), dtype=np.float32)
        for t in range(last, -1, -1):
            before = step_ > t
            ids[:, t] = np.where(step_ == t, word, np.where(before, words[t, img, j], ids[:, t]))
            running[:, t] = np.where(step_ == t, score, np.where(before, score_steps[t, img, j], running[:, t]))
            j = np.where(before, parents[t, img, j], j)
            heads[:, t], betas[:, t] = head_steps[t, img, j], beta_steps[t, img, j]
        logps = running - np.pad(running[:, :-1], ((0, 0), (1, 0)))
        m = step_ + 1
        return [_trim(ids[i, :m[i]].tolist(), heads[i, :m[i]], betas[i, :m[i]], float(score[i]), end, pad,
                      logps[i, :m[i]]) for i in r]

    def emit(rows: np.ndarray, last: int) -> None:
        found = np.maximum(np.isfinite(pool_rank[rows, :num_captions]).sum(1), 1)
        places = np.concatenate([np.arange(f) for f in found])
        captions = iter(read_back(np.repeat(rows, found), places, last))
        for i, f in zip(active[rows].tolist(), found.tolist()):
            best = next(captions)
            best.runners_up = [next(captions) for _ in range(f - 1)]
            out[i] = best

    for t in range(steps):
        bb = len(active)
        logp, h_next, c_next, alpha, beta = step(y, h, c, a, kk)
        logp = _never_emit(logp, start, pad)
        if t == steps - 1:
            logp = _only_end(logp, end)
        logp = logp.reshape(bb, k, -1)  # (b', k, V)
        v = logp.shape[-1]
        if head_steps is None:
            head_steps = np.zeros((steps, b, k, alpha.shape[1], n), dtype=np.float32)
        head_steps[t, active] = alpha.reshape(bb, k, -1, n)
        beta_steps[t, active] = beta.reshape(bb, k)
        flat = (scores[:, :, None] + logp).reshape(bb, k * v)
        w = min(width, k * v)
        idx = _topk(flat, w)  # (b', 2k), best first
        cand = np.take_along_axis(flat, idx, 1)
        beam, word = idx // v, idx % v
        ended = (word == end) & np.isfinite(cand)
        joins = ended.copy()
        joins[:, k:] = False
        rank = cand / np.float32((t + 1) ** length_penalty) if length_penalty > 0 else cand
        merged = np.concatenate([pool_rank, np.where(joins, rank, NINF)], 1)
        pick = _topk(merged, k)
        pool_rank = np.take_along_axis(merged, pick, 1)
        pool_score = np.take_along_axis(np.concatenate([pool_score, cand], 1), pick, 1)
        pool_step = np.take_along_axis(np.concatenate([pool_step, np.full_like(beam, t)], 1), pick, 1)
        pool_parent = np.take_along_axis(np.concatenate([pool_parent, beam], 1), pick, 1)
        if t == steps - 1:
            emit(np.arange(bb), t)  # the length limit: the best of what is there
            break
        # The new open beams: the best k candidates that did not end.
        position = np.broadcast_to(np.arange(w), cand.shape)
        go_on = np.sort(position + w * ended.astype(np.int64), axis=1)[:, :k] % w  # (b', k)
        scores = np.take_along_axis(cand, go_on, 1)
        beam, word = np.take_along_axis(beam, go_on, 1), np.take_along_axis(word, go_on, 1)
        words[t, active], parents[t, active], score_steps[t, active] = word, beam, scores
        rows = (np.arange(bb)[:, None] * k + beam).reshape(-1)  # (b'*k,) parent rows
        h, c = h_next[rows], c_next[rows]
        y = word.reshape(-1)
        bar = pool_rank[:, num_captions - 1]  # the pool's N-th best
        done = np.isfinite(bar) & (bar >= scores[:, 0] / np.float32(best_possible))
        if done.any():
            emit(np.flatnonzero(done), t)
            keep = np.flatnonzero(~done)
            if keep.size == 0:
                break
            kept_rows = (keep[:, None] * k + np.arange(k)).reshape(-1)
            active, a, kk = active[keep], a[kept_rows], kk[kept_rows]
            scores, pool_rank, pool_score = scores[keep], pool_rank[keep], pool_score[keep]
            pool_step, pool_parent = pool_step[keep], pool_parent[keep]
            h, c, y = h[kept_rows], c[kept_rows], y[kept_rows]
    return out  # type: ignore[return-value]
