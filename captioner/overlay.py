"""Attention overlays aligned with the image (no plotting library, works headless).

Overlays are drawn on the image the model saw: the whole image when its preprocessing
resizes without cropping, else the centre crop (``Preprocess.seen``). Cell (r, c) of an
H x W map then covers exactly rows r/H..(r+1)/H and columns c/W..(c+1)/W of that image.
Maps are upsampled to the image's own size with that geometry, then smoothed.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont

from .decoding import CaptionResult


def upsample_alpha(alpha: torch.Tensor | np.ndarray, size: tuple[int, int], smooth: bool = True) -> np.ndarray:
    """(H, W) map -> (height, width) map over the image, ``size`` = (width, height) as in PIL.
    Also (T, H, W) maps -> (T, height, width), all in one pass."""
    a = torch.as_tensor(np.asarray(alpha), dtype=torch.float32)
    maps = a.reshape(-1, 1, *a.shape[-2:])  # (T, 1, H, W)
    w, h = size
    # align_corners=False: each cell's centre lands on the centre of the pixel block it covers.
    up = F.interpolate(maps, size=(h, w), mode="bilinear", align_corners=False)
    if smooth:
        cell = max(h / maps.shape[2], w / maps.shape[3])
        sigma = max(cell / 3.0, 0.5)
        up = _gaussian_blur(up, sigma)
    return up[:, 0].reshape(*a.shape[:-2], h, w).numpy()


def _gaussian_blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    radius = int(3 * sigma)
    t = torch.arange(-radius, radius + 1, dtype=torch.float32)
    k = torch.exp(-(t**2) / (2 * sigma**2))
    k = k / k.sum()
    x = F.pad(x, (radius, radius, 0, 0), mode="replicate")
    x = F.conv2d(x, k.view(1, 1, 1, -1))
    x = F.pad(x, (0, 0, radius, radius), mode="replicate")
    return F.conv2d(x, k.view(1, 1, -1, 1))


def overlay(image: Image.Image, alpha: torch.Tensor | np.ndarray, smooth: bool = True) -> Image.Image:
    """The image lit where the model looked (as in the paper's figures), tinted warm at the peak."""
    return overlays(image, torch.as_tensor(np.asarray(alpha))[None], smooth)[0]


def overlays(image: Image.Image, alphas: torch.Tensor | np.ndarray, smooth: bool = True) -> list[Image.Image]:
    """One overlay per map of ``alphas`` (T, H, W), upsampled and smoothed together: what a
    page showing every word draws, at the cost of one pass instead of T."""
    rgb = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0  # (h, w, 3)
    m = upsample_alpha(alphas, image.size, smooth)  # (T, h, w)
    lo = m.min(axis=(1, 2), keepdims=True)
    m = (m - lo) / np.maximum(m.max(axis=(1, 2), keepdims=True) - lo, 1e-8)  # each map in [0, 1]
    tint = np.array([1.0, 0.55, 0.1], dtype=np.float32)
    out = []
    for mt in m[..., None]:  # (h, w, 1)
        lit = rgb * (0.2 + 0.8 * mt)
        shown = lit * (1 - 0.35 * mt) + tint * 0.35 * mt
        out.append(Image.fromarray(np.clip(shown * 255.0 + 0.5, 0, 255).astype(np.uint8)))
    return out


def attention_figure(image: Image.Image, result: CaptionResult, panel: int = 224, columns: int = 5,
                     smooth: bool = True) -> Image.Image:
    """The image, then one overlay panel per word with the word and its beta below."""
    scale = panel / max(image.size)
    pw, ph = max(1, round(image.width * scale)), max(1, round(image.height * scale))
    shown = image.convert("RGB").resize((pw, ph), Image.Resampling.BICUBIC)
    panels = [(shown, "(image)")]
    lit = overlays(shown, result.alphas, smooth) if result.words else []
    for t, word in enumerate(result.words):
        panels.append((lit[t], f"{word}  beta {float(result.betas[t]):.2f}"))
    font = _font(max(12, panel // 14))
    label_h = font.size + 8 if hasattr(font, "size") else 20
    cols = min(columns, len(panels))
    rows = -(-len(panels) // cols)
    pad = 6
    fig = Image.new("RGB", (cols * (pw + pad) + pad, rows * (ph + label_h + pad) + pad), "white")
    draw = ImageDraw.Draw(fig)
    for i, (img, label) in enumerate(panels):
        x = pad + (i % cols) * (pw + pad)
        y = pad + (i // cols) * (ph + label_h + pad)
        fig.paste(img, (x, y))
        draw.text((x + 2, y + ph + 3), label, fill="black", font=font)
    return fig


def _font(size: int):
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow without scalable default font
        return ImageFont.load_default()
