"""A search's ids turned into words: the typed ``CaptionResult`` the CLI, the app and the metrics
take, with each word's probability and its maps on the feature grid."""

from __future__ import annotations

from captioner.data.vocab import Vocabulary
from captioner.search.decoding import Alternative, CaptionResult, DecodedIds


def to_result(d: DecodedIds, vocab: Vocabulary, grid: tuple[int, int], alternatives: bool = False,
              length_penalty: float = 0.0) -> CaptionResult:
    """``d`` in words. ``alternatives``: the result lists ``d`` and its runners-up as Alternatives,
    each with the rank the search ordered them by where ``length_penalty`` > 0."""
    words = vocab.decode(d.ids)
    t = len(words)  # one alpha map per word; the <end> step is not shown
    heads = d.alphas_heads[:t].unflatten(-1, grid)  # (T, h, H, W), on the host already (DecodedIds)
    probs = d.log_probs.double().exp().tolist()  # (T,) or (T + 1,) with <end>
    ended = d.ids[-1:] == [vocab.end]
    text = vocab.join(words)

    def alternative(x: DecodedIds, w: list[str], text: str) -> Alternative:
        rank = x.score / len(x.ids) ** length_penalty if length_penalty > 0 else None
        return Alternative(tuple(w), x.score, text, rank)

    alts = ((alternative(d, words, text),
             *(alternative(x, w, vocab.join(w)) for x in d.runners_up for w in [vocab.decode(x.ids)]))
            if alternatives and d.ids else ())  # no ids: no caption fits the budget, nothing to list
    return CaptionResult(words, d.alphas[:t].reshape(t, *grid), d.betas[:t], d.score,
                         heads, text=text, word_probs=tuple(probs[:t]), alternatives=alts,
                         end_prob=probs[t] if ended else None)
