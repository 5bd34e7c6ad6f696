"""One benchmark at two commits, interleaved: speed before and after a change.

    python benchmarks/bench_revisions.py BEFORE [AFTER] [--rounds 3] [--unit images/s] -- SCRIPT [ARGS...]
    python benchmarks/bench_revisions.py bdc8e8e -- benchmarks/bench_decoder.py --search-demo 64 --repeats 2 --threads 1

Each commit's tracked files are copied out (git archive) into a temporary folder, with its
train/ and app/ reachable as captioner.train and captioner.app as an install makes them;
SCRIPT then runs from each copy in turn (AFTER first in odd rounds, BEFORE first in even
ones), with this environment's packages. The figure is the first number before ``--unit``
in each run's output; printed are every round's figures and the median of AFTER / BEFORE
(above 1: AFTER is faster, for a rate). AFTER defaults to the working tree as committed
(HEAD); uncommitted changes are not measured.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def figure(output: str, unit: str) -> float:
    """The first number written just before ``unit`` in ``output``; ValueError if there is none."""
    found = re.search(r"(\d+(?:\.\d+)?)\s*" + re.escape(unit), output)
    if found is None:
        raise ValueError(f"no figure in {unit} in the benchmark's output")
    return float(found.group(1))


def checkout(rev: str, into: Path) -> Path:
    """``rev``'s tracked files under ``into``/rev, importable as an installed captioner."""
    tree = into / rev
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    for part in ("train", "app"):
        (tree / "captioner" / part).symlink_to(Path("..") / part)
    return tree


def run(tree: Path, script: list[str], unit: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, *script], cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{tree.name}: {' '.join(script)} failed: {done.stderr.strip()[-500:]}")
    return figure(done.stdout, unit)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("bench_revisions: give the benchmark after --, e.g. -- benchmarks/bench_decoder.py", file=sys.stderr)
        return 2
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before")
    ap.add_argument("after", nargs="?", default="HEAD")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--unit", default="images/s", help="the figure's unit in the output (default images/s)")
    args = ap.parse_args(argv[:cut])
    script = argv[cut + 1:]
    with tempfile.TemporaryDirectory() as tmp:
        trees = {rev: checkout(rev, Path(tmp)) for rev in (args.before, args.after)}
        ratios = []
        for r in range(args.rounds):
            order = (args.after, args.before) if r % 2 == 0 else (args.before, args.after)
            got = {rev: run(trees[rev], script, args.unit) for rev in order}
            ratios.append(got[args.after] / got[args.before])
            print(f"round {r + 1}: {args.before} {got[args.before]:g}, {args.after} {got[args.after]:g} "
                  f"{args.unit}; ratio {ratios[-1]:.3f}", flush=True)
    print(f"{args.after} / {args.before}: median {statistics.median(ratios):.3f} over {args.rounds} rounds "
          f"(rounds {', '.join(f'{x:.3f}' for x in ratios)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
