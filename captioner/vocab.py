"""Vocabulary and tokenisation.

A tokenizer is chosen per data set, by name, and recorded in the data set's split file and
in the checkpoint (old checkpoints, which record none, are "ptb"):

- ``ptb``: English, as the COCO caption evaluation toolkit tokenises (below);
- ``chars``: Chinese and Japanese, which write no spaces between words: every Han, kana
  or Hangul character is a token, a run of Latin letters or digits inside stays one
  token ("T恤" -> "t", "恤"), punctuation goes; captions join back with no spaces;
- ``whitespace``: other languages that put spaces between words: lower-cased words, with
  the punctuation at their edges stripped.

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
from functools import lru_cache

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
    """Whether ``text`` holds a character of a script written without spaces (Chinese,
    Japanese, Korean): such text needs a font with CJK glyphs."""
    return _IS_CJK.search(text) is not None


class Tokenizer:
    """Text -> tokens, and tokens -> the text a caption shows."""

    name: str = ""

    def tokenize(self, text: str) -> list[str]:
        raise NotImplementedError

    def join(self, tokens: Sequence[str]) -> str:
        return " ".join(tokens)


class PTBTokenizer(Tokenizer):
    """English: the COCO evaluation toolkit's tokens (:func:`tokenize`)."""

    name = "ptb"

    def tokenize(self, text: str) -> list[str]:
        return tokenize(text)


class CharTokenizer(Tokenizer):
    """Chinese, Japanese: one token per character of a script written without spaces.

    Text is NFKC-normalised first (full-width "ＡＢＣ１" is "ABC1") and lower-cased.
    """

    name = "chars"

    def tokenize(self, text: str) -> list[str]:
        return _CHAR_TOKEN.findall(unicodedata.normalize("NFKC", text).lower())

    def join(self, tokens: Sequence[str]) -> str:
        """No space between characters; one between two Latin words or numbers ("iphone 12")."""
        out: list[str] = []
        for tok in tokens:
            if out and not _IS_CJK.match(tok) and not _IS_CJK.match(out[-1][-1]):
                out.append(" ")
            out.append(tok)
        return "".join(out)


class WhitespaceTokenizer(Tokenizer):
    """Languages that put spaces between words: lower-cased words, punctuation at their
    edges stripped ("«бежит»," -> "бежит"), a word of punctuation alone dropped."""

    name = "whitespace"

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
TOKENIZERS: dict[str, Tokenizer] = {t.name: t for t in (PTB, CharTokenizer(), WhitespaceTokenizer())}
DEFAULT_TOKENIZER = PTB.name  # what a data set or checkpoint that names none was made with


def tokenizer_named(name: str) -> Tokenizer:
    """The tokenizer called ``name``; a ValueError naming the known ones otherwise."""
    try:
        return TOKENIZERS[name]
    except KeyError:
        raise ValueError(f"unknown tokenizer {name!r}: use one of {', '.join(TOKENIZERS)} (ptb for English, "
                         "chars for Chinese and Japanese, whitespace for other languages)") from None


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

    def to_list(self) -> list[str]:
        return list(self.words)
