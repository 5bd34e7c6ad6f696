"""The training captions: tokenised and left out when too long, their vocabulary (training
captions only), the caption dataset and its padded batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from captioner.data.coco import load_split
from captioner.data.images import ImageLoadError, Preprocess
from captioner.data.vocab import tokenize
from captioner.train.captions import CaptionDataset, build_vocab, collate_captions, training_captions

PRE = Preprocess(size=(8, 8))  # tiny, so image work costs nothing


def test_vocab_from_training_captions_only(tiny_coco: Path) -> None:
    train = load_split(tiny_coco, "train")
    vocab = build_vocab(train, min_count=1)
    assert "red" in vocab and "square" in vocab
    assert "zebra" not in vocab  # only in a val caption
    assert "giraffe" not in vocab  # only in a test caption
    # min_count counts training occurrences: "a" is everywhere, "sky" appears once.
    strict = build_vocab(train, min_count=2)
    assert "a" in strict and "sky" not in strict
    assert len(build_vocab(train, min_count=1, max_size=6)) == 6


def test_caption_dataset_items(tiny_coco: Path) -> None:
    records = load_split(tiny_coco, "train")
    vocab = build_vocab(records, min_count=1)
    ds = CaptionDataset(records, vocab, PRE, max_len=3)
    # One item per caption of at most 3 words; the 6 longer ones are left out, not cut.
    assert len(ds) == sum(len(r.captions) for r in records) - 6 and ds.too_long == 6

    image, tokens, index = ds[0]
    assert image.shape == (3, 8, 8) and image.dtype == torch.float32
    assert index == 0
    # "a red box" (the first caption, "A red square on a table.", is too long), framed by start and end.
    assert tokens.tolist() == [vocab.start, vocab.index("a"), vocab.index("red"), vocab.index("box"), vocab.end]
    assert tokens.dtype == torch.long
    # The items of one image point at that image.
    assert [ds[i][2] for i in range(len(records[0].captions) - 1)] == [0] * (len(records[0].captions) - 1)
    assert ds[len(ds) - 1][2] == len(records) - 1


def test_caption_dataset_cache(tiny_coco: Path) -> None:
    records = load_split(tiny_coco, "val")
    vocab = build_vocab(load_split(tiny_coco, "train"), min_count=1)
    cached = CaptionDataset(records, vocab, PRE, cache_images=True)
    first = cached[0][0]
    records[0].path.unlink()  # served from memory from now on
    assert cached[0][0] is first
    assert cached[1][0] is first  # second caption of the same image shares the tensor

    uncached = CaptionDataset(records, vocab, PRE)
    with pytest.raises(ImageLoadError, match="val_201.png"):
        uncached[0]


def test_collate_pads_with_zero(tiny_coco: Path) -> None:
    records = load_split(tiny_coco, "train")
    vocab = build_vocab(records, min_count=1)
    ds = CaptionDataset(records, vocab, PRE, max_len=20)
    items = [ds[0], ds[1], ds[2]]  # 6, 3 and 2 words
    batch = collate_captions(items)

    assert batch.images.shape == (3, 3, 8, 8)
    assert batch.lengths.tolist() == [8, 5, 4]  # words + start + end
    assert batch.tokens.shape == (3, 8)
    assert batch.image_indices.tolist() == [0, 0, 0]
    for row, (_, tokens, _) in enumerate(items):
        n = len(tokens)
        assert batch.tokens[row, :n].tolist() == tokens.tolist()
        assert (batch.tokens[row, n:] == vocab.pad).all()
    assert vocab.pad == 0

    loader = DataLoader(ds, batch_size=4, shuffle=False, collate_fn=collate_captions)
    batches = list(loader)
    assert sum(len(b.lengths) for b in batches) == len(ds)
    assert all(b.tokens.shape[1] == int(b.lengths.max()) for b in batches)


def test_long_captions_are_left_out_not_cut(photos: Path) -> None:
    coco = photos / "coco"
    records = load_split(coco, "train", coco / "dataset_coco.json")
    lengths = [len(tokenize(c)) for r in records for c in r.captions]
    long = sum(n > 20 for n in lengths)
    assert long == 3  # the fixture has three training captions over 20 words

    kept = training_captions(records, max_len=20)
    assert kept.too_long == long and len(kept.items) == len(lengths) - long
    vocab = build_vocab(records, min_count=1, max_len=20)
    ds = CaptionDataset(records, vocab, Preprocess(size=(16, 16)), max_len=20)
    assert ds.too_long == long and len(ds) == len(lengths) - long
    full = {tuple(tokenize(c)) for r in records for c in r.captions}
    for i in range(len(ds)):
        words = vocab.decode(ds.items[i][1])
        assert ds.items[i][1][-1] == vocab.end
        assert tuple(words) in full  # every item is a whole caption, never a cut one
        assert len(words) <= 20
    # Words only found in the left-out captions are not in the vocabulary.
    assert "tablecloth" not in vocab and "chipped" not in build_vocab(records, min_count=1, max_len=20)
    assert "tablecloth" in build_vocab(records, min_count=1)
