"""What TensorBoard's event files cost a training step: a shapes-soft run (its model, batch and
rates, on a few generated images) with every write of the board timed.

    python -m benchmarks.bench_tensorboard [--steps 60] [--train-images 320] [--threads 0]

The run logs every step (``optim.log_every = 1``, the most writing a run can ask for; the
shapes-soft config logs every 50th) and validates twice, drawing ``log.tensorboard_images`` (3)
attention figures each time. Printed: the mean training step (the run's training time over its
steps, the board's writes included), the board's time per log line (``Board.training``: a dozen
scalars handed to the writer, whose own thread writes the file) and per step (``Board.took``), so
the cost per step at log_every = 1 and at the config's log_every; and at each validation the
figures' time (``Board.validation``) against the validation's (``loop._validate_here``).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from captioner.train import loop
from captioner.train.config import load_config
from captioner.train.tensorboard import Board


def _timed(owner, name: str, spent: list[float]) -> None:
    """``owner.name`` timed: each call's seconds appended to ``spent``."""
    inner = getattr(owner, name)

    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    setattr(owner, name, call)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    p.add_argument("--train-images", type=int, default=320, help="generated training images (default 320)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)

    config = Path(__file__).resolve().parents[1] / "train" / "configs" / "shapes-soft.toml"
    logged = load_config(config).optim.log_every
    spent: dict[str, list[float]] = {"training": [], "took": [], "validation": [], "validate": []}
    for name in ("training", "took", "validation"):
        _timed(Board, name, spent[name])
    _timed(loop, "_validate_here", spent["validate"])
    with tempfile.TemporaryDirectory() as tmp:
        # Two validations: half-way (an epoch's end) and at the last step.
        per_epoch = -(-args.train_images * 5 // 32)  # 5 captions an image, batches of 32
        cfg = load_config(config, [f"data.dir={tmp}/shapes", f"data.shapes_train={args.train_images}",
                                   "data.shapes_val=8", "val.limit=8", f"optim.max_steps={args.steps}",
                                   f"optim.epochs={max(2, -(-args.steps // per_epoch))}", "optim.max_minutes=0",
                                   "optim.log_every=1", "optim.save_every=0", f"optim.threads={args.threads}",
                                   "log.tensorboard=true"])
        outcome = loop.train(cfg, Path(tmp) / "run", progress=False)
    step = outcome.train_seconds / outcome.step
    line = sum(spent["training"]) / len(spent["training"])
    took = sum(spent["took"]) / len(spent["took"])
    print(f"{outcome.step} steps of shapes-soft (batch 32), {len(spent['training'])} log lines, "
          f"{len(spent['validate'])} validations")
    print(f"training step: {1000 * step:.1f} ms (mean, the board's writes included)")
    print(f"board per log line: {1e6 * line:.0f} us; per step (counting images): {1e6 * took:.2f} us")
    for every in (1, logged):
        cost = line / every + took
        print(f"cost per step at log_every = {every}: {1e6 * cost:.1f} us = {100 * cost / step:.3f}% of a step")
    for figures, validate in zip(spent["validation"], spent["validate"]):
        print(f"validation: {validate:.2f} s, of which the board's figures and figures' captions {figures:.2f} s "
              f"({100 * figures / validate:.0f}%)")


if __name__ == "__main__":
    main()
