"""studies.attention.stats and the table's intervals: a variant is compared with the
reference by a bootstrap over training seeds and test images together, and by the seed
means with a Welch t interval, so that a seed effect is not taken for a variant effect."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from studies.attention import stats as cs
from studies.attention import table as ct

N_IMAGES = 3000
WORDS = 3  # scored words per image


def _difficulty(seed: int = 0) -> np.ndarray:
    """(N,) per-image chance of pointing right, shared by every variant and seed: some
    images are easy, some hard, as on the real test sets."""
    return np.random.default_rng(seed).uniform(0.3, 0.95, N_IMAGES)


def _run(p: np.ndarray, offset: float, rng: np.random.Generator) -> dict:
    """One training seed's per-image columns: hits out of WORDS words, whether the caption
    names its objects and whether its one relation is true, each with the image's chance
    moved by the seed's offset."""
    q = np.clip(p + offset, 0.0, 1.0)
    return {"pt_hit": rng.binomial(WORDS, q).astype(float), "pt_n": np.full(N_IMAGES, float(WORDS)),
            "obj": (rng.random(N_IMAGES) < q).astype(float), "rel_true": (rng.random(N_IMAGES) < q).astype(float),
            "rel_named": np.ones(N_IMAGES), "rel_n": np.ones(N_IMAGES)}


def _found(offsets: dict[str, list[float]], data_seed: int = 0) -> dict:
    """What the results file gives (store.Results.found): row -> seed -> {"ids", "stats"}, on the same
    images."""
    p = _difficulty(data_seed)
    rng = np.random.default_rng(data_seed + 1)
    ids = [("test7001", i) for i in range(N_IMAGES)]
    return {row: {s: {"ids": ids, "stats": _run(p, off, rng)} for s, off in enumerate(offs)}
            for row, offs in offsets.items()}


def _covers_zero(d: dict) -> bool:
    return d["lo"] <= 0 <= d["hi"]


def test_a_seed_effect_is_not_taken_for_a_variant_effect():
    # The same per-image distribution for both rows; each training seed moves every image's
    # chance by its own offset (sd about 0.08, as additive's pointing at the quarter recipe).
    found = _found({"additive": [0.10, -0.08, 0.03], "concat": [-0.06, 0.05, -0.12]})
    summary = ct.summarise(found, "additive", ("additive", "concat"), resamples=2000)
    d = summary["vs_reference"]["concat"]["pointing"]
    assert d["diff"] == pytest.approx(-0.06, abs=0.01)
    # Resampling the images alone, seeds pooled, calls this difference real ...
    assert d["images_only"]["hi"] < 0 and d["images_only"]["hi"] - d["images_only"]["lo"] < 0.02
    # ... the interval over seeds and images does not, nor does the seed means' t interval.
    assert _covers_zero(d) and _covers_zero(d["seed_means"])
    assert _covers_zero(summary["vs_reference"]["concat"]["object_accuracy"])
    # Nothing is printed in bold: no column is called different.
    rows = [line for line in ct.markdown(summary, None, "h").splitlines() if line.startswith("| concat |")]
    assert rows and not any("**" in line for line in rows)


def test_a_variant_effect_larger_than_the_seed_spread_is_found():
    found = _found({"additive": [0.02, -0.02, 0.0], "concat": [-0.19, -0.21, -0.185]})
    summary = ct.summarise(found, "additive", ("additive", "none"), resamples=2000)
    d = summary["vs_reference"]["concat"]["pointing"]
    assert d["diff"] == pytest.approx(-0.2, abs=0.02)
    assert d["hi"] < -0.1 and d["seed_means"]["hi"] < -0.1
    # No A/A floor measured here: both intervals exclude 0, so the cell is in bold.
    table = ct.markdown(summary, None, "h")
    cells = [line for line in table.splitlines() if line.startswith("| concat |") and "[" in line]
    assert len(cells) == 2 and all(line.split(" | ")[3].startswith("**-0.19") for line in cells)


def test_seeds_of_different_variants_are_drawn_independently():
    # Each concat seed is the additive seed of the same number less 0.05: pairing the seeds
    # by their number would see a sure difference of -0.05, but seed 0 of one variant has
    # nothing to do with seed 0 of another, and the seed spread (0.1) hides such a difference.
    found = _found({"additive": [0.10, -0.10, 0.0], "concat": [0.05, -0.15, -0.05]})
    d = ct.summarise(found, "additive", ("additive", "none"), resamples=2000)["vs_reference"]["concat"]["pointing"]
    assert _covers_zero(d) and d["hi"] - d["lo"] > 0.1


def test_the_same_image_draw_for_every_variant_pairs_the_difference():
    # Every seed gives the same per-image outcome (no seed effect), and images differ a lot
    # (all or none of their words right); concat is additive with 60 images better by one word.
    easy = np.random.default_rng(3).random(N_IMAGES) < 0.6
    additive = {"pt_hit": np.where(easy, WORDS, 0).astype(float), "pt_n": np.full(N_IMAGES, float(WORDS))}
    concat = {k: v.copy() for k, v in additive.items()}
    concat["pt_hit"][np.flatnonzero(~easy)[:60]] += 1
    runs_a, runs_c = [additive] * 3, [concat] * 3
    weights = cs.bootstrap_weights(N_IMAGES, 1000, seed=0)
    d = cs.paired_difference(runs_c, runs_a, weights, cs.seed_weights(3, 1000, 0, "concat"),
                             cs.seed_weights(3, 1000, 0, "additive"))["pointing"]
    assert d["diff"] == pytest.approx(60 / (N_IMAGES * WORDS))
    # Paired over images the interval is about +-0.001 around 0.0067; drawing each variant's
    # images apart would spread it over +-0.025 (the sd of a 0.6 proportion over 3,000 images).
    assert 0.003 < d["lo"] <= d["hi"] < 0.011


def test_intervals_are_the_same_for_the_same_bootstrap_seed_and_move_with_another():
    found = _found({"additive": [0.05, -0.05, 0.0], "concat": [0.0, -0.1, 0.02]})
    first = ct.summarise(found, "additive", ("additive", "concat"), resamples=300)
    again = ct.summarise(found, "additive", ("additive", "concat"), resamples=300)
    assert first["vs_reference"] == again["vs_reference"]
    other = ct.summarise(found, "additive", ("additive", "concat"), resamples=300, seed=1)
    assert other["vs_reference"]["concat"]["pointing"]["lo"] != first["vs_reference"]["concat"]["pointing"]["lo"]
    # Another variant's seed draws do not depend on which other rows are in the table.
    more = dict(found, dot=found["concat"])
    assert (ct.summarise(more, "additive", ("additive", "concat"), resamples=300)["vs_reference"]["concat"]
            == first["vs_reference"]["concat"])


def test_seed_weights_draw_each_variants_seeds_with_replacement():
    w = cs.seed_weights(3, 5000, 0, "concat")
    assert w.shape == (5000, 3) and (w.sum(1) == 3).all()
    # All three seeds the same in 3 of 27 draws; each seed once in 6 of 27.
    assert (w.max(1) == 3).mean() == pytest.approx(3 / 27, abs=0.015)
    assert (w.max(1) == 1).mean() == pytest.approx(6 / 27, abs=0.02)
    assert not np.array_equal(w, cs.seed_weights(3, 5000, 0, "dot"))


def test_resampled_figures_are_ratios_of_sums_over_the_drawn_seed_image_records():
    a = {"pt_hit": np.array([1.0, 0.0]), "pt_n": np.array([1.0, 3.0]), "obj": np.array([1.0, 0.0])}
    b = {"pt_hit": np.array([2.0, 3.0]), "pt_n": np.array([2.0, 3.0]), "obj": np.array([1.0, 1.0])}
    images = np.array([[1.0, 1.0], [2.0, 0.0], [0.0, 2.0]])
    seeds = np.array([[1.0, 1.0], [2.0, 0.0], [0.0, 2.0]])
    f = cs.resampled_figures([a, b], images, seeds)
    # both seeds, both images: 6 hits of 9 words; seed a twice, image 0 twice: 2 of 2;
    # seed b twice, image 1 twice: 6 of 6; object accuracy counts captions alike
    assert f["pointing"].tolist() == pytest.approx([6 / 9, 1.0, 1.0])
    assert f["object_accuracy"].tolist() == pytest.approx([3 / 4, 1.0, 1.0])
    # One seed weight of ones is the seeds pooled, as the point estimate is.
    assert cs.resampled_figures([a, b], np.ones((1, 2)), np.ones((1, 2)))["pointing"][0] == pytest.approx(
        cs.figures(cs.pool([a, b]))["pointing"])


def test_student_t_quantiles_and_the_welch_interval():
    for df, t in [(1, 12.706204736174707), (2, 4.302652729911275), (3, 3.182446305284263),
                  (4, 2.7764451051977987), (10, 2.2281388519649385), (30, 2.042272456301238)]:
        assert cs.t_quantile(0.975, df) == pytest.approx(t, rel=1e-6)
    # Welch's df is not whole: check such a quantile against the density integrated numerically.
    df = 2.5
    t = cs.t_quantile(0.975, df)
    x = np.linspace(-t, t, 200001)
    density = np.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
                     - (df + 1) / 2 * np.log1p(x * x / df))
    assert np.trapezoid(density, x) == pytest.approx(0.95, abs=1e-7)
    assert cs.t_quantile(0.5, 3) == pytest.approx(0.0, abs=1e-9)
    d = cs.welch_difference([0.70, 0.60, 0.65], [0.80, 0.90, 0.85], level=0.95)
    # sd 0.05 on each side: se = 0.05 * sqrt(2 / 3), Welch's df = 4
    half = 2.7764451051977987 * 0.05 * np.sqrt(2 / 3)
    assert d["diff"] == pytest.approx(-0.2) and d["df"] == pytest.approx(4.0)
    assert (d["lo"], d["hi"]) == pytest.approx((-0.2 - half, -0.2 + half))
    assert cs.welch_difference([0.7], [0.8, 0.9]) is None  # one seed: no spread to judge by


@pytest.mark.slow
def test_the_two_level_bootstrap_stays_fast_for_the_full_table():
    # 14 variants x 3 seeds x 3,000 images x 2,000 resamples, as the full table has.
    found = _found({f"v{k}": [0.0, 0.01, -0.01] for k in range(14)})
    for seeds in found.values():
        for s in seeds.values():
            s["stats"]["bleu"] = np.ones((N_IMAGES, 10))
    start = time.perf_counter()
    summary = ct.summarise(found, "v0", ("v0", "v1"), resamples=2000)
    assert len(summary["vs_reference"]) == 13
    assert time.perf_counter() - start < 60  # seconds on one busy core; minutes would fail


def test_with_three_seeds_the_bootstrap_alone_is_too_narrow_and_the_seed_means_decide():
    # Seeds 0.04 apart within each variant, the variants' means 0.08 apart. A bootstrap of
    # 3 seeds knows 10 multisets per variant: its seed part is about the range of the seeds
    # and excludes 0; Welch's t (4.3 to 2.8 sds of the mean, not 2) does not.
    found = _found({"additive": [0.0, 0.04, 0.08], "concat": [-0.08, -0.04, 0.0]})
    summary = ct.summarise(found, "additive", ("additive", "none"), resamples=2000)
    d = summary["vs_reference"]["concat"]["pointing"]
    assert d["hi"] < 0 and _covers_zero(d["seed_means"])
    assert not ct.beyond_noise(d, None)
    assert not any("**" in line for line in ct.markdown(summary, None, "h").splitlines()
                   if line.startswith("| concat |"))


def test_the_welch_p_value_and_one_stratum_of_weight_one_is_welchs_own_test():
    d = cs.welch_difference([0.70, 0.60, 0.65], [0.80, 0.90, 0.85])
    # t = -0.2 / (0.05 sqrt(2/3)) = -4.899 on 4 degrees of freedom: the two tails, integrated.
    t = 0.2 / (0.05 * math.sqrt(2 / 3))
    x = np.linspace(t, 200.0, 2_000_001)
    density = np.exp(math.lgamma(2.5) - math.lgamma(2.0) - 0.5 * math.log(4 * math.pi) - 2.5 * np.log1p(x * x / 4))
    assert d["p"] == pytest.approx(2 * np.trapezoid(density, x), rel=1e-4)
    assert d == cs.stratified_welch([(1.0, [0.70, 0.60, 0.65], [0.80, 0.90, 0.85])])
    assert cs.welch_difference([0.5, 0.6], [0.5, 0.6])["p"] == pytest.approx(1.0)


def test_holm_adjusts_each_p_by_its_rank_and_keeps_the_order():
    adjusted = cs.holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.005})
    # sorted: d 0.005 x 4 = 0.02; a 0.01 x 3 = 0.03; c 0.03 x 2 = 0.06; b 0.04 x 1, raised to 0.06
    assert adjusted == pytest.approx({"d": 0.02, "a": 0.03, "c": 0.06, "b": 0.06})
    assert cs.holm({"x": 0.6, "y": 0.7}) == pytest.approx({"x": 1.0, "y": 1.0})


def _on(found: dict, row: str, device: str, seeds=None) -> dict:
    for s, entry in found[row].items():
        if seeds is None or s in seeds:
            entry["trained_on"] = device
    return found


def test_each_variant_is_compared_with_the_reference_trained_on_its_own_device():
    # The reference's seeds on the GPU point 0.10 better than its seeds on the CPU (a device
    # effect); the variant, all on the GPU, points as the reference does there. Against the
    # reference's seeds pooled over devices it would seem 0.05 better; against its own
    # device's seeds (the reference's twin's too), it is not.
    found = _found({"additive": [0.0, 0.01, -0.01, 0.10, 0.11], "additive-cuda": [0.09, 0.10, 0.11],
                    "sparsemax": [0.10, 0.09, 0.11, 0.10, 0.12]})
    _on(_on(_on(found, "additive", "auto", {0, 1, 2}), "additive", "cuda", {3, 4}), "additive-cuda", "cuda")
    _on(found, "sparsemax", "cuda")
    summary = ct.summarise(found, "additive", ("additive", "none"), resamples=1000, twins=("additive-cuda",))
    d = summary["vs_reference"]["sparsemax"]["pointing"]
    assert abs(d["diff"]) < 0.02 and _covers_zero(d["seed_means"])
    pooled = ct.summarise({k: v for k, v in found.items() if k != "additive-cuda"}
                          | {"additive": {s: dict(e, trained_on="auto") for s, e in found["additive"].items()},
                             "sparsemax": {s: dict(e, trained_on="auto") for s, e in found["sparsemax"].items()}},
                          "additive", ("additive", "none"), resamples=1000)
    assert pooled["vs_reference"]["sparsemax"]["pointing"]["diff"] > 0.04
    # The twin measures the device's effect: against the reference's CPU seeds.
    twin = summary["vs_reference"]["additive-cuda"]["pointing"]
    assert twin["diff"] == pytest.approx(0.10, abs=0.02)
    # Seeds on a device no reference seed was trained on are left out, and said so.
    _on(found, "sparsemax", "mps", {4})
    summary = ct.summarise(found, "additive", ("additive", "none"), resamples=200, twins=("additive-cuda",))
    assert summary["left_out"] == {"sparsemax": ["mps"]}
    assert "sparsemax (mps)" in ct.markdown(summary, None, "h")


@pytest.mark.slow
def test_a_call_that_fails_holms_correction_is_not_in_bold():
    # concat points better by about 2.5 seed sds: Welch's p near 0.01 on its own, but
    # fourteen other comparisons share the table, and Holm's correction keeps it from a call.
    offsets = {"additive": [0.0, 0.03, -0.03], "concat": [0.07, 0.10, 0.04]}
    offsets |= {f"v{k}": [0.01 * (k % 3 - 1), 0.03, -0.03] for k in range(14)}
    summary = ct.summarise(_found(offsets), "additive", ("additive", "none"), resamples=1000)
    d = summary["vs_reference"]["concat"]["pointing"]
    assert d["seed_means"]["p"] < 0.05 and _excludes(d)  # called without the correction ...
    assert d["seed_means"]["p_holm"] >= 0.05  # ... not with it
    assert not ct.beyond_noise(d, None)
    assert not any("**" in line for line in ct.markdown(summary, None, "h").splitlines()
                   if line.startswith("| concat |"))


def _excludes(d: dict) -> bool:
    return d["lo"] > 0 or d["hi"] < 0
