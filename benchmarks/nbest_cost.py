"""What the N best captions cost: --num-captions 3 against 1 at beam 3, on a demo.

    python -m benchmarks.nbest_cost [--weights demo-soft] [--images 200] [--runs 3] [--threads 1]

On fresh shapes images (`captioner shapes --seed 31415`), batches of 16, the search alone
(encoder included, no image loading): decoder steps (calls, and beam rows summed over the
calls) and the fastest of ``--runs`` timings of each setting, taken in turn batch by batch.
Prints the ratio N = 3 / N = 1 of each, how many images got 1, 2 or 3 captions, whether the
best captions are the same, and digests of N = 1's captions with their step counts, and of
the captions alone (run it on two versions of the code: the same digests mean the same
captions and the same steps; a search that keeps every image in the batch until all are done
takes other steps for the same captions).
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from captioner.inference import Captioner, DecodeOptions


def shapes_batches(cap: Captioner, images: int, batch: int) -> list[torch.Tensor]:
    from captioner.data.images import load_image
    from captioner.data.shapes import generate_dataset

    with tempfile.TemporaryDirectory() as tmp:
        generate_dataset(Path(tmp), {"test": images}, seed=31415)
        paths = sorted((Path(tmp) / "images" / "test").glob("*.png"))
        pixels = torch.stack([cap.preprocess(load_image(p)) for p in paths])
    return list(pixels.split(batch))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", default="demo-soft")
    p.add_argument("--images", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--beam-size", type=int, default=3)
    p.add_argument("--num-captions", type=int, default=3)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cap = Captioner.load(args.weights)
    batches = shapes_batches(cap, args.images, args.batch_size)
    settings = {n: DecodeOptions(beam_size=args.beam_size, max_len=cap.max_len, num_captions=n)
                for n in (1, args.num_captions)}
    decoder, real_step = cap.model.decoder, cap.model.decoder.step
    calls: dict[int, list[int]] = {n: [] for n in settings}  # rows of each decoder step
    best = {n: float("inf") for n in settings}
    results: dict[int, list] = {}
    for run in range(args.runs):
        seconds = {n: 0.0 for n in settings}
        out: dict[int, list] = {n: [] for n in settings}
        for pixels in batches:
            for n, options in settings.items():
                rows: list[int] = []
                decoder.step = lambda y, *a, _rows=rows, **kw: _rows.append(y.shape[0]) or real_step(y, *a, **kw)
                start = time.perf_counter()
                out[n] += cap.caption_batch(pixels, options)
                seconds[n] += time.perf_counter() - start
                del decoder.step
                if run == 0:
                    calls[n] += rows
        for n in settings:
            best[n] = min(best[n], seconds[n])
        results = out
    one, many = 1, args.num_captions
    digest = hashlib.sha1(repr(([r.words for r in results[one]], calls[one])).encode()).hexdigest()[:12]
    words = hashlib.sha1(repr([r.words for r in results[one]]).encode()).hexdigest()[:12]
    print(f"{args.weights}, beam {args.beam_size}, {args.images} images in batches of {args.batch_size}, "
          f"{args.threads} thread(s), fastest of {args.runs}")
    for n in settings:
        print(f"  N = {n}: {len(calls[n])} decoder steps, {sum(calls[n])} beam rows, "
              f"{1000 * best[n] / args.images:.2f} ms per image")
    print(f"  ratio N = {many} / N = 1: steps {len(calls[many]) / len(calls[one]):.3f}, beam rows "
          f"{sum(calls[many]) / sum(calls[one]):.3f}, time {best[many] / best[one]:.3f}")
    got = Counter(len(r.alternatives) for r in results[many])
    print(f"  captions per image with N = {many}: " + ", ".join(f"{k}: {got[k]}" for k in sorted(got)))
    same = sum(a.words == b.words for a, b in zip(results[one], results[many]))
    print(f"  best caption the same as N = 1's: {same} of {args.images}")
    print(f"  N = 1 digest (captions and steps): {digest}; of the captions alone: {words}")


if __name__ == "__main__":
    main()
