"""What a new user tries in the first hour: --version, --quiet everywhere, paths on standard
input, a URL, Ctrl-C during a long caption run, and figures that say all they should."""

from __future__ import annotations

import io
import json
from importlib.metadata import version

import numpy as np
import pytest
import torch
from PIL import Image

from captioner.cli.main import main
from captioner.model.familiarity import Familiarity
from captioner.overlay import attention_figure
from captioner.search.decoding import CaptionResult
from tests.builders import one_line, read_jsonl
from tests.tiny import tiny_image, write_tiny_coco


def test_version_names_the_installed_release(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"captioner {version('captioner')}"


def test_evaluate_takes_quiet_like_the_other_commands(tmp_path, weights, capsys):
    data = write_tiny_coco(tmp_path / "coco")
    args = ["evaluate", "--data", str(data), "--weights", weights, "--max-len", "4", "--no-meteor", "--limit", "2"]
    assert main(args + ["--quiet"]) == 0
    quiet = capsys.readouterr()
    assert "BLEU-4" in quiet.out and quiet.err == ""  # the table, and nothing on stderr: no progress bar
    assert main(args) == 0
    assert "decoding" in capsys.readouterr().err  # without it, the progress bar


def _folder(root, n):
    root.mkdir()
    for i in range(n):
        tiny_image(i).save(root / f"img{i}.png")
    return sorted(root.iterdir())


def test_a_dash_reads_the_paths_from_standard_input(tmp_path, weights, capsys, monkeypatch):
    paths = _folder(tmp_path / "pics", 3)
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{paths[2]}\n\n  {paths[0]}  \n"))
    assert main(["caption", "-", "--weights", weights, "--max-len", "4", "--quiet"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert sorted(r["image"] for r in lines) == sorted([str(paths[0]), str(paths[2])])
    assert all("caption" in r for r in lines)


def test_a_dash_with_nothing_on_standard_input_is_one_line(weights, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("\n"))
    assert main(["caption", "-", "--weights", weights]) == 2
    assert "standard input" in one_line(capsys.readouterr().err)


@pytest.mark.parametrize("url", ["https://example.com/cat.jpg", "http://example.com/a/b.png?x=1"])
def test_a_url_is_not_fetched_and_the_line_says_what_to_do(tmp_path, weights, capsys, monkeypatch, url):
    monkeypatch.chdir(tmp_path)
    assert main(["caption", url, "--weights", weights]) == 2
    line = one_line(capsys.readouterr().err)
    assert url in line and "not fetched" in line and "download" in line
    assert "captioner caption " in line  # how to caption the file once it is here
    assert "no such file" not in line


def test_a_url_among_standard_input_paths_is_refused_too(weights, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("https://example.com/x.jpg\n"))
    assert main(["caption", "-", "--weights", weights]) == 2
    assert "not fetched" in one_line(capsys.readouterr().err)


def test_ctrl_c_during_caption_says_the_same_command_continues(tmp_path, weights, capsys, monkeypatch):
    from captioner.inference import Captioner

    _folder(tmp_path / "pics", 4)
    out = tmp_path / "out.jsonl"
    args = ["caption", str(tmp_path / "pics"), "--out", str(out), "--weights", weights, "--max-len", "4",
            "--batch-size", "2", "--workers", "0", "--quiet"]
    real, calls = Captioner.caption_batch, []

    def interrupted_on_the_second_batch(self, *a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, *a, **kw)

    monkeypatch.setattr(Captioner, "caption_batch", interrupted_on_the_second_batch)
    assert main(args) == 130
    line = one_line(capsys.readouterr().err)
    assert "interrupted" in line and str(out) in line and "the same command continues where it stopped" in line
    assert len(read_jsonl(out)) == 2
    monkeypatch.undo()

    assert main(args[:-1]) == 0  # the same command, less --quiet for its summary
    assert "captioned 2, failed 0, skipped 0 (not image files), already done 2" in capsys.readouterr().err
    assert len(read_jsonl(out)) == 4


def test_ctrl_c_with_captions_on_standard_output_says_how_to_keep_them(tmp_path, weights, capsys, monkeypatch):
    from captioner.inference import Captioner

    _folder(tmp_path / "pics", 2)

    def interrupted(self, *a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(Captioner, "caption_batch", interrupted)
    assert main(["caption", str(tmp_path / "pics"), "--weights", weights, "--workers", "0", "--quiet"]) == 130
    assert "--out FILE" in one_line(capsys.readouterr().err)


NOTICE = ("demo-soft is trained on synthetic shapes only (coloured circles, squares, triangles, stars and crosses "
          "on a dark background): it describes any picture, a photograph too, as coloured shapes (for photographs, "
          "train a model on photographs and pass it with --weights) {end}")


def _figure(notice: str | None = None, familiarity: Familiarity | None = None) -> np.ndarray:
    words = ["red", "circle"]
    result = CaptionResult(words, torch.full((2, 2, 2), 0.25), torch.ones(2), -1.0, familiarity=familiarity)
    image = Image.new("RGB", (48, 48), (40, 40, 40))
    return np.asarray(attention_figure(image, result, panel=64, model="demo-soft", notice=notice))


def test_the_figure_shows_the_whole_demo_notice():
    a, b = _figure(NOTICE.format(end="ALPHA")), _figure(NOTICE.format(end="OMEGA"))
    assert a.shape == b.shape and (a != b).any()  # the notice's last word is drawn, not cut off
    assert a.shape[0] > _figure(None).shape[0] + 3 * 12  # on several lines
    assert a.shape[1] == _figure(None).shape[1]  # the figure as wide as without it


def test_the_figure_shows_the_unfamiliar_flag():
    familiar = _figure(familiarity=Familiarity(0.4, False, 0.01))
    unfamiliar = _figure(familiarity=Familiarity(0.001, True, 0.01))
    assert (familiar == _figure()).all()  # nothing to flag
    assert unfamiliar.shape[0] > familiar.shape[0]  # a line more: the flag
    other = _figure(familiarity=Familiarity(0.002, True, 0.01))
    assert (unfamiliar != other).any()  # with its figure
