"""The synthetic "shapes" dataset, written in COCO format.

Each image shows 1-3 flat-coloured shapes on a dark, mildly noisy background, with five
English captions that name every object as "[size] colour shape", or with ``language="zh"``
five Chinese ones ("一个红色的大圆形和一个蓝色的三角形") of the same images and objects.
:func:`english_words` reads a Chinese caption's characters as the English words they
spell, so that object accuracy and the pointing game parse both languages. Because the objects and
their boxes are known exactly, the dataset lets us measure what a captioner says (object
accuracy) and where its attention looks (pointing game), see ``captioner.evaluation.grounding``.

Layout under ``out_dir``::

    images/<split>/<split>_000000.png
    captions_<split>.json    COCO captions: images, annotations {id, image_id, caption}
    instances_<split>.json   COCO instances: images, categories (shape names),
                             annotations {bbox [x, y, w, h], attributes {color, size}}

Generation is deterministic: image ``i`` of a split depends only on (seed, split, i), so
the same seed gives byte-identical files and a larger count extends a smaller one.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star", "cross")
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 190, 60),
    "blue": (50, 90, 235),
    "yellow": (235, 220, 40),
    "purple": (150, 50, 200),
    "white": (245, 245, 245),
}
SIZES: tuple[str, ...] = ("small", "large")

# Object extents in pixels at image_size 128; scaled linearly for other sizes. The gap
# between the ranges keeps "small" and "large" visually unambiguous.
_SIZE_RANGE_128 = {"small": (18, 26), "large": (34, 46)}
_COLOR_JITTER = 12  # per-channel jitter of an object's colour; stays far from the others
_BACKGROUND = (30, 70)  # grey level range of the background, well below every colour
_NOISE = 6  # per-pixel background noise amplitude
_MIN_IMAGE_SIZE = 48
_SPLIT_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


@dataclass(frozen=True)
class _Object:
    shape: str
    color: str
    size: str
    box: tuple[int, int, int]  # x, y, side of the square the shape is drawn in
    bbox: tuple[int, int, int, int]  # tight x, y, w, h of what is actually drawn

    @property
    def centre(self) -> tuple[float, float]:
        x, y, w, h = self.bbox
        return x + w / 2, y + h / 2


# ---------------------------------------------------------------------------- drawing

def _star_points(x: int, y: int, s: int) -> list[tuple[float, float]]:
    """Five-pointed star in the square (x, y, s), centred vertically on its own extent."""
    r_out = (s - 1) / 2
    r_in = r_out * 0.45
    pts = []
    for k in range(10):
        r = r_out if k % 2 == 0 else r_in
        a = -math.pi / 2 + k * math.pi / 5
        pts.append((r * math.cos(a), r * math.sin(a)))
    # The star reaches r_out upwards but only r_out*cos(36 deg) downwards: recentre it.
    top, bottom = min(p[1] for p in pts), max(p[1] for p in pts)
    dy = -(top + bottom) / 2
    return [(x + r_out + px, y + r_out + py + dy) for px, py in pts]


def _draw_mask(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int]) -> None:
    """Draw one shape (fill 255) into the square box (x, y, side)."""
    x, y, s = box
    x1, y1 = x + s - 1, y + s - 1  # PIL boxes include their last pixel
    if shape == "circle":
        draw.ellipse((x, y, x1, y1), fill=255)
    elif shape == "square":
        draw.rectangle((x, y, x1, y1), fill=255)
    elif shape == "cross":
        t = max(2, round(s / 3))
        a, b = x + (s - t) // 2, y + (s - t) // 2
        draw.rectangle((a, y, a + t - 1, y1), fill=255)
        draw.rectangle((x, b, x1, b + t - 1), fill=255)
    elif shape == "triangle":
        draw.polygon([(x + (s - 1) / 2, y), (x, y1), (x1, y1)], fill=255)
    elif shape == "star":
        draw.polygon(_star_points(x, y, s), fill=255)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def _paint(image: Image.Image, shape: str, box: tuple[int, int, int],
           fill: tuple[int, int, int]) -> tuple[int, int, int, int]:
    """Paint one shape; return the tight bbox (x, y, w, h) of the pixels it covers.

    The box is measured on the rasterised mask rather than computed from the geometry,
    so it matches the pixels exactly whatever PIL's rounding of polygon edges.
    """
    mask = Image.new("L", image.size, 0)
    _draw_mask(ImageDraw.Draw(mask), shape, box)
    image.paste(fill, mask=mask)
    x0, y0, x1, y1 = mask.getbbox()
    return x0, y0, x1 - x0, y1 - y0


# --------------------------------------------------------------------------- layout

def _separated(a: tuple[int, int, int], b: tuple[int, int, int], gap: int) -> bool:
    ax, ay, as_ = a
    bx, by, bs = b
    return (ax + as_ + gap <= bx or bx + bs + gap <= ax
            or ay + as_ + gap <= by or by + bs + gap <= ay)


def _layout(rng: np.random.Generator, image_size: int) -> list[tuple[str, str, str, tuple[int, int, int]]]:
    """1-3 (shape, colour, size, square box) without overlap and without repeated
    (colour, shape) pairs, so every object can be named unambiguously in a caption."""
    scale = image_size / 128
    gap = max(2, round(3 * scale))
    border = max(1, round(2 * scale))
    n = int(rng.integers(1, 4))
    placed: list[tuple[str, str, str, tuple[int, int, int]]] = []
    for _ in range(n):
        while True:  # redraw repeated (colour, shape) pairs; 30 pairs, at most 3 taken
            shape = SHAPES[int(rng.integers(len(SHAPES)))]
            color = list(COLORS)[int(rng.integers(len(COLORS)))]
            if not any(p[0] == shape and p[1] == color for p in placed):
                break
        size = SIZES[int(rng.integers(len(SIZES)))]
        lo, hi = _SIZE_RANGE_128[size]
        s = int(rng.integers(round(lo * scale), round(hi * scale) + 1))
        for _attempt in range(100):
            x = int(rng.integers(border, image_size - border - s + 1))
            y = int(rng.integers(border, image_size - border - s + 1))
            if all(_separated((x, y, s), p[3], gap) for p in placed):
                placed.append((shape, color, size, (x, y, s)))
                break
        # An object that found no free spot is simply dropped; the first always fits.
    return placed


def _render(rng: np.random.Generator, image_size: int) -> tuple[Image.Image, list[_Object]]:
    base = int(rng.integers(_BACKGROUND[0], _BACKGROUND[1] + 1))
    # Grey noise (equal on all channels): enough texture that the background is not a
    # flat constant, while PNGs stay small (colour noise triples their size).
    noise = rng.integers(-_NOISE, _NOISE + 1, size=(image_size, image_size))
    grey = np.clip(base + noise, 0, 255).astype(np.uint8)
    image = Image.fromarray(np.repeat(grey[:, :, None], 3, axis=2))
    objects = []
    for shape, color, size, box in _layout(rng, image_size):
        jitter = rng.integers(-_COLOR_JITTER, _COLOR_JITTER + 1, size=3)
        fill = tuple(int(v) for v in np.clip(np.array(COLORS[color]) + jitter, 0, 255))
        bbox = _paint(image, shape, box, fill)
        objects.append(_Object(shape, color, size, box, bbox))
    return image, objects


# -------------------------------------------------------------------------- captions

def _article(phrase: str) -> str:
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase


def _phrase(obj: _Object, with_size: bool) -> str:
    return _article(f"{obj.size} {obj.color} {obj.shape}" if with_size else f"{obj.color} {obj.shape}")


def _join(phrases: Sequence[str]) -> str:
    if len(phrases) == 1:
        return phrases[0]
    return ", ".join(phrases[:-1]) + " and " + phrases[-1]


# A template maps the phrases of the objects, ordered left to right, to a caption.
_Template = Callable[[list[str]], str]

_LIST_TEMPLATES: list[_Template] = [
    lambda p: _join(p),
    lambda p: "there is " + _join(p),
    lambda p: "an image with " + _join(p),
    lambda p: "a picture of " + _join(p),
    lambda p: _join(p) + " on a dark background",
    lambda p: "a dark background with " + _join(p),
    lambda p: "this image shows " + _join(p),
]
_SINGLE_TEMPLATES: list[_Template] = [
    lambda p: "a single " + p[0][p[0].index(" ") + 1:],
    lambda p: "only one object: " + p[0],
]
_MULTI_TEMPLATES: list[_Template] = [
    lambda p: "from left to right: " + _join(p),
    lambda p: ("two" if len(p) == 2 else "three") + " objects: " + _join(p),
]


def _relation_pair(a: _Object, b: _Object) -> tuple[bool, _Object, _Object]:
    """(True, the upper, the lower) when the centres lie further apart vertically than
    horizontally, else (False, the left, the right): the relation a caption states."""
    (ax, ay), (bx, by) = a.centre, b.centre
    if abs(by - ay) > abs(bx - ax):
        return (True, a, b) if ay < by else (True, b, a)
    return (False, a, b) if ax <= bx else (False, b, a)


def _relation_templates(a: _Object, b: _Object) -> list[Callable[[Callable[[_Object], str]], str]]:
    """Captions stating a true spatial relation between exactly two objects; the axis
    with the larger separation of centres decides between left/right and above/below."""
    vertical, first, second = _relation_pair(a, b)
    if vertical:
        up, down = first, second
        return [
            lambda ph: f"{ph(up)} above {ph(down)}",
            lambda ph: f"{ph(down)} below {ph(up)}",
            lambda ph: f"an image with {ph(up)} above {ph(down)}",
        ]
    left, right = first, second
    return [
        lambda ph: f"{ph(left)} to the left of {ph(right)}",
        lambda ph: f"{ph(right)} to the right of {ph(left)}",
        lambda ph: f"an image with {ph(left)} on the left of {ph(right)}",
    ]


def _top_to_bottom(p: list[str]) -> str:
    return "from top to bottom: " + _join(p)


# ------------------------------------------------------------------ Chinese captions

ZH_SHAPES = {"circle": "圆形", "square": "正方形", "triangle": "三角形", "star": "星形", "cross": "十字形"}
ZH_COLORS = {"red": "红色", "green": "绿色", "blue": "蓝色", "yellow": "黄色", "purple": "紫色", "white": "白色"}
ZH_SIZES = {"small": "小", "large": "大"}


def _zh_phrase(obj: _Object, with_size: bool, counted: bool = True) -> str:
    """"一个红色的大圆形" ("a large red circle"); without the count "红色的大圆形" (relations)."""
    size = ZH_SIZES[obj.size] if with_size else ""
    return ("一个" if counted else "") + f"{ZH_COLORS[obj.color]}的{size}{ZH_SHAPES[obj.shape]}"


def _zh_join(phrases: Sequence[str]) -> str:
    return phrases[0] if len(phrases) == 1 else "、".join(phrases[:-1]) + "和" + phrases[-1]


# The English templates' counterparts, as many of each kind, so that both languages draw
# their five captions from pools of the same sizes.
_ZH_LIST_TEMPLATES: list[_Template] = [
    lambda p: _zh_join(p),
    lambda p: "有" + _zh_join(p),
    lambda p: "一张有" + _zh_join(p) + "的图片",
    lambda p: "图片上是" + _zh_join(p),
    lambda p: _zh_join(p) + "在深色的背景上",
    lambda p: "深色背景上有" + _zh_join(p),
    lambda p: "这张图片里有" + _zh_join(p),
]
_ZH_SINGLE_TEMPLATES: list[_Template] = [
    lambda p: "只有" + p[0],
    lambda p: "只有一个物体：" + p[0],
]
_ZH_MULTI_TEMPLATES: list[_Template] = [
    lambda p: "从左到右：" + _zh_join(p),
    lambda p: ("两" if len(p) == 2 else "三") + "个物体：" + _zh_join(p),
]


def _zh_relation_templates(a: _Object, b: _Object) -> list[Callable[[Callable[[_Object], str]], str]]:
    """:func:`_relation_templates` in Chinese: "X在Y的上面", "X在Y的左边", ..."""
    vertical, first, second = _relation_pair(a, b)
    if vertical:
        up, down = first, second
        return [
            lambda ph: f"{ph(up)}在{ph(down)}的上面",
            lambda ph: f"{ph(down)}在{ph(up)}的下面",
            lambda ph: f"一张图片，{ph(up)}在{ph(down)}的上面",
        ]
    left, right = first, second
    return [
        lambda ph: f"{ph(left)}在{ph(right)}的左边",
        lambda ph: f"{ph(right)}在{ph(left)}的右边",
        lambda ph: f"一张图片，{ph(left)}在{ph(right)}的左边",
    ]


# Chinese character runs -> the English words of the grounding parser; "的" ("of", between a
# colour and a size) says nothing there and goes. Anything else stays as it is.
_ZH_TO_ENGLISH: dict[str, tuple[str, ...]] = {
    **{zh: (en,) for en, zh in {**ZH_SHAPES, **ZH_COLORS, **ZH_SIZES}.items()},
    "左边": ("left",), "右边": ("right",), "上面": ("above",), "下面": ("below",),
    "从左到右": ("from", "left", "to", "right"), "从上到下": ("from", "top", "to", "bottom"),
    "的": (),
}
_ZH_LONGEST = max(len(k) for k in _ZH_TO_ENGLISH)


def english_words(words: Sequence[str]) -> tuple[list[str], list[int]]:
    """A caption's tokens with Chinese shape, colour, size and relation words (characters
    as the ``chars2`` or ``chars`` tokenizer gives them) replaced by the English words, and for each word
    the step of its first character (the step at which the model chose that word): index
    the attention maps with it. English captions come back as they are."""
    out: list[str] = []
    steps: list[int] = []
    i = 0
    while i < len(words):
        for n in range(min(_ZH_LONGEST, len(words) - i), 0, -1):
            english = _ZH_TO_ENGLISH.get("".join(words[i:i + n]))
            if english is not None:
                out += english
                steps += [i] * len(english)
                i += n
                break
        else:
            out.append(words[i])
            steps.append(i)
            i += 1
    return out, steps


def _captions(rng: np.random.Generator, objects: list[_Object], n: int = 5,
              top_to_bottom: bool = False, language: str = "en") -> list[str]:
    zh = language == "zh"
    phrase = _zh_phrase if zh else _phrase
    ordered = sorted(objects, key=lambda o: o.centre[0])
    pool: list[Callable[[bool], str]] = []
    if zh:
        extra = _ZH_SINGLE_TEMPLATES if len(ordered) == 1 else _ZH_MULTI_TEMPLATES
        templates = _ZH_LIST_TEMPLATES + extra
    else:
        templates = _LIST_TEMPLATES + (_SINGLE_TEMPLATES if len(ordered) == 1 else _MULTI_TEMPLATES)
    for t in templates:
        pool.append(lambda ws, t=t: t([phrase(o, ws) for o in ordered]))
    if top_to_bottom and len(ordered) > 1:
        # The vertical twin of "from left to right": the objects named highest first.
        downward = sorted(objects, key=lambda o: o.centre[1])
        if zh:
            pool.append(lambda ws: "从上到下：" + _zh_join([phrase(o, ws) for o in downward]))
        else:
            pool.append(lambda ws: _top_to_bottom([phrase(o, ws) for o in downward]))
    if len(ordered) == 2:
        if zh:  # relations name the objects without the count: "红色的圆形在蓝色的正方形的左边"
            for r in _zh_relation_templates(*ordered):
                pool.append(lambda ws, r=r: r(lambda o: _zh_phrase(o, ws, counted=False)))
        else:
            for r in _relation_templates(*ordered):
                pool.append(lambda ws, r=r: r(lambda o: _phrase(o, ws)))
    chosen = rng.choice(len(pool), size=n, replace=False)
    # Sizes are named in about half the captions, for all objects of that caption.
    return [pool[int(i)](bool(rng.integers(2))) for i in chosen]


# --------------------------------------------------------------------------- writing

def _split_key(split: str) -> int:
    # Python's hash() is salted per process; a digest gives a stable per-split stream.
    return int.from_bytes(hashlib.sha256(split.encode("utf-8")).digest()[:8], "little")


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False) + "\n", encoding="utf-8")


LANGUAGES = {"en": "ptb", "zh": "chars2"}  # caption language -> the tokenizer its data set names


def generate_split(out_dir: Path, split: str, count: int, seed: int = 0,
                   image_size: int = 128, progress: bool = False, top_to_bottom: bool = False,
                   language: str = "en") -> dict:
    """Write one split; returns {"images", "objects", "captions"} counts. ``top_to_bottom``
    adds a "from top to bottom: ..." caption to the templates an image with two or three
    objects draws its five from (the images stay the same; off, the captions do too).
    ``language``: "en" or "zh", the captions' (the images and objects are the same)."""
    out_dir = Path(out_dir)
    image_dir = out_dir / "images" / split
    image_dir.mkdir(parents=True, exist_ok=True)
    key = _split_key(split)
    images, captions, instances = [], [], []
    indices = range(count)
    if progress:
        from tqdm import tqdm
        indices = tqdm(indices, desc=f"shapes {split}", unit="img")
    for i in indices:
        rng = np.random.default_rng([seed, key, i])
        image, objects = _render(rng, image_size)
        file_name = f"{split}/{split}_{i:06d}.png"
        image.save(out_dir / "images" / file_name, format="PNG")
        image_id = i + 1  # COCO ids start at 1; 0 is easy to mistake for "missing"
        images.append({"id": image_id, "file_name": file_name, "width": image_size, "height": image_size})
        for text in _captions(rng, objects, top_to_bottom=top_to_bottom, language=language):
            captions.append({"id": len(captions) + 1, "image_id": image_id, "caption": text})
        for obj in objects:
            x, y, w, h = obj.bbox
            instances.append({
                "id": len(instances) + 1, "image_id": image_id,
                "category_id": SHAPES.index(obj.shape) + 1,
                "bbox": [x, y, w, h], "area": w * h, "iscrowd": 0,
                "attributes": {"color": obj.color, "size": obj.size},
            })
    categories = [{"id": k + 1, "name": name, "supercategory": "shape"} for k, name in enumerate(SHAPES)]
    info = {"description": f"synthetic shapes, split {split}, seed {seed}"}
    if language != "en":
        info = {"description": f"{info['description']}, captions in {language}", "tokenizer": LANGUAGES[language]}
    _write_json(out_dir / f"captions_{split}.json", {"info": info, "images": images, "annotations": captions})
    _write_json(out_dir / f"instances_{split}.json",
                {"info": info, "images": images, "categories": categories, "annotations": instances})
    return {"images": len(images), "objects": len(instances), "captions": len(captions)}


_DATASET_FILE = re.compile(r"(captions|instances)_[\w-]+\.json")
_DATASET_IMAGE = re.compile(r"([\w-]+)/\1_\d{6}\.png")


def remove_dataset(out_dir: Path) -> None:
    """Delete the shapes data set in ``out_dir`` (the files ``generate_dataset`` writes, see the
    layout above), so that a new one does not mix with it; other files stay."""
    out_dir = Path(out_dir)
    for path in out_dir.glob("*.json"):
        if _DATASET_FILE.fullmatch(path.name):
            path.unlink()
    images = out_dir / "images"
    for path in sorted(images.rglob("*.png")) if images.is_dir() else ():
        if _DATASET_IMAGE.fullmatch(path.relative_to(images).as_posix()):
            path.unlink()
    for folder in sorted((p for p in images.rglob("*") if p.is_dir()), reverse=True) if images.is_dir() else ():
        if not any(folder.iterdir()):
            folder.rmdir()
    if images.is_dir() and not any(images.iterdir()):
        images.rmdir()


def generate_dataset(out_dir: Path, counts: dict[str, int], seed: int = 0,
                     image_size: int = 128, progress: bool = False, top_to_bottom: bool = False,
                     language: str = "en") -> dict:
    """Generate every split in ``counts`` (e.g. {"train": 3000, "val": 200, "test": 500}).

    Returns a summary: {"out_dir", "seed", "image_size", "splits": {split: counts}}.
    """
    if image_size < _MIN_IMAGE_SIZE:
        raise ValueError(f"image_size must be at least {_MIN_IMAGE_SIZE}, got {image_size}")
    if language not in LANGUAGES:
        raise ValueError(f"captions in {', '.join(LANGUAGES)} only, not {language!r}")
    for split, count in counts.items():
        if not _SPLIT_NAME.match(split):
            raise ValueError(f"split names may use letters, digits, '_' and '-' only: {split!r}")
        if not isinstance(count, int) or count < 0:
            raise ValueError(f"count for split {split!r} must be a non-negative int, got {count!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    splits = {split: generate_split(out_dir, split, count, seed, image_size, progress, top_to_bottom, language)
              for split, count in counts.items()}
    return {"out_dir": str(out_dir), "seed": seed, "image_size": image_size, "splits": splits}
