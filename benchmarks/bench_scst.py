"""Time of a self-critical training step against a cross-entropy step, and what it spends
on each part: drawing the k samples, their CIDEr-D rewards, the greedy baseline's caption,
and the teacher-forced log-probabilities with their backward.

    python benchmarks/bench_scst.py                       # demo-soft, shapes, batch 32, k 5
    python benchmarks/bench_scst.py --device cuda --rounds 20

The model reads cached annotations (the encoder frozen, as in train/configs/shapes-scst.toml),
so a step is the decoder's; the batch is built as training builds it (one caption of each
of 32 generated images). Rounds interleave the three steps (cross-entropy, SCST with the
leave-one-out baseline, SCST with the greedy baseline), so the ratios are measured side by
side; the figures are medians over the rounds. The parts are timed inside those same SCST
steps: each of the objective's phases is wrapped in a timer while it runs, and the rest of
the step (the backward and the optimizer) is what remains.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

import captioner.train.scst as scst
from captioner.data.coco import load_split
from captioner.data.shapes import generate_dataset
from captioner.inference import Captioner
from captioner.model.encoders import Annotations
from captioner.train.captions import CaptionDataset, collate_captions
from captioner.train.config import ScstConfig
from captioner.train.losses import soft_loss

PARTS = {"sample_captions": "draw k samples", "rewards": "CIDEr-D rewards", "greedy": "greedy caption",
         "sample_log_probs": "log p of the samples (forward)"}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _time_parts(device: torch.device, spent: dict[str, float]) -> None:
    """Wrap the objective's phases (the functions ScstObjective.__call__ calls) in timers
    that add their seconds to ``spent``; the objective itself runs unchanged."""
    def wrap(owner, name: str) -> None:
        inner = getattr(owner, name)

        def timed(*a, **k):
            _sync(device)
            start = time.perf_counter()
            out = inner(*a, **k)
            _sync(device)
            spent[name] += time.perf_counter() - start
            return out
        setattr(owner, name, timed)
    for name in ("sample_captions", "greedy", "sample_log_probs"):
        wrap(scst, name)
    wrap(scst.ScstObjective, "rewards")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default="demo-soft", help="a shapes checkpoint (default: demo-soft)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--samples", type=int, default=5, help="k, samples per image")
    ap.add_argument("--max-len", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on the CPU (training's default: 1)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    cap = Captioner.load(args.weights, device=device)
    model = cap.model.train()
    with tempfile.TemporaryDirectory() as tmp:
        generate_dataset(Path(tmp), {"train": args.batch_size}, seed=11, image_size=128)
        records = load_split(tmp, "train")
        data = CaptionDataset(records, cap.vocab, cap.preprocess, max_len=args.max_len)
        first = {}  # one caption of each image
        for j, (i, _) in enumerate(data.items):
            first.setdefault(i, j)
        batch = collate_captions([data[j] for j in first.values()]).to(device)
    with torch.no_grad():
        ann = model.encode(batch.images)
    ann = Annotations(ann.vectors.detach(), ann.grid)
    params = [p for p in model.decoder.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-9)  # a real update's cost, a negligible change
    base = ScstConfig(enabled=True, samples=args.samples, max_len=args.max_len)
    objectives = {b: scst.ScstObjective(replace(base, baseline=b), cap.vocab, [r.captions for r in records],
                                        device=device) for b in ("loo", "greedy")}

    def step(loss_of):
        def run() -> None:
            opt.zero_grad(set_to_none=True)
            loss_of().backward()
            opt.step()
        return run

    steps = {"cross-entropy": step(lambda: soft_loss(model, ann, batch.tokens, batch.lengths, 0.0).loss),
             "SCST, loo baseline": step(lambda: objectives["loo"](model, ann, batch.image_indices).loss),
             "SCST, greedy baseline": step(lambda: objectives["greedy"](model, ann, batch.image_indices).loss)}
    for fn in steps.values():
        fn()  # warm-up
    spent: dict[str, float] = defaultdict(float)
    _time_parts(device, spent)
    times = {name: [] for name in steps}
    parts = {name: [] for name in PARTS}
    for _ in range(args.rounds):
        for name, fn in steps.items():
            spent.clear()
            times[name].append(_timed(fn, device))
            if name == "SCST, loo baseline":
                for part in PARTS:
                    parts[part].append(spent[part])

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {args.threads} thread(s)"
    print(f"{where}; torch {torch.__version__}; {args.weights}: decoder over cached annotations, batch "
          f"{args.batch_size}, k {args.samples}, max_len {args.max_len}; medians of {args.rounds} rounds")
    xe = statistics.median(times["cross-entropy"])
    print("| step | seconds | x cross-entropy |\n|---|---|---|")
    for n, t in times.items():
        print(f"| {n} | {statistics.median(t):.4f} | {statistics.median(t) / xe:.2f} |")
    loo = times["SCST, loo baseline"]
    rest = [total - sum(parts[p][r] for p in PARTS) for r, total in enumerate(loo)]
    print("\n| part of an SCST step (loo) | seconds | share |\n|---|---|---|")
    for name, values in [*((PARTS[p], parts[p]) for p in PARTS if p != "greedy"), ("backward and optimizer", rest)]:
        median = statistics.median(values)
        print(f"| {name} | {median:.4f} | {median / statistics.median(loo):.0%} |")
    greedy_part = [t - loo_t for t, loo_t in zip(times["SCST, greedy baseline"], loo)]
    print(f"\nthe greedy baseline's extra caption and rewards: {statistics.median(greedy_part):+.4f} s a step")


if __name__ == "__main__":
    main()
