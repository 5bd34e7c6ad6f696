"""Why a model states a spatial relation wrong: each relation its captions state between two
rightly named objects (the relation direction accuracy's, captioner/evaluation/grounding.py), decoded as
the comparison decodes (beam 3), is told by one outcome:

    right             it stands (the first object's centre above / left of the second's)
    tie               wrong, but the two centres are within --tie-px on the relation's axis
                      (one 8-px cell by default): a near tie the eye would call either way
    other-axis order  wrong, and the objects are named in the order of the other axis: "X
                      above Y" with X left of Y, "X left of Y" with X above Y. A decoder that
                      names objects left to right and then picks "above" shows here.
    other             wrong otherwise

Relations whose objects are misnamed are left out (they are naming errors). The counts per
relation kind ("above" covers "below" too, "left_of" covers "right of" and "from left to
right") show which kind a seed gets wrong.

A second table asks whether the model knows the direction when the objects come in the
reference's order: every reference caption that states a relation ("X above Y", "Y below
X", "X to the left of Y" ...; they are true by construction) is fed to the model up to
its direction word, and the choice is right when the model scores that word above its
opposite ("above" against "below", "left" against "right"). Near 1: the model knows up
from down and its decoded captions go wrong in the order it names the objects; near 0.5:
it does not know.

    python -m studies.attention relation demo-soft runs/a --data data/shapes-test7001-1000 \
        --data data/shapes-test7002-1000
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

from captioner.evaluation.grounding import ShapeObject, centre, named_pairs, parse_relations, stands

from .scoring import check_test_set, decoded_sets_arguments, decoded_test_images

OUTCOMES = ("right", "tie", "other-axis order", "other")
KINDS = ("above", "left_of")
OPPOSITE = {"above": "below", "below": "above", "left": "right", "right": "left"}


def outcomes(words: Sequence[str], objects: Sequence[ShapeObject], tie_px: float = 8.0) -> list[tuple[str, str]]:
    """(kind, outcome) of each relation the caption states between two objects of the image."""
    out = []
    for rel in parse_relations(words):
        pairs = list(named_pairs(rel, objects))
        if not pairs:
            continue
        if any(stands(rel, a, b) for a, b in pairs):
            out.append((rel.relation, "right"))
            continue
        a, b = pairs[0]
        if rel.second.shape_index < rel.first.shape_index:  # "below", "right of": b is named first
            a, b = b, a
        (ax, ay), (bx, by) = centre(a), centre(b)  # a: the object named first in the caption
        along, across = (by - ay, bx - ax) if rel.relation == "above" else (bx - ax, by - ay)
        if abs(along) < tie_px:
            out.append((rel.relation, "tie"))
        elif across > 0:  # the one named first is left of (above) the other: the other axis's order
            out.append((rel.relation, "other-axis order"))
        else:
            out.append((rel.relation, "other"))
    return out


def tally(found: Sequence[tuple[str, str]]) -> dict[str, int]:
    """Counts: each kind, each kind's right ones, and each outcome over both kinds."""
    counts: Counter[str] = Counter()
    for kind, outcome in found:
        counts[kind] += 1
        counts[outcome] += 1
        if outcome == "right":
            counts[f"{kind} right"] += 1
    return dict(counts)


def outcomes_of(cap, folder: Path, images: int, beam_size: int, tie_px: float) -> list[tuple[str, str]]:
    """outcomes() of the relations stated by the captions of the first ``images`` test images
    of ``folder``, decoded."""
    return [o for words, objects in decoded_test_images(cap, folder, images, beam_size)
            for o in outcomes(words, objects, tie_px)]


def direction_words(words: Sequence[str]) -> list[tuple[int, str]]:
    """(index, kind) of each word that sets a stated relation's direction: "above" and
    "below" (kind above), "left" and "right" followed by "of" (kind left_of); the "left" and
    "right" of "from left to right" set none."""
    out = []
    for k, w in enumerate(words):
        if w in ("above", "below"):
            out.append((k, "above"))
        elif w in ("left", "right") and words[k + 1:k + 2] == ["of"]:
            out.append((k, "left_of"))
    return out


@torch.inference_mode()
def forced_choices(cap, records) -> list[tuple[str, bool]]:
    """(kind, right) for every direction word of every reference caption of ``records``: is
    the reference's word scored above its opposite, the caption fed up to it?"""
    from captioner.data.coco import ImageDataset
    from captioner.data.vocab import tokenize

    data, v = ImageDataset(records, cap.preprocess), cap.vocab
    cap.model.eval()
    out = []
    for i, rec in enumerate(records):
        stating = [(w, found) for w in map(tokenize, rec.captions) if (found := direction_words(w))]
        if not stating:
            continue
        ann = cap.model.encode(data[i][0][None])
        for words, found in stating:
            ids = torch.tensor([v.encode(words)])
            logits = cap.model(ann, ids, torch.tensor([ids.shape[1]])).logits[0]  # row k predicts words[k]
            out += [(kind, bool(logits[k, v.index(words[k])] > logits[k, v.index(OPPOSITE[words[k]])]))
                    for k, kind in found]
    return out


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("relation", help="why the relations a model states are wrong",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    decoded_sets_arguments(p)
    p.add_argument("--tie-px", type=float, default=8.0,
                   help="centres closer than this on the relation's axis make a wrong relation a tie")
    p.set_defaults(func=cmd_relations)


def cmd_relations(args: argparse.Namespace) -> int:
    from captioner.data.coco import load_split

    from .checkpoints import load_weights

    forced = []
    for folder in args.data:
        check_test_set(folder, args.images)
    print("| weights | stated | accuracy | above: right / stated | left_of: right / stated | "
          + " | ".join(o for o in OUTCOMES[1:]) + " |\n" + "|---" * (5 + len(OUTCOMES) - 1) + "|")
    for w in args.weights:
        cap = load_weights(w)
        c = tally([o for folder in args.data for o in outcomes_of(cap, folder, args.images, args.beam_size,
                                                                   args.tie_px)])
        stated = c.get("above", 0) + c.get("left_of", 0)
        accuracy = f"{c.get('right', 0) / stated:.3f}" if stated else "n/a"
        kinds = " | ".join(f"{c.get(f'{k} right', 0)} / {c.get(k, 0)}" for k in KINDS)
        print(f"| {w} | {stated} | {accuracy} | {kinds} | " + " | ".join(str(c.get(o, 0)) for o in OUTCOMES[1:])
              + " |")
        forced.append((w, [f for folder in args.data
                           for f in forced_choices(cap, load_split(folder, "test")[:args.images])]))
    print("\nThe reference captions fed up to their direction word: the reference's word scored above its opposite\n")
    print("| weights | above/below: right / captions | left/right: right / captions |\n|---|---|---|")
    for w, found in forced:
        cells = [f"{sum(r for k, r in found if k == kind)} / {sum(k == kind for k, _ in found)}" for kind in KINDS]
        print(f"| {w} | " + " | ".join(cells) + " |")
    return 0
