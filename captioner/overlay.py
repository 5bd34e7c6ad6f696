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


SMOOTH_CELL = 8  # pixels per grid cell at which smoothing is computed (finer only for smaller images)


def upsample_alpha(alpha: torch.Tensor | np.ndarray, size: tuple[int, int], smooth: bool = True) -> np.ndarray:
    """(H, W) map -> (height, width) map over the image, ``size`` = (width, height) as in PIL.
    Also (T, H, W) maps -> (T, height, width), all in one pass.

    Smoothing is a Gaussian blur of sigma = a third of a cell. The blurred map varies on the
    scale of a cell, so it is computed at SMOOTH_CELL pixels per cell and then resized to the
    image: the same map within rounding, at a small fraction of the cost of blurring every pixel
    of a large image (a 81-tap kernel at 560 px)."""
    a = torch.as_tensor(np.asarray(alpha), dtype=torch.float32)
    maps = a.reshape(-1, 1, *a.shape[-2:])  # (T, 1, H, W)
    rows, cols = maps.shape[2:]
    w, h = size
    # align_corners=False throughout: each cell's centre lands on the centre of the pixel
    # block it covers, at the working size as at the image's.
    work = (min(h, rows * SMOOTH_CELL), min(w, cols * SMOOTH_CELL)) if smooth else (h, w)
    up = F.interpolate(maps, size=work, mode="bilinear", align_corners=False)  # (T, 1, h', w')
    if smooth:
        sigma = max(max(h / rows, w / cols) / 3.0, 0.5)  # in image pixels
        up = _gaussian_blur(up, max(sigma * work[0] / h, 0.5), max(sigma * work[1] / w, 0.5))
    if work != (h, w):
        up = F.interpolate(up, size=(h, w), mode="bilinear", align_corners=False)
    return up[:, 0].reshape(*a.shape[:-2], h, w).numpy()


def _gaussian_blur(x: torch.Tensor, sigma_y: float, sigma_x: float | None = None) -> torch.Tensor:
    """Separable blur of (N, 1, h, w), edges replicated."""
    for dim, sigma in ((3, sigma_x if sigma_x is not None else sigma_y), (2, sigma_y)):
        radius = int(3 * sigma)
        t = torch.arange(-radius, radius + 1, dtype=torch.float32)
        k = torch.exp(-(t**2) / (2 * sigma**2))
        k = k / k.sum()
        if dim == 3:
            x = F.conv2d(F.pad(x, (radius, radius, 0, 0), mode="replicate"), k.view(1, 1, 1, -1))
        else:
            x = F.conv2d(F.pad(x, (0, 0, radius, radius), mode="replicate"), k.view(1, 1, -1, 1))
    return x


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
