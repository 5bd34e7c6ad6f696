"""Attention grounding on COCO's instance annotations: does the model look at the objects
it names?

For every generated word that names a COCO category present among the image's instances
(the words read as CHAIR reads them, :mod:`captioner.evaluation.chair`, with the synonym list's
defects corrected: "bus" is a bus here), the map of the step that emitted it is scored
against all of that category's instances, by the shapes' pointing game
(:func:`captioner.evaluation.grounding.point`, the same code): a hit when the map's strongest cell has
its centre inside one of the instances (in its box, and on its mask where the file gives
one), and the attention mass on such cells. A two-word name ("hot dog", "baby elephant")
is scored at its last word, when the whole name has been said. Words naming an object that
only the reference captions name have no region to score and are left out; words whose
instances all lie outside the centre crop the model saw are counted apart (``unseen``).

The chance levels are those of a uniformly random cell and of a uniform map: the share
of cells inside the instances.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from captioner.data.coco import ImageInstances
from captioner.evaluation.chair import object_words
from captioner.evaluation.grounding import Crop, PointingRecord, Region, point, word_maps


def coco_pointing(words: Sequence[str], alphas: Any, image: ImageInstances,
                  crop: Crop | None = None) -> list[PointingRecord]:
    """One record per word naming a category among ``image``'s instances (``kind``: the
    category). ``alphas``: (T, H, W), T >= len(words); ``crop`` as in the shapes'
    pointing game (None: the grid covers the whole image)."""
    maps = word_maps(alphas, len(words))
    reader = object_words(corrected=True)
    by_category: dict[str, list] = {}
    for inst in image.instances:
        by_category.setdefault(reader.category(inst.category), []).append(inst)
    regions: dict[str, list[Region]] = {}  # masks decoded once per image, for the categories named
    records = []
    for mention in reader.mentions(words):
        instances = by_category.get(mention.category)
        if not instances:
            continue
        if mention.category not in regions:
            regions[mention.category] = [Region(i.bbox, image.mask(i)) for i in instances]
        records.append(point(maps[mention.last], regions[mention.category], image.size, crop,
                             mention.last, mention.words, mention.category))
    return records


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if len(values) else None


@dataclass(frozen=True)
class CategoryPointing:
    """One category's scored words: how many, the share of hits, the mean mass inside its
    instances and the mean chance level (share of cells inside)."""

    n_words: int
    pointing_accuracy: float
    alpha_mass: float
    chance: float


@dataclass(frozen=True)
class CocoGroundingSummary:
    """A split's COCO grounding, micro-averaged over scored words; None over none."""

    n_images: int
    n_words: int
    n_words_unseen: int
    pointing_accuracy: float | None
    pointing_chance: float | None
    pointing_accuracy_touch: float | None
    alpha_mass: float | None
    alpha_mass_chance: float | None
    per_category: dict[str, CategoryPointing]

    def to_dict(self) -> dict:
        return asdict(self)


def summarize_coco_grounding(records_per_image: Sequence[Sequence[PointingRecord]]) -> CocoGroundingSummary:
    every = [r for per_image in records_per_image for r in per_image]
    records = [r for r in every if r.seen]
    per_category = {}
    for category in sorted({r.kind for r in records}):
        mine = [r for r in records if r.kind == category]
        per_category[category] = CategoryPointing(len(mine), _mean([float(r.hit) for r in mine]),
                                                  _mean([r.mass for r in mine]), _mean([r.chance for r in mine]))
    chance = _mean([r.chance for r in records])
    return CocoGroundingSummary(
        n_images=len(records_per_image), n_words=len(records), n_words_unseen=len(every) - len(records),
        pointing_accuracy=_mean([float(r.hit) for r in records]), pointing_chance=chance,
        pointing_accuracy_touch=_mean([float(r.hit_touch) for r in records]),
        alpha_mass=_mean([r.mass for r in records]), alpha_mass_chance=chance, per_category=per_category)
