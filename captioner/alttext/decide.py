"""Which captions become alt text, and which are held for a person: never a guess.

A caption is held, with its reason, when the image is unlike the model's training images
(``familiarity`` below ``--unfamiliar-below``: flagged ``unfamiliar``), when its confidence is
below ``--min-confidence``, or when there is none: no caption fits the character budget (which
the search keeps, ``DecodeOptions.max_chars``: a caption is never cut), or the model ended none.

The confidence is the caption's probability under the model, exp(score): the product of its
words' probabilities and its <end>'s. Of the three measures compared on fresh shapes images
(this one, the geometric mean of those probabilities, and the lowest of them) it stops the most
wrong captions for the right ones it holds back (docs/alt-text.md has the table and its command).

Plain Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The default of --min-confidence: docs/alt-text.md's table.
MIN_CONFIDENCE = 0.05
# The default of --max-chars: the length most alt-text guides ask captions to stay within.
MAX_CHARS = 125


def confidence(score: float) -> float:
    """A caption's confidence: its probability, from its score (the log-probability)."""
    return math.exp(score)


@dataclass(frozen=True)
class Caption:
    """What alt text is made from: a caption as the model gave it. ``familiarity`` None: the
    model keeps no record of its training images, so nothing is known of it. ``no_fit``: why
    there is no caption when none fits the budget (``text`` is then empty)."""

    text: str
    score: float
    familiarity: float | None
    words: int
    no_fit: str | None = None

    @classmethod
    def of(cls, result) -> "Caption":
        """The caption of a ``CaptionResult``."""
        known, missed = result.familiarity, result.no_fit
        no_fit = None if missed is None else missed.reason  # as `captioner caption` says it
        score = result.score if result.words else 0.0  # no caption: -inf, which JSON cannot hold
        return cls(result.caption if result.words else "", score, None if known is None else known.value,
                   len(result.words), no_fit)

    def to_json(self) -> dict:
        return {"text": self.text, "score": self.score, "familiarity": self.familiarity, "words": self.words,
                "no_fit": self.no_fit}

    @classmethod
    def from_json(cls, d: dict) -> "Caption":
        return cls(str(d["text"]), float(d["score"]), None if d["familiarity"] is None else float(d["familiarity"]),
                   int(d["words"]), None if d.get("no_fit") is None else str(d["no_fit"]))


@dataclass(frozen=True)
class Rules:
    """What a caption must pass to be written."""

    min_confidence: float = MIN_CONFIDENCE
    unfamiliar_below: float = 0.01


def held_because(caption: Caption, rules: Rules) -> str | None:
    """Why ``caption`` is not written as alt text, in words for the person who will write it;
    None: it is written."""
    if caption.words == 0 or not caption.text.strip():
        return caption.no_fit or "the model gave no caption"
    if caption.familiarity is not None and caption.familiarity < rules.unfamiliar_below:
        return (f"unfamiliar: unlike the model's training images (familiarity {caption.familiarity:.3g} < "
                f"{rules.unfamiliar_below:g})")
    p = confidence(caption.score)
    if p < rules.min_confidence:
        return f"confidence {p:.3g} below --min-confidence {rules.min_confidence:g}"
    return None
