"""The training data's name, in words, for the checkpoint's metadata and the app's model card."""

from __future__ import annotations

import json
from pathlib import Path

from captioner.inference import SYNTHETIC_SHAPES

from .config import DataConfig


def _description(captions_file: Path) -> str:
    """``info.description`` of a COCO-format captions file ("COCO 2014 Dataset"), or ""."""
    try:
        with open(captions_file, encoding="utf-8") as f:
            info = json.load(f).get("info") or {}
    except (OSError, ValueError, AttributeError):
        return ""
    description = info.get("description") if isinstance(info, dict) else None
    return description.strip() if isinstance(description, str) else ""


def training_data_name(d: DataConfig) -> str:
    """E.g. "synthetic shapes (data/shapes, split train)" or "COCO 2014 Dataset (data/coco,
    Karpathy split dataset_coco.json)": the dataset as its captions file describes itself
    (else the folder's name), where it was, and which split trained the model. A name that
    starts with "synthetic shapes" tells the app and the CLI that the model knows shapes only."""
    description = _description(Path(d.dir) / f"captions_{d.train_split}.json")
    if d.generate_shapes or description.startswith(SYNTHETIC_SHAPES):
        what = SYNTHETIC_SHAPES
    else:
        what = description or Path(d.dir).name or str(d.dir)
    split = f"Karpathy split {Path(d.karpathy).name}" if d.karpathy else f"split {d.train_split}"
    return f"{what} ({d.dir}, {split})"
