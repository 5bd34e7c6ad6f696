"""Where each head of a multi-head model looks: the pointing game and the mass in the box for
every head's own map and for their mean (the map the overlay shows by default), on the same
reference words as the attention comparison (each test image's first reference caption fed
to the model; its colour and shape words that name an object uniquely present).

    python -m studies.attention heads runs/attention-comparison/full-3752steps/heads4/seed0 \\
        --data data/shapes-test7001-1000 --images 1000

The weights are a checkpoint file or a run folder (its last.pt, with the moving average of the
weights where the run keeps one: the attention comparison's checkpoint rule). Also useful on a
single-head model: its one head is its mean.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from captioner.data.coco import load_split
from captioner.evaluation.grounding import load_shape_objects, pointing_game
from captioner.inference import Captioner

from .forced import forced_outputs
from .scoring import check_test_set, test_set_arguments


@dataclass
class HeadPointing:
    """Strict pointing and mass in box per map: the mean map first, then head 1, 2, ..."""
    hits: np.ndarray  # (1 + h,) words whose argmax cell lies in the named object's box
    mass: np.ndarray  # (1 + h,) summed mass in that box
    words: int  # words scored (the same for every map)
    best_head_hits: int  # words where at least one head's argmax lies in the box

    def rows(self) -> list[tuple[str, float, float]]:
        names = ["mean of heads"] + [f"head {i + 1}" for i in range(len(self.hits) - 1)]
        n = max(1, self.words)
        return [(name, h / n, m / n) for name, h, m in zip(names, self.hits, self.mass)]


@torch.inference_mode()
def head_pointing(cap: Captioner, folder: Path, images: int, batch_size: int = 32) -> HeadPointing:
    records = load_split(folder, "test")[:images]
    objects = load_shape_objects(folder / "instances_test.json")
    cap.model.eval()
    hits = mass = None
    words_scored = best = 0
    for idx, words, out, grid in forced_outputs(cap, records, batch_size):
        heads = out.alphas_heads  # (B, T, h, L), h = 1 for one head
        maps = torch.cat([out.alphas.unsqueeze(2), heads], dim=2)  # the mean first
        maps = maps.unflatten(3, grid).double().numpy()  # (B, T, 1 + h, H, W)
        if hits is None:
            hits, mass = np.zeros(maps.shape[2]), np.zeros(maps.shape[2])
        for b, i in enumerate(idx):
            img = objects[records[i].image_id]
            per_map = [pointing_game(words[b], maps[b, :len(words[b]), k], img.objects, img.size)
                       for k in range(maps.shape[2])]
            words_scored += len(per_map[0])
            for k, recs in enumerate(per_map):
                hits[k] += sum(r.hit for r in recs)
                mass[k] += sum(r.mass for r in recs)
            best += sum(any(per_map[k][w].hit for k in range(1, len(per_map))) for w in range(len(per_map[0])))
    return HeadPointing(hits, mass, words_scored, best)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("heads", help="pointing and mass in box of each head's map and of their mean",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    test_set_arguments(p)
    p.set_defaults(func=cmd_heads)


def cmd_heads(args: argparse.Namespace) -> int:
    from .checkpoints import load_weights

    check_test_set(args.data, args.images)
    print("| weights | map | strict pointing | mass in box |\n|---|---|---|---|")
    for w in args.weights:
        r = head_pointing(load_weights(w), args.data, args.images)
        for name, p, m in r.rows():
            print(f"| {w} | {name} | {p:.3f} | {m:.3f} |")
        print(f"| {w} | any head | {r.best_head_hits / max(1, r.words):.3f} | |")
        print(f"<!-- {w}: {r.words:,} words scored -->")
    return 0
