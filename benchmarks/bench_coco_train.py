"""Training speed and memory at COCO's sizes, on generated data: what an epoch of COCO costs.

    python -m benchmarks.bench_coco_train [--device cuda] [--batch-size 64] [--steps 20]
                                          [--precisions fp32,bf16] [--config coco-vgg19-soft.toml]

The model of ``train/configs/coco-vgg19-soft.toml`` (VGG-19 at 224 px: 14x14x512 annotations,
hidden 1800, a 10,000-word vocabulary, random weights: speed does not depend on them), on
random images and captions of COCO's lengths (8 to 22 words, mean about 11), one optimiser
step as ``captioner train`` takes it (soft_loss: -log p + the doubly stochastic penalty,
autocast and gradient scaling from train/precision.py, training's optimiser). Two ways:
- "feature cache": the frozen encoder's annotations computed beforehand (the config's way),
  the step is the decoder's;
- "end to end": the encoder's forward in every step as well (what fine-tuning adds to, and
  what a run without the cache pays).
Prints steps/s, images/s, peak GPU memory and the hours per epoch of COCO's Karpathy train
split (113,287 images x 5 captions, each (image, caption) pair one item of an epoch:
566,435 captions), an estimate from these steps alone (no loader, no validation).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import torch

from captioner.model.decoder import CaptionModel
from captioner.model.encoders import Annotations
from captioner.train.config import OptimConfig, load_config, model_config
from captioner.train.loop import build_optimizer
from captioner.train.losses import soft_loss
from captioner.train.precision import MixedPrecision

COCO_CAPTIONS = 113_287 * 5
CONFIGS = Path(__file__).resolve().parent.parent / "train" / "configs"


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def captions(batch: int, vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    words = torch.randint(8, 23, (batch,), generator=gen)  # COCO-like lengths
    lengths = words + 2  # <start> ... <end>
    tokens = torch.zeros(batch, int(lengths.max()), dtype=torch.long)
    for i, n in enumerate(words.tolist()):
        tokens[i, 0] = 1
        tokens[i, 1:n + 1] = torch.randint(4, vocab, (n,), generator=gen)
        tokens[i, n + 1] = 2
    return tokens, lengths


def bench(config: str, dev: torch.device, precision: str, batch: int, steps: int, cached: bool,
          warmup: int = 3) -> dict:
    cfg = load_config(CONFIGS / config, [])
    torch.manual_seed(0)
    # Random weights (speed does not depend on them): no ImageNet download.
    model_cfg = model_config(replace(cfg.model, encoder_pretrained=False), vocab_size=10_000)
    model = CaptionModel(model_cfg).to(dev).train()
    model.encoder.eval()  # frozen, as the config trains it
    mp = MixedPrecision(precision, dev)
    opt = build_optimizer([{"params": list(model.decoder.parameters()), "lr": 2e-4}], OptimConfig())
    gen = torch.Generator().manual_seed(0)
    size = model_cfg.image_size
    images = torch.randn(batch, 3, *size, device=dev)
    with torch.no_grad(), mp.autocast():
        ann = model.encode(images)
    ann = Annotations(ann.vectors.float(), ann.grid)
    batches = [tuple(t.to(dev) for t in captions(batch, 10_000, gen)) for _ in range(4)]

    def step(i: int) -> None:
        tokens, lengths = batches[i % len(batches)]
        with mp.autocast():
            inputs = ann if cached else images
            parts = soft_loss(model, inputs, tokens, lengths, 1.0)
        opt.zero_grad(set_to_none=True)
        mp.backward(parts.loss)
        mp.step(opt, model.parameters(), 5.0)

    for i in range(warmup):
        step(i)
    _sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    start = time.perf_counter()
    for i in range(steps):
        step(i)
    _sync(dev)
    seconds = (time.perf_counter() - start) / steps
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else float("nan")
    return {"steps_s": 1 / seconds, "images_s": batch / seconds, "peak_gib": peak,
            "epoch_h": COCO_CAPTIONS / batch * seconds / 3600}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20, help="timed steps, after the warm-up steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--config", default="coco-vgg19-soft.toml", help="a config in train/configs")
    args = ap.parse_args()
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{name}; torch {torch.__version__}; {args.config}, batch {args.batch_size}, {args.steps} steps")
    for cached in (True, False):
        for precision in args.precisions.split(","):
            r = bench(args.config, dev, precision.strip(), args.batch_size, args.steps, cached, args.warmup)
            way = "feature cache" if cached else "end to end"
            print(f"{way:<14} {precision:<5} {r['steps_s']:7.2f} steps/s {r['images_s']:8.1f} img/s  "
                  f"peak {r['peak_gib']:5.1f} GiB  ~{r['epoch_h']:.2f} h per COCO epoch (estimate)")


if __name__ == "__main__":
    main()
