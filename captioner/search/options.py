"""How a caption is searched for: the decoding options, each checked once, here, where they are made.

``DecodeOptions`` refuses what no search can take when it is built; everything downstream
(``captioner caption``, the app, the torch-free runtime, the searches themselves) takes one and
trusts it. The command lines parse their flags with ``parser(FIELD)``, which applies the same
rule as the dataclass, so that a bad flag is refused as argparse reads it, in one line, with the
words the Python API would use. ``Tokens`` are the vocabulary's special ids the search needs.

Plain Python: the torch-free runtime (``captioner.onnx``) imports it.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from captioner.data.vocab import Spelling

# The most words --max-len allows (tokens: characters for a Chinese model): captions are a sentence
# (COCO's longest training captions, which the configs keep, are 50 words); a larger limit only lets
# an undertrained model run on. A flag's cap only: a model trained on longer captions decodes to its
# own length.
MAX_WORDS = 100
# How a hard-attention model picks its context at inference (model.attention.HARD_INFERENCE holds
# what each means): "expected", the alpha-weighted mean of the annotations, is the default.
HARD_ATTENTION = ("expected", "argmax", "sample")
# An image whose familiarity (the share of training images at least as far from their distribution)
# is below this is reported as unfamiliar.
UNFAMILIAR_BELOW = 0.01


class OptionError(ValueError):
    """A decoding option no search can take: ``option`` is the field's name, ``reason`` why."""

    def __init__(self, option: str, value, reason: str):
        self.option, self.value, self.reason = option, value, reason
        super().__init__(f"{option} {value!r}: {reason}")

    @property
    def flag(self) -> str:
        """The option as the command lines spell it (--num-captions)."""
        return "--" + self.option.replace("_", "-")

    def for_command(self) -> str:
        """The refusal in the command lines' words: ``--num-captions 4: more than ...``."""
        return f"{self.flag} {self.value}: {self.reason}"


def _whole(low: int, high: int | None = None, unit: str = "") -> Callable[[object], str | None]:
    def rule(x) -> str | None:
        if isinstance(x, bool) or not isinstance(x, int):
            return "must be a whole number"
        if x < low:
            return f"must be >= {low}"
        if high is not None and x > high:
            return f"at most {high}{unit}"
        return None
    return rule


def _none_or(rule: Callable[[object], str | None]) -> Callable[[object], str | None]:
    def either(x) -> str | None:
        return None if x is None else rule(x)
    return either


def _finite_at_least_0(x) -> str | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
        return "must be a number >= 0 (0: rank by log p)"
    return None


def _share(x) -> str | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= 1:  # NaN too
        return "must be a share from 0 to 1"
    return None


def _hard(x) -> str | None:
    return None if isinstance(x, str) and x in HARD_ATTENTION else f"must be one of {', '.join(HARD_ATTENTION)}"


def _flag(x) -> str | None:
    return None if isinstance(x, bool) else "must be True or False"


# Each field's rule: None when the value is fine, else why not.
_RULES: dict[str, Callable[[object], str | None]] = {
    "beam_size": _whole(1),
    "max_len": _whole(1),
    "length_penalty": _finite_at_least_0,
    "hard_attention": _hard,
    "unfamiliar_below": _share,
    "num_captions": _whole(1),
    "allow_unk": _flag,
    "max_chars": _none_or(_whole(1)),
}


# A flag's rule where it asks more than the field's.
_FLAG_RULES = {"max_len": _whole(1, MAX_WORDS, " words"), "max_chars": _whole(1)}


@dataclass(frozen=True)
class DecodeOptions:
    """How to decode a caption. Frozen: equal options are one key, for a cache or for a batch of
    images that can be captioned together."""

    beam_size: int = 3  # 1: greedy
    max_len: int = 20  # words, never the <end> token
    # rank finished captions by log p / length**P (length counts <end>); 0: by log p
    length_penalty: float = 0.0
    # hard-attention models only: one of HARD_ATTENTION ("sample": s_t ~ Multinoulli(alpha_t))
    hard_attention: str = "expected"
    unfamiliar_below: float = UNFAMILIAR_BELOW
    # how many of the search's best finished captions to return (CaptionResult.alternatives), at most
    # beam_size: the search goes on until no open beam can beat the N-th best
    num_captions: int = 1
    # <unk> stands for every word the vocabulary lacks: a caption shown to a person never holds it
    # unless asked for (True: the search may choose it, as a word like any other)
    allow_unk: bool = False
    # a character budget: the best caption whose printed text (as the tokenizer joins it) has at
    # most this many characters, found inside the search, never cut (search.budget); None: no budget
    max_chars: int | None = None

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            reason = _RULES[f.name](value)
            if reason is not None:
                raise OptionError(f.name, value, reason)
        if self.num_captions > self.beam_size:
            raise OptionError("num_captions", self.num_captions,
                              f"more than the beam size ({self.beam_size}): the alternatives are the beam's "
                              "finished captions (raise the beam size)")

    @property
    def greedy(self) -> bool:
        """Width 1 with nothing that needs a beam (a length penalty, a character budget): the most
        likely next word at every step."""
        return self.beam_size == 1 and self.length_penalty == 0 and self.max_chars is None


def parser(option: str, kind: type = int) -> Callable[[str], object]:
    """An argparse ``type=`` for the field ``option``: the text as ``kind``, held to the field's rule
    (one line when refused)."""
    return _typed(_FLAG_RULES.get(option, _RULES[option]), kind)


def _typed(rule: Callable[[object], str | None], kind: type) -> Callable[[str], object]:
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a {'whole number' if kind is int else 'number'}: "
                                             f"{text!r}") from None
        reason = rule(value)
        if reason is not None:
            raise argparse.ArgumentTypeError(f"{reason}, got {text}")
        return value

    return parse


def at_least(low: int) -> Callable[[str], object]:
    """An argparse ``type=`` for a whole number of at least ``low`` that is not a decoding option
    (images per batch, threads, workers): the same words as the options' own refusals."""
    return _typed(_whole(low), int)


count = at_least(1)  # images per batch, threads


@dataclass(frozen=True)
class Tokens:
    """The vocabulary's special ids a search needs. ``unk`` None: the vocabulary has no <unk> (a
    test's table of words). ``spelling``: how each token prints (``data.vocab.Spelling``), which
    a character budget needs; None: unknown (a search with ``max_chars`` refuses it)."""

    start: int
    end: int
    pad: int
    unk: int | None = None
    spelling: Spelling | None = None  # equal only to itself: a cheap key for the search's graphs

    @classmethod
    def of(cls, vocab) -> "Tokens":
        """A vocabulary's (``data.vocab.Vocabulary``, or anything with its four ids and spelling)."""
        return cls(start=vocab.start, end=vocab.end, pad=vocab.pad, unk=vocab.unk,
                   spelling=getattr(vocab, "spelling", None))

    def budget_spelling(self, options: DecodeOptions) -> Spelling | None:
        """The spelling the options' character budget needs (None without a budget); refused in
        one line where these tokens do not know it."""
        if options.max_chars is None:
            return None
        if self.spelling is None:
            raise ValueError("max_chars needs to know how the vocabulary prints its tokens: "
                             "build the tokens with Tokens.of(vocabulary)")
        return self.spelling

    def never(self, options: DecodeOptions) -> tuple[int, ...]:
        """The ids no caption may hold: <start> and <pad>, and <unk> unless the options allow it."""
        unk = () if self.unk is None or options.allow_unk else (self.unk,)
        return (self.start, self.pad, *unk)
