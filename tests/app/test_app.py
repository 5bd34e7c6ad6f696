"""The web page, driven by Streamlit's AppTest: same captions as the CLI, bad uploads, reruns."""

from __future__ import annotations

import base64
import html
import io
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from PIL import Image

from captioner import inference
from captioner.app.serving import figure_png, result_json
from captioner.cli.main import build_parser, main
from captioner.inference import DecodeOptions
from captioner.io import bundled
from tests.tiny import tiny_captioner, tiny_image

AppTest = pytest.importorskip("streamlit.testing.v1").AppTest

APP = Path(__file__).resolve().parents[2] / "app" / "streamlit_app.py"
MODEL = "tiny.pt"
HARD_MODEL = "tiny-hard.pt"
COCO_MODEL = "tiny-coco.pt"  # a user checkpoint that names its training data
SHAPES_MODEL = "tiny-shapes.pt"  # a user checkpoint trained on the synthetic shapes
SEED = 5  # a tiny random model whose captions differ between beam sizes 3 and 5


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("weights")
    tiny_captioner(seed=SEED).save(folder / MODEL)
    tiny_captioner(seed=SEED, attention="hard").save(folder / HARD_MODEL)
    tiny_captioner(seed=SEED).save(folder / COCO_MODEL, meta={"training_data": "COCO 2014 Dataset (data/coco)"})
    tiny_captioner(seed=SEED).save(folder / SHAPES_MODEL, meta={"training_data": "synthetic shapes (data/shapes)"})
    return folder


@pytest.fixture
def app(weights_dir, monkeypatch) -> AppTest:
    """The page with the tiny model selected (bundled demo models, when installed, are listed first)."""
    monkeypatch.setenv("CAPTIONER_WEIGHTS_DIR", str(weights_dir))
    at = AppTest.from_file(str(APP), default_timeout=180).run()
    assert not at.exception
    at.sidebar.selectbox[0].select(MODEL).run()
    return at


def _png(seed: int, size=(64, 48)) -> bytes:
    buf = io.BytesIO()
    tiny_image(seed, size).save(buf, "PNG")
    return buf.getvalue()


def _cli_record(tmp_path, capsys, data: bytes, weights: Path, beam: int, max_len: int = 20,
                *extra: str) -> dict:
    """The JSON line `captioner caption --with-attention` prints for this image and these settings,
    the model's name included (the download is the same record); the page lists the search's 3
    best captions by default: --num-captions 3, at most the beam."""
    path = tmp_path / "image.png"
    path.write_bytes(data)
    capsys.readouterr()
    assert main(["caption", str(path), "--weights", str(weights), "--beam-size", str(beam),
                 "--max-len", str(max_len), "--with-attention", "--quiet", "--num-captions", str(min(3, beam)),
                 *extra]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["model"] == weights.name
    return record


def _shown_caption(at: AppTest) -> str:
    """The big caption, with the page's markdown escapes removed."""
    return re.sub(r"\\(.)", r"\1", at.main.header[0].value)


def _details(at: AppTest) -> str:
    return next(c.value for c in at.caption if " · beam " in c.value)


def _page_html(at: AppTest) -> str:
    return "".join(h.value for h in at.html)


def _word_panels(at: AppTest) -> list[str]:
    """The grid's panel labels, "word · β 0.52", one per word."""
    return [html.unescape(m) for m in re.findall(r'<label class="cell"[^>]*>.*?<span>(.*?)</span>', _page_html(at))]


def _data_images(fragment: str) -> list[Image.Image]:
    """The pictures inside an HTML fragment (data URIs), decoded."""
    return [Image.open(io.BytesIO(base64.b64decode(b64)))
            for b64 in re.findall(r'data:image/(?:png|jpeg);base64,([A-Za-z0-9+/=]+)', fragment)]


def test_upload_shows_the_cli_caption_and_one_overlay_per_word(app, weights_dir, tmp_path, capsys):
    data = _png(seed=3)
    app.file_uploader[0].set_value(("generated.png", data, "image/png")).run()
    assert not app.exception and not app.error
    cli = _cli_record(tmp_path, capsys, data, weights_dir / MODEL, beam=3)
    assert _shown_caption(app) == cli["caption"]
    assert "generated.png" in _details(app) and "beam 3" in _details(app)
    assert [p.split(" · β ")[0] for p in _word_panels(app)] == cli["words"]
    labels = [b.label for b in app.get("download_button")]
    assert any("PNG" in label for label in labels) and any("JSON" in label for label in labels)
    shown = app.session_state["shown"]  # what the download buttons serve
    # Same pixels, same model, same settings: the same numbers, attention maps included.
    assert json.loads(result_json(shown)) == {**cli, "image": "generated.png"}
    figure = Image.open(io.BytesIO(figure_png(shown, MODEL)))
    assert figure.format == "PNG"
    assert figure.text["Title"] == shown.result.caption and figure.text["Model"] == MODEL  # and drawn above


def _bomb_png() -> bytes:
    buf = io.BytesIO()  # 96 M pixels, over Pillow's default limit, a few KB as a 1-bit PNG
    Image.new("1", (12000, 8000)).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize("name, data, message", [
    ("notes.jpg", b"just some text, not an image\n", "not an image"),
    ("empty.jpg", b"", "empty file"),
    ("cut.png", _png(seed=4)[:60], "truncated"),
    ("huge.png", _bomb_png(), "pixel"),
])
def test_a_bad_upload_shows_an_error_and_the_page_keeps_working(app, name, data, message):
    app.file_uploader[0].set_value((name, data, "image/jpeg")).run()
    assert not app.exception
    assert len(app.error) == 1 and message in app.error[0].value.replace("\\", "")
    assert not _word_panels(app)

    app.file_uploader[0].set_value(("fine.png", _png(seed=5), "image/png")).run()
    assert not app.exception and not app.error
    assert "fine.png" in _details(app) and _word_panels(app)


def test_changing_the_beam_size_captions_again(app, weights_dir, tmp_path, capsys):
    data = _png(seed=6)
    app.file_uploader[0].set_value(("generated.png", data, "image/png")).run()
    first = app.session_state["shown"]
    assert first.key[3].beam_size == 3 and "beam 3" in _details(app)
    app.sidebar.slider[0].set_value(5).run()
    assert not app.exception
    again = app.session_state["shown"]
    assert again is not first and again.key[3].beam_size == 5  # captioned again, with the new beam
    assert "beam 5" in _details(app)
    cli = _cli_record(tmp_path, capsys, data, weights_dir / MODEL, beam=5)
    assert _shown_caption(app) == cli["caption"]
    assert json.loads(result_json(again)) == {**cli, "image": "generated.png"}


def test_hard_attention_models_offer_the_inference_mode(app, weights_dir, tmp_path, capsys):
    assert not app.sidebar.radio  # a soft model has no such choice
    app.sidebar.selectbox[0].select(HARD_MODEL).run()
    data = _png(seed=3)
    app.file_uploader[0].set_value(("generated.png", data, "image/png")).run()
    assert app.sidebar.radio[0].value == "expected" and "hard attention: expected" in _details(app)
    app.sidebar.radio[0].set_value("argmax").run()
    assert not app.exception and "hard attention: argmax" in _details(app)
    cli = _cli_record(tmp_path, capsys, data, weights_dir / HARD_MODEL, 3, 20, "--hard-attention", "argmax")
    assert json.loads(result_json(app.session_state["shown"])) == {**cli, "image": "generated.png"}


def test_the_word_picker_is_in_the_page_one_radio_and_one_map_per_word(app):
    """Picking a word is left to the browser (tests/app/test_app_browser.py clicks it): the page holds
    one radio input per word, the first checked, each in one block with everything it shows (its
    pill, the big view with its map layer over the one photo, its note, its panel), and the
    stylesheet shows the block whose input is checked."""
    from captioner.app import page

    app.file_uploader[0].set_value(("generated.png", _png(seed=3, size=(96, 64)), "image/png")).run()
    words = _shown_caption(app).split()
    view = app.session_state["shown"].view
    assert view in _page_html(app) and "<script" not in _page_html(app)
    blocks = re.findall(r'<div class="word">(.*?)</label></div>', view)
    assert len(blocks) == len(words)
    betas = app.session_state["shown"].result.betas
    for t, (block, w, b) in enumerate(zip(blocks, words, betas)):
        (me, checked), = re.findall(r'<input type="radio" name="\w+" id="([\w-]+)"( checked)?>', block)
        assert bool(checked) == (t == 0)  # the first word picked
        assert re.findall(r'<label class="(?:pill|cell)" for="([\w-]+)">', block) == [me, me]  # its pill and panel
        layers = re.findall(r'style="--layer: var\(--([\w-]+)\)"', block)
        assert layers == [f"l{t}hm"] * 2  # its own map, in the big view and on the panel
        (note,) = re.findall(r'<p class="note">(.*?)</p>', block)
        assert html.unescape(note) == f"“{w}”: word {t + 1} of {len(words)}, β = {float(b):.2f}"
    layers = _data_images(view)
    (photo,) = _data_images(_page_html(app).replace(view, ""))  # the preview's, drawn by the big view
    assert photo.format == "JPEG" and photo.size == (96, 64)  # the photo once, at the size it was uploaded
    assert len(layers) == len(words) and all(m.mode == "P" and m.size[0] <= 96 for m in layers)
    assert layers[0].convert("RGBA").tobytes() != layers[-1].convert("RGBA").tobytes()  # each its own map
    # What is shown follows the checked input alone: no rule names a word, the stylesheet is the same for all.
    assert ".word:has(> input:checked) > :is(.view, .note) { display: block; }" in page.STYLE
    assert "<style" not in view


def test_every_picture_travels_once_per_page(app):
    """The photo and every word's layer are in the page once: the preview defines the photo, the
    result the layers, and the big view and the grid draw them by name (CSS custom properties)."""
    from captioner.app import page

    app.file_uploader[0].set_value(("generated.png", _png(seed=3, size=(96, 64)), "image/png")).run()
    html_page = _page_html(app)
    uris = re.findall(r'data:image/(?:png|jpeg);base64,[A-Za-z0-9+/=]+', html_page)
    assert len(uris) == len(set(uris)) == 1 + len(_word_panels(app))  # the photo, one layer per word
    names = dict(re.findall(r'--([\w-]+): url\((data:[^)]+)\)', html_page))  # every picture is named, once
    assert sorted(names.values()) == sorted(uris)
    drawn = re.findall(r'var\(--([\w-]+)\)', html_page.replace(page.STYLE, ""))
    assert set(drawn) == set(names)  # each drawn by its name, none missing
    photo = page.photo_var(app.session_state["picture"])
    assert drawn.count(photo) == 2  # by the preview and by the result, which draws it in every view
    assert "Writing a caption" not in html_page  # the note shown while the model works is gone with the caption


def test_repeated_words_get_labels_the_picker_can_tell_apart():
    from captioner.app.page import word_labels

    assert word_labels(["a", "star", "and", "a", "star", "a"]) == ["a", "star", "and", "a (2)", "star (2)", "a (3)"]


def test_models_offered_are_installed_bundled_ones_and_the_weights_folder(tmp_path, monkeypatch):
    from captioner.app.streamlit_app import available_models

    demos = tmp_path / "bundled"
    demos.mkdir()
    (demos / bundled.DEMOS["demo-hard"].file).write_bytes(b"")  # only demo-hard is installed
    folder = tmp_path / "mine"
    folder.mkdir()
    for name in ("b.pt", "a.pt", "notes.txt"):
        (folder / name).write_bytes(b"")
    monkeypatch.setattr(bundled, "WEIGHTS_DIR", demos)
    monkeypatch.setenv("CAPTIONER_WEIGHTS_DIR", str(folder))
    assert available_models() == {"demo-hard": "demo-hard", "a.pt": str(folder / "a.pt"),
                                  "b.pt": str(folder / "b.pt")}


def test_examples_are_captioned_before_any_upload(app):
    assert not app.error
    assert app.pills[0].value == 0  # the first example
    assert ".png" in _details(app) and _word_panels(app)


def test_an_image_over_the_pixel_limit_names_the_apps_setting_and_reads_as_one_sentence(app):
    app.file_uploader[0].set_value(("huge.png", _bomb_png(), "image/png")).run()
    assert not app.exception
    message = app.error[0].value.replace("\\", "")
    assert "96,000,000 pixels" in message and "captioner app --max-pixels" in message
    assert ".." not in message and ". ." not in message


def test_the_apps_pixel_limit_can_be_raised_above_pillows_own(weights_dir, monkeypatch):
    """Pillow's limit lowered to make the test small: an upload over twice it is still captioned
    when the app's own limit (captioner app --max-pixels) allows it."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1_000)
    monkeypatch.setenv("CAPTIONER_WEIGHTS_DIR", str(weights_dir))
    monkeypatch.setenv("CAPTIONER_APP_MAX_PIXELS", "5000")
    at = AppTest.from_file(str(APP), default_timeout=180).run()
    at.sidebar.selectbox[0].select(MODEL).run()
    at.file_uploader[0].set_value(("wide.png", _png(seed=2, size=(64, 48)), "image/png")).run()  # 3,072 pixels
    assert not at.exception and not at.error
    assert "wide.png" in _details(at) and _word_panels(at)


def test_app_command_passes_its_pixel_limit_to_the_page(monkeypatch):
    import captioner.app.cli

    calls = []
    monkeypatch.setattr(captioner.app.cli.os, "execve", lambda path, cmd, env: calls.append(env))
    monkeypatch.setattr(captioner.app.cli.subprocess, "call", lambda cmd, env: calls.append(env) or 0)
    args = build_parser().parse_args(["app", "--max-pixels", "300000000"])
    assert args.func(args) == 0
    assert calls[0]["CAPTIONER_APP_MAX_PIXELS"] == "300000000"


def test_no_model_says_how_to_get_one(tmp_path, monkeypatch):
    monkeypatch.setattr(bundled, "WEIGHTS_DIR", tmp_path / "none")
    monkeypatch.setenv("CAPTIONER_WEIGHTS_DIR", str(tmp_path / "empty"))
    at = AppTest.from_file(str(APP), default_timeout=180).run()
    assert not at.exception
    assert "No captioning model" in at.warning[0].value
    assert any("captioner train" in m.value for m in at.markdown)


def test_an_unusable_checkpoint_shows_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(bundled, "WEIGHTS_DIR", tmp_path / "none")
    (tmp_path / "broken.pt").write_bytes(b"not a checkpoint")
    monkeypatch.setenv("CAPTIONER_WEIGHTS_DIR", str(tmp_path))
    at = AppTest.from_file(str(APP), default_timeout=180).run()
    assert not at.exception
    assert len(at.error) == 1 and "broken" in at.error[0].value
    assert ".." not in at.error[0].value.replace("\\", "")  # the checkpoint's sentence, then the page's
    assert not at.file_uploader  # nothing to caption with


def test_app_command_starts_streamlit_on_the_page(monkeypatch):
    import captioner.app.cli

    calls = []
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    # os.execve would make this process the server
    monkeypatch.setattr(captioner.app.cli.os, "execve", lambda path, cmd, env: calls.append((cmd, env)))
    monkeypatch.setattr(captioner.app.cli.subprocess, "call", lambda cmd, env: calls.append((cmd, env)) or 0)
    args = build_parser().parse_args(["app", "--port", "8765", "--address", "0.0.0.0", "--workers", "3",
                                      "--batch", "2"])
    assert args.func(args) == 0
    cmd, env = calls[0]
    assert cmd[1:4] == ["-m", "streamlit", "run"] and Path(cmd[4]) == APP
    assert cmd[cmd.index("--server.port") + 1] == "8765"
    assert cmd[cmd.index("--server.address") + 1] == "0.0.0.0"
    assert cmd[cmd.index("--server.headless") + 1] == "true"
    # A server, not a development session: no file watching, no usage statistics sent out.
    assert cmd[cmd.index("--server.fileWatcherType") + 1] == "none"
    assert cmd[cmd.index("--browser.gatherUsageStats") + 1] == "false"
    assert cmd[cmd.index("--runner.postScriptGC") + 1] == "false"  # no full collection per upload
    assert env["CAPTIONER_APP_WORKERS"] == "3" and env["CAPTIONER_APP_BATCH"] == "2"
    assert env["MALLOC_ARENA_MAX"] == "2"  # memory freed by one session's thread serves the next


def test_app_command_passes_device_and_precision_to_the_server(monkeypatch):
    import captioner.app.cli

    calls = []
    monkeypatch.setattr(captioner.app.cli.os, "execve", lambda path, cmd, env: calls.append(env))
    monkeypatch.setattr(captioner.app.cli.subprocess, "call", lambda cmd, env: calls.append(env) or 0)
    args = build_parser().parse_args(["app", "--device", "cpu", "--precision", "bf16"])
    assert args.func(args) == 0
    assert calls[0]["CAPTIONER_APP_DEVICE"] == "cpu" and calls[0]["CAPTIONER_APP_PRECISION"] == "bf16"
    assert main(["app", "--device", "cuda:7"]) == 2  # no such device here: one line, before the server


def test_the_app_takes_one_worker_per_gpu_and_one_per_core_on_the_cpu(monkeypatch):
    from captioner.app import serving

    monkeypatch.setattr(serving, "usable_cores", lambda: 16)
    assert serving.default_workers("cuda") == 1 and serving.default_workers("cuda:1") == 1
    assert serving.default_workers("cpu") == 16
    monkeypatch.setenv("CAPTIONER_APP_DEVICE", "cpu")
    monkeypatch.setenv("CAPTIONER_APP_PRECISION", "bf16")
    assert serving.app_device() == "cpu" and serving.app_precision() == "bf16"


def test_app_command_refuses_a_bad_number_of_workers(capsys):
    assert main(["app", "--workers", "0"]) == 2
    assert "--workers" in capsys.readouterr().err
    assert main(["app", "--batch", "0"]) == 2
    assert "--batch" in capsys.readouterr().err


def _notices(at: AppTest) -> list[str]:
    return [w.value for w in at.main.warning if "synthetic shapes" in w.value]


def _model_card(at: AppTest) -> str:
    """The sidebar's text, with the page's markdown escapes removed."""
    return re.sub(r"\\(.)", r"\1", " ".join(m.value for m in at.sidebar.markdown))


@pytest.mark.skipif(not (bundled.DEMOS["demo-soft"].path).is_file(),
                    reason="the bundled demo model is not installed")
def test_a_demo_model_shows_a_notice_beside_the_caption_and_in_its_card(weights_dir, monkeypatch):
    monkeypatch.setenv("CAPTIONER_WEIGHTS_DIR", str(weights_dir))
    at = AppTest.from_file(str(APP), default_timeout=180).run()
    assert not at.exception
    assert at.sidebar.selectbox[0].value == "demo-soft"  # the default
    assert at.main.header[0].value  # an example was captioned
    notices = _notices(at)
    assert len(notices) == 1 and "trained on synthetic shapes only" in notices[0]
    assert "photograph" in notices[0]
    card = _model_card(at)
    assert "Trained on" in card and "synthetic shapes" in card

    at.file_uploader[0].set_value(("cat.png", _png(seed=3), "image/png")).run()  # an upload too
    assert len(_notices(at)) == 1


def test_a_user_checkpoint_shows_its_training_data_and_no_notice(app):
    app.sidebar.selectbox[0].select(COCO_MODEL).run()
    assert not app.exception and _word_panels(app)
    assert not _notices(app)
    assert "COCO 2014 Dataset" in _model_card(app) and "data/coco" not in _model_card(app)


def test_a_user_checkpoint_trained_on_shapes_shows_the_notice(app):
    app.sidebar.selectbox[0].select(SHAPES_MODEL).run()
    assert not app.exception
    assert len(_notices(app)) == 1
    assert "synthetic shapes" in _model_card(app) and "data/shapes" not in _model_card(app)


@pytest.mark.parametrize("meta, shown", [
    ({"training_data": "coco (/home/trainer/data/coco, Karpathy split dataset_coco.json)"},
     "coco (Karpathy split dataset_coco.json)"),
    ({"training_data": "Flicker8k_Dataset (/srv/flickr8k/Flicker8k_Dataset, split train)"},
     "Flicker8k_Dataset (split train)"),
    ({"data": "/home/trainer/data/coco"}, "the data in a folder named coco"),
], ids=["coco", "flickr8k", "folder-only"])
def test_the_model_card_never_shows_the_trainers_paths(weights_dir, tmp_path, monkeypatch, meta, shown):
    """Checkpoints trained before the data was named from its layout held the trainer's folders."""
    folder = tmp_path / "weights"
    folder.mkdir()
    tiny_captioner(seed=SEED).save(folder / "old.pt", meta=meta)
    monkeypatch.setattr(bundled, "WEIGHTS_DIR", tmp_path / "none")
    monkeypatch.setenv("CAPTIONER_WEIGHTS_DIR", str(folder))
    at = AppTest.from_file(str(APP), default_timeout=180).run()
    assert not at.exception
    card = _model_card(at)
    assert shown in card and "/home/" not in card and "/srv/" not in card


def test_a_model_trained_for_one_step_says_step_not_steps():
    from captioner.app.streamlit_app import model_details

    cap = tiny_captioner(seed=SEED)
    cap.meta["step"] = 1
    assert "trained 1 step" in model_details(cap) and "1 steps" not in model_details(cap)
    cap.meta["step"] = 1200
    assert "trained 1,200 steps" in model_details(cap)


def test_a_checkpoint_that_does_not_say_its_data_says_so_in_its_card(app):
    assert not _notices(app)
    assert "Trained on" in _model_card(app) and "not recorded" in _model_card(app)


class _Encodes:
    """Counts the images Pillow encodes (every PNG/JPEG the page or Streamlit writes)."""

    def __init__(self, monkeypatch):
        self.formats: list[str] = []
        save = Image.Image.save

        def counting_save(im, fp, format=None, **kw):
            self.formats.append(str(format or Path(str(fp)).suffix).upper().lstrip("."))
            return save(im, fp, format, **kw)

        monkeypatch.setattr(Image.Image, "save", counting_save)


def test_an_upload_makes_no_figure_until_it_is_downloaded(app, monkeypatch):
    data = _png(seed=12)  # an image no other test uploads: results are shared between sessions
    from captioner.app import serving

    figures = []
    draw = serving.attention_figure
    monkeypatch.setattr(serving, "attention_figure", lambda *a, **k: figures.append(1) or draw(*a, **k))
    app.file_uploader[0].set_value(("generated.png", data, "image/png")).run()
    assert not app.exception and _word_panels(app)
    assert figures == []  # not drawn yet
    png = figure_png(app.session_state["shown"], MODEL)  # what the button's callable serves on a click
    assert Image.open(io.BytesIO(png)).format == "PNG" and figures == [1]


def test_reruns_that_change_nothing_encode_no_image_again(app, monkeypatch):
    app.file_uploader[0].set_value(("generated.png", _png(seed=13), "image/png")).run()
    words = _shown_caption(app).split()
    assert len(words) >= 2
    encodes = _Encodes(monkeypatch)
    app.run()  # a rerun with nothing changed
    app.run()
    assert _shown_caption(app).split() == words and encodes.formats == []


def test_a_caption_waits_its_turn_for_the_model_and_says_so(app):
    import threading
    import time

    from captioner.app.serving import caption_gate

    gate = caption_gate()  # the one the page's sessions share
    held = threading.Semaphore(0)

    def busy(items):  # other students' captions, holding every slot for a while
        held.release()
        time.sleep(0.5)
        return items

    others = [threading.Thread(target=gate.run, args=(None, i, busy)) for i in range(gate.slots)]
    for other in others:
        other.start()
    for _ in others:
        assert held.acquire(timeout=10)
    app.file_uploader[0].set_value(("queued.png", _png(seed=14), "image/png")).run()
    for other in others:
        other.join(10)
    assert not app.exception and _word_panels(app)
    assert "waiting for the model" in _details(app)


def test_an_image_captioned_in_one_session_is_not_captioned_again_in_another(app, weights_dir, monkeypatch):
    data = _png(seed=15)
    app.file_uploader[0].set_value(("first.png", data, "image/png")).run()
    calls = []
    caption = inference.Captioner.caption_images
    monkeypatch.setattr(inference.Captioner, "caption_images",
                        lambda self, *a, **k: calls.append(1) or caption(self, *a, **k))
    other = AppTest.from_file(str(APP), default_timeout=180).run()  # a second student
    calls.clear()  # the default model's example, if no earlier page showed it
    other.sidebar.selectbox[0].select(MODEL).run()
    assert not other.exception and _word_panels(other) and calls == []  # the example: shown already by the first
    other.file_uploader[0].set_value(("same-photo.png", data, "image/png")).run()
    assert not other.exception and calls == []
    assert _shown_caption(other) == _shown_caption(app) and "same-photo.png" in _details(other)
    other.file_uploader[0].set_value(("new.png", _png(seed=16), "image/png")).run()
    assert calls == [1]


@pytest.mark.slow
def test_a_session_keeps_one_result_and_the_shared_results_are_bounded(app, monkeypatch):
    from captioner.app.serving import RESULTS_KEPT, Shown

    seeds = range(100, 100 + RESULTS_KEPT + 5)
    for seed in seeds:
        app.file_uploader[0].set_value((f"photo-{seed}.png", _png(seed=seed), "image/png")).run()
    assert not app.exception and f"photo-{seed}.png" in _details(app)
    state = app.session_state._state._state  # everything the session keeps
    kept = [k for k in state.filtered_state if isinstance(state[k], Shown)]
    assert kept == ["shown"]
    calls = []
    caption = inference.Captioner.caption_images
    monkeypatch.setattr(inference.Captioner, "caption_images",
                        lambda self, *a, **k: calls.append(1) or caption(self, *a, **k))
    app.pills[0].set_value(0).run()  # the first example: pushes out one more result
    app.file_uploader[0].set_value(("again.png", _png(seed=seeds[-1]), "image/png")).run()
    assert not app.exception and len(calls) <= 1  # the last photo: still shared (the example may be new)
    calls.clear()
    app.file_uploader[0].set_value(("again.png", _png(seed=seeds[0]), "image/png")).run()
    assert not app.exception and calls == [1]  # the first photo: no longer kept, captioned again


def test_the_collection_after_every_run_does_not_walk_the_whole_heap(tmp_path, monkeypatch):
    """Streamlit collects garbage after every script run; with torch and a model loaded a full
    collection walks a few hundred thousand objects (0.1-0.2 s of CPU per rerun). Once the
    model is loaded they are set aside, and it walks only what the runs make."""
    import gc

    monkeypatch.setattr(bundled, "WEIGHTS_DIR", tmp_path / "none")
    tiny_captioner(seed=SEED).save(tmp_path / "fresh.pt")  # a model this process has not loaded yet
    monkeypatch.setenv("CAPTIONER_WEIGHTS_DIR", str(tmp_path))
    at = AppTest.from_file(str(APP), default_timeout=180).run()
    assert not at.exception and _word_panels(at)
    at.run()
    gc.collect()
    assert len(gc.get_objects()) < 60_000


def test_an_upload_stays_until_an_example_is_picked_and_leaves_the_store_empty(app, monkeypatch):
    """Once read, the upload is the page's own (Streamlit's copy is dropped; the uploader keeps
    only its id): it stays on the page through later runs, with no example picked, until the
    user picks one."""
    from streamlit.runtime.memory_uploaded_file_manager import MemoryUploadedFileManager

    stores = []
    add = MemoryUploadedFileManager.add_file
    monkeypatch.setattr(MemoryUploadedFileManager, "add_file", lambda self, *a: stores.append(self) or add(self, *a))
    app.file_uploader[0].set_value(("mine.png", _png(seed=17), "image/png")).run()
    assert not app.exception and "mine.png" in _details(app)
    assert stores and all(not any(store.file_storage.values()) for store in stores)  # nothing left in Streamlit's
    assert app.pills[0].value is None  # no example picked
    before = _details(app)
    calls = []
    caption = inference.Captioner.caption_images
    monkeypatch.setattr(inference.Captioner, "caption_images",
                        lambda self, *a, **k: calls.append(1) or caption(self, *a, **k))
    app.run()
    assert not app.exception and _details(app) == before and calls == []
    app.pills[0].set_value(2).run()  # the user picks an example: shown
    assert not app.exception and ".png · tiny.pt" in _details(app) and "mine.png" not in _details(app)
    app.sidebar.slider[0].set_value(4).run()  # and it stays, the upload forgotten
    assert "mine.png" not in _details(app) and "beam 4" in _details(app)


def _big_view_photo(at: AppTest) -> bytes:
    """The photo the big view draws: the picture the result names, wherever the page defines it."""
    photo = re.search(r'--photo: ([^;"]+)', at.session_state["shown"].view).group(1)
    found = re.fullmatch(r"var\(--([\w-]+)\)", photo)
    if found is not None:  # the page's definition
        photo = re.search(rf'--{found.group(1)}: (url\([^)]+\))', _page_html(at)).group(1)
    return base64.b64decode(re.fullmatch(r"url\(data:image/jpeg;base64,([A-Za-z0-9+/=]+)\)", photo).group(1))


def _jpeg(seed: int, size=(96, 64), **save) -> bytes:
    buf = io.BytesIO()
    tiny_image(seed, size).save(buf, "JPEG", quality=90, **save)
    return buf.getvalue()


def test_a_web_sized_jpeg_is_shown_as_uploaded_and_captioned_as_the_cli_does(app, weights_dir, tmp_path, capsys):
    """An upright RGB JPEG of web size is its own preview and big view: nothing resized or encoded again."""
    data = _jpeg(seed=21)
    app.file_uploader[0].set_value(("photo.jpg", data, "image/jpeg")).run()
    assert not app.exception and not app.error
    assert _big_view_photo(app) == data
    cli = _cli_record(tmp_path, capsys, data, weights_dir / MODEL, beam=3)
    assert json.loads(result_json(app.session_state["shown"])) == {**cli, "image": "photo.jpg"}
    assert "(96×64)" in _page_html(app)


def test_a_truncated_or_turned_jpeg_is_not_shown_as_uploaded(app):
    app.file_uploader[0].set_value(("cut.jpg", _jpeg(seed=22)[:400], "image/jpeg")).run()
    assert not app.exception and len(app.error) == 1 and "truncated" in app.error[0].value.replace("\\", "")
    exif = Image.Exif()
    exif[0x0112] = 6  # to be shown turned 90°: the browser and Pillow may not agree, so the page turns it
    data = _jpeg(seed=23, exif=exif.tobytes())
    app.file_uploader[0].set_value(("turned.jpg", data, "image/jpeg")).run()
    assert not app.exception and not app.error and "(64×96)" in _page_html(app)
    assert Image.open(io.BytesIO(_big_view_photo(app))).size == (64, 96)


def test_a_one_head_result_has_no_head_picker():
    from captioner.app.page import Word, result_html

    html = result_html("r1", [Word("a", "n", "p")], {(0, None): "data:,x"}, "url(data:,y)", 1.0, (2, 2))
    assert 'class="heads"' not in html and html.count('class="head-group"') == 1
    assert html.count('type="radio"') == 1 and html.count("var(--l0hm)") == 2  # the big view and the panel


@pytest.mark.parametrize("store_kept", [False, True], ids=["store-emptied", "store-kept"])
def test_one_uploader_for_the_page_s_life_and_each_new_file_in_it_is_shown(app, monkeypatch, store_kept):
    """The uploader keeps its key through uploads (docs/app-serving.md: one replaced after each
    upload dropped a file landing in it as the last upload's run drew), and a file in it is
    shown once, when it is new: an example picked afterwards stays, and the same picture
    uploaded again is a new file, shown again. The same where Streamlit's copy stays (a
    release that moves its private store: forget_upload then does nothing)."""
    if store_kept:
        from captioner.app import serving

        monkeypatch.setattr(serving, "forget_upload", lambda upload: None)
    app.file_uploader[0].set_value(("first.png", _png(seed=21), "image/png")).run()
    assert not app.exception and _details(app).startswith("first.png · ")
    key = app.file_uploader[0].key
    app.file_uploader[0].set_value(("second.png", _png(seed=22), "image/png")).run()
    assert not app.exception and _details(app).startswith("second.png · ")
    assert app.file_uploader[0].key == key == "uploader"
    app.pills[0].set_value(1).run()
    assert "second.png" not in _details(app)
    app.run()  # the uploader still names the file: not shown again over the example
    assert not app.exception and "second.png" not in _details(app) and app.pills[0].value == 1
    app.file_uploader[0].set_value(("second.png", _png(seed=22), "image/png")).run()
    assert not app.exception and _details(app).startswith("second.png · ") and app.pills[0].value is None


def test_the_model_card_counts_a_chinese_vocabulary_in_characters():
    from captioner.app.streamlit_app import model_details
    from captioner.data.vocab import Vocabulary, tokenizer_named

    cap = tiny_captioner()
    assert "words" in model_details(cap) and "characters" not in model_details(cap)
    cap.vocab = Vocabulary(cap.vocab.words, tokenizer_named("chars"))
    assert f"{len(cap.vocab):,} characters" in model_details(cap)
    cap.vocab = Vocabulary(cap.vocab.words, tokenizer_named("chars2"))
    assert f"{len(cap.vocab):,} characters" in model_details(cap)


def test_the_length_slider_starts_at_each_models_own_limit_and_a_length_chosen_stays(weights_dir, monkeypatch):
    """The slider starts at the selected model's longest training caption (demo-zh's counts
    characters, 40); a user who then picks 20 for it gets 20, not the model's own limit."""
    from captioner.app import serving

    monkeypatch.setenv("CAPTIONER_WEIGHTS_DIR", str(weights_dir))
    asked = []
    real = serving.caption_image

    def spy(*args, **kwargs):
        asked.extend(a for a in (*args, *kwargs.values()) if isinstance(a, DecodeOptions))
        return real(*args, **kwargs)

    monkeypatch.setattr(serving, "caption_image", spy)
    at = AppTest.from_file(str(APP), default_timeout=180).run()
    assert not at.exception
    length = next(s for s in at.sidebar.slider if s.label.startswith("Longest caption"))
    assert at.sidebar.selectbox[0].value == "demo-soft" and length.value == 20
    assert length.label == "Longest caption (words)"
    at.sidebar.selectbox[0].select("demo-zh").run()
    length = next(s for s in at.sidebar.slider if s.label.startswith("Longest caption"))
    assert length.value == 40 and asked and asked[-1].max_len == 40
    assert length.label == "Longest caption (characters)"  # a character model counts characters
    asked.clear()
    length.set_value(20).run()
    assert not at.exception and asked and all(o.max_len == 20 for o in asked)


def test_a_port_another_server_holds_is_refused_in_one_line_that_names_port(capsys):
    """A second `captioner app` on a busy port: one line naming --port, before any server starts."""
    import socket

    from captioner.cli.common import port_taken
    from captioner.cli.main import main

    with socket.socket() as held:
        held.bind(("localhost", 0))
        held.listen()
        port = held.getsockname()[1]
        assert main(["app", "--port", str(port), "--device", "cpu"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and f"port {port} on localhost is taken" in err and "--port" in err
    assert port_taken("localhost", port) is None  # free again once the other server is gone


def test_the_character_budget_slider_captions_within_it_as_the_cli_does(app, weights_dir, tmp_path, capsys):
    data = _png(seed=6)
    app.file_uploader[0].set_value(("generated.png", data, "image/png")).run()
    assert app.session_state["shown"].key[3].max_chars is None  # 0 on the slider: no budget
    app.slider(key="max_chars").set_value(12).run()
    assert not app.exception
    assert app.session_state["shown"].key[3].max_chars == 12 and "at most 12 characters" in _details(app)
    cli = _cli_record(tmp_path, capsys, data, weights_dir / MODEL, 3, 20, "--max-chars", "12")
    assert _shown_caption(app) == cli["caption"] and 0 < len(cli["caption"]) <= 12


def test_a_budget_no_caption_fits_is_said_in_place_of_the_caption(tmp_path, monkeypatch):
    from captioner.data.vocab import Vocabulary

    cap = tiny_captioner(seed=SEED)
    cap.vocab = Vocabulary([("aa" if w == "a" else w) for w in cap.vocab.words])  # no word of one letter
    cap.save(tmp_path / "short.pt")
    monkeypatch.setenv("CAPTIONER_WEIGHTS_DIR", str(tmp_path))
    at = AppTest.from_file(str(APP), default_timeout=180).run()
    at.sidebar.selectbox[0].select("short.pt").run()
    at.file_uploader[0].set_value(("generated.png", _png(seed=6), "image/png")).run()
    at.slider(key="max_chars").set_value(1).run()
    assert not at.exception
    [warning] = [re.sub(r"\\(.)", r"\1", w.value) for w in at.warning if "no caption fits" in w.value]
    assert warning.startswith("generated.png: no caption fits in 1 character "
                              "(the shortest found without a budget is ")
    assert not at.main.header  # no caption shown


@pytest.mark.parametrize("kind", ["gradcam", "gradinput"])
def test_the_maps_toggle_shows_what_made_it_say_each_word_with_the_same_picker(app, weights_dir, kind):
    """The toggle above the result: the same caption, word picker, big view and grid, each word's
    layer now its gradient map (captioner.explain) rather than its attention; the figure and the
    JSON carry those maps too."""
    from captioner.app.pictures import map_layers

    data = _png(seed=3, size=(96, 64))
    app.file_uploader[0].set_value(("generated.png", data, "image/png")).run()
    looked = app.session_state["shown"]
    assert app.radio(key="maps").value == "attention" and looked.explain is None
    app.radio(key="maps").set_value(kind).run()
    assert not app.exception
    said = app.session_state["shown"]
    assert said.explain == kind and said.result.words == looked.result.words  # the same caption
    want = inference.Captioner.load(weights_dir / MODEL).caption(data, DecodeOptions(num_captions=3), explain=kind)
    assert torch.allclose(said.result.gradients[kind], want.gradients[kind], atol=1e-5)
    size = _data_images(said.view)[0].size
    drawn = map_layers(replace(said.result, alphas=said.result.gradients[kind], alphas_heads=None), size)
    assert [uri for _, uri in sorted(drawn.items())] == re.findall(r"--l\d+hm: url\(([^)]+)\)", said.view)
    assert re.findall(r"--l\d+hm: url\(([^)]+)\)", said.view) != re.findall(r"--l\d+hm: url\(([^)]+)\)", looked.view)
    assert "<h3>Every word, what made the model say it</h3>" in said.view
    assert "<h3>Every word, where the model looked</h3>" in looked.view and "<h3>Every word, where" not in said.view
    assert len(re.findall(r'<div class="word">', said.view)) == len(said.result.words)  # one picker entry a word
    assert kind in json.loads(result_json(said))
    assert Image.open(io.BytesIO(figure_png(said, MODEL))).text["Model"].endswith(f"{kind} maps: what made it say "
                                                                                  "each word")
    app.radio(key="maps").set_value("attention").run()
    assert app.session_state["shown"].view == looked.view  # back to where it looked
