"""What a run checks and sets up before it trains: its data (generated, or every image found
readable), its model with the weights it starts from, and its run folder's first write (on
rank 0, taken back when a new run cannot start).

Each refusal is a StartupError: one line, raised before anything is written or after what
was written is taken back.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

from captioner.checkpoint import CheckpointError, load_checkpoint
from captioner.data.coco import ImageRecord, TrainingCaptions, build_vocab, dataset_tokenizer, load_splits
from captioner.distributed import DistContext
from captioner.images import IMAGENET_MEAN, IMAGENET_STD, Preprocess
from captioner.inference import resolve_weights
from captioner.model import CaptionModel, ModelConfig
from captioner.vocab import DEFAULT_TOKENIZER, PTB, Tokenizer, Vocabulary, tokenizer_named

from .config import DataConfig, TrainConfig, model_config


class StartupError(ValueError):
    """Training cannot start: the data, the config or the run folder need the user. Raised
    before anything is written, or after what was written is taken back; one line."""


def prepare_data(cfg: TrainConfig) -> None:
    """Generate the synthetic shapes data when the config asks for it and it is not there yet."""
    d = cfg.data
    if d.generate_shapes and not (Path(d.dir) / f"captions_{d.train_split}.json").is_file():
        from captioner.data.shapes import generate_dataset

        print(f"generating the shapes dataset in {d.dir}", file=sys.stderr)
        generate_dataset(Path(d.dir), {d.train_split: d.shapes_train, d.val_split: d.shapes_val},
                         seed=d.shapes_seed, image_size=d.shapes_image_size, progress=True,
                         top_to_bottom=d.shapes_top_to_bottom, language=d.shapes_language)


def readable_splits(cfg: TrainConfig, ctx: DistContext,
                    progress: bool) -> tuple[Preprocess, dict[str, list[ImageRecord]], dict[str, int]]:
    """The preprocessing, the training and validation splits less their unreadable images, and
    split -> how many were left out. A damaged image stops the run here, each named (unless
    ``data.skip_unreadable``), rather than with a traceback an hour in."""
    d, m = cfg.data, cfg.model
    splits = load_splits(d.dir, [d.train_split, d.val_split], d.split_file)
    preprocess = Preprocess(size=(m.image_size, m.image_size), mean=IMAGENET_MEAN, std=IMAGENET_STD,
                            resize=m.resize)
    # Every image decoded once now, the way training decodes it.
    unreadable = _unreadable_images(splits, preprocess, d, ctx, progress)
    if unreadable and not d.skip_unreadable:
        raise StartupError(_unreadable_message(unreadable))
    left_out = {name: sum(r.path in unreadable for r in records) for name, records in splits.items()}
    readable = {name: [r for r in splits[name] if r.path not in unreadable] for name in (d.train_split, d.val_split)}
    if not readable[d.train_split] or not readable[d.val_split]:
        raise StartupError("no readable images left in split "
                           f"{d.train_split if not readable[d.train_split] else d.val_split!r}")
    return preprocess, readable, left_out


def data_tokenizer(cfg: TrainConfig, ckpt: dict | None = None) -> Tokenizer:
    """The tokenizer a run trains with: the checkpoint's when resuming, else the one its data
    set names (the split file's or the captions file's; "ptb" when none)."""
    d = cfg.data
    name = (ckpt.get("tokenizer", DEFAULT_TOKENIZER) if ckpt is not None
            else dataset_tokenizer(d.dir, d.split_file, d.train_split))
    try:
        return tokenizer_named(name)
    except ValueError as e:
        raise StartupError(f"{d.split_file or d.dir} names an {e}") from e


def build_model(cfg: TrainConfig, train_records: list[ImageRecord], kept: TrainingCaptions, ckpt: dict | None,
                 device: torch.device, tokenizer: Tokenizer = PTB) -> tuple[CaptionModel, Vocabulary]:
    """The model and its vocabulary: the checkpoint's when resuming, else built from the
    training captions (``kept``, tokens of ``tokenizer``), the weights fresh or from
    ``model.init_from`` / ``model.encoder_from``."""
    d, m = cfg.data, cfg.model
    if ckpt is not None:
        vocab = Vocabulary(list(ckpt["vocab"]), tokenizer)
        model_cfg = ModelConfig.from_dict(ckpt["model_config"])
        model_cfg.encoder_pretrained = False  # the weights come from the checkpoint
    else:
        vocab = build_vocab(train_records, min_count=d.min_count, max_size=d.max_vocab or None, captions=kept,
                            tokenizer=tokenizer)
        model_cfg = model_config(m, len(vocab))
    model = CaptionModel(model_cfg).to(device)
    if ckpt is not None:
        model.load_state_dict(ckpt["state_dict"])
    elif m.init_from:
        _init_from(model, vocab, Path(m.init_from))
    if ckpt is None and m.encoder_from:
        _encoder_from(model, m.encoder_from)
    return model, vocab


def _unreadable_images(splits: dict[str, list], preprocess: Preprocess, d: DataConfig, ctx: DistContext,
                       progress: bool) -> dict[Path, str]:
    """Path -> why, for every image of ``splits`` that does not decode; each rank checks its share."""
    from captioner.data.check import unreadable_images

    paths = sorted({r.path for records in splits.values() for r in records})
    mine = unreadable_images(paths[ctx.rank::ctx.world], preprocess, workers=d.loader_workers(),
                             progress=progress and ctx.is_main)
    shares = ctx.gather(mine)
    return ctx.broadcast({path: why for share in shares for path, why in share.items()} if ctx.is_main else None)


LISTED = 10  # unreadable images named in the one-line error; `data check` lists them all


def _unreadable_message(unreadable: dict[Path, str]) -> str:
    named = "; ".join(f"{path} ({why})" for path, why in list(unreadable.items())[:LISTED])
    more = f"; and {len(unreadable) - LISTED:,} more" if len(unreadable) > LISTED else ""
    one = len(unreadable) == 1
    return (f"{len(unreadable):,} image{'' if one else 's'} cannot be read: {named}{more}. Replace or remove "
            f"{'it' if one else 'them'} (`captioner data check --config FILE` lists every one), or train without "
            f"{'it' if one else 'them'}: --set data.skip_unreadable=true")


def on_main(ctx: DistContext, work) -> None:
    """``work()`` on rank 0; a StartupError there is raised on every rank, which would otherwise
    wait for rank 0 at their next step together."""
    error = None
    if ctx.is_main:
        try:
            work()
        except StartupError as e:
            error = str(e)
    error = ctx.broadcast(error)
    if error is not None:
        raise StartupError(error)


def take_back(run_dir: Path) -> None:
    """Undo a new run's start-up: what it wrote goes (the folder too, when that leaves it empty),
    but a complete feature cache stays, for the next attempt to use."""
    keep = set()
    for meta in run_dir.glob("features-*.json"):
        try:
            complete = json.loads(meta.read_text()).get("complete")
        except (OSError, ValueError):
            complete = False
        if complete:
            keep |= {meta, meta.with_suffix(".f16")}
    for path in run_dir.iterdir() if run_dir.is_dir() else ():
        if path not in keep:
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    try:
        run_dir.rmdir()
    except OSError:  # not empty (a cache kept), or gone already
        pass


def _init_from(model: CaptionModel, vocab: Vocabulary, path: Path) -> None:
    """Copy another checkpoint's weights: same sizes and the same vocabulary required
    (the attention mode may differ: soft and hard attention share every parameter)."""
    try:
        src = load_checkpoint(path)
    except CheckpointError as e:
        raise StartupError(f"model.init_from: {e}") from e
    if list(src["vocab"]) != vocab.words:
        raise StartupError(f"{path} has a different vocabulary; it cannot initialise this run")
    try:
        model.load_state_dict(src["state_dict"])
    except RuntimeError as e:
        raise StartupError(f"{path} does not fit this model: {e}") from e


def _encoder_from(model: CaptionModel, name: str) -> None:
    """Copy only the encoder's weights of another checkpoint (a bundled model's name or a
    path); the decoder keeps its fresh initialisation. The encoders must be the same."""
    try:
        src = load_checkpoint(resolve_weights(name))
    except CheckpointError as e:
        raise StartupError(f"model.encoder_from: {e}") from e
    theirs = src["model_config"].get("encoder")
    if theirs != model.config.encoder:
        raise StartupError(f"model.encoder_from: {name} has the encoder {theirs!r}, this model "
                           f"{model.config.encoder!r}")
    weights = {k.removeprefix("encoder."): v for k, v in src["state_dict"].items() if k.startswith("encoder.")}
    try:
        model.encoder.load_state_dict(weights)
    except RuntimeError as e:
        raise StartupError(f"model.encoder_from: {name}'s encoder does not fit this model: {e}") from e
