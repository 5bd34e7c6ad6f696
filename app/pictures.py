"""The pictures the page shows: the upload's preview, the part the model saw, and one map
layer per word.

Every picture is drawn once, at the size the page shows it, and kept as encoded bytes, so
that reruns (picking a word, reopening the page) encode nothing.

A word's map is not drawn into a copy of the photo: it is a small RGBA layer that the browser
lays over the one photo. Laid over an image with ordinary alpha blending,

    out = photo * (1 - a) + C * a,   a = 1 - lit(m),   C = TINT * warm(m) / a,

a function of m alone: a layer is a map of 8-bit levels of m and a palette of 256 (C, a),

it gives the overlay of ``captioner.overlay.overlays``: photo * lit(m) + TINT * warm(m), with
lit and warm the library's ``captioner.overlay.shading``, m the map scaled to [0, 1].

Layers are keyed by (word, head); head None is the map a word's step used (the heads' mean
when a model has several heads).
"""

from __future__ import annotations

import base64
import io
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from captioner.data.images import Preprocess, load_image
from captioner.overlay import TINT, shading, unit_maps, upsample_alpha
from captioner.search.decoding import CaptionResult

LARGE_WIDTH = 560  # the picked word's view and the upload's preview
JPEG_QUALITY = 90
AS_IS_SIDE = 800  # an upright RGB JPEG at most this long a side is shown as uploaded
EXIF_ORIENTATION = 0x0112
LAYER_CELL = 4  # layer pixels per map cell (maps blurred already): the browser's smooth upscaling does the rest
Key = tuple[int, "int | None"]  # (word index, head; None: the map the step used)


def data_uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def jpeg(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "JPEG", quality=JPEG_QUALITY)
    return buf.getvalue()


def fit_width(image: Image.Image, width: int) -> Image.Image:
    """A copy at most ``width`` wide, same aspect. Overlays stay aligned: the whole image is kept."""
    if image.width <= width:
        return image.copy()
    height = max(1, round(image.height * width / image.width))
    return image.resize((width, height), Image.Resampling.BICUBIC, reducing_gap=2.0)


@dataclass
class Picture:
    """An upload as the page shows it before any caption: its digest, size and preview."""

    digest: str
    width: int
    height: int
    preview: bytes  # JPEG, at most AS_IS_SIDE a side: the upload itself, or a copy at most LARGE_WIDTH wide
    as_is: bool = False  # the preview is the uploaded file itself

    @property
    def preview_uri(self) -> str:
        return data_uri(self.preview, "image/jpeg")

    @classmethod
    def decode(cls, digest: str, data: bytes, preprocess: Preprocess,
               max_pixels: int) -> tuple["Picture", Decoded]:
        """Raw bytes -> (picture, the upload decoded for the model and for the page's views); raises
        ImageLoadError with a message for the user, also for an image of more than ``max_pixels``.

        The upload is decoded as ``captioner caption`` decodes it for this model (``Preprocess.load``:
        a big JPEG at the reduced scale the model needs), and the model captions that image. A photo
        from a phone or a camera resized for the web (an RGB JPEG, upright, at most AS_IS_SIDE a
        side) is shown as it came: the browser scales it, and the server neither resizes nor encodes
        it. The preview and the views of the maps are drawn from the model's image, unless the
        model's reduced scale leaves it narrower than the page's views (LARGE_WIDTH) where the file
        is wider: then, and only then, the page decodes its own copy at the scale its views need."""
        image = preprocess.load(data, max_pixels)
        (width, height), as_is = _header(data)
        drawn = not as_is or preprocess.resize  # the views draw on an image, not on the upload shown whole
        reduced = max(width, height) > max(image.size)  # the model's decode is smaller than the file
        view = image if not drawn or image.width >= LARGE_WIDTH or not reduced else \
            load_image(data, max_pixels, at_least=LARGE_WIDTH)
        if as_is:
            return cls(digest, width, height, data, as_is=True), Decoded(image, view, None)
        preview = fit_width(view, LARGE_WIDTH)
        return cls(digest, view.width, view.height, jpeg(preview)), Decoded(image, view, preview)


@dataclass(frozen=True)
class Decoded:
    """An upload decoded: ``image`` as the model decodes it, ``view`` the image the page's views are
    drawn from (``image`` itself, or a copy at a larger scale), ``preview`` the preview drawn from
    it (None: the upload itself is the preview)."""

    image: Image.Image
    view: Image.Image
    preview: Image.Image | None


def _header(data: bytes) -> tuple[tuple[int, int], bool]:
    """An upload that decoded, read from its header alone: its size as stored, and whether the page
    shows it as it came (an RGB JPEG, upright, at most AS_IS_SIDE a side)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # load_image has checked the size
        with Image.open(io.BytesIO(data)) as im:
            as_is = (im.format == "JPEG" and im.mode == "RGB" and max(im.size) <= AS_IS_SIDE
                     and im.getexif().get(EXIF_ORIENTATION, 1) == 1)
            return im.size, as_is


def seen_by_model(preprocess: Preprocess, image: Image.Image, picture: Picture | None = None,
                  preview: Image.Image | None = None) -> tuple[bytes, tuple[int, int]]:
    """The part of the upload the model saw (all of it without a crop), as JPEG bytes at most
    LARGE_WIDTH wide, and its (width, height): the picture a result's maps are laid over.
    ``image``: the upload as the page's views draw it (``Decoded.view``); ``picture``, ``preview``:
    as Picture.decode gave them, when there are; the picture's own preview bytes come back when
    they show just that part."""
    if picture is not None and picture.as_is and not preprocess.resize:
        return picture.preview, (picture.width, picture.height)  # the upload itself
    cropped = preprocess.seen(image)
    if cropped is image and preview is not None and picture is not None:
        return picture.preview, preview.size  # encoded already
    seen = fit_width(cropped, LARGE_WIDTH)
    return jpeg(seen), seen.size


def _palette() -> bytes:
    """256 RGBA entries, level i for m = i / 255: a layer is a map of 8-bit levels, a palette PNG."""
    lit, warm = shading(np.arange(256) / 255.0)
    a = 1 - lit  # in [0.48, 0.8]: never 0
    colour = (warm / a)[:, None] * np.array(TINT)
    return np.concatenate([colour, 255.0 * a[:, None]], 1).round().clip(0, 255).astype(np.uint8).tobytes()


PALETTE = _palette()


def layer_size(grid: tuple[int, int], size: tuple[int, int]) -> tuple[int, int]:
    """(width, height) of the layers for an image of ``size`` (width, height): the image's aspect,
    about LAYER_CELL pixels per cell, never larger than the image."""
    rows, cols = grid
    w, h = size
    scale = min(1.0, max(LAYER_CELL * cols / w, LAYER_CELL * rows / h))
    return max(1, round(w * scale)), max(1, round(h * scale))


def attention_layers(alphas: torch.Tensor, size: tuple[int, int]) -> np.ndarray:
    """(T, H, W) maps -> (T, h, w) uint8 levels of m, the image's aspect, all in one pass.
    The layer's colours and opacities are PALETTE's entries for those levels."""
    lw, lh = layer_size(tuple(alphas.shape[-2:]), size)
    m = unit_maps(torch.from_numpy(upsample_alpha(alphas, (lw, lh))))  # (T, lh, lw), blurred as the overlays are
    return m.mul_(255.0).add_(0.5).clamp_(0, 255).to(torch.uint8).numpy()


def png(levels: np.ndarray) -> bytes:
    """(h, w) levels -> a palette PNG with PALETTE's colours and opacities (a few KB)."""
    image = Image.fromarray(levels, "P")
    image.putpalette(PALETTE, "RGBA")
    buf = io.BytesIO()
    image.save(buf, "PNG", compress_level=3)
    return buf.getvalue()


def heads_of(result: CaptionResult) -> int:
    """The number of attention heads whose maps a result carries (1: only the map each step used)."""
    return result.alphas_heads.shape[1]


def map_layers(result: CaptionResult, size: tuple[int, int]) -> dict[Key, str]:
    """Every layer of a result, for a photo of ``size``, as data URIs: (t, None) the map word t's
    step used, and with several heads (t, j) each head j's own map too."""
    layers = {(t, None): data_uri(png(layer), "image/png")
              for t, layer in enumerate(attention_layers(result.alphas, size))}
    heads = heads_of(result)
    for j in range(heads if heads > 1 else 0):
        layers.update({(t, j): data_uri(png(layer), "image/png")
                       for t, layer in enumerate(attention_layers(result.alphas_heads[:, j], size))})
    return layers
