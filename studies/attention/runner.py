"""The comparison's trainings: each (training, seed) trained to a fixed step count (or
resumed from its last.pt), then every row that uses it scored on the test sets, a pool of
jobs at a time, one thread each.

Each job is a child process (`python -m studies.attention run-one ...`) that trains,
scores and hands its records over in its run folder; this process alone adds them to the
table's results file (store.py). A rerun skips every (row, seed) the results file has, and
resumes a stopped training.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from .plan import Row, by_training, child_env, device_here, device_of, prepare_training_data, training_config
from .scoring import evaluate_checkpoint
from .store import Results, collect_handoff, compact_columns, write_handoff

INTERRUPTED = 130  # a training stopped by Ctrl-C (saved): the same command resumes it


def run_job(rows: list[Row], seed: int, recipe: dict, recipe_name: str, steps: int, test_sets: dict[str, Path] | None,
            results: Results | None, runs: Path, beam_size: int, progress: bool = False,
            device: str | None = None) -> int:
    """Train one (training, seed) to ``steps`` (or resume it), then score every row of
    ``rows`` (all using that training) that ``results`` lacks, and add their records
    there; with ``results`` None, score every row and hand the records over in the run
    folder (a job of the pool). No scoring when ``test_sets`` is None (train only).
    Returns INTERRUPTED when the training was interrupted (Ctrl-C), 0 when done."""
    import torch

    from captioner.inference import Captioner
    from captioner.io.checkpoint import load_checkpoint
    from captioner.train.loop import train

    from .checkpoints import last_step, model_at_last_step, run_config, run_device

    pending = [r for r in rows if results is None or not results.done(r.name, seed)]
    if not pending:
        return 0
    run_dir = runs / pending[0].train_key / f"seed{seed}"
    if last_step(run_dir) != steps:  # not started, or stopped on the way: resume from last.pt
        cfg = training_config(recipe, steps, pending[0], seed, device)
        resume = (run_dir / "last.pt").is_file()
        started_on = run_device(run_dir) if resume else cfg.optim.device
        if started_on != cfg.optim.device:  # one run, one device's arithmetic
            raise RuntimeError(f"{run_dir}: started with optim.device={started_on}, not "
                               f"{cfg.optim.device}; resume it there (--device), or delete the folder to start over")
        if cfg.optim.device.startswith("cuda"):
            torch.backends.cudnn.allow_tf32 = False  # convolutions in full fp32, as on a CPU
            torch.backends.cuda.matmul.allow_tf32 = False
        outcome = train(cfg, run_dir, resume=resume, progress=progress)
        if outcome.reason == "interrupted":
            return INTERRUPTED
        if last_step(run_dir) != steps:
            raise RuntimeError(f"{run_dir}: training ended ({outcome.reason}) at step {outcome.step}, not {steps}")
    if test_sets is None:
        return 0
    log = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    vals = [r for r in log if "val" in r]
    last = load_checkpoint(run_dir / "last.pt")
    state, config = last.train_state, run_config(last)
    records = []
    for row in pending:
        if row.checkpoint == "best":
            best = load_checkpoint(run_dir / "best.pt")
            chosen = best.meta["step"]
            cap, val = Captioner.from_checkpoint(best), next(r for r in reversed(vals) if r["step"] == chosen)
            metric = config.val.metric
            which = f"best.pt at step {chosen} of {steps}, chosen on validation {metric}"
        else:
            cap, val = model_at_last_step(last), vals[-1] if vals else None  # the validation at the end
            which = f"last.pt at step {steps}, its weight average if any"
        tests = evaluate_checkpoint(cap, row.decode, test_sets, beam_size, progress)
        for t in tests.values():
            t["stats"] = compact_columns(t["stats"])  # about 100 bytes an image as text
        records.append({"row": row.name, "seed": seed, "recipe": recipe_name, "steps": steps, "sets": list(row.sets),
                        "decode": row.decode, "checkpoint": which, "train_seconds": round(state.train_seconds, 1),
                        "trained_on": config.optim.device, "validation": val, "tests": tests})
    if results is None:
        write_handoff(run_dir, records)
    else:
        results.add(records)
    return 0


def run_all(rows: list[Row], seeds: list[int], args, recipe: dict, steps: int, test_sets: dict[str, Path] | None,
            results: Results, runs: Path) -> list[str]:
    """Every missing (training, seed), ``args.jobs`` at a time (0: in this process);
    returns the failures."""
    from tqdm import tqdm

    from .checkpoints import last_step

    by_key = by_training(rows)
    for key in by_key:  # records a job handed over before this process could add them
        for seed in seeds:
            collect_handoff(results, runs / key / f"seed{seed}")
    # A training on a device this machine lacks (a row that names cuda, run on a CPU) is left
    # out with a note, unless a finished last.pt waits to be scored: not a failure of the rest.
    here = {k: device_here(device_of(recipe, steps, r[0], args.device)) for k, r in by_key.items()}
    todo, absent = [], []
    for key in by_key:
        for seed in seeds:
            if all(results.done(r.name, seed) for r in by_key[key]):
                continue
            if here[key] and test_sets is not None:
                todo.append((key, seed))
                continue
            finished = last_step(runs / key / f"seed{seed}") == steps
            if test_sets is None and finished:
                continue
            (todo if here[key] or finished else absent).append((key, seed))
    done = sum(len(seeds) for _ in by_key) - len(todo) - len(absent)
    if absent:
        print(f"left out, their device is not on this machine: "
              f"{', '.join(f'{k} seed {s}' for k, s in absent)}", file=sys.stderr)
    print(f"{len(todo)} training(s) to run, {done} already finished; logs in {runs / 'logs'}", file=sys.stderr)
    if not todo:
        return []
    prepare_training_data(recipe, steps, rows[0])
    failures: list[str] = []
    bar = tqdm(total=len(todo), desc="trainings", unit="run", file=sys.stderr)
    if args.jobs == 0:
        for key, seed in todo:
            if run_job(by_key[key], seed, recipe, args.recipe, steps, test_sets, results, runs, args.beam_size,
                       device=args.device) == INTERRUPTED:
                raise SystemExit(INTERRUPTED)
            bar.update(1)
        bar.close()
        return failures
    (runs / "logs").mkdir(parents=True, exist_ok=True)
    jobs = [(key, seed, [r for r in by_key[key] if not results.done(r.name, seed)]) for key, seed in todo]
    try:
        _pool(jobs, args, results, runs, bar, failures)
    except KeyboardInterrupt:  # Ctrl-C reached the trainings too: each saves its last.pt and stops
        for key, seed, _ in jobs:
            collect_handoff(results, runs / key / f"seed{seed}")
        print("interrupted: the same command resumes every unfinished training", file=sys.stderr)
        raise SystemExit(INTERRUPTED)
    bar.close()
    return failures


def job_command(key: str, seed: int, rows: list[Row], args) -> list[str]:
    """The child process of one job: the same plan, data and folders as this one's."""
    cmd = [sys.executable, "-m", "studies.attention", "run-one", "--training", key, "--seed", str(seed),
           "--rows", ",".join(r.name for r in rows), "--rows-file", str(args.rows_file), "--recipe", args.recipe,
           "--test-seeds", args.test_seeds, "--test-images", str(args.test_images), "--test-root",
           str(args.test_root), "--runs", str(args.runs), "--beam-size", str(args.beam_size)]
    if args.steps is not None:
        cmd += ["--steps", str(args.steps)]
    if args.device:
        cmd += ["--device", args.device]
    if args.train_only:
        cmd.append("--train-only")
    return cmd


def _pool(jobs: list[tuple[str, int, list[Row]]], args, results: Results, runs: Path, bar,
          failures: list[str]) -> None:
    """Start jobs as slots free up, until none is left and every job has ended; add each
    finished job's records to ``results`` as it ends."""
    from tqdm import tqdm

    env = child_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    queue = list(jobs)
    running: list[tuple[str, int, subprocess.Popen]] = []
    try:
        while queue or running:
            while queue and len(running) < args.jobs:
                key, seed, rows = queue.pop(0)
                with open(runs / "logs" / f"{key}-seed{seed}.log", "ab") as log:
                    running.append((key, seed, subprocess.Popen(job_command(key, seed, rows, args), stdout=log,
                                                                stderr=log, env=env)))
            time.sleep(1)
            for key, seed, proc in list(running):
                if proc.poll() is None:
                    continue
                running.remove((key, seed, proc))
                bar.update(1)
                if proc.returncode == INTERRUPTED:
                    raise KeyboardInterrupt
                if proc.returncode != 0:
                    failures.append(f"{key} seed {seed}: exit {proc.returncode} (see its log)")
                    tqdm.write(f"failed: {failures[-1]}", file=sys.stderr)
                collect_handoff(results, runs / key / f"seed{seed}")
    except KeyboardInterrupt:
        for _, _, proc in running:
            proc.wait()
        raise
