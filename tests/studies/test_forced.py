"""studies.attention.forced: each image's first reference caption fed to the model, batched, gives
the maps the model gives that caption image by image."""

from __future__ import annotations

import pytest
import torch

from captioner.data.coco import ImageDataset, load_split
from captioner.data.shapes import generate_dataset
from captioner.data.vocab import tokenize
from captioner.model.encoders import Annotations
from studies.attention.forced import forced_maps, forced_outputs
from tests.tiny import tiny_captioner


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shapes")
    generate_dataset(folder, {"test": 5}, seed=4, image_size=48)
    return load_split(folder, "test")


@pytest.mark.parametrize("overrides", [{}, {"heads": 2}, {"grid_layers": 1}])
def test_batched_forced_maps_are_each_captions_own(records, overrides):
    cap = tiny_captioner(seed=1, **overrides)
    with torch.inference_mode():
        maps = forced_maps(cap, records, batch_size=2)  # batches of 2, 2 and 1: padding in the first two
        assert [w for w, _ in maps] == [tokenize(r.captions[0]) for r in records]
        for rec, (words, got) in zip(records, maps):
            x = ImageDataset([rec], cap.preprocess)[0][0][None]
            ids = torch.tensor([cap.vocab.encode(words)])
            alone = cap.model(x, ids, torch.tensor([ids.shape[1]])).alphas[0, :len(words)]  # (T, L): <end>'s left out
            grid = cap.model.encode(x).grid
            assert got.shape == (len(words), *grid)  # (T, H, W)
            assert torch.allclose(torch.from_numpy(got), alone.unflatten(1, grid).double(), atol=1e-5)
            assert torch.allclose(torch.from_numpy(got).sum((1, 2)), torch.ones(len(words), dtype=torch.float64),
                                  atol=1e-5)


def test_forced_outputs_yield_each_batchs_indices_words_and_grid(records):
    cap = tiny_captioner(seed=1)
    with torch.inference_mode():
        batches = list(forced_outputs(cap, records, batch_size=3))
    assert [list(idx) for idx, *_ in batches] == [[0, 1, 2], [3, 4]]
    for idx, words, out, grid in batches:
        # One step per word and one for <end>, the longest caption's.
        assert len(words) == len(idx) and out.alphas.shape[:2] == (len(idx), max(map(len, words)) + 1)
        assert out.alphas.shape[2] == grid[0] * grid[1]


def test_forced_outputs_give_the_model_its_own_devices_tensors(records, monkeypatch):
    """A model on another device than the CPU (the meta device stands in for a GPU) gets its
    images, tokens and lengths there, not on the CPU where the data set makes them."""
    cap = tiny_captioner(seed=1)
    seen = []

    class Spy(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def encode(self, images):
            return Annotations(torch.zeros(len(images), 4, 1), (2, 2))

        def forward(self, images, tokens, lengths):
            seen.append({images.device.type, tokens.device.type, lengths.device.type})
            return None

    monkeypatch.setattr(type(cap), "device", property(lambda self: torch.device("meta")))
    cap.model = Spy(cap.model)
    with torch.inference_mode():
        list(forced_outputs(cap, records, batch_size=2))
    assert seen == [{"meta"}] * 3
