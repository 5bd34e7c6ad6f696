"""benchmarks/bench_revisions.py: the figure it reads from a benchmark's output, and its usage."""

from __future__ import annotations

import pytest

from benchmarks import bench_revisions


def test_the_figure_is_the_first_number_before_the_unit():
    out = "demo-soft, 96 shapes images (seed 9102), beam 3\nbeam search: 24.5 images/s; decoder steps per image 11.40"
    assert bench_revisions.figure(out, "images/s") == 24.5
    assert bench_revisions.figure("training: 3 steps/s, search 7.25 steps/s", "steps/s") == 3.0
    with pytest.raises(ValueError, match="no figure in images/s"):
        bench_revisions.figure("beam search: fast", "images/s")


def test_without_a_benchmark_after_the_dashes_it_says_so(capsys):
    assert bench_revisions.main(["bdc8e8e"]) == 2
    assert "give the benchmark after --" in capsys.readouterr().err
