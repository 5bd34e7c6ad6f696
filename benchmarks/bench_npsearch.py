"""The torch-free runtime's numpy beam search alone, at the paper's sizes: its own cost per caption.

    python benchmarks/bench_npsearch.py [--images 1] [--repeats 20] [--vocab 10000]

captioner.onnx.search.beam_search (beam 3, 20 words) around a stand-in step that hands back
log-probabilities fixed beforehand (vocabulary 10,000, <end> out of reach, so every caption has
20 words), 196 locations: what is timed is the search's numpy work per step (masking, the best
2k of k x V candidates, the pool, the trace) and the read-back, without the graph. Prints ms per
caption (the median of --repeats searches of --images images, divided by the images).
To time it before and after a change: benchmarks/bench_revisions.py REV --unit "ms per caption"
-- benchmarks/bench_npsearch.py (a lower figure is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from captioner.onnx.search import beam_search
from captioner.search.options import DecodeOptions, Tokens

L, D, A, H = 196, 2048, 512, 512


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=10_000)
    args = ap.parse_args()
    tokens = Tokens(start=1, end=2, pad=0, unk=3)
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((64, args.vocab)).astype(np.float32)
    logits[:, tokens.end] = -1e4
    table = logits - np.log(np.exp(logits).sum(1, keepdims=True))  # (64, V) log-softmax rows
    calls = [0]

    def step(word, h, c, ann, keys):
        n = len(word)
        calls[0] += 1
        i = calls[0] % (64 - n)
        return table[i:i + n].copy(), h, c, np.full((n, 1, L), 1 / L, np.float32), np.ones(n, np.float32)

    b = args.images
    ann, keys = np.zeros((b, L, D), np.float32), np.zeros((b, L, A), np.float32)
    h = np.zeros((b, H), np.float32)
    opts = DecodeOptions(beam_size=3, max_len=20)
    words = len(beam_search(step, ann, keys, h, h, tokens, opts)[0].ids)  # warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        beam_search(step, ann, keys, h, h, tokens, opts)
        times.append(time.perf_counter() - start)
    print(f"numpy beam search, beam 3, vocabulary {args.vocab}, {b} image(s), {words} tokens per caption: "
          f"{statistics.median(times) / b * 1000:.2f} ms per caption")


if __name__ == "__main__":
    main()
