"""Self-critical training: the CIDEr-D reward against pycocoevalcap's, the samples and
their probabilities, the baselines, learning on a fixed batch, and the training loop's
SCST phase (resume, the training split's document frequencies, offline end to end)."""

from __future__ import annotations

import pytest
import torch
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.cider.cider_scorer import CiderScorer

from captioner.cider import CiderD, cider_d
from captioner.metrics import _prepare
from captioner.vocab import tokenize

# A corpus of six images' references: words in every image ("a"), in one image only, and
# repeated; punctuation and capitals that the tokenizer must remove.
CORPUS = [
    ["A red square on a table.", "a red box", "red square"],
    ["A green circle.", "a green ball on grass"],
    ["a blue square", "the blue box is small", "blue"],
    ["A yellow star in the sky.", "a yellow star"],
    ["a purple circle", "purple ball on a table"],
    ["a cyan square and a red circle", "two shapes", "a red circle and a cyan square, side by side"],
]
# (image, candidate): exact matches, partial matches, repeats (clipping), long and short
# captions (the length penalty), words the corpus never saw, an empty caption.
CASES = [
    (0, "a red square on a table"),
    (0, "red square"),
    (0, "red red red red red square"),
    (0, "a red square on a table on a table on a table with a red box"),
    (1, "a green ball"),
    (1, "A green circle on grass."),
    (2, "blue"),
    (2, "a zebra eats grass"),
    (3, "a yellow star in the sky"),
    (4, "a purple ball"),
    (5, "a red circle and a cyan square"),
    (5, "two shapes side by side"),
    (5, ""),
]


def _pycocoevalcap_score(image: int, candidate: str) -> float:
    """pycocoevalcap's CiderScorer over the whole corpus (its document frequencies), the
    candidate on ``image``, every other image's candidate a dummy; the score of ``image``."""
    scorer = CiderScorer(n=4, sigma=6.0)
    for i, refs in enumerate(CORPUS):
        test = candidate if i == image else "a"
        scorer += (" ".join(tokenize(test)), [" ".join(tokenize(r)) for r in refs])
    _, scores = scorer.compute_score()
    return float(scores[image])


@pytest.mark.parametrize("image,candidate", CASES)
def test_cider_d_equals_pycocoevalcap_given_the_same_document_frequencies(image, candidate):
    cider = CiderD(CORPUS)
    ours = cider.score(candidate, cider.references(CORPUS[image]))
    assert ours == pytest.approx(_pycocoevalcap_score(image, candidate), rel=1e-9, abs=1e-12)


def test_cider_d_scores_what_the_metrics_report_as_cider():
    """The corpus form: document frequencies from the scored images' references, as the
    evaluation's pycocoevalcap Cider computes them (after the metrics' tokenisation)."""
    references = {100 + i: refs for i, refs in enumerate(CORPUS)}
    candidates = {100 + i: c for i, (_, c) in zip(range(len(CORPUS)), CASES[::2])}
    mean, per_image = cider_d(references, candidates)
    theirs_mean, theirs = Cider().compute_score(*_prepare(references, candidates))
    assert mean == pytest.approx(theirs_mean, rel=1e-9)
    assert [per_image[i] for i in sorted(references)] == pytest.approx(list(theirs), rel=1e-9)
    assert theirs_mean > 0.5  # the cases score: a real comparison, not zeros


def test_cider_d_clips_repeats_and_penalises_length():
    cider = CiderD(CORPUS)
    refs = cider.references(CORPUS[0])
    assert cider.score("red square", refs) > cider.score("red red red red red square", refs)
    assert cider.score("a red square on a table", refs) > cider.score(
        "a red square on a table on a table on a table with a red box", refs)
    assert cider.score("", refs) == 0.0
