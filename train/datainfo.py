"""The training data's name, in words, for the checkpoint's metadata and the app's model card."""

from __future__ import annotations

import json
import re
from pathlib import Path

from captioner.inference import SYNTHETIC_SHAPES

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
        return KARPATHY_DATASETS.get(dataset.lower(), f"{dataset or d.split_file.stem}, Karpathy split")
    name = re.sub(r"\s+dataset\b", "", description, flags=re.I).strip() or folder.resolve().name
    return f"{name}, split {d.train_split}"
