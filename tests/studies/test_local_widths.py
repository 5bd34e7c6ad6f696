"""studies.attention.widths: the half-widths a learned local window predicts."""

import pytest
import torch

from captioner.inference import DecodeOptions
from studies.attention import cli
from studies.attention import widths as local_widths
from tests.tiny import tiny_captioner, tiny_image


def test_a_learned_window_starts_at_the_fixed_half_width_and_follows_its_bias():
    cap = tiny_captioner(local_window=1.5, local_width="learned")
    images = [tiny_image(s) for s in range(3)]
    w = local_widths.half_widths(cap, images, batch_size=2)
    words = sum(len(r.words) for r in cap.caption_images(images, DecodeOptions(beam_size=1)))
    assert words >= 3 and w.half_widths.numel() == words  # one per word: no <end> step, nothing after it
    assert torch.allclose(w.half_widths, torch.full_like(w.half_widths, 1.5), atol=1e-5)
    assert w.start == 1.5 and w.grid == tuple(cap.caption(images[0]).alphas.shape[-2:])
    (window,) = local_widths.learned_windows(cap)
    with torch.no_grad():
        window.centre[2].bias[2] += 3.0  # a larger softplus input: a wider window for every word
    wider = local_widths.half_widths(cap, images)
    assert wider.half_widths.min() > 1.5 + 2.0
    assert window.centre._forward_hooks == {}  # the hooks are removed


def test_a_model_without_a_learned_window_is_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="no learned local window"):
        local_widths.half_widths(tiny_captioner(local_window=1.5), [tiny_image(0)])
    weights = tmp_path / "fixed.pt"
    tiny_captioner(local_window=1.5).save(weights)
    folder = tmp_path / "images"
    folder.mkdir()
    tiny_image(0).save(folder / "a.png")
    assert cli.main(["widths", str(weights), str(folder)]) == 2
    assert "no learned local window" in capsys.readouterr().err


def test_every_head_of_a_multi_head_model_gives_one_half_width_per_word():
    cap = tiny_captioner(heads=2, local_window=1.5, local_width="learned")
    images = [tiny_image(s) for s in range(3)]
    words = sum(len(r.words) for r in cap.caption_images(images, DecodeOptions(beam_size=1)))
    heads = local_widths.learned_windows(cap)
    assert len(heads) == 2
    with torch.no_grad():
        heads[1].centre[2].bias[2] += 3.0  # the second head wider than the first
    w = local_widths.half_widths(cap, images)
    assert w.half_widths.numel() == 2 * words
    assert (w.half_widths < 2.0).sum() == words and (w.half_widths > 3.5).sum() == words
