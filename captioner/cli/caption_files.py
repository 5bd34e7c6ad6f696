"""Captions as files beside the images: ``captioner caption --format txt`` and ``--format metadata``.

The two forms that tools training image generators read:

- ``txt``: ``NAME.txt`` beside each image (``photo.jpg`` -> ``photo.txt``), or under ``--out DIR``
  in the tree of the folder given, the caption on one line;
- ``metadata``: Hugging Face's ``metadata.jsonl`` in the folder given, one line per image,
  ``{"file_name": its path relative to the folder, "text": its caption}``, which
  ``datasets.load_dataset("imagefolder", data_dir=FOLDER)`` reads as it is.

What is there already is kept (an image whose .txt, or whose metadata.jsonl line, exists is not
captioned) unless ``overwrite``: so a run that stopped continues where it stopped, and a caption
corrected by hand is never lost to a later run. Each .txt is written whole (a temporary file,
then a rename); metadata.jsonl gains one whole line per image as its batch is done, and holds one
line per image at the end of a run. ``captioner data import`` reads both forms back.

Plain Python: nothing here loads torch.
"""

from __future__ import annotations

import json
import os
import posixpath
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from captioner.cli.common import UsageError, make_folders

if TYPE_CHECKING:
    import argparse

FORMATS = ("jsonl", "txt", "metadata")
METADATA = "metadata.jsonl"
MAX_NAMED = 10  # files kept, or images failed, named in the summary; the rest are counted


class CaptionFilesError(ValueError):
    """The images cannot be captioned into files as asked; the message says why, in one line."""


@dataclass
class FilePlan:
    """Where each image's caption goes, and which images have one there already."""

    format: str  # "txt" or "metadata"
    todo: list[str]  # images to caption, in the order found
    targets: dict[str, str]  # image -> its .txt (txt), or its file_name in metadata.jsonl (metadata)
    kept: list[str]  # .txt files, or metadata file_names, there already: their images are not captioned
    metadata: Path | None = None  # the metadata.jsonl (metadata)


def check_format_flags(args: argparse.Namespace) -> None:
    """Refuse, in one line, the flags of ``captioner caption`` that do not go with its --format
    (before any work); with --format txt, make the --out folder."""
    files = ("--prefix", "--suffix", "--overwrite")
    if args.format == "jsonl":
        for flag in files:
            if getattr(args, flag[2:]):
                raise UsageError(f"{flag} goes with --format txt or metadata (JSON lines keep the caption as the "
                                 "model gave it, and --out FILE resumes: nothing there is replaced)")
        return
    for flag, given, why in (
            ("--with-attention", args.with_attention, "adds the attention to JSON lines"),
            ("--attention-heads", args.attention_heads and args.attention_dir is None,
             "adds each head's maps to JSON lines (with --attention-dir, to the figures)"),
            ("--num-captions", args.num_captions > 1, "adds alternatives to JSON lines")):
        if given:
            raise UsageError(f"{flag} {why}; --format {args.format} writes one caption per image: leave it out, "
                             "or use --format jsonl")
    for flag in ("--prefix", "--suffix"):
        if "\n" in getattr(args, flag[2:]) or "\r" in getattr(args, flag[2:]):
            raise UsageError(f"{flag} holds a line break: a caption file holds one caption per line")
    if args.format == "metadata":
        if args.out is not None:
            raise UsageError("--out does not go with --format metadata: metadata.jsonl is written into the folder "
                             "of the images, where Hugging Face's imagefolder reads it (--format txt --out DIR "
                             "writes the captions elsewhere)")
        if len(args.paths) != 1 or not os.path.isdir(args.paths[0]):
            raise UsageError("--format metadata captions one folder (its metadata.jsonl names the images relative "
                             f"to it): give one folder, not {' '.join(args.paths)}")
    elif args.out is not None:
        if args.out.exists() and not args.out.is_dir():
            raise UsageError(f"--out {args.out} is a file; with --format txt, --out is the folder the .txt files "
                             "go to")
        make_folders(args.out)


def plan_files(fmt: str, images: list[str], roots: list[str | None], *, out_dir: Path | None = None,
               overwrite: bool = False) -> FilePlan:
    """The plan for ``images`` (each found under the folder of ``roots``, or named itself: None).

    txt: each image's .txt beside it, or under ``out_dir`` at the image's place in its folder's
    tree; two images that would write one .txt (``photo.jpg`` and ``photo.png``) are refused.
    metadata: every image under one folder (``roots``' only one), its metadata.jsonl read
    (a torn last line cut, one line kept per file_name)."""
    from captioner.cli.batch import resume_key

    unique: list[tuple[str, str | None]] = []
    seen: set[str] = set()
    real_folders: dict[str, str] = {}
    for image, root in zip(images, roots):
        key = resume_key(image, real_folders)
        if key not in seen:  # the same image named twice, or its folder spelled twice
            seen.add(key)
            unique.append((image, root))
    if fmt == "metadata":
        folder = Path(roots[0])
        metadata = folder / METADATA
        there = read_metadata(metadata)
        targets = {image: Path(os.path.relpath(image, folder)).as_posix() for image, _ in unique}
        kept = [name for name in targets.values() if name in there]
        todo = [image for image, name in targets.items() if overwrite or name not in there]
        return FilePlan(fmt, todo, targets, [] if overwrite else kept, metadata)
    targets, writers = {}, {}
    for image, root in unique:
        rel = os.path.relpath(image, root) if root is not None else os.path.basename(image)
        target = os.path.splitext(os.path.join(out_dir, rel) if out_dir is not None else image)[0] + ".txt"
        same = os.path.normpath(os.path.abspath(target))
        if same in writers:
            raise CaptionFilesError(f"{writers[same]} and {image} would both write {target}: rename one of them"
                                    f"{' or caption their folders one at a time' if out_dir is not None else ''}")
        writers[same] = image
        targets[image] = target
    kept = [] if overwrite else [t for t in targets.values() if os.path.exists(t)]
    todo = [image for image, target in targets.items() if overwrite or not os.path.exists(target)]
    return FilePlan(fmt, todo, targets, kept)


def _metadata_lines(path: Path) -> list[tuple[str, str | None]]:
    """(line, its normalised file_name or None) for each whole line of ``path``; a torn last
    line (a run killed mid-write) is cut off the file."""
    if not path.is_file():
        return []
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep < len(data):
        with open(path, "rb+") as f:
            f.truncate(keep)
    try:
        text = data[:keep].decode("utf-8")
    except UnicodeDecodeError as e:
        raise CaptionFilesError(f"{path} is not UTF-8 (byte {e.start}): save it as UTF-8, or move it away "
                                "to caption the folder afresh") from None
    lines = []
    for line in text.split("\n")[:-1]:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            rec = None
        name = rec.get("file_name") if isinstance(rec, dict) else None
        lines.append((line, posixpath.normpath(name) if isinstance(name, str) else None))
    return lines


def tidy_metadata(path: Path) -> int:
    """Keep one line per file_name in ``path``, the last (a caption written with --overwrite
    replaces the one before); other lines stay. The file is replaced atomically, and only when
    a line goes. Returns the lines dropped."""
    lines = _metadata_lines(path)
    last = {name: i for i, (_, name) in enumerate(lines) if name is not None}
    kept = [line for i, (line, name) in enumerate(lines) if name is None or last[name] == i]
    if len(kept) < len(lines):
        tmp = path.with_name(f".{path.name}.tidy")
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            f.write("".join(line + "\n" for line in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return len(lines) - len(kept)


def read_metadata(path: Path) -> set[str]:
    """The file_names ``path`` holds a line for (normalised: "./a.png" is "a.png"), after
    ``tidy_metadata``."""
    tidy_metadata(path)
    return {name for _, name in _metadata_lines(path) if name is not None}


@dataclass
class CaptionFiles:
    """Writes each caption into its file as ``caption_paths`` hands it over (its ``on_record``),
    and keeps what the summary names: the files written, the images that failed, and those
    whose caption has no word (nothing is written for them)."""

    plan: FilePlan
    prefix: str = ""
    suffix: str = ""
    overwrite: bool = False
    written: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)  # (image, why)
    wordless: list[str] = field(default_factory=list)
    appeared: list[str] = field(default_factory=list)  # a .txt made by someone else while this run went on

    def __post_init__(self):
        self._metadata = None
        if self.plan.format == "metadata":
            self._metadata = open(self.plan.metadata, "a", encoding="utf-8", newline="\n")

    def __call__(self, image: str, record: dict) -> None:
        from captioner.data.vocab import UNK

        if "error" in record:
            self.failed.append((image, record["error"]))
            return
        if all(w == UNK for w in record["words"]):
            self.wordless.append(image)
            return
        text = f"{self.prefix}{record['caption']}{self.suffix}"
        if self._metadata is not None:
            line = json.dumps({"file_name": self.plan.targets[image], "text": text}, ensure_ascii=False)
            self._metadata.write(line + "\n")  # one write per whole line
            self._metadata.flush()
            self.written += 1
            return
        target = Path(self.plan.targets[image])
        try:
            if write_text(target, text, self.overwrite):
                self.written += 1
            else:
                self.appeared.append(str(target))
        except OSError as e:
            self.failed.append((image, f"cannot write {target} ({e.strerror or e}); --out DIR writes the .txt "
                                       "files into another folder"))

    def close(self) -> None:
        if self._metadata is not None:
            self._metadata.close()
            tidy_metadata(self.plan.metadata)

    def summary(self, captioned: int, skipped: int, out_dir: Path | None) -> list[str]:
        """What the run did, in a few lines: counts, where the files went, the files kept."""
        kept = self.plan.kept + self.appeared
        where = "their .txt was there already" if self.plan.format == "txt" else f"in {METADATA} already"
        lines = [f"captioned {captioned}, failed {len(self.failed)}, skipped {skipped} (not image files), "
                 f"kept {len(kept)} ({where}; --overwrite captions them again)"]
        if self.plan.format == "metadata":
            lines.append(f"wrote {self.written} line{'s' if self.written != 1 else ''} to {self.plan.metadata}")
        else:
            place = f"under {out_dir}" if out_dir is not None else "beside the images"
            lines.append(f"wrote {self.written} .txt file{'s' if self.written != 1 else ''} {place}")
        if kept:
            named = ", ".join(kept[:MAX_NAMED])
            lines.append(f"kept: {named}{f' and {len(kept) - MAX_NAMED} more' if len(kept) > MAX_NAMED else ''}")
        return lines

    def failures(self) -> list[str]:
        """The images that failed, each with its reason (they have no other record)."""
        lines = [f"failed: {image}: {why}" for image, why in self.failed[:MAX_NAMED]]
        if len(self.failed) > MAX_NAMED:
            lines.append(f"failed: ... and {len(self.failed) - MAX_NAMED} more")
        return lines


def write_text(target: Path, text: str, overwrite: bool) -> bool:
    """``text`` and a line break into ``target`` whole (a temporary file, then a rename), its
    missing folders made; False, and nothing written, when ``target`` is there and not
    ``overwrite``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if not overwrite and target.exists():
        return False
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            f.write(text + "\n")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return True
