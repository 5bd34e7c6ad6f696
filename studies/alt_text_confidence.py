"""Which confidence keeps a wrong caption out of alt text, at what cost: docs/alt-text.md's table.

    python -m studies.alt_text_confidence [--weights demo-soft demo-hard] [--images 1000] [--seed 27182]

A fresh shapes test set (``captioner shapes --train 0 --val 0 --test N --seed S``, a seed the
demos were not trained on) is captioned as ``captioner alt-text`` captions (beam 3, the model's
length limit, the budget of 125 characters). A caption is right when it names every object of
the image, in colour and shape, and nothing else, any size it gives is right, and every
relation it states ("above", "to the left of") stands (``captioner.evaluation.grounding``); it
is wrong otherwise.

Three confidences of a caption are compared, each from the probabilities the search reports:

- ``sequence_p``: the caption's probability, exp(score) = the product of its words'
  probabilities and its <end>'s (what ``captioner alt-text --min-confidence`` compares);
- ``mean_word_p``: the geometric mean of those probabilities, exp(score / (words + 1));
- ``min_word_p``: the lowest of them.

For each, the thresholds that hold back 1, 2, 5, 10 and 20% of the right captions (the right
captions' quantiles), and the share of the wrong ones each stops; then, for the sequence
probability, the shares at round thresholds, from which the default is chosen. The images that
familiarity flags ``unfamiliar`` are counted too (they are held whatever their confidence).
"""

from __future__ import annotations

import argparse
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HELD_BACK = (0.01, 0.02, 0.05, 0.10, 0.20)  # shares of the right captions a threshold holds back
ROUND = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1)  # thresholds of the sequence probability


@dataclass(frozen=True)
class Scored:
    """One image's caption: right or wrong, its three confidences, and whether it was unfamiliar."""

    right: bool
    sequence_p: float
    mean_word_p: float
    min_word_p: float
    unfamiliar: bool = False


MEASURES = ("sequence_p", "mean_word_p", "min_word_p")


def confidences(result) -> dict[str, float]:
    """The three confidences of a ``CaptionResult``, from its word and <end> probabilities."""
    from captioner.alttext.decide import confidence

    probs = [*result.word_probs, *([result.end_prob] if result.end_prob is not None else [])]
    return {"sequence_p": confidence(result.score),
            "mean_word_p": math.exp(result.score / max(len(probs), 1)),
            "min_word_p": min(probs, default=0.0)}


def is_right(words, objects) -> bool:
    """Every object named, nothing else, sizes given right, every stated relation standing."""
    from captioner.evaluation.grounding import object_accuracy, relation_accuracy

    named = object_accuracy(words, objects)
    relations = relation_accuracy(words, objects)
    return named.exact_full and relations.relations_true == relations.n_relations


def score_model(weights: str, folder: Path, images: int) -> list[Scored]:
    """Each of the first ``images`` test images of ``folder``, captioned by ``weights`` as alt-text does."""
    import torch

    from captioner.alttext.decide import MAX_CHARS
    from captioner.data.coco import load_split
    from captioner.evaluation.evaluate import decode_records
    from captioner.evaluation.grounding import load_shape_objects
    from captioner.inference import Captioner, DecodeOptions

    cap = Captioner.load(weights)
    records = load_split(folder, "test")[:images]
    objects = load_shape_objects(folder / "instances_test.json")
    with torch.inference_mode():
        options = DecodeOptions(beam_size=3, max_len=cap.max_len, max_chars=MAX_CHARS)
        results = decode_records(cap, records, options, batch_size=64)
    return [Scored(is_right(res.words, objects[rec.image_id].objects), **confidences(res),
                   unfamiliar=bool(res.familiarity is not None and res.familiarity.unfamiliar))
            for rec, res in zip(records, results)]


def by_held_back(scored: list[Scored], measure: str) -> list[tuple[float, float, float]]:
    """(share of right held back, threshold, share of wrong stopped) at each of HELD_BACK: the
    threshold is the right captions' quantile, a caption is held when its confidence is below it."""
    right = np.array([getattr(s, measure) for s in scored if s.right])
    wrong = np.array([getattr(s, measure) for s in scored if not s.right])
    rows = []
    for share in HELD_BACK:
        threshold = float(np.quantile(right, share))
        rows.append((float((right < threshold).mean()), threshold, float((wrong < threshold).mean())))
    return rows


def at_threshold(scored: list[Scored], threshold: float, measure: str = "sequence_p",
                 unfamiliar: bool = False) -> tuple[float, float]:
    """(share of wrong captions stopped, share of right ones held back) by ``measure`` < ``threshold``,
    and with ``unfamiliar`` by the image being flagged unfamiliar too (alt-text's whole rule)."""
    def held(s: Scored) -> bool:
        return getattr(s, measure) < threshold or (unfamiliar and s.unfamiliar)

    right = np.array([held(s) for s in scored if s.right])
    wrong = np.array([held(s) for s in scored if not s.right])
    return float(wrong.mean()), float(right.mean())


def report(name: str, scored: list[Scored]) -> str:
    """The tables of one model, in Markdown."""
    wrong = sum(not s.right for s in scored)
    flagged = sum(s.unfamiliar for s in scored)
    lines = [f"### {name}: {len(scored)} images, {wrong} captions wrong ({wrong / len(scored):.1%}), "
             f"{flagged} flagged unfamiliar", "",
             "| right held back | " + " | ".join(f"{m}: threshold, wrong stopped" for m in MEASURES) + " |",
             "| --- |" + " --- |" * len(MEASURES)]
    columns = [by_held_back(scored, m) for m in MEASURES]
    for i, share in enumerate(HELD_BACK):
        cells = [f"{t:.3g}, {stopped:.0%}" for _, t, stopped in (c[i] for c in columns)]
        lines.append(f"| {share:.0%} | " + " | ".join(cells) + " |")
    lines += ["", "| --min-confidence (sequence_p) | wrong stopped | right held back | with unfamiliar: wrong "
              "stopped | right held back |", "| --- | --- | --- | --- | --- |"]
    for threshold in ROUND:
        alone, whole = at_threshold(scored, threshold), at_threshold(scored, threshold, unfamiliar=True)
        lines.append(f"| {threshold:g} | {alone[0]:.0%} | {alone[1]:.1%} | {whole[0]:.0%} | {whole[1]:.1%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m studies.alt_text_confidence", description=__doc__.split("\n")[0])
    p.add_argument("--weights", nargs="+", default=["demo-soft", "demo-hard"], help="models (default both demos)")
    p.add_argument("--images", type=int, default=1000, help="fresh shapes test images (default 1000)")
    p.add_argument("--seed", type=int, default=27182, help="their seed (default 27182, not a demo's)")
    args = p.parse_args(argv)
    from captioner.data.shapes import generate_dataset

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "shapes"
        generate_dataset(folder, {"test": args.images}, seed=args.seed)
        for weights in args.weights:
            print(report(weights, score_model(weights, folder, args.images)), end="\n\n", flush=True)


if __name__ == "__main__":
    main()
