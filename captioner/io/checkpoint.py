"""Checkpoints: one file, tensors and plain data only, read into one typed record.

A checkpoint holds the model's state_dict, its config, the vocabulary, the name of the
tokenizer that made it ("ptb", "chars2", "chars", "whitespace"), the preprocessing as plain
data, so it rebuilds its model with no other file (``Captioner.from_checkpoint``, the one
place that does); optionally a description of its training images' features as plain
tensors (``familiarity``) and, in a run's last.pt, the state that resumes its training
(``train_state``). It is read with ``torch.load(weights_only=True)``: a file that would need
to run code to unpickle is refused. Writes are atomic (temporary file in the same folder,
fsync, rename), so a crash during a save leaves the previous checkpoint intact.

``Checkpoint.from_dict`` is the one reader of the file's dict: it upgrades every older form
(each upgrade named in ``_upgrade`` and ``TrainingState.from_dict``) into today's, checks
each field's type (a one-line CheckpointError), and gives a frozen record; ``to_dict`` writes
today's form, the keys every captioner version and the exporter read.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from captioner.data.images import Preprocess
from captioner.data.vocab import DEFAULT_TOKENIZER, Vocabulary, tokenizer_named
from captioner.model.decoder import ModelConfig
from captioner.model.familiarity import TrainingFeatures

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


def _need(d: dict, key: str, kind: type | tuple[type, ...], source: str) -> Any:
    """``d[key]``, of ``kind``; else a one-line CheckpointError naming the field."""
    if key not in d:
        raise CheckpointError(f"{source} lacks '{key}'")
    value = d[key]
    if not isinstance(value, kind):
        raise CheckpointError(f"{source}: '{key}' is {type(value).__name__}, not {_kind_name(kind)}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _tensors(value: dict, key: str, source: str) -> dict[str, torch.Tensor]:
    if not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items()):
        raise CheckpointError(f"{source}: '{key}' must map names to tensors")
    return value


def _familiarity(value: dict | None, source: str) -> TrainingFeatures | None:
    if value is None:
        return None
    try:
        return TrainingFeatures.from_dict(value)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{source}'s familiarity record is unusable: {e}") from None


# ---------------------------------------------------------------- the weight average, the training state

@dataclass(frozen=True)
class AverageState:
    """The moving average of a run's weights (train/averaging.py), in last.pt's train_state, with
    the familiarity record of the averaged encoder once the run has ended (None before)."""

    decay: float
    updates: int
    tensors: dict[str, torch.Tensor]
    familiarity: TrainingFeatures | None = None

    @classmethod
    def from_dict(cls, d: dict, source: str = "checkpoint") -> "AverageState":
        where = f"{source}'s weight average"
        decay, updates = _need(d, "decay", (int, float), where), _need(d, "updates", int, where)
        tensors = _tensors(_need(d, "tensors", dict, where), "tensors", where)
        return cls(float(decay), updates, tensors, _familiarity(d.get("familiarity"), where))

    def to_dict(self) -> dict:
        out = {"decay": self.decay, "updates": self.updates, "tensors": self.tensors}
        if self.familiarity is not None:
            out["familiarity"] = self.familiarity.to_dict()
        return out


# Where a run stands: TrainingState's position fields, saved in this order; training's running
# record of them (train/loop.py's TrainState) is made from these.
POSITION = ("step", "epoch", "batch_in_epoch", "best", "bad_vals", "validated_at", "train_seconds", "shown_loss")


@dataclass(frozen=True)
class TrainingState:
    """A last.pt's ``train_state``: where the run is and what resumes it exactly. ``config`` is
    the run's resolved config as plain data (train/ reads it as its TrainConfig: the library
    knows nothing of training); the optimiser's, the scheduler's, the grad scaler's and the
    random states are their owners' plain state dicts; ``objective`` holds the training
    objective's own entries (hard attention: ``baseline`` and ``hard``; SCST: ``scst``, one
    sampler state per rank). A study's slim copy has no optimiser, scheduler or random state."""

    config: dict
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0  # batches of this epoch done
    best: float | None = None  # the best validation figure so far
    bad_vals: int = 0  # validations since it last improved
    validated_at: int = -1  # the step of the last validation (-1: none yet)
    train_seconds: float = 0.0  # training time, checkpoints and validations left out
    shown_loss: float | None = None  # the progress bar's moving average, which a resume goes on from
    optimizer: dict | None = None
    scheduler: dict | None = None
    rng_per_rank: tuple[dict, ...] = ()  # each rank's random state (loop._rng_state)
    grad_scaler: dict = field(default_factory=dict)  # {} without fp16
    objective: dict = field(default_factory=dict)
    weight_average: AverageState | None = None

    @classmethod
    def from_dict(cls, d: dict, source: str = "checkpoint") -> "TrainingState":
        """Today's form from any earlier one; each upgrade says which form it reads."""
        where = f"{source}'s train_state"
        d = dict(d)
        config = _upgrade_config(dict(_need(d, "config", dict, where)))
        # A position field a checkpoint lacks (saved before the field existed) keeps its default.
        position = {name: d[name] for name in POSITION if name in d}
        for name in ("step", "epoch", "batch_in_epoch", "bad_vals", "validated_at"):
            if name in position and not isinstance(position[name], int):
                raise CheckpointError(f"{where}: '{name}' is {type(position[name]).__name__}, not int")
        # Saved before runs on several processes: one random state, "rng", for the only rank.
        rngs = d.get("rng_per_rank") or ([d["rng"]] if "rng" in d else [])
        # Saved before the grad scaler was kept: none (training in fp32 or bf16).
        scaler = d.get("grad_scaler") or {}
        objective = {k: d[k] for k in ("baseline", "hard", "scst") if k in d}
        # Saved before the hard objective kept its coin: only the baseline, and the coin as the
        # run's seed made it (what a resume of such a file has always drawn from).
        if "baseline" in objective and "hard" not in objective:
            seed = config.get("optim", {}).get("seed", 0)
            objective["hard"] = {"baseline": objective["baseline"],
                                 "coin": torch.Generator().manual_seed(seed).get_state()}
        # Saved before each SCST sampler named its device: a CPU generator's state is 5056 bytes
        # (a CUDA generator's 16), so the size says which.
        if "scst" in objective:
            objective["scst"] = [s if "device" in s else {**s, "device": _generator_device(s["generator"])}
                                 for s in objective["scst"]]
        average = d.get("weight_average")
        return cls(config=config, **position, optimizer=d.get("optimizer"), scheduler=d.get("scheduler"),
                   rng_per_rank=tuple(rngs), grad_scaler=scaler, objective=objective,
                   weight_average=None if average is None else AverageState.from_dict(average, source))

    def to_dict(self) -> dict:
        out: dict[str, Any] = {name: getattr(self, name) for name in POSITION}
        out.update({"optimizer": self.optimizer, "scheduler": self.scheduler,
                    "rng": self.rng_per_rank[0] if self.rng_per_rank else None,
                    "rng_per_rank": list(self.rng_per_rank), "config": self.config, "grad_scaler": self.grad_scaler,
                    **self.objective})
        if self.weight_average is not None:
            out["weight_average"] = self.weight_average.to_dict()
        return out

    def rng_of(self, rank: int, device: torch.device) -> dict:
        """Rank ``rank``'s random state, its "cuda" entry the state of ``device``'s GPU (None:
        none saved). Files saved before a run kept only its own GPU's state hold every visible
        GPU's as a list: the one of the GPU it resumes on is taken (an upgrade that needs the
        device, so it is made here rather than in ``from_dict``)."""
        state = dict(self.rng_per_rank[rank])
        saved = state.get("cuda")
        if isinstance(saved, (list, tuple)):
            index = (device.index or 0) if device.type == "cuda" else 0
            state["cuda"] = saved[index] if index < len(saved) else None
        return state


def _generator_device(state: torch.Tensor) -> str:
    return "cpu" if state.numel() == torch.Generator().get_state().numel() else "cuda"


def _upgrade_config(config: dict) -> dict:
    """A run's config as today's TrainConfig reads it."""
    optim = config.get("optim")
    # Older runs: optim.amp, a bool for bf16 autocast on CUDA, before optim.precision.
    if isinstance(optim, dict) and "amp" in optim:
        optim = {("precision" if k == "amp" else k): (("auto" if v else "fp32") if k == "amp" else v)
                 for k, v in optim.items()}
        config = {**config, "optim": optim}
    return config


# ---------------------------------------------------------------- the checkpoint

@dataclass(frozen=True)
class Checkpoint:
    """A captioner checkpoint, typed: everything ``Captioner.from_checkpoint`` rebuilds a model
    from, and what training resumes from. ``meta`` is free plain data (the run's name, its
    step, what it was trained on: see ``training_data_of``); ``demo`` names the bundled model
    an exported folder holds, for its notice."""

    model_config: ModelConfig
    vocab: tuple[str, ...]
    tokenizer: str  # a name tokenizer_named knows
    preprocess: Preprocess
    state_dict: dict[str, torch.Tensor]
    meta: dict = field(default_factory=dict)
    train_state: TrainingState | None = None
    familiarity: TrainingFeatures | None = None
    demo: str | None = None

    @property
    def vocabulary(self) -> Vocabulary:
        """The vocabulary with its tokenizer."""
        return Vocabulary(list(self.vocab), tokenizer_named(self.tokenizer))

    @classmethod
    def from_dict(cls, d: dict, source: str = "checkpoint") -> "Checkpoint":
        """The record of a checkpoint's dict, of this version or any earlier one (``_upgrade``),
        each field checked; ``source`` (the file) names it in a one-line CheckpointError."""
        if not isinstance(d, dict):
            raise CheckpointError(f"{source} is {type(d).__name__}, not a checkpoint's dict")
        version = d.get("version", 0)
        if not isinstance(version, int) or version > VERSION:
            raise CheckpointError(f"{source} has format version {version}; this captioner reads up to {VERSION}")
        d = _upgrade(d, source)
        try:
            model_config = ModelConfig.from_dict(d["model_config"])
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: unusable model_config: {e}") from None
        vocab = d["vocab"]
        if not all(isinstance(w, str) for w in vocab):
            raise CheckpointError(f"{source}: 'vocab' must be a list of words")
        tokenizer = _need(d, "tokenizer", str, source)
        try:
            tokenizer_named(tokenizer)
        except ValueError as e:
            raise CheckpointError(f"{source} names an {e}") from None
        try:
            preprocess = Preprocess.from_dict(d["preprocess"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: unusable preprocess: {type(e).__name__} {e}") from None
        state = _need(d, "state_dict", dict, source)
        train_state = d.get("train_state")
        if train_state is not None:
            train_state = TrainingState.from_dict(_need(d, "train_state", dict, source), source)
        demo = d.get("demo")
        if demo is not None and not isinstance(demo, str):
            raise CheckpointError(f"{source}: 'demo' is {type(demo).__name__}, not str")
        return cls(model_config=model_config, vocab=tuple(vocab), tokenizer=tokenizer, preprocess=preprocess,
                   state_dict=state, meta=_need(d, "meta", dict, source), train_state=train_state,
                   familiarity=_familiarity(d.get("familiarity"), source), demo=demo)

    def to_dict(self) -> dict:
        """Today's on-disk form: what ``torch.save`` writes and every reader expects."""
        out: dict[str, Any] = {
            "format": FORMAT,
            "version": VERSION,
            "model_config": self.model_config.to_dict(),
            "vocab": list(self.vocab),
            "tokenizer": self.tokenizer,
            "preprocess": self.preprocess.to_dict(),
            "state_dict": self.state_dict,
            "meta": dict(self.meta),
        }
        if self.train_state is not None:
            out["train_state"] = self.train_state.to_dict()
        if self.familiarity is not None:
            out["familiarity"] = self.familiarity.to_dict()
        if self.demo is not None:
            out["demo"] = self.demo
        return out

    def save(self, path: str | os.PathLike) -> None:
        """``to_dict`` written atomically (``atomic_save``)."""
        atomic_save(self.to_dict(), path)


def _upgrade(d: dict, source: str) -> dict:
    """Today's form of a checkpoint's dict: every upgrade of an older form, in one place (those
    of a run's training state in ``TrainingState.from_dict``). The fields the upgrades read are
    checked for type first."""
    d = dict(d)
    for key, kind in (("model_config", dict), ("vocab", (list, tuple)), ("preprocess", dict),
                      ("state_dict", dict)):
        _need(d, key, kind, source)
    _tensors(d["state_dict"], "state_dict", source)
    # Saved before checkpoints named their tokenizer: every such model is English, PTB-tokenised.
    d.setdefault("tokenizer", DEFAULT_TOKENIZER)
    # Saved before the metadata was always written: none.
    if d.get("meta") is None:
        d["meta"] = {}
    # Saved before the crop option: no "resize", the whole image resized.
    d["preprocess"] = {"resize": 0, **d["preprocess"]}
    d["state_dict"] = upgrade_weights(d["model_config"], d["state_dict"], source=source)
    return d


def upgrade_weights(config: dict, state: dict[str, torch.Tensor], prefix: str = "decoder.",
                    source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """A state dict of an older form as today's model of ``config`` (a ModelConfig's dict)
    loads it; ``prefix``: where the decoder's weights lie ("decoder." in a whole model's, ""
    in a decoder's own)."""
    heads = config.get("heads", 1)
    atts = [f"{prefix}attention."] if heads == 1 else [f"{prefix}attention.heads.{j}." for j in range(heads)]
    # Saved before the cosine score had a temperature: tau = 1, the scores it was trained with.
    if config.get("score") == "cosine":
        missing = {f"{a}log_temperature": torch.zeros(()) for a in atts if f"{a}log_temperature" not in state}
        state = {**state, **missing} if missing else state
    # Multi-head attention before its values were projected per head: W_o of (D, h D) and no W_v,
    # which no upgrade maps onto today's form: refused with the reason.
    w_o = state.get(f"{prefix}attention.out_proj.weight")
    if heads > 1 and w_o is not None and f"{prefix}attention.value_proj.0.weight" not in state \
            and w_o.shape[-1] == heads * w_o.shape[0]:
        raise CheckpointError(
            f"{source}: this multi-head checkpoint keeps all {w_o.shape[0]} values per head (an earlier form, "
            f"before values were projected to {w_o.shape[0] // heads} per head); retrain it with this version")
    return state


def training_data_of(meta: dict) -> str | None:
    """What a checkpoint's ``meta`` says its model was trained on, in words: "training_data",
    or in files saved before that name "trained_on"; older files also named their data
    "NAME (FOLDER, split ...)": the folder goes (the app shows it to every visitor)."""
    for key in ("training_data", "trained_on"):
        if isinstance(meta.get(key), str) and meta[key]:
            return _without_paths(meta[key])
    return None


def _without_paths(name: str) -> str:
    found = re.fullmatch(r"(.*?) \((.*)\)", name)
    if found is None:
        return name
    kept = [part for part in found.group(2).split(", ") if "/" not in part and "\\" not in part]
    return f"{found.group(1)} ({', '.join(kept)})" if kept else found.group(1)


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


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> Checkpoint:
    """Read, upgrade and check a checkpoint, never running code from the file: a .pt file, or a
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
    except Exception as e:  # a zip cut short or overwritten part-way, not a zip/pickle at all, ...
        raise CheckpointError(f"{path} is damaged: it cannot be read as a checkpoint (cut short, or "
                              f"overwritten part-way, as by a full disk or a copy that stopped)") from e
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise not_a_checkpoint(path, f"a PyTorch file, but not one captioner wrote: no '{FORMAT}' header")
    return Checkpoint.from_dict(ckpt, str(path))


def load_folder(folder: str | os.PathLike) -> Checkpoint:
    """The checkpoint of a model folder ``captioner export`` wrote (captioner.io.folder):
    safetensors and JSON only, so nothing in it is unpickled. Its tensors are on the CPU; a
    demo's folder says which demo (``demo``), for its notice."""
    from captioner.io import folder as fmt
    from captioner.io import tensorfile

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
    d = {"format": FORMAT, "version": VERSION, "model_config": config["model"], "vocab": vocab,
         "tokenizer": config["tokenizer"], "preprocess": config["preprocess"],
         "state_dict": {k: torch.from_numpy(v.copy()) for k, v in arrays.items()}, "meta": config.get("meta"),
         "familiarity": familiarity, "demo": config.get("demo") or None}
    return Checkpoint.from_dict(d, str(folder))
