"""A digest of what the demos write for fresh shapes images: to show that a change of the code
left every caption, score and alternative as it was.

    python -m benchmarks.caption_digest [--images 500] [--seed 2718] [--num-captions 3]
        [--demos demo-soft,demo-hard,demo-zh] [--code DIR]

The images are generated once (``captioner shapes``, a seed no data set of the project uses);
each demo captions them with ``python -m captioner.cli caption`` at beam 3, asking for the N
best, and the digest is taken over each line's caption, words, score, word and <end>
probabilities and alternatives, in the order of the images' names (the paths, which differ
from run to run, left out). ``--code DIR``: run the command of another checkout of the project
(its root, with ``captioner/train`` and ``captioner/app`` reachable as an install makes them),
to compare two versions with the same images.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

FIELDS = ("caption", "words", "score", "word_probs", "end_prob", "alternatives")


def digest(lines: list[str]) -> tuple[str, int]:
    """The digest of the JSON lines' FIELDS, in the order of their images' names, and how many."""
    records = sorted((json.loads(line) for line in lines if line.strip()), key=lambda r: Path(r["image"]).name)
    kept = [{k: r.get(k) for k in FIELDS} for r in records]
    return hashlib.sha1(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:12], len(kept)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=500)
    p.add_argument("--seed", type=int, default=2718)
    p.add_argument("--num-captions", type=int, default=3)
    p.add_argument("--demos", default="demo-soft,demo-hard,demo-zh")
    p.add_argument("--code", type=Path, default=None, help="the root of the checkout whose command captions")
    args = p.parse_args(argv)
    env = dict(os.environ)  # run from the temporary folder: the working directory shadows no code
    code = (args.code or Path(__file__).resolve().parents[1]).resolve()
    env["PYTHONPATH"] = os.pathsep.join([str(code), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory() as tmp:
        from captioner.data.shapes import generate_dataset

        generate_dataset(Path(tmp) / "shapes", {"test": args.images}, seed=args.seed)
        images = Path(tmp) / "shapes" / "images" / "test"
        for demo in args.demos.split(","):
            out = Path(tmp) / f"{demo}.jsonl"
            subprocess.run([sys.executable, "-m", "captioner.cli", "caption", str(images), "--weights", demo,
                            "--beam-size", "3", "--num-captions", str(args.num_captions), "--out", str(out)],
                           check=True, env=env, cwd=tmp, stderr=subprocess.DEVNULL)
            value, n = digest(out.read_text(encoding="utf-8").splitlines())
            print(f"{demo}: {n} images, N = {args.num_captions}, digest {value}")


if __name__ == "__main__":
    main()
