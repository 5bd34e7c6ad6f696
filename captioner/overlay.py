"""Attention overlays aligned with the image (no plotting library, works headless).

Overlays are drawn on the image the model saw: the whole image when its preprocessing
resizes without cropping, else the centre crop (``Preprocess.seen``). Cell (r, c) of an
H x W map then covers exactly rows r/H..(r+1)/H and columns c/W..(c+1)/W of that image.
Maps are upsampled to the image's own size with that geometry, then smoothed.

Labels use Pillow's own font, which has no Chinese or Japanese glyphs: a caption in those
scripts is drawn with a font of the system that has them (:func:`cjk_font_file`; Debian's
fonts-wqy-microhei or fonts-noto-cjk), never one fetched from elsewhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageChops, ImageDraw, ImageFont
from PIL.PngImagePlugin import PngInfo

from captioner.data.vocab import has_cjk
from captioner.search.decoding import CaptionResult

TINT = (255, 140, 26)  # warm orange at the peak of a map


def upsample_alpha(alpha: torch.Tensor | np.ndarray, size: tuple[int, int], smooth: bool = True) -> np.ndarray:
    """(H, W) map -> (height, width) map over the image, ``size`` = (width, height) as in PIL.
    Also (T, H, W) maps -> (T, height, width), all in one pass.

    Bilinear upsampling, then (smooth) a Gaussian blur of sigma = a third of a cell, edges
    replicated. Both are separable and linear, so each axis is one matrix, (height, H) and
    (width, W), made once per size: a map costs two small products, not a blur of every pixel."""
    a = torch.as_tensor(np.asarray(alpha), dtype=torch.float32)
    return _upsample(a.reshape(-1, *a.shape[-2:]), size, smooth).reshape(*a.shape[:-2], size[1], size[0]).numpy()


def _upsample(maps: torch.Tensor, size: tuple[int, int], smooth: bool) -> torch.Tensor:
    """(T, H, W) -> (T, height, width), see upsample_alpha."""
    rows, cols = maps.shape[1:]
    w, h = size
    sigma = max(max(h / rows, w / cols) / 3.0, 0.5) if smooth else 0.0  # in image pixels, as on both axes
    ry, rx = _axis_operator(rows, h, sigma), _axis_operator(cols, w, sigma)  # (h, H), (w, W)
    return torch.einsum("yi,tij,xj->tyx", ry, maps, rx)


@lru_cache(maxsize=64)
def _axis_operator(cells: int, pixels: int, sigma: float) -> torch.Tensor:
    """(pixels, cells): bilinear upsampling along one axis (align_corners=False: each cell's centre
    lands on the centre of the pixel block it covers), then the blur, as one matrix."""
    eye = torch.eye(cells).view(cells, 1, 1, cells)  # one unit map per cell
    up = F.interpolate(eye, size=(1, pixels), mode="bilinear", align_corners=False)  # (cells, 1, 1, pixels)
    if sigma > 0:
        up = _gaussian_blur(up, 0.0, sigma)
    return up[:, 0, 0].T.contiguous()


def _gaussian_blur(x: torch.Tensor, sigma_y: float, sigma_x: float | None = None) -> torch.Tensor:
    """Separable blur of (N, 1, h, w), edges replicated; a sigma of 0 leaves that axis alone."""
    for dim, sigma in ((3, sigma_y if sigma_x is None else sigma_x), (2, sigma_y)):
        if sigma <= 0:
            continue
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
    a = torch.as_tensor(np.asarray(alphas), dtype=torch.float32)
    return shaded(image, unit_maps(_upsample(a.reshape(-1, *a.shape[-2:]), image.size, smooth)))


def shading(m: float | np.ndarray | torch.Tensor) -> tuple:
    """The overlay's two weights at m, a map's value scaled to [0, 1] (a float, an array or a
    tensor): pixel = rgb * lit(m) + TINT * warm(m), lit(m) = (0.2 + 0.8 m)(1 - 0.35 m) and
    warm(m) = 0.35 m. The image is lit where the model looked (0.2 of its light where it did not
    look at all) and tinted warm at the peak. The one formula of every overlay: the figures',
    and the app's layers, laid over the photo by the browser."""
    return (0.2 + 0.8 * m) * (1 - 0.35 * m), 0.35 * m


def unit_maps(maps: torch.Tensor) -> torch.Tensor:
    """(T, h, w) maps, each scaled to [0, 1] (its lowest value 0, its highest 1), as ``shading`` takes them."""
    lo = maps.amin(dim=(1, 2), keepdim=True)
    return (maps - lo) / (maps.amax(dim=(1, 2), keepdim=True) - lo).clamp_min(1e-8)


def shaded(image: Image.Image, m: torch.Tensor) -> list[Image.Image]:
    """One overlay per map of ``m`` (T, h, w), scaled to [0, 1] and of the image's size (h, w):
    ``shading``'s two weights as 8-bit masks, then Pillow's 8-bit multiply and add (a fraction of
    the cost of float maths on every channel)."""
    base = image.convert("RGB")
    lit, warm = shading(m)  # (T, h, w) each
    lit = lit.mul_(255.0).add_(0.5).to(torch.uint8).numpy()
    warm = warm.mul_(255.0).add_(0.5).to(torch.uint8).numpy()
    tint = Image.new("RGB", base.size, TINT)
    return [ImageChops.add(ImageChops.multiply(base, Image.fromarray(lt, "L").convert("RGB")),
                           ImageChops.multiply(tint, Image.fromarray(wt, "L").convert("RGB")))
            for lt, wt in zip(lit, warm)]


def attention_figure(image: Image.Image, result: CaptionResult, panel: int = 224, columns: int = 5,
                     smooth: bool = True, heads: bool = False, model: str | None = None,
                     notice: str | None = None) -> Image.Image:
    """The image, then one overlay panel per word with the word and its beta below.
    ``heads``: a row per word instead, its map (the heads' mean) then each head's map.
    ``model``: a title above the panels, the caption and this model's name, so that a figure
    found later in a folder says what it shows; ``notice``: lines under it (a demo model's,
    that it knows synthetic shapes only), whole, wrapped to the figure's width, for a figure shown
    without the command's output; and when the image is unfamiliar to the model, a line that
    says so, as the JSON's ``unfamiliar`` and the app do."""
    scale = panel / max(image.size)
    pw, ph = max(1, round(image.width * scale)), max(1, round(image.height * scale))
    shown = image.convert("RGB").resize((pw, ph), Image.Resampling.BICUBIC)
    panels: list[tuple[Image.Image, str] | None] = [(shown, "(image)")]
    lit = overlays(shown, result.alphas, smooth) if result.words else []
    if heads:
        maps = result.alphas_heads  # (T, h, H, W)
        nh = maps.shape[1]
        per_head = overlays(shown, maps.reshape(-1, *maps.shape[2:]), smooth) if result.words else []  # T*h
        cols = 1 + nh
        panels += [None] * (cols - 1)  # the image alone on the first row
        for t, word in enumerate(result.words):
            panels.append((lit[t], f"{word}  beta {float(result.betas[t]):.2f}"))
            panels += [(per_head[t * nh + j], f"{word}  head {j + 1}") for j in range(nh)]
    else:
        for t, word in enumerate(result.words):
            panels.append((lit[t], f"{word}  beta {float(result.betas[t]):.2f}"))
        cols = min(columns, len(panels))
    font = _font(max(12, panel // 14), cjk=has_cjk(result.caption + "".join(result.words)))
    label_h = font.size + 8 if hasattr(font, "size") else 20
    rows = -(-len(panels) // cols)
    pad = 6
    width = cols * (pw + pad) + pad
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    warnings = [*_wrapped(measure, unfamiliar_line(result), font, width - 2 * pad - 2),
                *_wrapped(measure, notice, font, width - 2 * pad - 2)]
    title_h = (label_h + pad if model is not None else 0) + label_h * len(warnings)
    fig = Image.new("RGB", (width, title_h + rows * (ph + label_h + pad) + pad), "white")
    draw = ImageDraw.Draw(fig)
    if model is not None:
        title = _fitted(draw, f"{result.caption or '(no words)'}  (model: {model})", font, fig.width - 2 * pad - 2)
        draw.text((pad + 2, pad + 2), title, fill="black", font=font)
    for i, line in enumerate(warnings):
        y = pad + 2 + (label_h if model is not None else 0) + i * label_h
        draw.text((pad + 2, y), line, fill=(150, 30, 30), font=font)
    for i, cell in enumerate(panels):
        if cell is None:
            continue
        img, label = cell
        x = pad + (i % cols) * (pw + pad)
        y = title_h + pad + (i // cols) * (ph + label_h + pad)
        fig.paste(img, (x, y))
        draw.text((x + 2, y + ph + 3), label, fill="black", font=font)
    return fig


def figure_info(result: CaptionResult, model: str, notice: str | None = None) -> PngInfo:
    """PNG text chunks for a saved figure: its caption, model and notice, readable without looking."""
    info = PngInfo()
    info.add_text("Title", result.caption)
    info.add_text("Model", model)
    if notice:
        info.add_text("Warning", notice)
    flag = unfamiliar_line(result)
    if flag:
        info.add_text("Unfamiliar", flag)
    return info


def unfamiliar_line(result: CaptionResult) -> str | None:
    """The figure's flag for an image unlike the model's training images; None otherwise."""
    fam = result.familiarity
    if fam is None or not fam.unfamiliar:
        return None
    return (f"unfamiliar: unlike the model's training pictures (familiarity {fam.value:.3f}, below "
            f"{fam.threshold:g}); the caption says more about them than about this picture")


def _wrapped(draw: ImageDraw.ImageDraw, text: str | None, font, width: float) -> list[str]:
    """``text`` (none: no lines) in lines of at most ``width`` pixels, broken between words (between
    characters in text without spaces, Chinese say); a word wider than a line is cut short."""
    if not text:
        return []
    tokens = text.split(" ") if " " in text.strip() else list(text)
    glue = " " if " " in text.strip() else ""
    lines: list[str] = []
    for token in tokens:
        joined = f"{lines[-1]}{glue}{token}" if lines else token
        if lines and draw.textlength(joined, font=font) <= width:
            lines[-1] = joined
        else:
            lines.append(_fitted(draw, token, font, width))
    return lines


def _fitted(draw: ImageDraw.ImageDraw, text: str, font, width: float) -> str:
    """``text``, cut short with an ellipsis where it would run past ``width`` pixels."""
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "…", font=font) > width:
        text = text[:-1]
    return text + "…"


# Where Debian's packages put fonts with CJK glyphs, most compact first; fontconfig is asked
# when none of them is there.
CJK_FONT_FILES = (
    "/usr/share/fonts/truetype/wqy/wqy-microhei.ttc",  # fonts-wqy-microhei (5 MB)
    "/usr/share/fonts/truetype/wqy/wqy-zenhei.ttc",  # fonts-wqy-zenhei
    "/usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc",  # fonts-noto-cjk
    "/usr/share/fonts/truetype/droid/DroidSansFallbackFull.ttf",  # fonts-droid-fallback
)


@lru_cache(maxsize=1)
def cjk_font_file() -> str | None:
    """A font file with Chinese and Japanese glyphs: $CAPTIONER_CJK_FONT, one of
    :data:`CJK_FONT_FILES`, or what fontconfig lists for Chinese; None when there is none."""
    chosen = os.environ.get("CAPTIONER_CJK_FONT")
    if chosen and os.path.isfile(chosen):
        return chosen
    for path in CJK_FONT_FILES:
        if os.path.isfile(path):
            return path
    if shutil.which("fc-list"):
        try:
            listed = subprocess.run(["fc-list", ":lang=zh", "file"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        files = sorted(line.split(":")[0].strip() for line in listed.splitlines() if line.strip())
        return files[0] if files else None
    return None


def _font(size: int, cjk: bool = False):
    """Pillow's own font; for text with CJK characters a system font that has their glyphs
    (Pillow's would draw each as the same empty box), when there is one."""
    path = cjk_font_file() if cjk else None
    if path is not None:
        return ImageFont.truetype(path, size)
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow without scalable default font
        return ImageFont.load_default()
