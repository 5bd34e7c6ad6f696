"""The captions a model trains on: tokenised (``training_captions``), counted into a vocabulary
(``build_vocab``), paired with their images (``CaptionDataset``) and padded into batches
(``collate_captions``). Training alone needs them; the library decodes images with
``captioner.data.coco.ImageDataset``, which ``CaptionDataset`` reads its images through."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from captioner.data.coco import ImageDataset, ImageRecord
from captioner.data.images import Preprocess
from captioner.data.vocab import PTB, Tokenizer, Vocabulary


@dataclass
class TrainingCaptions:
    """The captions a model trains on, tokenised, and how many were left out."""

    items: list[tuple[int, list[str]]]  # (index of the image in the records, tokens)
    too_long: int  # captions over max_len words: left out, never cut
    empty: int  # captions with no words after tokenisation


def training_captions(records: Sequence[ImageRecord], max_len: int | None = None,
                      tokenizer: Tokenizer = PTB) -> TrainingCaptions:
    """Every caption of every record with at most ``max_len`` words (tokens of ``tokenizer``).

    A longer caption is left out rather than cut: a cut caption followed by ``<end>``
    would teach the model to stop mid-sentence.
    """
    items, too_long, empty = [], 0, 0
    for i, record in enumerate(records):
        for caption in record.captions:
            tokens = tokenizer.tokenize(caption)
            if not tokens:
                empty += 1
            elif max_len is not None and max_len > 0 and len(tokens) > max_len:
                too_long += 1
            else:
                items.append((i, tokens))
    return TrainingCaptions(items, too_long, empty)


def build_vocab(train_records: Sequence[ImageRecord], min_count: int = 5,
                max_size: int | None = None, max_len: int | None = None,
                captions: TrainingCaptions | None = None, tokenizer: Tokenizer = PTB) -> Vocabulary:
    """Vocabulary from the given (training) records' captions only, those the model trains
    on (at most ``max_len`` words); ``captions``: ``training_captions`` of those records
    (by the same ``tokenizer``) when the caller has them already (tokenising COCO's
    captions takes a while).

    Passing validation or test records here would leak their words into the model.
    """
    captions = captions if captions is not None else training_captions(train_records, max_len, tokenizer)
    counts = Counter(t for _, tokens in captions.items for t in tokens)
    return Vocabulary.from_counts(counts, min_count=min_count, max_size=max_size, tokenizer=tokenizer)


class CaptionDataset(Dataset):
    """One item per (image, caption) pair: every caption of every image.

    Items are ``(image (3, H, W), token ids (n + 2,), image index)``: the ids are
    ``<start> w1 .. wn <end>``, and the image index is the position of the image in
    ``records``. Captions over ``max_len`` words are left out (``too_long`` counts them),
    never cut; captions with no words after tokenisation are skipped: there is nothing to
    learn from them.
    """

    def __init__(self, records: Sequence[ImageRecord], vocab: Vocabulary, preprocess: Preprocess,
                 max_len: int | None = None, cache_images: bool = False,
                 captions: TrainingCaptions | None = None) -> None:
        self.records = list(records)
        self.vocab = vocab
        self.max_len = max_len
        self._images = ImageDataset(self.records, preprocess, cache_images)
        kept = captions if captions is not None else training_captions(self.records, max_len, vocab.tokenizer)
        self.too_long = kept.too_long
        # Encoded once up front: cheap, and it keeps __getitem__ to image work only.
        self.items: list[tuple[int, list[int]]] = [(i, vocab.encode(tokens)) for i, tokens in kept.items]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        image_index, ids = self.items[idx]
        return self._images[image_index][0], torch.tensor(ids, dtype=torch.long), image_index


@dataclass
class CaptionBatch:
    """A padded training batch.

    ``tokens`` is (B, T + 1), padded with 0 (the pad id) after each caption's end token:
    inputs are ``tokens[:, :-1]`` and targets ``tokens[:, 1:]``, T steps. ``lengths``
    counts each caption's tokens including start and end. The batch keeps the loader's
    order (it is not sorted by length), so ``image_indices`` lines up with every row.
    """

    images: torch.Tensor
    tokens: torch.Tensor
    lengths: torch.Tensor
    image_indices: torch.Tensor

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "CaptionBatch":
        return CaptionBatch(*(t.to(device, non_blocking=non_blocking) for t in
                              (self.images, self.tokens, self.lengths, self.image_indices)))

    def pin_memory(self) -> "CaptionBatch":
        # Called by DataLoader(pin_memory=True) on custom batch types.
        return CaptionBatch(*(t.pin_memory() for t in
                              (self.images, self.tokens, self.lengths, self.image_indices)))


def collate_captions(batch: Sequence[tuple[torch.Tensor, torch.Tensor, int]]) -> CaptionBatch:
    """Stack images and right-pad token ids with 0 into a :class:`CaptionBatch`."""
    if not batch:
        raise ValueError("cannot collate an empty batch")
    images, token_seqs, indices = zip(*batch)
    lengths = torch.tensor([len(t) for t in token_seqs], dtype=torch.long)
    tokens = torch.zeros(len(batch), int(lengths.max()), dtype=torch.long)  # 0 is the pad id
    for row, seq in enumerate(token_seqs):
        tokens[row, : len(seq)] = seq
    return CaptionBatch(images=torch.stack(images), tokens=tokens, lengths=lengths,
                        image_indices=torch.tensor(indices, dtype=torch.long))
