"""Own images and captions -> a Karpathy-format split file (``dataset.json``).

Three sources are read, each giving (image path, caption) pairs:

- a CSV or TSV file with a header: an image column and a caption column (found from the
  usual names, or named by the caller), several rows per image allowed;
- a JSON Lines file: one object per line with an image (``image``, ``file_name``, ...)
  and ``caption``/``text``, or a list ``captions`` (the ``metadata.jsonl`` of image-folder
  data sets);
- a folder of images, each with a text file of the same name beside it (``photo.jpg`` +
  ``photo.txt``), one caption per line;
- a folder of images with Hugging Face's ``metadata.jsonl`` in it (``file_name`` relative to the
  folder, and ``text``). ``captioner caption --format txt`` and ``--format metadata`` write these
  two, so that a folder captioned, then corrected by hand, can be trained on. A folder that holds
  both is refused until the caller names one (``--format folder`` or ``--format metadata``).

Image paths are relative to the source file's folder (the folder itself for a folder
source) unless absolute. Rows of the same image are merged (however its path is spelt),
a caption given twice for one image is kept once, captions without a word are dropped;
what is left out is listed. :func:`write_dataset` writes Karpathy's format with the images
where they are (paths relative to the output folder), a seeded train/val/test draw
(:func:`split_sizes` states the rules), and the tokenizer's name, which training records
in the checkpoint.

Text files are read as UTF-8 (a byte-order mark, as Excel's "CSV UTF-8" writes, is skipped;
UTF-16 with its mark is read too). Anything else is refused naming the encoding it most
likely is (charset-normalizer's guess) and the runners-up, how a line reads in it, and the
``iconv`` command that converts it, rather than read on a guess that may garble every accent.
"""

from __future__ import annotations

import codecs
import csv
import io
import json
import os
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from captioner.data.coco import OWN_SPLIT_FILE
from captioner.data.images import IMAGE_EXTENSIONS
from captioner.data.vocab import tokenizer_named

# Column or key names tried in this order when the caller names none (case-insensitive).
IMAGE_KEYS = ("image", "file_name", "filename", "path", "image_path", "file", "img")
CAPTION_KEYS = ("caption", "text", "sentence", "description")
CAPTION_LIST_KEYS = ("captions", "texts", "sentences", "descriptions")  # JSON Lines: a list of captions
FORMATS = ("csv", "tsv", "jsonl", "folder", "metadata")
METADATA = "metadata.jsonl"  # Hugging Face's imagefolder metadata, in the folder of its images


class SourceError(ValueError):
    """The source cannot be read as captions; the message says why, in one line."""


@dataclass
class OwnImage:
    """One image of the source and all of its captions, in the order they came."""

    path: Path
    captions: list[str] = field(default_factory=list)


@dataclass
class Source:
    """What a source holds: its images (first-seen order), and what was left out."""

    format: str
    images: list[OwnImage]
    rows: int  # (image, caption) pairs read
    empty_captions: int  # captions without a letter or digit: dropped
    columns: tuple[str, str] | None = None  # the image and caption column (or key) used
    without_captions: list[Path] = field(default_factory=list)  # folder source: images with no .txt beside them
    duplicates: int = 0  # an image's caption given again: kept once

    @property
    def captions(self) -> int:
        return sum(len(im.captions) for im in self.images)


def source_format(source: Path) -> str:
    """"folder", "jsonl", "tsv" or "csv", from what ``source`` is."""
    if source.is_dir():
        return "folder"
    suffix = source.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    if suffix in (".tsv", ".tab"):
        return "tsv"
    return "csv"


def read_source(source: str | os.PathLike, fmt: str | None = None, image_key: str | None = None,
                caption_key: str | None = None, encoding: str | None = None) -> Source:
    """The images and captions of ``source`` (see the module docstring); a one-line
    :class:`SourceError` when it cannot be read. ``encoding``: the text files' (a Python
    codec name), for files that are not UTF-8."""
    source = Path(source)
    if not source.exists():
        raise SourceError(f"no such file or folder: {source}")
    given = fmt
    fmt = fmt or source_format(source)
    if fmt in ("folder", "metadata"):
        if not source.is_dir():
            raise SourceError(f"{source} is not a folder")
        if fmt == "metadata" or (fmt == "folder" and given is None and (source / METADATA).is_file()):
            return _read_metadata(source, image_key, caption_key, encoding, chosen=given is not None)
        return _read_folder(source, encoding)
    if not source.is_file():
        raise SourceError(f"{source} is a folder; give a CSV, TSV or JSON Lines file, or --format folder")
    text = read_text(source, encoding)
    base = source.parent
    if fmt == "jsonl":
        pairs, columns = _jsonl_pairs(text, source, image_key, caption_key)
    elif fmt in ("csv", "tsv"):
        pairs, columns = _table_pairs(text, source, "\t" if fmt == "tsv" else None, image_key, caption_key)
    else:
        raise SourceError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    return _merged(fmt, ((_resolve(base, image), caption) for image, caption in pairs), columns)


def read_text(path: Path, encoding: str | None = None) -> str:
    """The text of ``path``: UTF-8 (a byte-order mark skipped), UTF-16 with its mark, or
    ``encoding`` when given; else a :class:`SourceError` naming the likely encoding."""
    data = path.read_bytes()
    if encoding is not None:
        try:
            return data.decode(encoding)
        except LookupError:
            raise SourceError(f"unknown encoding {encoding!r} (Python's codec names: cp1252, gb18030, ...)") from None
        except UnicodeDecodeError as e:
            raise SourceError(f"{path} is not {encoding} (byte 0x{data[e.start]:02x} on line "
                              f"{_line_of(data, e.start)})") from None
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):  # Excel's "Unicode text"
        return data.decode("utf-16")
    try:
        return data.decode("utf-8-sig")  # a byte-order mark (Excel's "CSV UTF-8") is no header text
    except UnicodeDecodeError as e:
        raise SourceError(_not_utf8(path, data, e.start)) from None


def _not_utf8(path: Path, data: bytes, at: int) -> str:
    """Why ``data`` is refused: where UTF-8 fails, the likely encoding, how the failing line
    reads in it, the conversion command and the option that reads it as it is."""
    where = f"{path} is not UTF-8 (byte 0x{data[at]:02x} on line {_line_of(data, at)})"
    from charset_normalizer import from_bytes

    # A few lines fit several code pages about equally (a French "près" reads "prčs" in
    # cp1250): the runners-up are named, and the line as the best guess reads it.
    guesses = [m.encoding for m in from_bytes(data)]
    if not guesses:
        return f"{where} and its encoding cannot be told: save it as UTF-8 (your spreadsheet's \"CSV UTF-8\")"
    best = codecs.lookup(guesses[0]).name
    start, end = data.rfind(b"\n", 0, at) + 1, data.find(b"\n", at)
    line = data[start:end if end >= 0 else len(data)].decode(best, errors="replace").strip()
    others = ", ".join(codecs.lookup(g).name for g in guesses[1:4])
    return (f"{where}; it looks like {best}{f' (or {others})' if others else ''}, in which that line reads "
            f"{line[:60]!r}: if so, convert it with iconv -f {iconv_name(best)} -t UTF-8 {path} > "
            f"{path.with_stem(path.stem + '-utf8')} or read it as it is with --encoding {best}")


def _line_of(data: bytes, at: int) -> int:
    return data.count(b"\n", 0, at) + 1


_ICONV_NAMES = {"mac-roman": "MACINTOSH", "utf-16-le": "UTF-16LE", "utf-16-be": "UTF-16BE",
                "shift_jis_2004": "SHIFT_JISX0213", "euc_jis_2004": "EUC-JISX0213", "hz": "HZ-GB-2312"}


def iconv_name(codec: str) -> str:
    """GNU iconv's name for a Python codec ("iso8859-1" -> "ISO-8859-1", "cp1252" -> "CP1252")."""
    name = codecs.lookup(codec).name
    if name in _ICONV_NAMES:
        return _ICONV_NAMES[name]
    return name.upper().replace("_", "-").replace("ISO8859-", "ISO-8859-")


def _resolve(base: Path, image: str) -> Path:
    path = Path(image.strip()).expanduser()
    return path if path.is_absolute() else base / path


def _pick(names: Sequence[str], wanted: str | None, usual: Sequence[str]) -> str | None:
    """The name among ``names`` equal to ``wanted`` (or else to one of ``usual``), any case."""
    lowered = {n.strip().lower(): n for n in names}
    for candidate in ([wanted] if wanted else usual):
        if candidate.lower() in lowered:
            return lowered[candidate.lower()]
    return None


def _table_pairs(text: str, source: Path, delimiter: str | None, image_key: str | None,
                 caption_key: str | None) -> tuple[list[tuple[str, str]], tuple[str, str]]:
    if not text.strip():
        raise SourceError(f"{source} is empty")
    if delimiter is None:
        try:
            delimiter = csv.Sniffer().sniff(text[:8192], delimiters=",;\t|").delimiter
        except csv.Error:
            delimiter = ","
    reader = csv.reader(io.StringIO(text), delimiter=delimiter)
    header = next(reader)
    image_col = _pick(header, image_key, IMAGE_KEYS)
    caption_col = _pick(header, caption_key, CAPTION_KEYS)
    _require_columns(source, header, image_col, caption_col, image_key, caption_key, "column")
    i, c = header.index(image_col), header.index(caption_col)
    pairs = []
    first_line = reader.line_num + 1  # the line the next row starts on
    for row in reader:
        start, first_line = first_line, reader.line_num + 1
        if not any(cell.strip() for cell in row):
            continue
        for cell in row:
            _refuse_swallowed_rows(source, start, cell, delimiter)
        image = row[i] if i < len(row) else ""
        if not image.strip():
            raise SourceError(f"{source}, line {start}: no image in column {image_col!r}")
        pairs.append((image, row[c] if c < len(row) else ""))
    return pairs, (image_col, caption_col)


def _refuse_swallowed_rows(source: Path, start: int, cell: str, delimiter: str) -> None:
    """A quoted cell that runs over a line break into a line shaped like a row (cells, one
    naming an image file) has lost its closing quote and swallowed the rows after it."""
    for offset, line in enumerate(cell.split("\n")[1:], start=1):
        cells = line.split(delimiter)
        if len(cells) > 1 and any(Path(cell.strip()).suffix.lower() in IMAGE_EXTENSIONS for cell in cells):
            raise SourceError(f"{source}, line {start}: a quote opened on this line is not closed before line "
                              f"{start + offset}, which looks like a row of its own ({line[:50]!r}): close the "
                              "quote or remove it")


def _require_columns(source: Path, seen: Sequence[str], image_col: str | None, caption_col: str | None,
                     image_key: str | None, caption_key: str | None, what: str) -> None:
    listing = ", ".join(s.strip() for s in seen) or "none"
    captions = CAPTION_KEYS + CAPTION_LIST_KEYS if what == "key" else CAPTION_KEYS
    for found, wanted, usual, option, kind in ((image_col, image_key, IMAGE_KEYS, "--image-column", "image"),
                                                (caption_col, caption_key, captions, "--caption-column",
                                                 "caption")):
        if found is None:
            looked = repr(wanted) if wanted else ", ".join(usual)
            raise SourceError(f"{source}: no {kind} {what}; looked for {looked}; its {what}s: {listing}; "
                              f"name it with {option}")


def _jsonl_pairs(text: str, source: Path, image_key: str | None,
                 caption_key: str | None) -> tuple[list[tuple[str, str]], tuple[str, str]]:
    pairs: list[tuple[str, str]] = []
    columns = None
    # "\n" only: str.splitlines would also split at U+2028 and friends, which JSON writes unescaped.
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise SourceError(f"{source}, line {number} is not JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise SourceError(f"{source}, line {number} is not a JSON object")
        image_col = _pick(list(obj), image_key, IMAGE_KEYS)
        caption_col = _pick(list(obj), caption_key, CAPTION_KEYS + CAPTION_LIST_KEYS)
        try:
            _require_columns(source, list(obj), image_col, caption_col, image_key, caption_key, "key")
        except SourceError as e:
            raise SourceError(str(e).replace(f"{source}:", f"{source}, line {number}:", 1)) from None
        image, captions = obj[image_col], obj[caption_col]
        if not isinstance(image, str) or not image.strip():
            raise SourceError(f"{source}, line {number}: {image_col!r} is not a file name")
        for caption in captions if isinstance(captions, list) else [captions]:
            pairs.append((image, caption if isinstance(caption, str) else ""))
        columns = columns or (image_col, caption_col)
    if columns is None:
        raise SourceError(f"{source} holds no JSON lines")
    return pairs, columns


def _read_folder(folder: Path, encoding: str | None = None) -> Source:
    pairs, without = [], []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            path = Path(root) / name
            if path.suffix.lower() not in IMAGE_EXTENSIONS:
                continue
            text_file = path.with_suffix(".txt")
            if not text_file.is_file():
                without.append(path)
                continue
            text = read_text(text_file, encoding)
            # A final line break ends the last caption; it does not start an empty one.
            for line in text.removesuffix("\n").removesuffix("\r").split("\n"):
                pairs.append((path, line))
    source = _merged("folder", pairs, None)
    source.without_captions = without
    return source


def _folder_images(folder: Path) -> list[Path]:
    """The image files under ``folder``, in the order of a sorted walk."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        found += [Path(root) / name for name in sorted(files) if Path(name).suffix.lower() in IMAGE_EXTENSIONS]
    return found


def _read_metadata(folder: Path, image_key: str | None, caption_key: str | None, encoding: str | None,
                   chosen: bool) -> Source:
    """The captions of ``folder``'s metadata.jsonl; its images without a line are listed. Unless
    the format was ``chosen``, .txt captions beside the images too are an ambiguity, refused."""
    metadata = folder / METADATA
    if not metadata.is_file():
        raise SourceError(f"{folder} holds no {METADATA} (captioner caption --format metadata writes one); "
                          "--format folder reads .txt files beside the images")
    images = _folder_images(folder)
    if not chosen:
        sidecars = [p for p in images if p.with_suffix(".txt").is_file()]
        if sidecars:
            raise SourceError(f"{folder} holds both {METADATA} and .txt captions beside its images (e.g. "
                              f"{sidecars[0].with_suffix('.txt')}): read one with --format metadata or --format "
                              "folder (the .txt files)")
    pairs, columns = _jsonl_pairs(read_text(metadata, encoding), metadata, image_key, caption_key)
    source = _merged("metadata", ((_resolve(folder, image), caption) for image, caption in pairs), columns)
    listed = {str(im.path) for im in source.images}
    source.without_captions = [p for p in images if os.path.normpath(os.path.abspath(p)) not in listed]
    return source


def _merged(fmt: str, pairs: Iterable[tuple[Path, str]], columns: tuple[str, str] | None) -> Source:
    """Rows of one image merged (the same file however its path is spelled), empty captions
    dropped, a caption given again for the same image kept once."""
    images: dict[str, OwnImage] = {}
    rows = empty = duplicates = 0
    for path, caption in pairs:
        rows += 1
        key = os.path.normpath(os.path.abspath(path))
        image = images.setdefault(key, OwnImage(Path(key)))
        caption = " ".join(caption.split())  # a line break inside a cell is a space
        if not any(ch.isalnum() for ch in caption):
            empty += 1
        elif caption in image.captions:
            duplicates += 1
        else:
            image.captions.append(caption)
    return Source(fmt, list(images.values()), rows, empty, columns, duplicates=duplicates)


# --------------------------------------------------------------------------- writing


def split_sizes(n: int, val: float | None, test: float | None) -> tuple[int, int]:
    """Validation and test images out of ``n``.

    A whole number is a count, a number below 1 a share of ``n`` rounded to the nearest
    count (at least one when above 0). None: 10% for validation, at least one; 10% for
    test, at least one, only while three images or more are left to train on, else none.
    Training validates, so validation needs one image at least, and training one: fewer
    than 2 images, or counts that leave none to train on, are refused."""
    if n < 2:
        raise SourceError(f"{n} image{'' if n == 1 else 's'} cannot be split: a data set needs at least 2 images, "
                          "one to train on and one to validate on")

    def share(x: float) -> int:
        return max(1, int(x * n + 0.5)) if 0 < x < 1 else int(x)

    n_val = max(1, int(0.1 * n + 0.5)) if val is None else share(val)
    if test is not None:
        n_test = share(test)
    else:
        n_test = max(1, int(0.1 * n + 0.5))
        n_test = n_test if n - n_val - n_test >= 3 else 0
    if n_val < 1:
        raise SourceError("training validates on at least one image: give --val 1 or more")
    if n_val + n_test >= n:
        raise SourceError(f"{n} images cannot give {n_val} validation and {n_test} test images and still leave "
                          "one to train on: lower --val or --test")
    return n_val, n_test


def draw_splits(n: int, n_val: int, n_test: int, seed: int) -> list[str]:
    """"train", "val" or "test" for each of n images: a seeded draw, the same for the same seed."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    splits = ["train"] * n
    for rank, i in enumerate(order[: n_val + n_test]):
        splits[i] = "val" if rank < n_val else "test"
    return splits


def write_dataset(out_dir: str | os.PathLike, images: Sequence[OwnImage], splits: Sequence[str], tokenizer: str,
                  name: str) -> Path:
    """``out_dir/dataset.json`` in Karpathy's format: images where they are (paths relative
    to ``out_dir``), every sentence's raw text and tokens, the data set's name and the
    tokenizer's, written last like Karpathy's ``dataset`` so that a reader finds them in the
    file's tail. UTF-8, unescaped."""
    tok = tokenizer_named(tokenizer)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    entries, sentid = [], 0
    for imgid, (image, split) in enumerate(zip(images, splits)):
        relative = Path(os.path.relpath(image.path, out_dir.resolve()))
        sentences = []
        for raw in image.captions:
            sentences.append({"raw": raw, "tokens": tok.tokenize(raw), "imgid": imgid, "sentid": sentid})
            sentid += 1
        entries.append({"filepath": str(relative.parent), "filename": relative.name, "imgid": imgid,
                        "split": split, "sentids": [s["sentid"] for s in sentences], "sentences": sentences})
    path = out_dir / OWN_SPLIT_FILE
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"images": entries, "dataset": name, "tokenizer": tok.name}, ensure_ascii=False) + "\n",
                   encoding="utf-8")
    os.replace(tmp, path)
    return path
