"""The half-widths a learned local window chose: captions a folder of images greedily and
records, for every word of the captions, the window's half-width (cells of the annotation grid)
that the centre network predicted. A fixed window (model.local_width = fixed) has one
half-width, model.local_window; a learned one starts there and moves where training takes it.

    python -m studies.attention widths runs/attention-comparison/full-3752steps/local-learned/seed0 \\
        data/shapes-test7001-1000/images/test --images 200

The weights are a checkpoint file or a run folder (its last.pt, with the moving average of the
weights where the run keeps one: the attention comparison's checkpoint rule).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from captioner.data.images import is_image_path
from captioner.inference import Captioner, DecodeOptions
from captioner.model.attention import MIN_HALF_WIDTH, Attention

from .plan import UsageError

QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


@dataclass
class Widths:
    half_widths: torch.Tensor  # (N,) cells, one per word of the captions and per head
    start: float  # model.local_window: where training started every half-width
    grid: tuple[int, int]

    def quantiles(self) -> list[float]:
        return torch.quantile(self.half_widths, torch.tensor(QUANTILES)).tolist()


def learned_windows(cap: Captioner) -> list[Attention]:
    return [m for m in cap.model.modules()
            if isinstance(m, Attention) and m.local_window > 0 and m.width.learned]


def half_widths(cap: Captioner, images: list, batch_size: int = 16) -> Widths:
    """Caption `images` (PIL images) greedily and collect the half-width every window (every
    head) predicted for every word of the captions. Greedy decoding steps a whole batch until
    its longest caption ends, so the steps of a caption after its last word (its <end>, and
    those the batch takes after it) are left out."""
    if not images:
        raise ValueError("no images")
    windows = learned_windows(cap)
    if not windows:
        raise ValueError("this model has no learned local window (model.local_width = learned)")
    calls: list[torch.Tensor] = []  # one (B,) per window per decoding step, step-major
    hooks = [w.centre.register_forward_hook(lambda _m, _i, out: calls.append(out[:, 2].detach()))
             for w in windows]
    kept: list[torch.Tensor] = []
    try:
        for i in range(0, len(images), batch_size):
            calls.clear()
            results = cap.caption_images(images[i:i + batch_size], DecodeOptions(beam_size=1))
            raw = torch.stack(calls).view(-1, len(windows), len(results))  # (steps, windows, B)
            kept += [raw[: r.alphas.shape[0], :, b].flatten() for b, r in enumerate(results)]
    finally:
        for h in hooks:
            h.remove()
    raw = torch.cat(kept) if kept else torch.empty(0)
    return Widths(MIN_HALF_WIDTH + F.softplus(raw), float(windows[0].local_window),
                  tuple(results[0].alphas.shape[-2:]))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("widths", help="the half-widths a learned local window predicts, word by word",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("weights", type=Path, help="a checkpoint file, or a run folder (its last.pt)")
    p.add_argument("images", type=Path, help="a folder of images")
    p.add_argument("--images", dest="n_images", type=int, default=200, help="how many (sorted by name)")
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=cmd_widths)


def cmd_widths(args: argparse.Namespace) -> int:
    """Exit status 2 for a model without a learned window, said in one line."""
    from PIL import Image

    from .checkpoints import load_weights

    torch.set_num_threads(args.threads)
    if not args.images.is_dir():
        raise UsageError(f"not a folder: {args.images}")
    paths = sorted(p for p in args.images.iterdir() if is_image_path(p))[: args.n_images]
    if not paths:
        raise UsageError(f"no images in {args.images}")
    try:
        w = half_widths(load_weights(args.weights), [Image.open(p).convert("RGB") for p in paths])
    except ValueError as e:
        print(f"{args.weights}: {e}", file=sys.stderr)
        return 2
    q = ", ".join(f"{int(p * 100)}%: {v:.2f}" for p, v in zip(QUANTILES, w.quantiles()))
    print(f"{len(paths)} images, {w.half_widths.numel()} words (every head); starting half-width "
          f"{w.start:g} cells on a {w.grid[0]}x{w.grid[1]} grid")
    print(f"learned half-width, cells: mean {w.half_widths.mean():.2f}; quantiles {q}")
    return 0
