"""COCO-format caption data: real COCO, Karpathy splits, and our synthetic shapes data.

Two on-disk layouts are understood by :func:`load_split`:

- the project layout (shapes data, test fixtures): ``DIR/captions_<split>.json`` with
  image files under ``DIR/images/<file_name>``;
- the official COCO layout: ``DIR/annotations/captions_<split>.json`` (e.g. ``train2014``)
  with image files under ``DIR/<split>/<file_name>``.

With a Karpathy split file (``dataset_coco.json``, ``dataset_flickr8k.json``,
``dataset_flickr30k.json``) the split membership and the captions come from that file
instead, and image paths are ``DIR/<filepath>/<filename>``. A folder that holds no
captions file but a ``dataset.json`` (what ``captioner data import`` writes) is read
through that file, with no need to name it.

Each data set has a tokenizer (``captioner.data.vocab``): the split file's top-level
``"tokenizer"``, or the captions file's ``info.tokenizer``; "ptb" (English) when neither
names one. :func:`load_splits` gives it with the records (``SplitSet.tokenizer``);
:func:`dataset_tokenizer` reads it alone, from the file's ends, for a caller that has the records.

Annotation files are read with pycocotools, so anything it accepts works here.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch.utils.data import Dataset

from captioner.data.images import ImageLoadError, Preprocess
from captioner.data.vocab import DEFAULT_TOKENIZER

# The split file ``captioner data import`` writes: a folder holding it is read through it.
OWN_SPLIT_FILE = "dataset.json"

# Karpathy's "restval" images (COCO val2014 images outside his val/test) are training data
# in every published result that uses his splits.
KARPATHY_SPLIT_ALIASES: dict[str, tuple[str, ...]] = {"train": ("train", "restval")}


class SplitNotFoundError(FileNotFoundError):
    """The requested split does not exist; the message lists the splits that do.

    A FileNotFoundError so that command-line code can report it like a missing file.
    """


class MissingImagesError(FileNotFoundError):
    """Image files of a split are not where the annotations say; the message says how many."""


# Where users get the published files, for one-line "not found" messages.
COCO_ANNOTATIONS_HINT = ("COCO 2014 captions: annotations_trainval2014.zip from https://cocodataset.org/#download, "
                         "unzipped into the data folder (gives annotations/captions_train2014.json)")
KARPATHY_HINT = ("Karpathy's split files (dataset_coco.json, dataset_flickr8k.json, dataset_flickr30k.json) "
                 "are in caption_datasets.zip from https://cs.stanford.edu/people/karpathy/deepimagesent/")


def own_data_hint(data_dir: str | os.PathLike) -> str:
    """How own images and captions become the data set a folder lacks."""
    return (f"for your own images and captions, `captioner data import SOURCE --out {data_dir}` writes it "
            "(SOURCE: a CSV/TSV file, a JSON Lines file or a folder of images with .txt captions)")


def _missing_data_hint(data_dir: Path) -> str:
    """Where the data of a folder with no captions file comes from: COCO's download for a folder
    that says COCO, Karpathy's files for Flickr, else `captioner data import` (own data)."""
    text = str(data_dir).lower()
    if "coco" in text:
        return COCO_ANNOTATIONS_HINT
    if "flickr" in text:
        return KARPATHY_HINT
    return own_data_hint(data_dir)


def _images_hint(path: Path) -> str:
    text = str(path)
    if "2014" in text or "COCO_" in text:
        return "COCO 2014 images: train2014.zip and val2014.zip from https://cocodataset.org/#download"
    if "licker8k" in text:
        return "Flickr8k images: Flickr8k_Dataset.zip (folder Flicker8k_Dataset/), see the README"
    return "check data.dir (or --data)"


@dataclass
class ImageRecord:
    """One image and all of its reference captions."""

    image_id: int
    path: Path
    captions: list[str]
    width: int | None = None
    height: int | None = None
    empty_captions: int = 0  # captions with no word in the file (blank, or punctuation only): left out


def _with_words(raw: list[object]) -> tuple[list[str], int]:
    """The captions that hold a word (a letter or a digit), stripped, and how many did not."""
    captions = [str(c).strip() for c in raw]
    kept = [c for c in captions if any(ch.isalnum() for ch in c)]
    return kept, len(captions) - len(kept)


# --------------------------------------------------------------------------- loading


def load_records(captions_json: str | os.PathLike, image_root: str | os.PathLike) -> list[ImageRecord]:
    """Every image of a COCO captions file, with its captions, sorted by image id.

    Images without captions (e.g. an ``image_info_test*.json`` file) are kept with an
    empty caption list: they can still be captioned, just not scored or trained on. A
    caption with no word in it is left out (``ImageRecord.empty_captions`` counts them).
    """
    return _read_captions_file(captions_json, image_root)[0]


def _read_captions_file(captions_json: str | os.PathLike, image_root: str | os.PathLike) -> tuple[list[ImageRecord],
                                                                                                  dict]:
    """:func:`load_records`, and the file's ``info`` (a dict, empty when the file has none)."""
    from pycocotools.coco import COCO  # imported here: only this function needs it

    captions_json = Path(captions_json)
    image_root = Path(image_root)
    if not captions_json.is_file():
        raise FileNotFoundError(f"captions file not found: {captions_json} ({COCO_ANNOTATIONS_HINT})")
    # pycocotools prints progress ("loading annotations into memory...") to stdout,
    # which would corrupt output of commands that write results to stdout.
    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO(str(captions_json))

    records = []
    for image_id in sorted(coco.imgs):
        info = coco.imgs[image_id]
        anns = sorted(coco.imgToAnns.get(image_id, []), key=lambda a: a.get("id", 0))
        captions, empty = _with_words([a["caption"] for a in anns if "caption" in a])
        records.append(ImageRecord(
            image_id=int(image_id),
            path=image_root / info["file_name"],
            captions=captions,
            width=_int_or_none(info.get("width")),
            height=_int_or_none(info.get("height")),
            empty_captions=empty,
        ))
    info = coco.dataset.get("info")
    return records, info if isinstance(info, dict) else {}


@dataclass(frozen=True)
class SplitSet:
    """Several splits of a data folder, each file read once, with what the files say of the
    data set: the tokenizer it names and its own name for itself. "The files": the Karpathy
    split file, else the first split's captions file."""

    records: dict[str, list[ImageRecord]]
    split_file: Path | None  # the Karpathy split file read (a folder's own dataset.json included)
    tokenizer: str = DEFAULT_TOKENIZER  # the split file's "tokenizer", or the captions file's info.tokenizer
    title: str = ""  # the split file's "dataset" ("coco", "flickr8k"), or the captions file's info.description


def load_splits(data_dir: str | os.PathLike, splits: Sequence[str], karpathy: str | os.PathLike | None = None,
                optional: Sequence[str] = ()) -> SplitSet:
    """:func:`load_split` for several splits, each file read once (a Karpathy split file once for
    all), and what the files name: the tokenizer and the data set's title. ``optional``: more
    splits, left out when the data has none."""
    data_dir = Path(data_dir)
    karpathy = Path(karpathy) if karpathy is not None else own_split_file(data_dir)
    if karpathy is not None:
        data = _read_karpathy_file(karpathy, data_dir)
        named = {"tokenizer": data.get("tokenizer"), "description": data.get("dataset")}

        def read(split: str) -> tuple[list[ImageRecord], dict]:
            return _karpathy_split(data["images"], karpathy, data_dir, split), named
    else:
        read = partial(_split_records, data_dir)  # records and the captions file's info
    found = {split: read(split) for split in splits}
    for split in optional:
        if split not in found:
            with contextlib.suppress(SplitNotFoundError):
                found[split] = read(split)
    info = found[splits[0]][1]  # the split file's names, or the first split's captions file's
    return SplitSet({split: records for split, (records, _) in found.items()}, karpathy,
                    _named(info.get("tokenizer")) or DEFAULT_TOKENIZER, _named(info.get("description")))


def _named(value: object) -> str:
    """A name a file gives (stripped), or "" for anything that is not a string."""
    return value.strip() if isinstance(value, str) else ""


def load_split(data_dir: str | os.PathLike, split: str,
               karpathy: str | os.PathLike | None = None) -> list[ImageRecord]:
    """The records of one split.

    Without ``karpathy``: ``data_dir/captions_<split>.json`` (images under
    ``data_dir/images``), or else the official COCO layout
    ``data_dir/annotations/captions_<split>.json`` (images under ``data_dir/<split>``).

    With ``karpathy`` (a Karpathy split file): the images whose ``split`` field matches;
    ``"train"`` also includes ``"restval"``.

    Raises :class:`SplitNotFoundError` (a FileNotFoundError) listing the available splits
    when the split does not exist.
    """
    data_dir = Path(data_dir)
    karpathy = karpathy if karpathy is not None else own_split_file(data_dir)
    if karpathy is not None:
        return load_karpathy(karpathy, data_dir, split)
    return _split_records(data_dir, split)[0]


def _split_records(data_dir: Path, split: str) -> tuple[list[ImageRecord], dict]:
    """:func:`load_split` without a split file, and the captions file's ``info``."""
    candidates = _layouts(data_dir, split)
    for captions_json, image_root in candidates:
        if captions_json.is_file():
            return _read_captions_file(captions_json, image_root)

    available = available_splits(data_dir)
    listing = ", ".join(available) if available else "none"
    hint = f"; {_missing_data_hint(data_dir)}" if not available else ""
    raise SplitNotFoundError(
        f"no split {split!r} in {data_dir}: expected {candidates[0][0].name} there "
        f"(or annotations/{candidates[1][0].name}); splits present: {listing}{hint}")


def _layouts(data_dir: Path, split: str) -> list[tuple[Path, Path]]:
    """(captions file, image folder) of a split in each layout the module docstring names, in
    the order they are looked for."""
    return [(data_dir / f"captions_{split}.json", data_dir / "images"),
            (data_dir / "annotations" / f"captions_{split}.json", data_dir / split)]


def own_split_file(data_dir: str | os.PathLike) -> Path | None:
    """``data_dir/dataset.json`` when the folder has it and no COCO captions file of its own."""
    path = Path(data_dir) / OWN_SPLIT_FILE
    return path if path.is_file() and not available_splits(data_dir) else None


def dataset_tokenizer(data_dir: str | os.PathLike, karpathy: str | os.PathLike | None = None,
                      split: str = "train") -> str:
    """The name of the tokenizer a data set names (see the module docstring), else "ptb".

    Only the ends of the file are read: the importer writes the split file's key last and
    the shapes generator the captions file's ``info`` first, and COCO's own files, which
    name none, are too large to parse once more for nothing. A key in JSON text cannot be
    faked by a caption (its quotes would be escaped).
    """
    data_dir = Path(data_dir)
    karpathy = Path(karpathy) if karpathy is not None else own_split_file(data_dir)
    files = [karpathy] if karpathy is not None else [captions for captions, _ in _layouts(data_dir, split)]
    for path in files:
        if path.is_file():
            with open(path, "rb") as f:
                head = f.read(1 << 16)
                f.seek(max(0, f.seek(0, 2) - 4096))
                tail = f.read()
            for text in (tail, head):
                found = re.search(rb'"tokenizer"\s*:\s*"([^"\\]*)"', text)
                if found is not None:
                    return found.group(1).decode("utf-8", errors="replace")
            break
    return DEFAULT_TOKENIZER


def available_splits(data_dir: str | os.PathLike) -> list[str]:
    """Split names with a ``captions_<split>.json`` in ``data_dir`` or ``data_dir/annotations``."""
    data_dir = Path(data_dir)
    names: set[str] = set()
    for folder in (data_dir, data_dir / "annotations"):
        if folder.is_dir():
            names.update(p.name[len("captions_"):-len(".json")] for p in folder.glob("captions_*.json"))
    return sorted(names)


def load_karpathy(split_file: str | os.PathLike, data_dir: str | os.PathLike, split: str) -> list[ImageRecord]:
    """One split of a Karpathy split file, sorted by image id.

    Image ids are COCO's ``cocoid`` where present (so results match COCO's own ids),
    else the file's ``imgid`` (Flickr8k/30k). Captions are the sentences' raw text.
    """
    return load_karpathy_splits(split_file, data_dir, [split])[split]


def load_karpathy_splits(split_file: str | os.PathLike, data_dir: str | os.PathLike,
                         splits: Sequence[str]) -> dict[str, list[ImageRecord]]:
    """Several splits of a Karpathy split file, the file read once (COCO's is 150 MB)."""
    split_file = Path(split_file)
    images = _read_karpathy_file(split_file, data_dir)["images"]
    return {split: _karpathy_split(images, split_file, Path(data_dir), split) for split in splits}


def _read_karpathy_file(split_file: Path, data_dir: str | os.PathLike) -> dict:
    """The whole of a Karpathy split file; a missing one is a FileNotFoundError saying where to get it."""
    if not split_file.is_file():
        if split_file.name == OWN_SPLIT_FILE:  # what `captioner data import` writes
            raise FileNotFoundError(f"no data set in {data_dir}: {split_file} not found; {own_data_hint(data_dir)}")
        raise FileNotFoundError(f"Karpathy split file not found: {split_file} ({KARPATHY_HINT})")
    with open(split_file, encoding="utf-8") as f:
        return json.load(f)


def _karpathy_split(images: list[dict], split_file: Path, data_dir: Path, split: str) -> list[ImageRecord]:
    wanted = KARPATHY_SPLIT_ALIASES.get(split, (split,))
    records = []
    for entry in images:
        if entry.get("split") not in wanted:
            continue
        image_id = entry["cocoid"] if "cocoid" in entry else entry["imgid"]
        path = data_dir / entry.get("filepath", "") / entry["filename"]
        captions, empty = _with_words([s["raw"] for s in entry.get("sentences", []) if "raw" in s])
        records.append(ImageRecord(image_id=int(image_id), path=path, captions=captions, empty_captions=empty))

    if not records:
        present = sorted({str(e.get("split")) for e in images})
        if "restval" in present:
            present.append("train (= train + restval)")
        raise SplitNotFoundError(
            f"no images in split {split!r} of {split_file}; splits present: {', '.join(present) or 'none'}")
    records.sort(key=lambda r: r.image_id)
    return records


def missing_images(records: Sequence[ImageRecord]) -> list[Path]:
    """The records' image files that do not exist (one stat per image: seconds for COCO)."""
    return [r.path for r in records if not r.path.is_file()]


def require_images(records: Sequence[ImageRecord], split: str) -> None:
    """Raise :class:`MissingImagesError` (one line: how many, the first, where to get them)
    when image files of ``split`` are missing."""
    missing = missing_images(records)
    if missing:
        raise MissingImagesError(
            f"{len(missing):,} of {len(records):,} images of split {split!r} not found, e.g. {missing[0]} "
            f"({_images_hint(missing[0])}; `captioner data check --config FILE` lists them all)")


def _int_or_none(value: object) -> int | None:
    return None if value is None else int(value)


# --------------------------------------------------------------------------- datasets


class _ImageSource:
    """Loads and preprocesses record images, optionally keeping the tensors in memory.

    With DataLoader workers each worker process keeps its own cache, so caching is meant
    for small data sets (the synthetic shapes), ideally with ``num_workers=0``. The cached
    tensor is the output of ``preprocess``: a random augmentation inside it would be
    frozen after the first epoch, so leave caching off when augmenting.
    """

    def __init__(self, records: Sequence[ImageRecord], preprocess: Preprocess, cache_images: bool) -> None:
        self.records = list(records)
        self.preprocess = preprocess
        self.cache_images = cache_images
        self._cache: dict[int, torch.Tensor] = {}

    def image(self, index: int) -> torch.Tensor:
        cached = self._cache.get(index)
        if cached is not None:
            return cached
        path = self.records[index].path
        try:
            tensor = self.preprocess(self.preprocess.load(path))
        except ImageLoadError as e:
            # load_image's messages do not always name the file; a training run must.
            raise ImageLoadError(f"{path}: {e}") from e
        if self.cache_images:
            self._cache[index] = tensor
        return tensor


class ImageDataset(Dataset):
    """One item per image, ``(image (3, H, W), image index)``: for decoding a split.

    The default DataLoader collate turns a batch into ``(images (B, 3, H, W), indices (B,))``.
    """

    def __init__(self, records: Sequence[ImageRecord], preprocess: Preprocess,
                 cache_images: bool = False) -> None:
        self.records = list(records)
        self._images = _ImageSource(self.records, preprocess, cache_images)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, int]:
        return self._images.image(idx), idx


# --------------------------------------------------------------------------- instances


# COCO's instance annotations as published (annotations_trainval2014.zip), beside the captions
# files: the objects CHAIR and the COCO grounding score against.
COCO_INSTANCE_FILES = ("instances_train2014.json", "instances_val2014.json")


@dataclass(frozen=True)
class CocoInstance:
    """One annotated object: its COCO category name, its box (x, y, w, h, pixels) and its
    segmentation as the file gives it (polygons or RLE; None: the box alone)."""

    category: str
    bbox: tuple[float, float, float, float]
    segmentation: object = None


@dataclass(frozen=True)
class ImageInstances:
    """An image's annotated objects (none for an image without any) and its size."""

    image_id: int
    width: int
    height: int
    instances: tuple[CocoInstance, ...]

    @property
    def size(self) -> tuple[int, int]:
        return self.width, self.height

    def mask(self, instance: CocoInstance):
        """(height, width) bool numpy array of the instance's segmentation; None without one."""
        if not instance.segmentation:
            return None
        from pycocotools import mask as masks  # imported here: only masks need it

        seg = instance.segmentation
        if isinstance(seg, list):  # polygons
            rle = masks.merge(masks.frPyObjects(seg, self.height, self.width))
        elif isinstance(seg.get("counts"), list):  # uncompressed RLE (crowds)
            rle = masks.frPyObjects(seg, self.height, self.width)
        else:
            rle = seg
        with warnings.catch_warnings():  # pycocotools' own call into numpy 2 warns; the mask is right
            warnings.simplefilter("ignore", DeprecationWarning)
            return masks.decode(rle).astype(bool)


def instance_files(data_dir: str | os.PathLike, split: str) -> list[Path]:
    """The COCO instances files of a data folder in the published layout:
    ``annotations/instances_<split>.json`` when the split has one (``val2014``), else
    ``annotations/instances_train2014.json`` and ``instances_val2014.json``, those present
    (a Karpathy split draws on both)."""
    folder = Path(data_dir) / "annotations"
    own = folder / f"instances_{split}.json"
    if own.is_file():
        return [own]
    return [folder / name for name in COCO_INSTANCE_FILES if (folder / name).is_file()]


def load_instances(files: Sequence[Path], image_ids: set[int] | None = None) -> dict[int, ImageInstances]:
    """The objects of every image the files list (of ``image_ids`` only, when given); an
    image listed without annotations has none. Plain JSON reading: COCO's files are large
    and pycocotools' index is not needed."""
    per_image: dict[int, ImageInstances] = {}
    for path in files:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        names = {c["id"]: c["name"] for c in data["categories"]}
        found: dict[int, list[CocoInstance]] = {}
        for ann in data.get("annotations", []):
            if image_ids is None or ann["image_id"] in image_ids:
                found.setdefault(ann["image_id"], []).append(CocoInstance(
                    names[ann["category_id"]], tuple(float(v) for v in ann["bbox"]), ann.get("segmentation")))
        for img in data["images"]:
            if image_ids is None or img["id"] in image_ids:
                per_image[img["id"]] = ImageInstances(int(img["id"]), int(img["width"]), int(img["height"]),
                                                      tuple(found.get(img["id"], ())))
    return per_image
