"""Vocabulary and tokenisation.

A tokenizer is chosen per data set, by name, and recorded in the data set's split file and
in the checkpoint (old checkpoints, which record none, are "ptb"):

- ``ptb``: English, as the COCO caption evaluation toolkit tokenises (below);
- ``chars2``: Chinese and Japanese, which write no spaces between words: every Han or kana
  character is a token; a number with its sign, decimals and percent ("-5", "3.5", "50%")
  or a run of other letters ("T恤" -> "t", "恤"; "A/B测试" -> "a/b", ...) stays one token;
  sentence punctuation (，。、：；！？) is kept as tokens, so that generated captions read as
  sentences; the metrics leave it out (:meth:`Tokenizer.scored`), as the toolkit leaves out
  English punctuation. Captions join back with no spaces;
- ``chars``: the first form of ``chars2``, kept unchanged for the models trained with it
  (the bundled demo-zh among them): Hangul characters are tokens too, numbers split at
  their signs and stops ("3.5" -> "3", "5"), all punctuation goes;
- ``whitespace``: other languages that put spaces between words, Korean among them:
  lower-cased words, with the punctuation at their edges stripped.

:func:`guess_tokenizer` picks one from a data set's captions by the script of their letters.

The PTB tokenisation is the COCO caption evaluation toolkit's, in pure Python: pycocoevalcap's
PTBTokenizer runs Stanford's PTB tokenizer (java) lower-casing, then drops the tokens in
its punctuation list. :func:`tokenize` gives the same tokens for captions (a table of
tricky ones is checked against java in the tests), with nltk's TreebankWordTokenizer,
which needs no downloaded data (``nltk.word_tokenize`` would need the punkt models).
The vocabulary and the metrics use this one tokenizer. The vocabulary is stored in
checkpoints as a plain list of strings.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

PAD, START, END, UNK = "<pad>", "<start>", "<end>", "<unk>"
SPECIALS = (PAD, START, END, UNK)



@lru_cache(maxsize=1)
def _treebank():
    """nltk's TreebankWordTokenizer, loaded when English text is first tokenised (not to caption:
    the torch-free runtime joins words without nltk)."""
    from nltk.tokenize import TreebankWordTokenizer

    return TreebankWordTokenizer()

# pycocoevalcap's PUNCTUATIONS as they can match: its bracket tokens are spelt "-LRB-" but
# the tokens come out lower-cased, so "-lrb-" and friends stay, as do "&", "%", "#", "$".
_DROPPED = frozenset({"''", "'", "``", "`", ".", "?", "!", ",", ":", "-", "--", "...", ";"})
# Words whose final full stop belongs to them (Stanford keeps it): acronyms such as
# "u.s." or "p.m.", and common abbreviations before a name.
_ABBREVIATION = re.compile(r"(?:[^\W\d_]\.){2,}|(?:mr|mrs|ms|dr|st|jr|sr|prof|mt|ft|vs|etc|inc|co|ltd|no)\.")
# Plain words the Treebank rules split ("cannot" -> "can not"), as Stanford's tokenizer does.
_SPLIT_WORDS = frozenset({"cannot", "gimme", "gonna", "gotta", "lemme", "wanna"})
_CLITIC = re.compile(r"'(?:s|m|d|ll|re|ve)$")


def tokenize(text: str) -> list[str]:
    """Lower-cased PTB tokens, as the COCO evaluation toolkit gives them.

    Each whitespace-separated chunk is tokenised on its own, so a full stop ending a word
    inside a caption ("sits. It") is split off like the caption's last one; brackets become
    ``-lrb-``/``-rrb-``/..., clitics are split ("dog 's", "do n't"), quotes and the
    toolkit's punctuation tokens are dropped.
    """
    tokens: list[str] = []
    for chunk in text.lower().replace("`", " ` ").split():
        tokens.extend(_chunk_tokens(chunk))
    return tokens


@lru_cache(maxsize=1 << 17)
def _chunk_tokens(chunk: str) -> tuple[str, ...]:
    """The kept tokens of one whitespace-free chunk. Cached: captions reuse a few tens of
    thousands of chunks, and the Treebank rules are some forty regular expressions each."""
    if (chunk.isalnum() and chunk not in _SPLIT_WORDS) or _ABBREVIATION.fullmatch(chunk):
        return (chunk,)
    tokens: list[str] = []
    for tok in _treebank().tokenize(chunk, convert_parentheses=True):
        # An opening single quote ('quoted) is a quote, not part of the word.
        if tok.startswith("'") and len(tok) > 1 and not _CLITIC.match(tok):
            tokens.extend(["'", tok[1:]])
        else:
            tokens.append(tok.lower())
    return tuple(t for t in tokens if t not in _DROPPED)


# ------------------------------------------------------------------ tokenizers by name

# Scripts written without spaces between words: kana, bopomofo, Hangul, the CJK
# ideograph blocks (with extension A and the planes of extensions B onwards), compatibility
# ideographs. Each such character is one token.
_CJK = ("\u3040-\u30ff\u3100-\u312f\u31a0-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af"
        "\uf900-\ufaff\U00020000-\U0003134f")
_CHAR_TOKEN = re.compile(f"[{_CJK}]|(?:(?![{_CJK}])[^\\W_])+")
_IS_CJK = re.compile(f"[{_CJK}]")


def has_cjk(text: str) -> bool:
    """Whether ``text`` holds a Chinese, Japanese or Korean character: such text needs a
    font with CJK glyphs."""
    return _IS_CJK.search(text) is not None


# Scripts written without spaces between words (Korean puts spaces between words): kana,
# bopomofo and the CJK ideographs of _CJK, Hangul left out.
_SPACELESS = "\u3040-\u30ff\u3100-\u312f\u31a0-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0003134f"
_IS_SPACELESS = re.compile(f"[{_SPACELESS}]")
_RUN = f"(?:(?![{_SPACELESS}])[^\\W_])+"  # letters or digits of a script written with spaces
# A number's sign where no letter or digit of such a script stands before it ("零下-5度").
_SIGN = f"(?:(?<=[{_SPACELESS}])|(?<![^\\W_]))[-+\u2212](?=\\d)"
# Inside a word: . / & ' + - between runs ("a/b", "wi-fi", "3.5"), , and : between digits
# ("1,000", "12:30"); after a number a percent or degree sign ("50%").
_WORD = f"(?:{_SIGN})?{_RUN}(?:[./&'\u2019+-]{_RUN}|(?<=\\d)[,:](?=\\d){_RUN})*(?:(?<=\\d)[%\u2030\u00b0])?"
# Sentence punctuation kept by chars2, written the Chinese way (NFKC turns "，" into ","); a
# lone full stop is one, an ellipsis is not.
_SENTENCE_MARKS = {",": "\uff0c", ":": "\uff1a", ";": "\uff1b", "!": "\uff01", "?": "\uff1f", ".": "\u3002",
                   "\u3002": "\u3002", "\u3001": "\u3001"}
_CHAR2_TOKEN = re.compile(f"[{_SPACELESS}]|{_WORD}|(?<!\\.)[,:;!?\u3002\u3001.](?!\\.)")


class Tokenizer:
    """Text -> tokens, and tokens -> the text a caption shows."""

    name: str = ""
    unit: str = "words"  # what a token is, for people: "words", "characters"

    def tokenize(self, text: str) -> list[str]:
        raise NotImplementedError

    def scored(self, text: str) -> list[str]:
        """The tokens the metrics count: the tokens, less any kept only for reading."""
        return self.tokenize(text)

    def spaces(self, token: str) -> tuple[bool, bool]:
        """Whether ``token`` takes a space (before it, after it): :meth:`join` puts one between two
        tokens where the first takes one after and the second one before. Words written with
        spaces take both; a Chinese character neither. The character budget of the search
        (``captioner.search.budget``) counts a caption's printed length by this rule, so that it
        is ``len(join(tokens))`` exactly."""
        return True, True

    def join(self, tokens: Sequence[str]) -> str:
        """The text a caption shows: the tokens, with a space between two that take one (:meth:`spaces`)."""
        out: list[str] = []
        after = False  # whether the token before takes a space after it (none before the first)
        for tok in tokens:
            before, next_after = self.spaces(tok)
            if after and before:
                out.append(" ")
            out.append(tok)
            after = next_after
        return "".join(out)


class PTBTokenizer(Tokenizer):
    """English: the COCO evaluation toolkit's tokens (:func:`tokenize`)."""

    name = "ptb"

    def tokenize(self, text: str) -> list[str]:
        return tokenize(text)


class CharTokenizer(Tokenizer):
    """Chinese, Japanese, as the first models learnt them: one token per Han, kana or Hangul
    character, runs of other letters or digits whole, all punctuation dropped. Kept as it
    was for the checkpoints that name it; new data sets get :class:`Char2Tokenizer`.

    Text is NFKC-normalised first (full-width "ＡＢＣ１" is "ABC1") and lower-cased.
    """

    name = "chars"
    unit = "characters"

    def tokenize(self, text: str) -> list[str]:
        return _CHAR_TOKEN.findall(unicodedata.normalize("NFKC", text).lower())

    def spaces(self, token: str) -> tuple[bool, bool]:
        """No space beside a character; one between two Latin words or numbers ("iphone 12")."""
        return not _IS_CJK.match(token[0]), not _IS_CJK.match(token[-1])


class Char2Tokenizer(Tokenizer):
    """Chinese, Japanese: one token per Han or kana character; numbers with their signs,
    runs of other letters (Korean words, Latin ones) whole; sentence punctuation kept, in
    its Chinese form (see the module docstring).

    Text is NFKC-normalised first (full-width "ＡＢＣ１" is "ABC1") and lower-cased.
    """

    name = "chars2"
    unit = "characters"

    def tokenize(self, text: str) -> list[str]:
        return [_SENTENCE_MARKS.get(t, t) for t in _CHAR2_TOKEN.findall(unicodedata.normalize("NFKC", text).lower())]

    def scored(self, text: str) -> list[str]:
        return [t for t in self.tokenize(text) if t not in _KEPT_MARKS]

    def spaces(self, token: str) -> tuple[bool, bool]:
        """No space around a character or a punctuation mark; one between two words or
        numbers ("iphone 12")."""
        return _spaced(token[0]), _spaced(token[-1])


_KEPT_MARKS = frozenset(_SENTENCE_MARKS.values())


def _spaced(ch: str) -> bool:
    """Whether ``ch`` belongs to a word written with spaces around it (not a Han or kana
    character, not a sentence mark)."""
    return ch not in _KEPT_MARKS and _IS_SPACELESS.match(ch) is None


class WhitespaceTokenizer(Tokenizer):
    """Languages that put spaces between words: lower-cased words, punctuation at their
    edges stripped ("«бежит»," -> "бежит"), a word of punctuation alone dropped."""

    name = "whitespace"
    unit = "words split at spaces"

    def tokenize(self, text: str) -> list[str]:
        words = (_strip_punctuation(w) for w in unicodedata.normalize("NFC", text).lower().split())
        return [w for w in words if w]


def _strip_punctuation(word: str) -> str:
    start, end = 0, len(word)
    while start < end and unicodedata.category(word[start]).startswith("P"):
        start += 1
    while end > start and unicodedata.category(word[end - 1]).startswith("P"):
        end -= 1
    return word[start:end]


PTB = PTBTokenizer()
TOKENIZERS: dict[str, Tokenizer] = {t.name: t for t in (PTB, Char2Tokenizer(), WhitespaceTokenizer(),
                                                        CharTokenizer())}
DEFAULT_TOKENIZER = PTB.name  # what a data set or checkpoint that names none was made with


def tokenizer_named(name: str) -> Tokenizer:
    """The tokenizer called ``name``; a ValueError naming the known ones otherwise."""
    try:
        return TOKENIZERS[name]
    except KeyError:
        raise ValueError(f"unknown tokenizer {name!r}: use one of {', '.join(TOKENIZERS)} (ptb for English, "
                         "chars2 for Chinese and Japanese, whitespace for other languages; chars is chars2's "
                         "first form)") from None


# Latin letters outside ASCII ("é", "ß") above this share of a data set's Latin
# letters make it a language other than English: English borrows a "café" or a "naïve"
# now and then (a share of about 0.1-0.3%), French, German, Spanish or Italian write
# them in most sentences (1-4%).
MAX_NON_ASCII_ENGLISH = 0.005


def guess_tokenizer(captions: Iterable[str]) -> str:
    """The tokenizer for a data set, from the script of its captions' letters:

    - "chars2" when over half the captions hold a Han or kana character;
    - "ptb" (English) when at least 9 in 10 captions are written in Latin letters only and
      at most 0.5% of those letters are not ASCII (typographic quotes and apostrophes are no
      letters: they do not count); a data set without letters is "ptb" too;
    - else "whitespace" (Korean, Cyrillic, Greek, Arabic, ... and Latin-script languages
      other than English)."""
    n = spaceless = latin_only = latin = non_ascii = 0
    for caption in captions:
        n += 1
        if _IS_SPACELESS.search(caption):
            spaceless += 1
            continue
        letters = [ch for ch in unicodedata.normalize("NFC", caption) if ch.isalpha()]
        latin_letters = [ch for ch in letters if ch.isascii() or _is_latin(ch)]
        latin_only += len(latin_letters) == len(letters)
        latin += len(latin_letters)
        non_ascii += sum(not ch.isascii() for ch in latin_letters)
    if spaceless * 2 > n:
        return "chars2"
    if latin_only * 10 >= n * 9 and non_ascii <= MAX_NON_ASCII_ENGLISH * latin:
        return "ptb"
    return "whitespace"


@lru_cache(maxsize=4096)
def _is_latin(ch: str) -> bool:
    return unicodedata.name(ch, "").startswith("LATIN")


@dataclass(frozen=True, eq=False)
class Spelling:
    """How each token of a vocabulary prints, by id: its characters, and whether it takes a space
    before and after it (``Tokenizer.spaces``), so that a caption's printed length is known token
    by token (the search's character budget, ``captioner.search.budget``). <pad>, <start> and
    <end> print nothing; <unk> prints as "<unk>", as a caption that holds it shows it. Equal only
    to itself: a vocabulary makes its one spelling once."""

    lengths: tuple[int, ...]
    before: tuple[bool, ...]
    after: tuple[bool, ...]

    @classmethod
    def of(cls, words: Sequence[str], tokenizer: "Tokenizer", silent: Iterable[int]) -> "Spelling":
        """The spelling of the tokens ``words`` (by id) joined by ``tokenizer``; the ids ``silent``
        print nothing and take no space."""
        quiet = set(silent)
        sides = [(False, False) if i in quiet else tokenizer.spaces(w) for i, w in enumerate(words)]
        return cls(lengths=tuple(0 if i in quiet else len(w) for i, w in enumerate(words)),
                   before=tuple(b for b, _ in sides), after=tuple(a for _, a in sides))


# -------------------------------------------------------------------------- vocabulary


@dataclass
class Vocabulary:
    """Index <-> word mapping; indices 0..3 are the special tokens. Its tokenizer turns a
    caption into words, and words back into the caption shown."""

    words: list[str]
    tokenizer: Tokenizer = PTB
    _index: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if tuple(self.words[: len(SPECIALS)]) != SPECIALS:
            raise ValueError(f"vocabulary must start with the special tokens {SPECIALS}")
        if len(set(self.words)) != len(self.words):
            raise ValueError("vocabulary has duplicate words")
        self._index = {w: i for i, w in enumerate(self.words)}

    @classmethod
    def build(cls, captions: Iterable[str], min_count: int = 5, max_size: int | None = None,
              tokenizer: Tokenizer = PTB) -> "Vocabulary":
        """Words seen at least ``min_count`` times, most frequent first (ties alphabetical)."""
        return cls.from_counts(Counter(tok for caption in captions for tok in tokenizer.tokenize(caption)),
                               min_count=min_count, max_size=max_size, tokenizer=tokenizer)

    @classmethod
    def from_counts(cls, counts: Counter, min_count: int = 5, max_size: int | None = None,
                    tokenizer: Tokenizer = PTB) -> "Vocabulary":
        """Words counted at least ``min_count`` times, most frequent first (ties alphabetical)."""
        kept = sorted((w for w, c in counts.items() if c >= min_count and w not in SPECIALS),
                      key=lambda w: (-counts[w], w))
        if max_size is not None:
            kept = kept[: max(0, max_size - len(SPECIALS))]
        return cls(list(SPECIALS) + kept, tokenizer)

    def __len__(self) -> int:
        return len(self.words)

    def __contains__(self, word: str) -> bool:
        return word in self._index

    @property
    def pad(self) -> int:
        return 0

    @property
    def start(self) -> int:
        return 1

    @property
    def end(self) -> int:
        return 2

    @property
    def unk(self) -> int:
        return 3

    def index(self, word: str) -> int:
        return self._index.get(word, self.unk)

    def encode(self, caption: str | Sequence[str], max_len: int | None = None) -> list[int]:
        """<start> w1 .. wn <end>, with at most ``max_len`` words (the end token is always kept)."""
        tokens = self.tokenizer.tokenize(caption) if isinstance(caption, str) else list(caption)
        if max_len is not None:
            tokens = tokens[:max_len]
        return [self.start] + [self.index(t) for t in tokens] + [self.end]

    def decode(self, ids: Iterable[int]) -> list[str]:
        """Words up to (not including) the first end token; start and pad tokens are skipped."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.end:
                break
            if i in (self.pad, self.start):
                continue
            out.append(self.words[i])
        return out

    def join(self, words: Sequence[str]) -> str:
        """The caption these words make, as its language writes it (no spaces in Chinese)."""
        return self.tokenizer.join(words)

    @cached_property
    def spelling(self) -> Spelling:
        """How each of its tokens prints (made once, on first use)."""
        return Spelling.of(self.words, self.tokenizer, (self.pad, self.start, self.end))

    def to_list(self) -> list[str]:
        return list(self.words)
