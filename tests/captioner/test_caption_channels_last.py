"""Captioning in channels-last memory (Captioner.encode, kernels.channels_last_ok): on CUDA in
bf16 or fp16 the encoder's weights and the images are put in NHWC, the layout cuDNN computes
in there, and back when the precision goes back to fp32. Run on a CPU, whose convolutions take
either layout, with the rule stood in for."""

from __future__ import annotations

import torch

from captioner.inference import DecodeOptions
from captioner.model import kernels
from tests.tiny import tiny_captioner, tiny_image

OPTIONS = DecodeOptions(beam_size=2, max_len=6)


def _images(cap, n=4):
    return torch.stack([cap.preprocess(tiny_image(seed=i)) for i in range(n)])


def _convs(cap):
    return [p for p in cap.model.encoder.parameters() if p.dim() == 4 and p.shape[-1] > 1]


def test_bf16_captioning_takes_channels_last_and_fp32_puts_it_back(monkeypatch):
    cap = tiny_captioner(seed=3).use_precision("bf16")
    images = _images(cap)
    plain = cap.caption_batch(images, OPTIONS)
    assert all(p.is_contiguous() for p in _convs(cap))  # a CPU: the rule says no
    monkeypatch.setattr(kernels, "channels_last_ok", lambda device, dtype: dtype is not None)
    seen = []
    hook = cap.model.encoder.register_forward_pre_hook(
        lambda module, args: seen.append(args[0].is_contiguous(memory_format=torch.channels_last)
                                         and not args[0].is_contiguous()))
    nhwc = cap.caption_batch(images, OPTIONS)
    assert seen == [True]
    assert _convs(cap) and all(p.is_contiguous(memory_format=torch.channels_last) and not p.is_contiguous()
                               for p in _convs(cap))
    assert [r.words for r in nhwc] == [r.words for r in plain]
    for a, b in zip(nhwc, plain):
        assert abs(a.score - b.score) < 1e-2  # bf16: the same values, summed in another order
    cap.use_precision("fp32")
    cap.caption_batch(images, OPTIONS)
    hook.remove()
    assert seen == [True, False] and all(p.is_contiguous() for p in _convs(cap))


def test_weights_put_in_channels_last_inside_inference_mode_stay_weights_training_can_write(monkeypatch):
    cap = tiny_captioner(seed=4).use_precision("bf16")
    monkeypatch.setattr(kernels, "channels_last_ok", lambda device, dtype: dtype is not None)
    with torch.inference_mode():
        cap.caption_batch(_images(cap, 2), OPTIONS)
    assert _convs(cap) and not any(p.is_inference() for p in cap.model.parameters())
    with torch.no_grad():
        for p in _convs(cap):
            p.mul_(1.0)  # an optimiser's in-place update
