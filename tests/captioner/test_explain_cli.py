"""`captioner caption --explain`: the gradient maps in each line beside "alphas", their figure
drawn as the attention figure is (on the part of the image the model saw), and resume."""

import json
from dataclasses import replace

import numpy as np
import pytest
from PIL import Image

from captioner.cli.main import main
from captioner.inference import Captioner, DecodeOptions
from captioner.overlay import attention_figure
from tests.tiny import tiny_captioner, tiny_image


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    path = tmp_path_factory.mktemp("w") / "tiny.pt"
    tiny_captioner(seed=5).save(path)  # a seed whose captions have words
    return str(path)


def _images(tmp_path, n):
    paths = []
    for i in range(n):
        p = tmp_path / f"img{i}.png"
        tiny_image(i).resize((48, 32)).save(p)  # wider than tall: the model sees its centre crop
        paths.append(str(p))
    return paths


def _lines(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("kind", ["gradcam", "gradinput"])
def test_explain_writes_the_maps_and_their_figure(tmp_path, weights, kind):
    paths = _images(tmp_path, 2)
    out = tmp_path / "out.jsonl"
    assert main(["caption", *paths, "--weights", weights, "--explain", kind, "--max-len", "5", "--quiet",
                 "--out", str(out), "--attention-dir", str(tmp_path / "fig")]) == 0
    cap = Captioner.load(weights)
    for rec, path in zip(_lines(out), paths):
        r = cap.caption(path, DecodeOptions(max_len=5), explain=kind)
        assert rec["words"] == r.words and len(r.words) > 0
        np.testing.assert_allclose(np.array(rec[kind]), r.gradients[kind].numpy(), atol=1e-4)
        assert "alphas" not in rec  # the attention only when asked for
        # the figure: the attention figure's layout with the gradient maps in place of the
        # attention, on the centre crop the model saw
        seen = cap.preprocess.seen(Image.open(path).convert("RGB"))
        title = f"{cap.name}, {kind} maps: what made it say each word"
        want = attention_figure(seen, replace(r, alphas=r.gradients[kind], alphas_heads=None), model=title,
                                notice=cap.notice())
        got = Image.open(rec[f"{kind}_png"])
        assert rec[f"{kind}_png"].endswith(f"-{kind}.png") and rec[f"{kind}_png"] != rec["attention_png"]
        diff = np.abs(np.asarray(got.convert("RGB"), dtype=int) - np.asarray(want.convert("RGB"), dtype=int))
        assert diff.max() <= 2, diff.max()  # a level or two: the batch's maps and these agree to float rounding
        attention = np.asarray(Image.open(rec["attention_png"]).convert("RGB"))
        assert attention.shape == np.asarray(got.convert("RGB")).shape and not np.array_equal(attention, got)


def test_a_run_without_the_maps_is_redone_for_them(tmp_path, weights, capsys):
    paths = _images(tmp_path, 2)
    out = tmp_path / "out.jsonl"
    assert main(["caption", *paths, "--weights", weights, "--out", str(out), "--quiet"]) == 0
    plain = _lines(out)
    assert all("gradcam" not in rec for rec in plain)
    assert main(["caption", *paths, "--weights", weights, "--explain", "gradcam", "--out", str(out)]) == 0
    lines = _lines(out)
    assert len(lines) == 2 and all("gradcam" in rec for rec in lines)
    assert [r["caption"] for r in lines] == [r["caption"] for r in plain]  # the maps change no caption
    assert "2 again for their attention" in capsys.readouterr().err
    # asked for again: nothing to do
    assert main(["caption", *paths, "--weights", weights, "--explain", "gradcam", "--out", str(out)]) == 0
    assert "already done 2" in capsys.readouterr().err


def test_an_unknown_kind_is_a_usage_error(tmp_path, weights, capsys):
    paths = _images(tmp_path, 1)
    with pytest.raises(SystemExit) as e:
        main(["caption", *paths, "--weights", weights, "--explain", "saliency"])
    assert e.value.code == 2 and "gradcam" in capsys.readouterr().err
