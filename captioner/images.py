"""Safe image loading and the one preprocessing used at inference.

Every image becomes an 8-bit RGB PIL image: first frame of animations, EXIF orientation
applied, palette/alpha/CMYK/16-bit modes converted, a pixel-count limit against
decompression bombs. At inference the whole image is resized (never cropped), so the
attention grid covers the whole original image and overlays line up with it.
"""

from __future__ import annotations

import io
import os
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

IMAGE_EXTENSIONS = frozenset(
    {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm", ".pbm", ".pnm"}
)
DEFAULT_MAX_PIXELS = 89_478_485  # Pillow's own default limit (about 9500 x 9500)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class ImageLoadError(ValueError):
    """The file is not an image we can read; the message says why, for the user."""


@dataclass(frozen=True)
class Preprocess:
    """Resize (whole image, no crop) to ``size`` = (height, width), then normalise."""

    size: tuple[int, int] = (224, 224)
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD

    def __call__(self, image: Image.Image) -> torch.Tensor:
        """RGB PIL image -> (3, H, W) float tensor."""
        h, w = self.size
        resized = image.resize((w, h), Image.Resampling.BICUBIC)
        x = torch.from_numpy(np.asarray(resized, dtype=np.float32).copy()).permute(2, 0, 1) / 255.0
        mean = torch.tensor(self.mean).view(3, 1, 1)
        std = torch.tensor(self.std).view(3, 1, 1)
        return (x - mean) / std

    def to_dict(self) -> dict:
        return {k: list(v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict) -> "Preprocess":
        return cls(size=tuple(d["size"]), mean=tuple(d["mean"]), std=tuple(d["std"]))


def is_image_path(path: str | os.PathLike) -> bool:
    return Path(path).suffix.lower() in IMAGE_EXTENSIONS


def load_image(source: str | os.PathLike | bytes, max_pixels: int = DEFAULT_MAX_PIXELS,
               at_least: int | None = None) -> Image.Image:
    """Read a file path or raw bytes into an 8-bit RGB image, or raise ImageLoadError.

    ``at_least``: the caller will shrink the image to about this many pixels a side, so a
    JPEG may be decoded at a reduced scale (1/2, 1/4, 1/8) that keeps both sides at least
    this long: several times faster for photos, and the same picture after the resize."""
    name = "upload" if isinstance(source, bytes) else str(source)
    if isinstance(source, bytes):
        if not source:
            raise ImageLoadError("empty file (0 bytes)")
        fp: io.BytesIO | str | os.PathLike = io.BytesIO(source)
    else:
        try:
            size = os.path.getsize(source)
        except OSError as e:
            raise ImageLoadError(f"cannot read {name}: {e.strerror or e}") from e
        if size == 0:
            raise ImageLoadError("empty file (0 bytes)")
        fp = source
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(fp) as im:
                w, h = im.size
                if w * h > max_pixels:
                    raise ImageLoadError(
                        f"image is {w}x{h} = {w * h:,} pixels, over the limit of {max_pixels:,} "
                        "(possible decompression bomb)")
                im.seek(0)  # first frame of animations
                if at_least is not None and im.format == "JPEG":
                    im.draft(None, (at_least, at_least))
                im = ImageOps.exif_transpose(im)
                return to_rgb(im)
    except ImageLoadError:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        if isinstance(e, UnidentifiedImageError):
            raise ImageLoadError("not an image file Pillow can read") from e
        raise ImageLoadError(f"image over the pixel limit (possible decompression bomb): {e}") from e
    except PermissionError as e:
        raise ImageLoadError(f"permission denied: {name}") from e
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageLoadError(f"corrupt or truncated image: {e}") from e


def to_rgb(im: Image.Image) -> Image.Image:
    """Any Pillow mode -> 8-bit RGB; transparency is composited over white."""
    if im.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        arr = np.asarray(im, dtype=np.float64)
        hi = 65535.0 if im.mode.startswith("I;16") else max(float(arr.max()), 1.0)
        if im.mode in ("I", "F") and arr.max() <= 255:
            hi = 255.0
        arr = np.clip(arr / hi * 255.0, 0, 255).astype(np.uint8)
        return Image.fromarray(arr, mode="L").convert("RGB")
    if im.mode == "P" and "transparency" in im.info:
        im = im.convert("RGBA")
    if im.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = im.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if im.mode != "RGB":
        return im.convert("RGB")
    im.load()
    return im.copy()

