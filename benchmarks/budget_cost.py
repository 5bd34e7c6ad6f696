"""What a character budget (--max-chars) costs the search, against no budget, at beam 3.

    python -m benchmarks.budget_cost [--weights demo-soft] [--images 200] [--budgets 125,30]
        [--rounds 5] [--threads 1] [--paper-vocab]

Two measurements, each setting timed in turn (the order reversed every other round, after a
warm-up batch), round by round, on the same inputs:

- a demo model on fresh shapes images (`captioner shapes --seed 31415`), batches of 16, the
  search with its encoder (``Captioner.caption_batch``): each budget's time against no budget
  (median of the rounds' ratios), its decoder steps against no budget's, how many captions it
  changed, and that every caption fits. A budget the captions already fit (125 on shapes)
  costs only the mask; a tight one (30) changes captions, and so the steps.
- with ``--paper-vocab``, the search alone at the paper's sizes (decoder.py's random decoder:
  vocabulary 10,000 words of 1 to 12 letters, L = 196, D = 2048, hidden 512, batch 32, 20
  words), where the mask's (B*k, V) comparison each step is largest against the step.
Ratios above 1: the budget is slower.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from benchmarks.nbest_cost import shapes_batches
from captioner.data.vocab import SPECIALS, Vocabulary
from captioner.inference import Captioner, DecodeOptions
from captioner.model.decoder import Decoder, ModelConfig
from captioner.model.encoders import Annotations
from captioner.search.decoding import beam_search
from captioner.search.options import Tokens

PAPER = dict(vocab_size=10_000, annotation_dim=2048, embed_dim=512, hidden_dim=512, attention_dim=512)


def _ratios(runs: dict[str, list[float]]) -> dict[str, float]:
    """Each setting's median ratio of its time to no budget's, round by round."""
    return {name: statistics.median(t / base for t, base in zip(times, runs["none"]))
            for name, times in runs.items() if name != "none"}


def on_demo(args) -> None:
    cap = Captioner.load(args.weights)
    batches = shapes_batches(cap, args.images, 16)
    settings = {"none": DecodeOptions(beam_size=3, max_len=cap.max_len)}
    settings |= {str(c): DecodeOptions(beam_size=3, max_len=cap.max_len, max_chars=c) for c in args.budgets}
    decoder, real_step = cap.model.decoder, cap.model.decoder.step
    steps = {name: 0 for name in settings}
    runs: dict[str, list[float]] = {name: [] for name in settings}
    results: dict[str, list] = {}
    for options in settings.values():  # warm-up: one batch each, not timed
        cap.caption_batch(batches[0], options)
    for r in range(args.rounds):
        seconds = {name: 0.0 for name in settings}
        out: dict[str, list] = {name: [] for name in settings}
        order = list(settings.items())[::1 if r % 2 == 0 else -1]  # no setting always first
        for pixels in batches:
            for name, options in order:
                if r == 0:
                    def counting(*a, _name=name, **kw):
                        steps[_name] += 1
                        return real_step(*a, **kw)
                    decoder.step = counting
                start = time.perf_counter()
                out[name] += cap.caption_batch(pixels, options)
                seconds[name] += time.perf_counter() - start
                decoder.__dict__.pop("step", None)
        for name in settings:
            runs[name].append(seconds[name])
        results = out
    print(f"{args.weights}, beam 3, {args.images} shapes images in batches of 16, {args.threads} thread(s), "
          f"{args.rounds} rounds")
    print(f"  no budget: {1000 * min(runs['none']) / args.images:.2f} ms per image (fastest round), "
          f"{steps['none']} decoder steps")
    ratios = _ratios(runs)
    for c in args.budgets:
        name = str(c)
        got = results[name]
        changed = sum(a.words != b.words for a, b in zip(got, results["none"]))
        fits = sum(r.no_fit is None and len(r.caption) <= c for r in got)
        print(f"  --max-chars {c}: time / no budget {ratios[name]:.3f} (median of {args.rounds} rounds), steps "
              f"{steps[name] / steps['none']:.3f}, captions changed {changed} of {len(got)}, fit {fits}")


def on_paper_vocab(args) -> None:
    torch.manual_seed(0)
    rng = random.Random(0)
    words = list(SPECIALS)
    while len(words) < PAPER["vocab_size"]:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 12)))
        if word not in words:
            words.append(word)
    tokens = Tokens.of(Vocabulary(words))
    decoder = Decoder(ModelConfig(**PAPER, dropout=0.0)).eval()
    ann = Annotations(torch.randn(32, 196, PAPER["annotation_dim"]), (14, 14))
    settings = {"none": DecodeOptions(beam_size=3, max_len=20)}
    settings |= {str(c): DecodeOptions(beam_size=3, max_len=20, max_chars=c) for c in args.budgets}
    runs: dict[str, list[float]] = {name: [] for name in settings}
    for r in range(args.rounds):
        for name, options in list(settings.items())[::1 if r % 2 == 0 else -1]:
            start = time.perf_counter()
            beam_search(decoder, ann, tokens, options)
            runs[name].append(time.perf_counter() - start)
    print(f"paper sizes (vocabulary 10,000, random weights), beam 3, batch 32, 20 words, {args.rounds} rounds")
    print(f"  no budget: {min(runs['none']):.3f} s per batch (fastest round)")
    for name, ratio in _ratios(runs).items():
        print(f"  --max-chars {name}: time / no budget {ratio:.3f} (median of {args.rounds} rounds)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", default="demo-soft")
    p.add_argument("--images", type=int, default=200)
    p.add_argument("--budgets", type=lambda s: [int(x) for x in s.split(",")], default=[125, 30],
                   help="character budgets, comma-separated (default 125,30)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--paper-vocab", action="store_true", help="also time the search alone at the paper's sizes")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with torch.no_grad():
        on_demo(args)
        if args.paper_vocab:
            on_paper_vocab(args)


if __name__ == "__main__":
    main()
