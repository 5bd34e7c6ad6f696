"""Per-image statistics of a captioner on shapes test sets, and what compare_attention.py
builds from them: pooled figures, paired bootstrap intervals, rank correlations, tables.

Every figure of the comparison is a ratio of sums over images, so that images can be
resampled and seeds pooled without changing what a figure means:

    object accuracy   sum exact / sum 1              (per image: the caption names exactly its objects)
    relation accuracy sum true / sum stated          (micro-average over the stated relations)
    pointing          sum hits / sum scored words    (the same words for every model, see below)
    mass in box       sum mass / sum scored words
    entropy           sum entropy / sum steps        (nats, over the same reference words)
    CIDEr             sum score / sum 1              (CIDEr-D per image, document frequencies of the whole set)
    BLEU-4            corpus BLEU from summed n-gram counts (pycocoevalcap's "closest" reference length)

Image statistics are stored as columns: ``{name: [value per image]}``; ``bleu`` holds,
per image, [test length, reference length, guesses 1..4, correct 1..4].
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

# figure -> (numerator column, denominator column); None: 1 per image and run ("runs")
RATIOS: dict[str, tuple[str, str | None]] = {
    "object_accuracy": ("obj", None),
    "relation_accuracy": ("rel_true", "rel_n"),
    "pointing": ("pt_hit", "pt_n"),
    "pointing_chance": ("pt_chance", "pt_n"),  # a uniformly random cell
    "mass_in_box": ("pt_mass", "pt_n"),
    "entropy": ("ent_sum", "ent_n"),
    "pointing_generated": ("gen_hit", "gen_n"),
    "CIDEr": ("cider", None),
}
FIGURES = ("object_accuracy", "relation_accuracy", "pointing", "mass_in_box", "entropy", "BLEU-4", "CIDEr")


# ------------------------------------------------------------------------------- BLEU

def bleu_stats(gts: Mapping[int, Sequence[str]], res: Mapping[int, Sequence[str]], ids: Sequence[int]) -> np.ndarray:
    """(N, 10) per-image BLEU counts, in ``ids`` order, from tokenised captions (as
    ``captioner.metrics._prepare`` gives them): [test length, closest reference length,
    n-gram guesses n = 1..4, clipped matches n = 1..4]."""
    from pycocoevalcap.bleu.bleu_scorer import cook_refs, cook_test

    rows = []
    for i in ids:
        test = res[i][0]
        refs = cook_refs(gts[i], n=4)
        cooked = cook_test(test, refs, n=4)
        testlen = cooked["testlen"]
        reflen = min((abs(length - testlen), length) for length in refs[0])[1]  # "closest", ties: the shorter
        rows.append([testlen, reflen, *cooked["guess"], *cooked["correct"]])
    return np.asarray(rows, dtype=np.float64).reshape(-1, 10)


def corpus_bleu4(stats: np.ndarray) -> np.ndarray:
    """BLEU-4 from summed counts: stats (..., 10) -> (...). pycocoevalcap's formula, its
    smoothing constants included, so that the full set gives its corpus BLEU-4."""
    tiny, small = 1e-15, 1e-9
    testlen, reflen = stats[..., 0], stats[..., 1]
    guess, correct = stats[..., 2:6], stats[..., 6:10]
    log_p = np.log((correct + tiny) / (guess + small)).sum(-1) / 4
    ratio = (testlen + tiny) / (reflen + small)
    brevity = np.where(ratio < 1, 1 - 1 / np.maximum(ratio, tiny), 0.0)
    return np.exp(log_p + brevity)


# --------------------------------------------------------------------------- figures

def figures(stats: Mapping[str, np.ndarray], weights: np.ndarray | None = None) -> dict[str, float | None]:
    """Every figure from per-image columns (each (N,)); ``weights`` (R, N) gives R
    resampled sets at once (counts of each image), then each figure is (R,)."""
    n = len(next(iter(stats.values())))
    w = np.ones((1, n)) if weights is None else np.asarray(weights, dtype=np.float64)
    out: dict = {}
    for name, (num, den) in RATIOS.items():
        if num not in stats:
            out[name] = None
            continue
        top = w @ np.asarray(stats[num], dtype=np.float64)
        # Pooled seeds: an image's counts are summed over its runs, so are its captions.
        bottom = w @ np.asarray(stats.get(den or "runs", np.ones(n)), dtype=np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            value = np.where(bottom > 0, top / np.where(bottom > 0, bottom, 1), np.nan)
        out[name] = value
    out["BLEU-4"] = corpus_bleu4(w @ np.asarray(stats["bleu"], dtype=np.float64)) if "bleu" in stats else None
    if weights is None:
        return {k: (None if v is None or np.isnan(v[0]) else float(v[0])) for k, v in out.items()}
    return out


def pool(parts: Sequence[Mapping[str, Sequence]]) -> dict[str, np.ndarray]:
    """Sum the per-image columns of several runs on the same images (the seeds of a
    variant): a pooled figure is then over every (seed, image) caption. ``runs`` counts
    them, the denominator of the per-caption figures (object accuracy, CIDEr)."""
    keys = set.intersection(*(set(p) for p in parts))
    pooled = {k: np.sum([np.asarray(p[k], dtype=np.float64) for p in parts], axis=0) for k in keys}
    n = len(np.asarray(next(iter(parts[0].values()))))
    pooled["runs"] = np.sum([np.asarray(p.get("runs", np.ones(n)), dtype=np.float64) for p in parts], axis=0)
    return pooled


def concat(parts: Sequence[Mapping[str, Sequence]]) -> dict[str, np.ndarray]:
    """Join the columns of several test sets into one set of images."""
    keys = set.intersection(*(set(p) for p in parts))
    return {k: np.concatenate([np.asarray(p[k], dtype=np.float64) for p in parts]) for k in keys}


# ------------------------------------------------------------------------- bootstrap

def bootstrap_weights(n_images: int, resamples: int, seed: int = 0) -> np.ndarray:
    """(R, N) counts: R resamples of N images with replacement. The same matrix is used
    for every variant, so a difference is paired: both sides see the same images."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(n_images, np.full(n_images, 1 / n_images), size=resamples).astype(np.float64)


def paired_difference(variant: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], weights: np.ndarray,
                      level: float = 0.95) -> dict[str, dict | None]:
    """Per figure: variant minus reference on the full set, and the percentile interval
    of that difference over the resampled sets (``weights`` from bootstrap_weights)."""
    full_v, full_r = figures(variant), figures(reference)
    boot_v, boot_r = figures(variant, weights), figures(reference, weights)
    lo_q, hi_q = 100 * (1 - level) / 2, 100 * (1 + level) / 2
    out: dict[str, dict | None] = {}
    for name in full_v:
        if full_v[name] is None or full_r.get(name) is None:
            out[name] = None
            continue
        diff = boot_v[name] - boot_r[name]
        diff = diff[~np.isnan(diff)]
        lo, hi = (np.percentile(diff, [lo_q, hi_q]) if len(diff) else (math.nan, math.nan))
        out[name] = {"diff": full_v[name] - full_r[name], "lo": float(lo), "hi": float(hi)}
    return out


# -------------------------------------------------------------------------- rankings

def ranks(values: Sequence[float]) -> np.ndarray:
    """Ranks from 1 (the smallest), ties sharing their mean rank."""
    v = np.asarray(values, dtype=np.float64)
    order = np.argsort(v, kind="stable")
    r = np.empty(len(v))
    i = 0
    while i < len(v):
        j = i
        while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
            j += 1
        r[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return r


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = math.sqrt(float((ra ** 2).sum() * (rb ** 2).sum()))
    return float((ra * rb).sum() / den) if den else math.nan


def kendall_tau_b(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's tau-b (ties in either list counted as neither concordant nor discordant)."""
    n = len(a)
    concordant = discordant = ties_a = ties_b = 0
    for i in range(n):
        for j in range(i + 1, n):
            da, db = np.sign(a[i] - a[j]), np.sign(b[i] - b[j])
            if da == 0 and db == 0:
                continue
            if da == 0:
                ties_a += 1
            elif db == 0:
                ties_b += 1
            elif da == db:
                concordant += 1
            else:
                discordant += 1
    den = math.sqrt((concordant + discordant + ties_a) * (concordant + discordant + ties_b))
    return (concordant - discordant) / den if den else math.nan
