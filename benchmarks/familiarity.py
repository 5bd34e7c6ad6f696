"""What the demos know they do not know: familiarity, caption confidence, and their cost.

    python -m benchmarks.familiarity [--weights demo-soft demo-hard] [--test 1000] [--out FILE]

Needs scikit-image (`pip install scikit-image`) for its sample photographs. For each model:

1. Familiarity (captioner.familiarity) on a fresh shapes test set (`captioner shapes --seed
   31415 --test 1000`, never seen in training) against photographs: the sample photographs
   that scikit-image ships, each whole and as 4 random square crops. AUROC of familiarity
   (shapes positive), and the share of each set flagged unfamiliar (familiarity < 0.01).
2. The share flagged among shapes the model has never seen, 500 images each: objects in an
   unseen colour (orange, cyan, pink, brown), an unseen shape (diamond, hexagon, ring), the
   usual objects on a light background, five objects (training has one to three).
3. On the same fresh test set (beam 3): how well the caption's log-probability, its mean
   per word, and the lowest probability of its object words (colour, shape, size) predict
   that its objects are named right (object accuracy, colour and shape): AUROC.
4. The cost: ms per image of `captioner caption`'s work (loading, batch 16, beam 3, the
   JSON lines; one thread) on 500 of those images, without familiarity and alternatives (as
   before) and with familiarity and --num-captions 3, side by side batch by batch (``cost``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from captioner.cli.batch import image_loader
from captioner.data import shapes
from captioner.data.coco import load_split
from captioner.evaluation.grounding import load_shape_objects, object_accuracy, parse_mentions
from captioner.inference import Captioner, DecodeOptions
from captioner.search.options import UNFAMILIAR_BELOW

PHOTOS = ["astronaut", "camera", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry", "moon",
          "coins", "clock", "grass", "gravel", "brick", "retina", "page", "text", "microaneurysms"]
UNSEEN_COLORS = {"orange": (255, 140, 0), "cyan": (0, 200, 210), "pink": (255, 120, 190), "brown": (140, 80, 30)}
UNSEEN_SHAPES = ("diamond", "hexagon", "ring")
VARIANTS = ("unseen colour", "unseen shape", "light background", "five objects")


def auroc(positive: np.ndarray, negative: np.ndarray) -> float:
    """P(a positive scores above a negative), ties half: the area under the ROC curve."""
    p, n = np.asarray(positive, float)[:, None], np.asarray(negative, float)[None, :]
    return float((p > n).mean() + 0.5 * (p == n).mean())


def photographs(seed: int = 0) -> list[Image.Image]:
    try:
        import skimage.data
    except ImportError:
        sys.exit("this study needs scikit-image's sample photographs: pip install scikit-image")
    rng = np.random.default_rng(seed)
    out = []
    for name in PHOTOS:
        a = getattr(skimage.data, name)()
        a = np.repeat(a[:, :, None], 3, axis=2) if a.ndim == 2 else a[:, :, :3]
        image = Image.fromarray(a.astype(np.uint8))
        out.append(image)
        w, h = image.size
        for _ in range(4):
            s = int(min(w, h) * rng.uniform(0.4, 0.9))
            x, y = int(rng.integers(0, w - s + 1)), int(rng.integers(0, h - s + 1))
            out.append(image.crop((x, y, x + s, y + s)))
    return out


def _unseen_mask(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int]) -> None:
    x, y, s = box
    c, r = (x + (s - 1) / 2, y + (s - 1) / 2), (s - 1) / 2
    if shape == "diamond":
        draw.polygon([(c[0], y), (x + s - 1, c[1]), (c[0], y + s - 1), (x, c[1])], fill=255)
    elif shape == "hexagon":
        draw.regular_polygon((c[0], c[1], r), 6, fill=255)
    else:  # ring
        draw.ellipse((x, y, x + s - 1, y + s - 1), outline=255, width=max(2, s // 6))


def variant_image(kind: str, rng: np.random.Generator, size: int = 128) -> Image.Image:
    """A shapes image the model has never seen: one way off the training data, the rest as
    ``captioner shapes`` draws it (background noise, sizes, separated objects)."""
    light = kind == "light background"
    base = int(rng.integers(180, 231)) if light else int(rng.integers(*shapes._BACKGROUND))
    grey = np.clip(base + rng.integers(-shapes._NOISE, shapes._NOISE + 1, size=(size, size)), 0, 255)
    image = Image.fromarray(np.repeat(grey[:, :, None], 3, axis=2).astype(np.uint8))
    n = 5 if kind == "five objects" else int(rng.integers(1, 4))
    placed: list[tuple[int, int, int]] = []
    for _ in range(n):
        lo, hi = shapes._SIZE_RANGE_128["small" if n == 5 else shapes.SIZES[int(rng.integers(2))]]
        s = int(rng.integers(lo, hi + 1))
        for _attempt in range(200):
            box = (int(rng.integers(2, size - 2 - s + 1)), int(rng.integers(2, size - 2 - s + 1)), s)
            if all(shapes._separated(box, p, 3) for p in placed):
                placed.append(box)
                break
    colors = UNSEEN_COLORS if kind == "unseen colour" else shapes.COLORS
    for box in placed:
        fill = tuple(int(v) for v in list(colors.values())[int(rng.integers(len(colors)))])
        if kind == "unseen shape":
            mask = Image.new("L", image.size, 0)
            _unseen_mask(ImageDraw.Draw(mask), UNSEEN_SHAPES[int(rng.integers(len(UNSEEN_SHAPES)))], box)
            image.paste(fill, mask=mask)
        else:
            shapes._paint(image, shapes.SHAPES[int(rng.integers(len(shapes.SHAPES)))], box, fill)
    return image


def familiarities(cap: Captioner, images: list[Image.Image]) -> np.ndarray:
    opts = DecodeOptions(beam_size=1, max_len=1)  # familiarity needs the encoder only
    out = []
    for i in range(0, len(images), 64):
        out += [r.familiarity.value for r in cap.caption_images(images[i:i + 64], opts)]
    return np.array(out)


def confidence(cap: Captioner, data: Path, records) -> dict:
    """AUROC of three confidences for "the objects are named right", beam 3."""
    objects = load_shape_objects(data / "instances_test.json")
    right, logp, mean_logp, lowest, counted, n_objects = [], [], [], [], [], []
    images = [Image.open(r.path).convert("RGB") for r in records]
    for i in range(0, len(images), 32):
        for rec, res in zip(records[i:i + 32], cap.caption_images(images[i:i + 32], DecodeOptions(beam_size=3))):
            acc = object_accuracy(res.words, objects[rec.image_id].objects)
            right.append(acc.exact_color_shape)
            counted.append(acc.n_mentions == acc.n_objects)
            n_objects.append(acc.n_objects)
            logp.append(res.score)
            mean_logp.append(res.score / (len(res.words) + 1))
            named = [j for m in parse_mentions(res.words)
                     for j in (m.shape_index, m.color_index, m.size_index) if j is not None]
            lowest.append(min((res.word_probs[j] for j in named), default=0.0))
    right, counted, n_objects = np.array(right), np.array(counted), np.array(n_objects)
    out = {"images": len(right), "named_right": round(float(right.mean()), 4), "wrong": int((~right).sum()),
           "wrong_with_as_many_mentions_as_objects": int((~right & counted).sum()),
           "by_objects": {int(n): {"images": int((n_objects == n).sum()), "wrong": int((~right[n_objects == n]).sum()),
                                   "mean_word_log_p": round(float(np.mean(np.array(mean_logp)[n_objects == n])), 4)}
                          for n in np.unique(n_objects)}}
    for name, score in (("caption_log_p", logp), ("mean_word_log_p", mean_logp), ("lowest_object_word_p", lowest)):
        s = np.array(score)
        out[f"auroc_{name}"] = round(auroc(s[right], s[~right]), 4)
    return out


def cost(cap: Captioner, paths: list[str], repeats: int = 6) -> dict:
    """ms per image of `captioner caption`'s work, without familiarity and alternatives (as
    before) and with familiarity and --num-captions 3: images loaded (decoded and preprocessed)
    once, as the command's loader does, timed once; then, batch by batch, captioning and the
    JSON lines in each mode ``repeats`` times in turn, the fastest kept (the machine is shared:
    a slower run met other work)."""
    record = cap.familiarity
    modes = {"without": (None, DecodeOptions(beam_size=3)),
             "with": (record, DecodeOptions(beam_size=3, num_captions=3))}
    start = time.perf_counter()
    batches = list(image_loader(paths, cap.preprocess, 16, 0))
    load = time.perf_counter() - start
    total = dict.fromkeys(modes, 0.0)
    found = [0] * 4  # images with 0..3 alternatives (the pool's finished captions when the search stopped)
    for batch in batches:
        fastest = dict.fromkeys(modes, float("inf"))
        for r in range(repeats):
            for mode in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
                cap.familiarity, opts = modes[mode]
                start = time.perf_counter()
                results = cap.caption_batch(batch.pixels, opts)
                for i, res in zip(batch.loaded, results):
                    json.dumps(res.to_json(paths[i]))
                fastest[mode] = min(fastest[mode], time.perf_counter() - start)
                if mode == "with" and r == 0:
                    for res in results:
                        found[len(res.alternatives)] += 1
        for mode in modes:
            total[mode] += fastest[mode]
    cap.familiarity = record
    ms = {mode: 1000 * (load + t) / len(paths) for mode, t in total.items()}
    return {"images": len(paths), "ms_per_image_loading": round(1000 * load / len(paths), 2),
            "ms_per_image_without": round(ms["without"], 2), "ms_per_image_with": round(ms["with"], 2),
            "added": round(ms["with"] / ms["without"] - 1, 4), "images_with_1_2_3_alternatives": found[1:]}


def study(name: str, data: Path, photos: list[Image.Image], variants: dict[str, list[Image.Image]],
          timing: int) -> dict:
    cap = Captioner.load(name)
    if cap.familiarity is None:
        sys.exit(f"{name} has no familiarity record: captioner familiarity adds one")
    records = load_split(data, "test")
    test_images = [Image.open(r.path).convert("RGB") for r in records]
    shapes_fam, photo_fam = familiarities(cap, test_images), familiarities(cap, photos)
    t = cap.familiarity.images
    out = {"model": name, "training_images": t,
           "familiarity": {"auroc_shapes_vs_photos": round(auroc(shapes_fam, photo_fam), 4),
                           "shapes_test_images": len(shapes_fam),
                           "shapes_flagged": round(float((shapes_fam < UNFAMILIAR_BELOW).mean()), 4),
                           "photos": len(photo_fam),
                           "photos_flagged": round(float((photo_fam < UNFAMILIAR_BELOW).mean()), 4),
                           "photos_highest_familiarity": round(float(photo_fam.max()), 4),
                           "variants_flagged": {k: round(float((familiarities(cap, v) < UNFAMILIAR_BELOW).mean()), 4)
                                                for k, v in variants.items()}},
           "confidence": confidence(cap, data, records)}
    if timing:
        out["cost"] = cost(cap, [str(r.path) for r in records[:timing]])
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", nargs="+", default=["demo-soft", "demo-hard"])
    p.add_argument("--test", type=int, default=1000, help="fresh shapes test images (default 1000)")
    p.add_argument("--seed", type=int, default=31415, help="their seed (default 31415)")
    p.add_argument("--variants", type=int, default=500, help="images per unseen variant (default 500)")
    p.add_argument("--timing", type=int, default=500, help="images timed per run (default 500; 0: no timing)")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    variants = {k: [variant_image(k, rng) for _ in range(args.variants)] for k in VARIANTS}
    photos = photographs()
    with tempfile.TemporaryDirectory() as tmp:
        shapes.generate_dataset(Path(tmp), {"test": args.test}, seed=args.seed)
        results = [study(name, Path(tmp), photos, variants, args.timing) for name in args.weights]
    text = json.dumps(results, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
