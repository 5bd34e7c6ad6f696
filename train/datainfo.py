"""The training data in words: its name, for the checkpoint's metadata and the app's model card,
the vocabulary a run builds from it, and the summary of what a run trains on, for `data check`
and training's start-up."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from captioner.data.coco import OWN_SPLIT_FILE, ImageRecord, TrainingCaptions
from captioner.bundled import SYNTHETIC_SHAPES
from captioner.vocab import Tokenizer, Vocabulary

from .config import DataConfig

# The "dataset" field of Karpathy's split files -> the data set's name.
KARPATHY_DATASETS = {"coco": "COCO 2014, Karpathy split", "flickr8k": "Flickr8k",
                     "flickr30k": "Flickr30k, Karpathy split"}


def _description(captions_file: Path) -> str:
    """``info.description`` of a COCO-format captions file ("COCO 2014 Dataset"), or ""."""
    try:
        with open(captions_file, encoding="utf-8") as f:
            info = json.load(f).get("info") or {}
    except (OSError, ValueError, AttributeError):
        return ""
    description = info.get("description") if isinstance(info, dict) else None
    return description.strip() if isinstance(description, str) else ""


def _karpathy_dataset(split_file: Path) -> str:
    """The ``dataset`` field of a Karpathy split file ("coco", "flickr8k"), or "". The published
    files end with it: reading the last few KB finds it without parsing COCO's 150 MB again."""
    try:
        with open(split_file, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - 4096))
            tail = f.read().decode("utf-8", errors="replace")
            found = re.search(r'"dataset"\s*:\s*"([^"]*)"\s*}?\s*$', tail)
            if found is not None:
                return found.group(1)
            f.seek(0)
            dataset = json.load(f).get("dataset")
    except (OSError, ValueError, AttributeError):
        return ""
    return dataset if isinstance(dataset, str) else ""


def training_data_name(d: DataConfig) -> str:
    """The data set a model trains on, named from its layout and never by where it lies (the
    name is shown to every visitor of the app): "COCO 2014, Karpathy split" and "Flickr8k" from
    Karpathy's split files, "COCO 2014, split train2014" from COCO's own annotations, "synthetic
    shapes" for the generated data. A name that starts with "synthetic shapes" tells the app and
    the CLI that the model knows shapes only."""
    folder = Path(d.dir)
    captions = next((p for p in (folder / f"captions_{d.train_split}.json",
                                 folder / "annotations" / f"captions_{d.train_split}.json") if p.is_file()), None)
    description = _description(captions) if captions is not None else ""
    if d.generate_shapes or description.startswith(SYNTHETIC_SHAPES):
        return SYNTHETIC_SHAPES
    if d.split_file is not None:
        dataset = _karpathy_dataset(d.split_file)
        if d.split_file.name == OWN_SPLIT_FILE:  # what `captioner data import` wrote: a seeded split of its own
            return f"{dataset or folder.resolve().name} (own data)"
        return KARPATHY_DATASETS.get(dataset.lower(), f"{dataset or d.split_file.stem}, Karpathy split")
    name = re.sub(r"\s+dataset\b", "", description, flags=re.I).strip() or folder.resolve().name
    return f"{name}, split {d.train_split}"


def vocab_min_count(d: DataConfig, kept: TrainingCaptions) -> int:
    """The min_count a run's vocabulary keeps words at: ``data.min_count``, lowered (as far as 1)
    while more than ``data.max_unk_share`` of the training captions' words (tokens, counted with
    repeats) would be <unk>. A small data set sees most of its words once or twice: at a corpus's
    threshold its model would learn to say <unk>."""
    counts = Counter(t for _, tokens in kept.items for t in tokens)
    total = sum(counts.values())
    for min_count in range(d.min_count, 1, -1):
        if not total or sum(c for c in counts.values() if c < min_count) / total <= d.max_unk_share:
            return min_count
    return 1


def vocabulary(d: DataConfig, kept: TrainingCaptions, tokenizer: Tokenizer) -> Vocabulary:
    """The vocabulary of the training captions ``kept`` (tokens of ``tokenizer``): words seen at
    least ``vocab_min_count`` times, at most ``data.max_vocab``."""
    counts = Counter(t for _, tokens in kept.items for t in tokens)
    return Vocabulary.from_counts(counts, min_count=vocab_min_count(d, kept), max_size=d.max_vocab or None,
                                  tokenizer=tokenizer)


def summary_lines(d: DataConfig, splits: dict[str, list[ImageRecord]], vocab: Vocabulary,
                  kept: TrainingCaptions, unreadable: dict[str, int] | None = None) -> list[str]:
    """What a run trains and validates on, a line per item: shared by `data check` and training.
    ``kept``: the training captions, with those left out for having over ``data.max_caption_len``
    words or none at all; ``unreadable``: split -> images left out as unreadable. ``vocab``: the
    run's (its size, and the tokenizer it was built with: a resumed run's is its checkpoint's)."""
    source = f" (split file {d.split_file})" if d.split_file else ""
    lines = [f"data: {d.dir}{source}"]
    for name, records in splits.items():
        counts = [len(r.captions) for r in records]
        n = sum(counts)
        line = (f"{name}: {_count(len(records), 'image')}, {n:,} captions, {n / max(1, len(records)):.1f} per image "
                f"(min {min(counts, default=0)}, max {max(counts, default=0)})")
        left_out = []
        if name == d.train_split and kept.too_long:
            left_out.append(f"{kept.too_long:,} training captions over {d.max_caption_len} words")
        empty = sum(r.empty_captions for r in records) + (kept.empty if name == d.train_split else 0)
        if empty:
            left_out.append(_count(empty, "empty caption"))
        if left_out:
            line += f"; {' and '.join(left_out)} left out"
        if unreadable and unreadable.get(name):
            line += f"; {_count(unreadable[name], 'unreadable image')} left out"
        lines.append(line)
    limit = f", at most {d.max_vocab:,}" if d.max_vocab else ""
    tokenizer = vocab.tokenizer.name
    tokens = vocab.tokenizer.unit
    used = vocab_min_count(d, kept)
    lowered = (f" (data.min_count {d.min_count} lowered: at most {d.max_unk_share:.0%} of the training words "
               "<unk>)" if used < d.min_count else "")
    lines.append(f"vocabulary: {len(vocab):,} {tokens} (tokenizer {tokenizer}, min_count {used}{lowered}{limit}, "
                 "with 4 special tokens)")
    return lines


def _count(n: int, thing: str) -> str:
    return f"{n:,} {thing}{'s' if n != 1 else ''}"
