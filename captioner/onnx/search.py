"""Greedy and beam search in numpy, for the torch-free runtime (captioner.onnx).

The same searches as captioner.search.decoding, rule for rule (read its docstrings for the why):
<start> and <pad> are never emitted, nor <unk> unless the options allow it; ``max_len`` counts
words, and after the ``max_len``-th word only <end> may come; beam search keeps k open beams
and, apart from them, a pool of the best k finished captions, and an image is done only when
no open beam can still beat the pool's N-th best (N = ``num_captions``; N = 1: its best), or at
the length limit; with a character budget (``max_chars``), the extensions that would print past it
and <end> as the first token are masked at every step by the same ``search.budget.Budget``, and
an image no word fits gets no caption. Only the decoder step differs: a function (an ONNX
graph's session) taking one row per open beam.

Legend: B images, k beams, N = B*k rows, L locations, D annotation size, A attention size,
V vocabulary, h attention heads, T steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from captioner.search.budget import Budget
from captioner.search.options import DecodeOptions, Tokens

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


def _never_emit(logp: np.ndarray, tokens: tuple[int, ...]) -> np.ndarray:
    logp = logp.copy()
    logp[:, list(tokens)] = NINF
    return logp


def _only_end(logp: np.ndarray, end: int) -> np.ndarray:
    out = np.full_like(logp, NINF)
    out[:, end] = logp[:, end]
    return out


def _trim(ids: list[int], heads: np.ndarray, betas: np.ndarray, score: float, end: int, pad: int,
          log_probs: np.ndarray) -> Decoded:
    if score == -np.inf:  # no word fits the character budget: no caption
        return Decoded([], heads[:0], betas[:0], score, log_probs[:0])
    m = ids.index(end) + 1 if end in ids else ids.index(pad) if pad in ids else len(ids)
    return Decoded(ids[:m], heads[:m], betas[:m], score, log_probs[:m])


def _topk(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest of each row, largest first (ties: the lower index first).

    A row of k * V candidates (30,000 at the paper's sizes) is partitioned, not sorted: only its
    k largest are sorted, which is what a beam step costs in numpy. Where a tie at the k-th value
    leaves more than k candidates (at the last step, where all but <end> are -inf), the rows are
    sorted whole, so that ties fall as a stable sort lets them."""
    n = x.shape[1]
    if n <= 4 * k:
        return np.argsort(-x, axis=1, kind="stable")[:, :k]
    part = np.argpartition(-x, k - 1, axis=1)[:, :k]  # the k largest of each row, in no order
    kth = np.take_along_axis(x, part, 1).min(1, keepdims=True)  # (b, 1) the k-th largest value
    if not ((x >= kth).sum(1) == k).all():  # a tie at the k-th value: which of them is taken matters
        return np.argsort(-x, axis=1, kind="stable")[:, :k]
    part.sort(axis=1)  # in index order, so that the stable sort below puts equal values' lower index first
    order = np.argsort(-np.take_along_axis(x, part, 1), axis=1, kind="stable")
    return np.take_along_axis(part, order, 1)


def greedy(step: Step, ann: np.ndarray, keys: np.ndarray, h: np.ndarray, c: np.ndarray, tokens: Tokens,
           options: DecodeOptions) -> list[Decoded]:
    """The most likely next word at every step, up to ``options.max_len`` words and <end> (for
    options that are ``greedy``: a budget takes ``beam_search`` of width 1)."""
    start, end, pad, max_len, never = tokens.start, tokens.end, tokens.pad, options.max_len, tokens.never(options)
    b = len(ann)
    rows = np.arange(b)
    y = np.full(b, start, dtype=np.int64)
    done = np.zeros(b, dtype=bool)
    ids, heads, betas, logps = [], [], [], []
    for t in range(max_len + 1):
        logp, h, c, alpha, beta = step(y, h, c, ann, keys)
        logp = _never_emit(logp, never)
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


def beam_search(step: Step, ann: np.ndarray, keys: np.ndarray, h0: np.ndarray, c0: np.ndarray, tokens: Tokens,
                options: DecodeOptions) -> list[Decoded]:
    """The caption of highest rank per image (rank = log p, or log p / length**length_penalty),
    and with ``num_captions`` N > 1 the pool's next N - 1 (``runners_up``), the search going on
    until no open beam can beat the pool's N-th best. decoding.beam_search, in numpy."""
    start, end, pad, max_len = tokens.start, tokens.end, tokens.pad, options.max_len
    length_penalty, num_captions, never = options.length_penalty, options.num_captions, tokens.never(options)
    b, k = len(ann), options.beam_size
    a, kk = np.repeat(ann, k, 0), np.repeat(keys, k, 0)  # (B*k, L, D), (B*k, L, A): one row per beam
    h, c = np.repeat(h0, k, 0), np.repeat(c0, k, 0)  # (B*k, H)
    scores = np.full((b, k), NINF, dtype=np.float32)  # the open beams' log p
    scores[:, 0] = 0.0  # all beams start identical: let only the first one expand
    pool = _Pool(b, k, num_captions, length_penalty)
    trace = _Trace(b, k, max_len=max_len, end=end, pad=pad)
    budget = _budget(tokens, options, b * k)  # None: no character budget
    y = np.full(b * k, start, dtype=np.int64)
    active = np.arange(b)  # original index of each image still in the batch
    out: list[Decoded | None] = [None] * b
    reach = np.float32((max_len + 1) ** length_penalty if length_penalty > 0 else 1.0)
    for t in range(max_len + 1):  # max_len words, then a step that can only end
        logp, h_next, c_next, alpha, beta = step(y, h, c, a, kk)
        logp = _never_emit(logp, never)
        if budget is not None:
            logp = np.where(budget.over(), NINF, logp)
        if t == max_len:
            logp = _only_end(logp, end)
        trace.record_maps(t, active, alpha, beta)
        cand, beam, word = _extend(scores, logp.reshape(len(active), k, -1), 2 * k)  # (b', 2k) each, best first
        ended = (word == end) & np.isfinite(cand)
        pool.push(t, cand, beam, ended)
        if t == max_len:  # the length limit: the best of what is there
            done = np.ones(len(active), dtype=bool)
        else:
            go_on = _open_beams(ended, k)  # (b', k)
            scores, beam, word = (np.take_along_axis(x, go_on, 1) for x in (cand, beam, word))
            trace.record_beams(t, active, word, beam, scores)
            rows = (np.arange(len(active))[:, None] * k + beam).reshape(-1)  # (b'*k,) parents
            h, c, y = h_next[rows], c_next[rows], word.reshape(-1)
            if budget is not None:
                budget = budget.follow(rows, y)
            done = pool.beaten(scores[:, 0] / reach)
        if done.any():
            rows = np.flatnonzero(done)
            for i, caption in zip(active[rows].tolist(), trace.captions(pool, scores, active, rows, t)):
                out[i] = caption
            keep = np.flatnonzero(~done)
            if keep.size == 0:
                break
            kept_rows = (keep[:, None] * k + np.arange(k)).reshape(-1)
            active, a, kk, scores = active[keep], a[kept_rows], kk[kept_rows], scores[keep]
            pool.keep(keep)
            h, c, y = h[kept_rows], c[kept_rows], y[kept_rows]
            if budget is not None:
                budget = budget.take(kept_rows)
    return out  # type: ignore[return-value]


def _budget(tokens: Tokens, options: DecodeOptions, rows: int) -> Budget | None:
    """decoding._budget: the character budget of ``rows`` empty captions, or None without one."""
    spelling = tokens.budget_spelling(options)
    if spelling is None:
        return None
    before, after = np.array(spelling.before, dtype=bool), np.array(spelling.after, dtype=bool)
    return Budget(options.max_chars, tokens.end, np.array(spelling.lengths, dtype=np.int64), before, after,
                  np.zeros(rows, dtype=np.int64), np.zeros(rows, dtype=bool))


def _extend(scores: np.ndarray, logp: np.ndarray, width: int) -> tuple[np.ndarray, ...]:
    """decoding._extend: the best ``width`` extensions (b', width) of the open beams, best first:
    their log p, the open beam each extends and its word."""
    bb, k, v = logp.shape
    flat = (scores[:, :, None] + logp).reshape(bb, k * v)
    idx = _topk(flat, min(width, k * v))
    return np.take_along_axis(flat, idx, 1), idx // v, idx % v


def _open_beams(ended: np.ndarray, k: int) -> np.ndarray:
    """decoding._open_beams: (b', k) the places of the best k candidates that did not end."""
    width = ended.shape[1]
    position = np.broadcast_to(np.arange(width), ended.shape)
    return np.sort(position + width * ended.astype(np.int64), axis=1)[:, :k] % width


class _Pool:
    """decoding._Pool: each image's best k finished captions, sorted, as rank, log p, the step of
    their <end> and the open beam it extended, (b', k) each; an empty entry has rank -inf."""

    def __init__(self, b: int, k: int, num_captions: int, length_penalty: float):
        self.k, self.n, self.length_penalty = k, num_captions, length_penalty
        self.rank = np.full((b, k), NINF, dtype=np.float32)
        self.score = np.full((b, k), NINF, dtype=np.float32)
        self.step = np.zeros((b, k), dtype=np.int64)
        self.parent = np.zeros((b, k), dtype=np.int64)

    def push(self, t: int, cand: np.ndarray, beam: np.ndarray, ended: np.ndarray) -> None:
        """The candidates among the best k that ended join, if they rank among the pool's best k."""
        joins = ended.copy()
        joins[:, self.k:] = False
        rank = cand / np.float32((t + 1) ** self.length_penalty) if self.length_penalty > 0 else cand
        merged = np.concatenate([self.rank, np.where(joins, rank, NINF)], 1)
        pick = _topk(merged, self.k)
        self.rank = np.take_along_axis(merged, pick, 1)
        self.score = np.take_along_axis(np.concatenate([self.score, cand], 1), pick, 1)
        self.step = np.take_along_axis(np.concatenate([self.step, np.full_like(beam, t)], 1), pick, 1)
        self.parent = np.take_along_axis(np.concatenate([self.parent, beam], 1), pick, 1)

    def beaten(self, reach: np.ndarray) -> np.ndarray:
        """(b',) done: the N-th best ranks at least ``reach``, the best an open beam can still reach."""
        nth = self.rank[:, self.n - 1]
        return np.isfinite(nth) & (nth >= reach)

    def found(self, rows: np.ndarray) -> np.ndarray:
        """How many captions the images ``rows`` return (at least 1: the best open beam, cut off)."""
        return np.maximum(np.isfinite(self.rank[rows, :self.n]).sum(1), 1)

    def keep(self, rows: np.ndarray) -> None:
        self.rank, self.score = self.rank[rows], self.score[rows]
        self.step, self.parent = self.step[rows], self.parent[rows]


class _Trace:
    """decoding._Trace: per step and original image, the open beams' words, parents and log p,
    and the maps and gates each beam's step computed; captions are read back along the parents."""

    def __init__(self, b: int, k: int, *, max_len: int, end: int, pad: int):
        steps = max_len + 1
        self.max_len, self.end, self.pad, self.k = max_len, end, pad, k
        self.words = np.full((steps, b, k), pad, dtype=np.int64)
        self.parents = np.zeros((steps, b, k), dtype=np.int64)
        self.scores = np.zeros((steps, b, k), dtype=np.float32)
        self.heads: np.ndarray | None = None  # (T, B, k, h, L), made at the first step (h is known then)
        self.betas = np.zeros((steps, b, k), dtype=np.float32)

    def record_maps(self, t: int, active: np.ndarray, alpha: np.ndarray, beta: np.ndarray) -> None:
        bb, (h, n) = len(active), alpha.shape[1:]
        if self.heads is None:
            self.heads = np.zeros((*self.words.shape, h, n), dtype=np.float32)
        self.heads[t, active] = alpha.reshape(bb, self.k, -1, n)
        self.betas[t, active] = beta.reshape(bb, self.k)

    def record_beams(self, t: int, active: np.ndarray, word: np.ndarray, beam: np.ndarray,
                     scores: np.ndarray) -> None:
        self.words[t, active], self.parents[t, active], self.scores[t, active] = word, beam, scores

    def captions(self, pool: _Pool, scores: np.ndarray, active: np.ndarray, rows: np.ndarray,
                 last: int) -> list[Decoded]:
        """The best caption of each of the images ``rows``, done at step ``last``, with its runners-up."""
        found = pool.found(rows)
        places = np.concatenate([np.arange(f) for f in found])
        rows = np.repeat(rows, found)
        ended = np.isfinite(pool.rank[rows, places])
        img = active[rows]
        cut = min(last, self.max_len - 1)
        slot = scores[rows].argmax(1)
        step = np.where(ended, pool.step[rows, places], cut)
        word = np.where(ended, self.end, self.words[cut, img, slot])
        parent = np.where(ended, pool.parent[rows, places], self.parents[cut, img, slot])
        score = np.where(ended, pool.score[rows, places], scores[rows, slot])
        read = iter(self.read_back(img, step, word, parent, score, last))
        best = []
        for f in found.tolist():
            best.append(next(read))
            best[-1].runners_up = [next(read) for _ in range(f - 1)]
        return best

    def read_back(self, img: np.ndarray, step: np.ndarray, word: np.ndarray, parent: np.ndarray,
                  score: np.ndarray, last: int) -> list[Decoded]:
        n, j = len(img), parent
        ids = np.full((n, last + 1), self.pad, dtype=np.int64)
        heads = np.zeros((n, last + 1, *self.heads.shape[3:]), dtype=np.float32)
        betas = np.zeros((n, last + 1), dtype=np.float32)
        running = np.zeros((n, last + 1), dtype=np.float32)
        for t in range(last, -1, -1):
            before = step > t
            ids[:, t] = np.where(step == t, word, np.where(before, self.words[t, img, j], ids[:, t]))
            running[:, t] = np.where(step == t, score, np.where(before, self.scores[t, img, j], running[:, t]))
            j = np.where(before, self.parents[t, img, j], j)
            heads[:, t], betas[:, t] = self.heads[t, img, j], self.betas[t, img, j]
        with np.errstate(invalid="ignore"):  # -inf - -inf: a caption no word fits, which _trim drops
            logps = running - np.pad(running[:, :-1], ((0, 0), (1, 0)))
        m = step + 1
        return [_trim(ids[i, :m[i]].tolist(), heads[i, :m[i]], betas[i, :m[i]], float(score[i]), self.end, self.pad,
                      logps[i, :m[i]]) for i in range(n)]
