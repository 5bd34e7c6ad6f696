"""Each head's maps from the library and `captioner caption --attention-heads`."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from captioner.cli.main import main
from captioner.inference import Captioner, DecodeOptions
from captioner.overlay import attention_figure, overlays
from tests.tiny import tiny_captioner, tiny_image


@pytest.fixture(scope="module")
def two_heads(tmp_path_factory):
    path = tmp_path_factory.mktemp("w") / "two-heads.pt"
    tiny_captioner(seed=2, heads=2).save(path)  # a seed whose captions have words
    return str(path)


def _images(tmp_path, n):
    paths = []
    for i in range(n):
        p = tmp_path / f"img{i}.png"
        tiny_image(i).save(p)
        paths.append(str(p))
    return paths


def _lines(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_attention_heads_writes_each_heads_maps_and_overlays(tmp_path, two_heads):
    paths = _images(tmp_path, 3)
    out = tmp_path / "out.jsonl"
    code = main(["caption", *paths, "--weights", two_heads, "--attention-heads", "--max-len", "5", "--quiet",
                 "--out", str(out), "--attention-dir", str(tmp_path / "att")])
    assert code == 0
    cap = Captioner.load(two_heads)
    for rec, path in zip(_lines(out), paths):
        heads = np.array(rec["alphas_heads"])
        t = len(rec["words"])
        assert t > 0
        assert heads.shape == (t, 2, 2, 2)  # words x heads x 2x2 grid (32 px images)
        np.testing.assert_allclose(heads.sum((2, 3)), 1.0, atol=1e-3)
        np.testing.assert_allclose(heads.mean(1), np.array(rec["alphas"]), atol=1e-3)  # "alphas": their mean
        assert len(rec["betas"]) == t
        # The figure: a row per word, its mean map then one overlay per head.
        r = cap.caption(Image.open(path), DecodeOptions(max_len=5))
        seen = cap.preprocess.seen(Image.open(path).convert("RGB"))
        png = Image.open(rec["attention_png"])
        assert png.size == attention_figure(seen, r, heads=True, model=cap.name).size  # titled
        assert png.size != attention_figure(seen, r, model=cap.name).size


def test_a_run_without_head_maps_is_redone_for_them(tmp_path, two_heads, capsys):
    paths = _images(tmp_path, 2)
    out = tmp_path / "out.jsonl"
    assert main(["caption", *paths, "--weights", two_heads, "--with-attention", "--out", str(out), "--quiet"]) == 0
    assert all("alphas_heads" not in rec for rec in _lines(out))
    assert main(["caption", *paths, "--weights", two_heads, "--attention-heads", "--out", str(out)]) == 0
    lines = _lines(out)
    assert len(lines) == 2 and all("alphas_heads" in rec for rec in lines)
    assert "2 again for their attention" in capsys.readouterr().err


def test_a_single_head_model_has_one_map_per_word_as_its_head(tmp_path, capsys):
    weights = tmp_path / "one.pt"
    tiny_captioner(seed=2).save(weights)
    paths = _images(tmp_path, 1)
    assert main(["caption", *paths, "--weights", str(weights), "--attention-heads", "--max-len", "4"]) == 0
    rec = json.loads(capsys.readouterr().out.splitlines()[0])
    heads = np.array(rec["alphas_heads"])
    assert heads.shape[1] == 1
    np.testing.assert_allclose(heads[:, 0], np.array(rec["alphas"]))


def test_the_head_panels_show_each_heads_map():
    cap = tiny_captioner(seed=2, heads=2)
    image = tiny_image(0, size=(64, 48))
    r = cap.caption(image, DecodeOptions(max_len=4))
    assert r.words
    # Make the heads look at opposite corners, so that their panels cannot be confused.
    t = len(r.words)
    maps = torch.zeros(t, 2, *r.alphas.shape[1:])
    maps[:, 0, 0, 0] = 1.0
    maps[:, 1, -1, -1] = 1.0
    r.alphas_heads = maps
    fig = np.asarray(attention_figure(image, r, panel=64, heads=True))
    pw, ph = 64, 48
    lit = overlays(image.resize((pw, ph), Image.Resampling.BICUBIC), maps.reshape(-1, *maps.shape[2:]))
    pad = 6
    row_h = (fig.shape[0] - pad) // (1 + t)  # the image's row, then one per word
    for w in range(t):
        for j in range(2):
            x, y = pad + (1 + j) * (pw + pad), pad + (1 + w) * row_h
            np.testing.assert_array_equal(fig[y:y + ph, x:x + pw], np.asarray(lit[w * 2 + j]))
    assert fig.shape[1] == 3 * (pw + pad) + pad  # mean, head 1, head 2
