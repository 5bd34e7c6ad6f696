"""Greedy and beam-search decoding, batched across images.

Legend: B images, k beams, L locations, V vocabulary, T steps.

``max_len`` counts words, never the <end> token: a caption of exactly ``max_len`` words
followed by <end> can come out. After the ``max_len``-th word only <end> may come (every
other word is masked at that step, in greedy and beam search alike), so the search is over
finished captions of at most ``max_len`` words: a word that would be cut off anyway never
outranks an <end> there. A caption is cut off at ``max_len`` words only where <end>
itself cannot come (its probability is 0).

Beam search keeps the finished captions in a pool apart from the open beams (as in the
authors' code), so open beams can never push one out. It is exact for its width, and
returns the best caption by rank (log p, or with a length penalty P > 0 log p / length**P,
the length counting <end>) and, asked for N (``num_captions``, N <= k), the N best. The rule
(an exporter's search must follow it to give the same captions; ``npsearch`` does):
1. Each image keeps k open beams (at first one, the empty caption) and, apart from them,
   a pool of the best k captions that ended.
2. Every step ranks the k*V extensions of the open beams by log p (<start> and <pad>
   never come, nor <unk> unless the options allow it). The extensions ending in <end>
   among the best k join the pool, if they rank among its best k (so a finished caption
   is never pushed out by open ones); the best k extensions that did not end are the new open beams.
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
6. With a character budget C (``max_chars``), every extension whose printed text would pass
   C, and <end> as the first token, get log p -inf at every step, as <start> and <pad> do
   (``search.budget``, which proves this exact for the width); the rest is unchanged. An image
   no single word fits gets no caption (no ids, log p -inf), never a cut one.

B images x k beams run as one (B*k)-row tensor program. The k beams of an image share one copy
of its annotations and keys. Each step records, per beam, its word, the beam it extends and the
attention map it was computed with (``_Trace``, indexed by the original image); every caption is
read back along these pointers once, after the last step. ``_Pool`` holds the finished captions
and knows when an image is done. Run eagerly, an image leaves the batch at the step it is done;
recorded as a CUDA graph (``graph.SearchGraphs``), the same program runs every image to the last
step with its pool frozen from the step it is done, and asks nothing of the device until the
end. Greedy decoding is the search of width 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from captioner.model.attention import HARD_INFERENCE
from captioner.model.decoder import Decoder
from captioner.model.encoders import Annotations
from captioner.model.familiarity import Familiarity
from captioner.search.budget import Budget, NoFit
from captioner.search.options import DecodeOptions, Tokens
from captioner.search.record import caption_record


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
    # asked for (captioner.explain): each kind's (T, H, W) gradient maps, "gradcam" or "gradinput"
    gradients: dict[str, torch.Tensor] = field(default_factory=dict)
    # no caption fits the character budget (max_chars): words are empty, score -inf, and this
    # says the budget and the shortest caption found without it
    no_fit: NoFit | None = None

    def __post_init__(self):
        if self.alphas_heads is None:
            self.alphas_heads = self.alphas.unsqueeze(1)

    @property
    def caption(self) -> str:
        return " ".join(self.words) if self.text is None else self.text

    def to_json(self, image: str | None = None, with_attention: bool = False, digits: int = 4,
                heads: bool = False, *, model: str | None = None, training_data: str | None = None) -> dict:
        """The caption's JSON record (captioner.search.record), as `captioner caption` writes a line and
        the app's download holds it. Scores (log p) are rounded to ``digits`` decimals,
        probabilities to ``digits`` significant digits (never 0 for a positive one); "end_prob"
        is the <end> token's (null: cut off), so score = sum(log word_probs) + log end_prob.
        ``model`` and ``training_data`` name the model that wrote it (each left out when not
        given). ``heads`` adds "alphas_heads" (T x h x H x W) to the attention."""
        fam = self.familiarity
        attention = {}
        # Rounded in float64: a float32 0.0012 is 0.0012000000569969416 once it is a Python float.
        if with_attention or heads:
            attention["alphas"] = torch.round(self.alphas.double(), decimals=digits).tolist()
            attention["betas"] = torch.round(self.betas.double(), decimals=digits).tolist()
        if heads:
            attention["alphas_heads"] = torch.round(self.alphas_heads.double(), decimals=digits).tolist()
        for kind, maps in self.gradients.items():  # asked for: always in the record, beside "alphas"
            attention[kind] = torch.round(maps.double(), decimals=digits).tolist()
        return caption_record(image=image, caption=self.caption, words=self.words, score=self.score,
                              familiarity=None if fam is None else fam.value,
                              unfamiliar=None if fam is None else fam.unfamiliar,
                              word_probs=self.word_probs, end_prob=self.end_prob,
                              alternatives=[(a.caption, a.score, a.rank) for a in self.alternatives],
                              model=model, training_data=training_data, attention=attention, digits=digits)


@dataclass
class DecodedIds:
    """Raw decoder output for one image, before the vocabulary turns ids into words. Its
    tensors are on the host, in float32: the search moves them there once, after its last step,
    in one transfer each (each transfer a wait for the GPU), not several per image."""

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


def hard_kwargs(options: DecodeOptions) -> dict:
    """How a hard-attention model picks its context at inference (soft models ignore it)."""
    mode = HARD_INFERENCE[options.hard_attention]
    return {"argmax": mode.argmax, "sample": mode.sample}


@torch.no_grad()
def greedy(decoder: Decoder, ann: Annotations, tokens: Tokens, options: DecodeOptions) -> list[DecodedIds]:
    """The most likely next word at every step, up to ``options.max_len`` words and <end>: the
    beam search of width 1 (the same captions, and only one search to keep)."""
    return beam_search(decoder, ann, tokens, replace(options, beam_size=1, num_captions=1, length_penalty=0.0))


@torch.no_grad()
def beam_search(decoder: Decoder, ann: Annotations, tokens: Tokens, options: DecodeOptions) -> list[DecodedIds]:
    """The caption of highest rank per image: rank = log p, or with ``length_penalty`` P > 0
    log p / length**P (length counts the <end> token). With ``num_captions`` N > 1 (at most
    k), the N best finished captions of the search (``runners_up``: the 2nd to N-th), in the
    order of their rank. The search follows the rule of the module's docstring."""
    return search(decoder, ann.vectors, ann.grid, tokens, options).captions(ann.vectors.shape[0])


@dataclass
class Searched:
    """What a search leaves on the device: every image's pool, the trace of all steps, and the
    open beams' log p after the last step that keeps them (step max_len - 1)."""

    pool: _Pool
    trace: _Trace
    scores: torch.Tensor  # (B, k)
    done_at: torch.Tensor  # (B,) the step at which each image was done (rule 3), max_len if none

    def tensors(self) -> list[torch.Tensor]:
        p, t = self.pool, self.trace
        return [p.rank, p.score, p.step, p.parent, t.words, t.parents, t.scores, t.heads, t.betas, self.scores,
                self.done_at]

    def captions(self, images: int) -> list[DecodedIds]:
        """The first ``images`` images' captions (rule 5), read back in one pass."""
        return self.trace.captions(self.pool, self.scores, torch.arange(images, device=self.scores.device))


def search(decoder: Decoder, vectors: torch.Tensor, grid: tuple[int, int], tokens: Tokens,
           o: DecodeOptions, *, compact: bool = True) -> Searched:
    """The search over annotations ``vectors`` (B, L, D), at most max_len + 1 steps. With
    ``compact`` (eager), an image leaves the batch at the step it is done (rule 3), at the cost
    of one host wait a step, and the search stops when none is left. Without it, the fixed
    program a CUDA graph records (``graph.SearchGraphs``): every image runs every step, its pool
    frozen from the step it is done, and nothing is asked of the device until the end. The
    two give the same captions; the first does not pay for the steps of images already done."""
    kw, never = hard_kwargs(o), tokens.never(o)
    ann = decoder.annotate(Annotations(vectors, grid))  # once per image, shared by its beams
    a, k = ann.vectors, o.beam_size
    b, dev = a.shape[0], a.device
    keys = decoder.attention.prepare(a)  # once per image, shared by its beams
    h, c = (s.repeat_interleave(k, 0) for s in decoder.init_state(a))  # (B*k, H)
    scores = torch.full((b, k), float("-inf"), device=dev)  # the open beams' log p
    scores[:, 0] = 0.0  # all beams start identical: let only the first one expand
    last = scores.clone()  # (B, k) each image's open beams' log p when it left the batch
    pool = _Pool(b, k, o.num_captions, o.length_penalty, dev)
    trace = _Trace(b, k, decoder.attention.num_heads, a.shape[1], max_len=o.max_len, end=tokens.end,
                   pad=tokens.pad, device=dev)
    budget = _budget(tokens, o, b * k, dev)  # None: no character budget
    y = torch.full((b * k,), tokens.start, dtype=torch.long, device=dev)
    # The images in the batch, by their original index: all of them in the fixed program (a
    # slice: plain writes, no index a graph would copy); those not yet done, when compacting.
    active: torch.Tensor | slice = torch.arange(b, device=dev) if compact else slice(None)
    done = torch.zeros(b, 1, dtype=torch.bool, device=dev)  # (B, 1) fixed program: done, its pool frozen
    done_at = torch.full((b,), o.max_len, dtype=torch.long, device=dev)
    reach = (o.max_len + 1) ** o.length_penalty if o.length_penalty > 0 else 1.0  # log p / reach: a beam's best rank
    for t in range(o.max_len + 1):  # max_len words, then a step that can only end
        bb = scores.shape[0]
        out = decoder.step(y, h, c, a, keys, ann.grid, **kw)
        logp = _never_emit(F.log_softmax(out.logits.float(), dim=-1), never)
        if budget is not None:
            logp = logp.masked_fill(budget.over(), float("-inf"))
        if t == o.max_len:
            logp = _only_end(logp, tokens.end)
        trace.heads[t, active] = out.alpha_heads.view(bb, k, -1, a.shape[1]).float()
        trace.betas[t, active] = out.beta.view(bb, k).float()
        cand, beam, word = _extend(scores, logp.view(bb, k, -1), 2 * k)  # (b, 2k) each, best first
        ended = (word == tokens.end) & torch.isfinite(cand)
        pool.push(t, cand, beam, ended, active, frozen=None if compact else done)
        if t == o.max_len:
            break
        go_on = _open_beams(ended, k)  # (b, k)
        scores, beam, word = cand.gather(1, go_on), beam.gather(1, go_on), word.gather(1, go_on)
        trace.words[t, active], trace.parents[t, active], trace.scores[t, active] = word, beam, scores
        rows = (torch.arange(bb, device=dev).unsqueeze(1) * k + beam).view(-1)  # (b*k,) the rows each beam extends
        h, c, y = out.h[rows], out.c[rows], word.view(-1)
        if budget is not None:
            budget = budget.follow(rows, y)
        now = pool.beaten(scores[:, 0] / reach, active)  # (b,)
        if not compact:
            now = now & ~done.squeeze(1)
            done_at = torch.where(now, t, done_at)
            done = done | now.unsqueeze(1)
            continue
        if bool(now.any()):  # these images leave the batch
            done_at[active[now]] = t
            last[active] = scores
            keep = (~now).nonzero().flatten()
            if keep.numel() == 0:
                break
            kept_rows = (keep.unsqueeze(1) * k + torch.arange(k, device=dev)).view(-1)
            active, a, keys, scores = active[keep], a[keep], keys[keep], scores[keep]
            h, c, y = h[kept_rows], c[kept_rows], y[kept_rows]
            if budget is not None:
                budget = budget.take(kept_rows)
    last[active] = scores
    return Searched(pool, trace, last, done_at)


def _budget(tokens: Tokens, o: DecodeOptions, rows: int, device: torch.device) -> Budget | None:
    """The character budget of ``rows`` empty captions (``search.budget``), or None without one."""
    spelling = tokens.budget_spelling(o)
    if spelling is None:
        return None
    table = torch.tensor([spelling.lengths, spelling.before, spelling.after], device=device)  # (3, V)
    empty = torch.zeros(rows, dtype=torch.long, device=device)  # (B*k,) no character yet, no token before
    return Budget(o.max_chars, tokens.end, table[0], table[1].bool(), table[2].bool(), empty, empty.bool())


def _extend(scores: torch.Tensor, logp: torch.Tensor, width: int) -> tuple[torch.Tensor, ...]:
    """The best ``width`` extensions of each image's open beams of log p ``scores`` (B, k) by a
    word of log p ``logp`` (B, k, V): their log p, the open beam each extends and its word,
    (B, width) each, best first."""
    bb, k, v = logp.shape
    cand, idx = (scores.unsqueeze(-1) + logp).view(bb, k * v).topk(min(width, k * v), dim=1)
    return cand, torch.div(idx, v, rounding_mode="floor"), idx % v


def _open_beams(ended: torch.Tensor, k: int) -> torch.Tensor:
    """(B, k) the places, among candidates (B, 2k) best first, of the best k that did not end
    (at most k of 2k end): the new open beams."""
    width = ended.shape[1]
    position = torch.arange(width, device=ended.device).expand_as(ended)
    return torch.sort(position + width * ended.long(), dim=1).values[:, :k] % width


class _Pool:
    """The finished captions of each image, kept apart from its open beams (rule 1): its best k,
    sorted (entry 0 the best), as their rank, log p, the step of their <end> and the open beam
    that <end> extended, (B, k) each; an empty entry has rank -inf."""

    def __init__(self, b: int, k: int, num_captions: int, length_penalty: float, device: torch.device):
        self.k, self.n, self.length_penalty = k, num_captions, length_penalty
        self.rank = torch.full((b, k), float("-inf"), device=device)
        self.score = torch.full((b, k), float("-inf"), device=device)
        self.step = torch.zeros(b, k, dtype=torch.long, device=device)
        self.parent = torch.zeros(b, k, dtype=torch.long, device=device)

    def push(self, t: int, cand: torch.Tensor, beam: torch.Tensor, ended: torch.Tensor,
             images: torch.Tensor | slice, frozen: torch.Tensor | None) -> None:
        """Step ``t``'s candidates (b, 2k) of the images ``images`` (their original indices, or
        a slice for all), best first: those among the best k that ended join the pool if they
        rank among its best k (rule 2), but for the images already done (``frozen`` (B, 1), the
        fixed program's), whose pools stay as they were."""
        joins = ended.clone()
        joins[:, self.k:] = False
        rank = cand / (t + 1) ** self.length_penalty if self.length_penalty > 0 else cand
        old = (self.rank[images], self.score[images], self.step[images], self.parent[images])
        merged = torch.cat([old[0], torch.where(joins, rank, torch.full_like(rank, float("-inf")))], 1)
        best, pick = merged.topk(self.k, dim=1)  # (b, k), sorted: entry 0 is the best
        new = (best, torch.cat([old[1], cand], 1).gather(1, pick),
               torch.cat([old[2], torch.full_like(beam, t)], 1).gather(1, pick),
               torch.cat([old[3], beam], 1).gather(1, pick))
        if frozen is not None:
            new = tuple(torch.where(frozen, was, now) for was, now in zip(old, new))
        self.rank[images], self.score[images], self.step[images], self.parent[images] = new

    def beaten(self, reach: torch.Tensor, images: torch.Tensor | slice) -> torch.Tensor:
        """(b,) whether each of the images ``images`` is done (rule 3): its N-th best ranks at
        least ``reach`` (b,), the best rank its open beams can still reach (never while it
        holds fewer than N)."""
        nth = self.rank[images, self.n - 1]
        return torch.isfinite(nth) & (nth >= reach)

    def found(self, rows: torch.Tensor) -> list[int]:
        """How many captions the images ``rows`` return: their N best, fewer where fewer ended,
        and 1 where none did (the best open beam, cut off)."""
        return torch.isfinite(self.rank[rows, :self.n]).sum(1).clamp_min(1).tolist()


class _Trace:
    """Per step, indexed by the original image: the open beams' words, the beam each extends (its
    parent), their log p, and the maps and gates each beam's step computed (indexed by that
    beam). Every caption is read back along these pointers after the last step."""

    def __init__(self, b: int, k: int, heads: int, locations: int, *, max_len: int, end: int, pad: int,
                 device: torch.device):
        steps = max_len + 1
        self.max_len, self.end, self.pad = max_len, end, pad
        self.words = torch.full((steps, b, k), pad, dtype=torch.long, device=device)
        self.parents = torch.zeros(steps, b, k, dtype=torch.long, device=device)
        self.scores = torch.zeros(steps, b, k, device=device)  # each open beam's log p after its word
        self.heads = torch.zeros(steps, b, k, heads, locations, device=device)  # each head's map
        self.betas = torch.zeros(steps, b, k, device=device)

    def captions(self, pool: _Pool, scores: torch.Tensor, rows: torch.Tensor) -> list[DecodedIds]:
        """The best caption of each of the images ``rows``, with its runners-up (rule 5), read
        back in one pass after the last step. ``scores`` (B, k): the open beams' log p."""
        last = self.max_len
        found = pool.found(rows)  # (B,)
        places = torch.cat([torch.arange(f, device=rows.device) for f in found])  # 0: the pool's best
        rows = rows.repeat_interleave(torch.tensor(found, device=rows.device))
        ended = torch.isfinite(pool.rank[rows, places])
        img = rows
        cut = last - 1  # the last step whose open beams are kept
        slot = scores[rows].argmax(1)  # the best open beam: the caption where none ended
        step = torch.where(ended, pool.step[rows, places], torch.full_like(slot, cut))
        word = torch.where(ended, torch.full_like(slot, self.end), self.words[cut, img, slot])
        parent = torch.where(ended, pool.parent[rows, places], self.parents[cut, img, slot])
        score = torch.where(ended, pool.score[rows, places], scores[rows].gather(1, slot[:, None]).squeeze(1))
        read = iter(self.read_back(img, step, word, parent, score, last))
        best = []
        for f in found:
            best.append(next(read))
            best[-1].runners_up = [next(read) for _ in range(f - 1)]
        return best

    def read_back(self, img: torch.Tensor, step: torch.Tensor, word: torch.Tensor, parent: torch.Tensor,
                  score: torch.Tensor, last: int) -> list[DecodedIds]:
        """The captions (c of them) of images ``img`` (c,) whose last token ``word`` comes at ``step``
        after open beam ``parent``, of log p ``score``: back along the parents from step ``last``."""
        n, j = len(img), parent
        ids = torch.full((n, last + 1), self.pad, dtype=torch.long, device=img.device)
        heads = self.heads.new_zeros(n, last + 1, *self.heads.shape[3:])  # (c, T, h, L)
        betas = torch.zeros(n, last + 1, device=img.device)
        running = torch.zeros(n, last + 1, device=img.device)  # log p of the caption up to each step
        for t in range(last, -1, -1):
            before = step > t  # captions that go on after step t
            ids[:, t] = torch.where(step == t, word, torch.where(before, self.words[t, img, j], ids[:, t]))
            running[:, t] = torch.where(step == t, score, torch.where(before, self.scores[t, img, j], running[:, t]))
            j = torch.where(before, self.parents[t, img, j], j)  # now the beam that computed step t
            heads[:, t], betas[:, t] = self.heads[t, img, j], self.betas[t, img, j]
        logps = (running - F.pad(running[:, :-1], (1, 0))).cpu()  # (c, T) each token's log p
        m, ids_, score_ = (step + 1).tolist(), ids.tolist(), score.tolist()  # one transfer each, not one per row
        heads, betas = heads.cpu(), betas.cpu()
        return [_trim(ids_[r][:m[r]], heads[r, :m[r]], betas[r, :m[r]], score_[r], self.end, self.pad,
                      logps[r, :m[r]]) for r in range(n)]


def _never_emit(logp: torch.Tensor, tokens: tuple[int, ...]) -> torch.Tensor:
    """<start> and <pad> are never words of a caption, nor <unk> unless asked for (``Tokens.never``)."""
    logp = logp.clone()
    for token in tokens:  # one column at a time: a list index would be copied to the device every step
        logp[:, token] = float("-inf")
    return logp


def _only_end(logp: torch.Tensor, end: int) -> torch.Tensor:
    """After the last word allowed only <end> may come: every other word gets log p -inf."""
    out = torch.full_like(logp, float("-inf"))
    out[:, end] = logp[:, end]
    return out


def _trim(ids: list[int], heads: torch.Tensor, betas: torch.Tensor, score: float, end: int, pad: int,
          log_probs: torch.Tensor) -> DecodedIds:
    """Up to and with the first <end>; a caption cut off at the length limit stops before
    its first <pad> (never a word of a caption). heads (T, h, L), log_probs (T,). Of log p -inf
    (no word fits the character budget, ``search.budget``), no caption: no ids."""
    if score == float("-inf"):
        return DecodedIds([], heads[:0], betas[:0], score, log_probs[:0])
    m = ids.index(end) + 1 if end in ids else ids.index(pad) if pad in ids else len(ids)
    return DecodedIds(ids[:m], heads[:m], betas[:m], score, log_probs[:m])
