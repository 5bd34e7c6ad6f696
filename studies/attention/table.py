"""The comparison's table from its results: mean and sd over seeds, each variant against
the reference by a bootstrap over training seeds and test images (paired over images) and
by Welch's interval of the seed means, the A/A floor, where each seed was trained, and the
agreement of two recipes' rankings."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from . import stats as cs
from .plan import Plan, Row, UsageError
from .store import RESULTS, Results

COLUMNS = [("object_accuracy", "object acc."), ("relation_accuracy", "relation direction"),
           ("pointing", "pointing, strict"), ("mass_in_box", "mass in box"), ("entropy", "entropy (nats)"),
           ("BLEU-4", "BLEU-4"), ("CIDEr", "CIDEr")]
CI_COLUMNS = ["object_accuracy", "relation_accuracy", "pointing", "mass_in_box", "BLEU-4", "CIDEr"]


def _device(entry: dict) -> str:
    return entry.get("trained_on", "auto")


def summarise(found: dict[str, dict[int, dict]], reference: str, aa_pair: tuple[str, str], resamples: int,
              seed: int = 0, level: float = 0.95, twins: tuple[str, ...] = ()) -> dict:
    """Mean and sd over seeds of each figure, and each variant against the reference
    trained on the same device: seeds pooled within each device, the devices weighted by
    the variant's seeds on each, with the interval of a bootstrap over seeds and images
    (seeds drawn within their device), the same over images alone (``images_only``: kept
    for the record, not for ranking) and Welch's interval of the seed means with its
    p-value (``seed_means``), Holm-adjusted over every comparison of the table (``p_holm``).

    The reference's seeds on a device are those of the reference row and of its ``twins``
    (the reference's recipe run on another device). A variant's seeds on a device that no
    reference seed was trained on are left out of its comparison (``left_out``). A twin is
    compared with the reference's seeds on the other devices: the device's own effect."""
    rows: dict[str, dict] = {}
    runs: dict[str, list[dict]] = {}
    seed_figs: dict[str, list[dict]] = {}
    devices: dict[str, list[str]] = {}
    ids = None
    for name, by_seed in found.items():
        for s in by_seed.values():
            if ids is None:
                ids = s["ids"]
            elif s["ids"] != ids:
                raise ValueError(f"row {name!r}: its results are on other test images than the rest "
                                 "(other --test-seeds or --test-images): put them in another --out")
        runs[name] = [by_seed[k]["stats"] for k in sorted(by_seed)]
        devices[name] = [_device(by_seed[k]) for k in sorted(by_seed)]
        seed_figs[name] = per_seed = [cs.figures(stats) for stats in runs[name]]
        stat = {}
        for key in [*dict(COLUMNS), "pointing_chance", "pointing_generated"]:
            vals = [f[key] for f in per_seed if f[key] is not None]
            stat[key] = None if not vals else {"mean": float(np.mean(vals)), "sd": float(np.std(vals, ddof=1))
                                               if len(vals) > 1 else None, "n": len(vals), "per_seed": vals}
        pooled = cs.pool(runs[name])
        rows[name] = {"seeds": sorted(by_seed), "figures": stat,
                      # per seed (every seed scores the same reference words)
                      "pointing_words": int(sum(pooled["pt_n"])) // len(by_seed) if "pt_n" in pooled else None,
                      "relations_named": float(np.mean([sum(r["rel_named"]) for r in runs[name]]))
                      if all("rel_named" in r for r in runs[name]) else None,
                      "relations_stated": float(np.mean([sum(r["rel_n"]) for r in runs[name]]))
                      if all("rel_n" in r for r in runs[name]) else None}
    summary = {"n_images": len(ids or []), "reference": reference, "resamples": resamples, "bootstrap_seed": seed,
               "rows": rows, "vs_reference": {}, "aa": None, "left_out": {}}
    if reference not in rows:
        return summary
    images = cs.bootstrap_weights(len(ids), resamples, seed=seed)  # (R, N): one image draw for every variant

    def select(name: str, keep) -> tuple[list[dict], list[dict]]:
        picked = [i for i, d in enumerate(devices[name]) if keep(d)]
        return [runs[name][i] for i in picked], [seed_figs[name][i] for i in picked]

    ref_rows = [reference] + [t for t in twins if t in rows]
    ref_on: dict[str, tuple[list[dict], list[dict]]] = {}
    for name in ref_rows:
        for dev in sorted(set(devices[name])):
            r, f = select(name, lambda d, dev=dev: d == dev)
            ref_on.setdefault(dev, ([], []))
            ref_on[dev][0].extend(r)
            ref_on[dev][1].extend(f)

    def draws(key: str, n: int) -> np.ndarray:
        return cs.seed_weights(n, resamples, seed, key)

    def compare(v: str, ref_by_device: dict[str, tuple[list[dict], list[dict]]], ref_key: str) -> dict | None:
        """v against the reference seeds of the same device, the devices weighted by v's seeds."""
        matched = [d for d in sorted(set(devices[v])) if d in ref_by_device]
        left = sorted(set(devices[v]) - set(matched))
        if left:
            summary["left_out"][v] = left
        if not matched:
            return None
        n = sum(devices[v].count(d) for d in matched)
        one = len(set(devices[v])) == 1 and len(ref_by_device) == 1
        strata, welch_in = [], []
        for d in matched:
            v_runs, v_figs = select(v, lambda x, d=d: x == d)
            r_runs, r_figs = ref_by_device[d]
            w = len(v_runs) / n
            strata.append((w, v_runs, r_runs, draws(v if one else f"{v}@{d}", len(v_runs)),
                           draws(ref_key if one else f"{ref_key}@{d}", len(r_runs))))
            welch_in.append((w, v_figs, r_figs))
        both = cs.stratified_difference(strata, images, level)
        only = cs.stratified_difference([(w, vr, rr, None, None) for w, vr, rr, _, _ in strata], images, level)
        out: dict[str, dict | None] = {}
        for fig, diff in both.items():
            if diff is None:
                out[fig] = None
                continue
            per = [(w, [f[fig] for f in vf if f[fig] is not None], [f[fig] for f in rf if f[fig] is not None])
                   for w, vf, rf in welch_in]
            out[fig] = {**diff, "images_only": {"lo": only[fig]["lo"], "hi": only[fig]["hi"]},
                        "seed_means": cs.stratified_welch(per, level)}
        return out

    for name in rows:
        if name == reference:
            continue
        if name in twins:  # the device's effect: the reference's seeds trained elsewhere
            mine = set(devices[name])
            elsewhere = [i for i, d in enumerate(devices[reference]) if d not in mine]
            if elsewhere:
                pool = {devices[name][0]: ([runs[reference][i] for i in elsewhere],
                                           [seed_figs[reference][i] for i in elsewhere])}
                summary["vs_reference"][name] = compare(name, pool, f"{reference}@elsewhere")
            continue
        summary["vs_reference"][name] = compare(name, ref_on, reference)
    summary["vs_reference"] = {k: v for k, v in summary["vs_reference"].items() if v is not None}
    # Holm over every call the table makes: each (variant, figure) with a seed-means p-value.
    family = {(name, fig): d["seed_means"]["p"] for name, figs in summary["vs_reference"].items()
              for fig, d in figs.items() if fig in CI_COLUMNS and d and d.get("seed_means")}
    for (name, fig), p in cs.holm(family).items():
        summary["vs_reference"][name][fig]["seed_means"]["p_holm"] = p
    summary["tests"] = len(family)
    a, b = aa_pair
    if a == reference and b in summary["vs_reference"]:
        summary["aa"] = summary["vs_reference"][b]
    return summary


def _pm(stat: dict | None, digits: int = 3) -> str:
    if stat is None:
        return "n/a"
    sd = "" if stat["sd"] is None else f" ± {stat['sd']:.{digits}f}"
    return f"{stat['mean']:.{digits}f}{sd}"


def _signed(v: float) -> str:
    return f"{round(v, 3) + 0.0:+.3f}"  # + 0.0: no "-0.000"


def _count(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f}"


def _excludes_zero(d: dict | None) -> bool:
    return d is not None and (d["lo"] > 0 or d["hi"] < 0)


ALPHA = 0.05  # the family-wise error rate of the table's calls


def beyond_noise(d: dict | None, floor: dict | None) -> bool:
    """A difference the table calls real: the interval over seeds and images excludes 0,
    the seed means' Welch test rejects 0 after Holm's correction over every call of the
    table (where it was made; else its interval excludes 0), and it is larger than the A/A
    difference."""
    if d is None or not _excludes_zero(d) or d.get("seed_means") is None:
        return False
    means = d["seed_means"]
    significant = means["p_holm"] < ALPHA if "p_holm" in means else _excludes_zero(means)
    return significant and (floor is None or abs(d["diff"]) > abs(floor["diff"]))


def _interval(d: dict | None) -> str:
    return "n/a" if d is None else f"{_signed(d['diff'])} [{_signed(d['lo'])}, {_signed(d['hi'])}]"


def _ci(d: dict | None, floor: dict | None, part: str | None = None) -> str:
    shown = d if d is None or part is None else d.get(part)
    text = _interval(shown)
    if part == "seed_means" and shown and "p_holm" in shown:
        text += f" p {shown['p_holm']:.2g}"
    return f"**{text}**" if beyond_noise(d, floor) else text


def markdown(summary: dict, timing: dict | None, header: str) -> str:
    rates = (timing or {}).get("rates", {})
    lines = [header, "", "| variant | seeds | " + " | ".join(t for _, t in COLUMNS) + " | steps/s (1 thread) |",
             "|---" * (len(COLUMNS) + 3) + "|"]
    for name, r in summary["rows"].items():
        rate = rates.get(r.get("train_key", name)) or rates.get(name)
        cells = [_pm(r["figures"][k], 2 if k == "entropy" else 3) for k, _ in COLUMNS]
        speed = "not timed" if rate is None else f"{rate['steps_per_s']:.2f}"
        lines.append(f"| {name} | {len(r['seeds'])} | " + " | ".join(cells) + f" | {speed} |")
    pointing = [r for r in summary["rows"].values() if r["pointing_words"] is not None]
    if pointing:
        chance = pointing[0]["figures"].get("pointing_chance")
        counts = sorted({r["pointing_words"] for r in pointing})
        lines += ["", f"Pointing and mass in box are scored on the same {' / '.join(f'{c:,}' for c in counts)} "
                      "words for every variant (the colour and shape words of each test image's first reference "
                      "caption that name an object uniquely present, fed to the model by teacher forcing)"
                      + (f"; a uniformly random cell scores {chance['mean']:.3f}." if chance else ".")
                      + " Entropy is over every word of those captions. Relation direction is over the relations "
                        "each variant's own captions state between two rightly named objects (chance 0.5), per seed "
                        "(named of stated): "
                      + ", ".join(f"{n} {_count(r.get('relations_named'))} of {_count(r['relations_stated'])}"
                                  for n, r in summary["rows"].items())
                      + "; n/a where the results predate the count of named relations (their checkpoints were "
                        "not kept, so they cannot be scored again without training them again)."]
    floor = summary.get("aa")
    if summary["vs_reference"]:
        ref = summary["reference"]
        head = ["", "| variant | " + " | ".join(dict(COLUMNS)[k] for k in CI_COLUMNS) + " |",
                "|---" * (len(CI_COLUMNS) + 1) + "|"]
        left = summary.get("left_out") or {}
        lines += ["", f"Difference from {ref} trained on the same device (each device's seeds pooled, the devices "
                      "weighted by the variant's seeds on each), with its 95% interval from a bootstrap over "
                      f"training seeds and test images: each of {summary.get('resamples', 0):,} resamples draws "
                      "every variant's seeds with replacement (apart for each variant and device) and the "
                      f"{summary['n_images']:,} test images with replacement (the same images for every variant). "
                      "In bold, in this table and the next, where this interval excludes 0, the seed means' Welch "
                      f"test rejects 0 after Holm's correction over all {summary.get('tests', 0)} tests of the table "
                      f"(family-wise error {ALPHA:.0%}; p below is Holm's adjusted p), and the difference is "
                      "larger than the A/A floor. A difference not in bold is no difference detected, not an "
                      "equality: its interval says how large it may be."
                      + (" Seeds left out for want of a reference on their device: "
                         + "; ".join(f"{n} ({', '.join(d)})" for n, d in left.items()) + "." if left else ""),
                  *head]
        for name, d in summary["vs_reference"].items():
            lines.append(f"| {name} | " + " | ".join(_ci(d.get(k), (floor or {}).get(k)) for k in CI_COLUMNS) + " |")
        dfs = [d[k]["seed_means"]["df"] for d in summary["vs_reference"].values() for k in CI_COLUMNS
               if d.get(k) and d[k].get("seed_means") and d[k]["seed_means"]["df"] is not None]
        span = f", {min(dfs):.1f} to {max(dfs):.1f} here" if dfs else ""
        lines += ["", f"Difference of the seed means from {ref}'s, with Welch's 95% t interval from the seeds' "
                      f"sds (Welch-Satterthwaite degrees of freedom{span}; the test images are taken as fixed):",
                  *head]
        for name, d in summary["vs_reference"].items():
            lines.append(f"| {name} | " + " | ".join(_ci(d.get(k), (floor or {}).get(k), "seed_means")
                                                     for k in CI_COLUMNS) + " |")
    if floor:
        pair = " - ".join(reversed(summary.get("aa_pair", ("additive", "concat"))))
        lines += ["", f"A/A noise floor ({pair}, one score family twice), over seeds and images: "
                  + "; ".join(f"{dict(COLUMNS)[k]} {_interval(floor[k])}" for k in CI_COLUMNS if floor.get(k))
                  + "; seed means, Welch: "
                  + "; ".join(f"{dict(COLUMNS)[k]} {_interval(floor[k]['seed_means'])}" for k in CI_COLUMNS
                              if floor.get(k)) + "."]
    else:
        lines += ["", "A/A noise floor: not measured yet (needs both rows of the A/A pair)."]
    return "\n".join(lines)


def check_ranking(short: dict, full: dict, min_rows: int = 3) -> str:
    """How the short recipe's ranking of the common variants agrees with the full one's,
    per column: Spearman, Kendall tau-b, and whether both put the same variant on top."""
    common = [n for n in full["rows"] if n in short["rows"]]
    if len(common) < min_rows:
        raise ValueError(f"only {len(common)} variant(s) have results under both recipes; at least {min_rows} "
                         "are needed to compare rankings")
    lines = [f"Variants: {', '.join(common)}", "",
             "| column | Spearman | Kendall tau-b | top, short recipe | top, full recipe | same top |",
             "|---|---|---|---|---|---|"]
    for key, title in COLUMNS:
        pairs = [(n, short["rows"][n]["figures"][key], full["rows"][n]["figures"][key]) for n in common]
        pairs = [(n, a["mean"], b["mean"]) for n, a, b in pairs if a and b]
        if len(pairs) < min_rows:
            lines.append(f"| {title} | n/a | n/a | | | |")
            continue
        names, a, b = zip(*pairs)
        top_a, top_b = names[int(np.argmax(a))], names[int(np.argmax(b))]
        lines.append(f"| {title} | {cs.spearman(a, b):+.2f} | {cs.kendall_tau_b(a, b):+.2f} | {top_a} | {top_b} "
                     f"| {'yes' if top_a == top_b else 'no'} |")
    return "\n".join(lines)



# ------------------------------------------------------------------ the table's text

def table_for(plan: Plan, rows: list[Row], folder: Path, recipe_name: str, steps: int, args) -> tuple[str, dict]:
    """The table of the records in ``folder`` (results.jsonl.gz, and timing.json where there
    is one): its markdown and its summary."""
    found = Results(folder).found([r.name for r in rows])
    if not found:
        raise UsageError(f"no results in {folder / RESULTS} yet")
    timing_path = folder / "timing.json"
    timing = json.loads(timing_path.read_text()) if timing_path.is_file() else None
    return table_of(plan, rows, found, recipe_name, steps, args, timing)


def table_of(plan: Plan, rows: list[Row], found: dict[str, dict[int, dict]], recipe_name: str, steps: int, args,
             timing: dict | None) -> tuple[str, dict]:
    """table_for on entries already read (row -> seed -> store.entry); ``args`` gives
    resamples, bootstrap_seed, and the test seeds and beam the header states."""
    try:
        summary = summarise(found, plan.reference, plan.aa_pair, args.resamples, seed=args.bootstrap_seed,
                            twins=plan.twins)
    except ValueError as e:
        raise UsageError(str(e)) from e
    summary["aa_pair"] = list(plan.aa_pair)
    for r in rows:
        if r.name in summary["rows"]:
            summary["rows"][r.name]["train_key"] = r.train_key
    chosen = [r.name for r in rows if r.checkpoint == "best" and r.name in summary["rows"]]
    weights = "the weights at the last step" + (
        f" ({', '.join(chosen)}: the checkpoint chosen on validation)" if chosen else "")
    header = (f"Recipe `{recipe_name}`: {steps:,} training steps, {weights}; "
              f"{summary['n_images']:,} test images (test sets of seeds {args.test_seeds}), beam {args.beam_size}; "
              "mean ± sd over seeds.")
    devices = trained_where(found)
    for name, where in devices.items():
        summary["rows"][name]["trained_on"] = where
    return markdown(summary, timing, header) + "\n\n" + devices_line(devices), summary


def trained_where(found: dict[str, dict[int, dict]]) -> dict[str, dict[str, list[int]]]:
    """row -> device its seeds were trained on (an entry's "trained_on") -> those seeds."""
    where: dict[str, dict[str, list[int]]] = {}
    for row, by_seed in found.items():
        for seed in sorted(by_seed):
            where.setdefault(row, {}).setdefault(by_seed[seed]["trained_on"], []).append(seed)
    return where


def _seed_list(seeds: list[int]) -> str:
    """[0, 1, 2, 4] -> "0-2, 4"."""
    spans: list[list[int]] = []
    for s in sorted(seeds):
        if spans and s == spans[-1][1] + 1:
            spans[-1][1] = s
        else:
            spans.append([s, s])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def devices_line(where: dict[str, dict[str, list[int]]]) -> str:
    """One line: where each row's seeds were trained (optim.device), rows alike grouped."""
    groups: dict[str, list[str]] = {}
    for row, by_device in where.items():
        key = "; ".join(f"{dev} {_seed_list(seeds)}" for dev, seeds in sorted(by_device.items()))
        groups.setdefault(key, []).append(row)
    return ("Seeds by the device that trained them (optim.device; auto: the machine's own): "
            + "; ".join(f"{', '.join(rows)}: {key}" for key, rows in groups.items()) + ".")
