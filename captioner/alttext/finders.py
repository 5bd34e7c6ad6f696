"""The images of an HTML or Markdown document that have no alt text, and where each one is.

Found by the documents' own parsers, never by a pattern over the text: ``html.parser`` (the
standard library's, which skips comments, ``<script>`` and ``<style>``) and markdown-it-py
(CommonMark, with tables; code blocks, code spans and escaped brackets are not images to it).
Each parser reports where an image starts in the source; the place the alt text goes is taken
from there, and the text found at that place is checked before it is handed on, so that an edit
can only ever land where the parser saw the image.

- HTML: an ``<img>`` with no ``alt`` attribute at all. ``alt=""`` marks a decorative image
  (WCAG): it is left alone, as is any alt text already there. The alt attribute goes right after
  the tag's name (``<IMG SRC=a.png>`` becomes ``<IMG alt="..." SRC=a.png>``), so that nothing
  else of the tag, its case, quotes or line breaks, changes. The source is ``src``, else the
  first candidate of ``srcset`` (inside ``<picture>`` the ``<img>`` carries the alt text for all
  of its sources).
- Markdown: an image whose text is empty, ``![](src)`` or ``![][ref]``; the caption goes between
  the brackets. HTML inside Markdown (blocks and inline tags) is read as HTML.

Plain Python; markdown-it-py is imported when a Markdown document is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit
from urllib.request import url2pathname

HTML, MARKDOWN = "html", "markdown"
VECTOR = (".svg", ".svgz")  # drawings the image reader cannot open: skipped, not failed
SUFFIXES = {".html": HTML, ".htm": HTML, ".xhtml": HTML, ".md": MARKDOWN, ".markdown": MARKDOWN}


@dataclass(frozen=True)
class MissingAlt:
    """An image with no alt text: where its alt text goes (``offset``, in characters of the
    document's text), how it is written there (``syntax``), its line (from 1) and its source as
    the document writes it."""

    offset: int | None  # None: the parser saw the image, but its place in the source is not certain
    syntax: str  # HTML: an attribute after the tag's name; MARKDOWN: the text between the brackets
    line: int
    src: str


def find_missing(text: str, kind: str) -> list[MissingAlt]:
    """The images of ``text`` (an HTML or a Markdown document, ``kind``) without alt text, in
    the order of the document."""
    found = find_in_html(text) if kind == HTML else find_in_markdown(text)
    return sorted(found, key=lambda m: (m.line, -1 if m.offset is None else m.offset))


def line_starts(text: str, breaks: str = "\n") -> list[int]:
    """The offset of each line's first character; a line ends at ``\\n`` (as ``html.parser``
    counts lines) or, for ``breaks="any"``, at ``\\r\\n``, ``\\r`` or ``\\n`` (as markdown-it does)."""
    pattern = "\n" if breaks == "\n" else r"\r\n|\r|\n"
    return [0, *(m.end() for m in re.finditer(pattern, text))]


def _line_of(starts: list[int], offset: int) -> int:
    lo, hi = 0, len(starts)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if starts[mid] <= offset:
            lo = mid
        else:
            hi = mid
    return lo + 1


class _Images(HTMLParser):
    """The ``<img>`` start tags without ``alt``, with their offsets in the text fed."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.text = text
        self.starts = line_starts(text)
        self.found: list[tuple[int, str]] = []  # (offset of "<", source)

    def handle_starttag(self, tag, attrs):
        if tag != "img" or any(name == "alt" for name, _ in attrs):
            return
        line, column = self.getpos()
        start = self.starts[line - 1] + column
        raw = self.get_starttag_text() or ""
        if not self.text.startswith(raw, start) or raw[:4].lower() != "<img":
            return  # not where the parser says: never edit a place it did not see
        self.found.append((start, _source(attrs)))


def _source(attrs: list[tuple[str, str | None]]) -> str:
    """An ``<img>``'s source: its first ``src``, else the first URL of its ``srcset``."""
    for name, value in attrs:
        if name == "src" and value and value.strip():
            return value.strip()
    for name, value in attrs:
        if name == "srcset" and value and value.strip():
            return value.strip().split(",")[0].split()[0]
    return ""


def find_in_html(text: str, base: int = 0, starts: list[int] | None = None) -> list[MissingAlt]:
    """The ``<img>`` tags of ``text`` without an ``alt`` attribute; ``base`` is ``text``'s offset in
    a larger document whose ``starts`` (``line_starts``) give the lines."""
    parser = _Images(text)
    parser.feed(text)
    parser.close()
    starts = starts if starts is not None else parser.starts
    return [MissingAlt(base + at + len("<img"), HTML, _line_of(starts, base + at), src)
            for at, src in parser.found]


def _markdown():
    """markdown-it-py's CommonMark parser, with tables, whose image and inline-HTML rules note
    where each of their tokens starts in the inline text (``meta["at"]``)."""
    from markdown_it import MarkdownIt
    from markdown_it.rules_inline import html_inline, image

    def located(rule):
        def rule_at(state, silent: bool) -> bool:
            at, before = state.pos, len(state.tokens)
            done = rule(state, silent)
            if done and not silent:
                for token in state.tokens[before:]:
                    if token.type in ("image", "html_inline"):
                        token.meta = {**(token.meta or {}), "at": at}
                        break
            return done
        return rule_at

    md = MarkdownIt("commonmark").enable("table")
    md.inline.ruler.at("image", located(image))
    md.inline.ruler.at("html_inline", located(html_inline))
    return md


def find_in_markdown(text: str) -> list[MissingAlt]:
    """The images of a Markdown document with empty text, and the ``<img>`` tags without ``alt``
    in its HTML."""
    starts = line_starts(text, "any")
    lines = [text[a:b] for a, b in zip(starts, [*starts[1:], len(text) + 1])]
    lines = [line.rstrip("\r\n") for line in lines]
    found: list[MissingAlt] = []
    for block in _markdown().parse(text):
        if block.map is None:
            continue
        first, end = block.map
        if block.type == "html_block":
            start, stop = starts[first], starts[end] if end < len(starts) else len(text)
            found += find_in_html(text[start:stop], start, starts)
        elif block.type == "inline":
            for token in block.children or []:
                at = (token.meta or {}).get("at")
                if at is None:
                    continue
                offset = _source_offset(block.content, at, lines, starts, first)
                line = first + block.content.count("\n", 0, at) + 1
                if token.type == "image" and not token.children:
                    src = str(token.attrs.get("src", ""))
                    if offset is not None and text.startswith("![]", offset):
                        found.append(MissingAlt(offset + len("!["), MARKDOWN, line, src))
                    elif offset is None:
                        found.append(MissingAlt(None, MARKDOWN, line, src))
                elif token.type == "html_inline":
                    for tag in find_in_html(token.content):  # one tag: an <img> without alt, or none
                        placed = offset is not None and text[offset:offset + 4].lower() == "<img"
                        found.append(MissingAlt(offset + len("<img") if placed else None, HTML, line, tag.src))
    return found


def _source_offset(content: str, at: int, lines: list[str], starts: list[int], first: int) -> int | None:
    """Where position ``at`` of a block's inline text lies in the document. The inline text is
    the block's lines ``first``... with their leading markers and indentation taken off (and its
    ends stripped): each of its lines is the end of a source line, or in a table cell a part of
    one. None where that does not place it without doubt."""
    k = content.count("\n", 0, at)
    column = at - (content.rfind("\n", 0, at) + 1)
    piece = content.split("\n")[k]
    if first + k >= len(lines):
        return None
    line = lines[first + k]
    for cut in range(len(line) + 1):
        rest = line[cut:]
        if rest == piece or (rest.rstrip() == piece and rest.startswith(piece)):
            return starts[first + k] + cut + column
    if piece and line.count(piece) == 1:
        return starts[first + k] + line.index(piece) + column
    return None


@dataclass(frozen=True)
class Located:
    """What an image's source is: a local file (``path``), or why it is not captioned (``why``)."""

    path: Path | None
    why: str | None = None


def locate(src: str, document: Path, root: Path | None = None) -> Located:
    """The local file ``src`` names, relative to ``document``'s folder (a path from the site's
    root, ``/img/a.png``, under ``root``); remote URLs, ``data:`` URIs, files that are not there
    and SVG drawings are named with the reason they are not captioned."""
    if not src:
        return Located(None, "no source")
    if src.lower().startswith("data:"):
        return Located(None, "a data: URI")
    parts = urlsplit(src)
    if parts.scheme.lower() == "file":
        path = Path(url2pathname(parts.path))
    elif len(parts.scheme) > 1 or src.startswith("//"):  # one letter: a Windows drive
        return Located(None, "a remote URL (not fetched)")
    elif len(parts.scheme) == 1:
        path = Path(src)
    else:
        name = unquote(parts.path)
        if not name:
            return Located(None, "no file in the source")
        if name.startswith("/"):
            if root is None:
                return Located(None, "a path from the site's root: give --root, the folder the site is served from")
            path = root / name.lstrip("/")
        else:
            path = document.parent / name
    if not path.is_file():
        return Located(None, f"not found: {path}")
    if path.suffix.lower() in VECTOR:
        return Located(None, "an SVG drawing: only pictures of pixels are captioned")
    return Located(path)
