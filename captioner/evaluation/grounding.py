"""Grounded quality measures on the synthetic shapes dataset.

Two questions, both answerable only because the shapes images come with exact objects:

* Object accuracy: does the caption name exactly the objects in the image? Mentions
  ("[size] colour shape") are parsed from the words and matched against the objects.
* Relation direction accuracy: of the spatial relations a caption states ("X above Y",
  "X below Y", "X to the left / right of Y", "from left to right: A, B and C") whose two
  mentions both name an object of the image, how many stand as stated (the objects'
  centres)? There a random direction is right half the time: chance 0.5. Relations with
  a misnamed object are counted apart: they are naming errors, not direction errors.
* Pointing game: when the model emits a word that names an object uniquely present in
  the image (its shape word or its colour word), does the argmax of that step's attention
  map fall inside the object's box? We also report the attention mass inside the box
  (strictly, and on the cells that touch it), the chance level of both (what a uniformly
  random cell / a uniform map scores), and the entropy of the maps on those words.

The attention grid covers the region of the image the model saw: the whole image when
it is resized (``Preprocess.resize = 0``), the centre crop otherwise (``crop``, as
``Preprocess.crop_box`` gives it, (left, top, right, bottom) in the image's pixels). Cell
(r, c) of an H x W grid covers x in [left + c*(right-left)/W, left + (c+1)*(right-left)/W)
and y likewise; a cell is "inside" a box when its centre is. A word whose object lies
wholly outside the crop is not scored (the model could not see it): it is counted apart.

Pure functions over words, arrays and objects: no model, no torch import.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from captioner.data.shapes import COLORS, SHAPES, SIZES, english_words

_SHAPES = frozenset(SHAPES)
_COLORS = frozenset(COLORS)
_SIZES = frozenset(SIZES)


@dataclass(frozen=True)
class Mention:
    """One shape word in a caption with the colour (and size) words attached to it."""

    shape: str
    color: str | None
    size: str | None
    shape_index: int
    color_index: int | None
    size_index: int | None = None


@dataclass(frozen=True)
class ShapeObject:
    shape: str
    color: str
    size: str
    bbox: tuple[float, float, float, float]  # x, y, w, h in pixels


@dataclass(frozen=True)
class ImageObjects:
    """The objects of one image and the image's size, as read from instances JSON."""

    image_id: int
    file_name: str
    width: int
    height: int
    objects: list[ShapeObject]

    @property
    def size(self) -> tuple[int, int]:
        return self.width, self.height


@dataclass(frozen=True)
class PointingRecord:
    step: int  # index of the word in the caption (= attention step)
    word: str
    kind: str  # "shape" or "color"
    hit: bool  # the argmax cell's centre lies inside the object's box
    mass: float  # attention mass on cells whose centre lies inside the box
    chance: float  # fraction of cells whose centre lies inside the box
    hit_touch: bool = False  # the argmax cell's own area overlaps the box (the lenient reading)
    chance_touch: float = 0.0  # fraction of cells whose area overlaps the box
    mass_touch: float = 0.0  # attention mass on cells whose area overlaps the box
    entropy: float = 0.0  # of this step's map, nats: how sharply the model looks when it names
    seen: bool = True  # False: the object's box lies wholly outside the crop; not scored, counted apart


# ------------------------------------------------------------------------- mentions

def parse_mentions(words: Sequence[str]) -> list[Mention]:
    """Mentions in a tokenised caption (see ``captioner.data.vocab.tokenize``).

    A mention is a shape word. Its colour is the colour word right before it, or the one
    before that when a size word sits in between ("red large circle"); its size is the
    size word right before the colour ("large red circle", the generator's order) or
    right before the shape. A shape word with no colour gives a mention with colour None.
    """
    mentions = []
    for i, w in enumerate(words):
        if w not in _SHAPES:
            continue
        color_i = size_i = None
        j = i - 1
        if j >= 0 and words[j] in _SIZES:  # "red large circle" / "large circle"
            size_i, j = j, j - 1
        if j >= 0 and words[j] in _COLORS:
            color_i, j = j, j - 1
            if size_i is None and j >= 0 and words[j] in _SIZES:  # "large red circle"
                size_i = j
        mentions.append(Mention(
            shape=w,
            color=words[color_i] if color_i is not None else None,
            size=words[size_i] if size_i is not None else None,
            shape_index=i, color_index=color_i, size_index=size_i,
        ))
    return mentions


# -------------------------------------------------------------------------- loading

def load_shape_objects(instances_json: Path) -> dict[int, ImageObjects]:
    """Objects per image id from a shapes ``instances_<split>.json``.

    Images without objects are included with an empty list, so that every image of the
    split can be evaluated.
    """
    data = json.loads(Path(instances_json).read_text(encoding="utf-8"))
    categories = {c["id"]: c["name"] for c in data["categories"]}
    per_image: dict[int, list[ShapeObject]] = {img["id"]: [] for img in data["images"]}
    for ann in data["annotations"]:
        attrs = ann.get("attributes", {})
        per_image[ann["image_id"]].append(ShapeObject(
            shape=categories[ann["category_id"]], color=attrs["color"], size=attrs["size"],
            bbox=tuple(float(v) for v in ann["bbox"]),
        ))
    return {
        img["id"]: ImageObjects(img["id"], img["file_name"], int(img["width"]), int(img["height"]),
                                per_image[img["id"]])
        for img in data["images"]
    }


# ------------------------------------------------------------------ object accuracy

def _max_matching(mentions: Sequence[Mention], objects: Sequence[ShapeObject],
                  fits: Callable[[Mention, ShapeObject], bool]) -> int:
    """Size of a maximum one-to-one matching (augmenting paths; sets are tiny)."""
    owner: list[int | None] = [None] * len(objects)  # object -> mention matched to it

    def augment(m: int, seen: set[int]) -> bool:
        for o, obj in enumerate(objects):
            if o in seen or not fits(mentions[m], obj):
                continue
            seen.add(o)
            if owner[o] is None or augment(owner[o], seen):
                owner[o] = m
                return True
        return False

    return sum(augment(m, set()) for m in range(len(mentions)))


def _fits_color_shape(m: Mention, o: ShapeObject) -> bool:
    return m.shape == o.shape and m.color == o.color


def _fits_full(m: Mention, o: ShapeObject) -> bool:
    # A caption need not give sizes; when it does, they must be right.
    return _fits_color_shape(m, o) and (m.size is None or m.size == o.size)


@dataclass(frozen=True)
class ObjectAccuracy:
    """Does one caption name exactly the image's objects?

    ``exact_color_shape``: the multiset of (colour, shape) mentions equals the objects'.
    ``exact_full``: the same, and every size the caption gives is right.
    ``matched``/``matched_full``: mentions matched one-to-one to objects, for precision
    (matched / n_mentions) and recall (matched / n_objects).
    ``hallucinated``: mentions of a shape no object has (CHAIR's reading, the shape as the
    category); ``hallucinated_with_color``: mentions no object fits in colour and shape.
    """

    exact_color_shape: bool
    exact_full: bool
    n_mentions: int
    n_objects: int
    matched: int
    matched_full: int
    hallucinated: int = 0
    hallucinated_with_color: int = 0

    @property
    def precision(self) -> float | None:
        return self.matched / self.n_mentions if self.n_mentions else None

    @property
    def recall(self) -> float | None:
        return self.matched / self.n_objects if self.n_objects else None


def object_accuracy(words: Sequence[str], objects: Sequence[ShapeObject]) -> ObjectAccuracy:
    """Mentions parsed from ``words``, matched against ``objects`` (ObjectAccuracy)."""
    mentions = parse_mentions(words)
    matched = _max_matching(mentions, objects, _fits_color_shape)
    matched_full = _max_matching(mentions, objects, _fits_full)
    n_m, n_o = len(mentions), len(objects)
    shapes = {o.shape for o in objects}
    kinds = {(o.color, o.shape) for o in objects}
    return ObjectAccuracy(exact_color_shape=matched == n_m == n_o, exact_full=matched_full == n_m == n_o,
                          n_mentions=n_m, n_objects=n_o, matched=matched, matched_full=matched_full,
                          hallucinated=sum(m.shape not in shapes for m in mentions),
                          hallucinated_with_color=sum(m.shape not in shapes or m.color is not None
                                                      and (m.color, m.shape) not in kinds for m in mentions))


# --------------------------------------------------------------- spatial relations

RELATION_CHANCE = 0.5  # a stated direction between two rightly named objects, picked at random


@dataclass(frozen=True)
class Relation:
    """A stated relation, normalised: ``first`` is ``"left_of"`` or ``"above"`` ``second``."""

    first: Mention
    relation: str
    second: Mention


def _start(m: Mention) -> int:
    return min(i for i in (m.shape_index, m.color_index, m.size_index) if i is not None)


def parse_relations(words: Sequence[str]) -> list[Relation]:
    """Spatial relations stated in a tokenised caption.

    Between two consecutive mentions, "above"/"below" and "left"/"right" (as in "to the
    left of", "on the left of", "to the right of") relate them; a caption opening with
    "from left to right" puts each listed object left of the next, one opening with "from
    top to bottom" each above the next.
    """
    mentions = parse_mentions(words)
    if not mentions:
        return []
    head = set(words[:_start(mentions[0])])
    ordered = {"from", "left", "right"} <= head
    downward = {"from", "top", "bottom"} <= head
    relations = []
    for a, b in zip(mentions, mentions[1:]):
        between = set(words[a.shape_index + 1:_start(b)])
        if "above" in between:
            relations.append(Relation(a, "above", b))
        elif "below" in between:
            relations.append(Relation(b, "above", a))
        elif "left" in between:
            relations.append(Relation(a, "left_of", b))
        elif "right" in between:
            relations.append(Relation(b, "left_of", a))
        elif ordered:
            relations.append(Relation(a, "left_of", b))
        elif downward:
            relations.append(Relation(a, "above", b))
    return relations


def centre(o: ShapeObject) -> tuple[float, float]:
    """The centre (x, y) of the object's box, in pixels (y grows downwards)."""
    x, y, w, h = o.bbox
    return x + w / 2, y + h / 2


def named_pairs(rel: Relation, objects: Sequence[ShapeObject]):
    """(o1, o2): two distinct objects named by the relation's first and second mentions
    (colour and shape; size too where the caption gives one)."""
    for i, o1 in enumerate(objects):
        if _fits_full(rel.first, o1):
            for j, o2 in enumerate(objects):
                if i != j and _fits_full(rel.second, o2):
                    yield o1, o2


def stands(rel: Relation, o1: ShapeObject, o2: ShapeObject) -> bool:
    """``above`` is the smaller centre y, ``left_of`` the smaller centre x."""
    axis = 1 if rel.relation == "above" else 0
    return centre(o1)[axis] < centre(o2)[axis]


@dataclass(frozen=True)
class RelationAccuracy:
    """How many relations one caption states, how many of them name two objects of the
    image (distinct ones, by colour and shape, and size where the caption gives one), and
    how many of those stand as stated (a true relation is always named)."""

    n_relations: int
    n_relations_named: int
    relations_true: int


def relation_accuracy(words: Sequence[str], objects: Sequence[ShapeObject]) -> RelationAccuracy:
    """The relations ``words`` state, checked against ``objects`` (RelationAccuracy)."""
    relations = parse_relations(words)
    named = true = 0
    for rel in relations:
        pairs = list(named_pairs(rel, objects))
        named += bool(pairs)
        true += any(stands(rel, o1, o2) for o1, o2 in pairs)
    return RelationAccuracy(n_relations=len(relations), n_relations_named=named, relations_true=true)


# ------------------------------------------------------------------- pointing game

Crop = tuple[float, float, float, float]  # (left, top, right, bottom) in the image's pixels


def _view(image_size: tuple[int, int], crop: Crop | None) -> Crop:
    """The region the attention grid covers: ``crop``, or the whole image."""
    return tuple(crop) if crop is not None else (0.0, 0.0, float(image_size[0]), float(image_size[1]))


def in_view(bbox: Sequence[float], image_size: tuple[int, int], crop: Crop | None = None) -> bool:
    """Does the box overlap the region the model saw?"""
    left, top, right, bottom = _view(image_size, crop)
    x, y, bw, bh = bbox
    return x < right and x + bw > left and y < bottom and y + bh > top


def cells_inside(bbox: Sequence[float], grid: tuple[int, int], image_size: tuple[int, int],
                 crop: Crop | None = None) -> np.ndarray:
    """(H, W) bool: which grid cells have their centre inside the box. The grid covers
    ``crop`` (the whole image when None); the box is in the image's pixels."""
    h, w = grid
    left, top, right, bottom = _view(image_size, crop)
    x, y, bw, bh = bbox
    cx = left + (np.arange(w) + 0.5) * (right - left) / w
    cy = top + (np.arange(h) + 0.5) * (bottom - top) / h
    in_x = (cx >= x) & (cx < x + bw)
    in_y = (cy >= y) & (cy < y + bh)
    return in_y[:, None] & in_x[None, :]


def _cells_touching(bbox: Sequence[float], grid: tuple[int, int], image_size: tuple[int, int],
                    crop: Crop | None = None) -> np.ndarray:
    """(H, W) bool: which grid cells' areas overlap the box. A model that looks at an
    object's outline (where its shape shows) often peaks on a cell that straddles the
    edge, with its centre just outside the box: this counts it, the strict test does not."""
    h, w = grid
    view_left, view_top, view_right, view_bottom = _view(image_size, crop)
    cell_w, cell_h = (view_right - view_left) / w, (view_bottom - view_top) / h
    x, y, bw, bh = bbox
    left = view_left + np.arange(w) * cell_w
    top = view_top + np.arange(h) * cell_h
    in_x = (left < x + bw) & (left + cell_w > x)
    in_y = (top < y + bh) & (top + cell_h > y)
    return in_y[:, None] & in_x[None, :]


def _as_array(alphas: Any) -> np.ndarray:
    if hasattr(alphas, "detach"):  # a torch tensor, possibly on a GPU
        alphas = alphas.detach().float().cpu().numpy()
    return np.asarray(alphas, dtype=np.float64)


@dataclass(frozen=True)
class Region:
    """Where an object is, in the image's pixels: its box (x, y, w, h), and its mask where
    known ((height, width) bool; COCO's instances have one, the shapes none)."""

    bbox: tuple[float, float, float, float]
    mask: np.ndarray | None = None


def cells_in_regions(regions: Sequence[Region], grid: tuple[int, int], image_size: tuple[int, int],
                     crop: Crop | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(H, W) bool twice: the cells whose centre lies inside one of the regions (in its box,
    and on its mask where it has one), and the cells whose area overlaps one of the boxes."""
    inside = np.zeros(grid, dtype=bool)
    touching = np.zeros(grid, dtype=bool)
    h, w = grid
    left, top, right, bottom = _view(image_size, crop)
    for region in regions:
        cells = cells_inside(region.bbox, grid, image_size, crop)
        if region.mask is not None:
            rows, cols = region.mask.shape
            cy = np.clip(np.floor(top + (np.arange(h) + 0.5) * (bottom - top) / h).astype(int), 0, rows - 1)
            cx = np.clip(np.floor(left + (np.arange(w) + 0.5) * (right - left) / w).astype(int), 0, cols - 1)
            cells &= region.mask[np.ix_(cy, cx)].astype(bool)
        inside |= cells
        touching |= _cells_touching(region.bbox, grid, image_size, crop)
    return inside, touching


def point(word_map: np.ndarray, regions: Sequence[Region], image_size: tuple[int, int], crop: Crop | None,
          step: int, word: str, kind: str) -> PointingRecord:
    """The pointing record of one word's (H, W) map against the regions of the object(s) it
    names: the shapes' pointing game and COCO's both score here. A word none of whose
    regions reaches into the crop gets a record with ``seen`` False and nothing scored."""
    if not any(in_view(r.bbox, image_size, crop) for r in regions):
        return PointingRecord(step=step, word=word, kind=kind, hit=False, mass=0.0, chance=0.0, seen=False)
    grid = word_map.shape
    inside, touching = cells_in_regions(regions, grid, image_size, crop)
    r, c = np.unravel_index(int(np.argmax(word_map)), grid)
    positive = word_map[word_map > 0]
    return PointingRecord(
        step=step, word=word, kind=kind, hit=bool(inside[r, c]),
        mass=float(word_map[inside].sum()), chance=float(inside.mean()),
        hit_touch=bool(touching[r, c]), chance_touch=float(touching.mean()),
        mass_touch=float(word_map[touching].sum()), entropy=float(-(positive * np.log(positive)).sum()),
    )


def word_maps(alphas: Any, n_words: int) -> np.ndarray:
    """``alphas`` as a (T, H, W) float64 array with at least ``n_words`` maps, or ValueError."""
    maps = _as_array(alphas)
    if maps.ndim != 3:
        raise ValueError(f"alphas must be (T, H, W), got shape {maps.shape}")
    if maps.shape[0] < n_words:
        raise ValueError(f"{n_words} words but only {maps.shape[0]} attention maps")
    return maps


def pointing_game(words: Sequence[str], alphas: Any, objects: Sequence[ShapeObject],
                  image_size: tuple[int, int], crop: Crop | None = None) -> list[PointingRecord]:
    """One record per word that names an object uniquely present in the image.

    ``alphas``: (T, H, W) attention maps (tensor or array), T >= len(words); step t is
    the map used to emit words[t]. ``image_size``: (width, height) of the image whose
    pixels the boxes are in. ``crop``: the region the grid covers, in those pixels
    (``Preprocess.crop_box``); None: the whole image. A shape word counts when exactly one
    object has that shape, a colour word when exactly one object has that colour; others
    are skipped. A word whose object lies wholly outside the crop gets a record with
    ``seen`` False and nothing scored.
    """
    maps = word_maps(alphas, len(words))
    records = []
    for t, word in enumerate(words):
        if word in _SHAPES:
            kind, owners = "shape", [o for o in objects if o.shape == word]
        elif word in _COLORS:
            kind, owners = "color", [o for o in objects if o.color == word]
        else:
            continue
        if len(owners) != 1:  # absent, or ambiguous which object the word points to
            continue
        records.append(point(maps[t], [Region(owners[0].bbox)], image_size, crop, t, word, kind))
    return records


@dataclass(frozen=True)
class CaptionAccuracy:
    """What one caption names right: its objects and its relations."""

    objects: ObjectAccuracy
    relations: RelationAccuracy


def evaluate_caption(words: Sequence[str], alphas: Any, image: ImageObjects,
                     crop: Crop | None = None) -> tuple[list[PointingRecord], CaptionAccuracy]:
    """Pointing records, and object and relation accuracy, of one generated caption.
    ``crop``: the region of the image the attention grid covers (None: all of it). A
    Chinese caption's characters are read as English words, each with the map of the step
    of its first character (``captioner.data.shapes.english_words``). ``alphas`` None (a
    caption with no maps): no pointing records."""
    words, steps = english_words(words)
    pointing = [] if alphas is None else pointing_game(words, _as_array(alphas)[steps], image.objects, image.size, crop)
    return pointing, CaptionAccuracy(object_accuracy(words, image.objects), relation_accuracy(words, image.objects))


# -------------------------------------------------------------------- aggregation

def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if len(values) else None


@dataclass(frozen=True)
class GroundingSummary:
    """A split's grounding figures. Means over no items are None (e.g. no scorable words).

    Pointing means are over words (micro-averaged), object accuracies over images;
    precision and recall are micro-averaged over mentions and objects. Words whose object
    lay outside the crop are left out of the pointing means: ``n_words_unseen`` counts them.
    Directions are micro-averaged over the relations, in every image, whose two objects are
    named right; the others are counted apart, as naming errors. A uniform map puts exactly
    the in-box cell fraction of its mass in the box (``alpha_mass_chance``).
    ``chair_s``/``chair_i``: CHAIR on shapes (Rohrbach et al. 2018, the shape as the
    category): the share of captions naming a shape the image does not hold, and of shape
    mentions; ``*_with_color``: the same for mentions no object fits in colour and shape.
    """

    n_images: int
    object_accuracy: float | None
    object_accuracy_with_size: float | None
    object_precision: float | None
    object_recall: float | None
    relation_accuracy: float | None
    relation_chance: float
    n_relations: int
    n_relations_misnamed: int
    pointing_accuracy: float | None
    pointing_accuracy_shape: float | None
    pointing_accuracy_color: float | None
    pointing_chance: float | None
    pointing_accuracy_touch: float | None
    pointing_chance_touch: float | None
    alpha_mass_in_box: float | None
    alpha_mass_chance: float | None
    alpha_mass_touch: float | None
    alpha_entropy_named: float | None  # how sharp the maps are where it matters: on words naming an object
    n_words: int
    n_words_shape: int
    n_words_color: int
    n_words_unseen: int
    chair_s: float | None
    chair_i: float | None
    chair_s_with_color: float | None
    chair_i_with_color: float | None

    def to_dict(self) -> dict[str, float | int | None]:
        """The figures by name: the JSON of reports and logs, and the names validation metrics use."""
        return asdict(self)


def summarize_grounding(records_per_image: Sequence[Sequence[PointingRecord]],
                        accuracies_per_image: Sequence[CaptionAccuracy]) -> GroundingSummary:
    """Aggregate a split's pointing records and caption accuracies (GroundingSummary)."""
    every = [r for per_image in records_per_image for r in per_image]
    records = [r for r in every if r.seen]
    by_kind = {k: [r for r in records if r.kind == k] for k in ("shape", "color")}
    objects = [a.objects for a in accuracies_per_image]
    relations = [a.relations for a in accuracies_per_image]
    n_mentions = sum(o.n_mentions for o in objects)
    n_objects = sum(o.n_objects for o in objects)
    matched = sum(o.matched for o in objects)
    chance = _mean([r.chance for r in records])
    n_relations = sum(r.n_relations for r in relations)
    n_named = sum(r.n_relations_named for r in relations)
    return GroundingSummary(
        n_images=len(objects),
        object_accuracy=_mean([float(o.exact_color_shape) for o in objects]),
        object_accuracy_with_size=_mean([float(o.exact_full) for o in objects]),
        object_precision=matched / n_mentions if n_mentions else None,
        object_recall=matched / n_objects if n_objects else None,
        relation_accuracy=sum(r.relations_true for r in relations) / n_named if n_named else None,
        relation_chance=RELATION_CHANCE,
        n_relations=n_relations,
        n_relations_misnamed=n_relations - n_named,
        pointing_accuracy=_mean([float(r.hit) for r in records]),
        pointing_accuracy_shape=_mean([float(r.hit) for r in by_kind["shape"]]),
        pointing_accuracy_color=_mean([float(r.hit) for r in by_kind["color"]]),
        pointing_chance=chance,
        pointing_accuracy_touch=_mean([float(r.hit_touch) for r in records]),
        pointing_chance_touch=_mean([r.chance_touch for r in records]),
        alpha_mass_in_box=_mean([r.mass for r in records]),
        alpha_mass_chance=chance,
        alpha_mass_touch=_mean([r.mass_touch for r in records]),
        alpha_entropy_named=_mean([r.entropy for r in records]),
        n_words=len(records),
        n_words_shape=len(by_kind["shape"]),
        n_words_color=len(by_kind["color"]),
        n_words_unseen=len(every) - len(records),
        chair_s=_mean([float(o.hallucinated > 0) for o in objects]),
        chair_i=sum(o.hallucinated for o in objects) / n_mentions if n_mentions else None,
        chair_s_with_color=_mean([float(o.hallucinated_with_color > 0) for o in objects]),
        chair_i_with_color=sum(o.hallucinated_with_color for o in objects) / n_mentions if n_mentions else None,
    )
