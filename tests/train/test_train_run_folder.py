"""Nothing lost: a new run, a data set or an import into a folder that already holds one
refuses in one line (exit 2) before any work, and says how to go on; starting over in place
is asked for with --overwrite."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from captioner.cli.main import main as captioner_main
from captioner.io.checkpoint import load_checkpoint
from captioner.train.config import to_toml
from captioner.train.tensorboard import event_files
from tests.builders import one_line, tiny_train_config
from tests.tiny import tiny_captioner, write_tiny_coco


def _config(tiny_coco: Path, tmp_path: Path, steps: int) -> Path:
    path = tmp_path / f"cfg-{steps}.toml"
    path.write_text(to_toml(tiny_train_config(tiny_coco, **{"optim.max_steps": steps, "val.every_epochs": 0})))
    return path


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_a_new_run_into_a_used_run_folder_refuses_before_any_work_and_keeps_the_run(tiny_coco, tmp_path, capsys,
                                                                                      monkeypatch):
    run = tmp_path / "runs" / "a"
    assert captioner_main(["train", "--config", str(_config(tiny_coco, tmp_path, 3)), "--run-dir", str(run),
                           "--quiet"]) == 0
    before = _files(run)
    assert {"last.pt", "metrics.jsonl", "config.toml"} <= set(before)
    capsys.readouterr()

    import captioner.train.loop

    def no_work(*args, **kwargs):
        raise AssertionError("trained into a used run folder")

    monkeypatch.setattr(captioner.train.loop, "train", no_work)
    one_step = _config(tiny_coco, tmp_path, 1)
    assert captioner_main(["train", "--config", str(one_step), "--run-dir", str(run), "--quiet"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith("captioner train: error: ") and str(run) in line
    assert f"--resume {run}" in line and "--overwrite" in line and "another --run-dir" in line
    assert _files(run) == before  # the run as it was: its checkpoints, its config, its log
    monkeypatch.undo()

    # Asked for, a new run starts over in place: one run's log, one run's checkpoints.
    assert captioner_main(["train", "--config", str(one_step), "--run-dir", str(run), "--overwrite",
                           "--quiet"]) == 0
    assert load_checkpoint(run / "last.pt").train_state.step == 1
    assert len(event_files(run)) == 1  # the earlier run's curves went with its log
    steps = [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "nll" in r]
    assert steps == [1]
    assert "max_steps = 1" in (run / "config.toml").read_text()


@pytest.mark.parametrize("left", ["best.pt", "metrics.jsonl"])
def test_any_of_a_run_s_results_makes_the_folder_used(tiny_coco, tmp_path, capsys, left):
    run = tmp_path / "run"
    run.mkdir()
    (run / left).write_text("a run's result\n")
    assert captioner_main(["train", "--config", str(_config(tiny_coco, tmp_path, 1)), "--run-dir", str(run),
                           "--quiet"]) == 2
    assert left in one_line(capsys.readouterr().err)
    assert (run / left).read_text() == "a run's result\n"


def test_an_empty_folder_or_one_with_other_files_takes_a_new_run(tiny_coco, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine\n")
    assert captioner_main(["train", "--config", str(_config(tiny_coco, tmp_path, 1)), "--run-dir", str(run),
                           "--quiet"]) == 0
    assert (run / "notes.txt").read_text() == "mine\n" and (run / "last.pt").is_file()


def test_overwrite_is_for_new_runs_only(tiny_coco, tmp_path, capsys):
    run = tmp_path / "run"
    assert captioner_main(["train", "--config", str(_config(tiny_coco, tmp_path, 1)), "--run-dir", str(run),
                           "--quiet"]) == 0
    capsys.readouterr()
    assert captioner_main(["train", "--resume", str(run), "--overwrite", "--quiet"]) == 2
    assert "--overwrite" in one_line(capsys.readouterr().err)


def test_shapes_into_a_folder_that_holds_a_data_set_refuses_unless_asked(tmp_path, capsys):
    out = tmp_path / "shapes"
    args = ["shapes", "--out", str(out), "--val", "0", "--test", "0", "--image-size", "48"]
    assert captioner_main(args + ["--train", "3"]) == 0
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()

    assert captioner_main(args + ["--train", "2"]) == 2
    line = one_line(capsys.readouterr().err)
    assert str(out) in line and "--overwrite" in line and "another --out" in line
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before

    assert captioner_main(args + ["--train", "2", "--overwrite"]) == 0
    images = sorted(p.name for p in (out / "images").rglob("*.png"))
    assert images == ["train_000000.png", "train_000001.png"]  # the larger set's third image gone with it
    assert len(json.loads((out / "captions_train.json").read_text())["images"]) == 2


def test_shapes_into_a_folder_of_other_files_refuses_too(tmp_path, capsys):
    out = tmp_path / "photos"
    out.mkdir()
    (out / "holiday.jpg").write_bytes(b"not really\n")
    assert captioner_main(["shapes", "--out", str(out), "--train", "1", "--val", "0", "--test", "0"]) == 2
    assert "holiday.jpg" in one_line(capsys.readouterr().err)
    assert sorted(p.name for p in out.iterdir()) == ["holiday.jpg"]


def test_shapes_into_an_empty_folder_is_fine(tmp_path):
    assert captioner_main(["shapes", "--out", str(tmp_path), "--train", "1", "--val", "0", "--test", "0",
                           "--image-size", "48"]) == 0
    assert (tmp_path / "captions_train.json").is_file()


def test_data_import_keeps_an_earlier_dataset_json_unless_asked(tmp_path, capsys):
    coco = write_tiny_coco(tmp_path / "coco")
    images = sorted((coco / "images").rglob("*.*"))
    rows = ["image,caption"] + [f"{p},a picture number {i}" for i, p in enumerate(images)]
    (tmp_path / "c.csv").write_text("\n".join(rows) + "\n")
    out = tmp_path / "data"
    args = ["data", "import", str(tmp_path / "c.csv"), "--out", str(out), "--quiet", "--val", "1", "--test", "1"]
    assert captioner_main(args) == 0
    before = (out / "dataset.json").read_bytes()
    capsys.readouterr()

    assert captioner_main(args + ["--seed", "3"]) == 2
    line = one_line(capsys.readouterr().err)
    assert str(out / "dataset.json") in line and "--overwrite" in line and "another --out" in line
    assert (out / "dataset.json").read_bytes() == before

    assert captioner_main(args + ["--seed", "3", "--overwrite"]) == 0
    assert (out / "dataset.json").read_bytes() != before


def test_familiarity_out_keeps_another_checkpoint_unless_asked(tiny_coco, tmp_path, capsys):
    source, other = tmp_path / "a.pt", tmp_path / "b.pt"
    tiny_captioner(seed=1).save(source)
    tiny_captioner(seed=2).save(other)
    before = other.read_bytes()
    args = ["familiarity", str(source), "--data", str(tiny_coco), "--out", str(other), "--quiet", "--device", "cpu"]
    assert captioner_main(args) == 2
    line = one_line(capsys.readouterr().err)
    assert str(other) in line and "--overwrite" in line
    assert other.read_bytes() == before

    assert captioner_main(args + ["--overwrite"]) == 0
    assert load_checkpoint(other).familiarity is not None


def test_a_damaged_last_pt_on_resume_says_so_and_how_to_go_on_from_best_pt(tiny_coco, tmp_path, capsys):
    run = tmp_path / "runs" / "a"
    config = tmp_path / "cfg.toml"
    config.write_text(to_toml(tiny_train_config(tiny_coco, **{"optim.max_steps": 2})))
    assert captioner_main(["train", "--config", str(config), "--run-dir", str(run), "--quiet"]) == 0
    assert (run / "best.pt").is_file()
    whole = (run / "last.pt").read_bytes()
    (run / "last.pt").write_bytes(whole[: len(whole) // 2])  # cut short, as by a full disk or a killed copy
    capsys.readouterr()
    assert captioner_main(["train", "--resume", str(run), "--quiet"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "PytorchStreamReader" not in line and "central directory" not in line  # torch's words, not ours
    assert f"{run / 'last.pt'} is damaged" in line
    assert f"{run / 'best.pt'} (step 2) is intact" in line
    assert f"--config {run / 'config.toml'} --set model.init_from={run / 'best.pt'}" in line

    # Followed as written (a new run folder), it trains from best.pt's weights.
    new = tmp_path / "runs" / "b"
    assert captioner_main(["train", "--config", str(run / "config.toml"), "--set",
                           f"model.init_from={run / 'best.pt'}", "--run-dir", str(new), "--quiet"]) == 0
    capsys.readouterr()

    (run / "best.pt").write_bytes(b"")
    assert captioner_main(["train", "--resume", str(run), "--quiet"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "is damaged" in line and "no intact best.pt" in line and "--overwrite" in line
