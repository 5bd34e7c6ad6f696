"""Per-image statistics of a captioner on shapes test sets, and what the comparison builds
from them: pooled figures, bootstrap intervals over training seeds and test images,
Welch intervals of seed means, rank correlations.

Every figure of the comparison is a ratio of sums over (seed, image) records, so that
seeds and images can be resampled and seeds pooled without changing what a figure means:

    object accuracy   sum exact / sum 1              (per image: the caption names exactly its objects)
    relation accuracy sum true / sum named           (direction, over the stated relations whose
                                                      two objects are named right; chance 0.5)
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
import zlib
from collections.abc import Mapping, Sequence

import numpy as np

# figure -> (numerator column, denominator column); None: 1 per image and run ("runs")
RATIOS: dict[str, tuple[str, str | None]] = {
    "object_accuracy": ("obj", None),
    "relation_accuracy": ("rel_true", "rel_named"),  # results from before "rel_named": n/a
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
    ``captioner.evaluation.metrics._prepare`` gives them): [test length, closest reference length,
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

def _column(stats: Mapping[str, Sequence], key: str, n: int) -> np.ndarray:
    # A missing denominator counts 1 per image: "runs" (captions per image) is 1 for one
    # run, and pool() sums it over seeds.
    if key not in stats:
        return np.ones(n)
    return np.asarray(stats[key], dtype=np.float64)


def figures(stats: Mapping[str, Sequence]) -> dict[str, float | None]:
    """Every figure from per-image columns (each (N,)), over every image once."""
    n = len(np.asarray(next(iter(stats.values()))))
    out = resampled_figures([stats], np.ones((1, n)), np.ones((1, 1)))
    return {k: (None if v is None or np.isnan(v[0]) else float(v[0])) for k, v in out.items()}


def resampled_figures(runs: Sequence[Mapping[str, Sequence]], image_weights: np.ndarray,
                      seed_weights: np.ndarray) -> dict[str, np.ndarray | None]:
    """Every figure of R sets resampled at two levels, each (R,): ``runs`` are the S seeds
    of one variant (per-image columns on the same N images), ``image_weights`` (R, N) and
    ``seed_weights`` (R, S) how often each image and each seed is drawn. A figure is a ratio
    of sums over the drawn (seed, image) records: sum_s c_rs sum_i w_ri x_si."""
    n = len(np.asarray(next(iter(runs[0].values()))))
    keys = sorted(set.intersection(*(set(r) for r in runs)) | {"runs"})
    # Every column of every seed side by side, so that one product does all the sums:
    # blocks (S, N, C) with C the columns (bleu: 10 of them) -> (N, S * C).
    width = {k: (10 if k == "bleu" else 1) for k in keys}
    start = dict(zip(keys, np.cumsum([0] + [width[k] for k in keys])))
    x = np.stack([np.column_stack([_column(r, k, n).reshape(n, -1) for k in keys]) for r in runs])  # (S, N, C)
    s, _, c = x.shape
    w = np.asarray(image_weights, dtype=np.float64)
    per_seed = (w @ x.transpose(1, 0, 2).reshape(n, s * c)).reshape(-1, s, c)  # (R, N) x (N, S*C) -> (R, S, C)
    totals = np.einsum("rs,rsc->rc", np.asarray(seed_weights, dtype=np.float64), per_seed)  # (R, C)

    def total(key: str) -> np.ndarray:
        block = totals[:, start[key]:start[key] + width[key]]
        return block if key == "bleu" else block[:, 0]

    out: dict[str, np.ndarray | None] = {}
    for name, (num, den) in RATIOS.items():
        if num not in width or (den is not None and den not in width):
            out[name] = None
            continue
        top, bottom = total(num), total(den or "runs")
        with np.errstate(invalid="ignore", divide="ignore"):
            out[name] = np.where(bottom > 0, top / np.where(bottom > 0, bottom, 1), np.nan)
    out["BLEU-4"] = corpus_bleu4(total("bleu")) if "bleu" in width else None
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


def seed_weights(n_seeds: int, resamples: int, seed: int, variant: str) -> np.ndarray:
    """(R, S) counts: R resamples of one variant's S training seeds with replacement. Each
    variant has its own stream, keyed by its name: seed 0 of one variant has nothing to do
    with seed 0 of another (not paired), and a variant's draws do not change when rows are
    added to the table."""
    rng = np.random.default_rng([seed, zlib.crc32(variant.encode())])
    return rng.multinomial(n_seeds, np.full(n_seeds, 1 / n_seeds), size=resamples).astype(np.float64)


def _runs(runs: Mapping[str, Sequence] | Sequence[Mapping[str, Sequence]]) -> list[Mapping[str, Sequence]]:
    return [runs] if isinstance(runs, Mapping) else list(runs)


def paired_difference(variant, reference, image_weights: np.ndarray, variant_seeds: np.ndarray | None = None,
                      reference_seeds: np.ndarray | None = None, level: float = 0.95) -> dict[str, dict | None]:
    """Per figure: variant minus reference, seeds pooled, on the full set, and the
    percentile interval of that difference over the resampled sets.

    ``variant`` and ``reference`` are the per-image columns of each seed (or of one run).
    ``image_weights`` (R, N), from bootstrap_weights, is the same for both sides (paired
    over images); ``variant_seeds`` and ``reference_seeds`` (R, S), from seed_weights, draw
    each side's seeds apart. Without them every seed is kept in every resample: the
    interval then covers the test images only."""
    variant, reference = _runs(variant), _runs(reference)
    r = len(image_weights)
    full_v, full_r = figures(pool(variant)), figures(pool(reference))
    boot_v = resampled_figures(variant, image_weights,
                               np.ones((r, len(variant))) if variant_seeds is None else variant_seeds)
    boot_r = resampled_figures(reference, image_weights,
                               np.ones((r, len(reference))) if reference_seeds is None else reference_seeds)
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


def stratified_difference(strata: Sequence[tuple], image_weights: np.ndarray,
                          level: float = 0.95) -> dict[str, dict | None]:
    """``paired_difference`` taken stratum by stratum and weighted: each stratum is
    (w, variant runs, reference runs, variant seed draws or None, reference seed draws or
    None), its runs the seeds trained on one device; the difference is sum_d w_d (F(v_d) -
    F(r_d)), seeds pooled within a stratum, and every resample draws the images once for
    all strata (paired) and the seeds within each stratum. One stratum of weight 1 is
    ``paired_difference``."""
    r = len(image_weights)
    full: dict[str, float | None] = {}
    boot: dict[str, np.ndarray | None] = {}
    for w, v, ref, vs, rs in strata:
        v, ref = _runs(v), _runs(ref)
        fv, fr = figures(pool(v)), figures(pool(ref))
        bv = resampled_figures(v, image_weights, np.ones((r, len(v))) if vs is None else vs)
        br = resampled_figures(ref, image_weights, np.ones((r, len(ref))) if rs is None else rs)
        for name in fv:
            missing = fv[name] is None or fr.get(name) is None or name in full and full[name] is None
            full[name] = None if missing else full.get(name, 0.0) + w * (fv[name] - fr[name])
            boot[name] = None if missing else boot.get(name, 0.0) + w * (bv[name] - br[name])
    lo_q, hi_q = 100 * (1 - level) / 2, 100 * (1 + level) / 2
    out: dict[str, dict | None] = {}
    for name, diff in full.items():
        if diff is None:
            out[name] = None
            continue
        draws = boot[name][~np.isnan(boot[name])]
        lo, hi = (np.percentile(draws, [lo_q, hi_q]) if len(draws) else (math.nan, math.nan))
        out[name] = {"diff": diff, "lo": float(lo), "hi": float(hi)}
    return out


# ------------------------------------------------------------- seed means, Welch's t

def _betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b), by its continued fraction
    (modified Lentz), on the side of x where the fraction converges fast."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1) / (a + b + 2):
        return 1.0 - _betainc(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 500):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),  # even term
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):  # odd term
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return front * f / a


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t with df (> 0, not necessarily whole) degrees of
    freedom, by bisection on its tail P(T > t) = I_{df / (df + t^2)}(df / 2, 1 / 2) / 2."""
    if not 0 < p < 1 or not df > 0:
        raise ValueError("t_quantile needs 0 < p < 1 and df > 0")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    tail = 1 - p

    def upper(t: float) -> float:
        return 0.5 * _betainc(df / 2, 0.5, df / (df + t * t))

    lo, hi = 0.0, 1.0
    while upper(hi) > tail:
        lo, hi = hi, 2 * hi
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if upper(mid) > tail else (lo, mid)
        if hi - lo < 1e-12 * hi:
            break
    return (lo + hi) / 2


def t_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with df degrees of freedom."""
    return _betainc(df / 2, 0.5, df / (df + t * t)) if t else 1.0


def welch_difference(variant: Sequence[float], reference: Sequence[float], level: float = 0.95) -> dict | None:
    """Difference of two variants' seed means, with Welch's t interval from their seed
    sds (degrees of freedom by Welch-Satterthwaite: n - 1 to 2n - 2 with n seeds each) and
    its two-sided p-value. It treats a seed's figure on the test set as one measurement and
    ignores which images were drawn. None when a side has fewer than 2 seeds."""
    return stratified_welch([(1.0, variant, reference)], level)


def stratified_welch(strata: Sequence[tuple[float, Sequence[float], Sequence[float]]],
                     level: float = 0.95) -> dict | None:
    """Welch's interval for a difference of seed means taken stratum by stratum (a stratum:
    the seeds trained on one device) and weighted: D = sum_d w_d (mean v_d - mean r_d).
    Each side's seed variance is pooled over its strata (taken as the same on every device:
    s_v^2 = sum of squares about each stratum's mean / (n_v - its strata)), so that a
    stratum of one seed adds its mean but no spread; var D = s_v^2 sum_d w_d^2 / n_vd +
    s_r^2 sum_d w_d^2 / n_rd, with Welch-Satterthwaite's degrees of freedom over the two
    sides. One stratum of weight 1 is Welch's own interval. None when a side has no more
    seeds than strata (no spread to judge by)."""
    diff, sides = 0.0, {"v": [0.0, 0, 0, 0.0], "r": [0.0, 0, 0, 0.0]}  # squares, seeds, strata, sum w^2 / n
    for w, v, r in strata:
        for key, x in (("v", v), ("r", r)):
            x = np.asarray(x, dtype=np.float64)
            if not len(x):
                return None
            side = sides[key]
            side[0] += float(((x - x.mean()) ** 2).sum())
            side[1] += len(x)
            side[2] += 1
            side[3] += w * w / len(x)
        diff += w * float(np.mean(v) - np.mean(r))
    parts = []
    for squares, n, k, spread in sides.values():
        if n <= k:
            return None
        parts.append((squares / (n - k) * spread, n - k))
    var = sum(t for t, _ in parts)
    if var == 0:
        return {"diff": diff, "lo": diff, "hi": diff, "df": None, "p": 0.0 if diff else 1.0}
    df = var ** 2 / sum(t * t / dof for t, dof in parts if t > 0)
    half = t_quantile((1 + level) / 2, df) * math.sqrt(var)
    return {"diff": diff, "lo": diff - half, "hi": diff + half, "df": float(df),
            "p": t_two_sided_p(diff / math.sqrt(var), df)}


def holm(pvalues: Mapping[object, float]) -> dict[object, float]:
    """Holm-Bonferroni adjusted p-values over a family of tests (they control the
    family-wise error rate: call a test where its adjusted p is below the level):
    the i-th smallest p times (m - i + 1), made non-decreasing, capped at 1."""
    order = sorted(pvalues, key=lambda k: pvalues[k])
    m, running, out = len(order), 0.0, {}
    for i, key in enumerate(order):
        running = max(running, min(1.0, (m - i) * pvalues[key]))
        out[key] = running
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
