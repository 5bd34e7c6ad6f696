"""Alt text into HTML and Markdown documents: the images without it found by the parsers, with
their places; the alt text put there and every other byte left as it was; encodings read only
when they give the bytes back; the diff; the atomic write that refuses a file changed since."""

import os
import shutil
import subprocess

import pytest

from captioner.alttext.documents import (
    DocumentError,
    alt_markup,
    read_document,
    unified_diff,
    with_alt,
    write_if_unchanged,
)
from captioner.alttext.finders import HTML, MARKDOWN, MissingAlt, find_missing, locate

ALT = "a red circle"


def _doc(tmp_path, name: str, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return read_document(path)


def _filled(doc, alt: str = ALT) -> bytes:
    """The document with every image found given ``alt``, as bytes in its encoding."""
    text = with_alt(doc, {m: alt_markup(m.syntax, alt, doc.encoding) for m in doc.missing})
    return text.encode(doc.encoding)


# ------------------------------------------------------------------------------------- HTML

def test_html_odd_formatting_uppercase_tags_and_attributes_over_lines_change_only_by_the_alt(tmp_path):
    data = (b"<!DOCTYPE html>\r\n<HTML><BODY>\r\n<IMG\r\n     SRC='a.png'\r\n\tWIDTH=10\r\n>\r\n"
            b"<p>text <img src=b.png/> and <Img   src = \"c.png\"   ></p>\r\n</BODY></HTML>")
    doc = _doc(tmp_path, "page.html", data)
    assert [(m.line, m.src) for m in doc.missing] == [(3, "a.png"), (7, "b.png/"), (7, "c.png")]
    expected = data.replace(b"<IMG\r\n", b'<IMG alt="a red circle"\r\n') \
        .replace(b"<img src=b.png/>", b'<img alt="a red circle" src=b.png/>') \
        .replace(b'<Img   src = "c.png"', b'<Img alt="a red circle"   src = "c.png"')
    assert _filled(doc) == expected


def test_html_alt_empty_and_existing_alt_are_left_alone_in_any_spelling(tmp_path):
    data = (b'<img src="a.png" alt="">\n<img ALT="a dog" src="b.png">\n<img alt src="c.png">\n'
            b'<img\n  src="d.png"\n  Alt=\'\'>\n<img src="e.png">\n')
    doc = _doc(tmp_path, "page.html", data)
    assert [m.src for m in doc.missing] == ["e.png"]
    assert _filled(doc) == data.replace(b'<img src="e.png">', b'<img alt="a red circle" src="e.png">')


def test_html_comments_scripts_and_styles_hold_no_images(tmp_path):
    data = (b'<!-- <img src="a.png"> -->\n<script>let s = \'<img src="b.png">\';</script>\n'
            b'<style>/* <img src="c.png"> */</style>\n<!--\n<img src="d.png">\n-->\n<img src="e.png">\n')
    doc = _doc(tmp_path, "page.htm", data)
    assert [(m.line, m.src) for m in doc.missing] == [(7, "e.png")]


def test_picture_and_srcset_the_img_takes_the_alt_and_the_sources_stay(tmp_path):
    data = (b'<picture>\n  <source srcset="big.webp 2x, small.webp 1x" type="image/webp">\n'
            b'  <img srcset="photo.png 1x, photo@2x.png 2x">\n</picture>\n'
            b'<img sizes="50vw" srcset="wide.png 800w" src="fallback.png">\n')
    doc = _doc(tmp_path, "page.html", data)
    assert [m.src for m in doc.missing] == ["photo.png", "fallback.png"]
    assert _filled(doc) == data.replace(b"  <img srcset", b'  <img alt="a red circle" srcset') \
        .replace(b'<img sizes', b'<img alt="a red circle" sizes')


def test_html_alt_is_escaped_and_characters_the_encoding_lacks_become_references():
    assert alt_markup(HTML, 'a "b" & <c>', "utf-8") == ' alt="a &quot;b&quot; &amp; &lt;c&gt;"'
    assert alt_markup(HTML, "红色的圆", "ascii") == ' alt="&#32418;&#33394;&#30340;&#22278;"'
    assert alt_markup(HTML, "红色的圆", "utf-8") == ' alt="红色的圆"'


# --------------------------------------------------------------------------------- Markdown

def test_markdown_code_blocks_code_spans_and_escapes_hold_no_images(tmp_path):
    data = (b"# Title\n\n```\n![](fenced.png)\n```\n\n    ![](indented.png)\n\n"
            b"Inline `![](span.png)` and \\![](escaped.png) and ![](real.png).\n\n~~~md\n![](tilde.png)\n~~~\n")
    doc = _doc(tmp_path, "notes.md", data)
    assert [(m.line, m.src) for m in doc.missing] == [(9, "real.png")]
    assert _filled(doc) == data.replace(b"![](real.png)", b"![a red circle](real.png)")


def test_markdown_with_crlf_line_ends_keeps_every_cr(tmp_path):
    data = b"Intro\r\n\r\n![](a.png)\r\ntext ![](b.png \"title\")\r\n\r\n> quoted\r\n> ![](c.png)\r\n"
    doc = _doc(tmp_path, "notes.md", data)
    assert [(m.line, m.src) for m in doc.missing] == [(3, "a.png"), (4, "b.png"), (7, "c.png")]
    assert _filled(doc) == data.replace(b"![](", b"![a red circle](")


def test_markdown_text_already_there_is_never_replaced(tmp_path):
    data = b"![a cat](a.png) ![ ](b.png) ![](c.png)\n"
    doc = _doc(tmp_path, "notes.md", data)
    assert [m.src for m in doc.missing] == ["c.png"]


def test_markdown_lists_headings_links_references_and_tables(tmp_path):
    data = (b"# Logo ![](h.png) #\n\n- item ![](l.png)\n  1. nested [![](linked.png)](https://x.org)\n\n"
            b"| a | b |\n|---|---|\n| ![](t.png) | x |\n\nSee ![][logo].\n\n[logo]: ref.png\n")
    doc = _doc(tmp_path, "notes.md", data)
    assert [(m.line, m.src) for m in doc.missing] == [(1, "h.png"), (3, "l.png"), (4, "linked.png"),
                                                      (8, "t.png"), (10, "ref.png")]
    assert _filled(doc, "x") == data.replace(b"![](", b"![x](").replace(b"![][logo]", b"![x][logo]")


def test_html_inside_markdown_is_read_as_html(tmp_path):
    data = (b'<div align="center">\n  <IMG src="block.png" width="50">\n  <img src="has.png" alt="">\n</div>\n\n'
            b'Text <img src="inline.png"> more.\n\n```html\n<img src="code.png">\n```\n<!-- <img src="c.png"> -->\n')
    doc = _doc(tmp_path, "notes.md", data)
    assert [(m.syntax, m.line, m.src) for m in doc.missing] == [(HTML, 2, "block.png"), (HTML, 6, "inline.png")]
    assert _filled(doc) == data.replace(b"<IMG src", b'<IMG alt="a red circle" src') \
        .replace(b'<img src="inline', b'<img alt="a red circle" src="inline')


def test_markdown_alt_escapes_markup_characters():
    assert alt_markup(MARKDOWN, "a [b] *c* _d_ `e` <f> & \\", "utf-8") == \
        "a \\[b\\] \\*c\\* \\_d\\_ \\`e\\` \\<f> \\& \\\\"
    assert alt_markup(MARKDOWN, "红色的圆", "latin-1") is None  # Markdown has no character references


# -------------------------------------------------------------------------------- encodings

def test_a_file_that_is_not_its_encoding_is_refused_in_one_line(tmp_path):
    (tmp_path / "latin.md").write_bytes("caf\xe9 ![](a.png)\n".encode("latin-1"))
    with pytest.raises(DocumentError) as e:
        read_document(tmp_path / "latin.md")
    assert "not utf-8 text (byte 3)" in str(e.value) and "\n" not in str(e.value)


def test_an_encoding_that_does_not_give_the_bytes_back_is_refused(tmp_path):
    # UTF-16 big-endian with its mark: Python's utf-16 writes its own byte order back
    data = "\ufeff<img src=\"a.png\">\n".encode("utf-16-be")
    (tmp_path / "be.html").write_bytes(data)
    with pytest.raises(DocumentError, match="does not write its bytes back as they are"):
        read_document(tmp_path / "be.html")


def test_a_declared_charset_and_a_byte_order_mark_are_kept_byte_for_byte(tmp_path):
    latin = '<meta charset="ISO-8859-1">\n<p>caf\xe9</p><img src="a.png">\n'.encode("latin-1")
    doc = _doc(tmp_path, "latin.html", latin)
    assert doc.encoding == "iso-8859-1"
    assert _filled(doc, "été") == latin.replace(b"<img", '<img alt="été"'.encode("latin-1"))
    bom = b"\xef\xbb\xbf# T\n\n![](a.png)\n"
    doc = _doc(tmp_path, "bom.md", bom)
    assert [m.line for m in doc.missing] == [3]  # the mark is not text: "# T" is still a heading
    assert _filled(doc) == bom.replace(b"![]", b"![a red circle]")


# ------------------------------------------------------------------------------ diff, write

def test_the_diff_applies_with_git_and_gives_the_same_bytes(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    data = b"one\r\n![](a.png)\r\nthree\r\n![](b.png)"  # CRLF, no line break at the end
    doc = _doc(tmp_path, "notes.md", data)
    new = with_alt(doc, {m: alt_markup(m.syntax, ALT, doc.encoding) for m in doc.missing})
    diff = unified_diff(doc.text, new, "notes.md")
    assert diff.startswith("--- a/notes.md\n+++ b/notes.md\n") and "\\ No newline at end of file" in diff
    (tmp_path / "change.diff").write_bytes(diff.encode("utf-8"))
    subprocess.run(["git", "apply", "--unsafe-paths", "change.diff"], cwd=tmp_path, check=True)
    assert (tmp_path / "notes.md").read_bytes() == new.encode("utf-8") == data.replace(b"![]", b"![a red circle]")


def test_write_replaces_the_file_atomically_keeping_its_mode_and_a_links_target(tmp_path):
    doc = _doc(tmp_path, "page.html", b'<img src="a.png">\n')
    os.chmod(doc.path, 0o640)
    link = tmp_path / "link.html"
    link.symlink_to(doc.path.name)
    linked = read_document(link)
    assert write_if_unchanged(linked, '<img alt="x" src="a.png">\n') is None
    assert link.is_symlink() and doc.path.read_bytes() == b'<img alt="x" src="a.png">\n'
    assert oct(doc.path.stat().st_mode & 0o777) == oct(0o640)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.html", "page.html"]  # no temporary file left


def test_a_file_changed_since_it_was_read_is_not_written(tmp_path):
    doc = _doc(tmp_path, "page.html", b'<img src="a.png">\n')
    doc.path.write_bytes(b'<img src="a.png">\n<p>edited meanwhile</p>\n')
    why = write_if_unchanged(doc, '<img alt="x" src="a.png">\n')
    assert why is not None and "changed since it was read" in why
    assert doc.path.read_bytes() == b'<img src="a.png">\n<p>edited meanwhile</p>\n'


def test_an_edit_that_does_not_read_back_as_alt_text_is_refused(tmp_path):
    doc = _doc(tmp_path, "page.html", b'<p>x</p><img src="a.png">\n')
    wrong = MissingAlt(1, HTML, 1, "a.png")  # inside "<p>", not after "<img"
    with pytest.raises(DocumentError, match="did not read back"):
        with_alt(doc, {wrong: ' alt="x"'})


# ---------------------------------------------------------------------------------- sources

def test_sources_resolve_locally_and_remote_ones_and_data_uris_are_named(tmp_path):
    for folder in ("img", "docs"):
        (tmp_path / "site" / folder).mkdir(parents=True)
    (tmp_path / "site" / "img" / "a b.png").write_bytes(b"x")
    page = tmp_path / "site" / "docs" / "page.html"
    assert locate("../img/a%20b.png?v=2#top", page).path == tmp_path / "site" / "docs" / "../img/a b.png"
    assert locate("/img/a%20b.png", page, root=tmp_path / "site").path == tmp_path / "site" / "img" / "a b.png"
    assert "give --root" in locate("/img/a.png", page).why
    assert locate((tmp_path / "site" / "img" / "a b.png").as_uri(), page).path is not None
    for remote in ("https://x.org/a.png", "HTTP://x.org/a.png", "//cdn.x.org/a.png", "ftp://x/a.png"):
        assert locate(remote, page).why == "a remote URL (not fetched)"
    assert locate("data:image/png;base64,iVBORw0KGgo=", page).why == "a data: URI"
    assert locate("DATA:image/png;base64,iVBORw0KGgo=", page).why == "a data: URI"
    assert locate("missing.png", page).why.startswith("not found: ")
    (tmp_path / "site" / "img" / "logo.SVG").write_bytes(b"<svg/>")
    assert locate("../img/logo.SVG", page).why == "an SVG drawing: only pictures of pixels are captioned"
    assert locate("", page).why == "no source"


def test_find_missing_sorts_images_by_place(tmp_path):
    found = find_missing('<img src="b.png"><img src="a.png">', HTML)
    assert [m.offset for m in found] == [4, 21]


def test_an_image_whose_place_is_not_certain_is_found_but_given_no_place(tmp_path):
    # two equal cells of a table row: the parser sees two images, the text cannot say which is which
    doc = _doc(tmp_path, "notes.md", b"| a | b |\n|---|---|\n| ![](t.png) | ![](t.png) |\n")
    assert [(m.offset, m.line, m.src) for m in doc.missing] == [(None, 3, "t.png"), (None, 3, "t.png")]
