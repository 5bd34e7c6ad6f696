"""Vocabulary: specials first, min-count threshold, plain-data round trip, offline tokenizer."""

import pytest

from captioner.data.vocab import SPECIALS, Vocabulary, tokenize


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

from captioner.data.vocab import TOKENIZERS, tokenizer_named  # noqa: E402


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
    assert set(TOKENIZERS) == {"ptb", "chars", "chars2", "whitespace"}


# ------------------------------------------------------------------ chars2, Korean, guesses

import unicodedata  # noqa: E402

from captioner.data.vocab import guess_tokenizer  # noqa: E402


@pytest.mark.parametrize("text, tokens", [
    ("3.5米", ["3.5", "米"]),
    ("-5度", ["-5", "度"]),
    ("零下-5度的早晨", ["零", "下", "-5", "度", "的", "早", "晨"]),
    ("50%的人", ["50%", "的", "人"]),
    ("A/B测试", ["a/b", "测", "试"]),
    ("1,000只鸟和12:30的钟", ["1,000", "只", "鸟", "和", "12:30", "的", "钟"]),
    ("穿着T恤的男人", ["穿", "着", "t", "恤", "的", "男", "人"]),
    ("两个物体：一个红色的三角形，一个蓝色的圆形。", list("两个物体：一个红色的三角形，一个蓝色的圆形。")),
    ("猫、狗和鸟！真的吗？", list("猫、狗和鸟！真的吗？")),
    ("ＡＢＣ 3只猫！", ["abc", "3", "只", "猫", "！"]),
    ("一只猫, 一只狗.", ["一", "只", "猫", "，", "一", "只", "狗", "。"]),  # ASCII marks become Chinese ones
    ("“猫”（小的）…", ["猫", "小", "的"]),  # quotes, brackets and ellipses go
    ("这是一只猫(cat)", ["这", "是", "一", "只", "猫", "cat"]),
    ("猫-狗", ["猫", "狗"]),  # a dash between characters is no sign
    ("こんにちは、カメラ", list("こんにちは、カメラ")),
])
def test_chars2_keeps_numbers_signs_and_sentence_punctuation(text, tokens):
    assert tokenizer_named("chars2").tokenize(text) == tokens


@pytest.mark.parametrize("text", ["3.5米", "-5度", "50%的人", "a/b测试", "两个物体：一个红色的三角形，一个蓝色的圆形。",
                                  "一台iphone 12手机", "零下-5度", "12:30的钟", "wi-fi信号"])
def test_chars2_joins_back_to_the_text(text):
    chars2 = tokenizer_named("chars2")
    assert chars2.join(chars2.tokenize(text)) == text


def test_chars2_scores_without_punctuation():
    chars2 = tokenizer_named("chars2")
    assert chars2.scored("两个物体：一个红色的三角形，3.5米。") == list("两个物体一个红色的三角形") + ["3.5", "米"]
    assert tokenizer_named("ptb").scored("A dog, sitting.") == ["a", "dog", "sitting"]


def test_the_first_chars_tokenizer_is_kept_as_it_was_for_the_models_trained_with_it():
    chars = tokenizer_named("chars")
    assert chars.tokenize("3.5米，-5度。50%的人") == ["3", "5", "米", "5", "度", "50", "的", "人"]
    assert chars.tokenize("한국어 문장") == list("한국어문장")
    assert chars.join(list("한국어문장")) == "한국어문장"


def test_korean_is_split_into_words():
    korean = ["강아지가 공원에서 뛰고 있다", "한국어 문장", "고양이가 소파 위에서 자고 있다"]
    name = guess_tokenizer(korean)
    assert name == "whitespace"
    tok = tokenizer_named(name)
    assert tok.tokenize(korean[0]) == ["강아지가", "공원에서", "뛰고", "있다"]
    assert tok.join(tok.tokenize("한국어 문장.")) == "한국어 문장"
    assert tokenizer_named("chars2").tokenize("한국어 문장") == ["한국어", "문장"]


def test_guesses_go_by_script():
    # 1 caption in 10 with a typographic quote or apostrophe, 1 in 10 with an accented letter.
    english = ([f"a brown dog lying on the green grass next to a wooden bench {i}" for i in range(16)]
               + ["a dog’s “ball” on the grass in front of a small house", "a man’s bicycle leaning on a wall"]
               + ["people sitting outside a café on a sunny afternoon", "a naïve painting of a boat on the sea"])
    assert guess_tokenizer(english) == "ptb"
    # The edges: 1 accented letter in 200 is English, 1 in 199 is not; 9 captions in 10 in Latin letters.
    assert guess_tokenizer(["x" * 199 + "é"]) == "ptb" and guess_tokenizer(["x" * 198 + "é"]) == "whitespace"
    assert guess_tokenizer(["a dog"] * 9 + ["собака"]) == "ptb"
    assert guess_tokenizer(["a dog"] * 8 + ["собака"] * 2) == "whitespace"
    french = ["un chien sur l’herbe", "une femme près de la fenêtre", "un café crème", "un homme âgé",
              "deux enfants jouent", "un vélo rouge", "une tête de chat", "un garçon à la plage"]
    assert guess_tokenizer(french) == "whitespace"
    german = ["Ein Hund läuft über die Straße", "Eine Katze auf dem Sofa", "Zwei Männer spielen Fußball",
              "Ein rotes Auto", "Ein Mädchen mit einem Ball"]
    assert guess_tokenizer(german) == "whitespace"
    assert guess_tokenizer(["Собака бежит", "Кошка спит"]) == "whitespace"
    assert guess_tokenizer(["一只猫坐在桌子上", "桌子上有一只猫", "a cat"]) == "chars2"
    assert guess_tokenizer(["一只猫", "猫", "a cat", "a dog"]) == "whitespace"  # half Chinese: not most
    assert guess_tokenizer(["カメラ", "猫", "a"]) == "chars2"  # kana counts as well as Han
    assert guess_tokenizer(["12", "34"]) == "ptb" and guess_tokenizer([]) == "ptb"


def test_decomposed_text_gives_the_same_tokens_as_composed():
    composed = "Ein Mädchen läuft über die Straße"
    decomposed = unicodedata.normalize("NFD", composed)
    assert decomposed != composed
    for name in ("whitespace", "chars2"):  # ptb is the toolkit's, which does not normalise
        tok = tokenizer_named(name)
        assert tok.tokenize(decomposed) == tok.tokenize(composed), name


def test_tokenizers_say_what_their_tokens_are():
    assert [tokenizer_named(n).unit for n in ("ptb", "chars", "chars2", "whitespace")] == \
        ["words", "characters", "characters", "words split at spaces"]


# The bundled demo-zh's captions of the app's examples, as the "chars" tokenizer joined them
# when chars2 came: the old models must caption as they did.
DEMO_ZH = {"blue-star-green-star.png": "从左到右一个绿色的星形和一个蓝色的星形",
           "green-cross-red-circle.png": "一个绿色的十字形和一个红色的圆形",
           "three-shapes.png": "从左到右一个紫色的三角形一个红色的星形和一个绿色的正方形",
           "white-star.png": "只有一个物体一个白色的星形"}


def test_the_chinese_demo_trained_with_chars_captions_as_it_did():
    from pathlib import Path

    from PIL import Image

    from captioner.inference import Captioner, DecodeOptions
    from captioner.io import bundled

    if not bundled.DEMOS["demo-zh"].path.is_file():
        pytest.skip("demo-zh is not installed")
    zh = Captioner.load("demo-zh")
    assert zh.vocab.tokenizer.name == "chars"
    examples = Path(__file__).parents[2] / "app" / "examples"
    got = {name: zh.caption(Image.open(examples / name), DecodeOptions(beam_size=3, max_len=zh.max_len)).caption
           for name in DEMO_ZH}
    assert got == DEMO_ZH


def test_text_needing_cjk_glyphs_is_told_apart_korean_included():
    from captioner.data.vocab import has_cjk

    assert has_cjk("一只猫") and has_cjk("カメラ") and has_cjk("한국어 문장") and has_cjk("a 猫")
    assert not has_cjk("a cat") and not has_cjk("Собака") and not has_cjk("")


def test_the_edges_of_chars2_words_signs_and_marks():
    chars2 = tokenizer_named("chars2")
    assert chars2.tokenize("减号-x和dog,cat") == ["减", "号", "x", "和", "dog", "，", "cat"]  # no sign, no comma word
    assert chars2.join(["iphone", "，", "12"]) == "iphone，12"  # no space around a mark
    assert tokenizer_named("whitespace").tokenize("a ... — b") == ["a", "b"]  # a word of punctuation alone goes


def test_guesses_read_decomposed_accents_and_the_nine_in_ten_edge():
    french = ["un chien sur l’herbe", "une femme près de la fenêtre", "un café crème", "un homme âgé"]
    assert guess_tokenizer([unicodedata.normalize("NFD", c) for c in french]) == "whitespace"
    assert guess_tokenizer(["a dog"] * 9 + ["собака"] * 2) == "whitespace"  # 9 in 11: under 9 in 10


def test_encode_keeps_at_most_max_len_words():
    v = Vocabulary.build(["a red star"], min_count=1)
    assert v.encode("a red star", max_len=2) == [v.start, v.index("a"), v.index("red"), v.end]


# --- mutation testing's survivors (docs/testing.md) -----------------------------------------
def test_each_special_index_names_its_own_token_and_decode_skips_padding_and_start():
    v = Vocabulary.build(["a red star"], min_count=1)
    assert [v.words[i] for i in (v.pad, v.start, v.end, v.unk)] == list(SPECIALS)
    assert [v.index(w) for w in SPECIALS] == [v.pad, v.start, v.end, v.unk]
    red = v.index("red")
    assert v.decode([v.pad, v.start, red, v.pad, v.unk, v.end, red]) == ["red", "<unk>"]


def test_the_vocabulary_shows_its_words_not_its_index():
    """The word -> index table is derived from the words: a repr (a log line, a debugger) shows
    the words once, not the table of a vocabulary of thousands again."""
    v = Vocabulary.build(["a red star"], min_count=1)
    assert "_index" not in repr(v) and "'star'" in repr(v)
