"""How long training's start-up takes to read a COCO-sized data set: ``load_dataset`` (each file
parsed once) against the reads start-up made before the DataSet record, on the same
generated files in the same run.

    python -m benchmarks.bench_data_startup [--images 120000] [--layout coco karpathy] [--rounds 3]

The data: ``--images`` images with 5 captions each (120,000: about COCO 2014's train + val,
600,000 captions), in COCO's layout (``captions_train.json`` holding them all, and a
``captions_val.json`` of 5,000 images) and as a Karpathy split file (``dataset_coco.json``:
the same images, 5,000 of them val, each sentence with its tokens as Karpathy's file has
them). No image files: start-up's image check is not measured here.

"Before" repeats the reads start-up made before: the splits loaded twice (``require_data``, then
``readable_splits``), the tokenizer scraped from the file's ends (``dataset_tokenizer``) and,
in COCO's layout, the captions file parsed once more for its ``info.description`` (the data
set's name), in a Karpathy file its tail scraped for ``dataset``. "After" is one
``load_dataset``. Each round times both, alternating; the figures are the medians.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from captioner.data.coco import dataset_tokenizer, load_splits
from captioner.train.config import load_config
from captioner.train.datainfo import load_dataset

WORDS = ("a man woman dog cat sitting standing on the of with in next to table street car bus red blue green "
         "white black small large near two people plate food pizza train field grass water riding holding").split()
VAL_IMAGES = 5000


def _sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 14))).capitalize() + "."


def write_coco(folder: Path, images: int, seed: int = 0) -> None:
    """captions_train.json with ``images`` images, captions_val.json with VAL_IMAGES, 5 captions each."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for split, n, first in (("train", images, 0), ("val", VAL_IMAGES, images)):
        ims = [{"id": first + i, "file_name": f"COCO_{split}2014_{first + i:012d}.jpg", "width": 640, "height": 480}
               for i in range(n)]
        anns = [{"id": 5 * (first + i) + k, "image_id": first + i, "caption": _sentence(rng)}
                for i in range(n) for k in range(5)]
        data = {"info": {"description": "COCO 2014 Dataset", "year": 2014}, "licenses": [], "images": ims,
                "annotations": anns}
        (folder / f"captions_{split}.json").write_text(json.dumps(data))


def write_karpathy(folder: Path, images: int, seed: int = 0) -> None:
    """dataset_coco.json: ``images`` + VAL_IMAGES images, the last VAL_IMAGES val, "dataset" last."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    entries = []
    for i in range(images + VAL_IMAGES):
        sentences = []
        for k in range(5):
            raw = _sentence(rng)
            sentences.append({"tokens": raw.lower().rstrip(".").split(), "raw": raw, "imgid": i,
                              "sentid": 5 * i + k})
        entries.append({"filepath": "train2014", "sentids": [s["sentid"] for s in sentences],
                        "filename": f"COCO_train2014_{i:012d}.jpg", "imgid": i, "sentences": sentences,
                        "split": "val" if i >= images else "train", "cocoid": i})
    (folder / "dataset_coco.json").write_text(json.dumps({"images": entries, "dataset": "coco"}))


def before(folder: Path, karpathy: Path | None) -> None:
    """The reads start-up made before the DataSet record."""
    for _ in range(2):  # require_data, then readable_splits
        load_splits(folder, ["train", "val"], karpathy)
    dataset_tokenizer(folder, karpathy, "train")
    if karpathy is None:  # datainfo._description: the whole captions file for its info
        with open(folder / "captions_train.json", encoding="utf-8") as f:
            json.load(f).get("info")
    else:  # datainfo._karpathy_dataset: the file's last 4 KB
        with open(karpathy, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 4096))
            f.read()


def after(folder: Path, karpathy: Path | None) -> None:
    sets = [f"data.dir={folder}"] + ([f"data.karpathy={karpathy.name}"] if karpathy is not None else [])
    load_dataset(load_config(None, sets).data)


def timed(work, *args) -> float:
    gc.collect()
    start = time.perf_counter()
    work(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=120_000, help="training images, 5 captions each")
    parser.add_argument("--layout", nargs="+", choices=("coco", "karpathy"), default=["coco", "karpathy"])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for layout in args.layout:
            folder = Path(tmp) / layout
            (write_coco if layout == "coco" else write_karpathy)(folder, args.images)
            karpathy = folder / "dataset_coco.json" if layout == "karpathy" else None
            size = sum(p.stat().st_size for p in folder.glob("*.json")) / 1e6
            times: dict[str, list[float]] = {"before": [], "after": []}
            for _ in range(args.rounds):
                times["before"].append(timed(before, folder, karpathy))
                times["after"].append(timed(after, folder, karpathy))
            b, a = statistics.median(times["before"]), statistics.median(times["after"])
            print(f"{layout}: {args.images:,} + {VAL_IMAGES:,} images, {5 * (args.images + VAL_IMAGES):,} captions, "
                  f"{size:.0f} MB of JSON; before {b:.2f} s, after {a:.2f} s (median of {args.rounds}): "
                  f"after / before = {a / b:.2f}")


if __name__ == "__main__":
    main()
