"""Tiny random models and images, and a tiny COCO-format data set, for fast CPU tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from PIL import Image

from captioner.data.images import Preprocess
from captioner.data.vocab import Vocabulary
from captioner.inference import Captioner
from captioner.model.decoder import CaptionModel, ModelConfig

WORDS = ["a", "red", "blue", "green", "circle", "square", "star", "and", "small", "large"]


def tiny_vocab() -> Vocabulary:
    return Vocabulary.build([" ".join(WORDS)], min_count=1)


def tiny_config(**overrides) -> ModelConfig:
    cfg = dict(vocab_size=len(tiny_vocab()), encoder="small", image_size=(32, 32), embed_dim=12,
               hidden_dim=16, attention_dim=10, dropout=0.0)
    cfg.update(overrides)
    return ModelConfig(**cfg)


def tiny_captioner(seed: int = 0, **overrides) -> Captioner:
    torch.manual_seed(seed)
    cfg = tiny_config(**overrides)
    model = CaptionModel(cfg)
    # Random init gives near-uniform word distributions; sharpen them so decoding
    # choices are decided, not ties broken by rounding.
    with torch.no_grad():
        model.decoder.L_o.weight.mul_(8.0)
    return Captioner(model, tiny_vocab(), Preprocess(size=cfg.image_size))


def tiny_image(seed: int = 0, size: tuple[int, int] = (40, 30)) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    arr = (torch.rand(size[1], size[0], 3, generator=g) * 255).to(torch.uint8).numpy()
    return Image.fromarray(arr, "RGB")


def token_batch(vocab: Vocabulary, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = [vocab.encode(c) for c in captions]
    lengths = torch.tensor([len(x) for x in ids])
    tokens = torch.zeros(len(ids), int(lengths.max()), dtype=torch.long)
    for i, x in enumerate(ids):
        tokens[i, : len(x)] = torch.tensor(x)
    return tokens, lengths


# split -> [(image_id, file_name, (width, height), rgb colour, captions)]. Image ids are
# unique across splits, as in COCO. "zebra" appears only in a validation caption and
# "giraffe" only in a test caption, so tests can check that neither leaks into the
# training vocabulary.
TINY_COCO: dict[str, list[tuple[int, str, tuple[int, int], tuple[int, int, int], list[str]]]] = {
    "train": [
        (101, "train_101.png", (20, 16), (255, 0, 0), ["A red square on a table.", "a red box", "red square"]),
        (102, "train_102.png", (18, 16), (0, 255, 0), ["A green circle.", "a green ball on grass"]),
        (103, "train_103.png", (16, 20), (0, 0, 255), ["a blue square", "the blue box is small", "blue"]),
        (104, "train_104.png", (16, 16), (255, 255, 0), ["A yellow star in the sky.", "a yellow star"]),
        (105, "train_105.png", (24, 16), (255, 0, 255), ["a purple circle", "purple ball on a table"]),
        (106, "train_106.png", (16, 24), (0, 255, 255), ["a cyan square and a red circle", "two shapes"]),
    ],
    "val": [
        (201, "val_201.png", (16, 16), (128, 0, 0), ["a zebra on a table", "a dark red square"]),
        (202, "val_202.png", (16, 16), (0, 128, 0), ["a dark green circle", "a green ball", "green"]),
    ],
    "test": [
        (301, "test_301.png", (16, 16), (0, 0, 128), ["a giraffe and a dark blue square", "a blue box"]),
        (302, "test_302.png", (16, 16), (128, 128, 128), ["a grey circle", "a grey ball on a table"]),
    ],
}


def write_tiny_coco(root: Path) -> Path:
    """Write TINY_COCO under ``root`` as images/ + captions_<split>.json; return ``root``."""
    (root / "images").mkdir(parents=True, exist_ok=True)
    ann_id = 1
    for split, entries in TINY_COCO.items():
        images, annotations = [], []
        for image_id, file_name, (w, h), colour, captions in entries:
            Image.new("RGB", (w, h), colour).save(root / "images" / file_name)
            images.append({"id": image_id, "file_name": file_name, "width": w, "height": h})
            for caption in captions:
                annotations.append({"id": ann_id, "image_id": image_id, "caption": caption})
                ann_id += 1
        data = {"info": {"description": f"tiny test set, {split}"}, "licenses": [],
                "images": images, "annotations": annotations}
        (root / f"captions_{split}.json").write_text(json.dumps(data), encoding="utf-8")
    return root


def write_coco_instances(coco: Path, objects: dict[int, list[tuple[str, list[float], list | None]]]) -> None:
    """COCO's instance annotations for a data folder in the published layout (the photo
    fixture's ``coco/``): ``annotations/instances_{train,val}2014.json`` listing every image
    of the captions file beside it, with ``objects``: image id -> [(category name, bbox
    [x, y, w, h], polygons or None)]. An image not in ``objects`` has no instances."""
    names = sorted({name for found in objects.values() for name, _, _ in found})
    categories = [{"id": 100 + i, "name": n, "supercategory": "thing"} for i, n in enumerate(names)]
    ids = {c["name"]: c["id"] for c in categories}
    ann_id = 1
    for split in ("train2014", "val2014"):
        captions = json.loads((coco / "annotations" / f"captions_{split}.json").read_text(encoding="utf-8"))
        annotations = []
        for image in captions["images"]:
            for name, bbox, polygons in objects.get(image["id"], []):
                annotations.append({"id": ann_id, "image_id": image["id"], "category_id": ids[name], "bbox": bbox,
                                    "area": bbox[2] * bbox[3], "iscrowd": 0,
                                    **({"segmentation": polygons} if polygons is not None else {})})
                ann_id += 1
        data = {"info": captions.get("info", {}), "licenses": [], "images": captions["images"],
                "annotations": annotations, "categories": categories}
        (coco / "annotations" / f"instances_{split}.json").write_text(json.dumps(data), encoding="utf-8")
