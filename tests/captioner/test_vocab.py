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


# --------------------------------------------------------------------------- any language

from captioner.vocab import TOKENIZERS, tokenizer_named  # noqa: E402


def test_chinese_is_split_into_characters_without_punctuation():
    chars = tokenizer_named("chars")
    assert chars.tokenize("一个红色的大圆形，和一个蓝色的小三角形。") == list("一个红色的大圆形和一个蓝色的小三角形")
    # Latin words and numbers inside stay whole and lower-cased; full-width forms become ASCII.
    assert chars.tokenize("穿着T恤的男人和ＡＢＣ 3只猫！") == ["穿", "着", "t", "恤", "的", "男", "人", "和", "abc",
                                                        "3", "只", "猫"]
    assert chars.tokenize("こんにちは、カメラ") == list("こんにちはカメラ")


def test_chinese_joins_without_spaces_but_keeps_latin_words_apart():
    chars = tokenizer_named("chars")
    text = "一个红色的大圆形"
    assert chars.join(chars.tokenize(text)) == text
    assert chars.join(["一", "台", "iphone", "12", "手", "机"]) == "一台iphone 12手机"


def test_whitespace_tokenizer_keeps_accents_and_drops_edge_punctuation():
    ws = tokenizer_named("whitespace")
    assert ws.tokenize("Ein Hund läuft über die Straße, schnell!") == \
        ["ein", "hund", "läuft", "über", "die", "straße", "schnell"]
    assert ws.tokenize("Собака «бежит» по траве.") == ["собака", "бежит", "по", "траве"]
    assert ws.join(["ein", "hund"]) == "ein hund"


def test_ptb_is_the_default_and_the_coco_toolkits():
    v = Vocabulary(list(SPECIALS) + ["a", "dog"])
    assert v.tokenizer.name == "ptb"
    assert v.tokenizer.tokenize("A dog's ball.") == tokenize("A dog's ball.")
    assert v.join(["a", "dog"]) == "a dog"


def test_vocabulary_encodes_and_joins_with_its_tokenizer():
    v = Vocabulary.build(["红色的圆形", "蓝色的圆形"], min_count=1, tokenizer=tokenizer_named("chars"))
    assert set(v.words[len(SPECIALS):]) == set("红蓝色的圆形")
    ids = v.encode("红色的圆形")
    assert len(ids) == 2 + 5 and v.unk not in ids
    assert v.join(v.decode(ids)) == "红色的圆形"


def test_unknown_tokenizer_names_the_known_ones():
    with pytest.raises(ValueError, match="chars.*ptb.*whitespace|ptb.*chars"):
        tokenizer_named("jieba")
    assert set(TOKENIZERS) == {"ptb", "chars", "whitespace"}
