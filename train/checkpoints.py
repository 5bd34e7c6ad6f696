"""A run folder's checkpoints read the way studies score them: the step of its last.pt,
the model at that step (the moving average of the weights where the run keeps one), and a
slim copy of a finished run for scoring elsewhere.

The rule is the same for every variant a study compares: the weights at the run's last
step, whatever validation said on the way (best.pt is chosen by validation, so it would
give each variant a different stopping rule).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from captioner.checkpoint import load_checkpoint
from captioner.folder import is_model_folder
from captioner.inference import Captioner


def last_step(run_dir: Path) -> int | None:
    """The step of ``run_dir/last.pt``; None when there is none (not started)."""
    last = run_dir / "last.pt"
    return load_checkpoint(last)["train_state"]["step"] if last.is_file() else None


def run_device(run_dir: Path) -> str:
    """The device a run's config named (optim.device; "auto": the machine's own)."""
    return load_checkpoint(run_dir / "last.pt")["train_state"]["config"]["optim"]["device"]


def at_last_step(ckpt: dict) -> dict:
    """A last.pt as it is scored: its weights, or their moving average where the run keeps one,
    with the familiarity record that belongs to those weights. The average's own record
    (``train_state.weight_average.familiarity``, fitted on the averaged encoder at the end of
    the run) where there is one; the raw weights' record where the averaged encoder is the raw
    one (a frozen encoder); else none (familiarity unknown rather than measured against
    another encoder's features)."""
    average = ckpt["train_state"].get("weight_average")
    if average is None:
        return ckpt
    out = {**ckpt, "state_dict": average["tensors"]}
    record = average.get("familiarity")
    if record is not None:
        out["familiarity"] = record
    elif not same_encoder(average["tensors"], ckpt["state_dict"]):
        out.pop("familiarity", None)
    return out


def same_encoder(a: dict, b: dict) -> bool:
    """Two state dicts hold the same encoder weights (wherever each lies)."""
    keys = [k for k in a if k.startswith("encoder.")]
    return keys == [k for k in b if k.startswith("encoder.")] and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in keys)


def model_at_last_step(ckpt: dict) -> Captioner:
    """The model of a last.pt already read (left as it was): its weights, or their moving
    average where the run keeps one (as demo-soft ships), with their record (``at_last_step``)."""
    return Captioner.from_checkpoint(at_last_step(ckpt))


def last_step_model(run_dir: Path) -> Captioner:
    """model_at_last_step of ``run_dir/last.pt``."""
    return model_at_last_step(load_checkpoint(run_dir / "last.pt"))


def load_weights(weights: str | os.PathLike) -> Captioner:
    """A checkpoint file, a bundled model's name, an exported model folder, or a run folder (its
    last.pt, by last_step_model)."""
    run = Path(weights).is_dir() and not is_model_folder(weights)
    return last_step_model(Path(weights)) if run else Captioner.load(weights)


def slim_checkpoint(ckpt: dict) -> dict:
    """A finished run's last.pt as it is scored (model_at_last_step): the weights at the last
    step, their moving average where the recipe keeps one, with the step, training time and
    config, and the familiarity record of those weights; no optimizer state (about a quarter of
    the size; it cannot be resumed)."""
    ts = ckpt["train_state"]
    return {**at_last_step(ckpt),
            "train_state": {k: ts[k] for k in ("step", "epoch", "batch_in_epoch", "train_seconds", "config")}}
