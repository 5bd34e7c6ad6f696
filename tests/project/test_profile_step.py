"""profile_step, the profiler over bench_precision's workloads: it runs on a CPU and prints
RESULT lines whose figures read back, and its device figures (busy share, kernels, host syncs)
count what they say on a GPU's events."""

from __future__ import annotations

import gzip
import json
import re
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from benchmarks import profile_step

LINE = re.compile(r"RESULT (\S+) (train|caption): ([\d.]+) ms/(step|batch) wall, device busy (\S+), ([\d,.]+) "
                  r"(ops|kernel launches)/(?:step|batch), ([\d,.]+) host syncs/(?:step|batch): (\S+)$")


@pytest.mark.slow
def test_a_cpu_run_prints_figures_for_training_and_captioning_and_gzipped_traces(tmp_path, capsys):
    assert profile_step.main(["--device", "cpu", "--batch-size", "1", "--variants", "fp32", "--encoder", "small",
                              "--tiny", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {m[2]: m for line in out if (m := LINE.match(line))}
    assert set(rows) == {"train", "caption"}, out
    for what, m in rows.items():
        assert m[1] == "fp32" and float(m[3]) > 0 and m[5] == "n/a" and m[9] == "n/a" and m[7] == "ops"
        assert float(m[6].replace(",", "")) > 0
    assert float(rows["caption"][8].replace(",", "")) >= 1  # beam search reads its progress back to the host
    assert out[-1].startswith("RESULT train ms/step: fp32 ") and "caption ms/batch: fp32 " in out[-1]
    assert sum("top 12 ops" in line for line in out) == 2
    for what in ("train", "caption"):
        trace = json.loads(gzip.decompress((tmp_path / f"trace-fp32-{what}.json.gz").read_bytes()))
        assert trace["traceEvents"]
    assert not list(tmp_path.glob("*.json"))  # only the gzipped copies stay


def _event(name, start, end, device=DeviceType.CPU, annotation=False):
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                           is_user_annotation=annotation)


def test_on_a_gpu_busy_is_the_union_of_device_work_and_only_the_spans_syncs_count():
    gpu = DeviceType.CUDA
    events = [
        _event(profile_step.SPAN, 0, 200, annotation=True),
        _event("aten::mm", 5, 10), _event("cudaLaunchKernel", 6, 8), _event("cudaLaunchKernel", 9, 10),
        _event("aten::item", 48, 60), _event(profile_step.SCALAR_READ, 49, 60),
        _event("cudaMemcpyAsync", 50, 51), _event("cudaStreamSynchronize_v3020", 52, 60),
        _event("cudaDeviceSynchronize", 210, 300),  # the profiler's own, as it stops
        _event("gemm_kernel", 10, 30, gpu), _event("elementwise_kernel", 20, 40, gpu),  # overlapping: 30 us
        _event("Memcpy DtoH (Device -> Pinned)", 50, 60, gpu),  # 10 us, no kernel
        _event(profile_step.SPAN, 10, 60, gpu),  # the annotation's device-side twin, gaps included
        _event("Optimizer.step#Adam.step", 0, 100, gpu, annotation=True),
        _event("Stream Sync", 52, 60, gpu), _event("Context Sync", 210, 300, gpu),  # waits, where recorded
    ]
    f = profile_step.figures(events, calls=2, wall_ms=0.05, on_cuda=True)  # 2 calls of 50 us: 100 us
    assert (f.launches, f.syncs, f.verdict) == (1, 0.5, "launch-bound")
    assert abs(f.busy - 0.4) < 1e-9  # (30 + 10) us of device work over 2 calls of 50 us
    line = profile_step.result_line("bf16", "train", f, on_cuda=True)
    assert line == ("RESULT bf16 train: 0.1 ms/step wall, device busy 40%, 1 kernel launches/step, "
                    "0.5 host syncs/step: launch-bound")
    busy = profile_step.Figures(10.0, 0.75, 100, 0)
    assert busy.verdict == "device-bound"
    assert profile_step.summary_line([("fp32", "train", busy), ("fp32", "caption", f)]) == (
        "RESULT train ms/step: fp32 10.0 (75% busy, device-bound); caption ms/batch: fp32 0.1 (40% busy, launch-bound)")
