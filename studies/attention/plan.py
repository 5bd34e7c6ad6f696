"""What the comparison trains: rows and recipes read from a TOML file (rows.toml beside this
module), the `--set` overrides of each (row, seed) training, and the checks made before
anything trains.

A row is `--set` overrides of the recipe's config; rows that share a training (`train`) are
decoded differently. A recipe is a config, a fixed step count and overrides of its own.
"""

from __future__ import annotations

import os
import re
import sys
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: configs are named from it
DEFAULT_ROWS = Path(__file__).resolve().parent / "rows.toml"
PROG = "python -m studies.attention"
# Held by every training of the comparison: a fixed step count, no validation on the way
# (the loop still validates once at the end; that figure is kept in the result record), unless
# a row validates to choose its checkpoint (Row.validate); never an early stop.
FIXED = ["optim.epochs=100000", "optim.max_minutes=0", "val.every_epochs=0", "val.patience=0", "optim.threads=1"]


class UsageError(SystemExit):
    """A one-line error, exit status 2."""

    def __init__(self, message: str):
        print(f"{PROG}: error: {message}", file=sys.stderr)
        super().__init__(2)


@dataclass(frozen=True)
class Row:
    name: str
    sets: tuple[str, ...] = ()
    train: str = ""  # the training it uses (rows sharing one are decoded differently)
    decode: dict = field(default_factory=dict, hash=False)
    requires_param: str = ""
    validate: bool = False  # validate every epoch (the config's val.metric keeps best.pt)
    checkpoint: str = "last"  # scored: "last" (last.pt, its weight average) or "best" (best.pt)

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


def load_plan(path: Path) -> Plan:
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        rows = [Row(r["name"], tuple(r.get("sets", ())), r.get("train", ""), dict(r.get("decode", {})),
                    r.get("requires_param", ""), bool(r.get("validate", False)), r.get("checkpoint", "last"))
                for r in data["rows"]]
        the_plan = Plan(rows, data["reference"], tuple(data["aa_pair"]), dict(data["recipes"]),
                        tuple(data.get("reference_twins", ())))
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError) as e:
        raise UsageError(f"cannot read the rows file {path}: {e}") from e
    check_checkpoint_choice(rows, path)
    return the_plan


def check_checkpoint_choice(rows: list[Row], path: Path) -> None:
    """A row scores best.pt only when its training validates, and rows sharing a training ask
    for the same training: else an error naming the rows, before anything trains."""
    problems = []
    for r in rows:
        if r.checkpoint not in ("last", "best"):
            problems.append(f'{r.name}: checkpoint must be "last" or "best", not {r.checkpoint!r}')
        elif r.checkpoint == "best" and not r.validate:
            problems.append(f'{r.name}: checkpoint = "best" needs validate = true (no validation, no best.pt)')
    for key, group in by_training(rows).items():
        if len({(r.sets, r.validate) for r in group}) > 1:
            problems.append(f"{', '.join(r.name for r in group)} share the training {key} but differ in "
                            "sets or validate")
    if problems:
        raise UsageError(f"rows file {path}: {'; '.join(problems)}")


def select_rows(plan: Plan, names: str | None) -> list[Row]:
    if not names:
        return plan.rows
    by_name = {r.name: r for r in plan.rows}
    unknown = [n for n in names.split(",") if n not in by_name]
    if unknown:
        raise UsageError(f"unknown row(s) {', '.join(unknown)}; rows: {', '.join(by_name)}")
    return [by_name[n] for n in names.split(",")]


def recipe_of(plan: Plan, name: str, steps: int | None) -> tuple[dict, int]:
    if name not in plan.recipes:
        raise UsageError(f"unknown recipe {name!r}; recipes: {', '.join(plan.recipes)}")
    recipe = plan.recipes[name]
    steps = steps or int(recipe["steps"])
    if steps < 1:
        raise UsageError("--steps must be >= 1")
    return recipe, steps


def by_training(rows: list[Row]) -> dict[str, list[Row]]:
    """Training key -> the rows that use that training, in the rows' order."""
    keys: dict[str, list[Row]] = {}
    for r in rows:
        keys.setdefault(r.train_key, []).append(r)
    return keys


def device_sets(device: str | None) -> list[str]:
    """Training on a named device in the arithmetic of the CPU runs: fp32 (the recipe's
    precision "auto" means bf16 autocast on CUDA). None: the recipe's own device."""
    return [f"optim.device={device}", "optim.precision=fp32"] if device else []


def training_sets(recipe: dict, steps: int, row: Row, seed: int, device: str | None = None) -> list[str]:
    """The overrides of one (row, seed) training; a row that validates does so every epoch
    and at its last step (best.pt kept on the config's val.metric), never stopping early."""
    validation = ["val.every_epochs=1"] if row.validate else []
    return [*recipe.get("sets", ()), *row.sets, *FIXED, *validation, *device_sets(device), f"optim.max_steps={steps}",
            f"optim.seed={seed}"]


def training_config(recipe: dict, steps: int, row: Row, seed: int, device: str | None = None):
    """The TrainConfig of one (row, seed) training."""
    from captioner.train.config import load_config

    return load_config(ROOT / recipe["config"], training_sets(recipe, steps, row, seed, device))


def device_of(recipe: dict, steps: int, row: Row, device: str | None) -> str:
    return training_config(recipe, steps, row, 0, device).optim.device


def device_here(device: str) -> bool:
    import torch

    return not device.startswith("cuda") or torch.cuda.is_available()


def check_rows(rows: list[Row], recipe: dict, steps: int) -> None:
    """Every row's overrides must name fields this code has, and its model the parameters
    it needs: else one error naming each such row and field, before anything trains."""
    from captioner.model.decoder import CaptionModel
    from captioner.train.config import model_config

    problems = []
    for row in rows:
        try:
            cfg = training_config(recipe, steps, row, 0)
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


def prepare_training_data(recipe: dict, steps: int, row: Row) -> None:
    """Generate the recipe's shapes data once, before parallel runs could race to write it."""
    d = training_config(recipe, steps, row, 0).data
    if d.generate_shapes and not (Path(d.dir) / f"captions_{d.train_split}.json").is_file():
        from captioner.data.shapes import generate_dataset

        generate_dataset(Path(d.dir), {d.train_split: d.shapes_train, d.val_split: d.shapes_val},
                         seed=d.shapes_seed, image_size=d.shapes_image_size, progress=True,
                         top_to_bottom=d.shapes_top_to_bottom)


def child_env(**more: str) -> dict[str, str]:
    """A child process imports this tree's packages (captioner, train, studies), as this
    one does."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **more}
