"""The ONNX runtime against torch: the same captions, scores, attention maps and familiarity.

    python benchmarks/onnx_parity.py [--images 500] [--seed 5858] [--beam-size 3] [--models demo-soft ...]

For each demo model: export it with --onnx into a temporary folder, caption N fresh shapes
images (``captioner shapes --seed SEED``, a seed no demo was trained on) and the photographs
in tests/fixtures/photos with torch (Captioner, the checkpoint) and with onnxruntime
(captioner.onnx, the folder), from the same decoded pixels, and print per model and image
set: the share of identical captions, and over the images captioned alike the largest
difference of score, word probability, attention map, gate and familiarity.
Targets: >= 99% identical captions; scores and maps within 1e-3.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from captioner.data.images import IMAGE_EXTENSIONS
from captioner.data.shapes import generate_dataset
from captioner.inference import Captioner, DecodeOptions
from captioner.io.export import export
from captioner.onnx.runtime import OnnxCaptioner

PHOTOS = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "photos"


def compare(cap: Captioner, rt: OnnxCaptioner, paths: list[Path], beam_size: int, batch: int = 16) -> dict:
    same, n = 0, 0
    worst = dict(score=0.0, word_probs=0.0, alphas=0.0, betas=0.0, familiarity=0.0)
    differ = []
    for i in range(0, len(paths), batch):
        chunk = paths[i:i + batch]
        pixels = np.stack([cap.preprocess.array(cap.preprocess.load(p)) for p in chunk])  # (b, H, W, 3)
        opts = DecodeOptions(beam_size=beam_size, max_len=cap.max_len)
        ours = cap.caption_batch(torch.from_numpy(pixels).permute(0, 3, 1, 2).contiguous(), opts)
        theirs = rt.caption_arrays(pixels, rt.options(beam_size=beam_size, max_len=cap.max_len))
        for p, a, b in zip(chunk, ours, theirs):
            n += 1
            if a.caption != b.text:
                differ.append(f"{p.name}: torch {a.caption!r} ({a.score:.4f}), onnx {b.text!r} ({b.score:.4f})")
                continue
            same += 1
            worst["score"] = max(worst["score"], abs(a.score - b.score))
            worst["word_probs"] = max(worst["word_probs"], float(np.abs(np.array(a.word_probs) - b.word_probs).max(
                initial=0)))
            worst["alphas"] = max(worst["alphas"], float(np.abs(a.alphas.numpy() - b.alphas).max(initial=0)))
            worst["betas"] = max(worst["betas"], float(np.abs(a.betas.numpy() - b.betas).max(initial=0)))
            if a.familiarity is not None:
                worst["familiarity"] = max(worst["familiarity"], abs(a.familiarity.value - b.familiarity))
    return {"images": n, "same": same, "worst": worst, "differ": differ}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=500)
    ap.add_argument("--seed", type=int, default=5858)
    ap.add_argument("--beam-size", type=int, default=3)
    ap.add_argument("--models", nargs="+", default=["demo-soft", "demo-hard", "demo-zh"])
    args = ap.parse_args()
    photos = sorted(p for p in PHOTOS.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        generate_dataset(tmp / "shapes", {"test": args.images}, seed=args.seed, progress=False)
        shapes = sorted((tmp / "shapes" / "images").rglob("*.png"))
        print(f"beam {args.beam_size}; {len(shapes)} shapes images (seed {args.seed}), {len(photos)} photographs")
        print(f"{'model':<10} {'images':<8} {'identical':>10}  {'max |d score|':>13} {'|d p(word)|':>11} "
              f"{'|d alpha|':>10} {'|d beta|':>9} {'|d famil.|':>10}")
        for name in args.models:
            cap = Captioner.load(name)
            export(cap, tmp / name, onnx=True)
            rt = OnnxCaptioner(tmp / name)
            for label, paths in (("shapes", shapes), ("photos", photos)):
                r = compare(cap, rt, paths, args.beam_size)
                w = r["worst"]
                share = r["same"] / r["images"]
                ok &= share >= 0.99 and w["score"] <= 1e-3 and w["alphas"] <= 1e-3
                print(f"{name:<10} {label:<8} {share:>9.1%}  {w['score']:>13.2e} {w['word_probs']:>11.2e} "
                      f"{w['alphas']:>10.2e} {w['betas']:>9.2e} {w['familiarity']:>10.2e}")
                for line in r["differ"]:
                    print(f"    differs: {line}")
    print("targets met" if ok else "TARGETS MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
