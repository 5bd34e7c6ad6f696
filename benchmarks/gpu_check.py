"""One prepared check of every GPU path, for a GPU machine available for a few minutes.

    python -m benchmarks.gpu_check --out LOGS [--device cuda] [--tutorial PATH] [--only NAME,...]
    python -m benchmarks.gpu_check --out LOGS --device cpu --quick     (the same steps, tiny, on CPU)

Run from the repository root, with the Python and packages the machine has (it installs
nothing). Each step is one command run in its own process, time-boxed, its output written to
``LOGS/NN-name.log``; one summary line per step (exit code, seconds, tracebacks, recompilations)
goes to the screen and to ``LOGS/summary.txt``. Recompilations are counted from
``TORCH_LOGS=recompiles`` ("Recompiling function" lines), so a compiled path that keeps
recompiling shows up in the summary, not only in a slow figure.

The steps: the environment (GPU name, missing packages); training fp32, bf16 + compile, fp16
(gradient scaling), bf16 with CUDA graphs (``optim.cuda_graphs``), soft and hard (hard over the
feature cache, as its config trains it), a resume, SCST; greedy and beam captioning on the
device compared caption for caption with the CPU's on the same images (on a GPU the beam's
captions come from the search's CUDA graphs, captioner/search/graph.py, the CPU's from the
plain search), and bf16 + compile
captioning; torchrun on one process (NCCL on a GPU); the app's captioning path; then the
benchmarks at the paper's sizes with small counts: bench_decoder at batch 32 and 256;
bench_precision at batch 32 (fp32, bf16, fp16); profile_step at batch 32 (fp32, bf16, the
compiled step: where a training step's and a captioning batch's time goes, launch-bound or
device-bound, Chrome traces in ``LOGS/profile``); bench_precision at batch 128 (fp32, bf16,
channels-last bf16, the compiled step with a dynamic batch as captioner compiles it and for
fixed shapes, fp32 and channels-last bf16 with the training step as a CUDA graph); bench_caption
with ResNet-101 on 2,000 JPEGs at the GPU's default batch, also with JPEGs decoded on the GPU
(--decode-on-device), and again in bf16; bench_coco_train; and compare_tutorial where ``--tutorial`` names the
tutorial's folder (on a GPU with ``--graphs``: the graphed step's loss and gradients against the
plain step's, then its speed).
``--quick`` shrinks every count and size (the training runs' model to 32 px and 16/16/16, the
benchmarks to their --tiny sizes on the small encoder, bench_coco_train to the shapes config's
model) and compiles with torch.compile's eager backend (the compiler's capture and its guards, no
code generation), so that a CPU test can run the whole check: every step, in a few minutes.
``--fork`` (CPU only) runs each ``python -m`` step in a fork of the check's own process, which
has imported torch, torchvision and the captioner once: a step then costs its own work, not the
imports' seconds again (most of a quick step on a CPU); torchrun's launcher too, which forks
its workers in turn (benchmarks/forked_workers.py): each a process of its own, in a session of
its own, as torchrun starts them.

The whole check is meant to fit ``--budget 480`` on a GPU. To make room for the profile and
batch 128, bench_precision at batch 32 leaves its compiled variants to them (the profile times
the compiled step at batch 32 without the profiler, beside fp32 and bf16; bf16 + compile was
slower than fp32 + compile on the first GPU), and bench_coco_train takes 10 steps, not 15.
Steps that would start after the budget is spent are skipped; the benchmarks measured on the
first GPU (bench_caption, bench_coco_train) come last, so they are the first to go.
On a machine where the rest of the check has passed before, ``--only profile,bench-`` runs the
measurements alone.
The exit code is 0 when every step passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.forked_workers import run_as_main
from captioner.cli.main import default_batch_size  # no torch at import: the package check runs first

# What the steps import; each missing one is named in one line before anything runs.
PACKAGES = ("torch", "torchvision", "PIL", "nltk", "pycocotools", "pycocoevalcap", "tqdm", "streamlit",
            "captioner.train")
RECOMPILE = re.compile(r"Recompiling function")
LIMIT_HIT = re.compile(r"recompile_limit|cache_size_limit")


@dataclass
class Step:
    name: str
    argv: list[str]
    timeout: float
    needs: tuple[str, ...] = ()  # the steps whose output this one reads: --only runs them too


@dataclass
class Outcome:
    name: str
    code: int | None  # None: killed at its time box
    seconds: float
    tracebacks: int
    recompiles: int
    limit_hit: bool
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.code == 0 and self.tracebacks == 0 and not self.limit_hit

    def line(self) -> str:
        code = "timeout" if self.code is None else str(self.code)
        flag = "ok  " if self.ok else "FAIL"
        extra = f"  {self.note}" if self.note else ""
        limit = "  recompile limit reached" if self.limit_hit else ""
        return (f"{flag} {self.name:<22} exit {code:<7} {self.seconds:6.1f} s  tracebacks {self.tracebacks}  "
                f"recompilations {self.recompiles}{limit}{extra}")


def missing_packages() -> list[str]:
    out = []
    for name in PACKAGES:
        try:
            if importlib.util.find_spec(name) is None:
                out.append(name)
        except ModuleNotFoundError:
            out.append(name)
    return out


def captioner_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "captioner.cli", *args]


def train_steps(device: str, quick: bool, logs: Path, shapes: Path) -> list[Step]:
    """Training in every precision, compiled or not, soft and hard, resumed, SCST, torchrun."""
    steps = 3 if quick else 20
    backend = "eager" if quick else "inductor"
    common = [
        f"data.dir={shapes}", "data.generate_shapes=true", f"data.shapes_train={32 if quick else 512}",
        f"data.shapes_val={8 if quick else 32}", "data.workers=0", "data.cache_images=true",
        f"optim.max_steps={steps}", "optim.epochs=1000", "optim.max_minutes=0", f"optim.device={device}",
        f"optim.batch_size={4 if quick else 32}", "optim.log_every=5", f"optim.save_every={max(1, steps // 2)}",
        "optim.threads=0", "val.metric=object_accuracy", "val.beam_size=1", f"val.limit={8 if quick else 32}",
        "val.every_epochs=1000",
    ]
    if quick:  # the configs' model at tiny sizes: every path runs in seconds on a CPU
        common += ["data.shapes_image_size=48", "model.image_size=32", "model.embed_dim=16", "model.hidden_dim=16",
                   "model.attention_dim=16"]
    # fp16 autocast has no CPU training path worth checking; quick mode takes bf16 there.
    fp16 = "bf16" if device == "cpu" else "fp16"
    runs = logs / "runs"
    soft = runs / "train-soft-fp32" / "best.pt"

    def train(name: str, config: str, *sets: str, timeout: float = 150, needs: tuple[str, ...] = ()) -> Step:
        argv = captioner_cmd("train", "--config", f"train/configs/{config}", "--run-dir", str(runs / name), "--quiet",
                             "--overwrite")  # a check run again into the same --out starts its runs over
        for s in (*common, *sets):
            argv += ["--set", s]
        return Step(name, argv, timeout, needs=needs)

    after_soft = ("train-soft-fp32",)

    out = [
        train("train-soft-fp32", "shapes-soft.toml", "optim.precision=fp32"),
        train("train-soft-bf16-compile", "shapes-soft.toml", "optim.precision=bf16", f"optim.compile={backend}"),
        train("train-soft-fp16", "shapes-soft.toml", f"optim.precision={fp16}"),
        # The forward and backward as CUDA graphs (train/graphed.py; the plain step on a CPU).
        train("train-soft-graphs", "shapes-soft.toml", "optim.precision=bf16", "optim.cuda_graphs=true"),
        # Hard attention and SCST start from the soft run above (their configs start from demo-soft,
        # whose vocabulary needs the whole shapes training set).
        train("train-hard-fp32", "shapes-hard.toml", "optim.precision=fp32", f"model.init_from={soft}",
              needs=after_soft),
        train("train-hard-bf16-compile", "shapes-hard.toml", "optim.precision=bf16", f"optim.compile={backend}",
              f"model.init_from={soft}", needs=after_soft),
        train("train-scst-bf16", "shapes-scst.toml", "optim.precision=bf16", f"scst.max_len={8 if quick else 20}",
              f"model.init_from={soft}", needs=after_soft),
    ]
    resume = captioner_cmd("train", "--resume", str(runs / "train-soft-fp32"), "--quiet",
                           "--set", f"optim.max_steps={steps + 4}")
    out.append(Step("train-resume", resume, 180, needs=after_soft))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                "-m", "captioner.cli", "train", "--config", "train/configs/shapes-soft.toml",
                "--run-dir", str(runs / "torchrun"), "--quiet", "--overwrite"]
    for s in (*common, "optim.precision=bf16"):
        torchrun += ["--set", s]
    out.append(Step("torchrun-1-process", torchrun, 240))
    return out


def caption_steps(device: str, quick: bool, logs: Path, images: Path) -> list[Step]:
    """Greedy and beam on the device against the CPU on the same images; bf16 + compile."""
    out = []
    for beam in (1, 3):
        files, names = [], []
        # The CPU's reference run takes other batches (5 images), so that on a CPU the comparison
        # still checks something: that batching does not change a caption.
        for dev, batch in ((device, "16"), ("cpu", "5")):
            f = logs / f"captions-beam{beam}-{dev.replace(':', '')}-batch{batch}.jsonl"
            files.append(f)
            names.append(f"caption-beam{beam}-{dev}-b{batch}")
            out.append(Step(names[-1], captioner_cmd(
                "caption", str(images), "--beam-size", str(beam), "--device", dev, "--out", str(f),
                "--workers", "0", "--quiet", "--batch-size", batch), 180))
        out.append(Step(f"compare-beam{beam}", [sys.executable, "-m", "benchmarks.gpu_check", "compare",
                                                 *map(str, files)], 60, needs=tuple(names)))
    f = logs / "captions-bf16-compile.jsonl"
    out.append(Step("caption-bf16-compile", captioner_cmd(
        "caption", str(images), "--device", device, "--precision", "bf16", "--compile",
        "eager" if quick else "inductor", "--out", str(f), "--workers", "0", "--quiet", "--batch-size", "8"),
        300))
    out.append(Step("app-captioning", [sys.executable, "-m", "benchmarks.gpu_check", "app",
                                       "--device", device, str(images)], 120))
    return out


def bench_steps(device: str, quick: bool, logs: Path, tutorial: Path | None) -> list[Step]:
    """The speed benchmarks at the paper's sizes, with small counts, and the profile of the
    ResNet-101 workloads (profile_step; its Chrome traces in LOGS/profile)."""
    py = [sys.executable, "-m"]
    traces = str(logs / "profile")
    if quick:
        # Every benchmark's code at tiny sizes (--tiny; bench_coco_train on the shapes config's
        # model): the figures mean nothing, the point is that each runs through.
        out = [Step("bench-decoder", py + ["benchmarks.bench_decoder", "--device", device, "--repeats", "1",
                                          "--batch", "2", "--tiny"], 300),
               Step("bench-precision", py + ["benchmarks.bench_precision", "--device", device, "--batch-size", "2",
                                            "--repeats", "1", "--variants", "fp32,bf16,bf16+cl", "--encoder", "small",
                                            "--tiny"], 300),
               Step("profile", py + ["benchmarks.profile_step", "--device", device, "--batch-size", "2",
                                     "--variants", "fp32,bf16", "--encoder", "small", "--tiny", "--out", traces], 150),
               Step("bench-caption", py + ["benchmarks.bench_caption", "--device", device, "--images", "4",
                                          "--batch-size", "2", "--workers", "0", "--repeats", "1",
                                          "--skip-memory", "--skip-resnet", "--decode-on-device"], 300),
               Step("bench-coco-train", py + ["benchmarks.bench_coco_train", "--device", device, "--batch-size", "2",
                                             "--steps", "1", "--warmup", "1", "--precisions", "fp32",
                                             "--config", "shapes-soft.toml"], 300)]
    else:
        out = [Step("bench-decoder", py + ["benchmarks.bench_decoder", "--device", device, "--repeats", "2"], 120),
               Step("bench-decoder-256", py + ["benchmarks.bench_decoder", "--device", device, "--repeats", "2",
                                              "--batch", "256"], 120),
               # The compiled variants at batch 32 are left to the profile (its wall times) and batch 128.
               Step("bench-precision", py + ["benchmarks.bench_precision", "--device", device, "--batch-size", "32",
                                            "--repeats", "2", "--variants", "fp32,bf16,fp16"], 120),
               Step("profile", py + ["benchmarks.profile_step", "--device", device, "--batch-size", "32",
                                     "--variants", "fp32,bf16,fp32+compile", "--out", traces], 150),
               Step("bench-precision-128", py + ["benchmarks.bench_precision", "--device", device,
                                                "--batch-size", "128", "--repeats", "2",
                                                "--variants", "fp32,bf16,bf16+cl,fp32+compile,fp32+static,"
                                                              "fp32+graphs,bf16+cl+graphs"],
                    210),
               # A few thousand JPEGs, timed twice (the first pass meets new shapes), with the batch
               # `captioner caption` takes on a GPU, and with JPEGs decoded there.
               Step("bench-caption", py + ["benchmarks.bench_caption", "--device", device, "--images", "2000",
                                          "--batch-size", str(default_batch_size("cuda")),
                                          "--workers", str(min(16, os.cpu_count() or 1)),
                                          "--repeats", "2", "--skip-memory", "--skip-demo", "--decode-on-device"],
                    240),
               # The same in bf16: the encoder in channels-last, the search as CUDA graphs.
               Step("bench-caption-bf16", py + ["benchmarks.bench_caption", "--device", device, "--images", "2000",
                                               "--batch-size", str(default_batch_size("cuda")),
                                               "--workers", str(min(16, os.cpu_count() or 1)), "--precision", "bf16",
                                               "--repeats", "2", "--skip-memory", "--skip-demo"],
                    200),
               Step("bench-coco-train", py + ["benchmarks.bench_coco_train", "--device", device, "--batch-size", "64",
                                             "--steps", "10"], 150)]
    if tutorial is not None:
        out.append(Step("compare-tutorial", py + ["benchmarks.compare_tutorial", str(tutorial), "--device", device,
                                                  "--rounds", "1" if quick else "3"]
                        + ([] if device == "cpu" else ["--graphs"])
                        + (["--batch", "4", "--beam-images", "4", "--steps", "6", "--beam-steps", "6"]
                           if quick else []), 300))
    return out


def select_steps(steps: list[Step], only: str) -> list[Step]:
    """The steps that ``--only`` names (comma-separated names or prefixes), with the steps they
    need (Step.needs, and theirs), in their order; all for "". A step whose input no step of the
    run makes would fail, as a compare step did without its two caption steps."""
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    if not wanted:
        return steps
    chosen = {s.name for s in steps if any(s.name.startswith(w) for w in wanted)}
    needs = {s.name: s.needs for s in steps}
    todo = list(chosen)
    while todo:
        for name in needs[todo.pop()]:
            if name not in chosen:
                chosen.add(name)
                todo.append(name)
    return [s for s in steps if s.name in chosen]


STEP_ENV = {"TORCH_LOGS": "recompiles", "PYTHONUNBUFFERED": "1"}


def forkable(step: Step) -> bool:
    """A ``python -m MODULE`` step (torchrun's launcher too: its workers are processes of their own)."""
    return step.argv[:2] == [sys.executable, "-m"]


def preload(steps: list[Step]) -> None:
    """Import, in this process, what the forked steps import (torch, torchvision, the captioner,
    the training, each step's module), so that a fork starts with them loaded."""
    import torch  # noqa: F401
    import torchvision  # noqa: F401

    for module in ("captioner.cli.main", "captioner.train", *{s.argv[2] for s in steps if forkable(s)}):
        importlib.import_module(module)


def _run_forked(step: Step, log) -> int | None:
    """``python -m MODULE ARGS`` as a fork of this process: its output into ``log``, its exit
    code back, killed at its time box (None)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the step
        code = 1
        try:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            # print() into the log too where a caller (a test's capture) had replaced sys.stdout
            sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
            os.setpgid(0, 0)  # its own group: a timeout kills what it started too
            code = run_as_main(step.argv[1:])  # torchrun's workers forked from it too
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + step.timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            _stop_group(pid)
            return None
        time.sleep(0.05)


def _stop_group(pid: int, grace: float = 5.0) -> None:
    """End a timed-out fork and its process group: SIGTERM first, which torchrun's launcher
    passes on to its workers (they run in sessions of their own), then SIGKILL after ``grace``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            break
        end = time.monotonic() + grace
        while time.monotonic() < end:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
            time.sleep(0.05)
    os.waitpid(pid, 0)


def run_step(step: Step, index: int, logs: Path, fork: bool = False) -> Outcome:
    """Run one step, its output in ``LOGS/NN-name.log``; ``fork``: a ``python -m`` step as a
    fork of this process (preload first), the others in processes of their own."""
    log = logs / f"{index:02d}-{step.name}.log"
    env = {**os.environ, **STEP_ENV}
    start = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + " ".join(step.argv) + "\n")
        f.flush()
        if fork and forkable(step):
            code = _run_forked(step, f)
        else:
            try:
                code = subprocess.run(step.argv, stdout=f, stderr=subprocess.STDOUT, env=env,
                                      timeout=step.timeout).returncode
            except subprocess.TimeoutExpired:
                code = None
    seconds = time.perf_counter() - start
    text = log.read_text(errors="replace").split("\n", 1)[-1]  # the output, not the command line above it
    note = ""
    last = [line for line in text.splitlines() if line.startswith("RESULT ")]
    if last:
        note = last[-1][len("RESULT "):]
    return Outcome(step.name, code, seconds, text.count("Traceback (most recent call last)"),
                   len(RECOMPILE.findall(text)), bool(LIMIT_HIT.search(text)), note)


def environment_line(device: str) -> str:
    import torch
    name = torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available() else "CPU"
    return (f"device {device} ({name}), torch {torch.__version__}, python {sys.version.split()[0]}, "
            f"{os.cpu_count()} cores")


def cmd_compare(paths: list[str]) -> int:
    """Caption for caption: the first file's captions against each other file's."""
    def read(p: str) -> dict[str, str]:
        rows = [json.loads(line) for line in Path(p).read_text().splitlines() if line.strip()]
        return {r["image"]: r.get("caption") for r in rows}

    base = read(paths[0])
    worst = 0
    for other in paths[1:]:
        theirs = read(other)
        differ = [k for k in base if theirs.get(k) != base[k]]
        worst = max(worst, len(differ))
        for k in differ[:5]:
            print(f"{k}: {base[k]!r} vs {theirs.get(k)!r}")
        print(f"RESULT {len(base) - len(differ)}/{len(base)} captions identical")
    if not base:
        print("no captions to compare", file=sys.stderr)
        return 1
    return 0 if worst <= max(1, len(base) // 20) else 1  # numerics may flip a near-tie, not more


def cmd_app(device: str, folder: str) -> int:
    """The app's captioning path (serving.caption_image) on the device, for every image of a folder."""
    from captioner.app import serving
    from captioner.batching import Gate
    from captioner.inference import Captioner, DecodeOptions

    captioner = Captioner.load(None, device=device)
    gate = Gate(1, threads=1, batch=4)
    files = sorted(Path(folder).glob("*.png")) + sorted(Path(folder).glob("*.jpg"))
    start = time.perf_counter()
    for i, p in enumerate(files):
        shown = serving.caption_image(captioner, gate, (i,), p.name, p.read_bytes(), DecodeOptions(beam_size=3))
        assert shown.result.words, f"no caption for {p}"
    print(f"RESULT {len(files)} uploads captioned on {captioner.device} in {time.perf_counter() - start:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compare"]:
        return cmd_compare(argv[1:])
    if argv[:1] == ["app"]:
        ap = argparse.ArgumentParser(prog="gpu_check app")
        ap.add_argument("--device", default="cuda")
        ap.add_argument("folder")
        a = ap.parse_args(argv[1:])
        return cmd_app(a.device, a.folder)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for the logs and the summary (made if missing)")
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes, torch.compile's eager backend, longer time boxes (a CPU test of the check)")
    ap.add_argument("--tutorial", type=Path, default=None, help="the tutorial's folder, for compare_tutorial")
    ap.add_argument("--only", default="",
                    help="comma-separated step names (or prefixes) to run; default all. The steps a named one needs "
                         "run too: compare-beamN's two caption steps, and the soft fp32 training that hard, SCST "
                         "and resumed training start from")
    ap.add_argument("--fork", action="store_true",
                    help="with --device cpu: run each python -m step in a fork of this process, which has imported "
                         "torch and the captioner once (seconds less a step; the CPU test of the check uses it)")
    ap.add_argument("--skip-bench", action="store_true", help="leave out the benchmarks")
    ap.add_argument("--budget", type=float, default=600,
                    help="seconds for the whole check (default 600): steps that would start later are skipped "
                         "and counted as failed, so a time-boxed machine still brings back a summary")
    args = ap.parse_args(argv)

    missing = missing_packages()
    if missing:
        print(f"gpu_check: missing packages: {', '.join(missing)} (nothing is installed by this check)",
              file=sys.stderr)
        return 2
    if args.tutorial is not None and not (args.tutorial / "models.py").is_file() and not args.tutorial.is_file():
        print(f"gpu_check: --tutorial {args.tutorial}: no models.py there (the tutorial's folder)", file=sys.stderr)
        return 2
    if args.fork and args.device != "cpu":
        print("gpu_check: --fork is for --device cpu (a fork of a process that has used CUDA cannot use it)",
              file=sys.stderr)
        return 2
    if args.fork:
        os.environ.update(STEP_ENV)  # torch reads TORCH_LOGS at its import, which the forks share
    import torch
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: --device cuda but torch sees no GPU; use --device cpu --quick on a CPU", file=sys.stderr)
        return 2
    logs = args.out.resolve()
    logs.mkdir(parents=True, exist_ok=True)
    data = logs / "data"
    images = data / "caption-images"
    steps = (train_steps(args.device, args.quick, logs, data / "shapes")
             + caption_steps(args.device, args.quick, logs, images)
             + ([] if args.skip_bench else bench_steps(args.device, args.quick, logs, args.tutorial)))
    steps = select_steps(steps, args.only)
    if args.fork:
        preload(steps)
    if not images.exists():  # shapes test images for the captioning steps, made once
        made = run_step(Step("caption-images", captioner_cmd(
            "shapes", "--out", str(data / "gen"), "--train", "0", "--val", "0",
            "--test", "8" if args.quick else "96", "--seed", "4242"), 300), 0, logs, args.fork)
        if not made.ok:
            print(f"gpu_check: the captioning steps' images could not be made: {logs / '00-caption-images.log'}",
                  file=sys.stderr)
            return 1
        (data / "gen" / "images" / "test").rename(images)
    head = environment_line(args.device)
    print(head, flush=True)
    lines = [head]
    outcomes = []
    deadline = time.perf_counter() + args.budget
    for i, step in enumerate(steps, 1):
        left = deadline - time.perf_counter()
        if left < 10:
            o = Outcome(step.name, None, 0.0, 0, 0, False, "skipped: out of --budget")
        else:
            step.timeout = min(step.timeout * (3 if args.quick else 1), left)  # a CPU is slower
            o = run_step(step, i, logs, args.fork)
        outcomes.append(o)
        lines.append(o.line())
        print(o.line(), flush=True)
    failed = sum(not o.ok for o in outcomes)
    tail = f"{len(outcomes) - failed}/{len(outcomes)} steps passed, {sum(o.seconds for o in outcomes):.0f} s"
    print(tail)
    (logs / "summary.txt").write_text("\n".join([*lines, tail]) + "\n")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
