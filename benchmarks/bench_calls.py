"""Work per beam search at an earlier commit and now, counted rather than timed.

    python benchmarks/bench_calls.py BEFORE [--weights demo-soft] [--images 32]
    python benchmarks/bench_calls.py bdc8e8e --weights demo-hard

The library at BEFORE (its captioner/ from git archive, imported as ``captioner_before``)
and the working tree's caption the same generated shapes images with the same demo model
(beam 3, batch of all the images, one thread); printed are the decoder steps, the Python
function calls (cProfile) and the torch operators (torch.profiler) of each, and whether
the words and maps are identical. Counts do not depend on the machine's load, so a change
meant to add no work per step can be checked on a busy machine; timings
(bench_revisions.py) need an idle one.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def library_at(rev: str, into: Path):
    """``rev``'s captioner package as the module ``captioner_before``."""
    archive = subprocess.run(["git", "archive", rev, "captioner"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (into / "captioner").rename(into / "captioner_before")
    sys.path.insert(0, str(into))
    import captioner_before.inference
    return captioner_before.inference


def counted(inference, weights: str, images: torch.Tensor) -> tuple[int, int, int, list]:
    """Decoder steps, Python calls, torch operators of one beam search, and its results."""
    cap = inference.Captioner.load(weights)
    options = inference.DecodeOptions(beam_size=3, max_len=20)
    cap.caption_batch(images, options)  # warm-up: lazy imports and first-call work are not counted
    steps, step = [], cap.model.decoder.step
    cap.model.decoder.step = lambda *a, **kw: (steps.append(1), step(*a, **kw))[1]
    profiler = cProfile.Profile()
    profiler.enable()
    results = cap.caption_batch(images, options)
    profiler.disable()
    del cap.model.decoder.step
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        cap.caption_batch(images, options)
    return len(steps), pstats.Stats(profiler).total_calls, sum(e.count for e in prof.key_averages()), results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before")
    ap.add_argument("--weights", default="demo-soft")
    ap.add_argument("--images", type=int, default=32)
    args = ap.parse_args(argv)
    from captioner import inference
    from captioner.data.images import load_image
    from captioner.data.shapes import generate_dataset

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        before = library_at(args.before, Path(tmp))
        generate_dataset(Path(tmp) / "shapes", {"test": args.images}, seed=9102)
        paths = sorted((Path(tmp) / "shapes" / "images" / "test").glob("*.png"))
        preprocess = inference.Captioner.load(args.weights).preprocess
        images = torch.stack([preprocess(load_image(p)) for p in paths])
        s0, c0, o0, r0 = counted(before, args.weights, images)
        s1, c1, o1, r1 = counted(inference, args.weights, images)
    same = [r.words for r in r0] == [r.words for r in r1] and all(torch.equal(a.alphas, b.alphas)
                                                                  for a, b in zip(r0, r1))
    print(f"{args.weights}, {args.images} shapes images, beam 3: decoder steps {s0} -> {s1}; Python calls "
          f"{c0} -> {c1} ({(c1 - c0) / max(s1, 1):+.1f} per step, {c1 / c0 - 1:+.2%}); torch operators "
          f"{o0} -> {o1}; words and maps {'identical' if same else 'DIFFERENT'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
