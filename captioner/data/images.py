"""Safe image loading and the one preprocessing used everywhere.

Every image becomes an 8-bit RGB PIL image: first frame of animations, EXIF orientation
applied, palette/alpha/CMYK/16-bit modes converted, a pixel-count limit against
decompression bombs.

:class:`Preprocess` is stored in every checkpoint and used by training, ``evaluate``,
``caption`` and the app alike, decoding included (:meth:`Preprocess.load`), so one
checkpoint sees the same pixels for one image whichever way it arrives. Two geometries:
the whole image resized to the input size (``resize = 0``, the default: the attention
grid covers the whole picture), or torchvision's ImageNet recipe (``resize = 256`` for a
224 input: shorter side to 256, centre crop 224), the paper's preprocessing; overlays
are then drawn on :meth:`Preprocess.seen`, the part of the image the model saw.
"""

from __future__ import annotations

import io
import os
import re
import warnings
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

if TYPE_CHECKING:
    import torch  # loaded where a tensor is made: the torch-free runtime (captioner.onnx) reads images here too

# AVIF: Pillow reads it (11.3 on); HEIC/HEIF (iPhone photos): with the optional pillow-heif,
# and without it each such file is named with what to install, never passed over unseen.
IMAGE_EXTENSIONS = frozenset(
    {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm", ".pbm", ".pnm", ".avif",
     ".heic", ".heif"}
)
# ISO base media file brands (bytes 8..12, after "ftyp") of HEIF images and of AVIF ones.
_HEIF_BRANDS = frozenset({b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis", b"hevm", b"hevs", b"mif1", b"msf1"})
_AVIF_BRANDS = frozenset({b"avif", b"avis"})
DEFAULT_MAX_PIXELS = 89_478_485  # Pillow's own default limit (about 9500 x 9500)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class ImageLoadError(ValueError):
    """The file is not an image we can read; the message says why, for the user."""


class ImageTooLargeError(ImageLoadError):
    """The image has more pixels than the limit; callers add how their user raises it."""

    def __init__(self, pixels: int, limit: int, size: tuple[int, int] | None = None):
        self.pixels, self.limit, self.size = pixels, limit, size
        shape = f"{size[0]}x{size[1]} = " if size else ""
        super().__init__(f"image is {shape}{pixels:,} pixels, over the limit of {limit:,} "
                         "(a guard against decompression bombs)")


def _allow_pixels(max_pixels: int) -> None:
    """Pillow's Image.open refuses images over twice its own limit (89,478,485 pixels) before
    ours is asked: lift its limit to ``max_pixels`` when that is higher, so that the limit
    the caller chose decides. Raised only, never lowered, and only to a limit a caller asked for."""
    if Image.MAX_IMAGE_PIXELS is not None and Image.MAX_IMAGE_PIXELS < max_pixels:
        Image.MAX_IMAGE_PIXELS = max_pixels


@dataclass(frozen=True)
class Preprocess:
    """Image -> normalised (3, H, W) tensor for ``size`` = (H, W).

    ``resize = 0``: the whole image resized (bicubic) to ``size``, no crop.
    ``resize = N``: torchvision's ImageNet recipe: the shorter side resized (bilinear) to
    N, then the centre ``size`` cropped (N = 256 for 224 px, as in the paper).
    """

    size: tuple[int, int] = (224, 224)
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    resize: int = 0

    def __call__(self, image: Image.Image) -> torch.Tensor:
        """RGB PIL image -> (3, H, W) float tensor: ``normalize(pixels(image))``."""
        return self.normalize(self.pixels(image))

    def pixels(self, image: Image.Image) -> torch.Tensor:
        """RGB PIL image -> its (3, H, W) 8-bit pixels at the input size, not yet normalised:
        a quarter of the float tensor's bytes, for a worker process to hand over (see
        :meth:`normalize`, which gives exactly the tensor ``__call__`` gives)."""
        import torch

        return torch.from_numpy(self.array(image)).permute(2, 0, 1)

    def array(self, image: Image.Image) -> np.ndarray:
        """RGB PIL image -> its (H, W, 3) 8-bit pixels at the input size (what ``pixels`` holds)."""
        h, w = self.size
        if self.resize:
            image = self._center_crop(image.resize(self._resized(image.size), Image.Resampling.BILINEAR))
        else:
            image = image.resize((w, h), Image.Resampling.BICUBIC)
        return np.asarray(image, dtype=np.uint8).copy()

    def normalize_array(self, pixels: np.ndarray) -> np.ndarray:
        """(..., H, W, 3) 8-bit pixels -> (..., 3, H, W) float32, as ``normalize`` computes it
        (the same float32 operations, so the same numbers), for the torch-free runtime."""
        x = np.moveaxis(pixels, -1, -3).astype(np.float32) / np.float32(255.0)
        mean = np.asarray(self.mean, dtype=np.float32).reshape(3, 1, 1)
        std = np.asarray(self.std, dtype=np.float32).reshape(3, 1, 1)
        return (x - mean) / std

    def normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        """8-bit pixels (..., 3, H, W) -> the float tensor the model takes, on their device:
        x / 255, less the mean, over the standard deviation, each in float32."""
        import torch

        x = pixels.float() / 255.0
        mean = torch.tensor(self.mean, device=x.device).view(3, 1, 1)
        std = torch.tensor(self.std, device=x.device).view(3, 1, 1)
        return (x - mean) / std

    def _resized(self, image_size: tuple[int, int]) -> tuple[int, int]:
        """(width, height) after resizing the shorter side to ``resize`` (torchvision's rounding)."""
        w, h = image_size
        if w <= h:
            return self.resize, int(self.resize * h / w)
        return int(self.resize * w / h), self.resize

    def _crop_origin(self, resized: tuple[int, int]) -> tuple[int, int]:
        """(left, top) of the centre crop in the resized image (torchvision's CenterCrop)."""
        (rw, rh), (h, w) = resized, self.size
        return int(round((rw - w) / 2.0)), int(round((rh - h) / 2.0))

    def _center_crop(self, image: Image.Image) -> Image.Image:
        h, w = self.size
        left, top = self._crop_origin(image.size)
        return image.crop((left, top, left + w, top + h))

    def crop_box(self, image_size: tuple[int, int]) -> tuple[float, float, float, float]:
        """(left, top, right, bottom) of the region the model sees, in the original image's
        pixels (``image_size`` = (width, height)): the attention grid covers exactly this."""
        if not self.resize:
            return (0, 0, image_size[0], image_size[1])
        resized = self._resized(image_size)
        scale = resized[0] / image_size[0] if image_size[0] <= image_size[1] else resized[1] / image_size[1]
        left, top = self._crop_origin(resized)
        h, w = self.size
        return (left / scale, top / scale, (left + w) / scale, (top + h) / scale)

    def seen(self, image: Image.Image) -> Image.Image:
        """The part of ``image`` the model sees (all of it without a crop): overlays go on this."""
        if not self.resize:
            return image
        left, top, right, bottom = self.crop_box(image.size)
        x, y = round(left), round(top)
        return image.crop((x, y, x + round(right - left), y + round(bottom - top)))

    @property
    def decode_side(self) -> int:
        """JPEGs may be decoded at a reduced scale that keeps both sides at least this long."""
        return self.resize or max(self.size)

    def load(self, source: str | os.PathLike | bytes, max_pixels: int | None = None) -> Image.Image:
        """Decode ``source`` as every path of the project does for this preprocessing.

        JPEGs are decoded at the reduced scale that still leaves :attr:`decode_side` pixels
        (several times faster for large photos); training, evaluation, batch captioning and
        the app all decode through here, so they see the same pixels."""
        return load_image(source, max_pixels or DEFAULT_MAX_PIXELS, at_least=self.decode_side)

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict) -> "Preprocess":
        return cls(size=tuple(d["size"]), mean=tuple(d["mean"]), std=tuple(d["std"]), resize=int(d["resize"]))


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
    _allow_pixels(max_pixels)
    try:
        return _decode(fp, name, max_pixels, at_least)
    except UnidentifiedImageError as e:
        brand = _ftyp_brand(source)
        unread = e
    if brand in _HEIF_BRANDS and _heif_opener():  # registered just now: Pillow reads it this time
        if isinstance(fp, io.BytesIO):
            fp.seek(0)
        try:
            return _decode(fp, name, max_pixels, at_least)
        except UnidentifiedImageError as e:
            raise ImageLoadError("a HEIC/HEIF file that pillow-heif cannot read") from e
    if brand in _HEIF_BRANDS:
        raise ImageLoadError("a HEIC/HEIF image: reading it needs the optional pillow-heif "
                             "(pip install 'captioner[heic]')") from unread
    if brand in _AVIF_BRANDS:
        raise ImageLoadError("an AVIF image: this Pillow cannot read AVIF (Pillow 11.3 or later can)") from unread
    raise ImageLoadError("not an image file Pillow can read") from unread


def _ftyp_brand(source: str | os.PathLike | bytes) -> bytes:
    """The major brand of an ISO base media file ("heic", "avif"), else b""."""
    if isinstance(source, bytes):
        head = source[:12]
    else:
        try:
            with open(source, "rb") as f:
                head = f.read(12)
        except OSError:
            return b""
    return head[8:12] if head[4:8] == b"ftyp" else b""


@lru_cache(maxsize=1)
def _heif_opener() -> bool:
    """Register pillow-heif's HEIC/HEIF reader with Pillow once; False when it is not installed."""
    try:
        import pillow_heif
    except ImportError:
        return False
    pillow_heif.register_heif_opener()
    return True


def _decode(fp: io.BytesIO | str | os.PathLike, name: str, max_pixels: int, at_least: int | None) -> Image.Image:
    """``load_image`` once the file is there: Pillow's errors as ImageLoadError, except
    UnidentifiedImageError, which the caller turns into its reason."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our limit is checked below
            with Image.open(fp) as im:  # reads the header only: the size is known before any decoding
                w, h = im.size
                if w * h > max_pixels:
                    raise ImageTooLargeError(w * h, max_pixels, (w, h))
                im.seek(0)  # first frame of animations
                if at_least is not None and im.format == "JPEG":
                    im.draft(None, (at_least, at_least))
                im = ImageOps.exif_transpose(im)
                return to_rgb(im)
    except (ImageLoadError, UnidentifiedImageError):
        raise
    except Image.DecompressionBombError as e:  # over twice Pillow's limit, which is at least ours
        found = re.search(r"\((\d+) pixels\)", str(e))
        raise ImageTooLargeError(int(found.group(1)) if found else 2 * max_pixels + 1, max_pixels) from e
    except PermissionError as e:
        raise ImageLoadError(f"permission denied: {name}") from e
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageLoadError(f"corrupt or truncated image: {e}") from e


def as_image(source, max_pixels: int = DEFAULT_MAX_PIXELS, at_least: int | None = None) -> Image.Image:
    """An 8-bit RGB image from what a user has at hand: a path or raw bytes (decoded by
    ``load_image``, as ``captioner caption`` decodes files), a PIL image of any mode (turned by
    its EXIF orientation, converted as a file would be) or an array (H x W grey, H x W x 3 RGB,
    H x W x 4 RGBA; 8-bit, or floats in [0, 1]). Larger than ``max_pixels``: ImageTooLargeError."""
    if isinstance(source, (str, os.PathLike, bytes)):
        return load_image(source, max_pixels, at_least)
    if isinstance(source, np.ndarray):
        arr = source
        if arr.dtype.kind == "f":
            arr = np.clip(np.nan_to_num(arr) * 255.0 + 0.5, 0, 255).astype(np.uint8)
        if arr.ndim == 3 and arr.shape[2] == 1:
            arr = arr[:, :, 0]
        if arr.ndim not in (2, 3) or arr.ndim == 3 and arr.shape[2] not in (3, 4):
            raise ImageLoadError(f"an image array is H x W, H x W x 3 or H x W x 4, got shape {source.shape}")
        source = Image.fromarray(arr.astype(np.uint8, copy=False))
    if not isinstance(source, Image.Image):
        raise ImageLoadError(f"not an image: {type(source).__name__} (give a path, a PIL image or an array)")
    if source.width * source.height > max_pixels:
        raise ImageTooLargeError(source.width * source.height, max_pixels, source.size)
    return to_rgb(ImageOps.exif_transpose(source))


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

