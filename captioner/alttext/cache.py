"""Captions kept by the image's content, so that a second run over the same pages costs no search.

An image's caption is stored under the SHA-256 of its bytes, in a folder of its own for each
model and way of searching (the SHA-256 of the model's files and of the decoding options): a
renamed or copied image is found again, an edited one is captioned again, and another model or
other options never read these captions. What is stored is the caption and what the rules of
``decide`` need (score, familiarity), so that changing ``--min-confidence`` costs no search.

The cache lives in ``$XDG_CACHE_HOME/captioner/alt-text`` (``~/.cache/captioner/alt-text`` when
XDG_CACHE_HOME is not set), or where ``--cache DIR`` says; deleting the folder clears it.
Each entry is written whole (a temporary file, then a rename); an entry that cannot be read
is captioned again.

Plain Python.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from captioner.alttext.decide import Caption


def default_folder() -> Path:
    """``$XDG_CACHE_HOME/captioner/alt-text``, or ``~/.cache/captioner/alt-text``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "captioner" / "alt-text"


def file_digest(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_digest(path: Path) -> str:
    """The SHA-256 of a model's files: a checkpoint file, or every file of an exported folder."""
    if not path.is_dir():
        return file_digest(path)
    h = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(file.relative_to(path).as_posix().encode("utf-8") + b"\0" + file_digest(file).encode("ascii"))
    return h.hexdigest()


class CaptionCache:
    """The captions of one model and one set of decoding options (``key``), under ``folder``."""

    def __init__(self, folder: Path, model: str, options: dict):
        key = hashlib.sha256(json.dumps({"model": model, "options": options}, sort_keys=True).encode()).hexdigest()
        self.folder = Path(folder) / key[:16]

    def _entry(self, image_digest: str) -> Path:
        return self.folder / image_digest[:2] / f"{image_digest}.json"

    def get(self, image_digest: str) -> Caption | None:
        """The caption stored for the image of that digest, or None."""
        try:
            return Caption.from_json(json.loads(self._entry(image_digest).read_text(encoding="utf-8")))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put(self, image_digest: str, caption: Caption) -> bool:
        """Store ``caption`` for the image of that digest. False: the cache cannot be written (the
        caption was made, and is used all the same)."""
        entry = self._entry(image_digest)
        tmp = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(caption.to_json(), ensure_ascii=False), encoding="utf-8")
            os.replace(tmp, entry)
        except OSError:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:  # its folder could not be made
                pass
            return False
        return True
