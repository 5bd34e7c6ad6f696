"""Time of a self-critical training step against a cross-entropy step, and what it spends
on each part: drawing the k samples, their CIDEr-D rewards, the greedy baseline's caption,
and the teacher-forced log-probabilities with their backward.

    python benchmarks/bench_scst.py                       # demo-soft, shapes, batch 32, k 5
    python benchmarks/bench_scst.py --device cuda --rounds 20

The model reads cached annotations (the encoder frozen, as in train/configs/shapes-scst.toml),
so a step is the decoder's. Rounds interleave the three steps (cross-entropy, SCST with the
leave-one-out baseline, SCST with the greedy baseline), so the ratios are measured side by
side; the figures are medians over the rounds. The parts are timed in a separate pass
that runs the objective's phases one by one.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from captioner.data.coco import load_split
from captioner.data.shapes import generate_dataset
from captioner.decoding import greedy
from captioner.encoders import Annotations
from captioner.inference import Captioner
from captioner.train.config import ScstConfig
from captioner.train.losses import soft_loss
from captioner.train.scst import ScstObjective, _dropout_off, sample_captions, sample_log_probs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


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
        images = torch.stack([cap.preprocess(cap.preprocess.load(r.path)) for r in records]).to(device)
    with torch.no_grad():
        ann = model.encode(images)
    ann = Annotations(ann.vectors.detach(), ann.grid)
    index = torch.arange(len(records))
    refs = [r.captions for r in records]
    captions = [r.captions[0] for r in records]
    tokens = torch.zeros(len(captions), args.max_len + 2, dtype=torch.long)
    lengths = torch.zeros(len(captions), dtype=torch.long)
    for i, c in enumerate(captions):
        ids = cap.vocab.encode(c)[: args.max_len + 2]
        tokens[i, : len(ids)] = torch.tensor(ids)
        lengths[i] = len(ids)
    tokens, lengths = tokens[:, : int(lengths.max())].to(device), lengths.to(device)
    params = [p for p in model.decoder.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-9)  # a real update's cost, a negligible change
    base = ScstConfig(enabled=True, samples=args.samples, max_len=args.max_len)
    objectives = {b: ScstObjective(replace(base, baseline=b), cap.vocab, refs, device=device)
                  for b in ("loo", "greedy")}

    def xe_step() -> None:
        opt.zero_grad(set_to_none=True)
        soft_loss(model, ann, tokens, lengths, 0.0).loss.backward()
        opt.step()

    def scst_step(baseline: str):
        def step() -> None:
            opt.zero_grad(set_to_none=True)
            objectives[baseline](model, ann, index).loss.backward()
            opt.step()
        return step

    steps = {"cross-entropy": xe_step, "SCST, loo baseline": scst_step("loo"),
             "SCST, greedy baseline": scst_step("greedy")}
    for fn in steps.values():
        fn()  # warm-up
    times = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, fn in steps.items():
            times[name].append(_timed(fn, device))

    # The parts, phase by phase, as ScstObjective runs them.
    loo = objectives["loo"]
    parts = {"draw k samples": [], "CIDEr-D rewards": [], "greedy caption": [], "log p + backward": []}
    for _ in range(args.rounds):
        with _dropout_off(model), torch.no_grad():
            held = {}
            parts["draw k samples"].append(_timed(lambda: held.update(s=sample_captions(
                model.decoder, ann, cap.vocab, k=args.samples, max_len=args.max_len, generator=loo.generator)), device))
            rows = [i for i in index.tolist() for _ in range(args.samples)]
            parts["CIDEr-D rewards"].append(_timed(lambda: loo.rewards(held["s"].words, rows), device))
            parts["greedy caption"].append(_timed(lambda: greedy(
                model.decoder, ann, start=cap.vocab.start, end=cap.vocab.end, pad=cap.vocab.pad,
                max_len=args.max_len), device))

        def forward_backward() -> None:
            with _dropout_off(model):
                log_p, _ = sample_log_probs(model, ann, held["s"], cap.vocab)
            log_p.mean().backward()
        parts["log p + backward"].append(_timed(forward_backward, device))

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {args.threads} thread(s)"
    print(f"{name}; torch {torch.__version__}; {args.weights}: decoder over cached annotations, batch "
          f"{args.batch_size}, k {args.samples}, max_len {args.max_len}; medians of {args.rounds} rounds")
    xe = statistics.median(times["cross-entropy"])
    print("| step | seconds | x cross-entropy |\n|---|---|---|")
    for n, t in times.items():
        m = statistics.median(t)
        print(f"| {n} | {m:.4f} | {m / xe:.2f} |")
    step = statistics.median(times["SCST, loo baseline"])
    print("\n| part of an SCST step | seconds | share of the loo step |\n|---|---|---|")
    for n, t in parts.items():
        m = statistics.median(t)
        print(f"| {n} | {m:.4f} | {m / step:.0%} |")


if __name__ == "__main__":
    main()
