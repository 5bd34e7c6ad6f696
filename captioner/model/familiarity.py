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
exact leave-one-out: r_n is training image n's distance to the fit on the other N - 1
images, so that it is as far as a fresh image of the same distribution is from the fit on
all N (an in-sample distance is smaller; a k-fold fit on fewer images, farther: neither is
exchangeable with a fresh image's). A fresh image's familiarity is then uniform on [0, 1];
an image unlike all of them is farther than every r_n, familiarity 0. ``unfamiliar`` is
familiarity < a threshold t (default 0.01): a share of about t of typical images is flagged,
and never less than 1/(N + 1) of them, since an image farther than all N is flagged whatever
t is (N = 99: 1%, N = 60: 1.6%).

The N leave-one-out fits cost two Cholesky factorisations, not N fits: with u_n = x_n - mu,
the scatter M = sum_n u_n u_n^T and the ridge r = s * mean(diag cov) of the fit on all N.
The ridge is fixed at the full fit's: it sets the scale of the feature space, one image
moves it by O(1/N), and with it fixed each leave-one-out covariance is the full one less
exactly a rank-one term, so the downdate is exact:

    mu_-n = mu - u_n / (N - 1),   x_n - mu_-n = u_n N / (N - 1)
    S_-n  = (M - N / (N - 1) u_n u_n^T) / (N - 2) + r I  =  A - c u_n u_n^T,
            A = M / (N - 2) + r I,  c = N / ((N - 1)(N - 2))
    r_n   = (N / (N - 1))^2 q_n / (1 - c q_n),   q_n = u_n^T A^-1 u_n   (Sherman-Morrison)

so at least 3 images are needed (a covariance of the other N - 1 >= 2).

Why this method (docs/results.md has the figures): it needs D + D^2 + N numbers, not the
training images' features (nearest neighbours would need all N x D of them), one (D, D)
product per image, and nothing but the encoder the model already runs.

Legend: B images, N training images, L locations, D annotation size.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

METHOD = "mahalanobis-mean-annotation"
SHRINK = 0.01  # share of the mean variance added to the diagonal: keeps S invertible for N < D


@dataclass(frozen=True)
class Familiarity:
    """One image's familiarity to its model."""

    value: float  # share of training images at least as far from their distribution: 1 typical, 0 unlike all
    unfamiliar: bool  # value < threshold
    threshold: float


MIN_IMAGES = 3  # each image held out, the others' covariance needs at least two

def pooled(vectors: torch.Tensor) -> torch.Tensor:
    """(B, L, D) annotation vectors -> (B, D) their mean over the L locations, in fp32."""
    return vectors.float().mean(1)


def _distances(x: torch.Tensor, mu: torch.Tensor, whiten: torch.Tensor) -> torch.Tensor:
    z = (x.to(mu.device, mu.dtype) - mu) @ whiten  # (B, D), on the record's device
    return (z * z).sum(1)  # (B,)


def leave_one_out(x: torch.Tensor, shrink: float = SHRINK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, D) features, N >= 3 -> mean mu (D,), whitening W (D, D) with S^-1 = W W^T of the fit on
    all N, and each image's squared distance to the fit on the other N - 1 (N,) (module docstring).
    Two Cholesky factorisations (S and A) and a triangular solve: no eigendecomposition."""
    n, dim = x.shape
    mu = x.mean(0)
    u = x - mu  # (N, D)
    scatter = u.T @ u  # (D, D) M
    scale = float(scatter.diagonal().mean()) / (n - 1)  # mean(diag cov)
    ridge = shrink * scale if scale > 0 else 1e-6
    eye = torch.eye(dim, dtype=x.dtype)
    s_factor = torch.linalg.cholesky(scatter / (n - 1) + ridge * eye)  # S = L L^T
    whiten = torch.linalg.solve_triangular(s_factor, eye, upper=False).T  # L^-T: S^-1 = L^-T L^-1
    a_factor = torch.linalg.cholesky(scatter / (n - 2) + ridge * eye)  # A = L_A L_A^T
    z = torch.linalg.solve_triangular(a_factor, u.T, upper=False)  # (D, N) L_A^-1 u_n
    q = (z * z).sum(0)  # (N,) u_n^T A^-1 u_n
    c = n / ((n - 1) * (n - 2))
    return mu, whiten, (n / (n - 1)) ** 2 * q / (1 - c * q)


@dataclass(frozen=True)
class TrainingFeatures:
    """What a checkpoint knows of its training images' features: enough to score any image's
    familiarity, as plain tensors (``to_dict``) that ``torch.load(weights_only=True)`` reads."""

    mean: torch.Tensor  # (D,) mu
    whiten: torch.Tensor  # (D, D) W, S^-1 = W W^T
    reference: torch.Tensor  # (N,) the training images' leave-one-out distances, sorted
    data: str = ""  # what they were computed on, in words

    @classmethod
    def fit(cls, features: torch.Tensor, *, data: str = "", shrink: float = SHRINK) -> "TrainingFeatures":
        """From the pooled features (N, D) of the training images (``pooled``), in float64."""
        n = len(features)
        if n < MIN_IMAGES:
            raise ValueError(f"familiarity needs at least {MIN_IMAGES} training images, got {n}")
        mu, whiten, reference = leave_one_out(features.detach().cpu().double(), shrink)
        return cls(mu.float(), whiten.float(), torch.sort(reference).values.float(), data)

    def to(self, device: str | torch.device) -> "TrainingFeatures":
        """The record on ``device`` (the model's): images are scored where they are encoded."""
        return replace(self, mean=self.mean.to(device), whiten=self.whiten.to(device),
                       reference=self.reference.to(device))

    @property
    def images(self) -> int:
        return len(self.reference)

    def distances(self, features: torch.Tensor) -> torch.Tensor:
        """(B, D) pooled features, on any device -> (B,) squared Mahalanobis distances, on the
        record's device (``to``)."""
        return _distances(features.detach(), self.mean, self.whiten)

    def values(self, features: torch.Tensor) -> torch.Tensor:
        """(B, D) pooled features -> (B,) familiarity in [0, 1], on the record's device."""
        d = self.distances(features)
        nearer = torch.searchsorted(self.reference, d, side="left")  # reference distances < d
        return (len(self.reference) - nearer).double() / len(self.reference)

    def score(self, features: torch.Tensor, threshold: float) -> list[Familiarity]:
        """One Familiarity per image, unfamiliar below ``threshold`` (``DecodeOptions.unfamiliar_below``):
        the values come to the host in one transfer."""
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

    from captioner.data.coco import ImageDataset

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
