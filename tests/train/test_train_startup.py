"""Training on real data layouts: what it says at start-up, damaged images, folders it cannot
write, a disk that fills up, and the lines it prints while it runs."""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch

from captioner.cli.main import main as captioner_main
from captioner.data.coco import load_split
from captioner.io.checkpoint import load_checkpoint
from captioner.train.config import DataConfig, to_toml
from captioner.train.data_cli import main as data_main
from tests.builders import coco_config, one_line, tiny_train_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "train" / "configs"
DAMAGED = "COCO_train2014_000000000030.jpg"
WHOLE_EPOCH = ["--set", "optim.max_steps=0", "--set", "optim.epochs=1"]  # every training image is read


def _damage(photos: Path) -> Path:
    path = photos / "coco" / "train2014" / DAMAGED
    path.write_bytes(path.read_bytes()[:400])  # a JPEG cut short, as a failed copy leaves it
    return path


def _cached(**extra):
    return {"data__feature_cache": True, "model__freeze_encoder": True, **extra}


@pytest.mark.parametrize("cache", [False, True], ids=["images", "feature-cache"])
def test_a_damaged_training_image_stops_training_at_start_up_in_one_line_leaving_no_run_folder(
        tmp_path, photos, capsys, cache):
    _damage(photos)
    config = coco_config(tmp_path, photos, **(_cached() if cache else {}))
    run = tmp_path / "run"
    code = captioner_main(["train", "--config", str(config), "--run-dir", str(run), *WHOLE_EPOCH, "--quiet"])
    line = one_line(capsys.readouterr().err)
    assert code == 2
    assert DAMAGED in line and "truncated" in line
    assert "data.skip_unreadable" in line  # how to go on without it
    assert not run.exists()  # nothing half-made for a rerun to trip on

    # Mended, the same command trains.
    (photos / "coco" / "train2014" / DAMAGED).write_bytes(
        (ROOT / "tests" / "fixtures" / "photos" / "coco" / "train2014" / DAMAGED).read_bytes())
    assert captioner_main(["train", "--config", str(config), "--run-dir", str(run), *WHOLE_EPOCH, "--quiet"]) == 0
    assert load_checkpoint(run / "last.pt").train_state.epoch == 1


@pytest.mark.parametrize("cache", [False, True], ids=["images", "feature-cache"])
def test_with_skip_unreadable_training_leaves_damaged_images_out_and_counts_them(tmp_path, photos, capsys, cache):
    _damage(photos)
    config = coco_config(tmp_path, photos, data__skip_unreadable=True, **(_cached() if cache else {}))
    run = tmp_path / "run"
    assert captioner_main(["train", "--config", str(config), "--run-dir", str(run), *WHOLE_EPOCH, "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "train: 7 images, 35 captions" in err  # 8 images, one left out
    assert "1 unreadable image left out" in err
    assert load_checkpoint(run / "last.pt").train_state.epoch == 1  # every kept image was read


class _ReadOnly:
    """Writes under ``folder`` fail as on a read-only file system (the tests run as root, whom
    chmod does not stop). Reading is untouched."""

    def __init__(self, monkeypatch, folder: Path):
        self.folder = str(folder)
        real_open, real_os_open, real_mkdir = builtins.open, os.open, os.mkdir

        def refuse(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

        def guarded_open(file, mode="r", *args, **kwargs):
            if isinstance(file, (str, os.PathLike)) and self._inside(file) and any(c in mode for c in "wax+"):
                refuse(file)
            return real_open(file, mode, *args, **kwargs)

        def guarded_os_open(path, flags, *args, **kwargs):
            if self._inside(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                refuse(path)
            return real_os_open(path, flags, *args, **kwargs)

        def guarded_mkdir(path, *args, **kwargs):
            if self._inside(path):
                refuse(path)
            return real_mkdir(path, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", guarded_open)
        monkeypatch.setattr(io, "open", guarded_open)
        monkeypatch.setattr(os, "open", guarded_os_open)
        monkeypatch.setattr(os, "mkdir", guarded_mkdir)

    def _inside(self, path) -> bool:
        return os.path.abspath(os.fspath(path)).startswith(self.folder + os.sep)


def test_a_read_only_run_folder_is_one_line_for_a_new_run_and_for_a_resumed_one(tiny_coco, tmp_path, capsys,
                                                                                 monkeypatch):
    cfg_path = tmp_path / "cfg.toml"
    cfg_path.write_text(to_toml(tiny_train_config(tiny_coco, **{"optim.max_steps": 2, "val.every_epochs": 0})))
    old = tmp_path / "shelf" / "old-run"
    assert captioner_main(["train", "--config", str(cfg_path), "--run-dir", str(old), "--quiet"]) == 0
    before = (old / "last.pt").read_bytes()
    capsys.readouterr()

    _ReadOnly(monkeypatch, tmp_path / "shelf")
    new = tmp_path / "shelf" / "new-run"
    assert captioner_main(["train", "--config", str(cfg_path), "--run-dir", str(new), "--quiet"]) == 2
    line = one_line(capsys.readouterr().err)
    assert str(new) in line and "Read-only file system" in line
    assert not new.exists()

    assert captioner_main(["train", "--resume", str(old), "--set", "optim.max_steps=4", "--quiet"]) == 2
    line = one_line(capsys.readouterr().err)
    assert str(old) in line and "Read-only file system" in line
    assert (old / "last.pt").read_bytes() == before


def test_a_full_disk_mid_run_stops_in_one_line_and_the_last_checkpoint_stays_intact(tiny_coco, tmp_path, capsys,
                                                                                     monkeypatch):
    cfg_path = tmp_path / "cfg.toml"
    cfg_path.write_text(to_toml(tiny_train_config(tiny_coco, **{"optim.max_steps": 12, "optim.save_every": 2,
                                                                "val.every_epochs": 0})))
    import captioner.train.loop

    real_fdopen, real_save, saved = os.fdopen, captioner.train.loop.atomic_save, []

    class FullDisk:
        """A file on a disk that fills up half-way through the write."""

        def __init__(self, f):
            self.f, self.written = f, 0

        def write(self, data):
            if self.written > 1000:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.written += len(data)
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def fdopen(fd, *args, **kwargs):  # the third checkpoint finds the disk full
        f = real_fdopen(fd, *args, **kwargs)
        return FullDisk(f) if len(saved) == 2 else f

    def atomic_save(obj, path):
        real_save(obj, path)
        saved.append(obj["train_state"]["step"])

    monkeypatch.setattr(os, "fdopen", fdopen)
    monkeypatch.setattr(captioner.train.loop, "atomic_save", atomic_save)
    run = tmp_path / "run"
    code = captioner_main(["train", "--config", str(cfg_path), "--run-dir", str(run), "--quiet"])
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]  # after the start-up summary
    assert code == 1 and "Traceback" not in err and line.startswith("captioner train: error: ")
    assert "No space left on device" in line and str(run / "last.pt") in line and f"--resume {run}" in line
    assert load_checkpoint(run / "last.pt").train_state.step == saved[-1]  # the last good one, whole
    # no temporary file (beside TensorBoard's event files, written through the writer's own thread)
    kept = sorted(p.name for p in run.iterdir() if not p.name.startswith("events.out.tfevents."))
    assert kept == ["config.toml", "last.pt", "metrics.jsonl"]


def test_a_feature_cache_that_does_not_fit_on_the_disk_isone_line(tmp_path, photos, capsys, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    config = coco_config(tmp_path, photos, **_cached())
    run = tmp_path / "run"
    code = captioner_main(["train", "--config", str(config), "--run-dir", str(run), "--quiet"])
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert code == 1 and "Traceback" not in "\n".join(lines)
    assert "feature cache" in lines[-1] and "No space left on device" in lines[-1]
    assert not run.exists()  # the run wrote nothing else: its folder goes


def test_the_data_summary_comes_before_the_feature_cache_is_built(tmp_path, photos, capsys, monkeypatch):
    import captioner.train.features

    real = captioner.train.features.build_cache

    def build_cache(*args, **kwargs):
        print("<building the feature cache>", file=sys.stderr)
        return real(*args, **kwargs)

    monkeypatch.setattr(captioner.train.features, "build_cache", build_cache)
    config = coco_config(tmp_path, photos, **_cached())
    assert captioner_main(["train", "--config", str(config), "--run-dir", str(tmp_path / "run"), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert err.index("train: 8 images") < err.index("vocabulary:") < err.index("run folder:") \
        < err.index("<building the feature cache>")


@pytest.mark.parametrize("config, data_dir", [("coco-vgg19-soft.toml", "coco"),
                                              ("flickr8k-vgg19-soft.toml", "flickr8k/Flicker8k_Dataset")])
def test_set_data_dir_moves_the_split_file_with_it(tmp_path, photos, capsys, monkeypatch, config, data_dir):
    monkeypatch.chdir(tmp_path)  # nothing is found relative to the working folder
    code = data_main(["check", "--config", str(CONFIGS / config), "--set", f"data.dir={photos / data_dir}",
                      "--workers", "0", "--quiet"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert re.search(r"all \d+ images found and decoded", captured.out)


@pytest.mark.slow
def test_loader_workers_are_a_ceiling_of_the_machines_cores(tmp_path, photos, capsys, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # a two-core machine, for torch too
    monkeypatch.setattr("captioner.batching.CGROUP", tmp_path / "no-cgroup")  # and no CPU quota
    assert DataConfig(workers=8).loader_workers() == 2
    assert DataConfig(workers=1).loader_workers() == 1 and DataConfig(workers=0).loader_workers() == 0
    assert DataConfig().loader_workers() == 2  # the default: the machine's cores
    for path in CONFIGS.glob("*.toml"):  # a config that asks for workers says it is a ceiling
        text = path.read_text()
        if re.search(r"^workers = [1-9]", text, re.M):
            assert re.search(r"^workers = \d+ +#.*ceiling", text, re.M), path.name

    config = coco_config(tmp_path, photos, **_cached())
    eight = ["--set", "data.workers=8"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert data_main(["check", "--config", str(config), *eight, "--quiet"]) == 0
        assert captioner_main(["train", "--config", str(config), "--run-dir", str(tmp_path / "run"), *eight,
                               "--set", "optim.epochs=2", "--set", "optim.max_steps=0", "--quiet"]) == 0
    assert not [w for w in caught if "worker" in str(w.message)], [str(w.message) for w in caught]


def test_empty_captions_are_left_out_and_counted_beside_the_long_ones(tmp_path, photos, capsys):
    split_file = photos / "coco" / "dataset_coco.json"
    data = json.loads(split_file.read_text())
    data["images"][0]["sentences"].append({"raw": "", "tokens": []})
    data["images"][1]["sentences"].append({"raw": " .\n", "tokens": []})
    split_file.write_text(json.dumps(data))
    annotations = photos / "coco" / "annotations" / "captions_train2014.json"
    anns = json.loads(annotations.read_text())
    anns["annotations"].append({"id": 999_999, "image_id": anns["images"][0]["id"], "caption": "   \n"})
    annotations.write_text(json.dumps(anns))

    assert data_main(["check", "--config", str(coco_config(tmp_path, photos)), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "train: 8 images, 40 captions, 5.0 per image (min 5, max 5)" in out  # as before the two were added
    assert "3 training captions over 20 words and 2 empty captions left out" in out
    official = load_split(photos / "coco", "train2014")
    assert all(c.strip() for r in official for c in r.captions)
    assert sum(r.empty_captions for r in official) == 1


def test_training_says_what_it_did_in_figures_a_reader_can_use(tiny_coco, tmp_path, capsys):
    cfg = tiny_train_config(tiny_coco, **{"optim.max_steps": 6, "optim.epochs": 30, "val.every_epochs": 1})
    cfg_path = tmp_path / "cfg.toml"
    cfg_path.write_text(to_toml(cfg))
    run = tmp_path / "run"
    assert captioner_main(["train", "--config", str(cfg_path), "--run-dir", str(run), "--quiet"]) == 0
    lines = capsys.readouterr().err.splitlines()
    vals = [x for x in lines if ": val BLEU-1 " in x]
    assert vals and "(first validation: saved as best.pt)" in vals[0]
    assert not any(x.endswith("(best)") for x in vals)
    last = lines[-1]
    assert last.startswith("stopped at optim.max_steps = 6: step 6, 1 of 30 epochs done;"), last
    figure = re.search(r"best val BLEU-1 (\S+) ", last).group(1)
    assert re.fullmatch(r"\d\.\d{4}|\d\.\d\de-\d\d", figure), last  # 0.1234, or 3.83e-13: never 17 digits
    assert float(figure) == pytest.approx(load_checkpoint(run / "best.pt").meta["val_BLEU-1"], rel=1e-2)


def test_checking_the_images_draws_nothing_from_the_global_random_state(tiny_coco):
    """Training checks its images before it builds the model: its initial weights (the same on
    every rank, the same as before the check existed) must not depend on the check."""
    from captioner.data.images import Preprocess
    from captioner.train.image_check import unreadable_images

    paths = sorted((tiny_coco / "images").glob("*.png"))
    torch.manual_seed(0)
    before = torch.get_rng_state()
    assert unreadable_images(paths, Preprocess(size=(16, 16)), workers=0, progress=False) == {}
    assert torch.equal(torch.get_rng_state(), before)


def test_generated_shapes_follow_the_top_to_bottom_option(tmp_path: Path) -> None:
    """``data.shapes_top_to_bottom`` reaches the generator when training makes its data."""
    from captioner.train.config import load_config
    from captioner.train.startup import prepare_data

    for on in (False, True):
        out = tmp_path / f"shapes-{on}"
        cfg = load_config(None, [f"data.dir={out}", "data.generate_shapes=true", "data.shapes_train=40",
                                 "data.shapes_val=2", "data.shapes_image_size=48",
                                 f"data.shapes_top_to_bottom={str(on).lower()}"])
        prepare_data(cfg)
        assert ("from top to bottom" in (out / "captions_train.json").read_text()) == on


# --- mistakes caught before the work: resume, data folder, checkpoints, encoder weights ------

def _tiny_run(tiny_coco, tmp_path, name="cfg.toml", **sets) -> Path:
    cfg_path = tmp_path / name
    cfg_path.write_text(to_toml(tiny_train_config(tiny_coco, **{"optim.max_steps": 2, "val.every_epochs": 0, **sets})))
    return cfg_path


def test_resume_refuses_another_config_and_changes_beyond_the_run_s_length(tiny_coco, tmp_path, capsys):
    cfg_path = _tiny_run(tiny_coco, tmp_path)
    run = tmp_path / "run"
    assert captioner_main(["train", "--config", str(cfg_path), "--run-dir", str(run), "--quiet"]) == 0
    before = (run / "last.pt").read_bytes()
    other = _tiny_run(tiny_coco, tmp_path, "other.toml", **{"optim.threads": 1, "model.freeze_encoder": True,
                                                             "data.feature_cache": True})
    capsys.readouterr()

    assert captioner_main(["train", "--resume", str(run), "--config", str(other), "--quiet"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "--config does not go with --resume" in line and "optim.max_steps" in line
    assert captioner_main(["train", "--resume", str(run), "--set", "optim.lr=0.5", "--quiet"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "--set optim.lr=0.5: a resumed run keeps its config" in line
    assert (run / "last.pt").read_bytes() == before  # nothing merged, nothing trained

    assert captioner_main(["train", "--resume", str(run), "--set", "optim.max_steps=3", "--quiet"]) == 0
    assert load_checkpoint(run / "last.pt").train_state.step == 3  # a longer run goes on


def test_shapes_are_generated_only_into_an_empty_folder_or_a_shapes_one(tmp_path, capsys):
    photos = tmp_path / "own-photos"
    photos.mkdir()
    (photos / "holiday.jpg").write_bytes(b"my photo")
    small = ["--set", "data.shapes_train=4", "--set", "data.shapes_val=2", "--set", "optim.max_steps=1",
             "--set", "val.limit=2"]  # short, were it to run
    code = captioner_main(["train", "--config", str(CONFIGS / "shapes-soft.toml"), "--run-dir",
                           str(tmp_path / "run"), "--set", f"data.dir={photos}", *small, "--quiet"])
    line = one_line(capsys.readouterr().err)
    assert code == 2 and "holds files that are not generated shapes (such as" in line and "holiday.jpg" in line
    assert sorted(p.name for p in photos.iterdir()) == ["holiday.jpg"]
    assert not (tmp_path / "run").exists()

    from captioner.train.startup import check_shapes_folder

    cut_short = tmp_path / "cut-short"  # a generation killed half-way is written again
    (cut_short / "images" / "train").mkdir(parents=True)
    (cut_short / "images" / "train" / "train_000000.png").write_bytes(b"")
    (cut_short / "instances_val.json").write_text("{}")
    check_shapes_folder(DataConfig(dir=str(cut_short), generate_shapes=True))
    check_shapes_folder(DataConfig(dir=str(tmp_path / "new"), generate_shapes=True))
    (tmp_path / "empty").mkdir()
    check_shapes_folder(DataConfig(dir=str(tmp_path / "empty"), generate_shapes=True))


def test_init_from_takes_a_bundled_name_or_a_path_beside_the_config_from_any_folder(tiny_coco, tmp_path, capsys,
                                                                                    monkeypatch):
    first = tmp_path / "first"
    assert captioner_main(["train", "--config", str(_tiny_run(tiny_coco, tmp_path)), "--run-dir", str(first),
                           "--quiet"]) == 0
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "start.pt").write_bytes((first / "last.pt").read_bytes())
    cfg_path = _tiny_run(tiny_coco, configs, **{"model.init_from": "start.pt"})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert captioner_main(["train", "--config", str(cfg_path), "--run-dir", "run", "--quiet"]) == 0, \
        capsys.readouterr().err
    assert load_checkpoint(elsewhere / "run" / "last.pt").train_state.config["model"]["init_from"] == \
        str(configs / "start.pt")

    # The shipped SCST config from another folder: its demo-soft is found, and a missing
    # checkpoint is one line before any data is generated.
    from captioner.train.config import load_config
    from captioner.train.startup import check_new_run

    cfg = load_config(CONFIGS / "shapes-scst.toml", [f"data.dir={tmp_path / 'shapes'}"])
    check_new_run(cfg, CONFIGS / "shapes-scst.toml")
    assert cfg.model.init_from == "demo-soft"
    capsys.readouterr()
    code = captioner_main(["train", "--config", str(CONFIGS / "shapes-scst.toml"), "--set",
                           f"data.dir={tmp_path / 'shapes'}", "--set", "model.init_from=runs/nope/best.pt", "--quiet"])
    line = one_line(capsys.readouterr().err)
    assert code == 2 and "model.init_from: no such checkpoint runs/nope/best.pt" in line and "demo-soft" in line
    assert not (tmp_path / "shapes").exists() and not (elsewhere / "runs").exists()


def test_a_pretrained_encoder_offline_is_one_line_naming_the_file_and_the_key(tiny_coco, tmp_path, capsys,
                                                                               monkeypatch):
    import urllib.error

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))

    def offline(url, dst, *args, **kwargs):
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    cfg_path = _tiny_run(tiny_coco, tmp_path, **{"model.encoder": "resnet18", "model.encoder_pretrained": True})
    run = tmp_path / "run"
    assert captioner_main(["train", "--config", str(cfg_path), "--run-dir", str(run), "--quiet"]) == 2
    line = one_line(capsys.readouterr().err)
    assert str(tmp_path / "torch" / "hub" / "checkpoints" / "resnet18-") in line
    assert "https://download.pytorch.org/models/resnet18-" in line
    assert "--set model.encoder_pretrained=false" in line and "set pretrained = false" not in line
    assert not run.exists()


def test_a_vocabulary_of_special_tokens_only_is_refused_inone_line(tiny_coco, tmp_path, capsys):
    cfg_path = _tiny_run(tiny_coco, tmp_path, **{"data.min_count": 50})
    run = tmp_path / "run"
    assert captioner_main(["train", "--config", str(cfg_path), "--run-dir", str(run), "--quiet"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "the vocabulary has no words" in line and "data.min_count = 50" in line
    assert not run.exists()
