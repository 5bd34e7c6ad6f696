"""Loading a model: which file a name means, the model rebuilt from its checkpoint, and what
it says about itself. Apart from captioning (``captioner.inference``), which takes what this
module built.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch

from captioner.io.bundled import DEFAULT, DEMOS, SYNTHETIC_SHAPES, BundledModel, bundled_at, shapes_only_notice
from captioner.io.checkpoint import Checkpoint, CheckpointError, training_data_of
from captioner.io.folder import CONFIG, WEIGHTS, is_model_folder, shape_mismatch
from captioner.model.decoder import CaptionModel
from captioner.model.familiarity import TrainingFeatures
from captioner.search.options import DecodeOptions


def resolve_weights(weights: str | os.PathLike | None) -> Path:
    """A bundled model name (demo-soft, demo-hard, demo-zh), a path to a checkpoint file, or a
    model folder ``captioner export`` wrote. A path that exists is taken before a bundled name:
    a demo's exported folder downloaded into the current folder is what its card's commands
    name (``shadows_demo`` says when that happened)."""
    name = str(weights or DEFAULT)
    if name in DEMOS and not Path(name).expanduser().exists():
        if not DEMOS[name].installed:
            raise CheckpointError(f"the bundled model {name!r} is missing from this installation ({DEMOS[name].path})")
        return DEMOS[name].path
    path = Path(name).expanduser()
    if path.is_dir():
        if not is_model_folder(path):
            raise CheckpointError(f"no such checkpoint: {name} is a folder but not an exported model (it has no "
                                  f"{CONFIG}); give a checkpoint file, or a folder `captioner export` wrote")
        return path
    if not path.is_file():
        raise CheckpointError(f"no such checkpoint: {name} (use a file path, an exported model folder, or one "
                              f"of {', '.join(DEMOS)})")
    return path


def shadows_demo(weights: str | os.PathLike | None, path: Path) -> bool:
    """Whether ``weights`` is a bundled model's name that resolved to a local file or folder
    of that name (``resolve_weights`` takes the path first)."""
    return weights is not None and str(weights) in DEMOS and path != DEMOS[str(weights)].path


# The files every run of `captioner train` writes: named alone, they would not say which model.
RUN_FILES = ("best.pt", "last.pt")


def checkpoint_name(path: Path, meta: dict | None) -> str:
    """A checkpoint's name in JSON lines, overlay titles and the app: the file's name, but for a
    run's best.pt or last.pt its run's with it ("my-photos/best.pt"): the run's folder as
    training recorded it (``meta["run"]``), else the folder the file lies in."""
    if path.name not in RUN_FILES:
        return path.name
    run = (meta or {}).get("run")
    run = run if isinstance(run, str) and run else path.resolve().parent.name
    return f"{run}/{path.name}" if run else path.name


# Numeric precision -> autocast dtype (None: no autocast). Training uses the same names.
AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
INFERENCE_PRECISIONS = tuple(AUTOCAST_DTYPES)


def identify(path: Path, ckpt: Checkpoint) -> tuple[str, BundledModel | None]:
    """The name and demo record of the model read from ``path``: named by its file, and a demo (its
    record, its notice) when the file is a shipped one, however it was named, or a demo's exported
    folder."""
    demo = bundled_at(path)
    name = demo.name if demo is not None else checkpoint_name(path, ckpt.meta)
    if demo is None and ckpt.demo in DEMOS:  # a demo's exported folder: its record and notice
        demo = DEMOS[ckpt.demo]
    return name, demo


def rebuild(ckpt: Checkpoint, device: str | torch.device = "cpu",
            path: Path | None = None) -> tuple[CaptionModel, TrainingFeatures | None]:
    """The one way a model is rebuilt from a checkpoint (captioning, evaluation, export, resuming a
    run, the studies), on ``device``, with its familiarity record; a checkpoint whose parts do not
    fit each other is a one-line CheckpointError (naming the exported folder's files when ``path``
    is one)."""
    cfg = ckpt.model_config
    # The checkpoint holds every encoder weight: build the encoder without asking torchvision for
    # ImageNet weights (no network, no hub cache needed), and keep the config saying how the model
    # was trained.
    model = CaptionModel(replace(cfg, encoder_pretrained=False))
    model.config = replace(model.config, encoder_pretrained=cfg.encoder_pretrained)
    try:
        model.load_state_dict(ckpt.state_dict)
    except RuntimeError as e:  # a module's own reason, else the first misfit in words
        wrong = shape_mismatch({k: tuple(v.shape) for k, v in model.state_dict().items()},
                               {k: tuple(v.shape) for k, v in ckpt.state_dict.items()})
        reason = wrong if wrong is not None and str(e).startswith("Error(s) in loading") else str(e)
        where = f"{path / WEIGHTS} does not fit its {CONFIG}" if path is not None and path.is_dir() else \
            "checkpoint weights do not fit its own config"
        raise CheckpointError(f"{where}: {reason}") from None
    if len(ckpt.vocabulary) != cfg.vocab_size:
        raise CheckpointError(f"vocabulary has {len(ckpt.vocabulary)} words but the model expects {cfg.vocab_size}")
    familiarity = ckpt.familiarity
    if familiarity is not None and len(familiarity.mean) != model.encoder.dim:
        raise CheckpointError(f"checkpoint's familiarity record describes {len(familiarity.mean)}-dimensional "
                              f"features, its encoder gives {model.encoder.dim}")
    return model.to(device), None if familiarity is None else familiarity.to(device)


class Described:
    """What a loaded model says about itself, from its ``name``, ``demo`` record and checkpoint
    ``meta``: what it was trained on, whether it knows the synthetic shapes only, its notice, its
    caption length. The CLI, the app and the JSON lines print these."""

    name: str | None  # what the user chose: a bundled model's name or the file's name
    demo: BundledModel | None  # the record of the demo model shipped in the package that this is, if one
    meta: dict

    @property
    def training_data(self) -> str | None:
        """What the model was trained on, in words, when known, and never where it lay on the
        trainer's disk (the app shows it to every visitor). Checkpoints from ``captioner train``
        store it as ``meta["training_data"]`` (``checkpoint.training_data_of``); the bundled models
        are trained on the synthetic shapes whatever their metadata says (older files name only
        the data folder)."""
        said = training_data_of(self.meta)
        if said is not None:
            return said
        if self.demo is not None:
            return self.demo.training_data
        data = self.meta.get("data")
        return f"the data in a folder named {Path(data).name}" if isinstance(data, str) and data else None

    @property
    def bundled(self) -> bool:
        """One of the demo models shipped in the package."""
        return self.demo is not None

    @property
    def shapes_only(self) -> bool:
        """True for a model that has seen the synthetic shapes and nothing else."""
        return self.bundled or (self.training_data or "").startswith(SYNTHETIC_SHAPES)

    @property
    def max_len(self) -> int:
        """The longest caption, in tokens, the model was trained on (``meta["max_caption_len"]``):
        the length limit of decoding unless one is asked for. 20 where the checkpoint does not
        say (the English demos); a Chinese model counts characters, about twice as many."""
        n = self.meta.get("max_caption_len")
        return n if isinstance(n, int) and n > 0 else DecodeOptions.max_len

    def notice(self) -> str | None:
        """One sentence for the user of a shapes-only model (the demos); None for others."""
        if not self.shapes_only:
            return None
        if self.demo is not None:
            return self.demo.notice()
        return shapes_only_notice(f"{self.name or 'this model'} is")
