"""Captioning speed on the CPU: onnxruntime (captioner.onnx) against torch eager, side by side.

    python benchmarks/bench_onnx.py [--model demo-soft] [--folder EXPORTED] [--repeats 5] [--beam-size 3]

From the same decoded 8-bit pixels (16 fresh shapes images, so decoding is left out of both),
the whole caption of each: encoder, beam search (k = 3) and familiarity. Per-image latency at
batch 1 (the median over the images and repeats) and images/s at batch 16 (the median batch
time), for torch eager (Captioner.caption_batch) and for the exported graphs in onnxruntime
(OnnxCaptioner.caption_arrays), the two taking turns so that both meet the same load; both
run on as many threads as torch uses. Prints both and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from captioner.data.shapes import generate_dataset
from captioner.inference import Captioner, DecodeOptions
from captioner.io.export import export
from captioner.onnx.runtime import OnnxCaptioner


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo-soft", help="checkpoint or demo name (default demo-soft)")
    ap.add_argument("--folder", type=Path, default=None, help="its export with --onnx (default: exported now)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--beam-size", type=int, default=3)
    args = ap.parse_args()
    threads = torch.get_num_threads()
    cap = Captioner.load(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        folder = args.folder or export(cap, tmp / "model", onnx=True).folder
        rt = OnnxCaptioner(folder, threads=threads)
        generate_dataset(tmp / "shapes", {"test": 16}, seed=5959, progress=False)
        paths = sorted((tmp / "shapes" / "images").rglob("*.png"))
        pixels = np.stack([cap.preprocess.array(cap.preprocess.load(p)) for p in paths])  # (16, H, W, 3)
    tensors = torch.from_numpy(pixels).permute(0, 3, 1, 2).contiguous()
    opts = DecodeOptions(beam_size=args.beam_size, max_len=cap.max_len)
    runs = {
        "torch eager": lambda i, j: cap.caption_batch(tensors[i:j], opts),
        "onnxruntime": lambda i, j: rt.caption_arrays(pixels[i:j], rt.options(beam_size=args.beam_size,
                                                                                 max_len=cap.max_len)),
    }
    for run in runs.values():  # warm-up: first calls allocate
        run(0, 1)
        run(0, 16)
    one = {k: [] for k in runs}
    batch = {k: [] for k in runs}
    for _ in range(args.repeats):
        for i in range(16):
            for name, run in runs.items():
                one[name].append(timed(lambda: run(i, i + 1)))
        for name, run in runs.items():
            batch[name].append(timed(lambda: run(0, 16)))
    latency = {k: statistics.median(v) * 1000 for k, v in one.items()}
    speed = {k: 16 / statistics.median(v) for k, v in batch.items()}
    print(f"{args.model}, beam {args.beam_size}, {threads} threads, torch {torch.__version__}, "
          f"{args.repeats} repeats")
    print(f"{'':<14}{'batch 1 ms/image':>18}{'batch 16 images/s':>20}")
    for name in runs:
        print(f"{name:<14}{latency[name]:>18.1f}{speed[name]:>20.1f}")
    print(f"{'ratio':<14}{latency['torch eager'] / latency['onnxruntime']:>17.2f}x"
          f"{speed['onnxruntime'] / speed['torch eager']:>19.2f}x   (onnxruntime's speed-up over torch)")


if __name__ == "__main__":
    main()
