"""Checkpoints: one file, tensors and plain data only.

A checkpoint holds the model's state_dict, its config, the vocabulary, the name of the
tokenizer that made it (``"tokenizer"``: "ptb", "chars2", "chars", "whitespace"; files that predate
it are "ptb") and the preprocessing as plain data, so it rebuilds its model with no other
file; and, optionally, a description of its training images' features as plain tensors
(``familiarity``). It is read with
``torch.load(weights_only=True)``: a file that would need to run code to unpickle is refused.
Writes are atomic (temporary file in the same folder, fsync, rename), so a crash during a
save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import pickle
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch

FORMAT = "captioner-checkpoint"
VERSION = 1
# Said after "X is not a captioner checkpoint (...)": what the user should pass instead.
WHAT_A_CHECKPOINT_IS = ("A captioner checkpoint is the .pt file that `captioner train` writes (best.pt or "
                        "last.pt in a run folder): the model's weights, config, vocabulary and preprocessing "
                        "in one PyTorch file.")

# First bytes -> what the file is, for files that are certainly not PyTorch files.
_MAGIC = [
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"\x89PNG\r\n\x1a\n", "a PNG image"),
    (b"GIF87a", "a GIF image"),
    (b"GIF89a", "a GIF image"),
    (b"II*\x00", "a TIFF image"),
    (b"MM\x00*", "a TIFF image"),
    (b"%PDF-", "a PDF document"),
    (b"\x1f\x8b", "a gzip file"),
    (b"\x89HDF\r\n\x1a\n", "an HDF5 file"),
    (b"\x7fELF", "a program (ELF)"),
]


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
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        failed = _write_error(e)
        if failed is not None and failed is not e:  # torch's zip writer reports a full disk as a RuntimeError
            raise OSError(failed.errno, failed.strerror, str(path)) from e
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _write_error(e: BaseException) -> OSError | None:
    """The OSError behind ``e`` (itself, or what it was raised while handling), if any."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def make_checkpoint(*, model_state: dict, model_config: dict, vocab: list[str], preprocess: dict,
                    meta: dict | None = None, train_state: dict | None = None, tokenizer: str = "ptb",
                    familiarity: dict | None = None) -> dict:
    """``familiarity``: the training images' features (familiarity.TrainingFeatures.to_dict),
    optional: a checkpoint without them loads, its images' familiarity unknown."""
    ckpt = {
        "format": FORMAT,
        "version": VERSION,
        "model_config": model_config,
        "vocab": list(vocab),
        "tokenizer": tokenizer,
        "preprocess": preprocess,
        "state_dict": model_state,
        "meta": dict(meta or {}),
    }
    if train_state is not None:
        ckpt["train_state"] = train_state
    if familiarity is not None:
        ckpt["familiarity"] = familiarity
    return ckpt


def _weights_only_reason(message: str) -> str:
    """The line of torch's long weights-only error that says what was found."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith(("Trying to load unsupported", "Unsupported")):
            return ln
    return lines[-1] if lines else message


def file_kind(path: Path) -> str | None:
    """What ``path`` is, from its first bytes, when it is certainly not a PyTorch file ("a
    JPEG image", "a text file", ...); None for a file torch.load may read (a zip archive
    holding PyTorch data, a pickle) or cannot be told from its start (a zip cut short)."""
    with open(path, "rb") as f:
        head = f.read(4096)
    if not head:
        return "an empty file"
    for magic, kind in _MAGIC:
        if head.startswith(magic):
            return kind
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return "a WebP image"
    if head.startswith(b"BM") and len(head) >= 6 and int.from_bytes(head[2:6], "little") == path.stat().st_size:
        return "a BMP image"
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        try:
            with zipfile.ZipFile(path) as z:
                names = z.namelist()
        except (zipfile.BadZipFile, OSError):
            return None  # a zip cut short: perhaps a checkpoint copied in part; torch.load says
        # torch.save writes <name>/data.pkl and the tensors beside it.
        return None if any(n.endswith("/data.pkl") for n in names) else "a zip archive, not a PyTorch file"
    if head[0] == 0x80:  # a pickle (protocol 2 or later): torch's older format, or plain Python objects
        return None
    if len(head) > 10 and head[8:10] == b'{"' and int.from_bytes(head[:8], "little") < 100_000_000:
        return "a safetensors file"
    if b"\x00" not in head:
        try:
            text = head.decode("utf-8")
        except UnicodeDecodeError as e:  # a character cut by the 4096-byte read is still text
            text = head[:e.start].decode("utf-8") if e.start >= len(head) - 3 else None
        if text is not None:
            start = text.lstrip().lower()
            if start.startswith(("<!doctype html", "<html")):
                return "an HTML page"
            if start.startswith(("{", "[")) and _is_json(path):
                return "a JSON file"
            return "a text file"
    return "binary data of no kind captioner knows"


def _is_json(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            json.load(f)
    except (OSError, ValueError):
        return False
    return True


def not_a_checkpoint(path: Path, kind: str) -> CheckpointError:
    return CheckpointError(f"{path} is not a captioner checkpoint ({kind}). {WHAT_A_CHECKPOINT_IS}")


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict:
    """Read and validate a checkpoint, never running code from the file: a .pt file, or a
    folder ``captioner export`` wrote (read by ``load_folder``)."""
    path = Path(path)
    if path.is_dir():
        return load_folder(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        kind = file_kind(path)
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e.strerror or e}") from e
    if kind is not None:
        raise not_a_checkpoint(path, kind)
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
        raise not_a_checkpoint(path, f"a PyTorch file, but not one captioner wrote: no '{FORMAT}' header")
    if ckpt.get("version", 0) > VERSION:
        raise CheckpointError(f"{path} has format version {ckpt['version']}; this captioner reads up to {VERSION}")
    for key in ("model_config", "vocab", "preprocess", "state_dict"):
        if key not in ckpt:
            raise CheckpointError(f"{path} lacks '{key}'")
    return ckpt


def load_folder(folder: str | os.PathLike) -> dict:
    """The checkpoint (as ``make_checkpoint`` makes it) of a model folder ``captioner export``
    wrote (captioner.folder): safetensors and JSON only, so nothing in it is unpickled. Its
    tensors are on the CPU; a demo's folder says which demo (``"demo"``), for its notice."""
    from . import folder as fmt
    from . import tensorfile

    folder = Path(folder)
    try:
        config = fmt.read_config(folder)
        vocab = fmt.read_vocab(folder, config)
        familiarity = fmt.read_familiarity(folder, config)
        fmt.require(folder, fmt.WEIGHTS)
        arrays, _ = tensorfile.read(folder / fmt.WEIGHTS)
    except (fmt.FolderError, tensorfile.TensorFileError) as e:
        raise CheckpointError(str(e)) from None
    if familiarity is not None:
        familiarity = {k: torch.from_numpy(v.copy()) if k in fmt.FAMILIARITY_TENSORS else v
                       for k, v in familiarity.items()}
    ckpt = make_checkpoint(model_state={k: torch.from_numpy(v.copy()) for k, v in arrays.items()},
                           model_config=config["model"], vocab=vocab, preprocess=config["preprocess"],
                           meta=config.get("meta"), tokenizer=config["tokenizer"], familiarity=familiarity)
    if config.get("demo"):
        ckpt["demo"] = config["demo"]
    return ckpt
