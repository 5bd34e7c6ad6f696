"""The exit benchmark takes its pairs in turn and prints the ratio pair by pair."""

from __future__ import annotations

import pytest

from benchmarks import bench_exit


def test_pairs_alternate_and_the_ratio_is_taken_pair_by_pair(monkeypatch, capsys):
    calls = []
    seconds = {"quick": iter([9.0, 1.0, 2.0, 3.0]), "usual": iter([2.0, 4.0, 6.0])}

    def timed(argv):
        kind = "quick" if argv[:3] == bench_exit.QUICK else "usual"
        calls.append((kind, argv[-2:]))
        return next(seconds[kind])

    monkeypatch.setattr(bench_exit, "timed", timed)
    assert bench_exit.main(["a.png", "--pairs", "3", "--", "--beam-size", "1"]) == 0
    assert [k for k, _ in calls] == ["quick", "quick", "usual", "usual", "quick", "quick", "usual"]
    assert all(a == ["--beam-size", "1"] for _, a in calls)
    out = capsys.readouterr().out
    # the warm-up (9 s) is not counted; ratios 1/2, 2/4, 3/6
    assert "run():  median 2.00 s" in out and "main(): median 4.00 s" in out
    assert "median 0.50 (min 0.50, max 0.50) over 3 pairs" in out


def test_no_pairs_is_refused():
    with pytest.raises(SystemExit) as done:
        bench_exit.main(["a.png", "--pairs", "0"])
    assert done.value.code == 2
