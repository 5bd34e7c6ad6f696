"""What every ``captioner`` subcommand shares: the exit codes, the one-line usage error, the
checks of --device and --out made before any work, and the one way a command loads its model.

The ``captioner`` command (cli.py), ``captioner export`` (export_cli.py) and the subcommands
that train/ and app/ register all import from here, so that none of them imports another.
Nothing slow is imported until a check or a model needs it.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from captioner.search.options import at_least

if TYPE_CHECKING:
    from captioner.inference import Captioner
    from captioner.io.checkpoint import Checkpoint

EXIT_OK, EXIT_SOME_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as shells report it


class UsageError(Exception):
    """Bad arguments or inputs the user must fix; exit code 2."""


def check_device(name: str) -> str:
    """``name`` if this machine has that device ("auto": the GPU if there is one, else the CPU)."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device {name}: not a device name (cpu, cuda, cuda:N or auto)") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise UsageError(f"--device {name}: no such device (this machine has {count} CUDA "
                             f"device{'s' if count != 1 else ''}; --device cpu runs on the CPU)")
    return name


def check_out_file(path: Path | None) -> None:
    """Refuse, before any work, an output file that cannot be written (None, no --out: the
    output goes to standard output, nothing to check). Its missing folders are made now (the
    one rule of every --out), so that the file can be written when the work is done."""
    if path is None:
        return
    if path.is_dir():
        raise UsageError(f"--out {path} is a folder; give a file name, e.g. {path / 'captions.jsonl'}")
    make_folders(path.parent)
    existed = path.exists()
    try:
        open(path, "a").close()
    except OSError as e:
        raise UsageError(f"--out {path}: cannot write there ({e.strerror or e})") from None
    if not existed:
        path.unlink(missing_ok=True)


def make_folders(folder: Path, option: str = "--out") -> None:
    """``folder`` and its missing parents, or a one-line UsageError saying why not."""
    for parent in (folder, *folder.parents):
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"{option}: {parent} is a file, not a folder")
            break
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{option}: cannot make the folder {folder} ({e.strerror or e})") from None


def demo_notice(command: str, captioner: Captioner) -> None:
    """One line on stderr when the model knows synthetic shapes only (the bundled demos)."""
    notice = captioner.notice()
    if notice:
        print(f"captioner {command}: note: {notice}", file=sys.stderr)


@dataclass(frozen=True)
class LoadedModel:
    """A command's model: the captioner, the checkpoint file (or exported folder) it came from,
    and the checkpoint as read, on the CPU (``familiarity`` adds its record and writes it back)."""

    captioner: Captioner
    path: Path
    checkpoint: Checkpoint


def load_model(command: str, weights: str | None, device: str, *, notice: bool = True) -> LoadedModel:
    """The model ``weights`` names (a checkpoint file, an exported folder, a bundled demo's
    name; None: the default demo) on ``device`` (checked before: see ``check_device``). A file
    that is not a usable checkpoint is a one-line UsageError; with ``notice``, a shapes-only
    model says so on stderr in the name of ``captioner COMMAND``."""
    from captioner.inference import Captioner
    from captioner.io.checkpoint import CheckpointError, load_checkpoint
    from captioner.io.loading import resolve_weights, shadows_demo

    try:
        path = resolve_weights(weights)
        if shadows_demo(weights, path):
            kind = "folder" if path.is_dir() else "file"
            print(f"captioner {command}: note: took the {kind} {weights} here, not the bundled demo of that name "
                  f"(a path is taken first)", file=sys.stderr)
        checkpoint = load_checkpoint(path)
        captioner = Captioner.from_file(path, checkpoint, device)
    except CheckpointError as e:
        raise UsageError(str(e)) from e
    if notice:
        demo_notice(command, captioner)
    return LoadedModel(captioner, path, checkpoint)


def port_taken(address: str, port: int) -> str | None:
    """Why the server could not listen on ``address``:``port`` (a one-line reason), or None when it
    can: checked before a server (`captioner app`, `captioner serve`) starts, whose own refusal
    names no way out."""
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: a closed one's port is free
            s.bind((address, port))
    except OSError as e:
        return e.strerror or str(e)
    return None


# Counts and numbers, checked as argparse reads them (one line each when refused); the decoding
# options' own rules are in captioner.search.options.
def _parsed(value: str, kind, what: str):
    try:
        return kind(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a {what}: {value!r}") from None


def whole_number(value: str) -> int:
    return _parsed(value, int, "whole number")


positive, non_negative = at_least(1), at_least(0)  # the decoding options' rule for whole numbers


def number(value: str) -> float:
    return _parsed(value, float, "number")
