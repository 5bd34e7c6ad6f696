"""A document read, its alt text inserted at the places the parsers found, the diff, the write.

Nothing is re-serialised: the new text is the old one with the alt text put in at the offsets
``finders`` gave, so every other character stays; and a document is only read in an encoding
that gives back its very bytes when the text is encoded again (UTF-8 unless a byte-order mark,
or an HTML page's ``<meta charset>``, says otherwise), so every other byte stays too. A file in
any other state is refused in one line. The write is atomic (a temporary file beside it, then a
rename) and only happens if the file holds what was read.

Plain Python.
"""

from __future__ import annotations

import codecs
import difflib
import html
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from captioner.alttext.finders import HTML, SUFFIXES, MissingAlt, find_missing

# The bytes of an HTML page's start where its <meta charset> is looked for (as the HTML standard's
# prescan does).
PRESCAN = 1024
_META_CHARSET = re.compile(rb"<meta[^>]*?charset\s*=\s*[\"']?\s*([A-Za-z0-9_.:-]+)", re.IGNORECASE)
_BOMS = ((codecs.BOM_UTF8, "utf-8-sig"), (codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))
# Markdown characters that would make an alt text's words into markup: escaped with a backslash.
_MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\]<&])")


class DocumentError(ValueError):
    """A document that is not edited; the message, one line, names it and says why."""


@dataclass(frozen=True)
class Document:
    """A document as read: its bytes, its text and the encoding between the two (which gives the
    bytes back), and its images without alt text."""

    path: Path
    kind: str  # finders.HTML or finders.MARKDOWN
    data: bytes
    text: str
    encoding: str
    missing: tuple[MissingAlt, ...]


def kind_of(path: Path) -> str | None:
    """HTML or MARKDOWN by the file's extension; None for any other file."""
    return SUFFIXES.get(path.suffix.lower())


def declared_encoding(data: bytes, kind: str) -> str:
    """The encoding a document's bytes say they are in: a byte-order mark, else an HTML page's
    ``<meta charset>`` in its first bytes, else UTF-8."""
    for bom, name in _BOMS:
        if data.startswith(bom):
            return name
    if kind == HTML:
        meta = _META_CHARSET.search(data[:PRESCAN])
        if meta is not None:
            return meta.group(1).decode("ascii").lower()
    return "utf-8"


def read_document(path: Path, kind: str | None = None) -> Document:
    """``path`` read, decoded and searched for images without alt text. A file whose text does
    not encode back into its very bytes is refused (DocumentError)."""
    kind = kind or kind_of(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DocumentError(f"{path}: cannot be read ({e.strerror or e})") from None
    encoding = declared_encoding(data, kind)
    try:
        text = data.decode(encoding)
    except LookupError:
        raise DocumentError(f"{path}: its encoding {encoding!r} is not one Python knows: left alone") from None
    except UnicodeDecodeError as e:
        raise DocumentError(f"{path}: not {encoding} text (byte {e.start}), so it cannot be written back byte for "
                            "byte: left alone (save it as UTF-8)") from None
    if text.encode(encoding) != data:
        raise DocumentError(f"{path}: {encoding} does not write its bytes back as they are: left alone "
                            "(save it as UTF-8)")
    return Document(path, kind, data, text, encoding, tuple(find_missing(text, kind)))


def encodable(text: str, encoding: str) -> bool:
    try:
        text.encode(encoding)
    except UnicodeEncodeError:
        return False
    return True


def alt_markup(syntax: str, alt: str, encoding: str) -> str | None:
    """What goes into the source for the alt text ``alt``: an HTML attribute (escaped, each
    character the encoding lacks as a character reference) or a Markdown image's text (its
    markup characters escaped). None: Markdown cannot hold ``alt`` in ``encoding``."""
    if syntax == HTML:
        value = "".join(c if encodable(c, encoding) else f"&#{ord(c)};" for c in html.escape(alt, quote=True))
        return f' alt="{value}"'
    text = _MARKDOWN_SPECIAL.sub(r"\\\1", alt)
    return text if encodable(text, encoding) else None


def with_alt(doc: Document, alts: dict[MissingAlt, str]) -> str:
    """``doc``'s text with each image of ``alts`` given its alt text (already ``alt_markup``), at
    its place and nowhere else. The result is read again: if those images do not come back with
    alt text, nothing is edited (DocumentError)."""
    pieces, at = [], 0
    for image in sorted(alts, key=lambda m: m.offset):
        pieces += [doc.text[at:image.offset], alts[image]]
        at = image.offset
    pieces.append(doc.text[at:])
    text = "".join(pieces)
    if len(find_missing(text, doc.kind)) != len(doc.missing) - len(alts):
        raise DocumentError(f"{doc.path}: the alt text did not read back where it was put: left alone")
    return text


def unified_diff(old: str, new: str, name: str) -> str:
    """The change as a unified diff (``git apply`` and ``patch -p1`` take it), lines split at
    ``\\n`` only (a CRLF line keeps its CR), a last line without a line break marked as diff marks it."""
    def lines(text: str) -> list[str]:
        return [line for line in re.split(r"(?<=\n)", text) if line]

    out = []
    name = name.lstrip("/")  # as git names an absolute path: a/tmp/page.html
    for line in difflib.unified_diff(lines(old), lines(new), f"a/{name}", f"b/{name}"):
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


def write_if_unchanged(doc: Document, text: str) -> str | None:
    """Write ``text`` over ``doc``'s file atomically (a temporary file beside it, its mode copied,
    then a rename over it; a symbolic link's target is written), unless the file no longer holds
    what was read. None when written, else why not, in words."""
    target = doc.path.resolve()
    try:
        now = target.read_bytes()
    except OSError as e:
        return f"cannot be read again ({e.strerror or e}): not written"
    if now != doc.data:
        return "changed since it was read: not written (run again to caption it as it is now)"
    tmp = target.with_name(f".{target.name}.{os.getpid()}.alt-text.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(text.encode(doc.encoding))
            f.flush()
            os.fsync(f.fileno())
        shutil.copymode(target, tmp)
        if target.read_bytes() != doc.data:  # changed while the new text was written
            return "changed since it was read: not written (run again to caption it as it is now)"
        os.replace(tmp, target)
    except OSError as e:
        return f"cannot be written ({e.strerror or e})"
    finally:
        tmp.unlink(missing_ok=True)
    return None

