"""Image encoders: a CNN cut before pooling, giving annotation vectors a_1..a_L.

Legend: B batch, C channels (= D, the annotation size), H x W the feature grid, L = H*W.

Registered encoders (``create_encoder(name, ...)``):
    small      a small CNN trained from scratch, for the synthetic shapes data and tests
    vgg19      VGG-19 conv5_4 after its ReLU, before the last max-pool (the paper's
               annotation vectors): 14x14x512 at 224 px
    vgg16      VGG-16 conv5_3 (not the paper's; kept for older checkpoints): 14x14x512 at 224 px
    resnet18   ResNet-18 layer4: 512 channels, 7x7 at 224 px (small and quick)
    resnet50   ResNet-50 layer4: 2048 channels, 7x7 at 224 px (14x14 at 448 px)
    resnet101  ResNet-101 layer4: 2048 channels
torchvision backbones are built with its weights API: ImageNet weights when
``pretrained`` (from the torch hub cache, ``$TORCH_HOME/hub/checkpoints/<file>``, or the
network), random otherwise. The weights are torchvision's ImageNet training, not the
Oxford VGG group's Caffe release the paper used. A checkpoint holds the whole encoder,
so loading one builds it with ``pretrained=False`` and never fetches these files.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

_REGISTRY: dict[str, Callable[..., "Encoder"]] = {}


def register_encoder(name: str):
    def deco(fn):
        _REGISTRY[name] = fn
        return fn
    return deco


def encoder_names() -> list[str]:
    return sorted(_REGISTRY)


def create_encoder(name: str, *, pretrained: bool = False, fine_tune_blocks: int = 0,
                   freeze: bool = False) -> "Encoder":
    """``freeze``: no encoder parameter trains (not even a from-scratch encoder's)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown encoder {name!r}; choose from {', '.join(encoder_names())}")
    encoder = _REGISTRY[name](pretrained=pretrained, fine_tune_blocks=0 if freeze else fine_tune_blocks)
    if freeze:
        encoder.freeze()
    return encoder


@dataclass
class Annotations:
    """Annotation vectors of a batch of images."""

    vectors: torch.Tensor  # (B, L, D)
    grid: tuple[int, int]  # (H, W) with H * W = L


class Encoder(nn.Module):
    """Wraps a convolutional trunk; forward gives (B, L, D) annotation vectors."""

    def __init__(self, trunk: nn.Module, dim: int, blocks: list[nn.Module] | None = None,
                 fine_tune_blocks: int = 0, trainable: bool = False):
        super().__init__()
        self.trunk = trunk
        self.dim = dim
        self.from_scratch = trainable
        if not trainable:
            # A pretrained backbone is frozen except its last `fine_tune_blocks` blocks.
            for p in self.trunk.parameters():
                p.requires_grad_(False)
            for block in (blocks or [])[-fine_tune_blocks:] if fine_tune_blocks > 0 else []:
                for p in block.parameters():
                    p.requires_grad_(True)

    def freeze(self) -> None:
        self.from_scratch = False
        for p in self.parameters():
            p.requires_grad_(False)

    def train(self, mode: bool = True) -> "Encoder":
        super().train(mode)
        if not self.from_scratch:
            # Batch-norm statistics of a pretrained backbone stay as they were.
            for m in self.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.eval()
        return self

    @property
    def trainable(self) -> bool:
        return any(p.requires_grad for p in self.parameters())

    def forward(self, images: torch.Tensor) -> Annotations:
        fmap = self.trunk(images)  # (B, D, H, W)
        b, d, h, w = fmap.shape
        return Annotations(fmap.flatten(2).transpose(1, 2), (h, w))  # (B, L, D)


class _CoordConcat(nn.Module):
    """Appends normalised (y, x) coordinate channels, so features know where they are."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, h, w = x.shape
        ys = torch.linspace(-1, 1, h, device=x.device, dtype=x.dtype).view(1, 1, h, 1).expand(b, 1, h, w)
        xs = torch.linspace(-1, 1, w, device=x.device, dtype=x.dtype).view(1, 1, 1, w).expand(b, 1, h, w)
        return torch.cat([x, ys, xs], dim=1)


def _conv(cin: int, cout: int, stride: int) -> nn.Sequential:
    # Stride 2 uses a 4x4 kernel (padding 1): output i is centred on input 2i + 0.5, so each
    # cell stays centred on its own block of pixels. A 3x3 stride-2 kernel centres it on 2i
    # instead, half a block up and left, and the attention maps then land off the objects
    # they look at.
    k = 4 if stride == 2 else 3
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


def _small_encoder(name: str, pretrained: bool, cell: int) -> Encoder:
    """The from-scratch encoders: coordinate channels, three 4x4 stride-2 stages (8-px
    cells, receptive field 22 px), for 16-px cells one more 2x2 stride-2 stage (receptive
    field 30 px), then a 1x1 layer. Every cell is centred on its own block of pixels."""
    if pretrained:
        raise ValueError(f"the {name!r} encoder has no pretrained weights; it is trained from scratch")
    dim = 128
    layers: list[nn.Module] = [_CoordConcat(), _conv(5, 32, 2), _conv(32, 64, 2), _conv(64, dim, 2)]
    if cell == 16:
        layers += [nn.Conv2d(dim, dim, 2, 2, bias=False), nn.BatchNorm2d(dim), nn.ReLU(inplace=True)]
    layers += [nn.Conv2d(dim, dim, 1), nn.ReLU(inplace=True)]
    return Encoder(nn.Sequential(*layers), dim, trainable=True)


@register_encoder("small")
def small(*, pretrained: bool = False, fine_tune_blocks: int = 0) -> Encoder:
    """16-px cells (grid = image / 16) with a receptive field of 30 px: a cell sees its own
    block and 7 px around it, not a whole object, so naming an object means attending to
    the cells it covers, word by word."""
    return _small_encoder("small", pretrained, cell=16)


@register_encoder("small8")
def small8(*, pretrained: bool = False, fine_tune_blocks: int = 0) -> Encoder:
    """The small encoder at twice the resolution: 8-px cells (16x16 at 128 px) with a
    receptive field of 22 px, so the maps can say more precisely where."""
    return _small_encoder("small8", pretrained, cell=8)


# Encoder name -> its torchvision weights enum (ImageNet): the encoders that can be pretrained.
PRETRAINED_WEIGHTS = {"vgg19": "VGG19_Weights", "vgg16": "VGG16_Weights", "resnet18": "ResNet18_Weights",
                      "resnet50": "ResNet50_Weights", "resnet101": "ResNet101_Weights"}


def _torchvision_weights(name: str, pretrained: bool):
    """Encoder ``name``'s ImageNet weights (torchvision's enum value), or None without ``pretrained``."""
    if not pretrained:
        return None
    import torchvision.models as tvm
    return getattr(tvm, PRETRAINED_WEIGHTS[name]).DEFAULT


def pretrained_file(name: str) -> tuple[Path, str] | None:
    """(where torchvision keeps encoder ``name``'s ImageNet weights, the address it downloads
    them from); None for an encoder without pretrained weights."""
    if name not in PRETRAINED_WEIGHTS:
        return None
    import torch.hub

    url = _torchvision_weights(name, True).url
    return Path(torch.hub.get_dir()) / "checkpoints" / url.rsplit("/", 1)[-1], url


def _build(builder: Callable, name: str, pretrained: bool) -> nn.Module:
    weights = _torchvision_weights(name, pretrained)
    try:
        return builder(weights=weights)
    except Exception as e:  # network or cache failure: say what to do
        if weights is None:
            raise
        where, url = pretrained_file(name)
        raise RuntimeError(
            f"could not load the pretrained ImageNet weights for {name} ({e}): copy {url} to {where} "
            "(TORCH_HOME moves that folder), or start from random weights (training: "
            "--set model.encoder_pretrained=false)") from e


@register_encoder("vgg19")
def vgg19(*, pretrained: bool = False, fine_tune_blocks: int = 0) -> Encoder:
    import torchvision.models as tvm
    net = _build(tvm.vgg19, "vgg19", pretrained)
    trunk = net.features[:36]  # up to conv5_4 + ReLU, before the last max-pool: (B, 512, 14, 14) at 224 px
    # Blocks for fine-tuning: conv5_1 .. conv5_4 (each conv + ReLU).
    blocks = [trunk[28:30], trunk[30:32], trunk[32:34], trunk[34:36]]
    return Encoder(trunk, 512, blocks, fine_tune_blocks)


@register_encoder("vgg16")
def vgg16(*, pretrained: bool = False, fine_tune_blocks: int = 0) -> Encoder:
    import torchvision.models as tvm
    net = _build(tvm.vgg16, "vgg16", pretrained)
    trunk = net.features[:30]  # up to conv5_3 + ReLU, before the last max-pool
    # Blocks for fine-tuning: conv5_1, conv5_2, conv5_3 (each conv + ReLU).
    blocks = [trunk[24:26], trunk[26:28], trunk[28:30]]
    return Encoder(trunk, 512, blocks, fine_tune_blocks)


def _resnet(name: str, pretrained: bool, fine_tune_blocks: int, dim: int = 2048) -> Encoder:
    import torchvision.models as tvm
    net = _build(getattr(tvm, name), name, pretrained)
    trunk = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool, net.layer1, net.layer2, net.layer3, net.layer4)
    blocks = list(net.layer3) + list(net.layer4)  # fine-tuning unfreezes the last blocks first
    return Encoder(trunk, dim, blocks, fine_tune_blocks)


@register_encoder("resnet18")
def resnet18(*, pretrained: bool = False, fine_tune_blocks: int = 0) -> Encoder:
    return _resnet("resnet18", pretrained, fine_tune_blocks, dim=512)


@register_encoder("resnet50")
def resnet50(*, pretrained: bool = False, fine_tune_blocks: int = 0) -> Encoder:
    return _resnet("resnet50", pretrained, fine_tune_blocks)


@register_encoder("resnet101")
def resnet101(*, pretrained: bool = False, fine_tune_blocks: int = 0) -> Encoder:
    return _resnet("resnet101", pretrained, fine_tune_blocks)
