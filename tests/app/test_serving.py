"""The app's shared machinery: uploads captioned together through the gate, the results cache, overlays
drawn in one go. (The gate itself, captioner/batching.py, is tested in tests/captioner/test_batching.py.)"""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from captioner.overlay import overlays, upsample_alpha
from tests.builders import hold_gate
from tests.tiny import tiny_image


def _one_overlay(image: Image.Image, alpha: torch.Tensor) -> np.ndarray:
    """The overlay of one map, computed on its own with the formula of the paper's figures."""
    rgb = np.asarray(image, dtype=np.float32) / 255.0
    m = upsample_alpha(alpha, image.size)  # (h, w)
    m = ((m - m.min()) / (m.max() - m.min()))[..., None]
    out = rgb * (0.2 + 0.8 * m) * (1 - 0.35 * m) + np.array([1.0, 0.55, 0.1]) * 0.35 * m
    return np.clip(out * 255.0 + 0.5, 0, 255).astype(np.uint8)


def test_overlays_in_one_go_equal_one_at_a_time():
    image = tiny_image(3, (90, 60))
    alphas = torch.softmax(torch.randn(5, 7, 7, generator=torch.Generator().manual_seed(0)).flatten(1), 1)
    alphas = alphas.view(5, 7, 7)
    together = overlays(image, alphas)
    assert len(together) == 5
    for a, im in zip(alphas, together):
        assert im.size == image.size
        diff = np.abs(np.asarray(im, dtype=int) - _one_overlay(image, a).astype(int))
        assert diff.max() <= 3  # 8-bit masks and products: within 3 levels of 255


def test_captions_made_together_are_each_image_s_own():
    """Four uploads queued behind a busy model are captioned in one batch, each as it is alone."""
    import io

    from captioner.app.serving import caption_image
    from captioner.batching import Gate
    from captioner.inference import DecodeOptions
    from tests.tiny import tiny_captioner

    cap = tiny_captioner(3)
    options = DecodeOptions(beam_size=3, max_len=8)
    uploads = []
    for seed in range(4):
        buf = io.BytesIO()
        tiny_image(20 + seed, (64, 48)).save(buf, "PNG")
        uploads.append(buf.getvalue())
    alone = [cap.caption(cap.preprocess.load(data), options) for data in uploads]
    gate, shown, queued = Gate(slots=1, batch=4), {}, threading.Semaphore(0)
    sizes = []
    original = cap.caption_images
    cap.caption_images = lambda images, opt, **kw: sizes.append(len(images)) or original(images, opt, **kw)

    def upload(i):
        shown[i] = caption_image(cap, gate, ("k", i), f"{i}.png", uploads[i], options,
                                 on_wait=lambda ahead: queued.release())

    release = hold_gate(gate)
    threads = []
    for i in range(4):
        threads.append(threading.Thread(target=upload, args=(i,)))
        threads[-1].start()
        assert queued.acquire(timeout=10)  # in line before the next one comes
    release.set()
    for t in threads:
        t.join(30)
    assert sizes == [4]  # one batch
    for i, own in enumerate(alone):
        r = shown[i].result
        assert r.words == own.words and r.score == pytest.approx(own.score, abs=1e-5)
        assert torch.allclose(r.alphas, own.alphas, atol=1e-5) and torch.allclose(r.betas, own.betas, atol=1e-5)
        assert shown[i].view and shown[i].cpu > 0


def test_the_results_cache_keeps_the_most_recently_used():
    from captioner.app.serving import ResultCache

    cache = ResultCache(max_entries=3)
    for k in "abcd":
        cache.put(k, k.upper())
    assert cache.get("a") is None
    assert cache.get("b") == "B"  # now the freshest
    cache.put("e", "E")
    assert cache.get("c") is None
    assert [cache.get(k) for k in "dbe"] == ["D", "B", "E"]  # three kept


def test_decode_options_are_their_own_cache_key():
    """Equal settings are one key for the results cache and the gate's batches: frozen, hashable."""
    from dataclasses import FrozenInstanceError

    from captioner.inference import DecodeOptions

    a, b = DecodeOptions(beam_size=3, max_len=8), DecodeOptions(beam_size=3, max_len=8)
    assert a == b and hash(a) == hash(b) and {("photo", a): 1}[("photo", b)] == 1
    assert a != DecodeOptions(beam_size=3, max_len=8, hard_attention="argmax")
    with pytest.raises(FrozenInstanceError):
        a.beam_size = 5


@pytest.mark.parametrize("size, grid", [((560, 420), (14, 14)), ((240, 180), (7, 7)), ((300, 500), (8, 6))])
def test_upsampling_by_axis_matrices_equals_blurring_every_pixel(size, grid):
    from captioner.overlay import _gaussian_blur

    alpha = torch.softmax(torch.randn(grid[0] * grid[1], generator=torch.Generator().manual_seed(1)), 0)
    alpha = alpha.view(*grid)
    w, h = size
    full = torch.nn.functional.interpolate(alpha[None, None], size=(h, w), mode="bilinear", align_corners=False)
    sigma = max(h / grid[0], w / grid[1]) / 3.0
    exact = _gaussian_blur(full, sigma)[0, 0].numpy()  # every pixel blurred: the definition
    fast = upsample_alpha(alpha, size)
    assert fast.shape == (h, w)
    assert np.abs(fast - exact).max() <= 1e-4 * exact.max()


@pytest.mark.parametrize("size, grid", [((96, 64), (7, 7)), ((560, 420), (14, 14)), ((300, 500), (8, 6))])
def test_a_layer_laid_over_the_photo_gives_the_overlay(size, grid):
    """The page lays each word's RGBA layer over the one photo and lets the browser blend it
    (out = photo (1 - a) + colour a): that must be the overlay the figure and the CLI draw."""
    import io

    from captioner.app.pictures import attention_layers, layer_size, png

    alphas = torch.softmax(torch.randn(3, grid[0] * grid[1], generator=torch.Generator().manual_seed(2)), 1)
    alphas = alphas.view(3, *grid)
    levels = attention_layers(alphas, size)  # (T, h, w)
    lw, lh = layer_size(grid, size)
    assert levels.shape == (3, lh, lw) and levels.dtype == np.uint8
    layers = [np.asarray(Image.open(io.BytesIO(png(x))).convert("RGBA")) for x in levels]  # as the browser reads them
    assert abs(lw / lh - size[0] / size[1]) < 0.05 and lw <= size[0]  # the photo's shape, no bigger
    photo = tiny_image(4, (lw, lh))  # the photo as the browser scales it under the layer
    rgb = np.asarray(photo, dtype=np.float32)
    for layer, drawn in zip(layers, overlays(photo, alphas)):
        a = layer[..., 3:].astype(np.float32) / 255.0
        blended = rgb * (1 - a) + layer[..., :3].astype(np.float32) * a
        assert np.abs(blended - np.asarray(drawn, dtype=np.float32)).max() <= 4  # 8-bit rounding of both
    assert not np.array_equal(layers[0], layers[1])


def test_the_page_s_layer_and_the_library_s_overlay_shade_each_pixel_alike():
    """Pixel by pixel, at every 8-bit level of a map: the photo under the app's layer (its palette
    entry for the level, blended as the browser does) is the library's overlay of that pixel."""
    from captioner.app.pictures import PALETTE
    from captioner.overlay import shaded

    levels = np.tile(np.arange(256, dtype=np.uint8), (4, 1))  # (4, 256): every level, on 4 rows
    photo = tiny_image(8, (256, 4))
    drawn = np.asarray(shaded(photo, torch.from_numpy(levels / 255.0).float()[None])[0], dtype=np.float32)
    rgba = np.frombuffer(PALETTE, dtype=np.uint8).reshape(256, 4)[levels].astype(np.float32)  # (4, 256, 4)
    a = rgba[..., 3:] / 255.0
    blended = np.asarray(photo, dtype=np.float32) * (1 - a) + rgba[..., :3] * a
    assert np.abs(blended - drawn).max() <= 3  # 8-bit rounding of both
    assert np.abs(drawn[:, -1] - drawn[:, 0]).max() > 100  # the levels do shade differently


def test_the_pictures_of_a_result_are_small():
    """A result travels inside the page: one photo and one small layer per word."""
    from captioner.app.pictures import attention_layers, png

    alphas = torch.softmax(torch.randn(20, 196, generator=torch.Generator().manual_seed(3)), 1).view(20, 14, 14)
    layers = attention_layers(alphas, (560, 420))
    assert max(layers.shape[1:3]) <= 14 * 8
    assert sum(len(png(layer)) for layer in layers) < 20 * 6_000


def test_a_multi_head_model_s_result_carries_each_head_s_maps_for_the_head_picker():
    """caption_image with a two-head model: a layer per word for the mean and for each head,
    each head's layer drawn from that head's own maps, and the picker offers the heads."""
    import io

    from captioner.app.pictures import attention_layers, data_uri, png
    from captioner.app.serving import caption_image
    from captioner.batching import Gate
    from captioner.inference import DecodeOptions
    from tests.tiny import tiny_captioner

    cap = tiny_captioner(3, heads=2)
    buf = io.BytesIO()
    tiny_image(5, (64, 48)).save(buf, "PNG")
    shown = caption_image(cap, Gate(slots=1), ("k",), "x.png", buf.getvalue(), DecodeOptions(beam_size=2, max_len=6))
    r = shown.result
    assert r.words and r.alphas_heads is not None and r.alphas_heads.shape[1] == 2
    size = Image.open(io.BytesIO(shown.seen)).size
    for j in (0, 1):
        levels = attention_layers(r.alphas_heads[:, j], size)
        for t in range(len(r.words)):
            assert f"--l{t}h{j}: url({data_uri(png(levels[t]), 'image/png')})" in shown.view  # head j's own map
    assert not torch.allclose(r.alphas_heads[:, 0], r.alphas_heads[:, 1])  # two different maps to show
    assert shown.view.count('class="head-group"') == 3  # mean, 1, 2
    assert re.findall(r'<div class="heads"><span>Head</span>(?:<label[^>]*>(\w+)</label>)', shown.view)[0] == "mean"
    # Made without the page's preview: the result defines its photo itself, once.
    assert shown.view.count(f"--photo: url({data_uri(shown.seen, 'image/jpeg')})") == 1
    assert "var(--img-" not in shown.view


@pytest.mark.parametrize("size, kind, as_is, decodes", [((64, 48), "PNG", False, 1), ((900, 700), "PNG", False, 1),
                                                    ((320, 240), "JPEG", True, 1), ((2400, 1800), "JPEG", False, 2)])
def test_an_upload_is_decoded_once_for_its_preview_its_caption_and_its_views(monkeypatch, size, kind, as_is, decodes):
    """Picture.decode decodes the upload as `captioner caption` does for this model; the caption
    and the views are drawn from that image, and nothing decodes the bytes again, but for a big
    JPEG that the model decodes at a scale too small for the page's views (2400 px at 1/8: 300 px,
    the views 560): the page decodes its own copy, once."""
    import io

    from captioner.app.pictures import LARGE_WIDTH, Picture
    from captioner.app.serving import caption_image
    from captioner.batching import Gate
    from captioner.data import images
    from captioner.inference import DecodeOptions
    from tests.tiny import tiny_captioner

    cap = tiny_captioner(3)
    buf = io.BytesIO()
    tiny_image(5, size).save(buf, kind)
    data = buf.getvalue()
    calls = []
    real = images._decode
    monkeypatch.setattr(images, "_decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    picture, decoded = Picture.decode("d", data, cap.preprocess, 10 ** 8)
    assert picture.as_is == as_is and (decoded.preview is None) == as_is
    assert (decoded.view is decoded.image) == (decodes == 1)
    if not as_is or cap.preprocess.resize:  # the views draw on it (not on the upload shown whole)
        assert decoded.view.width >= min(LARGE_WIDTH, size[0])  # they have the pixels they show
    options = DecodeOptions(beam_size=2, max_len=6, allow_unk=True)
    shown = caption_image(cap, Gate(slots=1), ("k",), "x", data, options, picture, decoded)
    assert len(calls) == decodes
    monkeypatch.undo()
    assert shown.result.words == cap.caption(data, options).words  # the command's own caption
