"""Training throughput with and without the feature cache, for a frozen encoder.

    python benchmarks/bench_feature_cache.py [--encoder resnet50] [--images 320] [--steps 12]

Two runs of the same config on generated shapes images: one encodes every batch with the
frozen backbone, one reads the annotations from the memory-mapped float16 cache (built
once, timed separately). Prints steps/s of each and their ratio.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from captioner.data.shapes import generate_dataset
from captioner.train.config import load_config
from captioner.train.loop import train


def run(data: Path, out: Path, encoder: str, image_size: int, steps: int, cache: bool) -> tuple[float, int]:
    cfg = load_config(None, [
        f"data.dir={data}", "data.min_count=1", "data.workers=2", f"data.feature_cache={cache}",
        f"model.encoder={encoder}", f"model.image_size={image_size}", "model.embed_dim=512",
        "model.hidden_dim=512", "model.attention_dim=512", "optim.batch_size=32", f"optim.max_steps={steps}",
        "optim.log_every=1000", "optim.save_every=0", "val.every_epochs=0", "val.limit=1",
    ])
    start = time.perf_counter()
    outcome = train(cfg, out, progress=False)
    return outcome.train_seconds, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--encoder", default="resnet50")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--images", type=int, default=320)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "shapes"
        generate_dataset(data, {"train": args.images, "val": 4}, seed=3, image_size=128)
        plain, _ = run(data, Path(tmp) / "plain", args.encoder, args.image_size, args.steps, cache=False)
        cached, total = run(data, Path(tmp) / "cached", args.encoder, args.image_size, args.steps, cache=True)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {args.encoder} frozen at "
          f"{args.image_size} px, decoder 512/512/512, batch 32, {args.steps} steps")
    print(f"without cache: {args.steps / plain:.2f} steps/s")
    print(f"with cache:    {args.steps / cached:.2f} steps/s ({plain / cached:.1f}x); building the cache for "
          f"{args.images} images and the rest of that run took {total - cached:.0f} s")


if __name__ == "__main__":
    main()
