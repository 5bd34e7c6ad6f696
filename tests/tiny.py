"""Tiny random models and images for fast CPU tests."""

from __future__ import annotations

import torch
from PIL import Image

from captioner.images import Preprocess
from captioner.inference import Captioner
from captioner.model import CaptionModel, ModelConfig
from captioner.vocab import Vocabulary

WORDS = ["a", "red", "blue", "green", "circle", "square", "star", "and", "small", "large"]


def tiny_vocab() -> Vocabulary:
    return Vocabulary.build([" ".join(WORDS)], min_count=1)


def tiny_config(**overrides) -> ModelConfig:
    cfg = dict(vocab_size=len(tiny_vocab()), encoder="small", image_size=(32, 32), embed_dim=12,
               hidden_dim=16, attention_dim=10, dropout=0.0)
    cfg.update(overrides)
    return ModelConfig(**cfg)


def tiny_captioner(seed: int = 0, **overrides) -> Captioner:
    torch.manual_seed(seed)
    cfg = tiny_config(**overrides)
    model = CaptionModel(cfg)
    # Random init gives near-uniform word distributions; sharpen them so decoding
    # choices are decided, not ties broken by rounding.
    with torch.no_grad():
        model.decoder.L_o.weight.mul_(8.0)
    return Captioner(model, tiny_vocab(), Preprocess(size=cfg.image_size))


def tiny_image(seed: int = 0, size: tuple[int, int] = (40, 30)) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    arr = (torch.rand(size[1], size[0], 3, generator=g) * 255).to(torch.uint8).numpy()
    return Image.fromarray(arr, "RGB")


def token_batch(vocab: Vocabulary, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = [vocab.encode(c) for c in captions]
    lengths = torch.tensor([len(x) for x in ids])
    tokens = torch.zeros(len(ids), int(lengths.max()), dtype=torch.long)
    for i, x in enumerate(ids):
        tokens[i, : len(x)] = torch.tensor(x)
    return tokens, lengths
