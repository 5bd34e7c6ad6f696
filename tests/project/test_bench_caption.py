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


def test_the_search_is_timed_in_each_form_with_the_form_captioning_takes_first(monkeypatch, capsys):
    """On a CPU the search runs eagerly, timed once; where the graphed search is taken (a GPU,
    stood in for by an eager capture), the search run eagerly is timed beside it."""
    out = _run(monkeypatch, capsys, "--skip-demo", *QUICK)
    assert "beam search alone" in out and "CUDA graphs" not in out
    from captioner.search import graph as search_graph
    from tests.captioner.test_search_graph import eager_capture

    captures = []
    monkeypatch.setattr(search_graph, "CAPTURE", lambda run, pool: captures.append(1) or eager_capture(run, pool))
    monkeypatch.setattr(bench_caption, "search_form", lambda *a: "graphed")
    monkeypatch.setattr("captioner.inference.search_form", lambda *a: "graphed")
    out = _run(monkeypatch, capsys, "--skip-demo", *QUICK)
    assert "beam search as CUDA graphs" in out and "the search run eagerly" in out
    assert captures  # the search timed as "search" went through the graphs
