"""Vocabulary: specials first, min-count threshold, plain-data round trip, offline tokenizer."""

import pytest

from captioner.vocab import SPECIALS, Vocabulary, tokenize


def test_tokenize_needs_no_downloaded_data_and_drops_punctuation():
    assert tokenize("A Red circle, and a dog's ball.") == ["a", "red", "circle", "and", "a", "dog", "'s", "ball"]


def test_min_count_and_order():
    v = Vocabulary.build(["a red circle", "a red star", "a blue star"], min_count=2)
    assert v.words == list(SPECIALS) + ["a", "red", "star"]  # by count, ties alphabetical; blue/circle dropped
    assert v.encode("a blue star") == [v.start, v.index("a"), v.unk, v.index("star"), v.end]
    assert v.decode(v.encode("a red star") + [v.pad]) == ["a", "red", "star"]
    assert Vocabulary(v.to_list()).words == v.words


def test_bad_vocabularies_are_refused():
    with pytest.raises(ValueError, match="special"):
        Vocabulary(["a", "b"])
    with pytest.raises(ValueError, match="duplicate"):
        Vocabulary(list(SPECIALS) + ["a", "a"])
