"""Feature cache: with a frozen encoder, annotation vectors are computed once per image
(not once per caption, not once per epoch) and stored as a memory-mapped float16 file.

Layout: ``<name>.f16`` holds an (N, L, D) float16 array, row i for record i;
``<name>.json`` says its shape, grid, encoder and image list, and whether it is complete.
Training reads rows through the memory map, so the cache need not fit in memory.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from captioner.data.coco import ImageDataset, ImageRecord
from captioner.data.images import Preprocess
from captioner.data.vocab import Vocabulary
from captioner.distributed import DistContext
from captioner.model.decoder import CaptionModel

from .captions import TrainingCaptions, training_captions


def cache_key(records: list[ImageRecord], model: CaptionModel, preprocess: Preprocess) -> str:
    """Changes when the images, the encoder's weights or the preprocessing change."""
    h = hashlib.sha1()
    h.update(json.dumps([model.config.encoder, preprocess.to_dict()]).encode())
    for r in records:
        h.update(str(r.path).encode())
    for name, t in sorted(model.encoder.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().float().numpy().tobytes()[:4096])
    return h.hexdigest()[:16]


class FeatureCache:
    def __init__(self, path: Path):
        meta = json.loads(path.with_suffix(".json").read_text())
        self.shape = tuple(meta["shape"])  # (N, L, D)
        self.grid = tuple(meta["grid"])
        self.array = np.memmap(path, dtype=np.float16, mode="r", shape=self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def row(self, i: int) -> torch.Tensor:
        return torch.from_numpy(np.asarray(self.array[i], dtype=np.float32))  # (L, D)


@torch.inference_mode()
def build_cache(model: CaptionModel, records: list[ImageRecord], preprocess: Preprocess, folder: Path,
                ctx: DistContext, batch_size: int = 32, workers: int = 0, progress: bool = True) -> FeatureCache:
    """Encode every image once (each rank its share of the rows) unless a complete cache exists."""
    if any(p.requires_grad for p in model.encoder.parameters()):
        raise ValueError("the feature cache needs a frozen encoder (a pretrained backbone with fine_tune_blocks = 0, "
                         "or model.freeze_encoder = true)")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"features-{cache_key(records, model, preprocess)}.f16"
    meta_path = path.with_suffix(".json")
    if meta_path.is_file() and json.loads(meta_path.read_text()).get("complete"):
        return FeatureCache(path)
    model.encoder.eval()
    probe = model.encode(preprocess(preprocess.load(records[0].path)).unsqueeze(0).to(ctx.device))
    n, (l, d), grid = len(records), probe.vectors.shape[1:], probe.grid
    full = None
    if ctx.is_main:
        try:
            _allocate(path, n * l * d * np.dtype(np.float16).itemsize)
        except OSError as e:
            path.unlink(missing_ok=True)
            full = f"no room for the feature cache in {folder}: it needs {_size(n * l * d * 2)} ({e.strerror or e})"
    full = ctx.broadcast(full)  # every rank stops, not only the one that writes
    if full is not None:
        raise CacheSpaceError(full)
    out = np.memmap(path, dtype=np.float16, mode="r+", shape=(n, l, d))
    mine = list(range(ctx.rank, n, ctx.world))  # rank r encodes rows r, r + world, ...
    loader = DataLoader(_Subset(ImageDataset(records, preprocess), mine), batch_size=batch_size,
                        num_workers=workers, generator=torch.Generator())
    with tqdm(total=len(mine), desc="feature cache", unit="img", file=sys.stderr,
              disable=not (progress and ctx.is_main)) as bar:
        for images, idx in loader:
            feats = model.encode(images.to(ctx.device)).vectors.to(torch.float16).cpu().numpy()
            out[idx.numpy()] = feats
            bar.update(len(idx))
    out.flush()
    ctx.barrier()
    if ctx.is_main:
        meta_path.write_text(json.dumps({"shape": [n, l, d], "grid": list(grid), "encoder": model.config.encoder,
                                         "images": len(records), "complete": True}))
    ctx.barrier()
    return FeatureCache(path)


def cache_features(cache: FeatureCache, rows: int = 256) -> torch.Tensor:
    """(N, D) the cached images' pooled annotations (captioner.model.familiarity.pooled), read
    ``rows`` images at a time through the memory map."""
    out = [torch.from_numpy(np.asarray(cache.array[i:i + rows], dtype=np.float32)).mean(1)
           for i in range(0, len(cache), rows)]  # each (rows, D)
    return torch.cat(out)


class CacheSpaceError(OSError):
    """The feature cache does not fit where it was to be written; the message says how big it is."""


def _allocate(path: Path, size: int) -> None:
    """Make ``path`` ``size`` bytes long with its blocks reserved now: a disk too small says so
    here, rather than killing the process (SIGBUS) when a write through the memory map finds
    no block, hours into the encoding."""
    with open(path, "wb") as f:
        if hasattr(os, "posix_fallocate"):
            try:
                os.posix_fallocate(f.fileno(), 0, size)
                return
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system that cannot: a plain file
                    raise
        f.truncate(size)


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


class _Subset(Dataset):
    def __init__(self, base: Dataset, indices: list[int]):
        self.base, self.indices = base, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        return self.base[self.indices[i]]


class CachedCaptionDataset(Dataset):
    """Like CaptionDataset, but items carry the cached annotations (L, D) instead of pixels."""

    def __init__(self, records: list[ImageRecord], vocab: Vocabulary, cache: FeatureCache, max_len: int | None,
                 captions: TrainingCaptions | None = None):
        if len(cache) != len(records):
            raise ValueError(f"feature cache has {len(cache)} rows for {len(records)} images")
        self.cache = cache
        # captions over max_len words left out, not cut; ``captions``: the caller's, if computed already
        kept = captions if captions is not None else training_captions(records, max_len, vocab.tokenizer)
        self.too_long = kept.too_long
        self.items = [(i, vocab.encode(tokens)) for i, tokens in kept.items]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, idx: int):
        i, ids = self.items[idx]
        return self.cache.row(i), torch.tensor(ids, dtype=torch.long), i
