"""Where a model looks when it names an object and its map misses it: on the same reference
words as the attention comparison (each test image's first reference caption fed to the
model; its colour and shape words that name an object uniquely present), every word is
told by the cell its map peaks on:

    hit         inside the named object's box (the strict pointing game)
    edge        a cell whose area overlaps that box, its centre outside
    previous    inside the box of the object the caption named just before
    next        inside the box of the object the caption names just after
    other       inside another object's box
    background  on no object

A seed that points badly because it looks one object ahead (or behind) shows a large
"next" (or "previous"); one whose maps wander, a large "background".

    python -m studies.attention misses runs/a/last.pt runs/b/last.pt --data data/shapes-test7001-1000
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from captioner.evaluation.grounding import ShapeObject, cells_inside, load_shape_objects, parse_mentions, pointing_game

from .scoring import check_test_set, test_set_arguments

PLACES = ("hit", "edge", "previous", "next", "other", "background")


def classify(words: Sequence[str], maps: np.ndarray, objects: Sequence[ShapeObject],
             image_size: tuple[int, int]) -> list[str]:
    """One place (PLACES) per word the pointing game scores, in caption order. ``maps``:
    (T, H, W), step t the map used for words[t]."""
    grid = (maps.shape[1], maps.shape[2])
    mentions = parse_mentions(words)
    owner: dict[int, ShapeObject] = {}  # mention -> the one object it names, where unique
    for k, m in enumerate(mentions):
        fits = [o for o in objects if o.shape == m.shape and o.color == m.color]
        if len(fits) == 1:
            owner[k] = fits[0]
    mention_of = {i: k for k, m in enumerate(mentions) for i in (m.shape_index, m.color_index) if i is not None}
    places = []
    for rec in pointing_game(words, maps, objects, image_size):
        cell = np.unravel_index(int(np.argmax(maps[rec.step])), grid)

        def on(obj: ShapeObject | None) -> bool:
            return obj is not None and bool(cells_inside(obj.bbox, grid, image_size)[cell])

        k = mention_of.get(rec.step)
        if rec.hit:
            places.append("hit")
        elif rec.hit_touch:
            places.append("edge")
        elif k is not None and on(owner.get(k - 1)):
            places.append("previous")
        elif k is not None and on(owner.get(k + 1)):
            places.append("next")
        elif any(on(o) for o in objects):
            places.append("other")
        else:
            places.append("background")
    return places


def shares(places: Sequence[str]) -> dict[str, float]:
    """The share of the scored words at each place."""
    if not places:
        raise ValueError("no scored words: the captions name no object uniquely present")
    return {p: sum(x == p for x in places) / len(places) for p in PLACES}


@torch.inference_mode()
def places_of(cap, folder: Path, images: int) -> list[str]:
    from captioner.data.coco import load_split

    from .forced import forced_maps

    records = load_split(folder, "test")[:images]
    objects = load_shape_objects(folder / "instances_test.json")
    cap.model.eval()
    out = []
    for rec, (words, maps) in zip(records, forced_maps(cap, records)):
        img = objects[rec.image_id]
        out += classify(words, maps, img.objects, img.size)
    return out


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("misses", help="where the maps of words that miss their object look",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    test_set_arguments(p)
    p.set_defaults(func=cmd_misses)


def cmd_misses(args: argparse.Namespace) -> int:
    from .checkpoints import load_weights

    check_test_set(args.data, args.images)
    print("| weights | " + " | ".join(PLACES) + " | words |\n" + "|---" * (len(PLACES) + 2) + "|")
    for w in args.weights:
        places = places_of(load_weights(w), args.data, args.images)
        share = shares(places)
        print(f"| {w} | " + " | ".join(f"{share[p]:.3f}" for p in PLACES) + f" | {len(places):,} |")
    return 0
