"""bench_caption's choice of models: --skip-demo times ResNet-101 alone (what a time-boxed GPU
run needs: the demo model's timing came first and used up the box), and the two skips together
are refused."""

from __future__ import annotations

import sys

import pytest

from benchmarks import bench_caption
from tests.tiny import tiny_captioner

QUICK = ["--images", "2", "--batch-size", "2", "--workers", "0", "--repeats", "1", "--skip-memory"]


def _run(monkeypatch, capsys, *argv):
    def no_demo(*a, **k):
        raise AssertionError("the demo model was loaded")

    monkeypatch.setattr(bench_caption.Captioner, "load", no_demo)
    monkeypatch.setattr(bench_caption, "resnet101_captioner", lambda device: tiny_captioner(seed=0))
    monkeypatch.setattr(sys, "argv", ["bench_caption", *argv])
    bench_caption.main()
    return capsys.readouterr().out


def test_skip_demo_times_the_paper_sized_model_alone(monkeypatch, capsys):
    out = _run(monkeypatch, capsys, "--skip-demo", *QUICK)
    assert "resnet101, paper sizes: caption" in out and "demo-soft" not in out


def test_skipping_both_models_is_refused(monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        _run(monkeypatch, capsys, "--skip-demo", "--skip-resnet", *QUICK)
    assert e.value.code == 2 and "no model to time" in capsys.readouterr().err
