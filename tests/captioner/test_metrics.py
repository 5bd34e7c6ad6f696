"""Caption metrics on hand-checked cases."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from captioner.evaluation import metrics
from captioner.evaluation.metrics import METRIC_NAMES, caption_metrics, coco_results_json, meteor_scores

needs_java = pytest.mark.skipif(not metrics.java_available(), reason="METEOR needs java on PATH")

REFS = {
    1: ["A man rides a red bicycle.", "Someone cycling down the street."],
    2: ["Two dogs play in the snow", "dogs playing outside in winter"],
}


def child_pids() -> set[int]:
    """Live child processes of this process (Linux /proc), to catch a leaked java."""
    pids: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        pids.update(int(p) for p in (task / "children").read_text().split())
    return pids


def test_identical_captions_score_one() -> None:
    # Each candidate equals one reference (case and punctuation differ: tokenisation drops them).
    cands = {1: "a man rides a red bicycle", 2: "Two dogs play in the snow."}
    scores = caption_metrics(REFS, cands, meteor=False)
    assert list(scores) == [k for k in METRIC_NAMES if k != "METEOR"]
    assert scores["BLEU-1"] == pytest.approx(1.0)
    assert scores["BLEU-4"] == pytest.approx(1.0)
    assert scores["ROUGE-L"] == pytest.approx(1.0)
    assert scores["CIDEr"] > 1.0
    assert all(isinstance(v, float) for v in scores.values())


def test_no_shared_words_scores_zero() -> None:
    cands = {1: "purple elephants dance", 2: "green cheese melts slowly"}
    scores = caption_metrics(REFS, cands, meteor=False)
    # BLEU adds 1e-15 to the match counts, so "zero" is tiny rather than exact.
    assert scores["BLEU-1"] < 1e-9
    assert scores["BLEU-4"] < 1e-9
    assert scores["ROUGE-L"] == 0.0
    assert scores["CIDEr"] == 0.0


def test_bleu1_hand_computed_corpus_level() -> None:
    refs = {1: ["a dog runs on the green grass"], 2: ["a cat sleeps"]}
    cands = {1: "a dog on a mat", 2: "a cat sleeps"}
    # BLEU is corpus-level: clipped unigram matches and lengths are summed over images.
    # Image 1: candidate unigrams a, dog, on, a, mat (5); reference has one "a", so the
    #   second "a" is clipped: matches a, dog, on = 3.
    # Image 2: 3 of 3 match.
    # Precision p1 = (3 + 3) / (5 + 3) = 0.75.
    # Brevity penalty: candidate length c = 8, reference length r = 7 + 3 = 10 (one
    #   reference each, so the "closest" reference length is that one); c < r, so
    #   BP = exp(1 - r / c) = exp(1 - 10/8) = exp(-0.25).
    # BLEU-1 = 0.75 * exp(-0.25) = 0.58410...
    # (The mean of per-sentence BLEU-1 would differ: (0.6 * exp(-0.4) + 1) / 2 = 0.7011.)
    scores = caption_metrics(refs, cands, meteor=False)
    assert scores["BLEU-1"] == pytest.approx(0.75 * math.exp(-0.25), rel=1e-6)


def test_empty_candidate_does_not_crash() -> None:
    scores = caption_metrics(REFS, {1: "", 2: "two dogs play in the snow"}, meteor=False)
    assert scores["ROUGE-L"] == pytest.approx(0.5)  # mean of 0 and 1
    assert all(math.isfinite(v) for v in scores.values())
    # Punctuation only is empty after tokenisation, too.
    caption_metrics(REFS, {1: "...", 2: "two dogs"}, meteor=False)


def test_ids_must_match() -> None:
    with pytest.raises(ValueError, match="same images"):
        caption_metrics(REFS, {1: "a man"}, meteor=False)
    with pytest.raises(ValueError, match="same images"):
        caption_metrics(REFS, {1: "a man", 2: "dogs", 3: "extra"}, meteor=False)
    with pytest.raises(ValueError, match="no candidates"):
        caption_metrics({}, {}, meteor=False)


def test_meteor_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    # The wiring, without paying for java: auto follows java's presence, True demands it.
    cands = {1: "a man rides a bicycle", 2: "dogs in snow"}
    monkeypatch.setattr(metrics, "java_available", lambda: False)
    assert "METEOR" not in caption_metrics(REFS, cands)
    with pytest.raises(RuntimeError, match="java"):
        caption_metrics(REFS, cands, meteor=True)

    monkeypatch.setattr(metrics, "java_available", lambda: True)
    monkeypatch.setattr(metrics, "_meteor", lambda gts, res: (0.25, {k: 0.25 for k in gts}))
    scores = caption_metrics(REFS, cands)
    assert list(scores) == list(METRIC_NAMES)
    assert scores["METEOR"] == 0.25
    assert "METEOR" not in caption_metrics(REFS, cands, meteor=False)


@pytest.mark.slow  # METEOR's jar takes several seconds to load its paraphrase tables
@needs_java
def test_meteor_real() -> None:
    before = child_pids()
    refs = {**REFS, 3: ["a black cat sleeps on a sofa"]}
    cands = {1: "a man rides a red bicycle", 2: "purple elephants dance", 3: ""}
    corpus, per_image = meteor_scores(refs, cands)
    assert per_image[1] == pytest.approx(1.0)
    assert per_image[1] > per_image[2]
    assert per_image[3] == 0.0  # the empty caption matches nothing
    assert 0.0 < corpus < 1.0
    assert child_pids() <= before  # java was shut down


def test_coco_results_json() -> None:
    assert coco_results_json({7: "a cat", 3: "a dog"}) == [
        {"image_id": 3, "caption": "a dog"},
        {"image_id": 7, "caption": "a cat"},
    ]


def test_chinese_is_scored_on_characters() -> None:
    from captioner.data.vocab import tokenizer_named

    refs = {1: ["一个红色的圆形", "红色的大圆形"], 2: ["一个蓝色的小方形", "蓝色方形"]}
    cands = {1: "红色的圆形", 2: "一个蓝色的方形"}
    chars = caption_metrics(refs, cands, meteor=False, tokenizer=tokenizer_named("chars"))
    # Whole captions as single "words" (the PTB tokenizer on text without spaces) share nothing.
    assert caption_metrics(refs, cands, meteor=False)["BLEU-1"] < 1e-6
    assert chars["BLEU-1"] > 0.8 and chars["BLEU-4"] > 0.3 and chars["CIDEr"] > 0.5


def test_chars2_punctuation_is_read_but_not_scored() -> None:
    from captioner.data.vocab import tokenizer_named

    refs = {1: ["两个物体：一个红色的圆形，一个蓝色的方形。", "红色的圆形和蓝色的方形"],
            2: ["一个绿色的星形。", "绿色星形"]}
    plain = {1: "两个物体一个红色的圆形一个蓝色的方形", 2: "一个绿色的星形"}
    marked = {1: "两个物体，一个红色的圆形：一个蓝色的方形！", 2: "一个绿色的星形。"}
    chars2 = tokenizer_named("chars2")
    assert caption_metrics(refs, plain, meteor=False, tokenizer=chars2) == \
        caption_metrics(refs, marked, meteor=False, tokenizer=chars2)
    assert caption_metrics(refs, plain, meteor=False, tokenizer=chars2)["BLEU-4"] > 0.99


def test_meteor_is_english_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from captioner.data.vocab import tokenizer_named

    monkeypatch.setattr(metrics, "java_available", lambda: True)
    refs, cands = {1: ["红色的圆形"]}, {1: "红色的圆形"}
    assert "METEOR" not in caption_metrics(refs, cands, tokenizer=tokenizer_named("chars"))  # skipped, not run
    with pytest.raises(ValueError, match="English"):
        caption_metrics(refs, cands, meteor=True, tokenizer=tokenizer_named("chars"))


def test_evaluate_refuses_meteor_on_chinese_before_decoding(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One rule for METEOR (metrics.meteor_wanted), asked by evaluate before its decode: a
    request it cannot meet fails at once, instead of being dropped or failing minutes later."""
    import captioner.evaluation.evaluate as evaluation
    from captioner.data.vocab import tokenizer_named
    from tests.tiny import tiny_captioner

    monkeypatch.setattr(metrics, "java_available", lambda: True)
    cap = tiny_captioner(seed=0)
    cap.vocab.tokenizer = tokenizer_named("chars")

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded before the METEOR request was checked")

    monkeypatch.setattr(evaluation, "decode_records", no_decoding)
    with pytest.raises(ValueError, match="English"):
        evaluation.evaluate(cap, tmp_path, "test", meteor=True)
    assert metrics.meteor_wanted(None, tokenizer_named("chars")) is False
    assert metrics.meteor_wanted(None) is True and metrics.meteor_wanted(False) is False
