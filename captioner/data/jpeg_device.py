"""JPEG decoding on the model's device, a switch of batch captioning (``--decode-on-device``),
kept apart from the one CPU preprocessing (:class:`captioner.data.images.Preprocess`).

On a GPU, worker processes decoding and resizing photos can fall behind the encoder. With
this switch the workers only read each JPEG's header (the pixel limit, its colour mode, its
EXIF orientation) and its bytes; the model's device decodes the batch at once
(``torchvision.io.decode_jpeg``, nvJPEG on a GPU) and resizes each image with the same
geometry as ``Preprocess`` (whole image bicubic, or shorter side bilinear then the centre
crop), antialiased, rounded back to 8-bit pixels. Everything else goes through the CPU path,
so every image still loads or fails as it would there: other formats, CMYK JPEGs, JPEGs with
an EXIF rotation, and any file the device's decoder refuses (the CPU path then names what is
wrong with it).

The pixels are close to the CPU path's, not equal: the device decodes at full scale (the CPU
path at a reduced scale where the size allows) and resamples with torch rather than Pillow.
Tests hold the difference to a few levels of 255 and the captions to the CPU path's.
"""

from __future__ import annotations

import io
import os
import warnings

import torch
import torch.nn.functional as F
from PIL import Image

from captioner.data.images import Preprocess

_ORIENTATION = 0x0112  # the EXIF tag of the picture's rotation
_JPEG_START = b"\xff\xd8"  # every JPEG file's first two bytes (its start-of-image marker)


def plain_jpeg(path: str | os.PathLike, max_pixels: int) -> torch.Tensor | None:
    """The file's bytes (a uint8 tensor) when the device may decode it as the CPU path would
    see it: a JPEG in RGB or grey, upright, within ``max_pixels``; None for anything else
    (the CPU path takes it, and says why it cannot when it cannot). The file is opened once;
    one that does not start as a JPEG does is not read further."""
    try:
        with open(path, "rb") as f:
            if f.read(2) != _JPEG_START:
                return None
            data = bytearray(_JPEG_START + f.read())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as im:  # the header, from the bytes in memory
                if im.format != "JPEG" or im.mode not in ("RGB", "L") or im.width * im.height > max_pixels:
                    return None
                if im.getexif().get(_ORIENTATION, 1) != 1:
                    return None
    except Exception:  # unreadable, not an image, over Pillow's own limit: the CPU path says which
        return None
    return torch.frombuffer(data, dtype=torch.uint8)


def resample(image: torch.Tensor, preprocess: Preprocess) -> torch.Tensor:
    """Decoded 8-bit pixels (3, H, W) -> (3, h, w) 8-bit pixels at ``preprocess``'s size, with
    its geometry, on the image's device."""
    h, w = preprocess.size
    x = image.unsqueeze(0).float()
    if preprocess.resize:
        rw, rh = preprocess._resized((image.shape[-1], image.shape[-2]))
        x = F.interpolate(x, size=(rh, rw), mode="bilinear", antialias=True, align_corners=False)
        left, top = preprocess._crop_origin((rw, rh))
        x = x[..., top:top + h, left:left + w]
    else:
        x = F.interpolate(x, size=(h, w), mode="bicubic", antialias=True, align_corners=False)
    return x.round().clamp(0, 255).to(torch.uint8)[0]


def decode_resize(raw: list[torch.Tensor], preprocess: Preprocess, device: torch.device | str) -> list:
    """Each JPEG's bytes -> its (3, h, w) 8-bit pixels on ``device`` (see :func:`resample`), or
    None where the device's decoder refuses the file. The batch is decoded in one call; when
    that call fails, image by image, so that one bad file costs only itself."""
    from torchvision.io import ImageReadMode, decode_jpeg

    if not raw:
        return []
    with warnings.catch_warnings():  # newer torchvision points to its successor, torchcodec, at each call
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            images = decode_jpeg(raw, mode=ImageReadMode.RGB, device=device)
        except RuntimeError:
            images = []
            for data in raw:
                try:
                    images.append(decode_jpeg(data, mode=ImageReadMode.RGB, device=device))
                except RuntimeError:
                    images.append(None)
    return [None if im is None else resample(im, preprocess) for im in images]
