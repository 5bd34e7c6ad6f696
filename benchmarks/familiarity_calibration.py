"""Is familiarity calibrated at any size? The share of fresh in-distribution images flagged
unfamiliar (familiarity < 0.01), by feature size D and training-set size N.

    python -m benchmarks.familiarity_calibration [--dims 128 2048] [--sizes 99 300 1000 5000]
        [--shapes-pool 8000] [--out FILE]

A threshold t should flag a share of about t of fresh images of the training distribution
(captioner/model/familiarity.py), and never less than 1/(N + 1): an image farther than all N
training images is flagged whatever t is. Two kinds of data:

1. Gaussian features: D dimensions with variances falling evenly from 1 to 0.05, for each
   D and N; ``draws`` training sets of N, 2,000 fresh images each.
2. Shapes through demo-soft's encoder (D = 128): a pool of ``--shapes-pool`` images of
   `captioner shapes` (seed 27182, never used in training), pooled annotations computed once;
   each draw fits on N of them at random and scores the rest.

The share printed is the mean over the draws: the rate a user meets over training sets, not
one set's (which, for small N, varies by about as much as it is: N = 99 flags only images
farther than all 99, a chance of 1 in 100 on average).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from captioner.model.familiarity import TrainingFeatures, pooled
from captioner.search.options import UNFAMILIAR_BELOW


def draws_for(n: int) -> int:
    """More training sets where one set's rate varies more (small N)."""
    return max(8, 4000 // n)


def gaussian_share(dim: int, n: int, draws: int, fresh: int = 2000, seed: int = 0) -> float:
    g = torch.Generator().manual_seed(seed)
    spread = torch.linspace(1.0, 0.05, dim, dtype=torch.float64).sqrt()  # (D,)
    shares = []
    for _ in range(draws):
        x = torch.randn(n + fresh, dim, generator=g, dtype=torch.float64) * spread + 3.0
        record = TrainingFeatures.fit(x[:n])
        shares.append(float((record.values(x[n:]) < UNFAMILIAR_BELOW).double().mean()))
    return sum(shares) / draws


@torch.no_grad()
def shapes_features(pool: int, weights: str = "demo-soft", batch_size: int = 64) -> torch.Tensor:
    """(pool, D) pooled annotations of fresh shapes images through the model's own encoder."""
    from torch.utils.data import DataLoader

    from captioner.data.coco import ImageDataset, load_split
    from captioner.data.shapes import generate_dataset
    from captioner.inference import Captioner

    cap = Captioner.load(weights)
    with tempfile.TemporaryDirectory() as tmp:
        generate_dataset(Path(tmp), {"test": pool}, seed=27182)
        records = load_split(Path(tmp), "test")
        loader = DataLoader(ImageDataset(records, cap.preprocess), batch_size=batch_size)
        return torch.cat([pooled(cap.model.encode(images).vectors) for images, _ in loader]).double()


def pool_share(features: torch.Tensor, n: int, draws: int, seed: int = 0) -> float:
    g = torch.Generator().manual_seed(seed)
    shares = []
    for _ in range(draws):
        order = torch.randperm(len(features), generator=g)
        record = TrainingFeatures.fit(features[order[:n]])
        shares.append(float((record.values(features[order[n:]]) < UNFAMILIAR_BELOW).double().mean()))
    return sum(shares) / draws


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dims", type=int, nargs="*", default=[128, 2048])
    p.add_argument("--sizes", type=int, nargs="*", default=[99, 300, 1000, 5000])
    p.add_argument("--shapes-pool", type=int, default=8000, help="shapes images to draw from (0: no shapes)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    rows = []

    def report(data: str, dim: int, n: int, draws: int, share: float, seconds: float) -> None:
        floor = 1 / (n + 1)
        rows.append({"data": data, "D": dim, "N": n, "draws": draws, "flagged": share, "floor": floor})
        print(f"{data:9} D={dim:5} N={n:5}  flagged {100 * share:5.2f}%  (floor 1/(N+1) {100 * floor:.2f}%, "
              f"{draws} draws, {seconds:.0f} s)", flush=True)

    for dim in args.dims:
        for n in args.sizes:
            t = time.perf_counter()
            share = gaussian_share(dim, n, draws_for(n))
            report("gaussian", dim, n, draws_for(n), share, time.perf_counter() - t)
    if args.shapes_pool:
        t = time.perf_counter()
        features = shapes_features(args.shapes_pool)
        print(f"encoded {len(features)} shapes images in {time.perf_counter() - t:.0f} s", file=sys.stderr)
        for n in args.sizes:
            if n >= len(features) - 500:
                continue
            t = time.perf_counter()
            share = pool_share(features, n, draws_for(n))
            report("shapes", features.shape[1], n, draws_for(n), share, time.perf_counter() - t)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
