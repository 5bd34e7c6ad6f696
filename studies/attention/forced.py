"""Teacher-forced attention maps: each image's first reference caption fed to the model,
the map of every word's step kept.

Real decoding (``captioner.evaluation.evaluate``) scores what a model says; this scores where it looks
while reading a fixed caption, so the words scored are the same for every model, whatever
it would have said: the pointing game of the attention comparison and of each head.

    maps: (T, H, W) per caption, T its words, H * W = L the annotation grid
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from captioner.data.coco import ImageDataset, ImageRecord
from captioner.inference import Captioner
from captioner.model.decoder import DecoderOutput


def forced_outputs(cap: Captioner, records: Sequence[ImageRecord],
                   batch_size: int = 32) -> Iterator[tuple[range, list[list[str]], DecoderOutput, tuple[int, int]]]:
    """Each image's first reference caption fed to the model (teacher forcing), a batch at a
    time: yields (the batch's record indices, their caption words, the model's DecoderOutput,
    the annotation grid (H, W))."""
    data = ImageDataset(records, cap.preprocess)
    grid = None
    for start in range(0, len(records), batch_size):
        idx = range(start, min(start + batch_size, len(records)))
        images = torch.stack([data[i][0] for i in idx]).to(cap.device)
        words = [cap.vocab.tokenizer.tokenize(records[i].captions[0]) for i in idx]
        ids = [cap.vocab.encode(w) for w in words]
        lengths = torch.tensor([len(x) for x in ids])
        tokens = torch.zeros(len(ids), int(lengths.max()), dtype=torch.long)
        for i, x in enumerate(ids):
            tokens[i, :len(x)] = torch.tensor(x)
        tokens, lengths = tokens.to(cap.device), lengths.to(cap.device)
        if grid is None:  # one model, one image size: one grid
            grid = cap.model.encode(images[:1]).grid  # (H, W), H * W = L
        # From the images, as training calls it: whatever the model does to the annotations
        # after the encoder (grid self-attention) happens here as it does there.
        yield idx, words, cap.model(images, tokens, lengths), grid


def forced_maps(cap: Captioner, records: Sequence[ImageRecord],
                batch_size: int = 32) -> list[tuple[list[str], np.ndarray]]:
    """Each image's first reference caption (forced_outputs): its words and the map of every
    word's step, (T, H, W)."""
    out = []
    for _, words, output, grid in forced_outputs(cap, records, batch_size):
        maps = output.alphas.unflatten(2, grid).double().cpu().numpy()  # (B, T, H, W)
        out += [(w, maps[i, :len(w)]) for i, w in enumerate(words)]
    return out
