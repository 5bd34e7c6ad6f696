"""Killed runs: batch captioning and training, stopped by SIGKILL or SIGTERM, then resumed.
The runs that are killed are processes of their own, forked with the captioner loaded
(tests.forked), but for the terminal's Ctrl-C; their reruns run in this process."""

import json
import signal
import subprocess
import sys
import time

import pytest
import torch

from captioner.cli.main import main
from captioner.io.checkpoint import load_checkpoint
from captioner.train.config import to_toml
from tests.builders import tiny_train_config
from tests.forked import Forked
from tests.tiny import tiny_captioner, tiny_image


def _wait_for(predicate, timeout: float = 120.0, proc: Forked | subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            err = proc.stderr() if isinstance(proc, Forked) else proc.stderr.read()
            raise AssertionError(f"process ended early with code {proc.returncode}: {err}")
        time.sleep(0.05)
    raise AssertionError("timed out")


def _lines(path):
    return path.read_bytes().count(b"\n")


@pytest.mark.slow  # processes started, killed and started again
def test_caption_killed_and_rerun_gives_every_image_exactly_once(tmp_path):
    weights = tmp_path / "tiny.pt"
    tiny_captioner(seed=1).save(weights)
    folder = tmp_path / "imgs"
    folder.mkdir()
    paths = []
    for i in range(120):
        p = folder / f"img{i:03d}.png"
        tiny_image(i % 7, size=(24, 24)).save(p)
        paths.append(str(p))
    out = tmp_path / "out.jsonl"
    args = ["caption", str(folder), "--weights", str(weights), "--out", str(out),
            "--batch-size", "2", "--max-len", "6", "--workers", "0", "--quiet"]
    proc = Forked(args, tmp_path / "killed")
    try:
        _wait_for(lambda: out.exists() and _lines(out) >= 10, proc=proc)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    done_before = _lines(out)
    assert done_before < len(paths)  # it really was stopped part way
    with open(out, "ab") as f:
        f.write(b'{"image": "' + paths[-1].encode()[:10])  # as if killed in the middle of a write
    assert main(args) == 0  # the rerun in this process: only the killed run needs its own
    images = [json.loads(line)["image"] for line in out.read_text().splitlines()]
    assert sorted(images) == sorted(paths)  # every image exactly once, no torn line left


def _start_training(cfg_path, run_dir) -> Forked:
    return Forked(["train", "--config", cfg_path, "--run-dir", run_dir, "--quiet"], run_dir.parent / "process")


@pytest.mark.slow
def test_training_killed_by_sigkill_resumes_to_identical_weights(tiny_coco, tmp_path):
    cfg = tiny_train_config(tiny_coco, **{"optim.max_steps": 14, "optim.save_every": 1, "val.every_epochs": 0})
    cfg_path = tmp_path / "cfg.toml"
    cfg_path.write_text(to_toml(cfg))

    straight = tmp_path / "straight"  # uninterrupted, in this process: the killed run is the one that needs its own
    assert main(["train", "--config", str(cfg_path), "--run-dir", str(straight), "--quiet"]) == 0

    killed = tmp_path / "killed"
    proc = _start_training(cfg_path, killed)

    def step_at_least(n):
        try:
            return load_checkpoint(killed / "last.pt").train_state.step >= n
        except Exception:  # not written yet
            return False

    try:
        _wait_for(lambda: step_at_least(5), proc=proc)
    finally:
        proc.send_signal(signal.SIGKILL)  # at any moment, possibly in the middle of a save
        proc.wait()
    state = load_checkpoint(killed / "last.pt").train_state  # the last checkpoint still loads
    assert 5 <= state.step < 14
    assert main(["train", "--resume", str(killed), "--quiet"]) == 0
    a = load_checkpoint(straight / "last.pt")
    b = load_checkpoint(killed / "last.pt")
    assert b.train_state.step == 14
    for k in a.state_dict:
        assert torch.equal(a.state_dict[k], b.state_dict[k]), k


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_training_stops_cleanly_and_saves_on_signal(tiny_coco, tmp_path, sig):
    cfg = tiny_train_config(tiny_coco, **{"optim.max_steps": 100000, "optim.save_every": 0, "val.every_epochs": 0})
    cfg_path = tmp_path / "cfg.toml"
    cfg_path.write_text(to_toml(cfg))
    run = tmp_path / "run"
    proc = _start_training(cfg_path, run)
    _wait_for(lambda: (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("nll") >= 3,
              proc=proc)
    proc.send_signal(sig)
    proc.wait(timeout=120)
    err = proc.stderr()
    assert proc.returncode == 130, err
    assert "interrupted" in err
    state = load_checkpoint(run / "last.pt").train_state
    assert state.step >= 3  # saved where it stopped, not at step 0


@pytest.mark.slow
def test_one_ctrl_c_prints_its_notice_once(tiny_coco, tmp_path):
    """A terminal's Ctrl-C reaches every process of the job, the data loader's workers too: one
    press must read as one press."""
    import os

    cfg = tiny_train_config(tiny_coco, **{"optim.max_steps": 100000, "optim.save_every": 0, "val.every_epochs": 0,
                                          "data.workers": 2, "data.cache_images": False})
    cfg_path = tmp_path / "cfg.toml"
    cfg_path.write_text(to_toml(cfg))
    run = tmp_path / "run"
    # A process started as a terminal starts a job, in a process group of its own. (Forked, its
    # data loader's workers took seconds longer to reach the third step.)
    proc = subprocess.Popen([sys.executable, "-m", "captioner.cli", "train", "--config", str(cfg_path), "--run-dir",
                             str(run), "--quiet"], stderr=subprocess.PIPE, text=True, start_new_session=True)
    _wait_for(lambda: (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("nll") >= 3,
              proc=proc)
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C: the whole foreground group
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.count("SIGINT: saving and stopping after this step") == 1, err
    assert load_checkpoint(run / "last.pt").train_state.step >= 3
