"""The bundled demo models say that they know synthetic shapes only, wherever they are used;
a user's own checkpoint says what it was trained on."""

import pytest
import torch

from captioner import inference
from captioner.cli.main import build_parser, main
from captioner.inference import Captioner
from captioner.io import bundled
from tests.tiny import tiny_captioner, tiny_image

NOTE = "trained on synthetic shapes only"
DEMOS = [m.name for m in bundled.installed()]


@pytest.fixture
def images(tmp_path):
    paths = []
    for i in range(3):
        p = tmp_path / f"photo{i}.png"
        tiny_image(i, (64, 48)).save(p)
        paths.append(str(p))
    return paths


@pytest.mark.parametrize("name", DEMOS)
def test_caption_with_a_demo_model_says_so_once_on_stderr(name, images, capsys):
    assert main(["caption", *images, "--weights", name, "--max-len", "4", "--batch-size", "1"]) == 0
    captured = capsys.readouterr()
    notes = [line for line in captured.err.splitlines() if NOTE in line]
    assert len(notes) == 1  # once per run, not once per image or batch
    assert notes[0].startswith(f"captioner caption: note: {name} ")
    assert NOTE not in captured.out  # the JSON lines stay clean
    assert len(captured.out.splitlines()) == 3


def test_the_demo_file_by_its_path_is_recognised_too(images, capsys):
    path = bundled.DEMOS["demo-soft"].path
    assert main(["caption", images[0], "--weights", str(path), "--max-len", "4", "--quiet"]) == 0
    assert NOTE in capsys.readouterr().err  # even with --quiet


def test_a_user_checkpoint_gives_no_demo_note(images, tmp_path, capsys):
    weights = tmp_path / "mine.pt"
    tiny_captioner(seed=1).save(weights, meta={"training_data": "COCO 2014 Dataset (data/coco)"})
    assert main(["caption", images[0], "--weights", str(weights), "--max-len", "4"]) == 0
    assert NOTE not in capsys.readouterr().err
    assert Captioner.load(weights).training_data == "COCO 2014 Dataset"  # an older label: its folder left out


def test_a_user_model_trained_on_shapes_says_so(images, tmp_path, capsys):
    weights = tmp_path / "shapes-run.pt"
    tiny_captioner(seed=1).save(weights, meta={"training_data": "synthetic shapes (data/shapes)"})
    assert main(["caption", images[0], "--weights", str(weights), "--max-len", "4"]) == 0
    assert "captioner caption: note: shapes-run.pt is trained on synthetic shapes only" in capsys.readouterr().err


@pytest.mark.parametrize("name", DEMOS)
def test_demo_models_are_recognised_from_what_they_ship_with(name):
    cap = Captioner.load(name)
    assert cap.bundled and cap.shapes_only
    assert cap.training_data.startswith("synthetic shapes")
    assert NOTE in cap.notice()


def test_evaluate_with_a_demo_model_says_so(tiny_coco, capsys):
    assert main(["evaluate", "--data", str(tiny_coco), "--split", "test", "--weights", "demo-soft",
                 "--no-meteor", "--max-len", "4"]) == 0
    err = capsys.readouterr().err
    assert sum(NOTE in line for line in err.splitlines()) == 1
    assert "captioner evaluate: note: demo-soft" in err


def test_help_says_what_the_demo_models_know(capsys):
    parser = build_parser()
    assert "trained on synthetic shapes only" in " ".join(parser.format_help().split())
    assert "works out of the box" not in parser.format_help()
    caption_help = parser._subparsers._group_actions[0].choices["caption"].format_help()
    assert "synthetic shapes" in " ".join(caption_help.split())
    # a transparent PNG is seen on white (the demo then calls its background a white square): said
    assert "transparent pixels are laid on white" in " ".join(caption_help.split()).lower()


def test_demo_hard_looks_through_demo_softs_frozen_encoder():
    """demo-hard is trained as train/configs/shapes-hard.toml says: a hard-attention decoder
    over demo-soft's encoder, frozen (as the paper's over fixed VGG features). Its encoder's
    every weight is demo-soft's; its decoder's are its own."""
    soft = Captioner.load(inference.resolve_weights("demo-soft")).model.state_dict()
    hard = Captioner.load(inference.resolve_weights("demo-hard")).model.state_dict()
    assert soft.keys() == hard.keys()
    encoder = [k for k in soft if k.startswith("encoder.")]
    assert encoder and all(torch.equal(soft[k], hard[k]) for k in encoder)
    assert not all(torch.equal(soft[k], hard[k]) for k in soft if k not in encoder)


def test_demo_zh_captions_in_chinese_through_demo_softs_frozen_encoder():
    """demo-zh is trained as train/configs/shapes-zh-soft.toml says: a Chinese decoder over
    demo-soft's frozen encoder. It names the example's shapes in Chinese, without spaces."""
    from pathlib import Path

    from PIL import Image

    from captioner.data.shapes import english_words
    from captioner.evaluation.grounding import parse_mentions

    soft = Captioner.load("demo-soft").model.state_dict()
    zh = Captioner.load("demo-zh")
    encoder = [k for k in soft if k.startswith("encoder.")]
    assert encoder and all(torch.equal(soft[k], zh.model.state_dict()[k]) for k in encoder)
    assert zh.vocab.tokenizer.name == "chars" and zh.max_len == 40 and zh.bundled and NOTE in zh.notice()
    image = Image.open(Path(__file__).parents[2] / "app" / "examples" / "three-shapes.png")
    result = zh.caption(image, inference.DecodeOptions(beam_size=3, max_len=zh.max_len))
    assert " " not in result.caption and result.caption == "".join(result.words)
    mentions = parse_mentions(english_words(result.words)[0])
    assert len(mentions) == 3 and all(m.color is not None for m in mentions), result.caption


def test_each_demo_is_one_record_read_by_the_api_and_the_app():
    """A demo's file, language and training data live in its record (captioner.bundled); the
    API's notice and the app's model card read them from there, not from copies."""
    from captioner.app.streamlit_app import shapes_notice

    for demo in bundled.installed():
        cap = inference.Captioner.load(demo.name)
        assert cap.demo is demo and cap.bundled and cap.name == demo.name
        assert cap.training_data.startswith(demo.training_data) and cap.notice() == demo.notice()
        assert demo.description in shapes_notice(cap, demo.name)
    assert [m.language for m in bundled.DEMOS.values()] == ["en", "en", "zh"]
    assert bundled.bundled_at(bundled.DEMOS["demo-hard"].path) is bundled.DEMOS["demo-hard"]
