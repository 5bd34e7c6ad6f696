"""A run folder's checkpoints read the way studies score them: the step of its last.pt,
the model at that step (the moving average of the weights where the run keeps one), and a
slim copy of a finished run for scoring elsewhere.

The rule is the same for every variant a study compares: the weights at the run's last
step, whatever validation said on the way (best.pt is chosen by validation, so it would
give each variant a different stopping rule).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from captioner.inference import Captioner
from captioner.io.checkpoint import Checkpoint, load_checkpoint
from captioner.io.folder import is_model_folder
from captioner.train.averaging import same_encoder
from captioner.train.config import TrainConfig


def last_step(run_dir: Path) -> int | None:
    """The step of ``run_dir/last.pt``; None when there is none (not started)."""
    last = run_dir / "last.pt"
    return _train_state(load_checkpoint(last), last).step if last.is_file() else None


def run_device(run_dir: Path) -> str:
    """The device a run's config named (optim.device; "auto": the machine's own)."""
    return run_config(load_checkpoint(run_dir / "last.pt")).optim.device


def run_config(ckpt: Checkpoint) -> TrainConfig:
    """The config of the run a last.pt was saved by."""
    return TrainConfig.from_dict(_train_state(ckpt).config)


def _train_state(ckpt: Checkpoint, path: Path | None = None):
    if ckpt.train_state is None:
        raise ValueError(f"{path or 'the checkpoint'} is not a run's last.pt: it has no training state")
    return ckpt.train_state


def at_last_step(ckpt: Checkpoint) -> Checkpoint:
    """A last.pt as it is scored: its weights, or their moving average where the run keeps one,
    with the familiarity record that belongs to those weights. The average's own record
    (``train_state.weight_average.familiarity``, fitted on the averaged encoder at the end of
    the run) where there is one; the raw weights' record where the averaged encoder is the raw
    one (a frozen encoder); else none (familiarity unknown rather than measured against
    another encoder's features)."""
    average = _train_state(ckpt).weight_average
    if average is None:
        return ckpt
    record = average.familiarity
    if record is None and same_encoder(average.tensors, ckpt.state_dict):
        record = ckpt.familiarity
    return replace(ckpt, state_dict=average.tensors, familiarity=record)


def model_at_last_step(ckpt: Checkpoint) -> Captioner:
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


def slim_checkpoint(ckpt: Checkpoint) -> dict:
    """A finished run's last.pt as it is scored (model_at_last_step), as the file holds it: the
    weights at the last step, their moving average where the recipe keeps one, with the step,
    training time and config, and the familiarity record of those weights; no optimizer state
    (about a quarter of the size; it cannot be resumed)."""
    ts = _train_state(ckpt)
    return {**at_last_step(ckpt).to_dict(),
            "train_state": {"step": ts.step, "epoch": ts.epoch, "batch_in_epoch": ts.batch_in_epoch,
                            "train_seconds": ts.train_seconds, "config": ts.config}}
