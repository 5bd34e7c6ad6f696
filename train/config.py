"""Training configuration: a TOML file, overridable with ``--set section.key=value``."""

from __future__ import annotations

import ast
import os
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path


@dataclass
class DataConfig:
    dir: str = "data/shapes"
    train_split: str = "train"
    val_split: str = "val"
    # Karpathy split file (dataset_coco.json), inside `dir` unless absolute, so that --set
    # data.dir=... moves it too; empty: the folder's own splits.
    karpathy: str = ""
    min_count: int = 5  # vocabulary: words seen at least this often in training captions
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

    @property
    def split_file(self) -> Path | None:
        """The Karpathy split file: ``karpathy`` inside ``dir`` unless it is absolute."""
        return Path(self.dir) / self.karpathy if self.karpathy else None

    def loader_workers(self) -> int:
        """``workers``, at most the CPU cores this process may use (under torchrun, its share of
        the machine's): more processes than cores only compete for them, and torch warns."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        ranks_here = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        return max(0, min(self.workers, max(1, cores // ranks_here)))


@dataclass
class ModelSection:
    encoder: str = "small"
    encoder_pretrained: bool = False
    fine_tune_blocks: int = 0
    freeze_encoder: bool = False  # no encoder weight trains (needed by the feature cache for "small")
    init_from: str = ""  # start from this checkpoint's weights (same architecture), e.g. hard from soft
    # Start the encoder alone from this checkpoint (a bundled model's name or a path), the
    # decoder fresh: with freeze_encoder, the paper's set-up of a decoder over fixed features.
    encoder_from: str = ""
    image_size: int = 128
    # 0: the whole image resized to image_size (no crop). N: torchvision's ImageNet recipe,
    # the shorter side resized to N then the centre image_size cropped (the paper: 256 -> 224).
    resize: int = 0
    embed_dim: int = 512
    hidden_dim: int = 512
    attention_dim: int = 512
    dropout: float = 0.5
    attention: str = "soft"  # soft | hard | mean
    score: str = "additive"
    normalizer: str = "softmax"
    local_window: float = 0.0
    local_width: str = "fixed"  # fixed | learned (predicted per step, starting at local_window)
    heads: int = 1  # decoder attention heads
    grid_layers: int = 0  # blocks of self-attention over the grid cells (0: none)
    grid_heads: int = 8
    rel_pos_clip: int = 4  # row and column offsets clipped to +-this for the position bias
    grid_dim: int = 0  # width inside the blocks (0: min(annotation size, 512))
    grid_ff: int = 0  # feed-forward size (0: twice the width)


@dataclass
class OptimConfig:
    epochs: int = 20
    max_steps: int = 0  # 0: no limit
    max_minutes: float = 0.0  # 0: no limit; stop (and save) after this much training time
    batch_size: int = 64  # the global batch: under torchrun each rank takes its share
    optimizer: str = "adam"  # adam | rmsprop (centred, momentum 0.9, as the authors' code) | sgd (momentum 0.9)
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
    precision: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16 | fp16 (with a gradient scaler)
    # torch.compile the decoder's per-word step with this backend: "" (off), "inductor"
    # (fused kernels; pays off on CUDA), or e.g. "aot_eager" (traces without generating code).
    compile: str = ""
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


@dataclass
class HardConfig:
    """REINFORCE for hard attention: reward = per-word mean log p(y|s,a) against a
    moving-average baseline of the same, weighted 0.1, entropy bonus 0.002, as in the
    authors' code (capgen.py), each averaged over the captions of the minibatch like the
    NLL (the paper's eq. 12), so that the weights mean the same at any batch size; see
    ``captioner.train.losses.HardAttentionObjective``. ``reduction = "sum"`` is capgen's form, which
    adds the two terms over the captions (their weight grows with the batch size)."""

    reward: str = "word_mean"  # word_mean: mean over the caption's words of log p | caption: their sum
    lambda_r: float = 0.1  # weight of the score-function term (the authors' "/10.")
    entropy: float = 0.002  # lambda_e, entropy bonus on every minibatch
    # How the score-function and entropy terms add over the B captions of a minibatch:
    # "mean" (1/B, like the NLL; the paper's estimator) or "sum" (capgen's: no 1/B beside a
    # mean NLL, so their weight is x B and changes with the batch size).
    reduction: str = "mean"
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
    baseline: str = "loo"
    max_len: int = 20  # words per sampled caption (<end> not counted); longer samples are cut off


@dataclass
class TrainConfig:
    name: str = "run"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelSection = field(default_factory=ModelSection)
    optim: OptimConfig = field(default_factory=OptimConfig)
    val: ValConfig = field(default_factory=ValConfig)
    hard: HardConfig = field(default_factory=HardConfig)
    scst: ScstConfig = field(default_factory=ScstConfig)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        cfg = cls()
        for key, value in d.items():
            if key == "name":
                cfg.name = str(value)
                continue
            section = getattr(cfg, key, None)
            if section is None or not isinstance(value, dict):
                raise ValueError(f"unknown config section [{key}]")
            for k, v in value.items():
                if key == "optim" and k == "amp":  # older runs: a bool for bf16 autocast on CUDA
                    k, v = "precision", "auto" if v else "fp32"
                _set_field(section, key, k, v)
        return cfg


def _set_field(section, section_name: str, key: str, value) -> None:
    types = {f.name: f.type for f in fields(section)}
    if key not in types:
        raise ValueError(f"unknown config key {section_name}.{key}; known: {', '.join(sorted(types))}")
    current = getattr(section, key)
    if isinstance(current, bool):
        if isinstance(value, str):
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"{section_name}.{key} must be true or false, got {value!r}")
            value = value.lower() in ("true", "1")
        value = bool(value)
    elif isinstance(current, (int, float)) and not isinstance(current, bool):
        try:
            value = type(current)(value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{section_name}.{key} must be a {type(current).__name__}, got {value!r}") from e
    else:
        value = str(value)
    setattr(section, key, value)


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    data: dict = {}
    if path is not None:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    return apply_overrides(TrainConfig.from_dict(data), overrides)


def apply_overrides(cfg: TrainConfig, overrides: list[str]) -> TrainConfig:
    """``section.key=value`` strings; values are Python/TOML literals or bare strings."""
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ValueError(f"--set wants section.key=value, got {item!r}")
        dotted, raw = item.split("=", 1)
        section_name, key = dotted.split(".", 1)
        section = getattr(cfg, section_name, None)
        if section is None or section_name == "name":
            raise ValueError(f"unknown config section {section_name!r}")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        _set_field(section, section_name, key, value)
    check_model_section(cfg.model)
    check_scst_section(cfg.scst)
    return cfg


# Fields of [model] that say how a run starts or reads its images, not the model's shape.
TRAINING_ONLY_MODEL_FIELDS = ("init_from", "encoder_from", "resize")


def model_config(m: ModelSection, vocab_size: int):
    """The ``captioner`` ModelConfig a training config's [model] section describes: one
    conversion for the training loop, the start-up check and the benchmarks."""
    from captioner.model import ModelConfig

    shape = {k: v for k, v in asdict(m).items() if k not in TRAINING_ONLY_MODEL_FIELDS}
    return ModelConfig.from_dict({**shape, "vocab_size": vocab_size, "image_size": (m.image_size, m.image_size)})


def check_model_section(m: ModelSection) -> None:
    """Refuse (ValueError, one line) at start-up a model section that ModelConfig refuses,
    rather than with a traceback once data and encoder are loaded."""
    model_config(m, vocab_size=1)


SCST_BASELINES = ("loo", "greedy")


def check_scst_section(s: ScstConfig) -> None:
    """Refuse (ValueError, one line) at start-up an [scst] section the objective cannot use."""
    if s.baseline not in SCST_BASELINES:
        raise ValueError(f"scst.baseline must be one of {', '.join(SCST_BASELINES)}, got {s.baseline!r}")
    least = 2 if s.baseline == "loo" else 1  # leave-one-out needs another sample of the image
    if s.samples < least:
        raise ValueError(f"scst.samples must be at least {least} with the {s.baseline} baseline, got {s.samples}")
    if s.max_len < 1:
        raise ValueError(f"scst.max_len counts words and must be >= 1, got {s.max_len}")


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
