"""What training and `captioner shapes` tell the user: the progress bar, the training data
named in the checkpoint, a readable summary of generated data."""

import re

from captioner.cli.main import main
from captioner.data.shapes import generate_dataset
from captioner.inference import Captioner
from captioner.io.checkpoint import load_checkpoint
from captioner.train.datainfo import load_dataset
from captioner.train.loop import train
from tests.builders import tiny_train_config

LABEL = "nll (recent mean)="  # the bar's loss: a moving average, and it says so


def _frames(err: str) -> list[str]:
    return [f.strip() for f in re.split(r"[\r\n]", err) if f.strip().startswith("epoch")]


def test_the_bar_counts_epochs_as_the_logs_do_with_a_fresh_loss_and_the_time_left(tiny_coco, tmp_path, capsys):
    # 14 captions, batch 4: 4 steps an epoch. Logging every 1,000 steps: the bar's loss must not wait for it.
    cfg = tiny_train_config(tiny_coco, **{"optim.max_steps": 9, "optim.log_every": 1000, "optim.epochs": 3,
                                          "optim.max_minutes": 30, "val.every_epochs": 1})
    train(cfg, tmp_path / "run", progress=True)
    err = capsys.readouterr().err
    frames = _frames(err)
    assert frames, err
    epochs = {int(m.group(1)) for f in frames if (m := re.match(r"epoch (\d+)/3", f))}
    assert epochs == {1, 2, 3}  # the first epoch is 1, as in "epoch 1 step 2: val ..."
    assert re.search(r"(^|\r)epoch 1 step 4: val ", err, re.M)
    # Stopped by its step limit in the third epoch: the last validation is of the third, as the
    # bar says (the summary counts the two done).
    assert re.search(r"(^|\r)epoch 3 step 9: val ", err, re.M)
    stepped = [f for f in frames if re.search(r"\| [1-9]\d*/\d+ \[", f)]  # after a step of its epoch
    assert len(stepped) >= 3 and all(LABEL in f for f in stepped)
    assert all(re.search(re.escape(LABEL) + r"\d+\.\d\d, budget left (\d+:)?\d\d:\d\d", f)
               for f in frames if LABEL in f)


def test_the_bar_s_moving_average_goes_on_across_a_resume(tiny_coco, tmp_path, monkeypatch):
    from captioner.train import loop

    cfg = tiny_train_config(tiny_coco, **{"optim.max_steps": 3, "optim.log_every": 1000, "val.every_epochs": 0})
    train(cfg, tmp_path / "run", progress=True)
    saved = load_checkpoint(tmp_path / "run" / "last.pt").train_state.shown_loss
    assert isinstance(saved, float) and saved > 0
    seen, real = [], loop._BarLoss.show

    def show(self, bar, parts, seconds):
        seen.append(self.average)
        real(self, bar, parts, seconds)

    monkeypatch.setattr(loop._BarLoss, "show", show)
    assert main(["train", "--resume", str(tmp_path / "run"), "--set", "optim.max_steps=5"]) == 0
    assert seen[0] == saved  # the first step after the resume moves the run's average, not a new one
    assert load_checkpoint(tmp_path / "run" / "last.pt").train_state.shown_loss != saved


def test_the_bar_shows_no_time_left_without_a_budget(tiny_coco, tmp_path, capsys):
    cfg = tiny_train_config(tiny_coco, **{"optim.max_steps": 2, "optim.log_every": 1000, "val.every_epochs": 0})
    train(cfg, tmp_path / "run", progress=True)
    frames = _frames(capsys.readouterr().err)
    assert any(LABEL in f for f in frames) and not any("budget left" in f for f in frames)


def test_checkpoints_name_their_training_data(tiny_coco, tmp_path):
    cfg = tiny_train_config(tiny_coco, **{"optim.max_steps": 2, "val.every_epochs": 0})
    train(cfg, tmp_path / "run", progress=False)
    for name in ("best.pt", "last.pt"):
        meta = load_checkpoint(tmp_path / "run" / name).meta
        assert meta["training_data"] == "tiny test set, train, split train"  # its description, not its folder
    cap = Captioner.load(tmp_path / "run" / "best.pt")
    assert cap.training_data.startswith("tiny test set") and not cap.shapes_only and cap.notice() is None


def test_shapes_data_is_named_synthetic_shapes(tmp_path):
    generate_dataset(tmp_path / "shapes", {"train": 2, "val": 1}, seed=3, image_size=64)
    cfg = tiny_train_config(tmp_path / "shapes")
    assert load_dataset(cfg.data).name == "synthetic shapes"


def test_the_training_data_is_named_from_its_layout_never_by_its_path(photos, tmp_path):
    coco, flickr = photos / "coco", photos / "flickr8k" / "Flicker8k_Dataset"
    named = {
        "COCO 2014, Karpathy split": tiny_train_config(coco, **{"data.karpathy": "dataset_coco.json"}),
        "COCO 2014 (fixture), split train2014": tiny_train_config(coco, **{"data.train_split": "train2014",
                                                                           "data.val_split": "val2014"}),
        "Flickr8k": tiny_train_config(flickr, **{"data.karpathy": "../dataset_flickr8k.json"}),
    }
    for name, cfg in named.items():
        assert load_dataset(cfg.data).name == name

    # What a checkpoint trained on COCO says, and what the app shows of it.
    cfg = tiny_train_config(coco, **{"data.karpathy": "dataset_coco.json", "optim.max_steps": 1, "val.limit": 1,
                                     "val.every_epochs": 0, "data.max_caption_len": 50})
    train(cfg, tmp_path / "run", progress=False)
    cap = Captioner.load(tmp_path / "run" / "best.pt")
    assert cap.training_data == "COCO 2014, Karpathy split"
    assert cap.meta["training_data"] == "COCO 2014, Karpathy split"


def test_shapes_prints_a_readable_summary(tmp_path, capsys):
    assert main(["shapes", "--out", str(tmp_path / "s"), "--train", "3", "--val", "2", "--test", "0",
                 "--image-size", "64", "--seed", "4"]) == 0
    err = capsys.readouterr().err
    assert "{" not in err and "}" not in err  # no raw Python dict
    assert f"wrote 5 images (64x64 px, seed 4) to {tmp_path / 's'}" in err
    assert re.search(r"split +images +captions +shapes", err)
    assert re.search(r"train +3 +15 +\d+ +captions_train.json", err) and re.search(r"val +2 +10 +\d+ ", err)
    assert not re.search(r"^ +test ", err, re.M)  # a split of size 0 is not written


def test_self_critical_training_shows_the_samples_reward_not_their_nll(tiny_coco, tmp_path, capsys):
    cfg = tiny_train_config(tiny_coco, **{"scst.enabled": True, "scst.samples": 3, "scst.max_len": 6,
                                          "optim.max_steps": 3, "optim.log_every": 1000, "val.every_epochs": 0})
    train(cfg, tmp_path / "run", progress=True)
    frames = _frames(capsys.readouterr().err)
    assert any(re.search(r"reward=\d+\.\d\d", f) for f in frames) and not any("nll=" in f for f in frames)


def test_best_pt_records_each_part_of_its_metric_the_validation_size_and_the_encoder_start(tiny_coco, tmp_path):
    cfg = tiny_train_config(tiny_coco, **{"optim.max_steps": 2, "val.every_epochs": 0,
                                          "val.metric": "min:BLEU-1,BLEU-4"})
    train(cfg, tmp_path / "run", progress=False)
    meta = load_checkpoint(tmp_path / "run" / "best.pt").meta
    parts = meta["val_BLEU-1"], meta["val_BLEU-4"]
    assert meta["val_min:BLEU-1,BLEU-4"] == min(parts)
    assert meta["val_images"] == 2  # the tiny set's validation split
    assert meta["encoder_weights"] == "random"  # a small encoder made from scratch
