"""A caption's JSON record, built here only: the line `captioner caption` writes, the app's
download and the line of the torch-free runtime (``python -m captioner.onnx``) are this one
dict, so a new field is added in one place and no reader meets two spellings of it.

Plain Python only (no torch, no numpy): the torch-free runtime imports it. The caller hands
the attention already rounded to plain lists (torch or numpy does that, each its own way).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

DIGITS = 4


def significant(p: float, digits: int = DIGITS) -> float:
    """``p`` to ``digits`` significant digits: 0.0000123456 -> 1.235e-05, never 0 unless p is."""
    return float(f"{p:.{digits}g}")


def caption_record(*, image: str | None, caption: str, words: Sequence[str], score: float,
                   familiarity: float | None, unfamiliar: bool | None, word_probs: Iterable[float],
                   end_prob: float | None, alternatives: Iterable[tuple[str, float, float | None]] = (),
                   model: str | None = None, training_data: str | None = None,
                   attention: dict[str, list] | None = None, digits: int = DIGITS) -> dict:
    """The record of one image's caption, its keys in this order:

    "image" (left out when None), "caption", "words", "score" (log p, its <end> included),
    "familiarity", "unfamiliar" (null: the model has no record of its training images),
    "word_probs", "end_prob" (the <end> token's p; null: cut off at the length limit), so
    score = sum(log word_probs) + log end_prob; "alternatives" with several captions
    (``(caption, score, rank)``, best first; "rank" only with a length penalty); "model" and
    "training_data" when known; then ``attention``'s keys ("alphas", "betas", ...).
    Scores are rounded to ``digits`` decimals, probabilities to ``digits`` significant digits.
    """
    out: dict = {} if image is None else {"image": image}
    out.update(caption=caption, words=list(words), score=round(float(score), digits),
               familiarity=None if familiarity is None else round(float(familiarity), digits),
               unfamiliar=unfamiliar,
               word_probs=[significant(p, digits) for p in word_probs],
               end_prob=None if end_prob is None else significant(end_prob, digits))
    alternatives = [{"caption": text, "score": round(float(s), digits),
                     **({} if rank is None else {"rank": round(float(rank), digits)})}
                    for text, s, rank in alternatives]
    if alternatives:
        out["alternatives"] = alternatives
    if model is not None:
        out["model"] = model
    if training_data:
        out["training_data"] = training_data
    out.update(attention or {})
    return out
