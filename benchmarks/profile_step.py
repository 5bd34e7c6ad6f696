"""Where the time of bench_precision's workloads goes: torch.profiler over training steps and
a captioning batch, per variant, to tell a launch-bound workload from a device-bound one.

    python -m benchmarks.profile_step --device cuda [--batch-size 32] [--variants fp32,bf16,fp32+compile] [--out DIR]
    python -m benchmarks.profile_step --device cpu --batch-size 1 --variants fp32,bf16 [--encoder small]

The model and workloads are bench_precision's, made by its functions (ResNet-101 at 224 px,
decoder 512/512/512, V = 10,000, 20-word captions, beam 3; variants fp32, bf16, fp16, each
optionally +compile, +static and +cl, as there). --encoder swaps ResNet-101 for another of the
project's encoders, for a quick run on a CPU; --tiny takes bench_precision's tiny sizes (the GPU
check's CPU test: figures of no worth, every line of the tool run). For each variant: two
warm-up calls of each workload (a compiled step compiles in them); 3 training steps and 1
captioning batch timed without the profiler; then the same under torch.profiler (CPU activity,
and CUDA's on a GPU). For the training steps, and again for the captioning batch, it prints the
12 ops with the most self device time (self CPU time on a CPU) and a line

    RESULT fp32 train: W ms/step wall, device busy B%, K kernel launches/step, S host syncs/step: VERDICT

- wall: per training step (per batch when captioning), timed without the profiler, whose
  bookkeeping slows the host and would make every workload look launch-bound;
- device busy: the time the device spends in kernels and copies (their union, so that
  overlapping streams count once) over that wall time; "n/a" on a CPU;
- kernel launches: device kernels run; on a CPU, "ops": aten ops, nested ones included;
- host syncs: calls that make the host wait for the device (cudaStreamSynchronize,
  cudaDeviceSynchronize, cudaEventSynchronize, a blocking cudaMemcpy; each .item(), bool() of
  a tensor or .cpu() makes one), or the number of scalar reads (aten::_local_scalar_dense, the
  op under .item() and bool()) where that is higher; the profiler's own closing
  synchronisation is left out. On a CPU nothing waits, and the count is of those scalar reads:
  each one a sync on a GPU;
- the verdict: "launch-bound" when the device is busy less than half the wall time (it waits
  on the host: Python, kernel launches, syncs), "device-bound" otherwise; "n/a" on a CPU.

A last RESULT line sums up every variant, for the GPU check's summary (benchmarks/gpu_check.py
shows a step's last RESULT line). With --out DIR each profile's Chrome trace is written
gzipped, DIR/trace-VARIANT-train.json.gz and DIR/trace-VARIANT-caption.json.gz ("+" in a
variant's name written "-"), for chrome://tracing or ui.perfetto.dev; a trace over 15 MiB
gzipped is left out, and says so. The tool prints figures and asserts nothing about them.
"""

from __future__ import annotations

import argparse
import gzip
import re
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.bench_precision import PAPER, TINY, _sync, prepare, variants_arg
from captioner.model.encoders import encoder_names

TRAIN_STEPS = 3  # profiled training steps per variant (and as many timed without the profiler)
WARMUP = 2
TOP_OPS = 12
TRACE_LIMIT = 15 * 2**20  # bytes, gzipped
SPAN = "profile_step.workload"  # the profiled calls, told apart from the profiler's own closing sync
SYNC_CALLS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"}
SCALAR_READ = "aten::_local_scalar_dense"
_VERSION = re.compile(r"_v\d+$")  # a CUDA API's versioned entry point, e.g. cudaLaunchKernel_v7000
# Device-side records of a wait ("Stream Sync", "Context Sync", "Stream Wait Event"), where a
# profiler records them: time the device spends waiting, not working.
_DEVICE_WAIT = re.compile(r"Sync$|^Stream Wait Event")


@dataclass
class Figures:
    """One workload's figures, per call (a training step, or a captioning batch)."""

    wall_ms: float  # timed without the profiler
    busy: float | None  # device time over wall time; None on a CPU
    launches: float  # device kernels; aten ops on a CPU
    syncs: float

    @property
    def verdict(self) -> str:
        if self.busy is None:
            return "n/a"
        return "launch-bound" if self.busy < 0.5 else "device-bound"


def _count(x: float) -> str:
    """1840 -> "1,840"; a per-call mean that is not whole keeps one decimal."""
    return f"{x:,.0f}" if x == int(x) else f"{x:,.1f}"


def result_line(variant: str, what: str, f: Figures, on_cuda: bool) -> str:
    unit = "step" if what == "train" else "batch"
    busy = "n/a" if f.busy is None else f"{100 * f.busy:.0f}%"
    launches = "kernel launches" if on_cuda else "ops"
    return (f"RESULT {variant} {what}: {f.wall_ms:.1f} ms/{unit} wall, device busy {busy}, "
            f"{_count(f.launches)} {launches}/{unit}, {_count(f.syncs)} host syncs/{unit}: {f.verdict}")


def summary_line(rows: list[tuple[str, str, Figures]]) -> str:
    """Every variant in one line: wall time, busy share and verdict of each workload."""
    parts = []
    for what, unit in (("train", "ms/step"), ("caption", "ms/batch")):
        cells = [f"{v} {f.wall_ms:.1f}" + ("" if f.busy is None else f" ({100 * f.busy:.0f}% busy, {f.verdict})")
                 for v, w, f in rows if w == what]
        parts.append(f"{what} {unit}: " + ", ".join(cells))
    return "RESULT " + "; ".join(parts)


def _union_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def figures(events, calls: int, wall_ms: float, on_cuda: bool) -> Figures:
    """The per-call figures of a profile's events (torch.profiler's FunctionEvents), the calls
    made inside the SPAN annotation."""
    span = next(e for e in events if e.name == SPAN and e.device_type == DeviceType.CPU)
    lo, hi = span.time_range.start, span.time_range.end
    host = [e for e in events if e.device_type == DeviceType.CPU and lo <= e.time_range.start <= hi]
    scalar_reads = sum(e.name == SCALAR_READ for e in host)
    if not on_cuda:
        ops = sum(e.name.startswith("aten::") for e in host)
        return Figures(wall_ms, None, ops / calls, scalar_reads / calls)
    # A record_function annotation has a device-side twin spanning its kernels, gaps included:
    # no kernel, and it would fill the gaps that busy is to show.
    annotations = {SPAN} | {e.name for e in events if getattr(e, "is_user_annotation", False)}
    device = [e for e in events if e.device_type != DeviceType.CPU and e.name not in annotations
              and not getattr(e, "is_user_annotation", False) and not _DEVICE_WAIT.search(e.name)]
    kernels = sum(not e.name.startswith(("Memcpy", "Memset")) for e in device)
    busy_ms = _union_us((e.time_range.start, e.time_range.end) for e in device) / 1000
    syncs = sum(_VERSION.sub("", e.name) in SYNC_CALLS for e in host)
    return Figures(wall_ms, busy_ms / calls / wall_ms, kernels / calls, max(syncs, scalar_reads) / calls)


def _timed_ms(fn: Callable[[], None], calls: int, dev: torch.device) -> float:
    _sync(dev)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(dev)
    return (time.perf_counter() - start) * 1000 / calls


def _save_trace(prof, path: Path) -> None:
    """The profile's Chrome trace as PATH.json.gz, unless that is over TRACE_LIMIT."""
    raw = path.with_suffix(".json")
    prof.export_chrome_trace(str(raw))
    packed = path.with_suffix(".json.gz")
    with open(raw, "rb") as src, gzip.open(packed, "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    size = packed.stat().st_size
    if size > TRACE_LIMIT:
        packed.unlink()
        print(f"trace {packed.name} left out: {size / 2**20:.1f} MiB gzipped, over {TRACE_LIMIT // 2**20} MiB")
    else:
        print(f"trace {packed} ({size / 2**20:.1f} MiB)")


def profile_workload(variant: str, what: str, fn: Callable[[], None], calls: int, dev: torch.device,
                     out: Path | None) -> Figures:
    """Warm-up, timing without the profiler, then the profile; prints its table and RESULT line."""
    on_cuda = dev.type == "cuda"
    for _ in range(WARMUP):
        fn()
    wall_ms = _timed_ms(fn, calls, dev)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        with record_function(SPAN):
            for _ in range(calls):
                fn()
    # The profiler synchronises the device as it stops, after the span: every kernel is in.
    sort = "self_device_time_total" if on_cuda else "self_cpu_time_total"
    print(f"\n{variant} {what}: {calls} call(s), top {TOP_OPS} ops by {sort}")
    print(prof.key_averages().table(sort_by=sort, row_limit=TOP_OPS))
    f = figures(prof.events(), calls, wall_ms, on_cuda)
    print(result_line(variant, what, f, on_cuda), flush=True)
    if out is not None:
        _save_trace(prof, out / f"trace-{variant.replace('+', '-')}-{what}")
    return f


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--variants", type=variants_arg, default="fp32,bf16,fp32+compile",
                    help="comma-separated, bench_precision's: fp32, bf16, fp16, each optionally +compile, +static "
                         "and +cl")
    ap.add_argument("--encoder", default="resnet101", choices=encoder_names(),
                    help="the encoder (random weights); default resnet101, bench_precision's")
    ap.add_argument("--out", type=Path, default=None, help="folder for the gzipped Chrome traces (made if missing)")
    ap.add_argument("--tiny", action="store_true",
                    help=f"bench_precision's tiny sizes ({TINY.describe()}): a quick CPU run whose figures mean "
                         "nothing (benchmarks/gpu_check.py --quick)")
    args = ap.parse_args(argv)
    variants = args.variants
    sizes = TINY if args.tiny else PAPER
    dev = torch.device(args.device)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{name}; torch {torch.__version__}; {args.encoder} {sizes.describe()}, "
          f"batch {args.batch_size}; {TRAIN_STEPS} training steps and 1 captioning batch (beam 3) per variant")
    rows = []
    for variant in variants:
        train_step, caption = prepare(variant, dev, args.batch_size, args.encoder, sizes)
        rows.append((variant, "train", profile_workload(variant, "train", train_step, TRAIN_STEPS, dev, args.out)))
        rows.append((variant, "caption", profile_workload(variant, "caption", caption, 1, dev, args.out)))
    print(summary_line(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
