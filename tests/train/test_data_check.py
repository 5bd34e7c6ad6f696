"""`captioner data check`, missing data as one-line errors (exit 2), and the start-up summary."""

from __future__ import annotations

from pathlib import Path

import pytest

from captioner.cli.main import main as captioner_main
from captioner.train.data_cli import main as data_main
from tests.builders import coco_config


def test_check_passes_and_summarises(tmp_path, photos, capsys):
    config = coco_config(tmp_path, photos)
    assert data_main(["check", "--config", str(config), "--workers", "2", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "train: 8 images, 40 captions, 5.0 per image (min 5, max 5)" in out  # 7 train2014 + 1 restval
    assert "val: 2 images" in out and "test: 2 images" in out
    assert "3 training captions over 20 words left out" in out
    assert "vocabulary:" in out and "min_count 1" in out
    assert "all 12 images found and decoded" in out


def test_check_reports_missing_and_unreadable_images(tmp_path, photos, capsys):
    coco = photos / "coco"
    (coco / "val2014" / "COCO_val2014_000000000074.jpg").unlink()
    (coco / "train2014" / "COCO_train2014_000000000030.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    assert data_main(["check", "--config", str(coco_config(tmp_path, photos)), "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "2 images of 12 cannot be used" in out
    assert "COCO_val2014_000000000074.jpg: missing" in out
    assert "COCO_train2014_000000000030.jpg:" in out and "truncated" in out


@pytest.mark.parametrize("remove, named", [("dataset_coco.json", "dataset_coco.json"),
                                           ("val2014", "val2014")])
def test_missing_data_is_one_line_exit_2_for_check_train_and_evaluate(tmp_path, photos, capsys, remove, named):
    import shutil

    target = photos / "coco" / remove
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    config = coco_config(tmp_path, photos)
    if remove == "val2014":  # the check itself runs, and lists the missing images: exit 1
        assert data_main(["check", "--config", str(config), "--quiet"]) == 1
        assert capsys.readouterr().out.count(".jpg: missing") == 5  # every val2014 image, by name
    else:  # nothing to check without the split file: exit 2, one line
        assert data_main(["check", "--config", str(config)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and named in err and "Traceback" not in err

    assert captioner_main(["train", "--config", str(config), "--run-dir", str(tmp_path / "run"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err and "Traceback" not in err
    assert not (tmp_path / "run" / "last.pt").exists()

    assert captioner_main(["evaluate", "--data", str(photos / "coco"), "--split", "test",
                           "--karpathy", str(photos / "coco" / "dataset_coco.json"), "--weights", "demo-soft",
                           "--no-meteor"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err and "Traceback" not in err


def test_missing_split_file_says_where_to_get_it(tmp_path, photos, capsys):
    (photos / "coco" / "dataset_coco.json").unlink()
    data_main(["check", "--config", str(coco_config(tmp_path, photos))])
    assert "cs.stanford.edu/people/karpathy/deepimagesent" in capsys.readouterr().err


def test_training_prints_the_start_up_summary(tmp_path, photos, capsys):
    config = coco_config(tmp_path, photos)
    assert captioner_main(["train", "--config", str(config), "--run-dir", str(tmp_path / "run"), "--quiet"]) == 0
    err = capsys.readouterr().err
    for expected in (f"data: {photos / 'coco'}", "train: 8 images", "val: 2 images",
                     "3 training captions over 20 words left out", "vocabulary:", "parameters",
                     "device: cpu, 1 thread", f"run folder: {tmp_path / 'run'}"):
        assert expected in err, expected


def test_flickr8k_layout_checks(tmp_path, photos, capsys):
    flickr = photos / "flickr8k"
    config = tmp_path / "flickr.toml"
    config.write_text(f'name = "f"\n[data]\ndir = "{flickr / "Flicker8k_Dataset"}"\n'
                      f'karpathy = "{flickr / "dataset_flickr8k.json"}"\nmin_count = 1\nworkers = 0\n')
    assert data_main(["check", "--config", str(config), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "train: 5 images" in out and "val: 1 image," in out and "test: 2 images" in out
    assert "all 8 images found and decoded" in out


# The paper's recipe; the self-critical fine-tuning configs follow Rennie et al. instead.
PAPER_CONFIGS = sorted(p for p in (Path(__file__).parents[2] / "train" / "configs").glob("*-vgg19-*.toml")
                       if "scst" not in p.stem)


@pytest.mark.parametrize("path", PAPER_CONFIGS, ids=[p.stem for p in PAPER_CONFIGS])
def test_paper_configs_use_the_papers_encoder_and_say_where_they_depart(path):
    from captioner.train.config import load_config

    cfg = load_config(path)
    m = cfg.model
    assert (m.encoder, m.image_size, m.resize, m.fine_tune_blocks) == ("vgg19", 224, 256, 0)
    assert m.encoder_pretrained and cfg.data.max_vocab == 10000 and cfg.optim.batch_size == 64
    assert cfg.val.metric == "BLEU-4"
    header = path.read_text().split("\nname =")[0]
    assert "Departs from the paper" in header


def test_no_other_config_claims_the_papers_settings():
    for path in (Path(__file__).parents[2] / "train" / "configs").glob("coco-*.toml"):
        header = path.read_text().split("\nname =")[0]
        assert "Departs from the paper" in header, path.name
        assert "as in the paper" not in header and "the paper's settings" not in header, path.name


def test_data_command_is_registered_as_captioner_data(tmp_path, photos, capsys):
    # pyproject's entry point puts `data` under the `captioner` command, as `train` and `app`.
    import argparse
    import importlib
    import tomllib

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    target = project["project"]["entry-points"]["captioner.commands"]["data"]
    module, func = target.split(":")
    parser = argparse.ArgumentParser(prog="captioner")
    getattr(importlib.import_module(module), func)(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["data", "check", "--config", str(coco_config(tmp_path, photos)), "--quiet"])
    assert args.func(args) == 0
    assert "all 12 images found and decoded" in capsys.readouterr().out
