"""The caption's JSON record is built in one place (captioner.record) for the caption command,
the app's download and the torch-free runtime."""

import numpy as np
import torch

from captioner.model.familiarity import Familiarity
from captioner.onnx.runtime import Caption
from captioner.search.decoding import Alternative, CaptionResult
from captioner.search.record import caption_record, significant


def _record(**over):
    fields = dict(image="a.jpg", caption="a cat", words=["a", "cat"], score=-1.234567, familiarity=0.123456,
                  unfamiliar=False, word_probs=[0.5, 0.000123456], end_prob=0.99996)
    return caption_record(**{**fields, **over})


def test_the_keys_come_in_the_documented_order_with_scores_and_probabilities_rounded():
    r = _record(model="demo-soft", training_data="shapes", attention={"alphas": [[1.0]], "betas": [0.5]})
    assert list(r) == ["image", "caption", "words", "score", "familiarity", "unfamiliar", "word_probs", "end_prob",
                       "model", "training_data", "alphas", "betas"]
    assert r["score"] == -1.2346 and r["familiarity"] == 0.1235
    assert r["word_probs"] == [0.5, 0.0001235] and r["end_prob"] == 1.0


def test_optional_keys_are_left_out_and_unknowns_are_null():
    r = _record(image=None, familiarity=None, unfamiliar=None, end_prob=None, training_data="")
    assert "image" not in r and "model" not in r and "training_data" not in r and "alternatives" not in r
    assert r["familiarity"] is None and r["unfamiliar"] is None and r["end_prob"] is None


def test_alternatives_carry_a_rank_only_when_the_search_ranked_by_one():
    r = _record(alternatives=[("a cat", -1.0, -0.33333), ("a dog", -2.0, None)])
    assert r["alternatives"] == [{"caption": "a cat", "score": -1.0, "rank": -0.3333},
                                 {"caption": "a dog", "score": -2.0}]


def test_digits_set_every_rounding():
    r = _record(digits=2)
    assert r["score"] == -1.23 and r["familiarity"] == 0.12 and r["word_probs"] == [0.5, 0.00012]


def test_a_positive_probability_keeps_its_figures():
    assert significant(1.23456e-9) == 1.235e-09 and significant(0.0) == 0.0


def test_the_torch_result_and_the_torch_free_runtime_write_the_same_record():
    alphas = np.array([[[0.25, 0.75]], [[0.5, 0.5]]], dtype=np.float32)  # (T, H, W)
    betas = np.array([0.123456, 0.9], dtype=np.float32)
    torch_result = CaptionResult(words=["a", "cat"], alphas=torch.from_numpy(alphas), betas=torch.from_numpy(betas),
                                 score=-1.5, familiarity=Familiarity(0.2, False, 0.01), word_probs=(0.5, 0.4),
                                 alternatives=(Alternative(("a", "cat"), -1.5), Alternative(("a", "dog"), -2.5)),
                                 end_prob=0.75)
    runtime = Caption(words=["a", "cat"], text="a cat", score=-1.5, alphas=alphas, betas=betas, word_probs=(0.5, 0.4),
                      end_prob=0.75, familiarity=0.2, unfamiliar=False, alternatives=(("a cat", -1.5), ("a dog", -2.5)))
    for attention in (False, True):
        assert torch_result.to_json("x.png", attention) == runtime.to_json("x.png", attention)
