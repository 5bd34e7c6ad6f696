"""The attention family on shapes, compared so that the table can rank: every variant
trained for the same number of steps, several seeds, scored on three fresh test sets, with
intervals against a reference variant (a bootstrap over seeds and images, paired over
images, and Welch's interval of the seed means) and an A/A noise floor.

    python benchmarks/compare_attention.py                       # the full table (long: see docs)
    python benchmarks/compare_attention.py --recipe quarter --rows mean,additive,concat,dot,sparsemax
    python benchmarks/compare_attention.py --check-ranking quarter --rows mean,additive,concat,dot,sparsemax
    python benchmarks/compare_attention.py --table               # rebuild the table from results only
    python benchmarks/compare_attention.py --timing              # training steps/s alone (an idle machine)
    python benchmarks/compare_attention.py --score demo-soft     # the scoring alone, on any checkpoint
    python benchmarks/compare_attention.py --score CANDIDATE.pt --against demo-soft --test-seeds 9001,9002,9003

Trained on a GPU machine, scored on another (one without the evaluation's packages, say):

    python benchmarks/compare_attention.py --rows heads4 --device cuda --train-only --jobs 12  # there
    python benchmarks/compare_attention.py --rows heads4 --pack packs                          # there
    python benchmarks/compare_attention.py --unpack packs/runs-*.tar                           # here
    python benchmarks/compare_attention.py --rows heads4                                       # here: scores

Rows and recipes are data (benchmarks/attention_rows.toml): a row is `--set` overrides of
the recipe's config (demo-soft's). Each (training, seed) runs to a fixed step count with no
validation on the way; the model scored is the one at that last step (the moving average
of the weights, as the recipe keeps one), the same rule for every variant. Each finished
(row, seed) writes results/<row>/seed<S>.json with per-image statistics; a rerun skips
what is finished and resumes a stopped training from its last.pt. See
docs/attention-comparison.md for the method.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT)]  # comparison_stats; this tree's packages
import comparison_stats as cs  # noqa: E402
import comparison_table as ct  # noqa: E402

from captioner.forced import forced_maps, forced_outputs  # noqa: E402,F401  (head_pointing imports them from here)
from train.checkpoints import last_step as _last_step  # noqa: E402
from train.checkpoints import last_step_model, load_weights, model_at_last_step, slim_checkpoint  # noqa: E402,F401
from train.checkpoints import run_device as _trained_on  # noqa: E402

DEFAULT_ROWS = Path(__file__).resolve().parent / "attention_rows.toml"
# Held by every training of the comparison: a fixed step count, no validation on the way
# (the loop still validates once at the end; that figure is kept in the result file).
FIXED = ["optim.epochs=100000", "optim.max_minutes=0", "val.every_epochs=0", "val.patience=0", "optim.threads=1"]


@dataclass(frozen=True)
class Row:
    name: str
    sets: tuple[str, ...] = ()
    train: str = ""  # the training it uses (rows sharing one are decoded differently)
    decode: dict = field(default_factory=dict, hash=False)
    requires_param: str = ""

    @property
    def train_key(self) -> str:
        return self.train or self.name


@dataclass
class Plan:
    rows: list[Row]
    reference: str
    aa_pair: tuple[str, str]
    recipes: dict[str, dict]
    twins: tuple[str, ...] = ()  # the reference's recipe on another device: its seeds there


class UsageError(SystemExit):
    """A one-line error, exit status 2."""

    def __init__(self, message: str):
        print(f"compare_attention: error: {message}", file=sys.stderr)
        super().__init__(2)


def load_plan(path: Path) -> Plan:
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        rows = [Row(r["name"], tuple(r.get("sets", ())), r.get("train", ""), dict(r.get("decode", {})),
                    r.get("requires_param", "")) for r in data["rows"]]
        return Plan(rows, data["reference"], tuple(data["aa_pair"]), dict(data["recipes"]),
                    tuple(data.get("reference_twins", ())))
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError) as e:
        raise UsageError(f"cannot read the rows file {path}: {e}") from e


def select_rows(plan: Plan, names: str | None) -> list[Row]:
    if not names:
        return plan.rows
    by_name = {r.name: r for r in plan.rows}
    unknown = [n for n in names.split(",") if n not in by_name]
    if unknown:
        raise UsageError(f"unknown row(s) {', '.join(unknown)}; rows: {', '.join(by_name)}")
    return [by_name[n] for n in names.split(",")]


def device_sets(device: str | None) -> list[str]:
    """Training on a named device in the arithmetic of the CPU runs: fp32 (the recipe's
    precision "auto" means bf16 autocast on CUDA). None: the recipe's own device."""
    return [f"optim.device={device}", "optim.precision=fp32"] if device else []


def training_sets(recipe: dict, steps: int, row: Row, seed: int, device: str | None = None) -> list[str]:
    return [*recipe.get("sets", ()), *row.sets, *FIXED, *device_sets(device), f"optim.max_steps={steps}",
            f"optim.seed={seed}"]


def check_rows(rows: list[Row], recipe: dict, steps: int) -> None:
    """Every row's overrides must name fields this code has, and its model the parameters
    it needs: else one error naming each such row and field, before anything trains."""
    from captioner.model import CaptionModel
    from train.config import load_config, model_config

    problems = []
    for row in rows:
        try:
            cfg = load_config(ROOT / recipe["config"], training_sets(recipe, steps, row, 0))
        except ValueError as e:
            unknown = re.match(r"unknown config key (\S+);", str(e))
            problems.append(f"{row.name} (unknown field {unknown.group(1)})" if unknown else f"{row.name} ({e})")
            continue
        if row.requires_param:
            model = CaptionModel(replace(model_config(cfg.model, 8), encoder_pretrained=False))
            if not any(row.requires_param in name for name, _ in model.named_parameters()):
                problems.append(f"{row.name} (its model has no parameter named *{row.requires_param}*)")
    if problems:
        raise UsageError(f"rows this code cannot run: {', '.join(problems)}; leave them out with --rows, or run "
                         "them on code that has these options")


# ------------------------------------------------------------------------ test sets

def _child_env() -> dict[str, str]:
    """A child process imports this tree's captioner and train, as this one does."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}


def ensure_test_sets(seeds: list[int], n_images: int, root: Path) -> dict[str, Path]:
    """Three fresh test sets, each `captioner shapes --train 0 --val 0 --test N --seed S`."""
    sets = {}
    for seed in seeds:
        folder = root / f"shapes-test{seed}-{n_images}"
        if not (folder / "instances_test.json").is_file():
            subprocess.run([sys.executable, "-m", "captioner.cli", "shapes", "--out", str(folder), "--train", "0",
                            "--val", "0", "--test", str(n_images), "--seed", str(seed)], check=True, env=_child_env())
        sets[f"test{seed}"] = folder
    return sets


# ------------------------------------------------------------------------ evaluation

def image_stats(records, results, forced, objects: dict, with_pointing: bool) -> dict[str, list]:
    """Per-image columns (see comparison_stats) for one test set."""
    from pycocoevalcap.cider.cider import Cider

    from captioner.grounding import object_accuracy, pointing_game, relation_accuracy
    from captioner.metrics import _prepare

    cols: dict[str, list] = {k: [] for k in ("obj", "rel_true", "rel_named", "rel_n", "ent_sum", "ent_n")}
    if with_pointing:
        cols.update({k: [] for k in ("pt_hit", "pt_n", "pt_mass", "pt_chance", "gen_hit", "gen_n")})
    for rec, res, (words, maps) in zip(records, results, forced):
        img = objects[rec.image_id]
        cols["obj"].append(float(object_accuracy(res.words, img.objects)["exact_color_shape"]))
        rel = relation_accuracy(res.words, img.objects)
        cols["rel_true"].append(rel["relations_true"])
        cols["rel_named"].append(rel["n_relations_named"])
        cols["rel_n"].append(rel["n_relations"])
        cols["ent_sum"].append(float(-(maps * np.log(np.clip(maps, 1e-30, None))).sum()))
        cols["ent_n"].append(len(words))
        if with_pointing:
            fixed = pointing_game(words, maps, img.objects, img.size)
            cols["pt_hit"].append(sum(p.hit for p in fixed))
            cols["pt_n"].append(len(fixed))
            cols["pt_mass"].append(sum(p.mass for p in fixed))
            cols["pt_chance"].append(sum(p.chance for p in fixed))
            own = pointing_game(res.words, res.alphas, img.objects, img.size)
            cols["gen_hit"].append(sum(p.hit for p in own))
            cols["gen_n"].append(len(own))
    gts, res_tok = _prepare({r.image_id: r.captions for r in records},
                            {r.image_id: res.caption for r, res in zip(records, results)})
    ids = [r.image_id for r in records]
    cols["bleu"] = cs.bleu_stats(gts, res_tok, ids).tolist()
    order = list(gts)
    _, per_image = Cider().compute_score(gts, res_tok)
    cider = dict(zip(order, (float(s) for s in per_image)))
    cols["cider"] = [cider[i] for i in ids]
    return cols


def evaluate_checkpoint(cap, decode: dict, test_sets: dict[str, Path], beam_size: int,
                        progress: bool = False) -> dict:
    """Per-image columns and figures of a Captioner on each test set."""
    import torch

    from captioner.data.coco import load_split
    from captioner.evaluation import decode_records
    from captioner.grounding import load_shape_objects
    from captioner.inference import DecodeOptions

    options = DecodeOptions(beam_size=beam_size, max_len=20, **decode)
    with_pointing = cap.model.config.attention != "mean"  # a uniform map points nowhere
    out = {}
    for name, folder in test_sets.items():
        records = load_split(folder, "test")
        with torch.inference_mode():
            results = decode_records(cap, records, options, progress=progress)
            forced = forced_maps(cap, records)
        cols = image_stats(records, results, forced, load_shape_objects(folder / "instances_test.json"),
                           with_pointing)
        out[name] = {"image_ids": [r.image_id for r in records], "stats": cols,
                     "figures": cs.figures({k: np.asarray(v) for k, v in cols.items()}),
                     "examples": {r.image_id: res.caption for r, res in list(zip(records, results))[:5]}}
    return out


# ------------------------------------------------------------------------------ runs

def result_path(out: Path, row: Row, seed: int) -> Path:
    return out / "results" / row.name / f"seed{seed}.json"


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # whole or absent: a rerun trusts what it finds


def _compact(cols: dict[str, list]) -> dict[str, list]:
    """Counts as ints, other figures to 6 decimals."""
    def one(v):
        return int(v) if float(v).is_integer() else round(float(v), 6)
    return {k: [[one(x) for x in v] if isinstance(v, list) else one(v) for v in vals] for k, vals in cols.items()}


def prepare_training_data(recipe: dict, steps: int, row: Row) -> None:
    """Generate the recipe's shapes data once, before parallel runs could race to write it."""
    from train.config import load_config

    d = load_config(ROOT / recipe["config"], training_sets(recipe, steps, row, 0)).data
    if d.generate_shapes and not (Path(d.dir) / f"captions_{d.train_split}.json").is_file():
        from captioner.data.shapes import generate_dataset

        generate_dataset(Path(d.dir), {d.train_split: d.shapes_train, d.val_split: d.shapes_val},
                         seed=d.shapes_seed, image_size=d.shapes_image_size, progress=True)


def run_job(rows: list[Row], seed: int, recipe: dict, recipe_name: str, steps: int, test_sets: dict[str, Path] | None,
            out: Path, runs: Path, beam_size: int, progress: bool = False, device: str | None = None) -> int:
    """Train one (training, seed) to ``steps`` (or resume it), then score every row that
    uses it (none when ``test_sets`` is None: train only); 130 when the training was
    interrupted (Ctrl-C), 0 when done."""
    from train.config import load_config
    from train.loop import train

    pending = [r for r in rows if not result_path(out, r, seed).is_file()]
    if not pending:
        return 0
    run_dir = runs / pending[0].train_key / f"seed{seed}"
    if _last_step(run_dir) != steps:  # not started, or stopped on the way: resume from last.pt
        cfg = load_config(ROOT / recipe["config"], training_sets(recipe, steps, pending[0], seed, device))
        resume = (run_dir / "last.pt").is_file()
        started_on = _trained_on(run_dir) if resume else cfg.optim.device
        if started_on != cfg.optim.device:  # one run, one device's arithmetic
            raise RuntimeError(f"{run_dir}: started with optim.device={started_on}, not "
                               f"{cfg.optim.device}; resume it there (--device), or delete the folder to start over")
        if cfg.optim.device.startswith("cuda"):
            import torch

            torch.backends.cudnn.allow_tf32 = False  # convolutions in full fp32, as on a CPU
            torch.backends.cuda.matmul.allow_tf32 = False
        outcome = train(cfg, run_dir, resume=resume, progress=progress)
        if outcome.reason == "interrupted":
            return 130
        if _last_step(run_dir) != steps:
            raise RuntimeError(f"{run_dir}: training ended ({outcome.reason}) at step {outcome.step}, not {steps}")
    if test_sets is None:
        return 0
    from captioner.checkpoint import load_checkpoint

    log = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    val = next((r for r in reversed(log) if "val" in r), None)  # the one validation, at the end
    last = load_checkpoint(run_dir / "last.pt")
    state = last["train_state"]
    cap = model_at_last_step(last)
    for row in pending:
        tests = evaluate_checkpoint(cap, row.decode, test_sets, beam_size, progress)
        record = {"row": row.name, "seed": seed, "recipe": recipe_name, "steps": steps, "sets": list(row.sets),
                  "decode": row.decode, "checkpoint": f"last.pt at step {steps}, its weight average if any",
                  "train_seconds": round(state["train_seconds"], 1), "trained_on": state["config"]["optim"]["device"],
                  "validation": val, "tests": tests}
        path = result_path(out, row, seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        # The per-image columns (what the table is built from) beside, compressed: about
        # 100 bytes an image as text. Written first: the summary's presence means both are whole.
        columns = {name: {"image_ids": t.pop("image_ids"), "stats": _compact(t.pop("stats"))}
                   for name, t in tests.items()}
        _atomic_write(ct.images_path(path), gzip.compress(json.dumps(columns).encode(), mtime=0))
        _atomic_write(path, (json.dumps(record, indent=1) + "\n").encode())
    return 0


def _device_of(recipe: dict, steps: int, row: Row, device: str | None) -> str:
    from train.config import load_config

    return load_config(ROOT / recipe["config"], training_sets(recipe, steps, row, 0, device)).optim.device


def _device_here(device: str) -> bool:
    import torch

    return not device.startswith("cuda") or torch.cuda.is_available()


def run_all(rows: list[Row], seeds: list[int], args, recipe: dict, steps: int, test_sets: dict[str, Path] | None,
            out: Path, runs: Path) -> list[str]:
    """Every missing (training, seed), ``args.jobs`` at a time (0: in this process);
    returns the failures."""
    from tqdm import tqdm

    by_key: dict[str, list[Row]] = {}
    for r in rows:
        by_key.setdefault(r.train_key, []).append(r)
    # A training on a device this machine lacks (a row that names cuda, run on a CPU) is left
    # out with a note, unless a finished last.pt waits to be scored: not a failure of the rest.
    here = {k: _device_here(_device_of(recipe, steps, r[0], args.device)) for k, r in by_key.items()}
    todo, absent = [], []
    for key in by_key:
        for seed in seeds:
            if all(result_path(out, r, seed).is_file() for r in by_key[key]):
                continue
            if here[key] and test_sets is not None:
                todo.append((key, seed))
                continue
            finished = _last_step(runs / key / f"seed{seed}") == steps
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
            if run_job(by_key[key], seed, recipe, args.recipe, steps, test_sets, out, runs, args.beam_size,
                       device=args.device) == 130:
                raise SystemExit(130)
            bar.update(1)
        bar.close()
        return failures
    (runs / "logs").mkdir(parents=True, exist_ok=True)
    env = {**_child_env(), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    running: list[tuple[str, subprocess.Popen]] = []
    queue = list(todo)
    try:
        _pool(queue, running, by_key, args, runs, env, bar, failures)
    except KeyboardInterrupt:  # Ctrl-C reached the trainings too: each saves its last.pt and stops
        for _, proc in running:
            proc.wait()
        print("interrupted: the same command resumes every unfinished training", file=sys.stderr)
        raise SystemExit(130)
    bar.close()
    return failures


def _pool(queue, running, by_key, args, runs: Path, env: dict, bar, failures: list[str]) -> None:
    """Start jobs as slots free up, until the queue is empty and every job has ended."""
    from tqdm import tqdm

    while queue or running:
        while queue and len(running) < args.jobs:
            key, seed = queue.pop(0)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--run-one", key, "--seed", str(seed),
                   "--rows", ",".join(r.name for r in by_key[key]), *args.passthrough]
            log = open(runs / "logs" / f"{key}-seed{seed}.log", "ab")
            running.append((f"{key} seed {seed}", subprocess.Popen(cmd, stdout=log, stderr=log, env=env)))
            log.close()
        time.sleep(1)
        for name, proc in list(running):
            if proc.poll() is None:
                continue
            running.remove((name, proc))
            bar.update(1)
            if proc.returncode == 130:
                raise KeyboardInterrupt
            if proc.returncode != 0:
                failures.append(f"{name}: exit {proc.returncode} (see its log)")
                tqdm.write(f"failed: {failures[-1]}", file=sys.stderr)


# ------------------------------------------------- trained on one machine, scored on another

PACKED = "packed"  # a marker in a run folder: packed once already
_MEMBER = re.compile(r"^([A-Za-z0-9_][A-Za-z0-9_.-]*)/seed([0-9]+)/(last\.pt|metrics\.jsonl|config\.toml)$")


def pack_runs(keys: list[str], seeds: list[int], runs: Path, steps: int, dest: Path, limit_bytes: int,
              max_files: int = 0) -> list[Path]:
    """Every finished (training, seed) not packed before, as slim checkpoints with their logs,
    in uncompressed tar files of at most ``limit_bytes`` each (weights hardly compress), and
    at most ``max_files`` files (0: no limit; the rest wait for the next call): what a
    training machine hands to the machine that scores. Returns the files written."""
    import io
    import tarfile

    import torch

    from captioner.checkpoint import load_checkpoint

    dest.mkdir(parents=True, exist_ok=True)
    start = len(list(dest.glob("runs-*.tar")))
    files: list[Path] = []
    tar, size = None, 0
    for key, seed in ((k, s) for k in keys for s in seeds):
        run_dir = runs / key / f"seed{seed}"
        if (run_dir / PACKED).exists() or not (run_dir / "last.pt").is_file():
            continue
        ckpt = load_checkpoint(run_dir / "last.pt")
        if ckpt["train_state"]["step"] != steps:
            continue
        buf = io.BytesIO()
        torch.save(slim_checkpoint(ckpt), buf)
        members = {"last.pt": buf.getvalue(), "metrics.jsonl": (run_dir / "metrics.jsonl").read_bytes(),
                   "config.toml": (run_dir / "config.toml").read_bytes()}
        need = sum(len(v) + 1024 for v in members.values())
        if tar is None or (size and size + need > limit_bytes):
            if max_files and len(files) == max_files:
                break  # the rest wait for the next --pack
            if tar is not None:
                tar.close()
            files.append(dest / f"runs-{start + len(files) + 1:03d}.tar")
            tar, size = tarfile.open(files[-1], "w"), 0
        for name, data in members.items():
            info = tarfile.TarInfo(f"{key}/seed{seed}/{name}")
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))
        size += need
        (run_dir / PACKED).touch()
        print(f"packed {key} seed {seed} into {files[-1].name}", file=sys.stderr)
    if tar is not None:
        tar.close()
    return files


def unpack_runs(files: list[Path], runs: Path, steps: int) -> list[str]:
    """Packed runs into ``runs``: only the three files a packed run has, each a plain file under
    <training>/seed<S>/, and never over a run already there. Returns the runs unpacked."""
    import tarfile

    from captioner.checkpoint import CheckpointError

    found: list[str] = []
    for file in files:
        try:
            tar = tarfile.open(file, "r")
        except (OSError, tarfile.TarError) as e:
            raise UsageError(f"cannot read {file}: {e}") from e
        with tar:
            members = tar.getmembers()
            bad = [m.name for m in members if not (m.isfile() and _MEMBER.match(m.name))]
            if bad:
                raise UsageError(f"{file}: not a pack of runs ({', '.join(bad[:3])} is no <training>/seed<S>/"
                                 "last.pt, metrics.jsonl or config.toml)")
            folders = sorted({m.name.rsplit("/", 1)[0] for m in members})
            taken = [f for f in folders if (runs / f / "last.pt").exists()]
            if taken:
                raise UsageError(f"{file}: {', '.join(taken)} already in {runs}; move it away to take the packed "
                                 "one")
            for m in members:
                target = runs / m.name
                target.parent.mkdir(parents=True, exist_ok=True)
                _atomic_write(target, tar.extractfile(m).read())
        for folder in folders:
            try:
                step = _last_step(runs / folder)
            except CheckpointError as e:
                raise UsageError(str(e)) from e
            if step != steps:
                raise UsageError(f"{file}: {folder} stopped at step {step}, not {steps}: another recipe's run?")
            found.append(folder)
    return found


# ---------------------------------------------------------------------------- timing

def time_trainings(rows: list[Row], recipe: dict, out: Path, steps: int, rounds: int, warmup: int = 5,
                   device: str | None = None) -> dict:
    """Training steps/s of each training, one thread, measured apart from the runs: short
    trainings in interleaved rounds (every variant once per round, so a busy spell of the
    machine hits all of them), the rate between the log at ``warmup`` steps and the last;
    the median of the rounds. Writes timing.json after every round."""
    import tempfile

    from train.config import load_config
    from train.loop import train

    import torch

    measured = max(warmup, steps // warmup * warmup)
    keys: dict[str, Row] = {}
    for r in rows:
        keys.setdefault(r.train_key, r)
    absent = [k for k, r in keys.items() if not _device_here(_device_of(recipe, measured, r, device))]
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
        # Trainings timed on another occasion keep their figures (each says when it was taken).
        timing = json.loads(path.read_text()) if path.is_file() else {"rates": {}}
        timing.update({"threads": 1, "measured_steps": measured, "warmup_steps": warmup, "torch": torch.__version__})
        timing["rates"].update({k: {"steps_per_s": float(np.median(v)), "rounds": [round(x, 3) for x in v],
                                    "measured": stamp} for k, v in rates.items() if v})
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(timing, indent=2) + "\n")
    return timing


# ------------------------------------------------------------------------------ main

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows-file", type=Path, default=DEFAULT_ROWS, help="rows and recipes (TOML)")
    ap.add_argument("--rows", default=None, help="comma-separated row names (default: every row of the file)")
    ap.add_argument("--recipe", default="full", help="a recipe of the rows file: full (default), half, quarter, tiny")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: the recipe's)")
    ap.add_argument("--seeds", default="0,1,2", help="training seeds (optim.seed), at least 3 for a ranking")
    ap.add_argument("--test-seeds", default="7001,7002,7003",
                    help="seeds of the three fresh test sets (never used to train or choose anything)")
    ap.add_argument("--test-images", type=int, default=1000, help="images in each test set")
    ap.add_argument("--test-root", type=Path, default=Path("data"), help="where the test sets are made")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/attention-comparison"),
                    help="results (small, meant to be committed) go under OUT/<recipe>-<steps>steps/")
    ap.add_argument("--runs", type=Path, default=Path("runs/attention-comparison"),
                    help="training runs (checkpoints, logs) go under RUNS/<recipe>-<steps>steps/")
    ap.add_argument("--jobs", type=int, default=2, help="trainings at once, one thread each (0: in this process)")
    ap.add_argument("--beam-size", type=int, default=3, help="beam of the test decoding")
    ap.add_argument("--resamples", type=int, default=2000,
                    help="bootstrap resamples (each draws every variant's seeds and the test images)")
    ap.add_argument("--bootstrap-seed", type=int, default=0,
                    help="seed of the bootstrap's draws (another one shows how much the interval ends move)")
    ap.add_argument("--table", action="store_true", help="only rebuild the table from the result files")
    ap.add_argument("--timing", action="store_true", help="only measure training steps/s (on an idle machine)")
    ap.add_argument("--skip-timing", action="store_true", help="do not measure steps/s after the trainings")
    ap.add_argument("--timing-steps", type=int, default=40, help="measured steps per timing run")
    ap.add_argument("--timing-rounds", type=int, default=3, help="interleaved timing rounds")
    ap.add_argument("--check-ranking", metavar="SHORT_RECIPE", default=None,
                    help="compare SHORT_RECIPE's ranking with --recipe's on the variants both have results for")
    ap.add_argument("--score", metavar="WEIGHTS", default=None,
                    help="only score one checkpoint (a file, or demo-soft / demo-hard) on the test sets and print "
                         "its figures: the comparison's scoring, on a model trained elsewhere")
    ap.add_argument("--device", default=None,
                    help="train on this device (cuda, cuda:1, cpu), in fp32 as on a CPU; default: the recipe's")
    ap.add_argument("--train-only", action="store_true",
                    help="train and stop: no scoring, no table (score later, here or on another machine, with the "
                         "same command without it)")
    ap.add_argument("--pack", metavar="DIR", type=Path, default=None,
                    help="only pack the finished trainings of --rows and --seeds, not packed before, as slim "
                         "checkpoints in DIR/runs-NNN.tar files (to score them on another machine)")
    ap.add_argument("--pack-mb", type=float, default=15.0, help="the largest tar file --pack writes, in MiB")
    ap.add_argument("--pack-files", type=int, default=0,
                    help="at most this many tar files (0: no limit); a later --pack takes the rest")
    ap.add_argument("--unpack", metavar="TAR", type=Path, nargs="+", default=None,
                    help="only put packed trainings into the runs folder; the normal command then scores them")
    ap.add_argument("--against", metavar="WEIGHTS", default=None,
                    help="with --score: score this checkpoint too, and print --score's minus its figures with a "
                         "paired bootstrap interval over the test images (two trained models, e.g. a candidate "
                         "demo against the shipped one)")
    ap.add_argument("--run-one", metavar="TRAINING", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        args.seed_list = [int(s) for s in args.seeds.split(",")]
        args.test_seed_list = [int(s) for s in args.test_seeds.split(",")]
    except ValueError as e:
        raise UsageError(f"--seeds and --test-seeds take comma-separated integers: {e}") from e
    if len(args.test_seed_list) != 3 or set(args.test_seed_list) & set(args.seed_list):
        raise UsageError("--test-seeds: three seeds, none of them a training seed")
    if args.against and not args.score:
        raise UsageError("--against goes with --score: --score CANDIDATE --against REFERENCE")
    if args.jobs < 0 or args.test_images < 1 or args.resamples < 1 or args.bootstrap_seed < 0:
        raise UsageError("--jobs and --bootstrap-seed must be >= 0, --test-images and --resamples >= 1")
    # What a job subprocess needs to find the same plan, data and folders.
    args.passthrough = ["--rows-file", str(args.rows_file), "--recipe", args.recipe, "--test-seeds", args.test_seeds,
                        "--test-images", str(args.test_images), "--test-root", str(args.test_root),
                        "--out", str(args.out), "--runs", str(args.runs), "--beam-size", str(args.beam_size)]
    if args.steps is not None:
        args.passthrough += ["--steps", str(args.steps)]
    if args.device:
        args.passthrough += ["--device", args.device]
    if args.train_only:
        args.passthrough.append("--train-only")
    return args


def recipe_of(plan: Plan, name: str, steps: int | None) -> tuple[dict, int]:
    if name not in plan.recipes:
        raise UsageError(f"unknown recipe {name!r}; recipes: {', '.join(plan.recipes)}")
    recipe = plan.recipes[name]
    steps = steps or int(recipe["steps"])
    if steps < 1:
        raise UsageError("--steps must be >= 1")
    return recipe, steps


def table_for(plan: Plan, rows: list[Row], out: Path, recipe_name: str, steps: int, args) -> tuple[str, dict]:
    found = ct.load_results(out, [r.name for r in rows])
    if not found:
        raise UsageError(f"no results under {out / 'results'} yet")
    try:
        summary = ct.summarise(found, plan.reference, plan.aa_pair, args.resamples, seed=args.bootstrap_seed,
                               twins=plan.twins)
    except ValueError as e:
        raise UsageError(str(e)) from e
    summary["aa_pair"] = list(plan.aa_pair)
    for r in rows:
        if r.name in summary["rows"]:
            summary["rows"][r.name]["train_key"] = r.train_key
    timing_path = out / "timing.json"
    timing = json.loads(timing_path.read_text()) if timing_path.is_file() else None
    header = (f"Recipe `{recipe_name}`: {steps:,} training steps, the weights at the last step; "
              f"{summary['n_images']:,} test images (test sets of seeds {args.test_seeds}), beam {args.beam_size}; "
              "mean ± sd over seeds.")
    devices = trained_where(found)
    for name, where in devices.items():
        summary["rows"][name]["trained_on"] = where
    return ct.markdown(summary, timing, header) + "\n\n" + devices_line(devices), summary


def trained_where(found: dict[str, dict[int, dict]]) -> dict[str, dict[str, list[int]]]:
    """row -> device its seeds were trained on (ct.load_results' "trained_on") -> those seeds."""
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


def score_only(weights: str, test_sets: dict[str, Path], beam_size: int, against: str | None = None,
               resamples: int = 2000, seed: int = 0) -> dict:
    """The comparison's figures of one checkpoint on each test set, printed; with ``against``,
    that checkpoint's too and the difference weights - against, all test sets together, with
    a 95% bootstrap interval over the test images (paired: the same images for both; two
    fixed models, so no seed part). Returns the differences (empty without ``against``)."""
    from captioner.checkpoint import CheckpointError
    from captioner.inference import Captioner

    names = ["object_accuracy", "relation_accuracy", "pointing", "pointing_generated", "pointing_chance",
             "mass_in_box", "entropy", "BLEU-4", "CIDEr"]
    scored = {}
    for w in [weights] + ([against] if against else []):
        try:
            cap = Captioner.load(w)
        except CheckpointError as e:
            raise UsageError(str(e)) from e
        tests = evaluate_checkpoint(cap, {}, test_sets, beam_size, progress=True)
        print(f"\n{w}:\n")
        print("| test set | " + " | ".join(names) + " | words scored (reference / own) |")
        print("|---" * (len(names) + 2) + "|")
        for name, t in tests.items():
            f = t["figures"]
            cells = ["n/a" if f.get(n) is None else f"{f[n]:.3f}" for n in names]
            words = f"{sum(t['stats'].get('pt_n', [])):,} / {sum(t['stats'].get('gen_n', [])):,}"
            print(f"| {name} | " + " | ".join(cells) + f" | {words} |")
        scored[w] = cs.concat([tests[n]["stats"] for n in sorted(tests)])
    if not against:
        return {}
    n = len(next(iter(scored[weights].values())))
    diff = cs.paired_difference(scored[weights], scored[against], cs.bootstrap_weights(n, resamples, seed))
    print(f"\n{weights} - {against}, {n:,} images, 95% interval over the images ({resamples:,} resamples):\n")
    print("| figure | difference | interval |\n|---|---|---|")
    for name in names:
        d = diff.get(name)
        cells = "n/a | n/a" if d is None else f"{d['diff']:+.3f} | [{d['lo']:+.3f}, {d['hi']:+.3f}]"
        print(f"| {name} | {cells} |")
    return diff


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = load_plan(args.rows_file)
    rows = select_rows(plan, args.rows)
    recipe, steps = recipe_of(plan, args.recipe, args.steps)
    out = args.out / f"{args.recipe}-{steps}steps"
    runs = args.runs / f"{args.recipe}-{steps}steps"
    if args.check_ranking:
        short_recipe, short_steps = recipe_of(plan, args.check_ranking, None)
        short_out = args.out / f"{args.check_ranking}-{short_steps}steps"
        _, short = table_for(plan, rows, short_out, args.check_ranking, short_steps, args)
        _, full = table_for(plan, rows, out, args.recipe, steps, args)
        try:
            ranking = ct.check_ranking(short, full)
        except ValueError as e:
            raise UsageError(str(e)) from e
        text = (f"Ranking under `{args.check_ranking}` ({short_steps:,} steps) against `{args.recipe}` "
                f"({steps:,} steps), means over seeds:\n\n" + ranking)
        print(text)
        (out / f"ranking-vs-{args.check_ranking}.md").write_text(text + "\n")
        return 0
    if args.table:
        text, summary = table_for(plan, rows, out, args.recipe, steps, args)
        print(text)
        (out / "table.md").write_text(text + "\n")
        (out / "table.json").write_text(json.dumps(summary, indent=2) + "\n")
        return 0
    if args.pack:
        keys = list(dict.fromkeys(r.train_key for r in rows))
        files = pack_runs(keys, args.seed_list, runs, steps, args.pack, int(args.pack_mb * 2**20), args.pack_files)
        print(f"{len(files)} file(s) written" + "".join(f"\n  {f}" for f in files))
        return 0
    if args.unpack:
        found = unpack_runs(args.unpack, runs, steps)
        print(f"{len(found)} training(s) unpacked into {runs}: {', '.join(found)}")
        return 0
    if not args.score:
        check_rows(rows, recipe, steps)
    if args.timing:
        time_trainings(rows, recipe, out, args.timing_steps, args.timing_rounds, device=args.device)
        return 0
    test_sets = (None if args.train_only and not args.score
                 else ensure_test_sets(args.test_seed_list, args.test_images, args.test_root))
    if args.score:
        score_only(args.score, test_sets, args.beam_size, args.against, args.resamples, args.bootstrap_seed)
        return 0
    if args.run_one is not None:
        mine = [r for r in rows if r.train_key == args.run_one]
        return run_job(mine, args.seed, recipe, args.recipe, steps, test_sets, out, runs, args.beam_size,
                       device=args.device)
    failures = run_all(rows, args.seed_list, args, recipe, steps, test_sets, out, runs)
    if failures:
        print("failed:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    if args.train_only:
        print(f"trained; score with the same command without --train-only (runs in {runs})", file=sys.stderr)
        return 0
    if not args.skip_timing:
        timing = out / "timing.json"
        known = json.loads(timing.read_text())["rates"] if timing.is_file() else {}
        if any(r.train_key not in known for r in rows):
            time_trainings(rows, recipe, out, args.timing_steps, args.timing_rounds)
    return main([*(argv if argv is not None else sys.argv[1:]), "--table"])


if __name__ == "__main__":
    sys.exit(main())
