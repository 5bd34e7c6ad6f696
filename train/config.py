"""Training configuration: a TOML file, overridable with ``--set section.key=value``.

A config may start from another and state only what differs: ``base = "shapes-soft.toml"``
(a path relative to the config's own folder) takes every value of that config, ``name``
included; the file's sections then merge into the base's key by key, and a base may have a
base of its own.

Every value is checked against its field's annotation as it is read: a bool, an int, a
float, a string, or one of a ``Literal``'s choices; then against what it can be (``BOUNDS``:
a positive batch size, a learning rate above 0, a validation metric validation gives), so
that a mistake stops the run before any data is read, not at its first step or validation.
The [model] section is ``captioner``'s
``ModelConfig`` (its fields, annotations and defaults) less what a run sets itself, plus
the keys that say how a run starts; ``model_config`` makes the one from the other.
"""

from __future__ import annotations

import ast
import difflib
import math
import os
import tomllib
from collections.abc import Callable
from dataclasses import MISSING, Field, asdict, dataclass, field, fields, make_dataclass
from functools import cache
from pathlib import Path
from typing import Literal, get_args, get_origin, get_type_hints

from captioner.evaluation.grounding import GroundingSummary
from captioner.evaluation.metrics import METRIC_NAMES
from captioner.model.attention import attention_mode
from captioner.model.decoder import ModelConfig
from captioner.model.encoders import encoder_names

from .precision import PrecisionName


@dataclass
class DataConfig:
    dir: str = "data/shapes"
    train_split: str = "train"
    val_split: str = "val"
    # Karpathy split file (dataset_coco.json), inside `dir` unless absolute, so that --set
    # data.dir=... moves it too; empty: the folder's own splits.
    karpathy: str = ""
    min_count: int = 5  # vocabulary: words seen at least this often in training captions
    # ... lowered (as far as 1) until at most this share of the training captions' words are <unk>:
    # a small data set sees most of its words once or twice and would caption in <unk>s; 1: never lowered.
    max_unk_share: float = 1.0
    max_vocab: int = 0  # 0: no limit
    max_caption_len: int = 20  # words; longer training captions are left out (counted at start-up), never cut
    cache_images: bool = False  # keep preprocessed training images in memory (small data)
    feature_cache: bool = False  # frozen encoder: annotations computed once per image, memory-mapped fp16
    feature_cache_dir: str = ""  # where the cache lives (default: the run folder)
    # Image-decoding processes, a ceiling: at most one per CPU core this run may use.
    workers: int = 8
    # Images that cannot be read (damaged, cut short) stop training at start-up, each named;
    # true: they are left out, and counted in the start-up summary.
    skip_unreadable: bool = False
    # Batches of captions of about one length (sorted by length, cut into batches, batches in
    # random order), as the authors grouped theirs: little padding. Off: uniformly random batches.
    length_buckets: bool = False
    # Shapes only: generate the synthetic data into `dir` when it is not there yet.
    generate_shapes: bool = False
    shapes_train: int = 3000
    shapes_val: int = 200
    shapes_seed: int = 1
    shapes_image_size: int = 128
    # Shapes only: add a "from top to bottom: ..." caption to the templates of images with two
    # or three objects (the test sets' generator leaves it out; docs/attention-comparison.md).
    shapes_top_to_bottom: bool = False
    # Shapes only: the captions' language, "en" or "zh" (Chinese; the same images and objects).
    shapes_language: Literal["en", "zh"] = "en"

    @property
    def split_file(self) -> Path | None:
        """The Karpathy split file: ``karpathy`` inside ``dir`` unless it is absolute."""
        return Path(self.dir) / self.karpathy if self.karpathy else None

    def loader_workers(self) -> int:
        """``workers``, at most the CPU cores this process may use (its container's quota heeded;
        under torchrun, its share of the machine's): more processes than cores only compete for
        them, and torch warns."""
        from captioner.batching import usable_cores

        cores = usable_cores()
        ranks_here = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        return max(0, min(self.workers, max(1, cores // ranks_here)))


# ModelConfig's fields that a run sets itself: the vocabulary's size, and the annotation size
# its encoder gives.
SET_BY_THE_RUN = ("vocab_size", "annotation_dim")


@dataclass
class ModelStart:
    """The [model] keys of training alone, beside ModelConfig's: where the weights start, and
    how the images are read. Training's images are square: ``image_size`` is one side (it
    takes the place of ModelConfig's (height, width))."""

    init_from: str = ""  # start from this checkpoint's weights (same architecture), e.g. hard from soft
    # Start the encoder alone from this checkpoint (a bundled model's name or a path), the
    # decoder fresh: with freeze_encoder, the paper's set-up of a decoder over fixed features.
    encoder_from: str = ""
    image_size: int = 128
    # 0: the whole image resized to image_size (no crop). N: torchvision's ImageNet recipe,
    # the shorter side resized to N then the centre image_size cropped (the paper: 256 -> 224).
    resize: int = 0


def _model_section() -> type:
    """The [model] section's dataclass: ModelConfig's fields in their order, with their
    annotations and defaults, less SET_BY_THE_RUN and with ModelStart's in place of those of
    the same name; then ModelStart's others."""
    start = {f.name: f for f in fields(ModelStart)}
    shape = [start.pop(f.name, f) for f in fields(ModelConfig) if f.name not in SET_BY_THE_RUN]
    kinds = {**get_type_hints(ModelConfig), **get_type_hints(ModelStart)}
    return make_dataclass("ModelSection", [(f.name, kinds[f.name], _default(f)) for f in [*shape, *start.values()]],
                          namespace={"__module__": __name__, "__doc__": "The [model] section: ModelConfig's fields "
                                     "but those a run sets itself, and ModelStart's."})


def _default(f: Field) -> Field:
    return field(default=f.default) if f.default is not MISSING else field(default_factory=f.default_factory)


ModelSection = _model_section()


@dataclass
class OptimConfig:
    epochs: int = 20
    max_steps: int = 0  # 0: no limit
    max_minutes: float = 0.0  # 0: no limit; stop (and save) after this much training time
    batch_size: int = 64  # the global batch: under torchrun each rank takes its share
    # rmsprop: centred, momentum 0.9, as the authors' code; sgd: momentum 0.9
    optimizer: Literal["adam", "rmsprop", "sgd"] = "adam"
    lr: float = 4e-4  # decoder
    encoder_lr: float = 1e-4  # encoder parameters that train (fine-tuning, or a from-scratch encoder)
    weight_decay: float = 0.0
    lr_decay: float = 0.8  # multiply the learning rates by this ...
    lr_decay_every: int = 5  # ... every this many epochs
    grad_clip: float = 5.0
    # 0: off. Otherwise the decay of an exponential moving average of the weights (e.g. 0.999):
    # validation decodes with the averaged weights and best.pt holds them.
    ema: float = 0.0
    doubly_stochastic: float = 1.0  # lambda of sum_i (1 - sum_t alpha_ti)^2
    seed: int = 0
    # auto: bf16 on CUDA, fp32 on CPU; fp16 with a gradient scaler (train/precision.py)
    precision: PrecisionName = "auto"
    # torch.compile the decoder's per-word step with this backend: "" (off), "inductor"
    # (fused kernels; pays off on CUDA), or e.g. "aot_eager" (traces without generating code).
    compile: str = ""
    # On a CUDA device, the soft objective's forward and backward recorded once per (batch size,
    # padded caption length) and replayed as CUDA graphs (train/graphed.py): the same losses and
    # gradients, without the launch of each small kernel. Taken without torchrun, fp32 or bf16,
    # no compile, and the kernels on (CAPTIONER_KERNELS); elsewhere the plain step runs. On by
    # default: on a GPU its gradients agree with the plain step's (docs/benchmarks.md).
    cuda_graphs: bool = True
    device: str = "auto"
    threads: int = 0  # CPU threads for this run (0: torch's default); 1 lets runs share a machine
    log_every: int = 20
    save_every: int = 200  # steps between "last" checkpoints (and at every epoch end)


@dataclass
class ValConfig:
    every_epochs: int = 1
    # Chooses the best checkpoint; from real decoding, not teacher forcing. A caption metric
    # (CIDEr, BLEU-4, ...), on shapes data a grounding figure (object_accuracy, pointing_accuracy,
    # ...), or "min:A,B" for the smaller of several.
    metric: str = "CIDEr"
    beam_size: int = 1
    max_len: int = 20  # words per caption at validation (<end> not counted)
    limit: int = 0  # 0: the whole validation split
    patience: int = 5  # early stopping: validations without improvement; 0 = never stop early
    # A validation of fewer images (the split, or val.limit) is too noisy to choose by: it neither
    # stops the run early nor picks best.pt, which then holds the last validated weights. 0: any size.
    min_images: int = 0


Reward = Literal["word_mean", "caption"]  # hard.reward: the names train.losses knows
Reduction = Literal["mean", "sum"]  # hard.reduction


@dataclass
class HardConfig:
    """REINFORCE for hard attention: reward = per-word mean log p(y|s,a) against a
    moving-average baseline of the same, weighted 0.1, entropy bonus 0.002, as in the
    authors' code (capgen.py), each averaged over the captions of the minibatch like the
    NLL (the paper's eq. 12), so that the weights mean the same at any batch size; see
    ``captioner.train.losses.HardAttentionObjective``. ``reduction = "sum"`` is capgen's form, which
    adds the two terms over the captions (their weight grows with the batch size)."""

    # word_mean: the mean over the caption's words of log p; caption: their sum
    reward: Reward = "word_mean"
    lambda_r: float = 0.1  # weight of the score-function term (the authors' "/10.")
    entropy: float = 0.002  # lambda_e, entropy bonus on every minibatch
    # How the score-function and entropy terms add over the B captions of a minibatch:
    # "mean" (1/B, like the NLL; the paper's estimator) or "sum" (capgen's: no 1/B beside a
    # mean NLL, so their weight is x B and changes with the batch size).
    reduction: Reduction = "mean"
    baseline_decay: float = 0.9  # b <- decay * b + (1 - decay) * mean over the minibatch of the reward
    expected_context_prob: float = 0.5  # per minibatch, use the expected (soft) context instead of a sample


@dataclass
class ScstConfig:
    """Self-critical sequence training (Rennie et al. 2017; ``captioner.train.scst``): when enabled,
    every training step samples captions and follows their CIDEr-D against a baseline
    instead of the cross-entropy (or hard attention's REINFORCE) objective. Start it from a
    cross-entropy checkpoint (``model.init_from``) at a learning rate well below
    cross-entropy's: Rennie et al. used 5e-5 after cross-entropy training on COCO; at
    cross-entropy's rates the first noisy steps undo the start."""

    enabled: bool = False
    samples: int = 5  # k captions drawn per image
    # loo: the mean reward of the image's other k - 1 samples | greedy: the greedy caption's reward (Rennie's)
    baseline: Literal["loo", "greedy"] = "loo"
    max_len: int = 20  # words per sampled caption (<end> not counted); longer samples are cut off


@dataclass
class LogConfig:
    """What a run writes for watching it besides metrics.jsonl (train/tensorboard.py)."""

    # TensorBoard event files in the run folder (`tensorboard --logdir runs`): the training
    # figures of every log line, the validation figures, and the attention figures below.
    tensorboard: bool = True
    # At each validation, the attention figure and caption of this many validation images (the
    # split's first, the same at every validation). 0: none.
    tensorboard_images: int = 3


@dataclass
class TrainConfig:
    name: str = "run"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelSection = field(default_factory=ModelSection)
    optim: OptimConfig = field(default_factory=OptimConfig)
    val: ValConfig = field(default_factory=ValConfig)
    hard: HardConfig = field(default_factory=HardConfig)
    scst: ScstConfig = field(default_factory=ScstConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        cfg = cls()
        for key, value in d.items():
            if key == "name":
                cfg.name = checked("name", str, value)
                continue
            section = getattr(cfg, key, None)
            if section is None or not isinstance(value, dict):
                raise ValueError(f"unknown config section [{key}]")
            for k, v in value.items():
                _set_field(section, key, k, v)
        return cfg


@cache
def _kinds(section_type: type) -> dict[str, object]:
    """A section's field name -> its annotation, resolved."""
    return get_type_hints(section_type)


def _set_field(section, section_name: str, key: str, value, text: str | None = None) -> None:
    """Set ``section.key`` to ``value`` as its annotation wants it. ``text``: the value as
    written after --set, taken whole for a string field (``--set model.init_from=123``)."""
    kinds = _kinds(type(section))
    if key not in kinds:
        raise ValueError(f"unknown config key {section_name}.{key}; known: {', '.join(sorted(kinds))}")
    kind = kinds[key]
    if text is not None and not isinstance(value, str) and (kind is str or get_origin(kind) is Literal):
        value = text
    setattr(section, key, checked(f"{section_name}.{key}", kind, value))


def checked(where: str, kind, value):
    """``value`` as the annotation ``kind`` wants it (an int is a float too, true/false/1/0 a
    bool), or a one-line ValueError naming ``where``, the value and what is allowed."""
    if get_origin(kind) is Literal:
        choices = get_args(kind)
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"{where} must be one of {', '.join(choices)}, got {value!r}")
        return value
    if kind is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        if isinstance(value, int) and value in (0, 1):  # bool is an int
            return bool(value)
        raise ValueError(f"{where} must be true or false, got {value!r}")
    if kind is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError(f"{where} must be an integer, got {value!r}")
    if kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ValueError(f"{where} must be a number, got {value!r}")
    if kind is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"{where} must be a string, got {value!r}")
    raise TypeError(f"{where}: no check for values of type {kind!r}")


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    return apply_overrides(TrainConfig.from_dict(read_config(path) if path is not None else {}), overrides)


# The configs shipped with captioner (the repository's train/configs), installed beside this file.
BUNDLED_CONFIGS = Path(__file__).parent / "configs"


def bundled_configs() -> list[str]:
    """The names of the shipped configs: ``--config NAME`` takes one from any folder."""
    return sorted(p.stem for p in BUNDLED_CONFIGS.glob("*.toml"))


def find_config(path: str | Path) -> Path:
    """The config file ``path`` names: a file; else a shipped config's name (``own-soft``, with
    or without ``.toml``), or the repository's path of one (``train/configs/own-soft.toml``)
    read from another folder; else a one-line ValueError listing the shipped names."""
    path = Path(path)
    if path.is_file():
        return path
    name, names = path.name.removesuffix(".toml"), bundled_configs()
    if name in names and path.parent.as_posix() in (".", "train/configs"):
        return BUNDLED_CONFIGS / f"{name}.toml"
    near = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    hint = f"did you mean {near[0]}? " if near else ""
    raise ValueError(f"no config file {path}; {hint}shipped configs, by name from any folder (--config own-soft): "
                     f"{', '.join(names)}")


def read_config(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict:
    """The TOML file at ``path`` (or the shipped config it names: ``find_config``) as a dict,
    merged over its base's when it names one."""
    path = find_config(path) if not _chain else Path(path)
    with open(path, "rb") as f:
        data = tomllib.load(f)
    return over_bases(path, data, _chain)


def over_bases(path: Path, data: dict, _chain: tuple[Path, ...] = ()) -> dict:
    """``data``, the TOML of the config file at ``path``, merged over its base's when it names
    one: for a caller that has read the file already (for its own keys, say)."""
    data = dict(data)
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ValueError(f"{path}: base must be a string, the path of another config, got {base!r}")
    chain = (*_chain, path.resolve())
    target = path.parent / base
    if target.resolve() in chain:
        cycle = " -> ".join(str(p) for p in (*chain[chain.index(target.resolve()):], target.resolve()))
        raise ValueError(f"config bases run in a circle: {cycle}")
    if not target.is_file():
        raise ValueError(f"{path}: base {base!r} is not a file ({target})")
    return _merged(read_config(target, chain), data)


def _merged(base: dict, delta: dict) -> dict:
    """``base`` with ``delta``'s values over it; tables merge key by key."""
    out = dict(base)
    for key, value in delta.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both else value
    return out


def apply_overrides(cfg: TrainConfig, overrides: list[str]) -> TrainConfig:
    """``section.key=value`` strings; values are Python/TOML literals or bare strings."""
    for item in overrides:
        if item.startswith("name="):  # the run's name, the one key outside a section
            cfg.name = item.split("=", 1)[1]
            if not cfg.name:
                raise ValueError("name must not be empty (--set name=NAME names the run and its folder)")
            continue
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ValueError(f"--set wants section.key=value or name=NAME, got {item!r}")
        dotted, raw = item.split("=", 1)
        section_name, key = dotted.split(".", 1)
        section = getattr(cfg, section_name, None)
        if section is None or section_name == "name":
            raise ValueError(f"unknown config section {section_name!r}")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        _set_field(section, section_name, key, value, text=raw)
    check_model_section(cfg.model)
    check_scst_section(cfg.scst)
    check_values(cfg)
    return cfg


def model_config(m: ModelSection, vocab_size: int) -> ModelConfig:
    """The ``captioner`` ModelConfig a training config's [model] section describes: the one
    conversion, for the training loop, the start-up check and the benchmarks."""
    shape = {f.name: getattr(m, f.name) for f in fields(ModelConfig) if f.name not in SET_BY_THE_RUN}
    return ModelConfig(**{**shape, "vocab_size": vocab_size, "image_size": (m.image_size, m.image_size)})


def check_model_section(m: ModelSection) -> None:
    """Refuse (ValueError, one line) at start-up a model section that ModelConfig refuses,
    rather than with a traceback once data and encoder are loaded."""
    if m.encoder not in encoder_names():
        raise ValueError(f"model.encoder must be one of {', '.join(encoder_names())}, got {m.encoder!r}")
    model_config(m, vocab_size=1)


SCST_BASELINES = get_args(get_type_hints(ScstConfig)["baseline"])


def check_scst_section(s: ScstConfig) -> None:
    """Refuse (ValueError, one line) at start-up an [scst] section the objective cannot use."""
    if s.baseline not in SCST_BASELINES:
        raise ValueError(f"scst.baseline must be one of {', '.join(SCST_BASELINES)}, got {s.baseline!r}")
    least = 2 if s.baseline == "loo" else 1  # leave-one-out needs another sample of the image
    if s.samples < least:
        raise ValueError(f"scst.samples must be at least {least} with the {s.baseline} baseline, got {s.samples}")
    if s.max_len < 1:
        raise ValueError(f"scst.max_len counts words and must be >= 1, got {s.max_len}")


def _at_least(low: float) -> tuple[Callable[[float], bool], str]:
    return (lambda v: v >= low), f">= {low:g}"


_POSITIVE = ((lambda v: v > 0), "> 0")
_SHARE = ((lambda v: 0 <= v <= 1), "between 0 and 1")

# section.key -> (test, what the value must be), beyond its type: each checked when a config
# is loaded, since a zero batch or a negative rate fails only at the first step.
BOUNDS: dict[str, tuple[Callable[[float], bool], str]] = {
    "data.min_count": _at_least(1), "data.max_unk_share": _SHARE, "data.max_vocab": _at_least(0),
    "data.max_caption_len": _at_least(1),
    "data.workers": _at_least(0), "data.shapes_train": _at_least(1), "data.shapes_val": _at_least(1),
    "data.shapes_image_size": _at_least(1),
    "model.image_size": _at_least(1), "model.resize": _at_least(0),
    "optim.epochs": _at_least(1), "optim.max_steps": _at_least(0), "optim.max_minutes": _at_least(0),
    "optim.batch_size": _at_least(1), "optim.lr": _POSITIVE, "optim.encoder_lr": _POSITIVE,
    "optim.weight_decay": _at_least(0), "optim.lr_decay": ((lambda v: 0 < v <= 1), "in (0, 1]"),
    "optim.lr_decay_every": _at_least(1), "optim.grad_clip": _at_least(0),
    "optim.ema": ((lambda v: 0 <= v < 1), "in [0, 1) (0: off)"), "optim.doubly_stochastic": _at_least(0),
    "optim.threads": _at_least(0), "optim.log_every": _at_least(1), "optim.save_every": _at_least(0),
    "val.every_epochs": _at_least(0), "val.beam_size": _at_least(1), "val.max_len": _at_least(1),
    "val.limit": _at_least(0), "val.patience": _at_least(0), "val.min_images": _at_least(0),
    "hard.lambda_r": _at_least(0), "hard.entropy": _at_least(0), "hard.baseline_decay": _SHARE,
    "hard.expected_context_prob": _SHARE, "log.tensorboard_images": _at_least(0),
}

# What validation scores (train/loop.py's validate): the caption metrics but METEOR, which it
# skips (a Java process per validation), and on data with objects (shapes) the grounding figures.
CAPTION_FIGURES = tuple(n for n in METRIC_NAMES if n != "METEOR")
GROUNDING_FIGURES = tuple(f.name for f in fields(GroundingSummary) if not f.name.startswith("n_")
                          and "chance" not in f.name)


def check_values(cfg: TrainConfig) -> None:
    """Refuse (ValueError, one line) a value its type allows but the run cannot use."""
    for dotted, (ok, what) in BOUNDS.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        if isinstance(value, float) and not math.isfinite(value) or not ok(value):
            raise ValueError(f"{dotted} must be {what}, got {value!r}")
    metric_names(cfg.val.metric)


def metric_parts(metric: str) -> list[str]:
    """The names in ``val.metric``: one, or after ``min:`` several, comma-separated. Start-up's
    check (metric_names) and validation (loop.validation_value) both read it here, so what is
    checked is what is scored."""
    if metric.startswith("min:"):
        return [n.strip() for n in metric.removeprefix("min:").split(",")]
    return [metric.strip()]


def metric_names(metric: str) -> list[str]:
    """The figures ``val.metric`` names (metric_parts), each one validation gives, or a one-line
    ValueError with the nearest name."""
    names = metric_parts(metric)
    known = CAPTION_FIGURES + GROUNDING_FIGURES
    for name in names:
        if name not in known:
            near = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = f"did you mean {near[0]}? " if near else ""
            raise ValueError(f"val.metric {metric!r}: {name!r} is not a figure validation gives; {hint}caption "
                             f"metrics: {', '.join(CAPTION_FIGURES)}; on data with objects (shapes): "
                             f"{', '.join(GROUNDING_FIGURES)}; min:A,B takes the smaller")
    return names


def grounding_metrics(metric: str) -> list[str]:
    """The figures of ``val.metric`` that only data with objects (shapes) gives."""
    return [n for n in metric_names(metric) if n in GROUNDING_FIGURES]


@dataclass(frozen=True)
class Ignored:
    """Values the run's other choices make ignored: ``keys``, ignored ``because`` of the values
    of ``causes``."""

    keys: tuple[str, ...]
    because: str
    causes: tuple[str, ...]


def ignored_values(cfg: TrainConfig) -> list[Ignored]:
    """What this config sets that its model or objective does not use."""
    m, s = cfg.model, cfg.scst
    mode = attention_mode(m.attention)
    hard = tuple(f"hard.{f.name}" for f in fields(HardConfig))
    out = []
    if s.enabled:
        out.append(Ignored(hard + ("optim.doubly_stochastic",), "self-critical training (scst.enabled) replaces "
                           "the cross-entropy and REINFORCE objectives", ("scst.enabled",)))
    else:
        if not mode.stochastic:
            out.append(Ignored(hard, f"REINFORCE is for hard attention, and model.attention is {m.attention}",
                               ("model.attention",)))
        if not mode.attends:
            out.append(Ignored(("optim.doubly_stochastic",), f"{m.attention} attention's maps are uniform: the "
                               "penalty is a constant", ("model.attention",)))
        out.append(Ignored(tuple(f"scst.{f.name}" for f in fields(ScstConfig) if f.name != "enabled"),
                           "scst.enabled is false", ("scst.enabled",)))
    if m.freeze_encoder:
        out.append(Ignored(("model.fine_tune_blocks", "optim.encoder_lr"), "model.freeze_encoder is true: no "
                           "encoder weight trains", ("model.freeze_encoder",)))
    return out


def check_ignored(cfg: TrainConfig, stated: set[str] = frozenset(), written: set[str] = frozenset(),
                  overridden: set[str] = frozenset()) -> list[str]:
    """Refuse (ValueError, one line) a value the run would ignore that the user gave for this
    run: with --set, or in the config file itself (``stated``) unless a --set of what makes it
    ignored switched it off (``--set model.attention=soft`` on a hard config). Return one note
    per reason for the ignored values that a base config sets (``written``: any file of the
    chain) or that differ from their defaults, for the start-up summary. A file that states
    every key is a run's resolved config.toml: a record of a run, whose values are noted only
    where they differ from the defaults."""
    defaults = TrainConfig()
    if stated >= written_keys(defaults.to_dict()):
        stated = written = frozenset()
    notes = []
    for rule in ignored_values(cfg):
        chosen = not overridden & set(rule.causes)
        refused = [k for k in rule.keys if k in overridden or (chosen and k in stated)]
        if refused:
            where = "--set" if refused[0] in overridden else "the config file"
            raise ValueError(f"{refused[0]} (from {where}) has no effect: {rule.because}; remove it")
        shown = [k for k in rule.keys if k in written or k in overridden or _value(cfg, k) != _value(defaults, k)]
        if shown:
            notes.append(f"ignored, {rule.because}: {', '.join(f'{k} = {_value(cfg, k)!r}' for k in shown)}")
    return notes


def _value(cfg: TrainConfig, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def written_keys(data: dict) -> set[str]:
    """``section.key`` for every value of a config dict (``name`` as itself)."""
    return {f"{section}.{key}" for section, values in data.items() if isinstance(values, dict) for key in values} | \
        ({"name"} if "name" in data else set())


def to_toml(cfg: TrainConfig) -> str:
    """The resolved config, written into the run folder."""
    lines = [f"name = {_toml_value(cfg.name)}", ""]
    for section, values in cfg.to_dict().items():
        if not isinstance(values, dict):
            continue
        lines.append(f"[{section}]")
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in values.items())
        lines.append("")
    return "\n".join(lines)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'
