"""The ``captioner`` command's shape: `caption` reads in one sitting, and every command that
runs a model (caption, evaluate, familiarity, export, alt-text) loads it through the one loader of
captioner/cli/common.py, so that each refuses a bad device or a file that is not a
checkpoint in the same words, and a demo model's notice is said in one place."""

import inspect
from pathlib import Path

import pytest
import torch

from captioner.cli import alt_text as alt_text_cli
from captioner.cli import common as cli_common
from captioner.cli import export as export_cli
from captioner.cli import main as cli
from captioner.cli.common import UsageError, check_device, load_model
from captioner.cli.main import main
from captioner.io import bundled
from captioner.io.checkpoint import load_checkpoint
from tests.builders import one_line
from tests.tiny import tiny_captioner, tiny_image, write_tiny_coco

STOP = "the loader was reached"


@pytest.fixture(scope="module")
def place(tmp_path_factory) -> Path:
    """A tiny checkpoint, an image, a text file and the tiny COCO data."""
    root = tmp_path_factory.mktemp("cli_shape")
    tiny_captioner(seed=1).save(root / "tiny.pt")
    tiny_image(0).save(root / "img.png")
    (root / "notes.txt").write_text("not a checkpoint\n")
    (root / "page.html").write_text('<img src="img.png">\n')
    write_tiny_coco(root / "coco")
    return root


def commands(root: Path, weights: str, device: str = "cpu") -> dict[str, list[str]]:
    """Each command that loads a model, run on ``weights``, up to where it loads it."""
    return {
        "caption": ["caption", str(root / "img.png"), "--weights", weights, "--device", device, "--quiet"],
        "evaluate": ["evaluate", "--data", str(root / "coco"), "--weights", weights, "--device", device,
                     "--quiet"],
        "familiarity": ["familiarity", weights, "--data", str(root / "coco"), "--out", str(root / "f.pt"),
                        "--device", device, "--quiet"],
        "export": ["export", weights, "--out", str(root / "exported")],
        "alt-text": ["alt-text", str(root / "page.html"), "--weights", weights, "--device", device, "--no-cache",
                     "--quiet"],
    }


def test_caption_command_is_under_fifty_lines():
    lines, _ = inspect.getsourcelines(cli.cmd_caption)
    assert len(lines) < 50, f"cmd_caption has {len(lines)} lines"


# (command, where the loader is expected to put the model, whether it says a demo's notice)
LOADS = [("caption", "cpu", True), ("evaluate", "cpu", True), ("familiarity", "cpu", False),
         ("export", "cpu", True), ("alt-text", "cpu", True)]


@pytest.mark.parametrize(("command", "device", "notice"), LOADS, ids=[c for c, *_ in LOADS])
def test_each_model_command_loads_its_model_through_the_one_loader(place, monkeypatch, capsys, command, device,
                                                                   notice):
    calls = []

    def loader(name, weights, on, *, notice=True):
        calls.append((name, weights, str(on), notice))
        raise UsageError(STOP)

    monkeypatch.setattr(cli, "load_model", loader)
    monkeypatch.setattr(export_cli, "load_model", loader)
    monkeypatch.setattr(alt_text_cli, "load_model", loader)
    weights = str(place / "tiny.pt")
    assert main(commands(place, weights)[command]) == 2
    assert one_line(capsys.readouterr().err) == f"captioner {command}: error: {STOP}"
    assert calls == [(command, weights, device, notice)]


def test_evaluate_of_a_captions_file_reads_the_preprocessing_through_the_loader(place, monkeypatch, capsys):
    calls = []

    def loader(name, weights, on, *, notice=True):
        calls.append((name, weights, str(on), notice))
        raise UsageError(STOP)

    (place / "captions.jsonl").write_text("")
    monkeypatch.setattr(cli, "load_model", loader)
    argv = ["evaluate", "--data", str(place / "coco"), "--captions", str(place / "captions.jsonl"),
            "--weights", str(place / "tiny.pt"), "--device", "cpu"]
    assert main(argv) == 2
    assert one_line(capsys.readouterr().err) == f"captioner evaluate: error: {STOP}"
    assert calls == [("evaluate", str(place / "tiny.pt"), "cpu", False)]


def test_every_model_command_refuses_a_file_that_is_not_a_checkpoint_in_the_same_words(place, capsys):
    weights = str(place / "notes.txt")
    with pytest.raises(UsageError) as refused:
        load_model("any", weights, "cpu")
    said = {}
    for command, argv in commands(place, weights).items():
        assert main(argv) == 2, command
        said[command] = one_line(capsys.readouterr().err)
    assert said == {c: f"captioner {c}: error: {refused.value}" for c in said}
    assert "notes.txt" in str(refused.value)
    assert not (place / "f.pt").exists() and not (place / "exported").exists()


@pytest.mark.parametrize("device", ["banana", "cuda:9"])
def test_every_command_with_a_device_refuses_a_missing_one_in_the_same_words(place, capsys, device):
    with pytest.raises(UsageError) as refused:
        check_device(device)
    for command, argv in commands(place, str(place / "tiny.pt"), device).items():
        if command == "export":  # no --device: it writes from the CPU
            continue
        assert main(argv) == 2, command
        assert one_line(capsys.readouterr().err) == f"captioner {command}: error: {refused.value}"


def test_the_loader_gives_the_model_its_file_and_the_checkpoint_as_read(place, capsys):
    path = place / "tiny.pt"
    model = load_model("caption", str(path), "cpu")
    assert model.path == path
    as_read = load_checkpoint(path)
    assert model.checkpoint.to_dict().keys() == as_read.to_dict().keys()
    assert model.checkpoint.state_dict.keys() == as_read.state_dict.keys()
    for key, value in as_read.state_dict.items():
        assert torch.equal(model.checkpoint.state_dict[key], value)
        assert model.checkpoint.state_dict[key].device.type == "cpu"
    assert model.captioner.vocab.to_list() == list(as_read.vocab)
    assert capsys.readouterr().err == ""  # a model of one's own: no notice


@pytest.mark.skipif("demo-soft" not in [m.name for m in bundled.installed()], reason="demo not installed")
def test_the_loader_says_a_demo_models_notice_once_in_the_commands_name(capsys):
    model = load_model("evaluate", "demo-soft", "cpu")
    assert model.path == bundled.DEMOS["demo-soft"].path
    assert one_line(capsys.readouterr().err) == f"captioner evaluate: note: {model.captioner.notice()}"
    load_model("familiarity", "demo-soft", "cpu", notice=False)
    assert capsys.readouterr().err == ""


def test_the_shared_pieces_live_apart_from_the_command_modules():
    """export_cli takes nothing from cli (the two formed an import circle), and the command
    modules hold no copy of the shared pieces."""
    source = Path(inspect.getsourcefile(export_cli)).read_text(encoding="utf-8")
    assert "from .cli import" not in source and "captioner.cli import" not in source
    for name in ("UsageError", "check_device", "check_out_file", "make_folders", "demo_notice", "load_model",
                 "EXIT_OK", "EXIT_USAGE"):
        assert getattr(cli, name, getattr(cli_common, name)) is getattr(cli_common, name), name


def _help(*words: str) -> str:
    import contextlib
    import io

    from captioner.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([*words, "--help"])
    return " ".join(out.getvalue().split())


def test_evaluate_s_help_says_it_takes_an_own_data_folder_too():
    assert "dataset.json" in _help("evaluate") and "captions_<split>.json" in _help("evaluate")


def test_the_app_s_help_names_every_kind_of_model_it_offers():
    text = _help("app")
    assert "*.pt" in text and "exported" in text
