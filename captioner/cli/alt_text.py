"""``captioner alt-text PATH...``: alt text for the images of HTML and Markdown pages that have none.

The pages are read (``captioner.alttext.documents``), their images without alt text found with
their places (``finders``), each local image captioned once (by its content: ``cache``), each
caption written or held for a person (``decide``), and the change printed as a unified diff;
``--write`` applies it, file by file, atomically, to files that have not changed since they
were read. What is held, skipped, refused or not written is listed on stderr with its reason.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from captioner.alttext.cache import CaptionCache, default_folder, model_digest
from captioner.alttext.decide import MAX_CHARS, MIN_CONFIDENCE, Caption, Rules, held_because
from captioner.alttext.documents import (
    Document,
    DocumentError,
    alt_markup,
    kind_of,
    read_document,
    unified_diff,
    with_alt,
    write_if_unchanged,
)
from captioner.alttext.finders import SUFFIXES, MissingAlt, locate
from captioner.cli.common import EXIT_OK, EXIT_SOME_FAILED, UsageError, check_device, load_model, positive
from captioner.search.options import parser

BATCH = 16  # images captioned together
SHOWN = 80  # the most characters of a source the listing shows


def add_alt_text_parser(sub: argparse._SubParsersAction, add_model_args: Callable[[argparse.ArgumentParser], None],
                        decode_options: Callable) -> None:
    """The ``alt-text`` subcommand, with the model flags ``caption`` has (``add_model_args``) and
    the function that turns them into decoding options."""
    p = sub.add_parser(
        "alt-text", help="fill in missing alt text in HTML and Markdown pages, as a diff to review",
        description="Find the images of HTML and Markdown pages that have no alt text (an <img> without an alt "
                    "attribute; a Markdown image with empty text, ![](src)), caption the local ones and print "
                    "the change as a unified diff (git apply or patch -p1 take it); --write applies it. "
                    'alt="" marks a decorative image and is left alone; alt text already there is never '
                    "replaced; nothing else of a file changes, byte for byte. Remote URLs and data: URIs are "
                    "not captioned but listed as skipped. No guess is written: an image the model finds "
                    "unfamiliar, or whose caption's confidence is below --min-confidence, is listed for a person "
                    "with the reason and its caption, and left without alt text. Captions are cached by the "
                    "image's content (--cache). Exit code: 0 done, 1 some pages were refused or not written or "
                    "some images could not be read, 2 usage error. The default model is a demo trained on "
                    "synthetic shapes only: for real pages, use a model trained on photographs (--weights).")
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help=f"HTML and Markdown files ({', '.join(SUFFIXES)}) and folders, searched recursively")
    p.add_argument("--write", action="store_true",
                   help="apply the change to the files (each atomically: a temporary file, then a rename; a file "
                        "changed since it was read is not written, and the output says so); the diff is printed "
                        "all the same")
    p.add_argument("--max-chars", type=parser("max_chars"), default=MAX_CHARS, metavar="N",
                   help=f"longest alt text, in characters (default {MAX_CHARS}, what most alt-text guides ask; "
                        "some screen readers cut at 150): the best caption that fits, found by the search, never "
                        "cut; an image no caption fits is held for a person")
    p.add_argument("--min-confidence", type=parser("unfamiliar_below", float),  # the same rule: a share
                   default=MIN_CONFIDENCE,
                   metavar="P",
                   help="hold back captions whose probability under the model is below P, a share from 0 to 1 "
                        f"(default {MIN_CONFIDENCE}; docs/alt-text.md measures what it stops and what it holds back)")
    p.add_argument("--root", type=Path, default=None, metavar="DIR",
                   help="the folder the site is served from, for sources that start with / (default: such "
                        "images are skipped)")
    p.add_argument("--cache", type=Path, default=None, metavar="DIR",
                   help=f"where captions are kept by image content (default {default_folder()}, from "
                        "XDG_CACHE_HOME; delete the folder to clear it)")
    p.add_argument("--no-cache", action="store_true", help="caption every image afresh, and keep nothing")
    add_model_args(p)
    p.add_argument("--batch-size", type=positive, default=BATCH, help=f"images per batch (default {BATCH})")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--quiet", action="store_true",
                   help="no summary on stderr (what is held, skipped, refused or not written is still listed)")
    p.set_defaults(func=lambda args: cmd_alt_text(args, decode_options))


def find_documents(paths: list[str]) -> list[Path]:
    """The HTML and Markdown files named, and those under the folders named (recursively, sorted;
    a folder reached twice through links is entered once, a page found twice is read once). A
    missing path, or a file named that is neither, is a one-line UsageError."""
    found: dict[Path, Path] = {}  # real location -> as found: a page named twice is read once
    seen: set[tuple[int, int]] = set()
    for given in paths:
        path = Path(given)
        if path.is_dir():
            for root, dirs, files in os.walk(path, followlinks=True):
                st = os.stat(root)
                if (st.st_dev, st.st_ino) in seen:
                    dirs[:] = []
                    continue
                seen.add((st.st_dev, st.st_ino))
                dirs.sort()
                for name in sorted(files):
                    if kind_of(Path(name)):
                        found.setdefault((Path(root) / name).resolve(), Path(root) / name)
        elif path.is_file():
            if kind_of(path) is None:
                raise UsageError(f"{given}: not an HTML or Markdown file (the extensions read: {', '.join(SUFFIXES)})")
            found.setdefault(path.resolve(), path)
        else:
            raise UsageError(f"{given}: no such file or folder")
    return list(found.values())


@dataclass
class LocalImage:
    """A local image some page shows without alt text: its bytes' digest, and its caption once known."""

    path: Path
    digest: str | None = None
    caption: Caption | None = None
    error: str | None = None  # why it could not be read or captioned


@dataclass
class Run:
    """What the run found and did, for the listing and the summary."""

    pages: int = 0  # HTML and Markdown files found
    documents: list[Document] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # "PATH: why"
    images: dict[Path, LocalImage] = field(default_factory=dict)  # by resolved path
    where: dict[tuple[int, MissingAlt], Path | str] = field(default_factory=dict)  # -> resolved path, or why skipped
    listed: list[str] = field(default_factory=list)  # held, skipped and failed, one line each
    filled: int = 0
    written: int = 0
    not_written: list[str] = field(default_factory=list)

    @property
    def missing(self) -> int:
        return sum(len(d.missing) for d in self.documents)


def cmd_alt_text(args: argparse.Namespace, decode_options: Callable) -> int:
    device = check_device(args.device)
    decode_options(args)  # refused before any work
    if args.root is not None and not args.root.is_dir():
        raise UsageError(f"--root {args.root}: not a folder")
    run = Run()
    found = find_documents(args.paths)
    run.pages = len(found)
    for path in found:
        try:
            run.documents.append(read_document(path))
        except DocumentError as e:
            run.refused.append(str(e))
    for i, doc in enumerate(run.documents):
        for image in doc.missing:
            located = locate(image.src, doc.path, args.root)
            if image.offset is None:
                run.where[i, image] = "its place in the source is not certain: give it alt text by hand"
            elif located.path is None:
                run.where[i, image] = located.why
            else:
                real = located.path.resolve()
                run.where[i, image] = real
                run.images.setdefault(real, LocalImage(located.path))
    if run.images:
        _caption(run, args, device, decode_options)
    rules = Rules(args.min_confidence, args.unfamiliar_below)
    for i, doc in enumerate(run.documents):
        _edit(run, i, doc, rules, args.write)
    for line in [*(f"refused: {r}" for r in run.refused), *run.listed, *run.not_written]:
        print(line, file=sys.stderr)
    if not args.quiet:
        print(_summary(run, args.write), file=sys.stderr)
    failed = run.refused or run.not_written or any(im.error for im in run.images.values())
    return EXIT_SOME_FAILED if failed else EXIT_OK


def _caption(run: Run, args: argparse.Namespace, device: str, decode_options: Callable) -> None:
    """Each image's caption: from the cache where the same bytes were captioned by the same model
    and options, else from the model (then kept in the cache)."""
    from captioner.data.images import ImageLoadError, as_image

    model = load_model("alt-text", args.weights, device)
    captioner = model.captioner
    options = decode_options(args, captioner.max_len)
    if captioner.familiarity is None and not args.quiet:
        print(f"captioner alt-text: note: {captioner.name or 'the model'} keeps no record of its training images, "
              "so unfamiliar images cannot be told: only --min-confidence holds captions back", file=sys.stderr)
    cache = None
    if not args.no_cache:
        # every option that shapes the caption; familiarity's threshold is applied to the value kept
        searched = {k: v for k, v in asdict(options).items() if k != "unfamiliar_below"}
        cache = CaptionCache(args.cache or default_folder(), model_digest(model.path), searched)
    todo: list[tuple[LocalImage, object]] = []
    for image in run.images.values():
        try:
            data = image.path.read_bytes()
        except OSError as e:
            image.error = f"cannot be read ({e.strerror or e})"
            continue
        image.digest = hashlib.sha256(data).hexdigest()
        image.caption = cache.get(image.digest) if cache is not None else None
        if image.caption is None:
            try:
                todo.append((image, as_image(data, at_least=captioner.preprocess.decode_side)))
            except ImageLoadError as e:
                image.error = f"not an image that can be read ({e})"
    cache_failed = False
    for start in range(0, len(todo), args.batch_size):
        batch = todo[start:start + args.batch_size]
        for (image, _), result in zip(batch, captioner.caption_images([im for _, im in batch], options)):
            image.caption = Caption.of(result)
            if cache is not None and not cache.put(image.digest, image.caption):
                cache_failed = True
    if cache_failed:
        print(f"captioner alt-text: note: the cache {cache.folder} cannot be written: the next run captions "
              "these images again", file=sys.stderr)


def _edit(run: Run, i: int, doc: Document, rules: Rules, write: bool) -> None:
    """The alt text of ``doc``'s images put in (or each one listed with why not), the diff
    printed, and with ``write`` the file written."""
    alts: dict[MissingAlt, str] = {}
    name = _shown(doc.path)
    for missing in doc.missing:
        src = missing.src if len(missing.src) <= SHOWN else missing.src[:SHOWN - 3] + "..."  # a data: URI is long
        at = f"{name}:{missing.line}: {src or '(no source)'}"
        where = run.where[i, missing]
        if isinstance(where, str):
            run.listed.append(f"skipped: {at}: {where}")
            continue
        image = run.images[where]
        if image.error is not None:
            run.listed.append(f"failed: {at}: {image.error}")
            continue
        why = held_because(image.caption, rules)
        markup = alt_markup(missing.syntax, image.caption.text, doc.encoding) if why is None else None
        if why is None and markup is None:
            why = f"the caption has characters {doc.encoding} cannot hold"
        if why is not None:
            said = f" (caption: {image.caption.text!r})" if image.caption.text else ""
            run.listed.append(f"held: {at}: {why}{said}")
            continue
        alts[missing] = markup
    if not alts:
        return
    try:
        text = with_alt(doc, alts)
    except DocumentError as e:
        run.refused.append(str(e))
        return
    sys.stdout.write(unified_diff(doc.text, text, name))
    run.filled += len(alts)
    if write:
        why = write_if_unchanged(doc, text)
        if why is None:
            run.written += 1
        else:
            run.not_written.append(f"not written: {name}: {why}")


def _shown(path: Path) -> str:
    """A document's name in the diff and the listing: relative to here when it is below here."""
    rel = os.path.relpath(path)
    return Path(rel).as_posix() if not rel.startswith("..") else path.as_posix()


def _summary(run: Run, write: bool) -> str:
    held = sum(line.startswith("held:") for line in run.listed)
    skipped = sum(line.startswith("skipped:") for line in run.listed)
    failed = sum(line.startswith("failed:") for line in run.listed)
    pages = run.pages
    done = (f"wrote {run.written} file{'s' if run.written != 1 else ''}" if write
            else "nothing written (the diff is on stdout; --write applies it)")
    return (f"{pages} page{'s' if pages != 1 else ''} ({len(run.refused)} refused), {run.missing} image"
            f"{'s' if run.missing != 1 else ''} without alt text: {run.filled} given alt text, {held} held for a "
            f"person, {skipped} skipped, {failed} failed; {done}")
