"""What a model names wrong: each caption that does not name exactly the image's objects
(object accuracy's test, captioner/evaluation/grounding.py: the multiset of (colour, shape) mentions
against the objects'), decoded as the comparison decodes (beam 3), is told by one kind:

    count             as many mentions as objects it is not: an object left out or one too many
    repeated shape    the colours are right, and a shape the image has is said more often
                      than the image has it: "a yellow cross and a yellow cross" for a cross
                      and a triangle. A decoder that says again a shape it has already said
                      shows here.
    other shape       the colours are right, the shapes wrong otherwise (a shape the image lacks)
    colour            the shapes are right, the colours wrong
    colour and shape  both wrong
    pairing           the colours and the shapes each right, paired wrong ("a blue circle and
                      a red square" for a red circle and a blue square)

    python -m studies.attention naming demo-soft runs/a --data data/shapes-test7001-1000 \\
        --data data/shapes-test7002-1000
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from captioner.evaluation.grounding import ShapeObject, object_accuracy, parse_mentions

from .scoring import check_test_set, decoded_sets_arguments, decoded_test_images

KINDS = ("count", "repeated shape", "other shape", "colour", "colour and shape", "pairing")


def kind(words: Sequence[str], objects: Sequence[ShapeObject]) -> str | None:
    """The kind of naming error of one caption; None when it names the objects right."""
    if object_accuracy(words, objects).exact_color_shape:
        return None
    mentions = parse_mentions(words)
    if len(mentions) != len(objects):
        return "count"
    said_shapes, true_shapes = Counter(m.shape for m in mentions), Counter(o.shape for o in objects)
    colours_right = Counter(m.color for m in mentions) == Counter(o.color for o in objects)
    if said_shapes == true_shapes:
        return "pairing" if colours_right else "colour"
    if not colours_right:
        return "colour and shape"
    repeated = any(n > true_shapes[s] > 0 for s, n in said_shapes.items())
    return "repeated shape" if repeated else "other shape"


def kinds_of(cap, folder: Path, images: int, beam_size: int) -> list[str | None]:
    """kind() of each of the first ``images`` test images of ``folder``, decoded."""
    return [kind(words, objects) for words, objects in decoded_test_images(cap, folder, images, beam_size)]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("naming", help="what kinds of naming errors a model makes",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    decoded_sets_arguments(p)
    p.set_defaults(func=cmd_naming)


def cmd_naming(args: argparse.Namespace) -> int:
    from .checkpoints import load_weights

    for folder in args.data:
        check_test_set(folder, args.images)
    print("| weights | images | wrong | " + " | ".join(KINDS) + " |\n" + "|---" * (3 + len(KINDS)) + "|")
    for w in args.weights:
        cap = load_weights(w)
        found = [k for folder in args.data for k in kinds_of(cap, folder, args.images, args.beam_size)]
        counts = Counter(k for k in found if k is not None)
        print(f"| {w} | {len(found)} | {sum(counts.values())} | " + " | ".join(str(counts[k]) for k in KINDS) + " |")
    return 0
