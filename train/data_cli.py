"""``captioner data import SOURCE --out DIR``: own images and captions into a data set;
``captioner data check --config FILE``: is the data of a training config all there?

Import reads a CSV/TSV file, a JSON Lines file or a folder of images with sidecar .txt
captions (``captioner.train.own``), checks that every image exists and decodes, and writes
``DIR/dataset.json`` (Karpathy's format, images left in place, a seeded train/val/test
draw, the tokenizer's name). Exit 0 written, 1 images missing or unreadable (nothing
written; ``--skip-unreadable`` leaves them out), 2 a source that cannot be read.

Check reads the config's split file or annotations, checks that every image exists and decodes
(worker processes, progress bar), and prints what a run would train on: images per split,
captions per image, captions left out as too long or empty, the vocabulary size at the config's
``min_count``, and every unusable file with the reason. Exit 0 when all is well, 1 when
images are missing or unreadable, 2 when the annotations or split file themselves are
missing (a one-line error saying where to get them).

Registered into the ``captioner`` command through the ``captioner.commands`` entry point;
also runs as ``python -m captioner.train.data_cli check --config FILE``.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from pathlib import Path

from captioner.data.coco import require_images
from captioner.data.vocab import tokenizer_named

from .captions import training_captions
from .config import TrainConfig, load_config
from .datainfo import DataSet, load_dataset, summary_lines, vocabulary

MAX_LISTED = 50  # unusable files printed one per line; the rest are counted


def require_data(cfg: TrainConfig) -> DataSet | None:
    """The config's data, read once, for the run to train on; None for synthetic shapes, which
    the run generates first. A FileNotFoundError (one line) unless the annotations and every
    training and validation image file are there."""
    if cfg.data.generate_shapes:
        return None
    data = load_dataset(cfg.data)
    for split, records in data.splits.items():
        require_images(records, split)
    return data


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="import own images and captions; check a data set before training on it",
                       description="Data set tools. `data import SOURCE --out DIR` turns own images and captions "
                                   "(CSV/TSV, JSON Lines, or a folder with .txt captions) into a data set; "
                                   "`data check --config FILE` checks that the data of a training config is "
                                   "complete and readable.")
    _add_subcommands(p)


def _add_subcommands(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND", required=True)
    c = sub.add_parser(
        "check", help="check that every image exists and decodes; print split sizes and the vocabulary",
        description="Read the config's Karpathy split file or COCO annotations, check that every image of "
                    "the training, validation (and test) splits exists and decodes, and print images per "
                    "split, captions per image, captions left out as too long or empty, the vocabulary size "
                    "at the config's min_count, and every unusable file with the reason. Exit 0: all "
                    "good; 1: images missing or unreadable; 2: annotations or split file missing.")
    c.add_argument("--config", type=Path, required=True,
                   help="training config: a file, or a shipped config's name from any folder (own-soft, "
                        "coco-vgg19-soft, ...)")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value, e.g. --set data.dir=/data/coco (repeatable)")
    c.add_argument("--workers", type=int, default=None,
                   help="image-decoding worker processes (default: the config's data.workers, at most one "
                        "per CPU core)")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(func=cmd_check)
    _add_import(sub)


def _count_or_share(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not (x >= 0 and (x < 1 or x == int(x))):
        raise argparse.ArgumentTypeError(f"give a count (0, 1, 2, ...) or a share below 1 (0.1), got {value}")
    return x


def _add_import(sub: argparse._SubParsersAction) -> None:
    from captioner.data.vocab import TOKENIZERS

    from .own import CAPTION_KEYS, CAPTION_LIST_KEYS, FORMATS, IMAGE_KEYS

    c = sub.add_parser(
        "import", help="turn own images and captions (CSV/TSV, JSON Lines, folder + .txt or metadata.jsonl) "
                       "into a data set",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="\n\n".join([
            _wrapped("Turn own images and captions into a data set that `data check`, `train` and `evaluate` "
                     "read as they read COCO (with --set data.dir=DIR, or --data DIR)."),
            "SOURCE is one of:\n"
            "  a CSV or TSV file with a header: an image column and a caption column, several rows per\n"
            f"    image allowed (usual names: {', '.join(IMAGE_KEYS[:4])}; {', '.join(CAPTION_KEYS[:2])})\n"
            "  a JSON Lines file: one object per line with an image (image, file_name) and caption/text\n"
            "    or a list captions/descriptions (the metadata.jsonl of image-folder data sets)\n"
            "  a folder of images, each with a .txt file of the same name beside it (photo.jpg +\n"
            "    photo.txt), one caption per line\n"
            "  a folder of images with Hugging Face's metadata.jsonl in it (file_name relative to the\n"
            "    folder, and text); captioner caption --format txt or metadata writes these two, so a\n"
            "    folder captioned, then corrected by hand, can be trained on. A folder that holds both\n"
            "    is read once --format names one (folder: the .txt files, or metadata)",
            _wrapped("Image paths are relative to the source file's folder unless absolute. Rows of one image are "
                     "merged; a caption repeated for one image is kept once; empty captions are dropped (counted); "
                     "images left out are named. Every image is checked to exist and decode. "
                     "Writes DIR/dataset.json in Karpathy's split format: the images stay where they are, split "
                     "into train/val/test by a seeded draw, with the tokenizer recorded (training puts it in the "
                     "checkpoint). Captions in any language, in UTF-8 (or UTF-16 with a byte-order mark; other "
                     "encodings with --encoding)."),
            _wrapped("Splits: by default 10% of the images validate (at least 1) and 10% test (at least 1, and "
                     "none when fewer than 3 images would be left to train on): 2 images give train 1 and val 1, "
                     "4 give train 3 and val 1, 5 give train 3, val 1, test 1. A data set needs 2 images at least."),
            _wrapped("Exit code: 0 written; 1 images missing or unreadable (up to 10 named, nothing written; "
                     "--skip-unreadable leaves them out); 2 a source that cannot be read (not UTF-8, no image "
                     "or caption column, ...), said in one line.")]))
    c.add_argument("source", type=Path, metavar="SOURCE", help="CSV/TSV file, JSON Lines file, or folder")
    c.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help="folder for dataset.json (missing folders are made; one that holds a dataset.json is "
                        "refused unless --overwrite)")
    c.add_argument("--overwrite", action="store_true",
                   help="replace the dataset.json that --out holds (a model trained on it loses its split)")
    c.add_argument("--format", choices=FORMATS, default=None,
                   help="the source's format (default: from its name: a folder (its metadata.jsonl if it holds "
                        "one, else the .txt files), .jsonl, .tsv, else CSV)")
    c.add_argument("--image-column", default=None, metavar="NAME",
                   help=f"CSV/TSV column or JSON key of the image (default: the first of {', '.join(IMAGE_KEYS)})")
    c.add_argument("--caption-column", default=None, metavar="NAME",
                   help="CSV/TSV column or JSON key of the caption, or of a list of captions (default: the first "
                        f"of {', '.join(CAPTION_KEYS + CAPTION_LIST_KEYS)})")
    c.add_argument("--tokenizer", choices=tuple(TOKENIZERS), default=None,
                   help="how captions split into tokens: ptb (English, the COCO toolkit's), chars2 (Chinese, "
                        "Japanese: one token per character, numbers and sentence punctuation kept), whitespace "
                        "(other languages, Korean among them); chars is chars2's first form, kept for the models "
                        "trained with it. Default: from the script of the captions' letters: chars2 when most "
                        "hold Chinese or Japanese characters, ptb when nearly all are in Latin letters with "
                        "hardly an accent, else whitespace")
    c.add_argument("--val", type=_count_or_share, default=None, metavar="N",
                   help="validation images: a count (1 or more), or a share below 1 rounded to the nearest count, "
                        "at least 1 (default 10%%)")
    c.add_argument("--test", type=_count_or_share, default=None, metavar="N",
                   help="test images: a count, or a share below 1 rounded to the nearest count, at least 1 when "
                        "above 0 (default 10%%, none while fewer than 3 images would be left to train on)")
    c.add_argument("--seed", type=int, default=0, help="seed of the split draw (default 0)")
    c.add_argument("--name", default=None,
                   help="the data set's name, recorded in dataset.json for the model card and run names (default: "
                        "the --out folder's name)")
    c.add_argument("--encoding", default=None, metavar="CODEC",
                   help="the source's text encoding when it is not UTF-8, e.g. cp1252 or gb18030 (default: UTF-8; "
                        "a file in another encoding is refused, naming the one it most likely is)")
    c.add_argument("--skip-unreadable", action="store_true",
                   help="leave missing or undecodable images out (counted) instead of stopping")
    c.add_argument("--workers", type=int, default=2, help="image-decoding worker processes (default 2)")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(func=cmd_import)


MAX_NAMED = 10  # unusable images named by import; the rest are counted


def _wrapped(text: str) -> str:
    """A paragraph of --help (raw formatting keeps the source list's lines) cut to lines."""
    return textwrap.fill(text, width=92)


def cmd_import(args: argparse.Namespace) -> int:
    from captioner.cli.common import EXIT_SOME_FAILED, UsageError, make_folders
    from captioner.data.images import Preprocess
    from captioner.data.vocab import guess_tokenizer

    from .image_check import unreadable_images
    from .own import SourceError, draw_splits, read_source, split_sizes, write_dataset

    earlier = args.out / "dataset.json"
    if earlier.exists() and not args.overwrite:
        raise UsageError(f"--out: {earlier} already exists (a data set, perhaps one a model was trained on): give "
                         "another --out for a new data set, or add --overwrite to replace it")
    try:
        source = read_source(args.source, args.format, args.image_column, args.caption_column, args.encoding)
    except SourceError as e:
        raise UsageError(str(e)) from e
    except OSError as e:
        raise UsageError(f"cannot read {args.source}: {e.strerror or e}") from e
    if not source.images:
        raise UsageError(f"{args.source}: no images with captions found")
    # Only images with a caption are kept: the others are not opened.
    problems = unreadable_images([im.path for im in source.images if im.captions], Preprocess(size=(32, 32)),
                                 workers=max(0, args.workers), progress=not args.quiet)
    if problems and not args.skip_unreadable:
        print_unusable(problems, len(source.images), MAX_NAMED)
        hint = relative_to_here(problems, args.source)
        if hint:
            print(hint)
        print("nothing written: fix the paths, or pass --skip-unreadable to leave these images out")
        return EXIT_SOME_FAILED
    images = [im for im in source.images if im.path not in problems and im.captions]
    no_caption = [im.path for im in source.images if im.path not in problems and not im.captions]
    captions = [c for im in images for c in im.captions]
    tokenizer = args.tokenizer or guess_tokenizer(captions)
    try:
        n_val, n_test = split_sizes(len(images), args.val, args.test)
    except SourceError as e:
        raise UsageError(str(e)) from e
    splits = draw_splits(len(images), n_val, n_test, args.seed)
    make_folders(args.out)
    name = args.name or args.out.resolve().name
    written = write_dataset(args.out, images, splits, tokenizer, name)

    columns = f" (image: {source.columns[0]!r}, caption: {source.columns[1]!r})" if source.columns else ""
    print(f"read {args.source} as {source.format}{columns}: {source.rows:,} rows")
    dropped = [(source.empty_captions, "empty caption", "empty captions"),
               (source.duplicates, "repeated caption", "repeated captions")]
    for n, one, many in dropped:
        if n:
            print(f"  {n:,} {one if n == 1 else many} dropped")
    without = "a line in metadata.jsonl" if source.format == "metadata" else "a caption file"
    left_out = [(no_caption, "image with only empty captions", "images with only empty captions"),
                (source.without_captions, f"image without {without}", f"images without {without}"),
                (list(problems), "unreadable image", "unreadable images")]
    for paths, one, many in left_out:
        if paths:
            print(f"  {len(paths):,} {one if len(paths) == 1 else many} left out:")
            for path in paths[:MAX_NAMED]:
                print(f"    {_shown(Path(path))}{f': {problems[path]}' if path in problems else ''}")
            if len(paths) > MAX_NAMED:
                print(f"    ... and {len(paths) - MAX_NAMED:,} more")
    print(f"{len(images):,} images, {len(captions):,} captions ({len(captions) / len(images):.1f} per image): "
          f"train {splits.count('train'):,}, val {n_val:,}, test {n_test:,} (seed {args.seed})")
    why = "chosen with --tokenizer" if args.tokenizer else "chosen from the captions; --tokenizer sets another"
    example = tokenizer_named(tokenizer).tokenize(captions[0])
    print(f"tokenizer: {tokenizer} ({why}); e.g. {captions[0]!r} -> {' | '.join(example[:12])}"
          f"{' ...' if len(example) > 12 else ''}")
    print(f"wrote {written}")
    print(f"next: captioner train --config own-soft --set data.dir={args.out}")
    return 0


def _shown(path: Path) -> Path:
    """``path`` relative to the working folder when it lies inside it, else absolute;
    normalised either way ("a/../b" is "b")."""
    path = Path(os.path.normpath(os.path.abspath(path)))
    try:
        return path.relative_to(Path(os.path.abspath(Path.cwd())))
    except ValueError:
        return path


def cmd_check(args: argparse.Namespace) -> int:
    from captioner.cli.common import UsageError
    from captioner.data.images import Preprocess

    from .image_check import unreadable_images
    from .startup import StartupError, data_tokenizer

    try:
        cfg = load_config(args.config, args.overrides)
        data = load_dataset(cfg.data, test=True)
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(str(e)) from e
    d, splits = cfg.data, data.splits
    try:
        tokenizer = data_tokenizer(data)
    except StartupError as e:
        raise UsageError(str(e)) from e
    kept = training_captions(splits[d.train_split], d.max_caption_len, tokenizer)
    vocab = vocabulary(d, kept, tokenizer)
    for line in summary_lines(d, splits, vocab, kept):
        print(line)
    paths = sorted({r.path for records in splits.values() for r in records})
    preprocess = Preprocess(size=(cfg.model.image_size,) * 2, resize=cfg.model.resize)
    workers = d.loader_workers() if args.workers is None else max(0, args.workers)
    problems = unreadable_images(paths, preprocess, workers=workers, progress=not args.quiet)
    if not problems:
        print(f"all {len(paths):,} images found and decoded")
        return 0
    print_unusable(problems, len(paths), MAX_LISTED)
    return 1


def relative_to_here(problems: dict[str, str], source: Path) -> str | None:
    """The commonest own-data mistake: a captions file's image paths written relative to the
    folder the user stands in, not to the file's own folder. When missing images exist relative
    to the current folder, one line that says so and names the fix; else None."""
    if source.is_dir():  # a folder's images are found in it, never by a path written by hand
        return None
    base = source.parent
    missing = [Path(p) for p, why in problems.items() if why == "missing"]
    here = [rel for rel in (Path(os.path.relpath(p, base)) for p in missing) if rel.is_file()]
    if not here:
        return None
    share = f"all {len(missing):,}" if len(here) == len(missing) else f"{len(here):,} of the {len(missing):,}"
    fixed = Path(os.path.relpath(here[0].resolve(), base.resolve()))
    return (f"{share} missing images exist relative to the current folder (e.g. {here[0]}), but paths in "
            f"{source} are read relative to the file's own folder ({base}): write them from there "
            f"(e.g. {fixed}), or absolute")


def print_unusable(problems: dict[str, str], total: int, limit: int) -> None:
    """The images that cannot be used, each with its reason, the first ``limit`` of them."""
    n = len(problems)
    print(f"{n:,} image{'s' if n != 1 else ''} of {total:,} cannot be used:")
    for path, reason in list(problems.items())[:limit]:
        print(f"  {path}: {reason}")
    if len(problems) > limit:
        print(f"  ... and {len(problems) - limit:,} more")


def main(argv: list[str] | None = None) -> int:
    from captioner.cli.common import EXIT_USAGE, UsageError

    parser = argparse.ArgumentParser(prog="captioner data", description="Data set tools.")
    _add_subcommands(parser)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except UsageError as e:
        print(f"captioner data {args.data_command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
