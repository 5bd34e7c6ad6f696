"""Vocabulary and tokenisation.

Tokenisation uses nltk's TreebankWordTokenizer, which needs no downloaded data
(``nltk.word_tokenize`` would need the punkt models). The vocabulary is stored in
checkpoints as a plain list of strings.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from nltk.tokenize import TreebankWordTokenizer

PAD, START, END, UNK = "<pad>", "<start>", "<end>", "<unk>"
SPECIALS = (PAD, START, END, UNK)

_tokenizer = TreebankWordTokenizer()


def tokenize(text: str) -> list[str]:
    """Lower-cased word tokens; punctuation other than inner apostrophes is dropped."""
    tokens = _tokenizer.tokenize(text.lower())
    return [t for t in tokens if any(ch.isalnum() for ch in t)]


@dataclass
class Vocabulary:
    """Index <-> word mapping; indices 0..3 are the special tokens."""

    words: list[str]
    _index: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if tuple(self.words[: len(SPECIALS)]) != SPECIALS:
            raise ValueError(f"vocabulary must start with the special tokens {SPECIALS}")
        if len(set(self.words)) != len(self.words):
            raise ValueError("vocabulary has duplicate words")
        self._index = {w: i for i, w in enumerate(self.words)}

    @classmethod
    def build(cls, captions: Iterable[str], min_count: int = 5, max_size: int | None = None) -> "Vocabulary":
        """Words seen at least ``min_count`` times, most frequent first (ties alphabetical)."""
        counts = Counter(tok for caption in captions for tok in tokenize(caption))
        kept = sorted((w for w, c in counts.items() if c >= min_count and w not in SPECIALS),
                      key=lambda w: (-counts[w], w))
        if max_size is not None:
            kept = kept[: max(0, max_size - len(SPECIALS))]
        return cls(list(SPECIALS) + kept)

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
        tokens = tokenize(caption) if isinstance(caption, str) else list(caption)
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

    def to_list(self) -> list[str]:
        return list(self.words)
