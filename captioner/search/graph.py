"""Beam search as one fixed program, and that program replayed as a CUDA graph: a speed form.

The plain search (``decoding.beam_search``) lets each image leave the batch at the step it is
done, and to know which are done it asks the device after every step. On a GPU that makes the
search launch-bound: some hundred small kernels a word, each issued only after the host has
heard back from the step before (docs/benchmarks.md, "On a GPU, second session", has the
profile).

The fixed form keeps every image in the batch for all ``max_len + 1`` steps and follows the
same rule (decoding's docstring): an image's pool of finished captions is frozen from the step
it is done, its later steps are computed and thrown away, and every caption is read back once,
after the last step, along the same pointers. It asks the device nothing until then, so the
host queues the whole search ahead of the GPU; and with nothing decided on the host, the whole
search can be recorded as one CUDA graph and replayed with one launch (``SearchGraphs``). What
it returns is what the plain search returns: the same captions, runners-up, scores and maps.
What it costs is the steps of images already done; a CPU, which is not launch-bound, gains
nothing from it (docs/benchmarks.md), and the plain search runs there. Where the graphs are
taken, greedy decoding runs through them too, as a search of width 1 (the same captions).

``SearchGraphs`` keeps one graph per (batch padded to a multiple of ``BUCKET``, annotation
shape and type, decoding options), up to ``MAX_GRAPHS``, in one shared memory pool; a batch is
copied into its graph's input tensor, the rows past the batch's own hold what an earlier batch
left there and their captions are never read. Beyond ``MAX_GRAPHS`` shapes, or after a capture
fails (said once, as a warning), the fixed form runs without a graph.

Taken when (``search_form``): the kernels on (CAPTIONER_KERNELS, captioner.kernels), a CUDA
device, a deterministic inference (hard attention's "sample" draws, and draws in another order
when images leave the batch), and the decoder's step not compiled (a compiled step is torch's
own way of cutting launches).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from captioner.model import kernels
from captioner.model.decoder import Decoder
from captioner.model.encoders import Annotations
from captioner.search.decoding import (
    DecodedIds,
    _extend,
    _never_emit,
    _only_end,
    _open_beams,
    _Pool,
    _Trace,
    hard_kwargs,
)
from captioner.search.options import DecodeOptions, Tokens

BUCKET = 8  # a batch is padded to a multiple of this many images for its graph
MAX_GRAPHS = 8  # shapes kept; another shape runs the fixed form without a graph


def search_form(device: torch.device, hard: str, compiled: bool) -> str:
    """Which search ``Captioner.caption_batch`` runs: "graphed" (this module) or "plain"."""
    if kernels.enabled() and device.type == "cuda" and hard != "sample" and not compiled:
        return "graphed"
    return "plain"


@dataclass
class _Searched:
    """What a fixed search leaves on the device: every image's pool, the trace of all steps, and
    the open beams' log p after the last step that keeps them (step max_len - 1)."""

    pool: _Pool
    trace: _Trace
    scores: torch.Tensor  # (B, k)
    done_at: torch.Tensor  # (B,) the step at which each image was done: where the plain search lets it go

    def tensors(self) -> list[torch.Tensor]:
        p, t = self.pool, self.trace
        return [p.rank, p.score, p.step, p.parent, t.words, t.parents, t.scores, t.heads, t.betas, self.scores,
                self.done_at]

    def captions(self, images: int) -> list[DecodedIds]:
        """The first ``images`` images' captions (rule 5), read back in one pass."""
        dev = self.scores.device
        rows = torch.arange(images, device=dev)
        return self.trace.captions(self.pool, self.scores, torch.arange(self.scores.shape[0], device=dev), rows,
                                   self.trace.max_len)


def _search(decoder: Decoder, vectors: torch.Tensor, grid: tuple[int, int], tokens: Tokens,
            o: DecodeOptions) -> _Searched:
    """The fixed program: all max_len + 1 steps for every image, no host wait."""
    kw = hard_kwargs(o)
    never = tokens.never(o)
    ann = decoder.annotate(Annotations(vectors, grid))
    a, k = ann.vectors, o.beam_size
    b, dev = a.shape[0], a.device
    keys = decoder.attention.prepare(a)
    h, c = (s.repeat_interleave(k, 0) for s in decoder.init_state(a))
    scores = torch.full((b, k), float("-inf"), device=dev)
    scores[:, 0] = 0.0  # all beams start identical: let only the first one expand
    pool = _Pool(b, k, o.num_captions, o.length_penalty, dev)
    trace = _Trace(b, k, decoder.attention.num_heads, a.shape[1], max_len=o.max_len, end=tokens.end,
                   pad=tokens.pad, device=dev)
    y = torch.full((b * k,), tokens.start, dtype=torch.long, device=dev)
    parents_of = torch.arange(b, device=dev).unsqueeze(1) * k  # (B, 1) each image's first row
    done = torch.zeros(b, 1, dtype=torch.bool, device=dev)  # (B, 1) done at an earlier step: its pool is frozen
    done_at = torch.full((b,), o.max_len, dtype=torch.long, device=dev)
    reach = (o.max_len + 1) ** o.length_penalty if o.length_penalty > 0 else 1.0
    for t in range(o.max_len + 1):
        out = decoder.step(y, h, c, a, keys, ann.grid, **kw)
        logp = _never_emit(F.log_softmax(out.logits.float(), dim=-1), never)
        if t == o.max_len:
            logp = _only_end(logp, tokens.end)
        trace.heads[t] = out.alpha_heads.view(b, k, -1, a.shape[1]).float()
        trace.betas[t] = out.beta.view(b, k).float()
        cand, beam, word = _extend(scores, logp.view(b, k, -1), 2 * k)
        ended = (word == tokens.end) & torch.isfinite(cand)
        kept = (pool.rank, pool.score, pool.step, pool.parent)
        pool.push(t, cand, beam, ended)
        pool.rank, pool.score, pool.step, pool.parent = (
            torch.where(done, old, new) for old, new in zip(kept, (pool.rank, pool.score, pool.step, pool.parent)))
        if t < o.max_len:
            go_on = _open_beams(ended, k)
            scores, beam, word = cand.gather(1, go_on), beam.gather(1, go_on), word.gather(1, go_on)
            trace.words[t], trace.parents[t], trace.scores[t] = word, beam, scores
            rows = (parents_of + beam).view(-1)
            h, c, y = out.h[rows], out.c[rows], word.view(-1)
            now = pool.beaten(scores[:, 0] / reach).unsqueeze(1) & ~done
            done_at = torch.where(now.squeeze(1), t, done_at)
            done = done | now
    return _Searched(pool, trace, scores, done_at)


@torch.no_grad()
def fixed_beam_search(decoder: Decoder, ann: Annotations, tokens: Tokens, options: DecodeOptions) -> list[DecodedIds]:
    """``decoding.beam_search``'s captions from the fixed program, run eagerly."""
    return _search(decoder, ann.vectors, ann.grid, tokens, options).captions(ann.vectors.shape[0])


# capture(run, pool) -> (replay, what the captured run returned, the pool to share with the next)
Capture = Callable[[Callable[[], _Searched], object], tuple[Callable[[], None], _Searched, object]]


def cuda_capture(run: Callable[[], _Searched], pool) -> tuple[Callable[[], None], _Searched, object]:
    """Record ``run`` as one CUDA graph, after one eager run on a side stream (as torch asks:
    libraries set themselves up there, not in the graph)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        searched = run()
    return graph.replay, searched, graph.pool()


CAPTURE: Capture = cuda_capture  # how SearchGraphs records a graph (tests stand another in)


@dataclass
class _Graph:
    replay: Callable[[], None]
    vectors: torch.Tensor  # (B padded, L, D) the graph's input
    searched: _Searched  # what a replay writes


class SearchGraphs:
    """The fixed search of one decoder as CUDA graphs, one per batch shape and options."""

    def __init__(self, decoder: Decoder, *, capture: Capture | None = None, max_graphs: int = MAX_GRAPHS,
                 bucket: int = BUCKET):
        self.decoder, self.capture = decoder, capture
        self.max_graphs, self.bucket = max_graphs, bucket
        self.graphs: dict[tuple, _Graph] = {}
        self.pool = None
        self.failed: str | None = None  # why a capture failed; then no graph is tried again
        # A graph's input and outputs are one set of tensors: one search at a time uses them (the
        # app captions from several threads with one captioner).
        self.lock = threading.Lock()

    @torch.no_grad()
    def search(self, ann: Annotations, tokens: Tokens, o: DecodeOptions) -> list[DecodedIds]:
        """``decoding.beam_search``'s captions, replayed from this shape's graph (recorded the first
        time it comes), or from the fixed program run eagerly where no graph can be had."""
        vectors, b = ann.vectors, ann.vectors.shape[0]
        padded = -(-b // self.bucket) * self.bucket
        autocast = torch.get_autocast_dtype(vectors.device.type) if torch.is_autocast_enabled(vectors.device.type) \
            else None
        key = (padded, tuple(vectors.shape[1:]), vectors.dtype, vectors.device, ann.grid, autocast, tokens, o)
        with self.lock:
            graph = self.graphs.get(key)
            if graph is None and self.failed is None and len(self.graphs) < self.max_graphs:
                graph = self._record(key, vectors, ann.grid, autocast, tokens, o)
            if graph is not None:
                graph.vectors[:b].copy_(vectors)
                graph.replay()
                return graph.searched.captions(b)
        return _search(self.decoder, vectors, ann.grid, tokens, o).captions(b)

    def _record(self, key: tuple, vectors: torch.Tensor, grid: tuple[int, int], autocast: torch.dtype | None,
                tokens: Tokens, o: DecodeOptions) -> _Graph | None:
        with torch.inference_mode(False):  # tensors that later calls, in inference mode or not, may write
            static = vectors.new_zeros(key[0], *vectors.shape[1:])
            static[:vectors.shape[0]].copy_(vectors)
        dev = vectors.device.type

        def run() -> _Searched:
            # Autocast's cache of cast weights is freed when the caller's autocast ends; a graph
            # must compute its casts itself.
            with torch.inference_mode(False), torch.autocast(dev, dtype=autocast or torch.float32,
                                                             enabled=autocast is not None, cache_enabled=False):
                return _search(self.decoder, static, grid, tokens, o)

        try:
            replay, searched, self.pool = (self.capture or CAPTURE)(run, self.pool)
        except Exception as e:  # an operation a graph cannot hold: the eager fixed form from now on
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            self.failed = f"{type(e).__name__}: {first}"
            warnings.warn(f"the beam search could not be recorded as a CUDA graph ({self.failed}); "
                          "it runs without one", RuntimeWarning, stacklevel=4)  # past search and its no_grad
            return None
        graph = self.graphs[key] = _Graph(replay, static, searched)
        return graph
