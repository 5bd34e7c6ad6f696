"""The prepared GPU check cannot rot between runs on a GPU: its quick mode runs every step on
the CPU at tiny sizes, and a machine without a package is told which, in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_check

ROOT = Path(__file__).resolve().parents[2]


def test_a_missing_package_is_named_in_one_line_before_any_step(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "PACKAGES", ("torch", "no_such_package_here"))
    assert gpu_check.main(["--out", str(tmp_path / "logs"), "--device", "cpu", "--quick"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no_such_package_here" in err and "\n" not in err and not (tmp_path / "logs").exists()


def test_a_tutorial_folder_that_is_not_there_is_refused_in_one_line(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path / "logs"), "--device", "cpu", "--quick",
                           "--tutorial", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--tutorial" in err and "\n" not in err


def test_a_summary_line_counts_tracebacks_and_recompilations(tmp_path):
    script = ("import sys; print('Recompiling function _step in x'); print('Recompiling function _step in x');"
              "print('Traceback (most recent call last):'); print('RESULT 3/4 captions identical'); sys.exit(1)")
    o = gpu_check.run_step(gpu_check.Step("demo", [sys.executable, "-c", script], 60), 1, tmp_path)
    assert (o.code, o.tracebacks, o.recompiles, o.note, o.ok) == (1, 1, 2, "3/4 captions identical", False)
    assert o.line().startswith("FAIL demo") and (tmp_path / "01-demo.log").is_file()
    slow = gpu_check.run_step(gpu_check.Step("slow", [sys.executable, "-c", "import time; time.sleep(30)"], 1),
                              2, tmp_path)
    assert slow.code is None and not slow.ok and "timeout" in slow.line()


@pytest.mark.slow
def test_a_forked_step_reports_its_exit_code_output_and_time_box_as_a_process_would(tmp_path, monkeypatch):
    (tmp_path / "step_ok.py").write_text("print('RESULT 2/2 fine')\n")
    (tmp_path / "step_exit.py").write_text("import sys\nprint('Recompiling function f')\nsys.exit(3)\n")
    (tmp_path / "step_raise.py").write_text("raise ValueError('broken')\n")
    (tmp_path / "step_sleep.py").write_text("import time\ntime.sleep(30)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    py = [sys.executable, "-m"]

    def run(module: str, timeout: float = 60) -> gpu_check.Outcome:
        return gpu_check.run_step(gpu_check.Step(module, py + [module, "--x"], timeout), 1, tmp_path, fork=True)

    ok = run("step_ok")
    assert (ok.code, ok.note, ok.ok) == (0, "2/2 fine", True)
    out = run("step_exit")
    assert (out.code, out.recompiles, out.ok) == (3, 1, False)
    raised = run("step_raise")
    assert (raised.code, raised.tracebacks) == (1, 1) and "broken" in (tmp_path / "01-step_raise.log").read_text()
    slow = run("step_sleep", timeout=1)
    assert slow.code is None and slow.seconds < 10
    assert gpu_check.forkable(gpu_check.Step("x", py + ["captioner.cli"], 1))
    assert gpu_check.forkable(gpu_check.Step("x", py + ["torch.distributed.run"], 1))
    assert not gpu_check.forkable(gpu_check.Step("x", [sys.executable, "-c", "pass"], 1))


@pytest.mark.slow
def test_a_forked_step_out_of_time_stops_the_workers_it_started_in_their_own_sessions(tmp_path, monkeypatch):
    """As torchrun's launcher does: its workers run in sessions of their own, out of reach of its
    process group, and it stops them when it is sent SIGTERM. A step out of time is sent that
    first, so that no worker outlives it."""
    pid_file = tmp_path / "worker.pid"
    (tmp_path / "step_launcher.py").write_text(
        "import signal, subprocess, sys, time\n"
        "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
        "def stop(*_):\n"
        "    worker.terminate(); worker.wait(); sys.exit(143)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        f"open({str(pid_file)!r}, 'w').write(str(worker.pid))\n"
        "time.sleep(60)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    step = gpu_check.Step("step_launcher", [sys.executable, "-m", "step_launcher"], 1.5)
    out = gpu_check.run_step(step, 1, tmp_path, fork=True)
    assert out.code is None and out.seconds < 10 and pid_file.is_file()
    with pytest.raises(ProcessLookupError):  # stopped and reaped by the launcher, not left behind
        os.kill(int(pid_file.read_text()), 0)


def test_fork_is_refused_off_the_cpu(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path / "logs"), "--device", "cuda", "--fork"]) == 2
    assert "--fork" in capsys.readouterr().err


def _all_steps(device: str = "cuda") -> list:
    logs = Path("logs")  # nothing runs: the steps are only listed
    return (gpu_check.train_steps(device, False, logs, logs / "shapes")
            + gpu_check.caption_steps(device, False, logs, logs / "images")
            + gpu_check.bench_steps(device, False, logs, None))


def test_only_pulls_in_the_steps_a_selected_step_needs_and_keeps_their_order():
    steps = _all_steps()

    def names(only: str) -> list[str]:
        return [s.name for s in gpu_check.select_steps(steps, only)]

    assert names("compare-beam1") == ["caption-beam1-cuda-b16", "caption-beam1-cpu-b5", "compare-beam1"]
    assert names("compare-beam3,app") == ["caption-beam3-cuda-b16", "caption-beam3-cpu-b5", "compare-beam3",
                                          "app-captioning"]
    # Hard attention, SCST and the resume start from the soft fp32 run.
    assert names("train-resume") == ["train-soft-fp32", "train-resume"]
    assert names("train-hard-fp32,train-scst") == ["train-soft-fp32", "train-hard-fp32", "train-scst-bf16"]
    assert names("bench-decoder") == ["bench-decoder", "bench-decoder-256"]  # a prefix, as before
    assert names("profile,bench-precision-128") == ["profile", "bench-precision-128"]
    assert names("") == [s.name for s in steps]


@pytest.mark.slow
def test_the_quick_mode_runs_every_step_on_the_cpu(tmp_path):
    logs = tmp_path / "logs"
    res = subprocess.run([str(ROOT / "benchmarks" / "gpu_check.sh"), "--out", str(logs), "--device", "cpu",
                          "--quick", "--fork", "--budget", "1800"], capture_output=True, text=True, timeout=2000,
                         env={**os.environ, "PYTHON": sys.executable})
    summary = (logs / "summary.txt").read_text()
    assert res.returncode == 0, summary + res.stderr[-2000:]
    lines = summary.splitlines()
    names = [line.split()[1] for line in lines[1:-1]]
    for step in ("train-soft-fp32", "train-soft-bf16-compile", "train-soft-fp16", "train-hard-fp32",
                 "train-hard-bf16-compile", "train-scst-bf16", "train-resume", "torchrun-1-process",
                 "compare-beam1", "compare-beam3", "caption-bf16-compile", "app-captioning", "bench-decoder",
                 "bench-precision", "profile", "bench-caption", "bench-coco-train"):
        assert step in names, step
    assert all(line.startswith("ok") for line in lines[1:-1]), summary
    assert "8/8 captions identical" in summary
    assert "1 process (gloo)" in next(logs.glob("*-torchrun-1-process.log")).read_text()
    assert len(list((logs / "profile").glob("trace-*.json.gz"))) == 4  # fp32 and bf16, training and captioning
