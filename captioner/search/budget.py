"""A character budget inside the search (``DecodeOptions.max_chars``): the printed length of a caption.

A caption's printed text is its tokens joined as its vocabulary's tokenizer joins them
(``Tokenizer.join``: a space between two tokens where the first takes one after it and the second
one before it, ``Tokenizer.spaces``; English words take both, a Chinese character neither). So
the printed length of a caption w_1..w_n is

    chars(w_1..w_n) = sum_t len(w_t) + #{t > 1 : after(w_{t-1}) and before(w_t)}

and adding a word never makes it shorter: chars(prefix + w) = chars(prefix) + len(w) +
[after(last) and before(w)] >= chars(prefix). <end> prints nothing.

The rule the searches follow with a budget C (``max_chars``): at every step, every extension of
an open beam whose printed length would pass C gets log p -inf, as <start> and <pad> do, and so
does <end> at the first step (a budget asks for a caption: the empty one is never an answer).
The search is otherwise the one of ``decoding``'s docstring, unchanged: the result is exactly what
the beam search of that width returns over the vocabulary with those continuations masked at
each step. No caption is cut: since printed length only grows, a prefix over C can never become a
caption within C, so dropping it at once loses nothing the budget allows. With N best, the N best
within the budget. An open beam that still fits always has a finished extension that fits (its
<end>), so an image gets no caption only when no single word fits C: then the search returns
none (``DecodedIds.ids`` empty, score -inf), never a cut one.

Plain Python: the spelling of a vocabulary (``data.vocab.Spelling``) is made once per vocabulary,
and ``Budget`` works on the arrays it is given, torch tensors in ``decoding`` and numpy arrays in
the torch-free runtime, with the same arithmetic: one definition of the rule for both.
"""

from __future__ import annotations

from dataclasses import dataclass


class Budget:
    """Each open beam's printed length so far and whether its last token takes a space after it,
    over the arrays of one search (torch tensors or numpy arrays: only operators and indexing
    are used). ``lengths`` (V,) whole numbers, ``before``/``after`` (V,) booleans: the spelling
    in the search's arrays; ``chars`` (R,) whole numbers, ``closes`` (R,) booleans: one per row
    (open beam)."""

    def __init__(self, limit: int, end: int, lengths, before, after, chars, closes):
        self.limit, self.end, self.lengths, self.before, self.after = limit, end, lengths, before, after
        self.chars, self.closes = chars, closes

    def over(self):
        """(R, V) the words each row may not take: those that would print past the budget, and
        <end> where the row holds no word yet (a budget asks for a caption). Every word prints
        at least one character, so a row of 0 characters is the empty caption."""
        gap = self.closes[:, None] & self.before[None, :]  # a space between the row's last token and the word
        over = self.chars[:, None] + self.lengths[None, :] + gap > self.limit
        over[:, self.end] = self.chars == 0
        return over

    def follow(self, rows, words) -> "Budget":
        """The budget of the open beams that extend rows ``rows`` (R',) by ``words`` (R',)."""
        chars = self.chars[rows] + self.lengths[words] + (self.closes[rows] & self.before[words])
        return self._with(chars, self.after[words])

    def take(self, rows) -> "Budget":
        """The budget of rows ``rows`` only (the images still in the batch)."""
        return self._with(self.chars[rows], self.closes[rows])

    def _with(self, chars, closes) -> "Budget":
        return Budget(self.limit, self.end, self.lengths, self.before, self.after, chars, closes)


@dataclass(frozen=True)
class NoFit:
    """Why an image has no caption: none fits the budget ``max_chars``. ``shortest``: the shortest
    of the captions the same search finds without the budget (its N best, N = its width); None:
    it ended none."""

    max_chars: int
    shortest: str | None

    @classmethod
    def among(cls, max_chars: int, captions: list[str]) -> "NoFit":
        """The budget missed, with the shortest of ``captions`` (the finished captions the search
        found without it; none: None)."""
        return cls(max_chars, min(captions, key=len) if captions else None)

    @property
    def reason(self) -> str:
        """Why, in one line: the budget and the shortest caption found (a JSON line's "error",
        beside its "image")."""
        found = ("the search without a budget ended no caption" if self.shortest is None
                 else f"the shortest found without a budget is {len(self.shortest)} characters long: "
                 f"{self.shortest!r}")
        unit = "character" if self.max_chars == 1 else "characters"
        return f"no caption fits in {self.max_chars} {unit} ({found})"

    def message(self, image: str) -> str:
        """The one line said of the image: which, the budget, and the shortest caption found."""
        return f"{image}: {self.reason}"
