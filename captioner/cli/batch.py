"""Batch captioning of files and folders: streaming, resumable, never stopped by one bad file.

Worker processes decode and preprocess images while the model runs; batches go through
the encoder and the batched beam search; each result is written as one whole JSON line
as soon as its batch is done, so memory stays flat however many images there are.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO

import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from captioner.data.images import (
    DEFAULT_MAX_PIXELS,
    ImageLoadError,
    ImageTooLargeError,
    Preprocess,
    is_image_path,
    load_image,
)
from captioner.data.jpeg_device import decode_resize, plain_jpeg
from captioner.data.vocab import UNK
from captioner.inference import Captioner, DecodeOptions
from captioner.search.decoding import CaptionResult


@dataclass
class Discovery:
    images: list[str] = field(default_factory=list)
    skipped: int = 0  # files in folders without an image extension
    roots: list[str | None] = field(default_factory=list)  # each image's folder as given; None: named itself


def discover(paths: list[str]) -> Discovery:
    """Image files named directly, and image files under folders (recursively, sorted).

    Symbolic links to folders are followed once: a folder already visited (same device
    and inode) is not entered again, so symlink loops end. Every path that does not exist
    is named in one FileNotFoundError."""
    found = Discovery()
    seen_dirs: set[tuple[int, int]] = set()
    missing = []
    for p in paths:
        if os.path.isdir(p):
            for root, dirs, files in os.walk(p, followlinks=True):
                st = os.stat(root)
                if (st.st_dev, st.st_ino) in seen_dirs:
                    dirs[:] = []
                    continue
                seen_dirs.add((st.st_dev, st.st_ino))
                dirs.sort()
                for name in sorted(files):
                    if is_image_path(name):
                        found.images.append(os.path.join(root, name))
                        found.roots.append(p)
                    else:
                        found.skipped += 1
        elif os.path.lexists(p):
            found.images.append(p)  # named explicitly: try it whatever its extension
            found.roots.append(None)
        else:
            missing.append(p)
    if missing:
        raise FileNotFoundError(f"no such file or folder: {', '.join(missing)}")
    return found


def resume_key(path: str, real_folders: dict[str, str] | None = None) -> str:
    """What resume matches an image on: its folder's real, absolute location, and its name.

    Any spelling of a folder (relative, absolute, ".", through a symlink) gives the same
    key; the file name stays as the folder walk saw it, so two links side by side in one
    folder are two images, as the walk lists them. ``real_folders`` caches each folder's
    real path across calls (a folder of many images is resolved once)."""
    folder, name = os.path.split(os.path.abspath(path))
    if real_folders is None:
        return os.path.join(os.path.realpath(folder), name)
    if folder not in real_folders:
        real_folders[folder] = os.path.realpath(folder)
    return os.path.join(real_folders[folder], name)


def _key(rec: dict, real_folders: dict[str, str] | None = None) -> str:
    # Lines written before "resolved" existed: resolved against the current folder.
    return rec.get("resolved") or resume_key(rec["image"], real_folders)


def _whole_lines(data: bytes) -> Iterator[tuple[bytes, dict | None]]:
    """(raw line, record) for every complete line; record is None for a line that is not
    an image record. A torn last line is not returned."""
    for line in data[: data.rfind(b"\n") + 1].splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            rec = None
        yield line, rec if isinstance(rec, dict) and isinstance(rec.get("image"), str) else None


def _read_cut(out_path: Path) -> bytes:
    """The file's bytes; a half-written last line (a run killed mid-write) is cut off the file."""
    if not out_path.exists():
        return b""
    with open(out_path, "rb+") as f:
        data = f.read()
        keep = data.rfind(b"\n") + 1  # everything after the last newline is a torn line
        if keep < len(data):
            f.truncate(keep)
            data = data[:keep]
    return data


@dataclass
class Resume:
    """What an output file already holds, by resume key."""

    done: set[str] = field(default_factory=set)  # a line this run accepts: not captioned again
    failed: set[str] = field(default_factory=set)  # only error lines: tried again
    lacking: set[str] = field(default_factory=set)  # captioned, without the attention (alternatives) asked for


def read_resume(out_path: Path, *, with_attention: bool = False, attention_dir: Path | None = None,
                heads: bool = False, alternatives: bool = False, explain: str | None = None) -> Resume:
    """Sort the images of ``out_path`` into done, failed before, and captioned without the
    attention asked for now (``alphas`` for --with-attention, ``alphas_heads`` for
    --attention-heads, an existing ``attention_png`` for --attention-dir), without the
    ``alternatives`` asked for (--num-captions) or without the gradient maps ``explain`` asks
    for (and their figure, with --attention-dir): the last three are captioned again."""
    ok: set[str] = set()
    good: set[str] = set()
    errors: set[str] = set()
    real_folders: dict[str, str] = {}
    for _, rec in _whole_lines(_read_cut(out_path)):
        if rec is None:
            continue
        key = _key(rec, real_folders)
        if "error" in rec:
            errors.add(key)
            continue
        good.add(key)
        enough = (not with_attention or "alphas" in rec) and (not heads or "alphas_heads" in rec) and \
            (attention_dir is None or os.path.isfile(str(rec.get("attention_png", "")))) and \
            (not alternatives or "alternatives" in rec) and \
            (explain is None or (explain in rec and (attention_dir is None
                                                     or os.path.isfile(str(rec.get(f"{explain}_png", ""))))))
        if enough:
            ok.add(key)
    return Resume(done=ok, failed=errors - good, lacking=good - ok)


@dataclass
class ResumePlan:
    """Which of the images found to caption this run: each image once, however often it was
    named, less those the output file already holds as asked for."""

    todo: list[str]  # in the order found
    already: int  # done before: not captioned again
    retried: int  # of todo: failed before
    again: int  # of todo: captioned before without the attention (or alternatives) asked for


def plan_resume(images: Sequence[str], resume: Resume | None) -> ResumePlan:
    """The images to caption, given what ``resume`` (read_resume of the output file, None
    without one) says is there."""
    todo, keys, todo_keys, real_folders = [], set(), set(), {}
    for path in images:
        key = resume_key(path, real_folders)
        if key not in keys:
            keys.add(key)
            if resume is None or key not in resume.done:
                todo.append(path)
                todo_keys.add(key)
    return ResumePlan(todo, len(keys) - len(todo),
                      len(todo_keys & resume.failed) if resume is not None else 0,
                      len(todo_keys & resume.lacking) if resume is not None else 0)


def compact(out_path: Path) -> int:
    """Keep one line per image: the last caption, else the last error. A caption always wins
    over an error (a retry that fails again loses nothing), a newer caption over an older one
    (one with attention over one without). Lines that are not image records are kept. The
    file is replaced atomically, and only when something is dropped. Returns the lines dropped."""
    data = _read_cut(out_path)
    lines = list(_whole_lines(data))
    winner: dict[str, tuple[bool, int]] = {}  # key -> (is a caption, line index)
    real_folders: dict[str, str] = {}
    for i, (_, rec) in enumerate(lines):
        if rec is not None:
            key, caption = _key(rec, real_folders), "error" not in rec
            if caption or not winner.get(key, (False, -1))[0]:
                winner[key] = (caption, i)
    keep = {i for _, i in winner.values()}
    kept = [line for i, (line, rec) in enumerate(lines) if rec is None or i in keep]
    dropped = len(lines) - len(kept)
    if dropped:
        tmp = out_path.with_name(f".{out_path.name}.compact")
        with open(tmp, "wb") as f:
            f.write(b"".join(line + b"\n" for line in kept))
            f.flush()
            os.fsync(f.fileno())
        shutil.copymode(out_path, tmp)
        os.replace(tmp, out_path)
    return dropped


def part_path(out_path: Path, rank: int) -> Path:
    """Where rank ``rank`` of a distributed run writes its lines before they are merged."""
    return out_path.with_name(f"{out_path.name}.part{rank}")


def merge_parts(out_path: Path) -> int:
    """Append the whole lines of every rank's part file to ``out_path``, delete the parts,
    then keep one line per image (see ``compact``). Returns the number of lines added."""
    _read_cut(out_path)
    added = 0
    with open(out_path, "a", encoding="utf-8") as out:
        for part in sorted(out_path.parent.glob(f"{out_path.name}.part*")):
            for line, rec in _whole_lines(part.read_bytes()):
                if rec is not None:
                    out.write(line.decode("utf-8") + "\n")
                    added += 1
            out.flush()
            os.fsync(out.fileno())
            part.unlink()
    compact(out_path)
    return added


@dataclass
class Loaded:
    index: int
    pixels: torch.Tensor | None  # (3, H, W) uint8 (Preprocess.pixels)
    error: str | None
    raw: torch.Tensor | None = None  # a JPEG's bytes, left to the model's device to decode (jpeg_device)


class _ImageFiles(Dataset):
    def __init__(self, paths: list[str], preprocess: Preprocess, max_pixels: int, raw_jpegs: bool = False):
        self.paths, self.preprocess, self.max_pixels, self.raw_jpegs = paths, preprocess, max_pixels, raw_jpegs

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> Loaded:
        if self.raw_jpegs:
            raw = plain_jpeg(self.paths[i], self.max_pixels)
            if raw is not None:
                return Loaded(i, None, None, raw)
        try:
            image = self.preprocess.load(self.paths[i], self.max_pixels)
            return Loaded(i, self.preprocess.pixels(image), None)
        except ImageTooLargeError as e:
            return Loaded(i, None, f"{e}; --max-pixels raises the limit")
        except ImageLoadError as e:
            return Loaded(i, None, str(e))
        except Exception as e:  # anything else about this one file must not stop the run
            return Loaded(i, None, f"{type(e).__name__}: {e}")


@dataclass
class LoadedBatch:
    """Consecutive images of ``paths``: those that loaded, their 8-bit pixels stacked into one
    tensor (one shared-memory transfer from a worker process per batch, not one per image, and
    a quarter of the bytes of float pixels; ``Preprocess.normalize`` or ``Captioner.caption_batch``
    normalise them where the model runs), and why the others could not be loaded."""

    indices: list[int]  # positions in ``paths`` of every image of the batch, in order
    pixels: torch.Tensor | None  # (len(loaded), 3, H, W) uint8; None when none loaded
    errors: dict[int, str]  # position -> the reason
    raw: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> JPEG bytes not yet decoded

    @property
    def loaded(self) -> list[int]:
        """Positions of the images in ``pixels``, in order."""
        return [i for i in self.indices if i not in self.errors and i not in self.raw]

    def decoded_on(self, device: torch.device, paths: Sequence[str], preprocess: Preprocess,
                   max_pixels: int = DEFAULT_MAX_PIXELS) -> "LoadedBatch":
        """This batch with its JPEG bytes decoded and resized on ``device`` (jpeg_device), every
        loaded image's pixels there in one tensor. A JPEG the device's decoder refuses goes
        through the CPU path here, which loads it or says why it cannot."""
        if not self.raw:
            return self
        decoded = dict(zip(self.raw, decode_resize(list(self.raw.values()), preprocess, device)))
        rows = dict(zip(self.loaded, self.pixels.to(device))) if self.pixels is not None else {}
        errors = dict(self.errors)
        for i, pixels in decoded.items():
            if pixels is None:
                item = _ImageFiles([paths[i]], preprocess, max_pixels)[0]
                if item.pixels is None:
                    errors[i] = item.error
                    continue
                pixels = item.pixels.to(device)
            rows[i] = pixels
        good = [rows[i] for i in self.indices if i in rows]
        return LoadedBatch(self.indices, torch.stack(good) if good else None, errors)


def _collate(batch: list[Loaded]) -> LoadedBatch:
    good = [item.pixels for item in batch if item.pixels is not None]
    return LoadedBatch([item.index for item in batch], torch.stack(good) if good else None,
                       {item.index: item.error for item in batch if item.error is not None},
                       {item.index: item.raw for item in batch if item.raw is not None})


def image_loader(paths: list[str], preprocess: Preprocess, batch_size: int, workers: int,
                 max_pixels: int = DEFAULT_MAX_PIXELS, raw_jpegs: bool = False) -> DataLoader:
    """LoadedBatch after LoadedBatch, in the order of ``paths``. ``workers`` processes decode
    ahead of the model; with ``raw_jpegs`` they leave plain JPEGs' bytes for the model's device
    to decode (LoadedBatch.decoded_on)."""
    return DataLoader(_ImageFiles(paths, preprocess, max_pixels, raw_jpegs), batch_size=batch_size,
                      num_workers=workers,
                      collate_fn=_collate, persistent_workers=False, prefetch_factor=4 if workers else None)


@dataclass
class BatchSummary:
    captioned: int = 0
    failed: int = 0
    wordless: int = 0  # captioned with no word, or with none but <unk>: nothing the model could say
    unfamiliar: int = 0  # captioned, and flagged unlike the model's training images


def caption_paths(captioner: Captioner, images: list[str], out: IO[str] | None, *, options: DecodeOptions,
                  batch_size: int = 16, workers: int = 0, with_attention: bool = False,
                  attention_dir: Path | None = None, max_pixels: int = DEFAULT_MAX_PIXELS,
                  progress: bool | None = None, resolved: bool = False, heads: bool = False,
                  decode_on_device: bool = False,
                  on_record: Callable[[str, dict], None] | None = None, explain: str | None = None) -> BatchSummary:
    """Caption ``images`` in order, writing one JSON line per image to ``out``, or handing
    each image's path and record to ``on_record`` instead (the caption files). With
    ``resolved``, each line also holds the image's resume key (for an output file that a
    later run resumes). ``heads``: each head's maps too, in the line and the figure. Each line
    names the model ("model", and "training_data" when known): several runs' captions in one
    folder stay told apart. ``decode_on_device``: JPEGs are decoded on the model's device
    (jpeg_device), everything else as before. ``explain``: each word's gradient map of that kind
    (captioner.explain) in the line, and with ``attention_dir`` a figure of them too."""
    summary = BatchSummary()
    if not images:
        return summary
    real_folders: dict[str, str] = {}
    loader = image_loader(images, captioner.preprocess, batch_size, workers, max_pixels, decode_on_device)
    # progress=None: a bar only when stderr is a terminal.
    bar = tqdm(total=len(images), unit="img", file=sys.stderr, dynamic_ncols=True,
               disable=None if progress is None else not progress)
    try:
        for batch in loader:
            batch = batch.decoded_on(captioner.device, images, captioner.preprocess, max_pixels)
            results: dict[int, CaptionResult] = {}
            if batch.pixels is not None:
                results = dict(zip(batch.loaded, captioner.caption_batch(batch.pixels, options, explain)))
            for index in batch.indices:
                path = images[index]
                r = results.get(index)
                if r is not None and r.no_fit is None:
                    record = r.to_json(path, with_attention, heads=heads, model=captioner.name,
                                       training_data=captioner.training_data)
                    if attention_dir is not None:
                        record["attention_png"] = _save_figure(path, r, attention_dir, captioner.preprocess, heads,
                                                               max_pixels, captioner.name or "", captioner.notice())
                        if explain is not None:  # the same figure, the word's gradient map in place of its attention
                            record[f"{explain}_png"] = _save_figure(
                                path, replace(r, alphas=r.gradients[explain], alphas_heads=None), attention_dir,
                                captioner.preprocess, False, max_pixels, captioner.name or "", captioner.notice(),
                                kind=explain)
                    summary.captioned += 1
                    summary.wordless += all(w == UNK for w in r.words)
                    summary.unfamiliar += bool(r.familiarity is not None and r.familiarity.unfamiliar)
                else:  # unreadable, or no caption fits --max-chars
                    record = {"image": path, "error": batch.errors[index] if r is None else r.no_fit.reason}
                    summary.failed += 1
                if resolved:
                    record["resolved"] = resume_key(path, real_folders)
                if on_record is not None:
                    on_record(path, record)
                else:
                    out.write(json.dumps(record, ensure_ascii=False) + "\n")  # one write per whole line
            if out is not None:
                out.flush()
            bar.update(len(batch.indices))
    finally:
        bar.close()
    return summary


def _save_figure(path: str, result: CaptionResult, folder: Path, preprocess: Preprocess, heads: bool = False,
                 max_pixels: int = DEFAULT_MAX_PIXELS, model: str = "", notice: str | None = None,
                 kind: str | None = None) -> str:
    """The image's figure in ``folder``; ``kind``: of that kind's gradient maps (NAME-HASH-KIND.png),
    its title saying so."""
    from captioner.overlay import attention_figure, figure_info

    folder.mkdir(parents=True, exist_ok=True)
    # Same stem in different folders must not collide: add a short hash of the full path.
    name = f"{Path(path).stem}-{hashlib.sha1(path.encode()).hexdigest()[:8]}{'-' + kind if kind else ''}.png"
    if kind is not None:
        model = f"{model}, {kind} maps: what made it say each word" if model else f"{kind} maps"
    seen = preprocess.seen(load_image(path, max_pixels))  # the part the model saw
    attention_figure(seen, result, heads=heads, model=model, notice=notice).save(
        folder / name, pnginfo=figure_info(result, model, notice))
    return str(folder / name)
