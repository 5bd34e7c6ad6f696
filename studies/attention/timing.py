"""Training steps/s of each training of the comparison, one thread, measured apart from
its runs (on an idle machine), into timing.json beside the table's results."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .plan import ROOT, Row, by_training, device_here, device_of, prepare_training_data, training_sets


def time_trainings(rows: list[Row], recipe: dict, out: Path, steps: int, rounds: int, warmup: int = 5,
                   device: str | None = None) -> dict:
    """Short trainings in interleaved rounds (every variant once per round, so a busy spell
    of the machine hits all of them), the rate between the log at ``warmup`` steps and the
    last; the median of the rounds. Writes timing.json after every round; trainings timed
    on another occasion keep their figures (each says when it was taken)."""
    import torch

    from captioner.train.config import load_config
    from captioner.train.loop import train

    measured = max(warmup, steps // warmup * warmup)
    keys = {k: r[0] for k, r in by_training(rows).items()}
    absent = [k for k, r in keys.items() if not device_here(device_of(recipe, measured, r, device))]
    if absent:
        print(f"not timed, their device is not on this machine: {', '.join(absent)}", file=sys.stderr)
        keys = {k: r for k, r in keys.items() if k not in absent}
    rates: dict[str, list[float]] = {k: [] for k in keys}
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    prepare_training_data(recipe, measured, rows[0])
    for round_ in range(rounds):
        for key, row in keys.items():
            with tempfile.TemporaryDirectory() as tmp:
                sets = training_sets(recipe, warmup + measured, row, 0, device) + [
                    "optim.save_every=0", f"optim.log_every={warmup}", "val.limit=1", "val.beam_size=1"]
                train(load_config(ROOT / recipe["config"], sets), Path(tmp), progress=False)
                log = [json.loads(x) for x in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
                steps_log = [r for r in log if "train_seconds" in r and "val" not in r]
                first, last = steps_log[0], steps_log[-1]
                rates[key].append((last["step"] - first["step"]) / max(1e-9, last["train_seconds"]
                                                                       - first["train_seconds"]))
            print(f"timing round {round_ + 1}/{rounds}: {key} {rates[key][-1]:.2f} steps/s", file=sys.stderr)
        path = out / "timing.json"
        timing = json.loads(path.read_text()) if path.is_file() else {"rates": {}}
        timing.update({"threads": 1, "measured_steps": measured, "warmup_steps": warmup, "torch": torch.__version__})
        timing["rates"].update({k: {"steps_per_s": float(np.median(v)), "rounds": [round(x, 3) for x in v],
                                    "measured": stamp} for k, v in rates.items() if v})
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(timing, indent=2) + "\n")
    return timing


def timed(out: Path) -> set[str]:
    """The trainings timing.json has a rate for."""
    path = out / "timing.json"
    return set(json.loads(path.read_text())["rates"]) if path.is_file() else set()
