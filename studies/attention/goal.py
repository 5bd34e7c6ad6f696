"""Does every seed of a recipe reach a goal? Each (row, seed) of the results file scored over
all its test images together (the table's figures, one seed at a time), each figure set
against a floor, and for each figure the row whose worst seed comes closest.

A mean over seeds can hide a seed that fails (the demo must work for whoever retrains it),
so the verdict is per seed: a row meets the goal when its every seed reaches every floor.

    python -m studies.attention goal --rows frozen-soft,frozen-sparsemax \\
        --floor object_accuracy=0.97 --floor BLEU-4=0.81
"""

from __future__ import annotations

from . import stats as cs
from .plan import UsageError

# The floors of a demo whose every seed names and points (docs/attention-comparison.md).
DEFAULT_FLOORS = {"object_accuracy": 0.97, "pointing": 0.90, "mass_in_box": 0.80, "relation_accuracy": 0.90}
FIGURES = tuple(f for f in cs.FIGURES if f != "entropy")  # those where higher is better


def parse_floors(items: list[str] | None) -> dict[str, float]:
    """DEFAULT_FLOORS with each NAME=VALUE of ``items`` set (a new figure or a new value)."""
    floors = dict(DEFAULT_FLOORS)
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or name not in FIGURES:
            raise UsageError(f"--floor takes FIGURE=VALUE with FIGURE one of {', '.join(FIGURES)}, not {item!r}")
        try:
            floors[name] = float(value)
        except ValueError:
            raise UsageError(f"--floor {name}: not a number: {value!r}") from None
    return floors


def per_seed(found: dict[str, dict[int, dict]]) -> dict[str, dict[int, dict[str, float | None]]]:
    """row -> seed -> its figures over every test image of its record."""
    return {row: {seed: cs.figures(e["stats"]) for seed, e in seeds.items()} for row, seeds in found.items()}


def verdicts(figs: dict[str, dict[int, dict]], floors: dict[str, float]) -> dict[str, list[str]]:
    """row -> what keeps it from the goal ("seed 2: pointing 0.881"; a figure not measured
    counts as missed); an empty list: every seed reaches every floor."""
    out = {}
    for row, seeds in figs.items():
        out[row] = [f"seed {s}: {k} {'n/a' if f.get(k) is None else f'{f[k]:.3f}'}"
                    for s, f in seeds.items() for k, floor in floors.items() if f.get(k) is None or f[k] < floor]
    return out


def closest(figs: dict[str, dict[int, dict]], floors: dict[str, float]) -> dict[str, tuple[str, float]]:
    """figure -> (row, its worst seed's value) for the row whose worst seed is highest."""
    out = {}
    for k in floors:
        worst = {row: min(f[k] for f in seeds.values()) for row, seeds in figs.items()
                 if all(f.get(k) is not None for f in seeds.values())}
        if worst:
            best = max(worst, key=worst.get)
            out[k] = (best, worst[best])
    return out


def markdown(figs: dict[str, dict[int, dict]], floors: dict[str, float]) -> str:
    keys = list(floors)
    lines = ["| row | seed | " + " | ".join(f"{k} >= {floors[k]:g}" for k in keys) + " |",
             "|---" * (len(keys) + 2) + "|"]
    for row, seeds in figs.items():
        for s, f in seeds.items():
            cells = ["n/a" if f.get(k) is None else (f"{f[k]:.3f}" if f[k] >= floors[k] else f"**{f[k]:.3f}**")
                     for k in keys]
            lines.append(f"| {row} | {s} | " + " | ".join(cells) + " |")
    lines += ["", "In bold: below the floor.", ""]
    for row, misses in verdicts(figs, floors).items():
        n = len(figs[row])
        lines.append(f"- {row} ({n} seeds): " + ("every seed meets the goal" if not misses else
                                                   f"misses {len(misses)} of {n * len(keys)}: {'; '.join(misses)}"))
    lines += ["", "Closest on each figure (the row whose worst seed is highest):", ""]
    lines += [f"- {k}: {row}, worst seed {v:.3f}" for k, (row, v) in closest(figs, floors).items()]
    return "\n".join(lines)
