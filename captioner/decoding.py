"""Greedy and beam-search decoding, batched across images.

Legend: B images, k beams, L locations, V vocabulary, T steps.

Beam search runs B images x k beams as one (B*k)-row tensor program. A caption that
emits <end> leaves the open beams for a pool of finished captions kept apart, per image
(as in the authors' code), so open beams can never push it out; the best of the pool is
returned. The search is exact for its width: it stops for an image only when no open
beam can still beat the pool's best, or at the length limit; with no <end> by then, the
best open beam is returned (no crash). Asked for the N best (N <= k), it stops only when no
open beam can beat the pool's N-th best, and returns the pool's N best (``beam_search``).

``max_len`` counts words, never the <end> token: a caption of exactly ``max_len`` words
followed by <end> can come out. After the ``max_len``-th word only <end> may come (every
other word is masked at that step, in greedy and beam search alike), so the search is over
finished captions of at most ``max_len`` words: a word that would be cut off anyway never
outranks an <end> there. A caption is cut off at ``max_len`` words only where <end>
itself cannot come (its probability is 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .attention import HARD_INFERENCE
from .encoders import Annotations
from .familiarity import Familiarity
from .model import Decoder


@dataclass(frozen=True)
class Alternative:
    """One of the beam's finished captions, with its log-probability."""

    words: tuple[str, ...]
    score: float  # log p of the caption, its <end> included
    text: str | None = None  # as its language writes it (CaptionResult.text); None: words joined with spaces
    # what the search ranked it by, with a length penalty P: score / (len(words) + 1)**P (None: no
    # penalty, the rank is the score); the alternatives come in this order, best first
    rank: float | None = None

    @property
    def caption(self) -> str:
        return " ".join(self.words) if self.text is None else self.text


@dataclass
class CaptionResult:
    """A caption and, for every word, where the model looked."""

    words: list[str]
    alphas: torch.Tensor  # (T, H, W), T = len(words); each map sums to 1 (several heads: their mean)
    betas: torch.Tensor  # (T,) the gate beta_t of each word's step
    score: float  # log-probability of the whole caption (its end token included, if any)
    # (T, h, H, W) each head's map, h = 1 for one head; the decoder always gives them, and a
    # result made without them has its one map as its one head
    alphas_heads: torch.Tensor | None = None
    # The caption as its language writes it (the vocabulary's tokenizer joins the words: no
    # spaces in Chinese); None: the words joined with spaces
    text: str | None = None
    familiarity: Familiarity | None = None  # how like the model's training images; None: unknown
    word_probs: tuple[float, ...] = ()  # (T,) p of each word given the image and the words before it
    # with several captions asked for: the search's N best finished captions, best first (the first is this one)
    alternatives: tuple[Alternative, ...] = ()
    # p of the <end> token after the words; None: cut off at the length limit, no <end>. score is
    # sum(log word_probs) + log end_prob
    end_prob: float | None = None

    def __post_init__(self):
        if self.alphas_heads is None:
            self.alphas_heads = self.alphas.unsqueeze(1)

    @property
    def caption(self) -> str:
        return " ".join(self.words) if self.text is None else self.text

    def to_json(self, image: str | None = None, with_attention: bool = False, digits: int = 4,
                heads: bool = False, *, model: str | None = None, training_data: str | None = None) -> dict:
        """The caption's JSON record, as `captioner caption` writes a line and the app's download
        holds it (built here only). Scores (log p) are rounded to ``digits`` decimals,
        probabilities to ``digits`` significant digits (never 0 for a positive one); "end_prob"
        is the <end> token's (null: cut off), so score = sum(log word_probs) + log end_prob.
        ``model`` and ``training_data`` name the model that wrote it (each left out when not
        given). ``heads`` adds "alphas_heads" (T x h x H x W) to the attention."""
        out: dict = {} if image is None else {"image": image}
        out.update(caption=self.caption, words=list(self.words), score=round(float(self.score), digits))
        fam = self.familiarity
        out.update(familiarity=None if fam is None else round(fam.value, digits),
                   unfamiliar=None if fam is None else fam.unfamiliar,
                   word_probs=[significant(p, digits) for p in self.word_probs],
                   end_prob=None if self.end_prob is None else significant(self.end_prob, digits))
        if self.alternatives:
            out["alternatives"] = [{"caption": a.caption, "score": round(a.score, digits),
                                    **({} if a.rank is None else {"rank": round(a.rank, digits)})}
                                   for a in self.alternatives]
        if model is not None:
            out["model"] = model
        if training_data:
            out["training_data"] = training_data
        # Rounded in float64: a float32 0.0012 is 0.0012000000569969416 once it is a Python float.
        if with_attention or heads:
            out["alphas"] = torch.round(self.alphas.double(), decimals=digits).tolist()
            out["betas"] = torch.round(self.betas.double(), decimals=digits).tolist()
        if heads:
            out["alphas_heads"] = torch.round(self.alphas_heads.double(), decimals=digits).tolist()
        return out


def significant(p: float, digits: int = 4) -> float:
    """``p`` to ``digits`` significant digits: 0.0000123456 -> 1.235e-05, never 0 unless p is."""
    return float(f"{p:.{digits}g}")


@dataclass
class DecodedIds:
    """Raw decoder output for one image, before the vocabulary turns ids into words. Its
    tensors are on the host, in float32: greedy moves a batch's maps there in one transfer,
    beam search in one per group of images finishing together, not several per image (each
    one a wait for the GPU)."""

    ids: list[int]  # generated token ids, without <start>; ends with <end> if it ended
    alphas_heads: torch.Tensor  # (len(ids), h, L) each head's map; h = 1 for one head
    betas: torch.Tensor  # (len(ids),)
    score: float
    log_probs: torch.Tensor  # (len(ids),) log p of each token given those before it
    # beam search's next best finished captions, best first (num_captions - 1 at most)
    runners_up: list["DecodedIds"] = field(default_factory=list)

    @property
    def alphas(self) -> torch.Tensor:
        """(len(ids), L) the heads' mean map (one head: its map)."""
        return self.alphas_heads.mean(1)


def _hard_kwargs(hard: str) -> dict:
    """How a hard-attention model picks its context at inference (soft models ignore it)."""
    if not isinstance(hard, str) or hard not in HARD_INFERENCE:
        raise ValueError(f"hard attention inference must be one of {', '.join(HARD_INFERENCE)}, got {hard!r}")
    return {"argmax": HARD_INFERENCE[hard].argmax, "sample": HARD_INFERENCE[hard].sample}


def _check_max_len(max_len: int) -> None:
    if not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len counts the words of a caption and must be >= 1, got {max_len!r}")


@torch.no_grad()
def greedy(decoder: Decoder, ann: Annotations, *, start: int, end: int, pad: int,
           max_len: int, hard: str = "expected") -> list[DecodedIds]:
    """The most likely next word at every step, up to ``max_len`` words and <end>."""
    _check_max_len(max_len)
    ann = decoder.annotate(ann)
    a = ann.vectors
    kw = _hard_kwargs(hard)
    b = a.shape[0]
    keys = decoder.attention.prepare(a)
    h, c = decoder.init_state(a)
    y = torch.full((b,), start, dtype=torch.long, device=a.device)
    done = torch.zeros(b, dtype=torch.bool, device=a.device)
    ids, heads, betas, logps = [], [], [], []
    for t in range(max_len + 1):
        o = decoder.step(y, h, c, a, keys, ann.grid, **kw)
        h, c = o.h, o.c
        logp = _never_emit(F.log_softmax(o.logits.float(), dim=-1), start, pad)
        if t == max_len:
            logp = _only_end(logp, end)
        y = logp.argmax(-1)
        counted = ~done
        if t == max_len:  # <end> cannot come (p = 0): the caption is cut off at max_len words
            counted = counted & torch.isfinite(logp[:, end])
            y = torch.where(counted, y, torch.full_like(y, pad))
        ids.append(y)
        heads.append(o.alpha_heads)
        betas.append(o.beta)
        logps.append(torch.where(counted, logp.gather(1, y[:, None]).squeeze(1),
                                 torch.zeros_like(y, dtype=logp.dtype)))
        done = done | (y == end)
        if bool(done.all()):
            break
    ids_l = torch.stack(ids, 1).tolist()  # (B, T)
    # (B, T, h, L), (B, T), (B, T): on the host in one transfer each, not three per image
    heads_t, betas_t = torch.stack(heads, 1).float().cpu(), torch.stack(betas, 1).float().cpu()
    logps_t = torch.stack(logps, 1).cpu()
    total = logps_t.sum(1).tolist()
    return [_trim(ids_l[i], heads_t[i], betas_t[i], total[i], end, pad, logps_t[i]) for i in range(b)]


@torch.no_grad()
def beam_search(decoder: Decoder, ann: Annotations, *, start: int, end: int, pad: int, beam_size: int,
                max_len: int, length_penalty: float = 0.0, hard: str = "expected",
                num_captions: int = 1) -> list[DecodedIds]:
    """The caption of highest rank per image: rank = log p, or with ``length_penalty`` P > 0
    log p / length**P (length counts the <end> token). With ``num_captions`` N > 1 (at most
    k), the N best finished captions of the search (``runners_up``: the 2nd to N-th).

    The rule (an exporter's search must follow it to give the same captions):
    1. Each image keeps k open beams (at first one, the empty caption) and, apart from them,
       a pool of the best k captions that ended.
    2. Every step ranks the k*V extensions of the open beams by log p (<start> and <pad>
       never come). The extensions ending in <end> among the best k join the pool, if they
       rank among its best k (so a finished caption is never pushed out by open ones); the
       best k extensions that did not end are the new open beams.
    3. An image is done when no open beam can still beat the pool's N-th best (N = 1: its
       best): log p only falls as words are added, so an open beam's best possible rank is
       its log p / (max_len + 1)**P (the longest caption it can still become); done when
       the pool's N-th best rank >= the best open beam's log p / (max_len + 1)**P. A full
       pool is no reason to stop. N = 1 stops exactly where the search for the best alone
       does; N > 1 may go on longer, never shorter, and its best is the same.
    4. After the ``max_len``-th word only <end> may come: at that step the extensions that
       end are the only candidates, each joins the pool if it ranks among its best k, and
       the image is done.
    5. It returns the pool's best and, with N > 1, the pool's next best up to N in all, in
       the order of their rank (with a length penalty, not necessarily of their log p). A
       caption cut off at ``max_len`` words is returned only when none ended (where <end>
       has probability 0); then it is the only one.

    B images x k beams run as one tensor program; the k beams of an image share one copy of
    its annotations and keys. Each step records, per beam, its word, the beam it extends and
    the attention map it was computed with; a caption is read back along these pointers when
    its image is done. An image leaves the batch as soon as it is done."""
    kw = _hard_kwargs(hard)
    if beam_size < 1:
        raise ValueError("beam_size must be >= 1")
    if not 1 <= num_captions <= beam_size:
        raise ValueError(f"num_captions must be from 1 to the beam size {beam_size}, got {num_captions}")
    _check_max_len(max_len)
    ann = decoder.annotate(ann)  # once per image, shared by its beams
    a = ann.vectors
    b, n, _ = a.shape
    k = beam_size
    steps = max_len + 1  # max_len words, then a step that can only end
    dev = a.device
    ninf = float("-inf")
    keys = decoder.attention.prepare(a)  # once per image, shared by its beams
    h, c = decoder.init_state(a)
    h, c = h.repeat_interleave(k, 0), c.repeat_interleave(k, 0)  # (B*k, H)

    scores = torch.full((b, k), ninf, device=dev)  # open beams' log p
    scores[:, 0] = 0.0  # all beams start identical: let only the first one expand
    # The pool of finished captions, (B, k) each: rank, log p, the step of their <end> and
    # the open beam that <end> extended (an empty entry has rank -inf).
    pool_rank = torch.full((b, k), ninf, device=dev)
    pool_score = torch.full((b, k), ninf, device=dev)
    pool_step = torch.zeros(b, k, dtype=torch.long, device=dev)
    pool_parent = torch.zeros(b, k, dtype=torch.long, device=dev)
    # Per step, indexed by the original image: the open beams' words, the beam each extends
    # (its parent) and the maps and gates each beam's step computed (indexed by that beam).
    words = torch.full((steps, b, k), pad, dtype=torch.long, device=dev)
    parents = torch.zeros(steps, b, k, dtype=torch.long, device=dev)
    score_steps = torch.zeros(steps, b, k, device=dev)  # each open beam's log p after its word
    head_steps = torch.zeros(steps, b, k, decoder.attention.num_heads, n, device=dev)  # each head's map
    beta_steps = torch.zeros(steps, b, k, device=dev)
    y = torch.full((b * k,), start, dtype=torch.long, device=dev)
    active = torch.arange(b, device=dev)  # original index of each image still in the batch
    out: list[DecodedIds | None] = [None] * b
    best_possible = steps ** length_penalty if length_penalty > 0 else 1.0  # divides an open score
    width = 2 * k  # k may end, k go on

    def read_back(rows: torch.Tensor, places: torch.Tensor, last: int) -> list[DecodedIds]:
        """Entry ``places[r]`` of the pool (0: its best) of image ``rows[r]`` (batch-relative;
        an image may come several times); none ends after step ``last``. Where no caption
        ended: the best open beam, cut off by the length limit."""
        img = active[rows]
        cut = min(last, max_len - 1)  # the last step whose open beams are kept
        ended = torch.isfinite(pool_rank[rows, places])  # the pool is sorted: entry 0 is its best
        slot = scores[rows].argmax(1)
        step = torch.where(ended, pool_step[rows, places], torch.full_like(slot, cut))
        word = torch.where(ended, torch.full_like(slot, end), words[cut, img, slot])
        j = torch.where(ended, pool_parent[rows, places], parents[cut, img, slot])
        score = torch.where(ended, pool_score[rows, places], scores[rows].gather(1, slot[:, None]).squeeze(1))
        ids = torch.full((len(img), last + 1), pad, dtype=torch.long, device=dev)
        heads = head_steps.new_zeros(len(img), last + 1, *head_steps.shape[3:])  # (b', T, h, L)
        betas = torch.zeros(len(img), last + 1, device=dev)
        running = torch.zeros(len(img), last + 1, device=dev)  # log p of the caption up to each step
        for t in range(last, -1, -1):
            before = step > t  # rows whose caption goes on after step t
            ids[:, t] = torch.where(step == t, word, torch.where(before, words[t, img, j], ids[:, t]))
            running[:, t] = torch.where(step == t, score, torch.where(before, score_steps[t, img, j], running[:, t]))
            j = torch.where(before, parents[t, img, j], j)  # now the beam that computed step t
            heads[:, t], betas[:, t] = head_steps[t, img, j], beta_steps[t, img, j]
        logps = (running - F.pad(running[:, :-1], (1, 0))).cpu()  # (b', T) each token's log p
        m, ids_, score_ = (step + 1).tolist(), ids.tolist(), score.tolist()  # one transfer each, not one per row
        heads, betas = heads.cpu(), betas.cpu()
        return [_trim(ids_[r][:m[r]], heads[r, :m[r]], betas[r, :m[r]], score_[r], end, pad, logps[r, :m[r]])
                for r in range(len(img))]

    def emit(rows: torch.Tensor, last: int) -> None:
        """Store the best caption of these (batch-relative) images, and its runners-up: the
        pool's next finished captions, up to num_captions in all, read back in one pass."""
        found = torch.isfinite(pool_rank[rows, :num_captions]).sum(1).clamp_min(1).tolist()  # (b',)
        places = torch.cat([torch.arange(f, device=dev) for f in found])
        captions = iter(read_back(rows.repeat_interleave(torch.tensor(found, device=dev)), places, last))
        for i, f in zip(active[rows].tolist(), found):
            best = next(captions)
            best.runners_up = [next(captions) for _ in range(f - 1)]
            out[i] = best

    for t in range(steps):
        bb = len(active)
        o = decoder.step(y, h, c, a, keys, ann.grid, **kw)
        logp = _never_emit(F.log_softmax(o.logits.float(), dim=-1), start, pad)
        if t == steps - 1:
            logp = _only_end(logp, end)
        logp = logp.view(bb, k, -1)  # (b', k, V)
        v = logp.shape[-1]
        head_steps[t, active] = o.alpha_heads.view(bb, k, -1, n).float()
        beta_steps[t, active] = o.beta.view(bb, k).float()
        cand, idx = (scores.unsqueeze(-1) + logp).view(bb, k * v).topk(min(width, k * v), dim=1)  # (b', 2k) sorted
        beam = torch.div(idx, v, rounding_mode="floor")  # the open beam each candidate extends
        word = idx % v
        ended = (word == end) & torch.isfinite(cand)
        # Into the pool: the ended candidates among the best k, if they rank among the pool's best k.
        joins = ended.clone()
        joins[:, k:] = False
        rank = cand / (t + 1) ** length_penalty if length_penalty > 0 else cand
        merged = torch.cat([pool_rank, torch.where(joins, rank, torch.full_like(rank, ninf))], 1)
        pool_rank, pick = merged.topk(k, dim=1)  # (b', k), sorted: entry 0 is the best
        pool_score = torch.cat([pool_score, cand], 1).gather(1, pick)
        pool_step = torch.cat([pool_step, torch.full_like(beam, t)], 1).gather(1, pick)
        pool_parent = torch.cat([pool_parent, beam], 1).gather(1, pick)
        if t == steps - 1:
            emit(torch.arange(bb, device=dev), t)  # the length limit: the best of what is there
            break
        # The new open beams: the best k candidates that did not end (at most k of 2k ended).
        position = torch.arange(cand.shape[1], device=dev).expand_as(cand)
        go_on = torch.sort(position + cand.shape[1] * ended.long(), dim=1).values[:, :k] % cand.shape[1]  # (b', k)
        scores, beam, word = cand.gather(1, go_on), beam.gather(1, go_on), word.gather(1, go_on)
        words[t, active], parents[t, active], score_steps[t, active] = word, beam, scores
        rows = (torch.arange(bb, device=dev).unsqueeze(1) * k + beam).view(-1)  # (b'*k,) parent rows
        h, c = o.h[rows], o.c[rows]
        y = word.view(-1)
        nth = pool_rank[:, num_captions - 1]  # the pool's N-th best (sorted; -inf while it holds fewer)
        done = torch.isfinite(nth) & (nth >= scores[:, 0] / best_possible)  # no open beam can beat it
        if bool(done.any()):
            emit(done.nonzero().flatten(), t)
            keep = (~done).nonzero().flatten()
            if keep.numel() == 0:
                break
            kept_rows = (keep.unsqueeze(1) * k + torch.arange(k, device=dev)).view(-1)
            active, a, keys = active[keep], a[keep], keys[keep]
            scores, pool_rank, pool_score = scores[keep], pool_rank[keep], pool_score[keep]
            pool_step, pool_parent = pool_step[keep], pool_parent[keep]
            h, c, y = h[kept_rows], c[kept_rows], y[kept_rows]
    return out  # type: ignore[return-value]


def _never_emit(logp: torch.Tensor, *tokens: int) -> torch.Tensor:
    """<start> and <pad> are never words of a caption."""
    logp = logp.clone()
    logp[:, list(tokens)] = float("-inf")
    return logp


def _only_end(logp: torch.Tensor, end: int) -> torch.Tensor:
    """After the last word allowed only <end> may come: every other word gets log p -inf."""
    out = torch.full_like(logp, float("-inf"))
    out[:, end] = logp[:, end]
    return out


def _trim(ids: list[int], heads: torch.Tensor, betas: torch.Tensor, score: float, end: int, pad: int,
          log_probs: torch.Tensor) -> DecodedIds:
    """Up to and with the first <end>; a caption cut off at the length limit stops before
    its first <pad> (never a word of a caption). heads (T, h, L), log_probs (T,)."""
    m = ids.index(end) + 1 if end in ids else ids.index(pad) if pad in ids else len(ids)
    return DecodedIds(ids[:m], heads[:m], betas[:m], score, log_probs[:m])
