"""TensorBoard's event files, read back as TensorBoard reads them (its EventAccumulator): every
curve at the steps of metrics.jsonl, attention figures that decode, the same curves after a crash
and --resume with no step twice, and nothing written (nor changed) when switched off or when the
tensorboard package is missing."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import captioner.train.loop as loop
from captioner.io.checkpoint import load_checkpoint
from captioner.train.loop import train
from captioner.train.tensorboard import event_files
from tests.builders import tiny_train_config

EVERYTHING = {"scalars": 0, "images": 0, "tensors": 0}  # 0: keep every event, not a sample


def _board(run: Path) -> EventAccumulator:
    board = EventAccumulator(str(run), size_guidance=EVERYTHING)
    board.Reload()
    return board


def _steps(board: EventAccumulator, tag: str) -> list[int]:
    kind = board.Images if tag.startswith("attention/") else board.Tensors if tag.startswith("caption/") \
        else board.Scalars
    return [e.step for e in kind(tag)]


def _log(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_every_curve_is_at_its_log_lines_and_validations_and_the_figures_decode(tiny_coco, tmp_path, attention):
    run = tmp_path / "run"
    train(tiny_train_config(tiny_coco, **{"model.attention": attention, "optim.max_steps": 9,
                                          "optim.log_every": 2, "log.tensorboard_images": 2}), run, progress=False)
    log = _log(run)
    logged = [r["step"] for r in log if "nll" in r]
    validated = [r["step"] for r in log if "val" in r]
    assert logged == [2, 4, 6, 8] and validated == [4, 8, 9]  # two epochs of four batches, and the last step

    board = _board(run)
    tags = board.Tags()
    parts = ["train/loss", "train/cross_entropy", "train/doubly_stochastic", "lr/decoder", "lr/encoder",
             "speed/steps_per_s", "speed/images_per_s"]
    parts += ["train/reward", "train/baseline", "train/entropy"] if attention == "hard" else []
    assert set(parts) <= set(tags["scalars"])
    for tag in parts:
        assert _steps(board, tag) == logged, tag
    if attention == "soft":
        assert not {"train/reward", "train/baseline", "train/entropy"} & set(tags["scalars"])
    # The curves are metrics.jsonl's figures.
    for tag, key in [("train/cross_entropy", "nll"), ("train/loss", "loss"), ("lr/decoder", "lr")] + \
            ([("train/baseline", "baseline"), ("train/reward", "reward")] if attention == "hard" else []):
        assert [e.value for e in board.Scalars(tag)] == pytest.approx([r[key] for r in log if "nll" in r]), tag
    # 14 training captions in batches of 4: an epoch's fourth step takes 2. Each pair of steps took
    # 8 caption-image pairs, or 6 with an epoch's last batch.
    speeds = zip(board.Scalars("speed/steps_per_s"), board.Scalars("speed/images_per_s"))
    ratios = [images.value / steps.value for steps, images in speeds]
    assert ratios == pytest.approx([4, 3, 4, 3], rel=1e-5)

    val = [r for r in log if "val" in r]
    assert {"BLEU-1", "BLEU-4", "CIDEr"} <= set(val[0]["val"])
    for name in val[0]["val"]:
        assert [e.value for e in board.Scalars(f"val/{name}")] == pytest.approx([r["val"][name] for r in val])
    assert sorted(t for t in tags["images"]) == ["attention/1", "attention/2"]
    assert sorted(t for t in tags["tensors"] if t.startswith("caption/")) == ["caption/1/text_summary",
                                                                              "caption/2/text_summary"]
    for tag in ("attention/1", "attention/2", "caption/1/text_summary"):
        assert _steps(board, tag) == validated, tag
    for event in board.Images("attention/1"):
        figure = Image.open(io.BytesIO(event.encoded_image_string))
        figure.load()
        # the image panel, then a panel a word: at least a row of panels of 224 px, as the CLI draws it
        assert figure.size == (event.width, event.height) and figure.height > 224
    caption = board.Tensors("caption/1/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert caption.startswith("val_201.png: ")


@pytest.mark.slow
def test_a_crashed_run_resumed_shows_each_step_once_with_the_uninterrupted_run_s_figures(tiny_coco, tmp_path,
                                                                                         monkeypatch):
    sets = {"optim.max_steps": 9, "optim.save_every": 0, "log.tensorboard_images": 1}
    straight = tmp_path / "straight"
    train(tiny_train_config(tiny_coco, **sets), straight, progress=False)

    crashed = tmp_path / "crashed"
    step = loop._train_step
    taken = []

    def power_cut(*args, **kwargs):  # steps 5 and 6 are logged after last.pt (the first epoch's end), then it dies
        if len(taken) == 6:
            raise RuntimeError("power cut")
        taken.append(1)
        return step(*args, **kwargs)

    monkeypatch.setattr(loop, "_train_step", power_cut)
    with pytest.raises(RuntimeError, match="power cut"):
        train(tiny_train_config(tiny_coco, **sets), crashed, progress=False)
    monkeypatch.undo()
    assert load_checkpoint(crashed / "last.pt").train_state.step == 4
    assert [r["step"] for r in _log(crashed) if "nll" in r] == [1, 2, 3, 4, 5, 6]  # 5 and 6 will be taken again
    assert _steps(_board(crashed), "val/BLEU-1") == [4]  # and the validation at the first epoch's end
    train(None, crashed, resume=True, progress=False)
    assert len(event_files(crashed)) == 2  # the crashed writer's file and the resumed one's

    a, b = _board(straight), _board(crashed)
    assert a.Tags()["scalars"] == b.Tags()["scalars"]
    for tag in a.Tags()["scalars"]:
        steps = _steps(b, tag)
        assert steps == sorted(set(steps)) == _steps(a, tag), tag
        if not tag.startswith("speed/"):  # the same curve: the resumed run is the uninterrupted one
            assert [e.value for e in b.Scalars(tag)] == [e.value for e in a.Scalars(tag)], tag
    assert _steps(b, "attention/1") == _steps(a, "attention/1") == [4, 8, 9]


def test_switched_off_a_run_writes_no_event_file_and_the_same_weights(tiny_coco, tmp_path):
    on, off = tmp_path / "on", tmp_path / "off"
    sets = {"optim.max_steps": 5, "model.attention": "hard"}  # drawing the figures must draw no random number
    train(tiny_train_config(tiny_coco, **sets), on, progress=False)
    train(tiny_train_config(tiny_coco, **sets, **{"log.tensorboard": "false"}), off, progress=False)
    assert len(event_files(on)) == 1 and event_files(off) == []
    a, b = load_checkpoint(on / "last.pt").state_dict, load_checkpoint(off / "last.pt").state_dict
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_without_the_tensorboard_package_the_run_says_so_once_and_trains(tiny_coco, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # its import fails, as when not installed
    run = tmp_path / "run"
    outcome = train(tiny_train_config(tiny_coco, **{"optim.max_steps": 3}), run, progress=False)
    assert outcome.step == 3 and event_files(run) == []
    notes = [line for line in capsys.readouterr().err.splitlines() if "TensorBoard" in line]
    assert notes == ["no TensorBoard event files: the tensorboard package is not installed "
                     "(pip install tensorboard); training goes on"]
