"""The soft objective's forward and backward replayed as CUDA graphs: a speed form, behind a switch.

At the paper's sizes a training step is some two thousand small kernels (twenty-odd per word,
forward and backward), and a GPU spends most of the step waiting for their launches, not
computing (docs/benchmarks.md, "On a GPU", has the profile). A CUDA graph records the
kernels of one forward and backward once and replays them all with one launch.

A graph holds fixed shapes and fixed memory. So each batch's captions are padded to a multiple
of ``BUCKET`` decoder steps (the padding steps come after every caption's ``<end>`` and are
masked out of the loss, as padding always is: the loss and the gradients are the plain step's),
its inputs are copied into the graph's own tensors, and one graph is kept per (batch size,
padded length), up to ``MAX_GRAPHS``; a batch of any other shape takes the plain step. The
graphs share one memory pool: they run one after another, and what each keeps (its inputs,
its loss figures, its gradients) stays referenced here.

The gradients a replay writes are the graph's own tensors; ``step`` hands them to the
parameters (``p.grad``), and the optimiser's step and the gradient clipping then run as usual,
outside the graph. Dropout inside a graph draws fresh masks at every replay (CUDA's generator
is graph-aware), so a graphed run is a run with other dropout masks, not another model.

Taken when (``graphs_apply``): a CUDA device, the soft objective, no torchrun, fp32 or bf16
(fp16's gradient scaler reads the gradients on the host), the step not compiled, and both
``optim.cuda_graphs`` and the kernels (CAPTIONER_KERNELS, captioner.kernels) on.

A capture that fails stops the run (GraphCaptureError): it leaves CUDA's random number
generator in a state that no later dropout survives, so the plain step cannot take over in the
same process. The run's last checkpoint is intact, and ``--resume RUN --set
optim.cuda_graphs=false`` goes on with the plain step.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from captioner.model import kernels
from captioner.model.encoders import Annotations

from .losses import LossParts

BUCKET = 4  # captions are padded to a multiple of this many decoder steps
MAX_GRAPHS = 16  # (batch size, padded length) pairs kept; other shapes take the plain step
WARMUP = 2  # eager forward and backward passes on a side stream before a capture (as torch asks)

# loss(inputs, tokens, lengths, steps) -> LossParts: the objective with a fixed number of steps
LossFn = Callable[[torch.Tensor | Annotations, torch.Tensor, torch.Tensor, int], LossParts]


class GraphCaptureError(RuntimeError):
    """The training step could not be recorded as a CUDA graph; the message says how to go on."""


def padded_steps(steps: int, bucket: int = BUCKET) -> int:
    """The decoder steps a graph runs for a batch whose longest caption needs ``steps``."""
    if steps < 1:
        raise ValueError(f"a caption needs at least one decoder step, got {steps}")
    return -(-steps // bucket) * bucket


def graphs_apply(*, device: torch.device, objective: str, distributed: bool, precision: str, compiled: bool,
                 enabled: bool) -> str | None:
    """None when the graphed step may run; otherwise why not, in words (for the run's log)."""
    if not enabled:
        return "optim.cuda_graphs is off"
    if not kernels.enabled():
        return f"the kernels are off ({kernels.ENVIRONMENT_VARIABLE})"
    if device.type != "cuda":
        return "not a CUDA device"
    if objective != "soft":
        return f"the {objective} objective samples on the host"
    if distributed:  # DistributedDataParallel's gradient hooks broke the capture, even for one process
        return "the run is under torchrun (DistributedDataParallel)"
    if precision == "fp16":
        return "fp16's gradient scaler reads the gradients on the host"
    if compiled:
        return "the step is compiled"
    return None


@dataclass
class _Graph:
    replay: Callable[[], None]
    inputs: torch.Tensor  # images (B, 3, H, W) or annotation vectors (B, L, D)
    tokens: torch.Tensor  # (B, steps + 1), padding beyond each batch's own columns
    lengths: torch.Tensor  # (B,)
    parts: LossParts  # the loss figures a replay writes
    grads: list[torch.Tensor | None]  # each parameter's gradient, as a replay writes it


def cuda_capture(run: Callable[[], LossParts], params: list[torch.nn.Parameter], pool):
    """Capture ``run`` (a forward and backward from fixed input tensors) as one CUDA graph:
    WARMUP eager passes on a side stream first, their gradients dropped. Returns the replay,
    the captured passes' LossParts and the memory pool, to share with the next capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP):
            run()
            for p in params:
                p.grad = None
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: the data loader's pinning thread may call CUDA while this thread captures
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        parts = run()
    return graph.replay, parts, graph.pool()


class GraphedSoftStep:
    """The training step's forward and backward as CUDA graphs, one per (batch size, padded
    length); ``step`` returns None for a batch the plain step must take."""

    def __init__(self, loss: LossFn, params: list[torch.nn.Parameter], autocast: Callable[[], AbstractContextManager],
                 *, capture=cuda_capture, max_graphs: int = MAX_GRAPHS, bucket: int = BUCKET):
        self.loss, self.params, self.autocast = loss, params, autocast
        self.capture, self.max_graphs, self.bucket = capture, max_graphs, bucket
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = None

    def step(self, inputs: torch.Tensor | Annotations, tokens: torch.Tensor, lengths: torch.Tensor) -> LossParts | None:
        """Replay (capturing first when this shape is new) the forward and backward on a batch
        already on the device: tokens (B, T+1) as the plain step takes them, lengths (B,).
        Leaves each parameter's gradient in ``p.grad`` and returns the loss figures (copies:
        the graph's own are overwritten by the next replay); None when the plain step must run
        (a new shape beyond ``max_graphs``). Raises GraphCaptureError when a capture fails."""
        key = (tokens.shape[0], padded_steps(tokens.shape[1] - 1, self.bucket))
        graph = self.graphs.get(key)
        if graph is None:
            if len(self.graphs) >= self.max_graphs:
                return None
            graph = self.graphs[key] = self._capture(inputs, tokens, lengths, key[1])
        _load(graph.inputs, graph.tokens, graph.lengths, inputs, tokens, lengths)
        graph.replay()
        for p, g in zip(self.params, graph.grads):
            p.grad = g
        parts = graph.parts
        return LossParts(parts.loss.detach().clone(), parts.nll.clone(), parts.penalty.clone(), parts.tokens.clone())

    def _capture(self, inputs, tokens: torch.Tensor, lengths: torch.Tensor, steps: int) -> _Graph:
        vectors = inputs.vectors if isinstance(inputs, Annotations) else inputs
        static_inputs = torch.empty_like(vectors)  # in the batch's layout (channels-last on a GPU in bf16)
        static_tokens = tokens.new_zeros(tokens.shape[0], steps + 1)
        static_lengths = torch.empty_like(lengths)
        fed = Annotations(static_inputs, inputs.grid) if isinstance(inputs, Annotations) else static_inputs

        def run() -> LossParts:
            with self.autocast():
                parts = self.loss(fed, static_tokens, static_lengths, steps)
            parts.loss.backward()
            return parts

        _load(static_inputs, static_tokens, static_lengths, inputs, tokens, lengths)
        kept = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        try:
            replay, parts, self.pool = self.capture(run, self.params, self.pool)
        except Exception as e:  # an operation a graph cannot hold
            for p, g in zip(self.params, kept):
                p.grad = g
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise GraphCaptureError(
                f"the training step could not be recorded as a CUDA graph ({type(e).__name__}: {first}). "
                "A failed capture leaves CUDA unusable for this process; the run's last checkpoint is intact: "
                "go on with --resume RUN_DIR --set optim.cuda_graphs=false, or start with "
                "--set optim.cuda_graphs=false") from e
        # The figures without their autograd graph: a graph kept alive keeps the parameters'
        # gradient accumulators, which the next capture would meet on another stream.
        return _Graph(replay, static_inputs, static_tokens, static_lengths,
                      LossParts(parts.loss.detach(), parts.nll, parts.penalty, parts.tokens),
                      [p.grad for p in self.params])


def _load(static_inputs: torch.Tensor, static_tokens: torch.Tensor, static_lengths: torch.Tensor,
          inputs: torch.Tensor | Annotations, tokens: torch.Tensor, lengths: torch.Tensor) -> None:
    """Copy a batch into a graph's input tensors. Token columns past the batch's own keep what an
    earlier batch left there: any word would do, those steps come after every caption's <end>
    and are masked out of the loss."""
    static_inputs.copy_(inputs.vectors if isinstance(inputs, Annotations) else inputs)
    static_tokens[:, :tokens.shape[1]].copy_(tokens)
    static_lengths.copy_(lengths)
