"""Check that every image of a data set exists and decodes, before a long run needs it.

Decoding runs in DataLoader worker processes, since decoding 120,000 COCO JPEGs on one
core takes a while; each file is decoded the way training decodes it
(:meth:`Preprocess.load`), so a file that passes here will load in training.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from captioner.data.images import ImageLoadError, Preprocess


class _Probe(Dataset):
    """Item i: None when paths[i] decodes, else the reason it does not."""

    def __init__(self, paths: Sequence[Path], preprocess: Preprocess) -> None:
        self.paths, self.preprocess = list(paths), preprocess

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> str | None:
        path = self.paths[i]
        if not path.is_file():
            return "missing"
        try:
            self.preprocess.load(path)
        except ImageLoadError as e:
            return str(e)
        except Exception as e:  # anything else about one file is reported, not raised
            return f"{type(e).__name__}: {e}"
        return None


def unreadable_images(paths: Sequence[Path], preprocess: Preprocess, workers: int = 2,
                      progress: bool = True) -> dict[Path, str]:
    """Path -> reason ("missing", "corrupt or truncated image: ...") for every image of
    ``paths`` that cannot be used; empty when all decode."""
    # Its own generator: training checks its images before it builds the model, whose initial
    # weights must not depend on a loader having drawn from the global random state.
    loader = DataLoader(_Probe(paths, preprocess), batch_size=32, num_workers=workers,
                        collate_fn=list, shuffle=False, generator=torch.Generator())
    problems: dict[Path, str] = {}
    done = 0
    with tqdm(total=len(paths), desc="checking images", unit="img", file=sys.stderr,
              disable=not progress, dynamic_ncols=True) as bar:
        for reasons in loader:
            for offset, reason in enumerate(reasons):
                if reason is not None:
                    problems[paths[done + offset]] = reason
            done += len(reasons)
            bar.update(len(reasons))
    return problems
