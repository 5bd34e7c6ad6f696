"""bench_serve's parts that decide its verdicts: each bad input it sends gets the status it expects
(here in this process, against the server's own app), and the target lines it prints."""

from __future__ import annotations

import math

import pytest

from benchmarks import bench_serve
from tests.tiny import tiny_captioner

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from captioner.serve.http import create_app  # noqa: E402
from captioner.serve.service import Limits, Service  # noqa: E402


def test_each_bad_input_gets_the_status_the_benchmark_expects():
    limits = Limits(max_wait_ms=0.0, max_pixels=bench_serve.BAD_FLAGS["--max-pixels"],
                    max_body_bytes=bench_serve.BAD_FLAGS["--max-body-bytes"])
    client = TestClient(create_app(Service(tiny_captioner(3), limits)), raise_server_exceptions=False)
    good = bench_serve.make_jpegs(1)[0]
    assert client.post("/v1/captions", content=good).status_code == 200
    kinds = bench_serve.bad_kinds(good)
    assert {status for _, status in kinds.values()} == {400, 413, 415, 422}
    for name, (ask, status) in kinds.items():
        body = ask.body if ask.declared is None else b"\0" * ask.declared  # the whole of it, here
        r = client.post(f"/v1/captions{ask.query}", content=body, headers=dict(ask.headers))
        assert r.status_code == status, (name, r.text)


def test_the_jpegs_are_distinct_640x480():
    import io

    from PIL import Image

    jpegs = bench_serve.make_jpegs(3)
    assert len(set(jpegs)) == 3
    assert all(Image.open(io.BytesIO(j)).size == (640, 480) for j in jpegs)


def test_percentiles_are_nearest_rank():
    xs = [float(i) for i in range(1, 101)]
    assert bench_serve.percentile(xs, 50) == 50 and bench_serve.percentile(xs, 99) == 99
    assert bench_serve.percentile([3.0], 99) == 3.0 and math.isnan(bench_serve.percentile([], 50))


def test_the_targets_are_printed_as_lines_met_or_not():
    level = {"requests": 200, "by_status": {"200": 200}, "p50_ms": 10.0, "p95_ms": 12.0}
    report = {"reference": {"caption_dir_images_per_s": 100.0, "one_image_in_process_ms": 20.0,
                            "one_image_in_process_p99_ms": 20.0},
              "levels": [{**level, "clients": 1, "images_per_s": 40.0, "p99_ms": 25.0},
                         {**level, "clients": 16, "images_per_s": 93.0, "p99_ms": 300.0}],
              "exit_code": 0,
              "overload": {"clients": 32, "holds": 8, "requests": 400, "crashes": 0, "lost": 0, "p99_ms": 3500.0,
                           "timeout_s": 3, "by_status": {"200": 150, "503": 250}},
              "bad": {"requests": 1000, "wrong_status": {"empty": {"500": 2}}, "alive_after": True, "exit_code": 0,
                      "traceback": False, "rss_after_over_before": 1.02}}
    lines = {line: (met, correctness) for line, met, correctness in bench_serve.checks(report)}
    assert lines["16 clients / caption DIR: 0.93x (target >= 0.8)"] == (True, False)
    # the same percentile of the same images' times on both sides (in process: each image's time to caption it)
    assert lines["1 client p99 / in-process p99, the same images: 1.25x (target <= 1.5)"] == (True, False)
    report["reference"]["one_image_in_process_p99_ms"] = 16.0
    assert ("1 client p99 / in-process p99, the same images: 1.56x (target <= 1.5)", False, False) \
        in bench_serve.checks(report)
    assert lines["overload (32 clients, the server holds 8): 0 crashes, 0 lost of 400 (target 0, 0)"] == (True, True)
    assert lines["overload: accepted p99 3.50 s (target <= --timeout-s 3 s)"] == (False, True)
    assert lines["bad input: 2 of 1000 got another status than their own (target 0)"] == (False, True)
    assert lines["bad input: RSS after / before: 1.020 (target <= 1.1)"] == (True, True)


def test_rounds_are_combined_by_their_medians_with_the_answers_summed():
    rounds = [{"clients": 16, "requests": 200, "images_per_s": v, "p99_ms": 10 * v, "by_status": {"200": 200 - e,
                                                                                                  "503": e}}
              for v, e in ((50.0, 0), (90.0, 2), (70.0, 1))]
    got = bench_serve.median_of_rounds(rounds)
    assert (got["clients"], got["requests"], got["images_per_s"], got["p99_ms"]) == (16, 600, 70.0, 700.0)
    assert got["by_status"] == {"200": 597, "503": 3}


def test_each_round_s_speed_targets_are_printed_as_checks_reads_them(capsys):
    def one(dir_rate: float, p99: float) -> dict:
        level = {"requests": 200, "by_status": {"200": 200}, "p50_ms": 10.0, "p95_ms": 12.0}
        return {"reference": {"caption_dir_images_per_s": dir_rate, "one_image_in_process_ms": 20.0,
                              "one_image_in_process_p99_ms": 30.0, "caption_dir_wall_s": 3.0, "images": 200},
                "levels": [{**level, "clients": 1, "images_per_s": 40.0, "p99_ms": p99, "cpu_s_per_image": 0.03,
                            "peak_rss_mib": 500.0, "server_cores": 1.2, "client_cores": 0.1},
                           {**level, "clients": 16, "images_per_s": 80.0, "p99_ms": 300.0, "cpu_s_per_image": 0.02,
                            "peak_rss_mib": 600.0, "server_cores": 1.6, "client_cores": 0.35}],
                "exit_code": 0}
    rounds = [one(100.0, 25.0), one(200.0, 40.0)]
    report = {"images": 200, "cores": 2, "load_average_before": 0.1, "server_flags": [], **rounds[0],
              "rounds": rounds}
    report["checks"] = bench_serve.checks(report)
    bench_serve.print_report(report)
    out = capsys.readouterr().out
    assert "| 16 | 80.0 | 10 | 12 | 300 | 200: 200 | 0.020 | 600 | 1.60 + 0.35 |" in out
    assert "round 1: 16 clients / caption DIR: 0.80x (target >= 0.8); 1 client p99 / in-process p99, the same " \
           "images: 0.83x (target <= 1.5)" in out
    assert "round 2: 16 clients / caption DIR: 0.40x (target >= 0.8); 1 client p99 / in-process p99, the same " \
           "images: 1.33x (target <= 1.5)" in out
    assert "1 client p99 / in-process median: 1.25x" in out  # the stricter reading, printed beside it
