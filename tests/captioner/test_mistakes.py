"""Common mistakes on the command line: each one gives one line on stderr and exit code 2,
never a traceback."""

import os
from pathlib import Path

import pytest

from captioner.cli.main import main
from tests.tiny import tiny_captioner, tiny_image

ROOT = os.geteuid() == 0 if hasattr(os, "geteuid") else False


@pytest.fixture(scope="module")
def place(tmp_path_factory) -> Path:
    """A folder with a tiny checkpoint, two good images, a text file and the tiny COCO data."""
    from tests.tiny import write_tiny_coco

    root = tmp_path_factory.mktemp("mistakes")
    tiny_captioner(seed=1).save(root / "tiny.pt")
    (root / "imgs").mkdir()
    for i in range(2):
        tiny_image(i).save(root / "imgs" / f"img{i}.png")
    (root / "notes.txt").write_text("not a checkpoint\n")
    readonly = root / "readonly"
    readonly.mkdir()
    (readonly / "out.jsonl").write_text("")
    (readonly / "out.jsonl").chmod(0o444)
    readonly.chmod(0o555)
    write_tiny_coco(root / "coco")
    return root


CAPTION = ["caption", "{root}/imgs", "--weights", "{root}/tiny.pt", "--max-len", "4", "--quiet"]
TRAIN = ["train", "--config", "{root}/cfg.toml", "--run-dir", "{root}/run"]

# (what the user got wrong, argv, words the message must contain)
MISTAKES = [
    ("--out under a file", CAPTION + ["--out", "{root}/notes.txt/out.jsonl"], "notes.txt is a file, not a folder"),
    ("evaluate: --out under a file", ["evaluate", "--data", "{root}/coco", "--weights", "{root}/tiny.pt",
                                      "--out", "{root}/notes.txt/m.json"], "notes.txt is a file, not a folder"),
    ("--out names a folder", CAPTION + ["--out", "{root}/imgs"], "is a folder"),
    ("--out cannot be written", CAPTION + ["--out", "/proc/version"], "cannot write"),
    ("--attention-dir names a file", CAPTION + ["--attention-dir", "{root}/notes.txt"], "not a folder"),
    ("weights file missing", ["caption", "{root}/imgs", "--weights", "{root}/nope.pt"], "no such checkpoint"),
    ("weights not a checkpoint", ["caption", "{root}/imgs", "--weights", "{root}/notes.txt"], "notes.txt"),
    ("weights a folder", ["caption", "{root}/imgs", "--weights", "{root}/imgs"], "no such checkpoint"),
    ("missing paths among good ones",
     ["caption", "{root}/imgs/img0.png", "{root}/gone1.jpg", "{root}/imgs", "{root}/gone2", "--weights",
      "{root}/tiny.pt"], "gone1.jpg, {root}/gone2"),
    ("beam size 0", CAPTION + ["--beam-size", "0"], "--beam-size"),
    ("beam size not a number", CAPTION + ["--beam-size", "three"], "--beam-size"),
    ("negative workers", CAPTION + ["--workers", "-1"], "--workers"),
    ("negative length penalty", CAPTION + ["--length-penalty", "-0.5"], "--length-penalty"),
    ("length penalty not a number", CAPTION + ["--length-penalty", "nan"], "--length-penalty"),
    ("a device that is not there", CAPTION + ["--device", "cuda:7"], "cuda:7"),
    ("a device that does not exist", CAPTION + ["--device", "banana"], "banana"),
    ("evaluate: no such data folder", ["evaluate", "--data", "{root}/nodata", "--weights", "{root}/tiny.pt"],
     "nodata"),
    ("evaluate: no such split", ["evaluate", "--data", "{root}/coco", "--split", "nosuch", "--weights",
                                 "{root}/tiny.pt"], "nosuch"),
    ("evaluate: --out names a folder", ["evaluate", "--data", "{root}/coco", "--weights", "{root}/tiny.pt",
                                        "--out", "{root}/imgs"], "is a folder"),
    ("train: --set value of the wrong type", TRAIN + ["--set", "optim.epochs=many"], "optim.epochs"),
    ("train: --set unknown key", TRAIN + ["--set", "optim.epoch=3"], "optim.epoch"),
    ("train: --set without a value", TRAIN + ["--set", "optim.epochs"], "optim.epochs"),
    ("train: no such config", ["train", "--config", "{root}/missing.toml"], "missing.toml"),
    ("train: resume a folder with no run", ["train", "--resume", "{root}/imgs"], "last.pt"),
    ("shapes: image size too small", ["shapes", "--out", "{root}/shapes", "--image-size", "4"], "image"),
    ("shapes: negative count", ["shapes", "--out", "{root}/shapes", "--train", "-1"], "--train"),
    ("shapes: --out names a file", ["shapes", "--out", "{root}/notes.txt", "--train", "1"], "notes.txt"),
    ("no command", [], "command"),
    ("unknown command", ["captoin", "x.jpg"], "captoin"),
]


@pytest.mark.parametrize("what, argv, words", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_mistake_gives_one_line_and_exit_two(place, what, argv, words, capsys):
    (place / "cfg.toml").write_text(f'[data]\ndir = "{place}/coco"\n')
    argv = [a.format(root=place) for a in argv]
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own exit
        code = e.code
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2, (what, captured.err)
    assert "Traceback" not in captured.err
    assert len(lines) == 1, (what, captured.err)
    assert lines[0].startswith("captioner"), lines[0]
    assert words.format(root=place) in lines[0], (what, lines[0])
    assert captured.out == ""


@pytest.mark.skipif(ROOT, reason="root may write to read-only files")
def test_a_read_only_out_file_is_one_line(place, capsys):
    code = main(["caption", str(place / "imgs"), "--weights", str(place / "tiny.pt"), "--quiet",
                 "--out", str(place / "readonly" / "out.jsonl")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "cannot write" in err


@pytest.mark.slow  # a process of its own
def test_a_mistake_under_python_m_is_one_line_too(tmp_path):
    """torchrun runs `-m captioner.cli`: the error a subcommand raises must be the one main() catches."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "captioner.cli", "train", "--config", str(tmp_path / "missing.toml")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip().startswith("captioner train: error: ") and "missing.toml" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
