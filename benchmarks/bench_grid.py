"""What self-attention over the grid (model.grid_layers) costs: training steps/s and
beam-search images/s for each layer count, in interleaved rounds.

    python benchmarks/bench_grid.py [--layers 0,1,2] [--rounds 5] [--threads 1] [--features]
                                    [--search] [--paper] [--heads 8] [--batch 32]

Default: demo-soft's model (train/configs/shapes-soft.toml: the small8 encoder trained
from scratch, 128 px images, a 16x16 grid of D = 128, embedding/hidden/attention
128/256/128, 30 words), batch 32, captions of 5 to 12 words, one Adam step on the
caption log-likelihood, encoder included. ``--features``: the decoder alone on annotations
given (what a run with the feature cache trains). ``--paper``: the paper's COCO sizes on
annotations given (14x14 grid, D = 2048, 512/512/512, 10,000 words, 20 words a caption).
Grid blocks use the defaults (8 heads unless ``--heads``, clip 4, width min(D, 512),
feed-forward twice that).

Each round times one step of every layer count, one after the other, so that a busy
machine slows all of them alike; the median over rounds and the ratio to the first
layer count are printed, with the parameter counts and the arithmetic of one training
step (torch's FLOP counter: matrix products, convolutions, attention), which no load
on the machine changes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from captioner.model.decoder import CaptionModel, Decoder, ModelConfig
from captioner.model.encoders import Annotations
from captioner.search.decoding import beam_search
from captioner.search.options import DecodeOptions, Tokens

DEMO = dict(vocab_size=30, encoder="small8", image_size=(128, 128), embed_dim=128, hidden_dim=256,
            attention_dim=128, dropout=0.3)
PAPER = dict(vocab_size=10_000, annotation_dim=2048, embed_dim=512, hidden_dim=512, attention_dim=512, dropout=0.5)


def _log_likelihood(out, tokens: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(out.logits.float(), dim=-1).gather(2, tokens[:, 1:, None]).squeeze(2)  # (B, T)
    return (logp * out.mask).sum(1)


def build(layers: int, args) -> tuple[torch.nn.Module, Decoder]:
    torch.manual_seed(0)
    if args.paper:
        decoder = Decoder(ModelConfig(**PAPER, grid_layers=layers, grid_heads=args.heads))
        return decoder, decoder
    model = CaptionModel(ModelConfig(**DEMO, grid_layers=layers, grid_heads=args.heads))
    return model, model.decoder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="0,1,2", help="grid layer counts to compare, comma-separated")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timed rounds (after one warm-up)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8, help="model.grid_heads of the grid blocks")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's choice)")
    ap.add_argument("--features", action="store_true", help="decoder only, on annotations given (feature cache)")
    ap.add_argument("--paper", action="store_true", help="the paper's COCO sizes, on annotations given")
    ap.add_argument("--search", action="store_true", help="also time beam search (k=3, 20 steps, whole batch)")
    args = ap.parse_args()
    try:
        layer_counts = [int(x) for x in args.layers.split(",")]
    except ValueError:
        ap.error(f"--layers wants comma-separated integers, got {args.layers!r}")
    if args.rounds < 1 or args.batch < 1 or args.heads < 1 or any(n < 0 for n in layer_counts):
        ap.error("--rounds, --batch and --heads must be >= 1, --layers >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)

    b = args.batch
    g = torch.Generator().manual_seed(0)
    vocab, grid = (PAPER["vocab_size"], (14, 14)) if args.paper else (DEMO["vocab_size"], (16, 16))
    lengths = torch.full((b,), 22) if args.paper else torch.randint(7, 15, (b,), generator=g)  # <start> .. <end>
    tokens = torch.randint(4, vocab, (b, int(lengths.max())), generator=g)
    tokens[:, 0] = 1
    if args.paper or args.features:
        dim = PAPER["annotation_dim"] if args.paper else 128
        inputs = Annotations(torch.rand(b, grid[0] * grid[1], dim, generator=g), grid)
    else:
        inputs = torch.randn(b, 3, 128, 128, generator=g)

    runs = {}
    for n in layer_counts:
        try:
            model, decoder = build(n, args)
        except ValueError as e:  # e.g. a width not divisible by --heads
            ap.error(str(e))
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        runs[n] = (model, decoder, opt)

    def train_step(n: int) -> None:
        model, _, opt = runs[n]
        model.train()
        out = model(inputs, tokens, lengths)
        loss = -_log_likelihood(out, tokens).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def search(n: int) -> None:
        model, decoder, _ = runs[n]
        model.eval()
        with torch.no_grad():
            ann = inputs if isinstance(inputs, Annotations) else model.encode(inputs)
            beam_search(decoder, ann, Tokens(start=1, end=2, pad=0), DecodeOptions(beam_size=3, max_len=20))

    what = "paper's COCO sizes, annotations given" if args.paper else \
        "demo-soft's model" + (", annotations given (feature cache)" if args.features else ", encoder included")
    print(f"{what}; batch {b}, grid {grid[0]}x{grid[1]}, {args.heads} grid heads, CPU, "
          f"{torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    for n, (model, decoder, _) in runs.items():
        grid_params = sum(p.numel() for p in decoder.grid_attention.parameters()) if decoder.grid_attention else 0
        print(f"grid_layers={n}: {sum(p.numel() for p in model.parameters()):,} parameters "
              f"({grid_params:,} in the grid blocks)")
    # Arithmetic (matrix products, convolutions, attention) of one training step: a figure
    # a busy machine cannot distort, beside the timings, which it can.
    flops = {}
    for n in layer_counts:
        with FlopCounterMode(display=False) as count:
            train_step(n)
        flops[n] = count.get_total_flops()
    for n in layer_counts:
        print(f"training step, grid_layers={n}: {flops[n] / 1e9:.1f} GFLOP "
              f"({flops[n] / flops[layer_counts[0]]:.2f}x grid_layers={layer_counts[0]})")
    jobs = [("training step", train_step, b)] + ([("beam search k=3", search, b)] if args.search else [])
    for name, fn, per in jobs:
        for n in layer_counts:
            fn(n)  # warm-up
        times: dict[int, list[float]] = {n: [] for n in layer_counts}
        for _ in range(args.rounds):
            for n in layer_counts:
                t = time.perf_counter()
                fn(n)
                times[n].append(time.perf_counter() - t)
        base = statistics.median(times[layer_counts[0]])
        for n in layer_counts:
            med = statistics.median(times[n])
            unit = "steps/s" if fn is train_step else "images/s"
            rate = 1 / med if fn is train_step else per / med
            print(f"{name}, grid_layers={n}: {rate:.2f} {unit} (median of {args.rounds}; "
                  f"{med / base:.2f}x the time of grid_layers={layer_counts[0]})")


if __name__ == "__main__":
    main()
