"""TensorBoard event files in the run folder: ``tensorboard --logdir runs`` shows every run's curves.

What a run writes (rank 0 alone; ``log.tensorboard = false``: nothing), each at its step:

- at every log line (``optim.log_every`` steps), the figures of that metrics.jsonl line, averaged
  over the ranks: ``train/loss`` (what backward() follows), its parts ``train/cross_entropy`` and
  ``train/doubly_stochastic`` (the penalty before its lambda), with hard attention REINFORCE's
  ``train/reward``, ``train/baseline`` and ``train/entropy``, with self-critical training its
  ``train/reward``; ``lr/decoder`` (and ``lr/encoder`` where the encoder trains); ``speed/steps_per_s``
  and ``speed/images_per_s`` since the line before (training time, saving and validation left out);
- at every validation, each figure of its metrics.jsonl line as ``val/NAME``, and for the first
  ``log.tensorboard_images`` images of the validation split (the same ones every time) the
  attention figure as ``captioner caption --attention-dir`` draws it (``attention/N``) and the
  caption (``caption/N``): over a run, the maps learning where to look.

A resumed run goes on with the same curves: its writer purges every event at a step after the
checkpoint it resumed from (SummaryWriter's ``purge_step``), which a killed run may have written
past its last save, so that no step is shown twice. Without the ``tensorboard`` package the run
says so once and trains on.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from captioner.data.coco import ImageRecord
from captioner.data.images import load_image
from captioner.inference import Captioner, DecodeOptions

# A metrics.jsonl training field -> its tag; fields not named here (step, epoch, the time) are not curves.
TRAINING_TAGS = {"loss": "train/loss", "nll": "train/cross_entropy", "penalty": "train/doubly_stochastic",
                 "reward": "train/reward", "baseline": "train/baseline", "entropy": "train/entropy",
                 "grad_scale": "train/grad_scale"}
LR_TAGS = ("lr/decoder", "lr/encoder")  # the optimiser's parameter groups, in build_run's order


class Board:
    """The run's event files, written by rank 0: one ``SummaryWriter`` in the run folder."""

    def __init__(self, writer, figure_images: list[ImageRecord], step: int, train_seconds: float) -> None:
        self.writer = writer
        self.figure_images = figure_images
        self._since = (step, train_seconds)  # the last log line's step and training time, for the speeds
        self._images = 0  # training images (caption, image pairs) since then

    def took(self, images: int) -> None:
        """A training step on a global batch of ``images``: counted for images/s."""
        self._images += images

    def training(self, step: int, record: dict, lrs: list[float], train_seconds: float) -> None:
        """A log line's figures (``record``: the metrics.jsonl line) at ``step``."""
        add = self.writer.add_scalar
        for key, tag in TRAINING_TAGS.items():
            if record.get(key) is not None:
                add(tag, record[key], step)
        for tag, lr in zip(LR_TAGS, lrs):
            add(tag, lr, step)
        last_step, last_seconds = self._since
        seconds = train_seconds - last_seconds
        if seconds > 0 and step > last_step:
            add("speed/steps_per_s", (step - last_step) / seconds, step)
            add("speed/images_per_s", self._images / seconds, step)
        self._since, self._images = (step, train_seconds), 0

    def validation(self, step: int, figures: dict, captioner: Captioner, options: DecodeOptions) -> None:
        """A validation's figures (None, where nothing was scored, is left out) and the attention
        figures of ``figure_images`` captioned by ``captioner`` (in eval mode, the weights
        validated) with validation's ``options``. Drawing them draws no random number the run
        would otherwise draw: a run writes the same weights with the board or without."""
        for name, value in figures.items():
            if value is not None:
                self.writer.add_scalar(f"val/{name}", float(value), step)
        if not self.figure_images:
            return
        from captioner.overlay import attention_figure

        device = captioner.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            images = [load_image(r.path) for r in self.figure_images]
            results = captioner.caption_images(images, options)
        for i, (record, image, result) in enumerate(zip(self.figure_images, images, results), start=1):
            figure = attention_figure(captioner.preprocess.seen(image), result)
            self.writer.add_image(f"attention/{i}", np.asarray(figure), step, dataformats="HWC")
            self.writer.add_text(f"caption/{i}", f"{Path(record.path).name}: {result.caption}", step)

    def close(self) -> None:
        try:
            self.writer.close()
        except OSError as e:  # a full disk: the curves lose their last points, the run nothing
            print(f"TensorBoard's event files could not be written whole: {e.strerror or e}", file=sys.stderr)


class NoBoard:
    """No event files: another rank's, or ``log.tensorboard = false``, or no ``tensorboard``."""

    def took(self, images: int) -> None:
        pass

    def training(self, step: int, record: dict, lrs: list[float], train_seconds: float) -> None:
        pass

    def validation(self, step: int, figures: dict, captioner: Captioner, options: DecodeOptions) -> None:
        pass

    def close(self) -> None:
        pass


def open_board(run_dir: Path, *, enabled: bool, main: bool, figure_images: list[ImageRecord],
               resumed_at: int | None, train_seconds: float = 0.0) -> Board | NoBoard:
    """The run's board: a ``Board`` writing into ``run_dir`` on rank 0 (``main``) when ``enabled``,
    else a ``NoBoard``. ``resumed_at``: the step of the checkpoint a resumed run goes on from (every
    event after it is purged), None for a new run; ``train_seconds``: the run's training time there."""
    if not (enabled and main):
        return NoBoard()
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("no TensorBoard event files: the tensorboard package is not installed (pip install tensorboard); "
              "training goes on", file=sys.stderr)
        return NoBoard()
    # flush_secs: a run watched while it trains shows each log line within half a minute
    writer = SummaryWriter(log_dir=str(run_dir), flush_secs=30,
                           purge_step=resumed_at + 1 if resumed_at is not None else None)
    return Board(writer, figure_images, resumed_at or 0, train_seconds)


def event_files(run_dir: Path) -> list[Path]:
    """The run folder's TensorBoard event files."""
    return sorted(run_dir.glob("events.out.tfevents.*"))

