"""`captioner alt-text`: the diff of the alt text it would give, --write that applies it to files
that have not changed, what it skips, holds for a person or refuses listed with the reason, and
captions kept by the image's content."""

import argparse
import json
import shutil
from pathlib import Path

import pytest

from captioner.cli.main import main
from captioner.inference import Captioner
from captioner.io import bundled
from tests.builders import one_line
from tests.tiny import tiny_image

EXAMPLES = Path(__file__).resolve().parents[2] / "app" / "examples"
OPEN = ["--min-confidence", "0", "--unfamiliar-below", "0"]  # the tiny random model passes every rule


def _site(root: Path, page: bytes = b'<p>\n<img src="a.png" width="10">\n</p>\n', name: str = "index.html") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    tiny_image(0).save(root / "a.png")
    tiny_image(1).save(root / "b.png")
    (root / name).write_bytes(page)
    return root / name


def _run(args, weights, capsys, *extra):
    capsys.readouterr()
    try:
        code = main(["alt-text", *map(str, args), "--weights", weights, "--max-len", "5", "--device", "cpu",
                     *map(str, extra)])
    except SystemExit as e:  # argparse's refusals
        code = e.code
    said = capsys.readouterr()
    return code, said.out, said.err


def _caption(weights: str, image: Path) -> str:
    from captioner.inference import DecodeOptions

    return Captioner.load(weights).caption(image, DecodeOptions(beam_size=3, max_len=5)).caption


@pytest.fixture
def cache(tmp_path) -> Path:
    return tmp_path / "cache"


def test_the_diff_shows_the_alt_text_and_nothing_is_written_without_write(tmp_path, weights, capsys, cache):
    page = _site(tmp_path / "site")
    before = page.read_bytes()
    code, out, err = _run([page], weights, capsys, *OPEN, "--cache", cache)
    alt = _caption(weights, tmp_path / "site" / "a.png")
    assert code == 0
    assert f'+<img alt="{alt}" src="a.png" width="10">\n' in out and '-<img src="a.png" width="10">\n' in out
    assert page.read_bytes() == before
    assert "1 image without alt text: 1 given alt text" in err and "nothing written" in err


def test_write_applies_the_change_and_changes_no_other_byte(tmp_path, weights, capsys, cache):
    data = b'<HTML>\r\n<IMG\r\n\tSRC="a.png">\r\n<img src="b.png" alt="">\r\n<img src="a.png" alt="kept">\r\n'
    page = _site(tmp_path / "site", data)
    code, out, err = _run([page, "--write"], weights, capsys, *OPEN, "--cache", cache)
    alt = _caption(weights, tmp_path / "site" / "a.png")
    assert code == 0 and "wrote 1 file" in err
    assert page.read_bytes() == data.replace(b"<IMG\r\n", f'<IMG alt="{alt}"\r\n'.encode())
    code, out, err = _run([page, "--write"], weights, capsys, *OPEN, "--cache", cache)
    assert code == 0 and out == "" and "0 images without alt text" in err  # nothing left to do


def test_markdown_folders_are_searched_and_the_same_image_is_captioned_once(tmp_path, weights, capsys, cache,
                                                                           monkeypatch):
    site = tmp_path / "site"
    _site(site, b"![](a.png)\n\n```\n![](a.png)\n```\n", "notes.md")
    (site / "docs").mkdir()
    (site / "docs" / "more.markdown").write_bytes(b"Text ![](../a.png) and ![](../b.png).\n")
    (site / "docs" / "readme.txt").write_bytes(b"![](../a.png)\n")  # not a page
    seen = []
    real = Captioner.caption_images
    monkeypatch.setattr(Captioner, "caption_images", lambda self, ims, *a, **k: seen.append(len(ims))
                        or real(self, ims, *a, **k))
    code, out, err = _run([site, "--write"], weights, capsys, *OPEN, "--cache", cache)
    assert code == 0 and seen == [2]  # a.png (twice on the pages) and b.png, in one batch
    a, b = _caption(weights, site / "a.png"), _caption(weights, site / "b.png")
    assert (site / "notes.md").read_bytes() == f"![{a}](a.png)\n\n```\n![](a.png)\n```\n".encode()
    assert (site / "docs" / "more.markdown").read_bytes() == f"Text ![{a}](../a.png) and ![{b}](../b.png).\n".encode()
    assert (site / "docs" / "readme.txt").read_bytes() == b"![](../a.png)\n"
    assert "wrote 2 files" in err


def test_a_page_named_twice_is_read_once(tmp_path, weights, capsys, cache):
    page = _site(tmp_path / "site")
    code, out, err = _run([tmp_path / "site", page, "--write"], weights, capsys, *OPEN, "--cache", cache)
    assert code == 0 and out.count("+++ ") == 1 and "1 page (0 refused)" in err and "wrote 1 file" in err


def test_remote_urls_data_uris_and_missing_files_are_listed_as_skipped(tmp_path, weights, capsys, cache):
    data = (b'<img src="https://example.org/a.png">\n<img src="data:image/png;base64,' + b"A" * 200 + b'">\n'
            b'<img src="gone.png">\n<img src="/a.png">\n')
    page = _site(tmp_path / "site", data)
    code, out, err = _run([page, "--write"], weights, capsys, *OPEN, "--cache", cache)
    assert code == 0 and out == "" and page.read_bytes() == data
    lines = [line for line in err.splitlines() if line.startswith("skipped: ")]
    assert lines[0].endswith("index.html:1: https://example.org/a.png: a remote URL (not fetched)")
    assert lines[1].endswith(": a data: URI") and len(lines[1]) < 200
    assert "index.html:3: gone.png: not found: " in lines[2]
    assert "index.html:4: /a.png: a path from the site's root: give --root" in lines[3]
    assert "4 skipped" in err
    code, out, err = _run([page, "--root", tmp_path / "site"], weights, capsys, *OPEN, "--cache", cache)
    assert code == 0 and '+<img alt="' in out and "3 skipped" in err  # /a.png found under --root


def test_a_caption_below_the_confidence_is_held_for_a_person_with_its_reason(tmp_path, weights, capsys, cache):
    data = b'<img src="a.png">\n'
    page = _site(tmp_path / "site", data)
    code, out, err = _run([page, "--write", "--min-confidence", "1"], weights, capsys, "--cache", cache)
    alt = _caption(weights, tmp_path / "site" / "a.png")
    assert code == 0 and out == "" and page.read_bytes() == data
    held = [line for line in err.splitlines() if line.startswith("held: ")]
    assert len(held) == 1 and "index.html:1: a.png: confidence " in held[0]
    assert "below --min-confidence 1 " in held[0] and f"(caption: {alt!r})" in held[0]
    assert "keeps no record of its training images" in err  # the tiny model cannot say what is unfamiliar


def test_the_character_budget_is_kept_by_the_search_not_by_a_cut(tmp_path, weights, capsys, cache):
    from captioner.inference import DecodeOptions

    data = b"![](a.png)\n"
    page = _site(tmp_path / "site", data, "notes.md")
    free = _caption(weights, tmp_path / "site" / "a.png")
    budget = len(free) - 1
    within = Captioner.load(weights).caption(tmp_path / "site" / "a.png",
                                             DecodeOptions(beam_size=3, max_len=5, max_chars=budget)).caption
    code, out, err = _run([page, "--write", "--max-chars", budget], weights, capsys, *OPEN, "--cache", cache)
    assert code == 0 and len(within) <= budget < len(free)
    assert page.read_bytes() == f"![{within}](a.png)\n".encode()


@pytest.mark.slow
@pytest.mark.skipif("demo-soft" not in [m.name for m in bundled.installed()], reason="demo not installed")
def test_a_demo_says_it_knows_shapes_only_and_holds_what_is_unlike_them(tmp_path, capsys, cache):
    site = tmp_path / "site"
    site.mkdir()
    shutil.copy(EXAMPLES / "three-shapes.png", site / "shapes.png")
    tiny_image(3, size=(128, 128)).save(site / "noise.png")  # not a picture of shapes
    (site / "index.html").write_bytes(b'<img src="shapes.png">\n<img src="noise.png">\n')
    capsys.readouterr()
    code = main(["alt-text", str(site), "--write", "--device", "cpu", "--cache", str(cache)])
    err = capsys.readouterr().err
    assert code == 0
    assert "demo-soft is a demo model trained on synthetic shapes only" in err
    assert [line.split(": ", 3)[2:] for line in err.splitlines() if line.startswith("held: ")][0][1].startswith(
        "unfamiliar: unlike the model's training images (familiarity ")
    page = (site / "index.html").read_bytes()
    assert page.startswith(b'<img alt="') and page.endswith(b'src="shapes.png">\n<img src="noise.png">\n')


def test_captions_are_cached_by_content_and_a_second_run_runs_no_search(tmp_path, weights, capsys, cache,
                                                                         monkeypatch):
    page = _site(tmp_path / "site")
    code, first, _ = _run([page], weights, capsys, *OPEN, "--cache", cache)
    entries = list(cache.rglob("*.json"))
    assert code == 0 and len(entries) == 1
    assert json.loads(entries[0].read_text())["text"] in first

    def no_search(*args, **kwargs):
        raise AssertionError("captioned again")

    monkeypatch.setattr(Captioner, "caption_images", no_search)
    shutil.copy(tmp_path / "site" / "a.png", tmp_path / "site" / "renamed.png")
    page.write_bytes(b'<p>\n<img src="renamed.png" width="10">\n</p>\n')
    code, second, _ = _run([page], weights, capsys, *OPEN, "--cache", cache)
    assert code == 0 and second == first.replace('src="a.png"', 'src="renamed.png"')
    with pytest.raises(AssertionError, match="captioned again"):  # other options are captioned afresh
        _run([page, "--beam-size", "2"], weights, capsys, *OPEN, "--cache", cache)


def test_no_cache_keeps_nothing(tmp_path, weights, capsys, cache):
    page = _site(tmp_path / "site")
    code, out, _ = _run([page, "--no-cache"], weights, capsys, *OPEN, "--cache", cache)
    assert code == 0 and '+<img alt="' in out and not cache.exists()


def test_a_file_changed_while_it_was_captioned_is_not_written(tmp_path, weights, capsys, cache, monkeypatch):
    page = _site(tmp_path / "site")
    real = Captioner.caption_images

    def edit_meanwhile(self, images, *args, **kwargs):
        page.write_bytes(page.read_bytes() + b"<p>added by someone else</p>\n")
        return real(self, images, *args, **kwargs)

    monkeypatch.setattr(Captioner, "caption_images", edit_meanwhile)
    monkeypatch.chdir(page.parent)  # the listing names a page below here relative to here
    code, out, err = _run([page, "--write"], weights, capsys, *OPEN, "--cache", cache)
    assert code == 1
    assert [line for line in err.splitlines() if line.startswith("not written: ")] == \
        ["not written: index.html: changed since it was read: not written (run again to caption it as it is now)"]
    assert page.read_bytes().endswith(b"<p>added by someone else</p>\n") and b"alt=" not in page.read_bytes()


def test_a_page_in_an_encoding_it_cannot_write_back_is_refused_in_one_line_and_the_rest_go_on(
        tmp_path, weights, capsys, cache):
    site = tmp_path / "site"
    _site(site)
    latin = "<p>caf\xe9</p><img src='a.png'>\n".encode("latin-1")
    (site / "latin.html").write_bytes(latin)
    code, out, err = _run([site, "--write"], weights, capsys, *OPEN, "--cache", cache)
    assert code == 1
    refused = [line for line in err.splitlines() if line.startswith("refused: ")]
    assert len(refused) == 1 and "latin.html: not utf-8 text (byte 6)" in refused[0]
    assert (site / "latin.html").read_bytes() == latin
    assert b"alt=" in (site / "index.html").read_bytes()


def test_an_image_that_cannot_be_read_is_listed_as_failed(tmp_path, weights, capsys, cache):
    page = _site(tmp_path / "site", b'<img src="broken.png"><img src="a.png">\n')
    (tmp_path / "site" / "broken.png").write_bytes(b"not a png")
    code, out, err = _run([page, "--write"], weights, capsys, *OPEN, "--cache", cache)
    assert code == 1
    assert "index.html:1: broken.png: not an image that can be read" in err
    assert page.read_bytes().startswith(b'<img src="broken.png"><img alt="')


@pytest.mark.parametrize(("args", "words"), [
    (["nowhere.html"], "nowhere.html: no such file or folder"),
    (["notes.txt"], "notes.txt: not an HTML or Markdown file"),
    (["index.html", "--root", "index.html"], "--root index.html: not a folder"),
    (["index.html", "--min-confidence", "2"], "must be a share from 0 to 1, got 2"),
    (["index.html", "--max-chars", "0"], "must be >= 1, got 0"),
])
def test_mistakes_are_refused_in_one_line(tmp_path, weights, capsys, monkeypatch, args, words):
    _site(tmp_path)
    (tmp_path / "notes.txt").write_text("x")
    monkeypatch.chdir(tmp_path)
    code, out, err = _run(args, weights, capsys)
    assert code == 2 and words in one_line(err)


def test_the_defaults_are_a_budget_of_125_characters_the_measured_confidence_and_the_user_cache():
    from captioner.alttext.cache import default_folder
    from captioner.alttext.decide import MIN_CONFIDENCE
    from captioner.cli.main import build_parser

    args = build_parser().parse_args(["alt-text", "site/"])
    assert (args.max_chars, args.min_confidence, args.write, args.cache) == (125, MIN_CONFIDENCE, False, None)
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    cache_help = next(a.help for a in sub.choices["alt-text"]._actions if "--cache" in a.option_strings)
    assert str(default_folder()) in cache_help and "delete the folder to clear it" in cache_help
