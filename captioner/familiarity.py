"""Familiarity: how like the images a model was trained on an image is.

A model describes whatever it is shown in the words of its training data: trained on
shapes, it describes a photograph as shapes. Familiarity says, for each image, how typical
it is of the training images as the model's own encoder sees them:

    x = mean_i a_i                                    the image's pooled annotations, (D,)
    d(x) = (x - mu)^T S^-1 (x - mu)                   squared Mahalanobis distance
    S = cov + s * mean(diag cov) * I                  shrunk covariance of the training x
    familiarity(x) = #{n : r_n >= d(x)} / N           share of training images at least as far

mu, S and the N reference distances r_n are computed once from the training images and kept
in the checkpoint as plain tensors (``TrainingFeatures``). The reference distances are
cross-fitted: training image n's distance comes from a fit on the other folds, so that
it is as far as a fresh image of the same distribution would be (an in-sample distance is
smaller). Familiarity of such images is then uniform on [0, 1]; an image unlike all of them
is farther than every r_n, familiarity 0. ``unfamiliar`` is familiarity < a threshold
(default 0.01, so 1% of typical images are flagged by construction).

Why this method (docs/results.md has the figures): it needs D + D^2 + N numbers, not the
training images' features (nearest neighbours would need all N x D of them), one (D, D)
product per image, and nothing but the encoder the model already runs.

Legend: B images, N training images, L locations, D annotation size.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

METHOD = "mahalanobis-mean-annotation"
DEFAULT_THRESHOLD = 0.01
FOLDS = 5
SHRINK = 0.01  # share of the mean variance added to the diagonal: keeps S invertible for N < D


@dataclass(frozen=True)
class Familiarity:
    """One image's familiarity to its model."""

    value: float  # share of training images at least as far from their distribution: 1 typical, 0 unlike all
    unfamiliar: bool  # value < threshold
    threshold: float


MIN_IMAGES = 3  # a mean and a covariance held out image by image need at least this many

def pooled(vectors: torch.Tensor) -> torch.Tensor:
    """(B, L, D) annotation vectors -> (B, D) their mean over the L locations, in fp32."""
    return vectors.float().mean(1)


def _fit(x: torch.Tensor, shrink: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean (D,) and whitening W (D, D), with S^-1 = W W^T, of x (N, D), N >= 2, in float64."""
    mu = x.mean(0)
    cov = torch.cov((x - mu).T).reshape(x.shape[1], x.shape[1])
    scale = float(cov.diagonal().mean())
    ridge = shrink * scale if scale > 0 else 1e-6
    cov = cov + ridge * torch.eye(len(cov), dtype=x.dtype)
    return mu, torch.linalg.cholesky(torch.linalg.inv(cov))


def _distances(x: torch.Tensor, mu: torch.Tensor, whiten: torch.Tensor) -> torch.Tensor:
    z = (x.to(mu.dtype) - mu) @ whiten  # (B, D)
    return (z * z).sum(1)  # (B,)


@dataclass(frozen=True)
class TrainingFeatures:
    """What a checkpoint knows of its training images' features: enough to score any image's
    familiarity, as plain tensors (``to_dict``) that ``torch.load(weights_only=True)`` reads."""

    mean: torch.Tensor  # (D,) mu
    whiten: torch.Tensor  # (D, D) W, S^-1 = W W^T
    reference: torch.Tensor  # (N,) the training images' cross-fitted distances, sorted
    data: str = ""  # what they were computed on, in words

    @classmethod
    def fit(cls, features: torch.Tensor, *, data: str = "", folds: int = FOLDS, shrink: float = SHRINK,
            seed: int = 0) -> "TrainingFeatures":
        """From the pooled features (N, D) of the training images (``pooled``)."""
        x = features.double()
        n = len(x)
        if n < MIN_IMAGES:
            raise ValueError(f"familiarity needs at least {MIN_IMAGES} training images, got {n}")
        folds = min(folds, n)  # a handful of images: leave one out
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        reference = torch.empty(n, dtype=torch.float64)
        for held in order.chunk(folds):
            rest = torch.ones(n, dtype=torch.bool)
            rest[held] = False
            reference[held] = _distances(x[held], *_fit(x[rest], shrink))
        mu, whiten = _fit(x, shrink)
        return cls(mu.float(), whiten.float(), torch.sort(reference).values.float(), data)

    @property
    def images(self) -> int:
        return len(self.reference)

    def distances(self, features: torch.Tensor) -> torch.Tensor:
        """(B, D) pooled features -> (B,) squared Mahalanobis distances."""
        return _distances(features.detach().float().cpu(), self.mean, self.whiten)

    def values(self, features: torch.Tensor) -> torch.Tensor:
        """(B, D) pooled features -> (B,) familiarity in [0, 1]."""
        d = self.distances(features)
        nearer = torch.searchsorted(self.reference, d, side="left")  # reference distances < d
        return (len(self.reference) - nearer).double() / len(self.reference)

    def score(self, features: torch.Tensor, threshold: float = DEFAULT_THRESHOLD) -> list[Familiarity]:
        return [Familiarity(v, v < threshold, threshold) for v in self.values(features).tolist()]

    def to_dict(self) -> dict:
        return {"method": METHOD, "mean": self.mean.clone(), "whiten": self.whiten.clone(),
                "reference": self.reference.clone(), "data": self.data}

    @classmethod
    def from_dict(cls, d: dict) -> "TrainingFeatures":
        if d.get("method") != METHOD:
            raise ValueError(f"unknown familiarity method {d.get('method')!r} (this captioner knows {METHOD})")
        mean, whiten, reference = d["mean"], d["whiten"], d["reference"]
        dim = mean.shape[0]
        if mean.dim() != 1 or tuple(whiten.shape) != (dim, dim) or reference.dim() != 1 or len(reference) == 0:
            raise ValueError("familiarity record has tensors of the wrong shapes")
        return cls(mean.float(), whiten.float(), reference.float(), str(d.get("data", "")))


@torch.no_grad()
def training_features(captioner, records: Sequence, *, data: str = "", batch_size: int = 64, workers: int = 0,
                      progress: bool = True) -> TrainingFeatures:
    """Fit ``TrainingFeatures`` on ``records`` (the images the model was trained on, as
    ImageRecords) through the captioner's own preprocessing and encoder."""
    from torch.utils.data import DataLoader
    from tqdm import tqdm

    from .data.coco import ImageDataset

    loader = DataLoader(ImageDataset(records, captioner.preprocess), batch_size=batch_size, num_workers=workers,
                        shuffle=False)
    model = captioner.model.eval()
    feats = []
    with tqdm(total=len(records), desc="familiarity", unit="img", file=sys.stderr, disable=not progress,
              leave=False) as bar:
        for images, _ in loader:
            feats.append(pooled(model.encode(images.to(captioner.device)).vectors).cpu())
            bar.update(len(images))
    return TrainingFeatures.fit(torch.cat(feats), data=data)
