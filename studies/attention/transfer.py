"""Trained on one machine, scored on another: finished runs packed as slim checkpoints
(checkpoints.slim_checkpoint) with their logs into tar files, and unpacked into the
runs folder of the machine that scores them.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from .plan import UsageError
from .store import atomic_write

PACKED = "packed"  # a marker in a run folder: packed once already
_MEMBER = re.compile(r"^([A-Za-z0-9_][A-Za-z0-9_.-]*)/seed([0-9]+)/(last\.pt|best\.pt|metrics\.jsonl|config\.toml)$")


def pack_runs(keys: list[str], seeds: list[int], runs: Path, steps: int, dest: Path, limit_bytes: int,
              max_files: int = 0) -> list[Path]:
    """Every finished (training, seed) not packed before, as slim checkpoints with their logs,
    in uncompressed tar files of at most ``limit_bytes`` each (weights hardly compress), and
    at most ``max_files`` files (0: no limit; the rest wait for the next call): what a
    training machine hands to the machine that scores. Returns the files written."""
    import io
    import tarfile

    import torch

    from captioner.io.checkpoint import load_checkpoint

    from .checkpoints import run_config, slim_checkpoint

    dest.mkdir(parents=True, exist_ok=True)
    start = len(list(dest.glob("runs-*.tar")))
    files: list[Path] = []
    tar, size = None, 0
    for key, seed in ((k, s) for k in keys for s in seeds):
        run_dir = runs / key / f"seed{seed}"
        if (run_dir / PACKED).exists() or not (run_dir / "last.pt").is_file():
            continue
        ckpt = load_checkpoint(run_dir / "last.pt")
        if ckpt.train_state is None or ckpt.train_state.step != steps:
            continue
        buf = io.BytesIO()
        torch.save(slim_checkpoint(ckpt), buf)
        members = {"last.pt": buf.getvalue(), "metrics.jsonl": (run_dir / "metrics.jsonl").read_bytes(),
                   "config.toml": (run_dir / "config.toml").read_bytes()}
        if run_config(ckpt).val.every_epochs > 0:  # a row may score the checkpoint chosen
            members["best.pt"] = (run_dir / "best.pt").read_bytes()  # weights and metadata alone: already slim
        need = sum(len(v) + 1024 for v in members.values())
        if tar is None or (size and size + need > limit_bytes):
            if max_files and len(files) == max_files:
                break  # the rest wait for the next pack
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
    """Packed runs into ``runs``: only the files a packed run has, each a plain file under
    <training>/seed<S>/, and never over a run already there. Returns the runs unpacked."""
    import tarfile

    from captioner.io.checkpoint import CheckpointError

    from .checkpoints import last_step

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
                                 "last.pt, best.pt, metrics.jsonl or config.toml)")
            folders = sorted({m.name.rsplit("/", 1)[0] for m in members})
            taken = [f for f in folders if (runs / f / "last.pt").exists()]
            if taken:
                raise UsageError(f"{file}: {', '.join(taken)} already in {runs}; move it away to take the packed "
                                 "one")
            for m in members:
                target = runs / m.name
                target.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(target, tar.extractfile(m).read())
        for folder in folders:
            try:
                step = last_step(runs / folder)
            except CheckpointError as e:
                raise UsageError(str(e)) from e
            if step != steps:
                raise UsageError(f"{file}: {folder} stopped at step {step}, not {steps}: another recipe's run?")
            found.append(folder)
    return found
