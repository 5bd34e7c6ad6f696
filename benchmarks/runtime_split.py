"""Where the torch-free runtime's time goes at a batch size: the encoder, the step's graph, and
the search's own numpy work, beside the bytes each step's graph reads.

    python benchmarks/runtime_split.py FOLDER [--batch 8] [--rounds 3] [--threads 2] [--words 20] [--spin]

FOLDER is an exported model (``captioner export ... --onnx``; bench_peers.py --folders keeps the
paper-size ones). Each round encodes the same fresh shapes images and runs the runtime's beam
search (beam 3, exactly ``--words`` words at most) with the step's graph timed call by call;
printed are the medians over the rounds, in ms per image. A step's graph reads the step's
weights once for all its rows, and the annotations and keys once per row: each beam of an
image carries its own copy. When those bytes over the step's time come near the machine's
memory rate (printed beside them: one large copy, bytes read plus written), the step is bound by
memory rather than by arithmetic.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

BEAM = 3


def step_bytes(weights: int, rows: int, cells: int, features: int, attention: int) -> dict[str, int]:
    """The bytes one call of the step's graph reads, by what they are: its ``weights`` (once a
    call), the annotations and keys (once a row: (rows, cells, features) and (rows, cells,
    attention) fp32), and what the rows would read with each image's annotations and keys read
    once for its ``BEAM`` rows."""
    per_row = 4 * cells * (features + attention)
    return {"weights": weights, "annotations and keys": rows * per_row,
            "annotations and keys, once an image": -(-rows // BEAM) * per_row}


def weights_read(graph) -> int:
    """The bytes of an ONNX graph's weights that one call reads whole: every initializer but those
    a Gather looks rows up in (the word embedding: a call reads one row a word)."""
    from onnx import numpy_helper

    looked_up = {n.input[0] for n in graph.node if n.op_type == "Gather"}
    return sum(numpy_helper.to_array(i).nbytes for i in graph.initializer if i.name not in looked_up)


def copy_rate(megabytes: int = 256, repeats: int = 5) -> float:
    """This machine's memory rate in GB/s, bytes read plus written, as the fastest of ``repeats``
    copies of an array too large for any cache: the roofline's other side."""
    import numpy as np

    a = np.ones(megabytes * 2**20 // 4, np.float32)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - began)
    return 2 * a.nbytes / best / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--words", type=int, default=20)
    ap.add_argument("--spin", action="store_true", help="the threads spin between runs (the runtime's --spin)")
    args = ap.parse_args(argv)
    if args.batch < 1 or args.rounds < 1:
        ap.error("--batch and --rounds must be at least 1")

    import numpy as np

    from captioner.data.shapes import generate_split
    from captioner.io import folder as fmt
    from captioner.onnx.runtime import OnnxCaptioner
    from captioner.onnx.search import beam_search

    rt = OnnxCaptioner(args.folder, threads=args.threads, spin=args.spin)
    with tempfile.TemporaryDirectory() as tmp:
        generate_split(Path(tmp), "split", args.batch, seed=4242)
        paths = sorted((Path(tmp) / "images" / "split").glob("*.png"))
        pixels = np.stack([rt.preprocess.array(rt.preprocess.load(p)) for p in paths])
    opts = rt.options(beam_size=BEAM, max_len=args.words)
    real_step, calls = rt.step, []

    def timed_step(*inputs):
        began = time.perf_counter()
        out = real_step(*inputs)
        calls.append(time.perf_counter() - began)
        return out

    figures: dict[str, list[float]] = {"encoder": [], "search": [], "step graph": [], "numpy": [], "steps": []}
    shapes = None
    for r in range(args.rounds + 1):  # the first round warms up
        x = rt.preprocess.normalize_array(pixels)
        began = time.perf_counter()
        ann, keys, h0, c0, _ = rt.encode(x)
        encoded = time.perf_counter()
        calls.clear()
        beam_search(timed_step, ann, keys, h0, c0, rt.tokens, opts)
        done = time.perf_counter()
        shapes = ann.shape, keys.shape
        if r == 0:
            continue
        per = 1000 / args.batch
        figures["encoder"].append((encoded - began) * per)
        figures["search"].append((done - encoded) * per)
        figures["step graph"].append(sum(calls) * per)
        figures["numpy"].append((done - encoded - sum(calls)) * per)
        figures["steps"].append(len(calls))
    med = {k: statistics.median(v) for k, v in figures.items()}
    (_, cells, features), (_, _, attention) = shapes
    import onnx

    read = step_bytes(weights_read(onnx.load(str(args.folder / fmt.STEP_ONNX)).graph), args.batch * BEAM, cells,
                      features, attention)
    step_s = med["step graph"] * args.batch / 1000 / med["steps"]
    print(f"{args.folder.name}, batch {args.batch}, beam {BEAM}, {args.threads} threads, median of {args.rounds} "
          "rounds, ms per image:")
    for k in ("encoder", "search", "step graph", "numpy"):
        print(f"  {k:<11} {med[k]:8.1f}")
    print(f"  one step's graph: {1000 * step_s:.2f} ms for {args.batch * BEAM} rows over {med['steps']:.0f} steps")
    total = read["weights"] + read["annotations and keys"]
    print(f"  it reads {total / 1e6:.1f} MB: weights {read['weights'] / 1e6:.1f}, annotations and keys "
          f"{read['annotations and keys'] / 1e6:.1f} (once an image: "
          f"{read['annotations and keys, once an image'] / 1e6:.1f}); {total / step_s / 1e9:.1f} GB/s, against "
          f"{copy_rate():.1f} GB/s read and written by one copy of 256 MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
