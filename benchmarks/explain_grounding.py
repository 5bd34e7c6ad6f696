"""Which map points at the object a word names: attention, Grad-CAM or gradient x input.

    python -m benchmarks.explain_grounding [--weights demo-soft demo-hard demo-zh] [--images 500]
                                           [--seed 7] [--beam-size 3] [--resamples 2000] [--timing 50]

On a fresh shapes test set (``captioner shapes --train 0 --val 0 --test N --seed S``, made in a
temporary folder), each model captions every image once and gives, for the caption it chose,
three maps per word: its attention, and the two gradient maps of ``captioner.explain``. Each
map is scored by the same pointing game (``captioner.evaluation.grounding.evaluate_caption``: the
words naming a shape or colour that one object in the image has; a hit when the map's strongest
cell lies in that object's box; the map's mass on the box's cells): the same words, so the
three columns are paired. Printed per model: pointing and mass in the box of each map, chance,
and each gradient map minus attention with a 95% bootstrap interval over the test images (the
attention comparison's statistics, ``studies.attention.stats``), then the maps ranked by
pointing. ``--timing N``: the time per image to caption N images with and without each
``explain`` kind (batches of 16, median of 3 rounds, interleaved).

``--coco DIR`` (a COCO folder in the published layout, with its instances files; ``--karpathy
FILE --split S`` as ``captioner evaluate`` takes them) scores the three maps of each model on
COCO's instance boxes instead, by ``captioner evaluate``'s grounding
(``captioner.evaluation.coco_grounding.coco_pointing``: each word naming a category among the
image's instances), the same words for each map.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from captioner.data.coco import instance_files, load_instances, load_split
from captioner.evaluation.coco_grounding import coco_pointing
from captioner.evaluation.grounding import evaluate_caption, load_shape_objects
from captioner.explain import KINDS
from captioner.inference import Captioner, DecodeOptions
from studies.attention.stats import bootstrap_weights, paired_difference

MAPS = ("attention", *KINDS)


def make_test_set(root: Path, images: int, seed: int) -> Path:
    folder = root / f"shapes-test{seed}-{images}"
    subprocess.run([sys.executable, "-m", "captioner.cli", "shapes", "--out", str(folder), "--train", "0",
                    "--val", "0", "--test", str(images), "--seed", str(seed)], check=True,
                   stdout=subprocess.DEVNULL)
    return folder


def _columns(cap: Captioner, records: list, beam_size: int, points) -> dict[str, dict[str, list]]:
    """Per map, per-image columns: pt_hit, pt_n, pt_mass, pt_chance (the pointing game's sums).
    ``points(record, words, maps)``: the pointing records of one caption's words on one map."""
    cols = {m: {k: [] for k in ("pt_hit", "pt_n", "pt_mass", "pt_chance")} for m in MAPS}
    options = DecodeOptions(beam_size=beam_size)
    for start in range(0, len(records), 32):
        chunk = records[start:start + 32]
        results = cap.caption_images([r.path for r in chunk], options, explain=KINDS)
        for rec, res in zip(chunk, results):
            for m in MAPS:
                maps = res.alphas if m == "attention" else res.gradients[m]
                scored = [p for p in points(rec, res.words, maps) if p.seen]
                c = cols[m]
                c["pt_hit"].append(sum(p.hit for p in scored))
                c["pt_n"].append(len(scored))
                c["pt_mass"].append(sum(p.mass for p in scored))
                c["pt_chance"].append(sum(p.chance for p in scored))
    return cols


def columns(cap: Captioner, folder: Path, images: int, beam_size: int) -> dict[str, dict[str, list]]:
    """``_columns`` on a shapes test set, by the shapes' pointing game."""
    objects = load_shape_objects(folder / "instances_test.json")

    def points(rec, words, maps):
        image = objects[rec.image_id]
        return evaluate_caption(words, maps, image, cap.preprocess.crop_box(image.size))[0]

    return _columns(cap, load_split(folder, "test")[:images], beam_size, points)


def coco_columns(cap: Captioner, folder: Path, split: str, karpathy: Path | None, images: int,
                 beam_size: int) -> dict[str, dict[str, list]]:
    """``_columns`` on a COCO split's instance boxes (``captioner evaluate``'s grounding)."""
    records = load_split(folder, split, karpathy)[:images]
    objects = load_instances(instance_files(folder, split), {r.image_id for r in records})

    def points(rec, words, maps):
        image = objects.get(rec.image_id)
        if image is None:
            return []
        return coco_pointing(words, maps, image, cap.preprocess.crop_box((image.width, image.height)))

    return _columns(cap, records, beam_size, points)


def report(name: str, cols: dict[str, dict[str, list]], resamples: int, seed: int) -> None:
    n_images = len(cols["attention"]["pt_n"])
    words = int(sum(cols["attention"]["pt_n"]))
    weights = bootstrap_weights(n_images, resamples, seed)
    print(f"\n{name}: {n_images} images, {words} words scored (the same words for each map)")
    print(f"  {'map':<10} {'pointing':>9} {'mass in box':>12}   minus attention: pointing [95%], mass [95%]")
    figures = {}
    for m in MAPS:
        c = {k: np.asarray(v, dtype=float) for k, v in cols[m].items()}
        n = max(c["pt_n"].sum(), 1)
        figures[m] = (c["pt_hit"].sum() / n, c["pt_mass"].sum() / n)
        line = f"  {m:<10} {figures[m][0]:>9.3f} {figures[m][1]:>12.3f}"
        if m != "attention":
            d = paired_difference(cols[m], cols["attention"], weights)
            p, s = d["pointing"], d["mass_in_box"]
            line += (f"   {p['diff']:+.3f} [{p['lo']:+.3f}, {p['hi']:+.3f}], "
                     f"{s['diff']:+.3f} [{s['lo']:+.3f}, {s['hi']:+.3f}]")
        print(line)
    chance = np.sum(cols["attention"]["pt_chance"]) / max(words, 1)
    print(f"  {'chance':<10} {chance:>9.3f} {chance:>12.3f}")
    ranked = sorted(MAPS, key=lambda m: -figures[m][0])
    print("  ranked by pointing: " + " > ".join(f"{m} ({figures[m][0]:.3f})" for m in ranked))


def timing(cap: Captioner, folder: Path, images: int, rounds: int = 3) -> None:
    """Time per image with and without each explain kind, interleaved rounds, batches of 16."""
    paths = [r.path for r in load_split(folder, "test")[:images]]
    spent: dict[str | None, list[float]] = {None: [], **{k: [] for k in KINDS}}
    cap.caption_images(paths[:4])  # warm-up
    for _ in range(rounds):
        for kind in spent:
            t0 = time.perf_counter()
            for start in range(0, len(paths), 16):
                cap.caption_images(paths[start:start + 16], DecodeOptions(beam_size=3), explain=kind)
            spent[kind].append((time.perf_counter() - t0) / len(paths))
    plain = statistics.median(spent[None])
    print(f"  time per image (batches of 16, beam 3, {torch.get_num_threads()} threads, median of {rounds}): "
          f"plain {plain * 1000:.1f} ms; " + "; ".join(
              f"--explain {k} {statistics.median(spent[k]) * 1000:.1f} ms "
              f"({statistics.median(spent[k]) / plain:.2f}x)" for k in KINDS))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", nargs="+", default=["demo-soft", "demo-hard", "demo-zh"])
    p.add_argument("--images", type=int, default=500)
    p.add_argument("--seed", type=int, default=7, help="the test set's seed (default 7)")
    p.add_argument("--beam-size", type=int, default=3)
    p.add_argument("--resamples", type=int, default=2000)
    p.add_argument("--timing", type=int, default=0, metavar="N", help="time N images with and without --explain")
    p.add_argument("--coco", type=Path, default=None, metavar="DIR",
                   help="score on this COCO folder's instance boxes instead of fresh shapes")
    p.add_argument("--karpathy", type=Path, default=None, help="with --coco: Karpathy's split file")
    p.add_argument("--split", default="test", help="with --coco: the split (default test)")
    args = p.parse_args(argv)
    if args.coco is not None:
        print(f"COCO instance boxes: {args.coco}, split {args.split}; beam {args.beam_size}")
        for w in args.weights:
            cap = Captioner.load(w, device="cpu")
            cols = coco_columns(cap, args.coco, args.split, args.karpathy, args.images, args.beam_size)
            report(w, cols, args.resamples, args.seed)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_test_set(Path(tmp), args.images, args.seed)
        print(f"fresh shapes test set: {args.images} images, seed {args.seed}; beam {args.beam_size}")
        for w in args.weights:
            cap = Captioner.load(w, device="cpu")
            report(w, columns(cap, folder, args.images, args.beam_size), args.resamples, args.seed)
            if args.timing:
                timing(cap, folder, min(args.timing, args.images))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
