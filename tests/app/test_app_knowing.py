"""The page says what the model does not know: an image unlike its training images, each
word's probability (a shade and a tooltip), and the beam's other captions."""

from __future__ import annotations

import html
import io
import json
import re
from pathlib import Path

import pytest

from captioner.cli.main import main
from captioner.io import bundled
from tests.tiny import tiny_captioner, tiny_image

AppTest = pytest.importorskip("streamlit.testing.v1").AppTest

APP = Path(__file__).resolve().parents[2] / "app" / "streamlit_app.py"
PHOTO = Path(__file__).parents[1] / "fixtures" / "photos" / "coco" / "train2014" / "COCO_train2014_000000000009.jpg"
DEMO = bundled.DEMOS["demo-soft"].path
MODEL = "tiny.pt"


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("weights")
    tiny_captioner(seed=6).save(folder / MODEL)  # a model whose beam finishes 3 captions of these images
    return folder


def _start(weights_dir: Path, monkeypatch, model: str | None = None) -> AppTest:
    monkeypatch.setenv("CAPTIONER_WEIGHTS_DIR", str(weights_dir))
    at = AppTest.from_file(str(APP), default_timeout=180).run()
    assert not at.exception
    if model is not None:
        at.sidebar.selectbox[0].select(model).run()
    return at


def _unlike(at: AppTest) -> list[str]:
    return [w.value for w in at.main.warning if "unlike" in w.value]


def _cli(tmp_path: Path, capsys, data: bytes, weights: str, *extra: str) -> dict:
    path = tmp_path / "image.png"
    path.write_bytes(data)
    capsys.readouterr()
    assert main(["caption", str(path), "--weights", weights, "--quiet", *extra]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.skipif(not DEMO.is_file(), reason="the bundled demo model is not installed")
def test_a_photograph_is_flagged_beside_the_notice_and_a_shapes_example_is_not(weights_dir, monkeypatch):
    at = _start(weights_dir, monkeypatch)  # demo-soft, the first example (shapes)
    assert at.main.header[0].value and not _unlike(at)
    at.file_uploader[0].set_value(("photo.jpg", PHOTO.read_bytes(), "image/jpeg")).run()
    assert not at.exception
    flagged = _unlike(at)
    assert len(flagged) == 1 and "familiarity 0.00" in flagged[0]
    assert any("synthetic shapes" in w.value for w in at.main.warning)  # the fixed notice stays


def test_each_word_shows_its_probability_and_the_beams_captions_are_listed(weights_dir, monkeypatch, tmp_path,
                                                                          capsys):
    at = _start(weights_dir, monkeypatch, MODEL)
    at.sidebar.slider[0].set_value(4).run()  # beam size
    at.sidebar.slider[2].set_value(3).run()  # captions to list
    data = io.BytesIO()
    tiny_image(2, (64, 48)).save(data, "PNG")
    at.file_uploader[0].set_value(("noise.png", data.getvalue(), "image/png")).run()
    assert not at.exception
    line = _cli(tmp_path, capsys, data.getvalue(), str(weights_dir / MODEL), "--beam-size", "4", "--num-captions",
                "3")
    page = "".join(h.value for h in at.html)
    shaded = re.findall(r'<span class="word-prob" style="--p: ([0-9.]+)" title="([^"]*)">([^<]*)</span>', page)
    assert [html.unescape(w) for _, _, w in shaded] == line["words"]
    assert [float(p) for p, _, _ in shaded] == pytest.approx(line["word_probs"], abs=0.006)
    assert [title for _, title, _ in shaded] == [f"p = {p:.4g} given the words before it" for p in line["word_probs"]]
    assert len(line["alternatives"]) == 3
    listed = [m.value for m in at.main.markdown if "log p" in m.value]
    assert len(listed) == 1
    for alt in line["alternatives"]:
        assert f"{alt['score']:.2f}" in listed[0]
    assert len(re.findall(r"^\d+\. ", listed[0], re.M)) == len(line["alternatives"])
    # Familiarity unknown for a checkpoint without a record: said so, nothing flagged.
    assert not _unlike(at) and "familiarity unknown" in next(c.value for c in at.caption if " · beam " in c.value)


def test_the_shaded_words_look_like_text_not_chips_that_would_be_clicked():
    """The caption's words are shaded by doubt, and clicking them does nothing: so they are marked
    as highlighted text (no padding, no rounded box, no pointer), not as pills like the word picker's."""
    css = (Path(__file__).resolve().parents[2] / "app" / "page.css").read_text()
    rule = re.search(r"\.captioner-probs \.word-prob \{([^}]*)\}", css).group(1)
    assert "padding" not in rule and "border-radius" not in rule and "pointer" not in rule
    assert "var(--p)" in rule  # still shaded by the word's probability
