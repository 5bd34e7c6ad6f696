"""A `captioner` call, whole process, with the command's quick exit and with the usual one.

    python -m benchmarks.bench_exit IMAGE [--pairs 8] [-- CAPTION ARGS...]

Runs ``python -m captioner.cli caption IMAGE`` (the command as installed: ``run()``, which
collects the garbage and freezes what is alive before the interpreter's shutdown) and the same
call through ``main()`` alone (the usual shutdown), in turn, ``--pairs`` times each, and prints
each one's median wall time and the median of the pairs' ratios. Taking the pairs in turn keeps
the ratio meaningful while the machine's speed drifts. The figures are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

QUICK = [sys.executable, "-m", "captioner.cli"]
USUAL = [sys.executable, "-c", "import sys; from captioner.cli.main import main; sys.exit(main())"]


def timed(argv: list[str]) -> float:
    """Wall seconds of one whole process; it must exit 0."""
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_exit", description=__doc__.split("\n\n")[0])
    ap.add_argument("image", help="an image to caption")
    ap.add_argument("--pairs", type=int, default=8, help="runs of each, taken in turn (default 8)")
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []  # more arguments for `captioner caption`
    args = ap.parse_args(argv[:len(argv) - len(extra) - (1 if "--" in argv else 0)])
    if args.pairs < 1:
        ap.error("--pairs must be at least 1")
    command = ["caption", args.image, *extra]
    timed(QUICK + command)  # a warm-up: the files read once into the page cache
    quick, usual = [], []
    for i in range(args.pairs):
        order = [(quick, QUICK), (usual, USUAL)] if i % 2 == 0 else [(usual, USUAL), (quick, QUICK)]
        for into, prefix in order:
            into.append(timed(prefix + command))
    ratios = [q / u for q, u in zip(quick, usual, strict=True)]
    print(f"run():  median {statistics.median(quick):.2f} s wall (min {min(quick):.2f}, max {max(quick):.2f})")
    print(f"main(): median {statistics.median(usual):.2f} s wall (min {min(usual):.2f}, max {max(usual):.2f})")
    print(f"run() / main(), pair by pair: median {statistics.median(ratios):.2f} "
          f"(min {min(ratios):.2f}, max {max(ratios):.2f}) over {args.pairs} pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
