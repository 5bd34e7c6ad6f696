"""torchvision encoders: the paper's VGG-19 cut, and pretrained weights read from the hub cache only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from captioner.model.encoders import create_encoder
from tests.pretrained import fake_torch_home


@pytest.mark.slow  # VGG's 143M weights: seconds to initialise
def test_vgg19_is_conv5_4_after_relu_before_the_last_pool() -> None:
    torch.manual_seed(0)
    enc = create_encoder("vgg19")
    convs = [m for m in enc.trunk if isinstance(m, nn.Conv2d)]
    assert len(convs) == 16  # VGG-19: 16 conv layers, the last is conv5_4
    assert isinstance(enc.trunk[-1], nn.ReLU)
    assert sum(isinstance(m, nn.MaxPool2d) for m in enc.trunk) == 4  # the fifth pool is cut off
    with torch.no_grad():
        ann = enc(torch.randn(1, 3, 224, 224))
    assert ann.grid == (14, 14) and ann.vectors.shape == (1, 196, 512)
    assert enc.dim == 512
    assert (ann.vectors >= 0).all()  # after the ReLU


@pytest.mark.slow
def test_vgg19_fine_tunes_the_conv5_blocks() -> None:
    enc = create_encoder("vgg19", fine_tune_blocks=2)
    trainable = [i for i, m in enumerate(enc.trunk) if any(p.requires_grad for p in m.parameters())]
    assert trainable == [32, 34]  # conv5_3 and conv5_4


@pytest.mark.slow  # builds ResNet-18 and loads its weights from a file: seconds
def test_pretrained_weights_come_from_torch_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    saved = fake_torch_home(tmp_path / "hub", monkeypatch, "resnet18")
    enc = create_encoder("resnet18", pretrained=True)
    assert torch.equal(enc.trunk[0].weight, saved["conv1.weight"])
    ann = enc(torch.randn(1, 3, 64, 64))
    assert ann.vectors.shape == (1, 4, 512)
