"""bench_precision's variants: the names it accepts, and channels-last changing the encoder's
memory layout but not what it computes."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_precision
from captioner.search.options import DecodeOptions


def test_a_variant_is_a_precision_then_compile_and_channels_last_in_any_order():
    assert bench_precision.parse_variant("fp32") == ("fp32", False, False)
    assert bench_precision.parse_variant(" bf16+cl ") == ("bf16", False, True)
    assert bench_precision.parse_variant("bf16+cl+compile") == ("bf16", True, True)
    assert bench_precision.parse_variant("fp16+compile+cl") == ("fp16", True, True)
    assert bench_precision.parse_variant("fp32+static") == ("fp32", "static", False)
    assert bench_precision.parse_variant("bf16+compile+static+cl") == ("bf16", "static", True)
    assert bench_precision.parse_variant("bf16+cl+graphs") == ("bf16", False, True)
    for bad in ("fp64", "bf16+fast", "cl+bf16", "", "fp16+graphs", "fp32+graphs+compile", "bf16+static+graphs"):
        with pytest.raises(ValueError, match="variant"):
            bench_precision.parse_variant(bad)


@pytest.mark.slow
def test_channels_last_gives_the_encoders_output_within_float_tolerance():
    cap = bench_precision.build(torch.device("cpu"), compile_step=False)
    model = cap.model.eval()
    torch.manual_seed(1)
    images = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        before = model.encode(images).vectors
        nhwc = bench_precision.use_channels_last(model, images)
        after = model.encode(nhwc).vectors
    assert nhwc.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous(
        memory_format=torch.channels_last)
    conv = next(m for m in model.encoder.modules() if isinstance(m, torch.nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert after.shape == before.shape == (2, 49, 2048)
    scale = before.abs().max()
    assert torch.allclose(after, before, rtol=1e-4, atol=1e-4 * scale), (after - before).abs().max() / scale


@pytest.mark.slow
def test_a_static_compile_reaches_torch_compile_and_captions_as_the_plain_step(monkeypatch):
    """"+static" compiles the decoder step for fixed shapes (dynamic=False, captioner's own
    compile is dynamic in the batch): the option must reach torch.compile, and the step must
    still compute what the plain one does."""
    from captioner.search.decoding import greedy
    from tests.tiny import tiny_captioner

    seen = []
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or real(fn, **kw))
    plain, static = tiny_captioner(seed=2), tiny_captioner(seed=2)
    static.compile(backend="eager", dynamic=False)
    tiny_captioner(seed=2).compile(backend="eager")
    assert [kw["dynamic"] for kw in seen] == [False, False, True, True]
    images = torch.randn(2, 3, *plain.preprocess.size)
    with torch.no_grad():
        runs = [greedy(c.model.decoder, c.model.encode(images), c.tokens, DecodeOptions(max_len=6))
                for c in (plain, static)]
    assert [d.ids for d in runs[0]] == [d.ids for d in runs[1]]
