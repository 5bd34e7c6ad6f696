"""Training and captioning throughput of a ResNet-101 model at the paper's sizes, by
numeric precision and with or without torch.compile of the decoder step. Meant for a GPU.

    python benchmarks/bench_precision.py --device cuda [--batch-size 32] [--repeats 5]
    python benchmarks/bench_precision.py --device cpu --batch-size 4 --repeats 1 --variants fp32,bf16
    python benchmarks/bench_precision.py --device cpu --batch-size 2 --repeats 1 --encoder small --tiny

ResNet-101 (random weights: speed does not depend on them) at 224 px gives 7x7x2048
annotations; decoder 512/512/512, vocabulary 10,000, 20-word captions. ``--encoder`` takes
another encoder and ``--tiny`` tiny sizes (32 px, 16/16/16, V = 50, 4 words): the GPU check's CPU
test (benchmarks/gpu_check.py --quick) runs every workload so, in seconds.
- training: images/s of one optimiser step (frozen encoder forward, teacher-forced decoder
  forward and backward, doubly stochastic penalty, Adam), autocast and gradient scaling as
  `captioner train` does them (train/precision.py), with training's optimiser (fused Adam);
- captioning: images/s of encoder + batched beam search (k=3, 20 steps: <end> never wins,
  the worst case), as `captioner caption --precision P [--compile]` runs it.
Variants are "fp32", "bf16", "fp16", each optionally with "+compile" (the decoder step
compiled by inductor), "+static" (compiled for fixed shapes, ``dynamic=False``: what the
dynamic batch dimension costs a compiled call) and "+cl" (channels-last: the encoder's weights
and the images in torch.channels_last memory format, the layout a GPU's convolutions prefer;
a speed switch, off unless asked for) and "+graphs" (the training step's forward and backward
replayed as a CUDA graph, train/graphed.py; fp32 and bf16, not compiled; and captioning as
`captioner caption` runs it on a GPU, with the search as CUDA graphs, captioner/search/graph.py,
and in bf16 the encoder in channels-last; without "+graphs" captioning takes the plain forms),
in any order:
"bf16+cl", "bf16+cl+compile", "bf16+cl+graphs". Each variant
builds its own model, and each model compiles its own copy of the decoder step (see
Decoder.compile_step), so a later variant never runs on an earlier one's compiled graphs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from captioner.data.images import Preprocess
from captioner.data.vocab import SPECIALS, Vocabulary
from captioner.inference import INFERENCE_PRECISIONS, Captioner, DecodeOptions
from captioner.model import kernels
from captioner.model.decoder import CaptionModel, ModelConfig, attention_penalty
from captioner.model.encoders import encoder_names
from captioner.train.config import OptimConfig
from captioner.train.graphed import GraphedSoftStep
from captioner.train.loop import build_optimizer
from captioner.train.losses import LossParts, caption_log_likelihood, soft_loss
from captioner.train.precision import MixedPrecision


@dataclass(frozen=True)
class Sizes:
    """The model's and the workloads' sizes: square images of ``image`` px, a decoder of
    ``dim``/``dim``/``dim`` (embedding, hidden, attention), ``vocab`` words, captions of ``steps``
    words (and as many search steps)."""

    image: int
    dim: int
    vocab: int
    steps: int

    def describe(self) -> str:
        vocab = f"{self.vocab // 1000}k" if self.vocab % 1000 == 0 else str(self.vocab)
        return f"{self.image} px, decoder {self.dim}/{self.dim}/{self.dim}, V={vocab}"


PAPER = Sizes(image=224, dim=512, vocab=10_000, steps=20)
# --tiny: every workload's code at sizes a CPU test runs in seconds; its figures mean nothing.
TINY = Sizes(image=32, dim=16, vocab=50, steps=4)
STEPS = PAPER.steps


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _best(fn, repeats: int, dev: torch.device) -> float:
    fn()  # warm-up (and compilation)
    _sync(dev)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        _sync(dev)
        best = min(best, time.perf_counter() - t)
    return best


def parse_variant(variant: str) -> tuple[str, bool | str, bool]:
    """"bf16+cl+compile" -> ("bf16", compiled step, channels-last): a precision, then any of
    "+compile", "+static" and "+cl" in any order; anything else is refused before a model is
    built. The compiled step is False, True (dynamic batch, as `captioner` compiles it) or
    "static" (fixed shapes)."""
    precision, *extras = variant.strip().split("+")
    unknown = [e for e in extras if e not in ("compile", "static", "cl", "graphs")]
    if precision not in INFERENCE_PRECISIONS or unknown:
        raise ValueError(f"variant {variant!r}: a precision ({', '.join(INFERENCE_PRECISIONS)}), optionally "
                         "+compile, +static, +cl and +graphs")
    if "graphs" in extras and (precision == "fp16" or "compile" in extras or "static" in extras):
        raise ValueError(f"variant {variant!r}: +graphs is for fp32 and bf16, not compiled (train/graphed.py)")
    compiled = "static" if "static" in extras else "compile" in extras
    return precision, compiled, "cl" in extras


def variants_arg(text: str) -> list[str]:
    """``--variants``: comma-separated variant names, each checked by :func:`parse_variant`
    before any model is built (argparse reports a bad one in one line)."""
    variants = [v.strip() for v in text.split(",") if v.strip()]
    for v in variants:
        try:
            parse_variant(v)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return variants


def build(dev: torch.device, compile_step: bool | str, encoder: str = "resnet101",
          sizes: Sizes = PAPER) -> Captioner:
    """The benchmark's model: ResNet-101 (random weights; ``encoder`` names another, for a quick
    test) at 224 px, decoder 512/512/512, V = 10,000 (``sizes``: other sizes), with <end> pushed
    down so that every caption runs its full length."""
    torch.manual_seed(0)
    vocab = Vocabulary(list(SPECIALS) + [f"w{i}" for i in range(sizes.vocab - len(SPECIALS))])
    side = (sizes.image, sizes.image)
    cfg = ModelConfig(vocab_size=len(vocab), encoder=encoder, image_size=side, embed_dim=sizes.dim,
                      hidden_dim=sizes.dim, attention_dim=sizes.dim, dropout=0.5, freeze_encoder=True)
    model = CaptionModel(cfg).to(dev)
    with torch.no_grad():
        model.decoder.L_o.bias[vocab.end] = -1e4  # no caption ends early
    cap = Captioner(model, vocab, Preprocess(size=side))
    if compile_step:
        cap.compile(**({"dynamic": False} if compile_step == "static" else {}))
    return cap


def use_channels_last(model: CaptionModel, images: torch.Tensor) -> torch.Tensor:
    """Puts the encoder's weights in channels-last (NHWC) memory format and returns ``images`` in
    it too: a GPU's convolutions (bf16 ones above all) run on NHWC natively, so the layout
    transposes around each of them go away. The values do not change, only their order in memory."""
    model.encoder.to(memory_format=torch.channels_last)
    return images.contiguous(memory_format=torch.channels_last)


def make_train_step(cap: Captioner, precision: str, images: torch.Tensor, graphs: bool = False,
                    steps: int = STEPS) -> Callable[[], None]:
    """One training step on ``images`` as `captioner train` runs it: frozen encoder forward,
    teacher-forced decoder forward and backward on random 20-word captions (``steps`` words), doubly stochastic
    penalty, training's fused Adam, autocast and gradient scaling (train/precision.py).
    ``graphs``: the forward and backward replayed as a CUDA graph (train/graphed.py)."""
    model, dev, batch = cap.model, images.device, images.shape[0]
    tokens = torch.randint(len(SPECIALS), len(cap.vocab), (batch, steps + 1), device=dev)
    tokens[:, 0] = cap.vocab.start
    lengths = torch.full((batch,), steps + 1, device=dev)
    mp = MixedPrecision(precision, dev)
    opt = build_optimizer([{"params": list(model.decoder.parameters()), "lr": 1e-4}], OptimConfig())  # training's
    if graphs:
        def loss(inputs, toks, lens, steps) -> LossParts:  # the same loss as train_step's below
            return soft_loss(model, inputs, toks, lens, 1.0, steps=steps)

        graphed = GraphedSoftStep(loss, list(model.decoder.parameters()), lambda: torch.autocast(
            dev.type, dtype=mp.dtype or torch.float32, enabled=mp.dtype is not None, cache_enabled=False))

        def graphed_step() -> None:
            model.train()
            graphed.step(images, tokens, lengths)  # one shape: always its graph
            mp.step(opt, model.decoder.parameters(), 5.0)

        return graphed_step

    def train_step() -> None:
        model.train()
        with mp.autocast():
            out = model(images, tokens, lengths)
            loss = -caption_log_likelihood(out, tokens[:, 1:]).mean() + attention_penalty(out.alphas.float(), out.mask)
        opt.zero_grad(set_to_none=True)
        mp.backward(loss)
        mp.step(opt, model.decoder.parameters(), 5.0)

    return train_step


def make_caption(cap: Captioner, precision: str, images: torch.Tensor, graphs: bool = False,
                 steps: int = STEPS) -> Callable[[], None]:
    """Captioning of ``images``: encoder, then batched beam search (k = 3, 20 words, or ``steps``). Without
    ``graphs`` in plain forms (the kernels off: NCHW unless the variant has "+cl", the plain
    search); with ``graphs`` as `captioner caption --precision P` runs it on a GPU (the search's
    fixed program as CUDA graphs, captioner.search_graph, and in bf16/fp16 the encoder in
    channels-last; on a CPU the plain forms all the same)."""
    cap.use_precision(precision)
    allowed = kernels.enabled()

    def caption() -> None:
        before = kernels.set_enabled(graphs and allowed)  # on a GPU captioning's one fast form is the search's
        try:
            cap.caption_batch(images, DecodeOptions(beam_size=3, max_len=steps))
        finally:
            kernels.set_enabled(before)

    return caption


def prepare(variant: str, dev: torch.device, batch: int, encoder: str = "resnet101",
            sizes: Sizes = PAPER) -> tuple[Callable[[], None], Callable[[], None]]:
    """(training step, captioning batch) of one variant, on a model of its own and random images."""
    precision, compile_step, channels_last = parse_variant(variant)
    cap = build(dev, compile_step, encoder, sizes)
    images = torch.randn(batch, 3, sizes.image, sizes.image, device=dev)
    if channels_last:
        images = use_channels_last(cap.model, images)
    graphs = "graphs" in variant.split("+")
    return (make_train_step(cap, precision, images, graphs, sizes.steps),
            make_caption(cap, precision, images, graphs, sizes.steps))


def bench_variant(variant: str, dev: torch.device, batch: int, repeats: int, encoder: str = "resnet101",
                  sizes: Sizes = PAPER) -> tuple[float, float]:
    train_step, caption = prepare(variant, dev, batch, encoder, sizes)
    t_train = _best(train_step, repeats, dev)
    t_cap = _best(caption, repeats, dev)
    return batch / t_train, batch / t_cap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats; the best is reported")
    ap.add_argument("--variants", type=variants_arg, default="fp32,bf16,fp16,fp32+compile,bf16+compile",
                    help="comma-separated, from fp32, bf16, fp16, each optionally +compile, +static (compiled for "
                         "fixed shapes) and +cl (channels-last)")
    ap.add_argument("--encoder", default="resnet101", choices=encoder_names(),
                    help="the encoder (random weights); default resnet101")
    ap.add_argument("--tiny", action="store_true",
                    help=f"tiny sizes ({TINY.describe()}, {TINY.steps} words) instead of the paper's: a quick CPU "
                         "run of every workload (benchmarks/gpu_check.py --quick), whose figures mean nothing")
    args = ap.parse_args()
    variants = args.variants
    sizes = TINY if args.tiny else PAPER
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{name}; torch {torch.__version__}; {args.encoder} {sizes.describe()}, "
          f"batch {args.batch_size}, {sizes.steps} steps, beam 3")
    print(f"{'variant':<14} {'train img/s':>12} {'caption img/s':>14}")
    base = None
    for variant in variants:
        tr, cp = bench_variant(variant, dev, args.batch_size, args.repeats, args.encoder, sizes)
        base = base or (tr, cp)
        print(f"{variant:<14} {tr:>12.1f} {cp:>14.1f}   ({tr / base[0]:.2f}x, {cp / base[1]:.2f}x the first)")


if __name__ == "__main__":
    main()
