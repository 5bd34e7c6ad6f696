"""The training data in words: its name, for the checkpoint's metadata and the app's model card,
the vocabulary a run builds from it, and the summary of what a run trains on, for `data check`
and training's start-up."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from captioner.data.coco import OWN_SPLIT_FILE, ImageRecord, SplitSet, load_splits
from captioner.data.vocab import Tokenizer, Vocabulary
from captioner.io.bundled import SYNTHETIC_SHAPES

from .captions import TrainingCaptions
from .config import DataConfig

# The "dataset" field of Karpathy's split files -> the data set's name.
KARPATHY_DATASETS = {"coco": "COCO 2014, Karpathy split", "flickr8k": "Flickr8k",
                     "flickr30k": "Flickr30k, Karpathy split"}


@dataclass(frozen=True)
class DataSet:
    """A training config's data, its files read once at start-up and handed on: the records of
    its splits, the tokenizer it names, and its name for the checkpoint and the app."""

    dir: Path
    splits: dict[str, list[ImageRecord]]  # the training and validation splits (`data check`: and test)
    split_file: Path | None  # the Karpathy split file read (a folder's own dataset.json too); None: COCO's layout
    tokenizer: str  # the tokenizer's name the data gives ("ptb" when it names none)
    name: str  # what the model card calls it: see ``training_data_name``

    def with_splits(self, splits: dict[str, list[ImageRecord]]) -> "DataSet":
        """The same data set with other records (its readable images only, say)."""
        return replace(self, splits=splits)


def load_dataset(d: DataConfig, test: bool = False) -> DataSet:
    """The data of ``d``: its training and validation splits, with ``test`` also a Karpathy split
    file's test split when it has one; each file read once. A missing file or split is a
    one-line FileNotFoundError."""
    found = load_splits(d.dir, [d.train_split, d.val_split], d.split_file,
                        optional=["test"] if test and d.split_file is not None else [])
    return DataSet(Path(d.dir), found.records, found.split_file, found.tokenizer, training_data_name(d, found))


def training_data_name(d: DataConfig, found: SplitSet) -> str:
    """The data set a model trains on, named from its layout and what its files call it
    (``found``: its splits as read) and never by where it lies (the name is shown to every
    visitor of the app): "COCO 2014, Karpathy split" and "Flickr8k" from Karpathy's split files,
    "COCO 2014, split train2014" from COCO's own annotations, "NAME (own data)" from what
    `captioner data import` wrote, "synthetic shapes" for the generated data. A name that starts
    with "synthetic shapes" tells the app and the CLI that the model knows shapes only."""
    folder, title, split_file = Path(d.dir), found.title, found.split_file
    if d.generate_shapes or title.startswith(SYNTHETIC_SHAPES):
        return SYNTHETIC_SHAPES
    if split_file is not None:
        if split_file.name == OWN_SPLIT_FILE:  # what `captioner data import` wrote: a seeded split of its own
            return f"{title or folder.resolve().name} (own data)"
        return KARPATHY_DATASETS.get(title.lower(), f"{title or split_file.stem}, Karpathy split")
    name = re.sub(r"\s+dataset\b", "", title, flags=re.I).strip() or folder.resolve().name
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
