"""A folder of awkward image files, each one a case a batch run must survive."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
from PIL import Image


def _rgb(w: int = 48, h: int = 32, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


def _jpeg_bytes(im: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "JPEG", **kw)
    return buf.getvalue()


def exif_rotated_jpeg() -> bytes:
    """A 40x20 (w x h) picture stored sideways with EXIF orientation 6 (rotate 90 CW to view)."""
    stored = Image.new("RGB", (20, 40), "blue")
    stored.paste(Image.new("RGB", (20, 20), "red"), (0, 0))  # red on top as stored
    exif = Image.Exif()
    exif[0x0112] = 6
    return _jpeg_bytes(stored, exif=exif.tobytes())


def make_bad_folder(root: Path) -> dict[str, bool]:
    """Writes the cases under ``root``; returns {relative path: expected to be captioned}."""
    root.mkdir(parents=True, exist_ok=True)
    expect: dict[str, bool] = {}

    def put(rel: str, data: bytes, ok: bool) -> None:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        expect[rel] = ok

    def save(rel: str, im: Image.Image, fmt: str, ok: bool = True, **kw) -> None:
        buf = io.BytesIO()
        im.save(buf, fmt, **kw)
        put(rel, buf.getvalue(), ok)

    put("good.jpg", _jpeg_bytes(_rgb()), True)
    put("zero.jpg", b"", False)
    put("truncated.jpg", _jpeg_bytes(_rgb(64, 64))[:300], False)
    put("text.jpg", b"just some text, not an image\n", False)
    put("page.jpg", b"<!doctype html><html><body>404 not found</body></html>", False)
    save("png-named.jpg", _rgb(), "PNG")
    save("cmyk.jpg", _rgb().convert("CMYK"), "JPEG")
    save("sixteen.png", Image.fromarray((np.arange(32 * 48).reshape(32, 48) * 40).astype(np.uint16)), "PNG")
    save("onebit.png", _rgb().convert("1"), "PNG")
    save("rgba.png", _rgb().convert("RGBA"), "PNG")
    save("la.png", _rgb().convert("LA"), "PNG")
    save("palette.png", _rgb().convert("P"), "PNG", transparency=0)
    frames = [_rgb(seed=i) for i in range(3)]
    save("animated.gif", frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    put("rotated.jpg", exif_rotated_jpeg(), True)
    save("tiny1x1.png", Image.new("RGB", (1, 1), "white"), "PNG")
    save("large.jpg", _rgb(3000, 2000), "JPEG")
    save("bomb.png", Image.new("1", (20000, 20000)), "PNG", ok=False)  # 400 M pixels, a few KB on disk
    save("with space ünïcødé.png", _rgb(seed=5), "PNG")
    save("nested/deeper/inside.webp", _rgb(seed=6), "WEBP")
    save("nested/pic.bmp", _rgb(seed=7), "BMP")
    save("nested/pic.tiff", _rgb(seed=8), "TIFF")
    os.symlink("missing-target.jpg", root / "dangling.jpg")  # unreadable: points nowhere
    expect["dangling.jpg"] = False
    os.symlink("..", root / "nested" / "loop")  # a symlink loop back up the tree
    (root / "notes.txt").write_text("not an image, ignored")
    (root / "nested" / "data.json").write_text("{}")
    return expect


SKIPPED_IN_BAD_FOLDER = 2  # notes.txt, data.json
