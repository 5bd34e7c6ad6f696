"""CIDEr-D with document frequencies from a fixed reference corpus: the reward of
self-critical training, and the COCO evaluation's CIDEr.

A caption x is a vector g_n(x) per n-gram order n = 1..4 of TF-IDF weights,

    g_n(x)_w = tf_x(w) * (log N - log max(1, df(w)))

where N is the number of images of the corpus and df(w) the number of corpus images
among whose references the n-gram w appears. A candidate c scores against the m
references s_1..s_m of its image

    CIDEr-D_n(c, S) = 1/m sum_j exp(-(l_c - l_j)^2 / (2 sigma^2))
                       * sum_w min(g_n(c)_w, g_n(s_j)_w) g_n(s_j)_w / (|g_n(c)| |g_n(s_j)|)
    CIDEr-D(c, S)   = 10 * 1/4 sum_{n=1..4} CIDEr-D_n(c, S),     sigma = 6,

with l the caption's length: a Gaussian length penalty, and the candidate's weights
clipped at the reference's, so that repeating a word earns nothing (the "-D" of
Vedantam et al. 2015). This is what pycocoevalcap's ``Cider`` computes (the COCO
leaderboard's "CIDEr" is this CIDEr-D); its lengths count bigrams, l - 1, which gives the
same differences here (an empty candidate scores 0 either way, and a reference is never
empty). pycocoevalcap takes N and df from the very captions it scores; self-critical
training needs them fixed, from the training split's references, whatever is scored:
:class:`CiderD` computes them once from a given corpus and keeps them. :func:`cider_d`
is pycocoevalcap's corpus-level form (df from the scored images' own references).

Captions are tokenised as the metrics tokenise them: with the data set's tokenizer
(:func:`captioner.data.vocab.tokenize`, PTB, unless another is given). An n-gram seen in one
corpus image only has the idf of an unseen one (log N), so only n-grams of df >= 2 are
stored: most 4-grams of COCO are seen once.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from captioner.data.vocab import PTB, Tokenizer

NGRAMS = 4
SIGMA = 6.0

Ngram = tuple[str, ...]


def ngram_counts(tokens: Sequence[str], n: int = NGRAMS) -> Counter[Ngram]:
    """Term frequencies of the 1..n-grams of a tokenised caption."""
    return Counter(tuple(tokens[i:i + k]) for k in range(1, n + 1) for i in range(len(tokens) - k + 1))


@dataclass(frozen=True)
class References:
    """One image's references, weighed once: for every n-gram, the (reference, weight) pairs
    of the references that hold it; each reference's norm per order, and its length."""

    weights: dict[Ngram, list[tuple[int, float]]]
    norms: list[list[float]]  # (m, n)
    lengths: list[int]  # (m,)

    def __len__(self) -> int:
        return len(self.lengths)


class CiderD:
    """CIDEr-D against document frequencies computed once from ``corpus``: one sequence of
    reference captions (raw text) per image. Empty references are dropped, and an image
    with none does not count in N."""

    def __init__(self, corpus: Iterable[Sequence[str]], *, n: int = NGRAMS, sigma: float = SIGMA,
                 tokenizer: Tokenizer = PTB):
        self.n, self.sigma = n, sigma
        self.tokenize = tokenizer.scored  # the metrics' tokens: chars2's punctuation left out
        df: Counter[Ngram] = Counter()
        images = 0
        for captions in corpus:
            seen = set()
            for caption in captions:
                seen.update(ngram_counts(self.tokenize(caption), n))
            if seen:
                images += 1
                df.update(seen)
        if images == 0:
            raise ValueError("CIDEr-D needs a corpus with at least one reference caption")
        self.images = images
        self.log_n = math.log(images)
        self.df = {g: c for g, c in df.items() if c >= 2}  # df 1 weighs as an unseen n-gram

    def idf(self, ngram: Ngram) -> float:
        """log N - log max(1, df(ngram))."""
        return self.log_n - math.log(self.df.get(ngram, 1))

    def vector(self, tokens: Sequence[str]) -> tuple[dict[Ngram, float], list[float]]:
        """g_n(x) as one dict over all orders, and |g_n(x)| for n = 1..N."""
        vec, sq = {}, [0.0] * self.n
        for g, tf in ngram_counts(tokens, self.n).items():
            w = tf * self.idf(g)
            vec[g] = w
            sq[len(g) - 1] += w * w
        return vec, [math.sqrt(s) for s in sq]

    def references(self, captions: Sequence[str]) -> References:
        """An image's reference captions (raw text), tokenised and weighed."""
        weights: dict[Ngram, list[tuple[int, float]]] = {}
        norms, lengths = [], []
        for caption in captions:
            tokens = self.tokenize(caption)
            if not tokens:
                continue
            j = len(lengths)
            vec, norm = self.vector(tokens)
            for g, w in vec.items():
                weights.setdefault(g, []).append((j, w))
            norms.append(norm)
            lengths.append(len(tokens))
        if not lengths:
            raise ValueError("an image needs at least one non-empty reference caption")
        return References(weights, norms, lengths)

    def score(self, candidate: str | Sequence[str], refs: References) -> float:
        """CIDEr-D of one candidate (raw text, or tokens as :func:`tokenize` gives them)."""
        tokens = self.tokenize(candidate) if isinstance(candidate, str) else candidate
        vec, norm = self.vector(tokens)
        m, n = len(refs), self.n
        dots = [[0.0] * n for _ in range(m)]  # (m, n): sum_w min(g_c, g_s) g_s
        for g, w in vec.items():
            for j, rw in refs.weights.get(g, ()):
                dots[j][len(g) - 1] += min(w, rw) * rw
        total = 0.0
        for j in range(m):
            penalty = math.exp(-((len(tokens) - refs.lengths[j]) ** 2) / (2 * self.sigma ** 2))
            for k in range(n):
                if dots[j][k]:  # else a norm may be 0 and the term is 0
                    total += penalty * dots[j][k] / (norm[k] * refs.norms[j][k])
        return 10.0 * total / (n * m)

    def scores(self, candidates: Sequence[str | Sequence[str]], refs: Sequence[References]) -> list[float]:
        """One score per candidate, candidate i against ``refs[i]``."""
        if len(candidates) != len(refs):
            raise ValueError(f"{len(candidates)} candidates for {len(refs)} reference sets")
        return [self.score(c, r) for c, r in zip(candidates, refs)]


def cider_d(references: Mapping[Hashable, Sequence[str]],
            candidates: Mapping[Hashable, str]) -> tuple[float, dict[Hashable, float]]:
    """The COCO evaluation's CIDEr (pycocoevalcap's): document frequencies from the scored
    images' own references; the mean over images and each image's score."""
    if set(references) != set(candidates):
        raise ValueError("references and candidates must cover the same images")
    ids = list(candidates)
    scorer = CiderD(references[i] for i in ids)
    per_image = {i: scorer.score(candidates[i], scorer.references(references[i])) for i in ids}
    return sum(per_image.values()) / len(ids), per_image
