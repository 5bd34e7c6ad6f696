"""Checkpoints: one file, tensors and plain data only.

A checkpoint holds the model's state_dict, its config, the vocabulary and the
preprocessing as plain data, so it rebuilds its model with no other file. It is read with
``torch.load(weights_only=True)``: a file that would need to run code to unpickle is refused.
Writes are atomic (temporary file in the same folder, fsync, rename), so a crash during a
save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import torch

FORMAT = "captioner-checkpoint"
VERSION = 1


class CheckpointError(ValueError):
    """The file is not a usable captioner checkpoint; the message says why."""


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """torch.save to a temporary file beside ``path``, then rename over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # the permissions a plain open() would give, not mkstemp's 0600
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def make_checkpoint(*, model_state: dict, model_config: dict, vocab: list[str], preprocess: dict,
                    meta: dict | None = None, train_state: dict | None = None) -> dict:
    ckpt = {
        "format": FORMAT,
        "version": VERSION,
        "model_config": model_config,
        "vocab": list(vocab),
        "preprocess": preprocess,
        "state_dict": model_state,
        "meta": dict(meta or {}),
    }
    if train_state is not None:
        ckpt["train_state"] = train_state
    return ckpt


def _weights_only_reason(message: str) -> str:
    """The line of torch's long weights-only error that says what was found."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith(("Trying to load unsupported", "Unsupported")):
            return ln
    return lines[-1] if lines else message


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict:
    """Read and validate a checkpoint, never running code from the file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        detail = _weights_only_reason(str(e))
        if "GLOBAL" in detail or "global" in detail:
            raise CheckpointError(
                f"refusing to load {path}: it holds Python objects other than tensors and plain data, "
                "and unpickling them could run code. A captioner checkpoint never needs that; "
                f"load only files you trust. ({detail})") from e
        raise CheckpointError(f"cannot read checkpoint {path}: not a valid checkpoint file ({detail})") from e
    except Exception as e:  # truncated file, not a zip/pickle at all, ...
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from e
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a captioner checkpoint (no '{FORMAT}' header)")
    if ckpt.get("version", 0) > VERSION:
        raise CheckpointError(f"{path} has format version {ckpt['version']}; this captioner reads up to {VERSION}")
    for key in ("model_config", "vocab", "preprocess", "state_dict"):
        if key not in ckpt:
            raise CheckpointError(f"{path} lacks '{key}'")
    return ckpt
