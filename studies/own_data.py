"""Does the own-data recipe learn from a handful of photographs? docs/own-data.md's figures.

Two steps around a `captioner train` run:

    python -m studies.own_data photos OUT          # OUT/captions.csv: 20 photographs, 2 captions each
    captioner data import OUT/captions.csv --out OUT/data --name "sample photographs"
    captioner train --config own-soft --set data.dir=OUT/data --set optim.max_minutes=3 \
        --set model.encoder_pretrained=false --run-dir OUT/run
    python -m studies.own_data score OUT/run/best.pt OUT/data

``photos`` needs scikit-image (``pip install scikit-image``): its sample photographs are the
images (kept where scikit-image installed them). ``score`` captions every image of a split
(beam search of width 3, as `captioner caption` by default) and prints the share of captions that are
non-empty and hold no ``<unk>``, and how many distinct captions there are, with every caption
beside the image's first reference.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

# scikit-image's sample photographs (skimage/data) and two captions each, written as a user
# would: capitals, full stops, words seen once.
PHOTOS = {
    "astronaut.png": ["An astronaut in an orange suit stands in front of a flag.",
                      "A smiling astronaut holding a white helmet."],
    "brick.png": ["A black and white photo of a brick wall.", "Rows of old bricks in a wall."],
    "camera.png": ["A man standing behind a camera on a tripod.",
                   "A black and white photo of a photographer in a field."],
    "cell.png": ["A gray microscope image of a cell.", "A single cell seen under a microscope."],
    "chelsea.png": ["An orange and white cat looks to the side.", "A close up of a striped cat with green eyes."],
    "clock_motion.png": ["A blurry clock on a wall.", "A round clock with black numbers."],
    "coffee.png": ["A cup of coffee on a saucer with a spoon.", "A white cup of coffee on a red table."],
    "coins.png": ["Many old coins laid out in rows.", "A black and white photo of coins on a table."],
    "grass.png": ["A black and white photo of grass.", "Close up of blades of grass in a field."],
    "gravel.png": ["A gray photo of small stones.", "Close up of gravel on the ground."],
    "horse.png": ["A black silhouette of a horse.", "A horse standing on a white background."],
    "hubble_deep_field.jpg": ["Many galaxies in a dark sky.", "A space photo with small bright spots."],
    "ihc.png": ["A microscope image of stained tissue.", "Brown and blue cells in a tissue sample."],
    "logo.png": ["A green and blue logo with a snake.", "A logo on a white background."],
    "moon.png": ["A black and white photo of the surface of the moon.", "Craters on the moon."],
    "motorcycle_left.png": ["A red motorcycle parked in a room.", "A motorcycle in front of a wall."],
    "page.png": ["A page of printed text.", "A black and white scan of a book page."],
    "retina.jpg": ["An orange image of a retina with blood vessels.", "A close up photo of the back of an eye."],
    "rocket.jpg": ["A rocket taking off from a launch pad.", "A white rocket rising above a cloud of smoke."],
    "text.png": ["Black letters on a white page.", "A photo of text written on a board."],
}


def write_photos(out: Path) -> Path:
    """``out/captions.csv``: an image column (absolute paths into scikit-image's data folder)
    and a caption column, one row per caption."""
    try:
        import skimage
    except ImportError:
        sys.exit("scikit-image is not installed: pip install scikit-image")
    data = Path(skimage.__file__).parent / "data"
    missing = [name for name in PHOTOS if not (data / name).is_file()]
    if missing:
        sys.exit(f"not in {data}: {', '.join(missing)}")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "captions.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["image", "caption"])
        for name, captions in PHOTOS.items():
            writer.writerows([str(data / name), caption] for caption in captions)
    return path


def score(weights: Path, data: Path, split: str, batch: int = 8) -> float:
    """The share of ``split``'s images whose caption is non-empty and free of ``<unk>``;
    prints each caption beside the image's first reference."""
    from captioner.data.coco import load_split
    from captioner.data.vocab import UNK
    from captioner.inference import Captioner

    cap = Captioner.load(weights)
    records = load_split(data, split)
    good, distinct = 0, set()
    for i in range(0, len(records), batch):
        chunk = records[i:i + batch]
        for record, result in zip(chunk, cap.caption_images([r.path for r in chunk])):
            ok = bool(result.words) and UNK not in result.words
            good += ok
            distinct.add(result.caption)
            print(f"{'ok ' if ok else 'BAD'} {record.path.name}: {result.caption!r} (ref: {record.captions[0]!r})")
    share = good / max(1, len(records))
    print(f"{good} of {len(records)} {split} captions non-empty and free of {UNK}: {share:.0%}; "
          f"{len(distinct)} distinct (one for every image: a model that has learnt nothing of the images)")
    return share


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies.own_data", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    ph = sub.add_parser("photos", help="write OUT/captions.csv over scikit-image's sample photographs")
    ph.add_argument("out", type=Path)
    sc = sub.add_parser("score", help="the share of a split's captions that are non-empty and free of <unk>")
    sc.add_argument("weights", type=Path)
    sc.add_argument("data", type=Path, help="the folder `captioner data import` wrote")
    sc.add_argument("--split", default="train")
    args = p.parse_args(argv)
    if args.command == "photos":
        print(write_photos(args.out))
        return 0
    score(args.weights, args.data, args.split)
    return 0


if __name__ == "__main__":
    sys.exit(main())
