"""The beam search's fixed program (``decoding.search``) replayed as a CUDA graph: a speed form.

The search asks the device nothing until its last step (decoding's docstring), so on a GPU the
host queues it whole ahead of the device; the launches of its some hundred small kernels a word
still cost more than their work there (docs/benchmarks.md, "On a GPU, second session", has the
profile). A CUDA graph records all of them once and replays them with one launch. What it
returns is what the search run eagerly returns: the same captions, runners-up, scores and maps.

``SearchGraphs`` keeps one graph per (batch padded to a multiple of ``BUCKET``, annotation
shape and type, decoding options), up to ``MAX_GRAPHS``, in one shared memory pool; a batch is
copied into its graph's input tensor, the rows past the batch's own hold what an earlier batch
left there and their captions are never read. Beyond ``MAX_GRAPHS`` shapes, or after a capture
fails (said once, as a warning), the search runs eagerly, as it does with a character budget.

Taken when (``search_form``): the kernels on (CAPTIONER_KERNELS, captioner.model.kernels), a CUDA
device, a deterministic inference (hard attention's "sample" draws), and the decoder's step not
compiled (a compiled step is torch's own way of cutting launches).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from captioner.model import kernels
from captioner.model.decoder import Decoder
from captioner.model.encoders import Annotations
from captioner.search.decoding import DecodedIds, Searched, search
from captioner.search.options import DecodeOptions, Tokens

BUCKET = 8  # a batch is padded to a multiple of this many images for its graph
MAX_GRAPHS = 8  # shapes kept; another shape runs the search eagerly


def search_form(device: torch.device, hard: str, compiled: bool) -> str:
    """How ``Captioner.caption_batch`` runs the search: "graphed" (this module) or "plain" (eagerly)."""
    if kernels.enabled() and device.type == "cuda" and hard != "sample" and not compiled:
        return "graphed"
    return "plain"


# capture(run, pool) -> (replay, what the captured run returned, the pool to share with the next)
Capture = Callable[[Callable[[], Searched], object], tuple[Callable[[], None], Searched, object]]


def cuda_capture(run: Callable[[], Searched], pool) -> tuple[Callable[[], None], Searched, object]:
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
    searched: Searched  # what a replay writes


class SearchGraphs:
    """The search of one decoder as CUDA graphs, one per batch shape and options."""

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
        time it comes), or from the search run eagerly where no graph can be had. A character
        budget (``max_chars``) always runs eagerly: its tables of printed lengths are copied to
        the device at the start of each search, which a graph cannot hold."""
        vectors, b = ann.vectors, ann.vectors.shape[0]
        if o.max_chars is not None:
            return search(self.decoder, vectors, ann.grid, tokens, o).captions(b)
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
        return search(self.decoder, vectors, ann.grid, tokens, o, compact=False).captions(b)

    def _record(self, key: tuple, vectors: torch.Tensor, grid: tuple[int, int], autocast: torch.dtype | None,
                tokens: Tokens, o: DecodeOptions) -> _Graph | None:
        with torch.inference_mode(False):  # tensors that later calls, in inference mode or not, may write
            static = vectors.new_zeros(key[0], *vectors.shape[1:])
            static[:vectors.shape[0]].copy_(vectors)
        dev = vectors.device.type

        def run() -> Searched:
            # Autocast's cache of cast weights is freed when the caller's autocast ends; a graph
            # must compute its casts itself.
            with torch.inference_mode(False), torch.autocast(dev, dtype=autocast or torch.float32,
                                                             enabled=autocast is not None, cache_enabled=False):
                return search(self.decoder, static, grid, tokens, o, compact=False)

        try:
            replay, searched, self.pool = (self.capture or CAPTURE)(run, self.pool)
        except Exception as e:  # an operation a graph cannot hold: the eager search from now on
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            self.failed = f"{type(e).__name__}: {first}"
            warnings.warn(f"the beam search could not be recorded as a CUDA graph ({self.failed}); "
                          "it runs without one", RuntimeWarning, stacklevel=4)  # past search and its no_grad
            return None
        graph = self.graphs[key] = _Graph(replay, static, searched)
        return graph
