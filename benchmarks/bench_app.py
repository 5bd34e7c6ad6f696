"""A classroom on one machine: N browser sessions upload images to one app server at once.

    python benchmarks/bench_app.py [--sessions 6] [--seconds 180] [--images 200] [--workers N]

Starts the page as `captioner app` serves it (127.0.0.1, a free port), opens N separate
contexts of Debian's Chromium (headless, driven by Playwright; its own browser downloads
are never used) and has each upload, for --seconds, a mix of the page's example images
(every --example-every'th upload) and distinct generated photographs (640x480 JPEG), one
after the other, waiting each time for its caption. The browsers run at a lower CPU priority
than the server (--browser-nice): they stand for the students' own machines, and take the
cores the server leaves. Nothing but 127.0.0.1 is contacted;
every request the pages make is recorded.

Prints: uploads/s; caption latency (upload -> its caption on the page) p50/p95/max; the
server's CPU-seconds per upload (its process's user+system time over the upload phase);
the model's own captioning time per image (`Captioner.caption`, one torch thread, as the
server's workers run it, on the first --model-images photographs uploaded, timed before the
run and after it, the mean of the two medians); the server's resident memory
at start, after the first upload, at its peak and at the end (sessions closed, then
--settle seconds); script runs per upload (the server's run log, $CAPTIONER_APP_RUN_LOG) and
requests per upload the pages made; failed uploads; captions that differ from the model's own; requests to
any other host; and, timed before the uploads (--idle-seconds), what the open pages cost the
server while nobody uploads. --json writes the same figures to a file.

--page serves another copy of the page (e.g. an older version, exported with `git archive`):
the server then imports `app` and `captioner` from that copy's folder.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import psutil
from bench_caption import photo_images  # the same generated photographs as the caption benchmark

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
LOCAL_HOSTS = {"127.0.0.1", "localhost"}
# The page's uploader; during a script run the one it replaced may linger, marked stale.
UPLOADER = ".stElementContainer:not([data-stale=true]) input[type=file]"


def make_photos(n: int, seed: int = 0) -> list[tuple[str, bytes]]:
    """Distinct 640x480 JPEGs (bench_caption's generated photos), as (name, bytes)."""
    photos = []
    for i, im in enumerate(photo_images(n, seed)):
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=90)
        photos.append((f"photo{i:04d}.jpg", buf.getvalue()))
    return photos


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(page: Path, workdir: Path, workers: int | None) -> tuple[subprocess.Popen, str, Path]:
    from captioner.app.cli import server_env, streamlit_command

    port = free_port()
    cmd = streamlit_command(port, "127.0.0.1")
    cmd[cmd.index("run") + 1] = str(page)
    root = page.resolve().parents[1]
    env = server_env(workers, base={**os.environ, "CAPTIONER_WEIGHTS_DIR": str(workdir / "no-weights"),
                                    "CAPTIONER_APP_RUN_LOG": str(workdir / "runs.log"),
                                    "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])})
    log = workdir / "streamlit.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url, log
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"the server did not answer within 120 s:\n{log.read_text(errors='replace')}")


class Sampler(threading.Thread):
    """The server's resident memory, every quarter second: the peak between two reads."""

    def __init__(self, proc: psutil.Process):
        super().__init__(daemon=True)
        self.proc, self.peak, self.stop = proc, proc.memory_info().rss, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.25):
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return


def cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def browser_cpu_seconds(server: psutil.Process) -> float:
    """CPU time of this process's other children: Playwright's driver and Chromium's processes."""
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        if child.pid != server.pid:
            try:
                total += cpu_seconds(child)
            except psutil.Error:
                pass
    return total


def script_runs(log: Path | None) -> int:
    """Script runs the server has logged so far (pages older than the run log log none)."""
    return len(run_log(log))


def run_log(log: Path | None) -> list[list[str]]:
    """The server's run log: per run [time, what, run CPU ms, model CPU ms]."""
    try:
        return [line.split("\t") for line in log.read_text().splitlines()] if log else []
    except OSError:
        return []


def run_cpu(lines: list[list[str]]) -> tuple[float, float, int]:
    """(CPU-seconds of the logged script runs, of the captions made in them, captions made)."""
    rows = [(float(r[2]), float(r[3])) for r in lines if len(r) == 4]
    return sum(r for r, _ in rows) / 1000, sum(m for _, m in rows) / 1000, sum(m > 0 for _, m in rows)


def machine_busy() -> float:
    """Seconds of CPU the whole machine has spent busy, all cores."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0) + getattr(t, "steal", 0)


class Run:
    """What the sessions record, shared by their coroutines (one event loop: no locks needed)."""

    def __init__(self, uploads: list[tuple[str, bytes]], server: psutil.Process):
        self.uploads, self.server = uploads, server
        self.next = 0
        self.latencies: list[float] = []
        self.opens: list[float] = []
        self.failed: list[str] = []
        self.captions: dict[str, tuple[int, str]] = {}  # upload name -> (image index, caption on the page)
        self.requests: list[str] = []
        self.rss_after_first: int | None = None
        self.end = 0.0  # when uploading stops (time.monotonic), set once every page is open
        self.finished = 0  # sessions done uploading
        self.browser_cpu = 0.0  # Chromium's and the driver's CPU-seconds over the upload phase
        self.machine_cpu = 0.0  # the whole machine's, every process
        self.run_log: Path | None = None  # the server's run log: one line per script run
        self.runs0 = self.runs = 0
        self.run_cpu = self.model_cpu = 0.0  # CPU-seconds of the upload phase's script runs, of their captions
        self.captioned = 0  # captions made (the others came from the results cache)
        self.upload_phase_requests = 0  # requests the pages made while uploading
        self.idle_cpu_per_s: float | None = None  # the server's CPU-seconds per second, every page open and idle

    def take(self) -> int:
        i = self.next % len(self.uploads)
        self.next += 1
        return i


async def session(sid: int, browser, url: str, run: Run, start: asyncio.Event, close: asyncio.Event,
                  timeout_s: float, ready: list) -> None:
    context = await browser.new_context(viewport={"width": 1400, "height": 1000})
    context.on("request", lambda r: run.requests.append(r.url))
    try:
        page = await context.new_page()
        t0 = time.perf_counter()
        await page.goto(url, timeout=timeout_s * 1000)
        await page.get_by_text(" · beam ").first.wait_for(timeout=timeout_s * 1000)  # the first example
        run.opens.append(time.perf_counter() - t0)
        ready.append(sid)
        await start.wait()
        n = 0
        while time.monotonic() < run.end:
            i = run.take()
            stem, data = run.uploads[i]
            name = f"s{sid}-{n}-{stem}"
            n += 1
            mime = "image/png" if stem.endswith(".png") else "image/jpeg"
            t0 = time.perf_counter()
            try:
                await page.locator(UPLOADER).set_input_files(
                    {"name": name, "mimeType": mime, "buffer": data})
                await page.get_by_text(f"{name} · ").wait_for(timeout=timeout_s * 1000)
                run.latencies.append(time.perf_counter() - t0)
                if run.rss_after_first is None:
                    run.rss_after_first = run.server.memory_info().rss
                caption = (await page.locator(".st-key-caption h2").inner_text()).strip()
                run.captions[name] = (i, caption)
                if await page.get_by_test_id("stException").count():
                    run.failed.append(f"{name}: an exception on the page")
            except Exception as e:  # a timeout, a closed page: counted, and the session goes on
                run.failed.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        run.finished += 1
        await close.wait()  # the page stays open until the browser's CPU time is read
    finally:
        await context.close()


async def drive(url: str, run: Run, args: argparse.Namespace) -> tuple[float, float]:
    """Open every page, then upload for --seconds. Returns (seconds, server CPU-seconds) of the upload phase."""
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            start, close, ready = asyncio.Event(), asyncio.Event(), []
            run.end = time.monotonic() + 10 * 86400
            tasks = [asyncio.create_task(session(s, browser, url, run, start, close, args.upload_timeout, ready))
                     for s in range(args.sessions)]
            deadline = time.monotonic() + args.upload_timeout + 5 * args.sessions
            while len(ready) < args.sessions and time.monotonic() < deadline:
                for t in tasks:
                    if t.done() and t.exception() is not None:
                        raise t.exception()
                await asyncio.sleep(0.2)
            if len(ready) < args.sessions:
                raise SystemExit(f"only {len(ready)} of {args.sessions} pages opened in time")
            if args.idle_seconds:
                await asyncio.sleep(2)  # the last page's own runs end
                idle0, t_idle = cpu_seconds(run.server), time.monotonic()
                await asyncio.sleep(args.idle_seconds)  # every page open, nobody uploading
                run.idle_cpu_per_s = (cpu_seconds(run.server) - idle0) / (time.monotonic() - t_idle)
            run.runs0 = script_runs(run.run_log)
            cpu0, t0 = cpu_seconds(run.server), time.monotonic()
            browser0, machine0 = browser_cpu_seconds(run.server), machine_busy()
            run.end = t0 + args.seconds
            requests0 = len(run.requests)
            start.set()
            # Every session ends its last upload within --upload-timeout of the end.
            deadline = time.monotonic() + args.seconds + args.upload_timeout + 60
            while run.finished < args.sessions and not all(t.done() for t in tasks):
                if time.monotonic() > deadline:
                    raise SystemExit("sessions still uploading long after the end")
                await asyncio.sleep(0.1)
            logged = run_log(run.run_log)[run.runs0:]
            run.runs = len(logged)
            run.run_cpu, run.model_cpu, run.captioned = run_cpu(logged)
            run.browser_cpu = browser_cpu_seconds(run.server) - browser0
            run.machine_cpu = machine_busy() - machine0
            seconds, cpu = time.monotonic() - t0, cpu_seconds(run.server) - cpu0
            run.upload_phase_requests = len(run.requests) - requests0
            close.set()
            await asyncio.gather(*tasks)
            return seconds, cpu
        finally:
            await browser.close()


def model_times(cap, uploads: list[tuple[str, bytes]], indices: list[int],
                threads: tuple[int, ...]) -> tuple[dict, dict[int, str]]:
    """Captioner.caption alone on the given uploads (decoded from the same bytes, as the page
    does), with each number of torch threads in ``threads``: wall and CPU time, median per image.
    Returns ({threads: (wall, cpu)}, the captions by index)."""
    import torch

    from captioner.inference import DecodeOptions

    default_threads = torch.get_num_threads()
    own: dict[int, str] = {}
    times = {}
    for n in threads:
        torch.set_num_threads(n)
        wall, cpu = [], []
        for i in indices:
            data = uploads[i][1]
            t0, c0 = time.perf_counter(), time.process_time()
            own[i] = cap.caption(cap.preprocess.load(data), DecodeOptions()).caption
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        times[n] = (statistics.median(wall), statistics.median(cpu)) if indices else (float("nan"),) * 2
    torch.set_num_threads(default_threads)
    return times, own


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--sessions", type=int, default=6, help="browser sessions uploading at once (default 6)")
    ap.add_argument("--seconds", type=float, default=180, help="how long they upload (default 180)")
    ap.add_argument("--images", type=int, default=200, help="distinct photographs to upload (default 200)")
    ap.add_argument("--example-every", type=int, default=5,
                    help="every n-th upload is one of the page's example images (default 5; 0: none)")
    ap.add_argument("--workers", type=int, default=None, help="the server's --workers (default: its own)")
    ap.add_argument("--upload-timeout", type=float, default=120, help="seconds before an upload counts as failed")
    ap.add_argument("--settle", type=float, default=5, help="seconds after the sessions close before 'end' memory")
    ap.add_argument("--idle-seconds", type=float, default=10,
                    help="seconds the pages stay open and idle before uploading, to time what open pages "
                         "cost the server (default 10; 0: none)")
    ap.add_argument("--browser-nice", type=int, default=10,
                    help="the browsers' CPU priority below the server's (nice; default 10): they stand for "
                         "the students' own machines and take what the server leaves; 0: the same priority")
    ap.add_argument("--model-images", type=int, default=100, help="images the model is timed on alone (default 100)")
    ap.add_argument("--page", type=Path, default=ROOT / "app" / "streamlit_app.py", help="the page to serve")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    if not 0 <= args.browser_nice <= 19:
        ap.error("--browser-nice must be between 0 and 19")
    if args.sessions < 1 or args.seconds <= 0 or args.images < 1 or args.example_every < 0 or args.idle_seconds < 0:
        ap.error("--sessions, --seconds and --images must be positive, --example-every and --idle-seconds "
                 "at least 0")
    if not Path(CHROMIUM).is_file():
        ap.error(f"needs Debian's chromium at {CHROMIUM}")
    if not args.page.is_file():
        ap.error(f"no such page: {args.page}")
    args.page = args.page.resolve()  # the server runs in a folder of its own

    photos = make_photos(args.images)
    examples = [(p.name, p.read_bytes()) for p in sorted((ROOT / "app" / "examples").glob("*.png"))]
    uploads = []
    for i, photo in enumerate(photos):
        if args.example_every and examples and i % args.example_every == args.example_every - 1:
            uploads.append(examples[(i // args.example_every) % len(examples)])
        uploads.append(photo)

    # The model alone, timed on the same images before the run and after it: the machine's speed
    # drifts over minutes (a VM's neighbours), so one timing on one side can be off by a third.
    photo_names = {name for name, _ in photos}
    timed = [i for i, (name, _) in enumerate(uploads) if name in photo_names][:args.model_images]
    import torch

    from captioner.inference import Captioner

    default_threads = torch.get_num_threads()
    cap = Captioner.load("demo-soft")
    before, _ = model_times(cap, uploads, timed, (1,))  # one thread, as the server's workers run it

    workdir = Path(tempfile.mkdtemp(prefix="bench-app-"))
    proc, url, log = start_server(args.page, workdir, args.workers)
    server = psutil.Process(proc.pid)
    # The browsers stand for the students' own machines: they take what the server leaves (Chromium
    # and Playwright's driver are started from here, after the server, and inherit the priority).
    base_nice = os.nice(0)
    if args.browser_nice:
        os.nice(args.browser_nice)
    try:
        rss_start = server.memory_info().rss
        sampler = Sampler(server)
        sampler.start()
        run = Run(uploads, server)
        run.run_log = workdir / "runs.log"
        print(f"{args.sessions} sessions upload for {args.seconds:.0f} s to {url} ...", flush=True)
        seconds, cpu = asyncio.run(drive(url, run, args))
        time.sleep(args.settle)
        rss_end = server.memory_info().rss
        sampler.stop.set()
        sampler.join()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(workdir, ignore_errors=True)

    if os.nice(0) != base_nice and os.geteuid() == 0:
        os.nice(base_nice - os.nice(0))  # the model timed at the priority it was timed at before the run
    times, own = model_times(cap, uploads, timed, (1, default_threads))
    checked = [(own[i], c) for i, c in run.captions.values() if i in own]
    checked, differ = len(checked), sum(a != b for a, b in checked)
    # One thread, the setting the server runs the model with: its CPU time is the model's own work
    # (on an idle machine the same as its wall time; on a loaded one the wall time adds waiting).
    # The mean of the timings before and after the run.
    one = (before[1][1] + times[1][1]) / 2
    done = len(run.latencies)
    outside = [u for u in run.requests
               if urlsplit(u).scheme not in ("data", "blob") and urlsplit(u).hostname not in LOCAL_HOSTS]
    mib = 2**20
    figures = {
        "sessions": args.sessions, "browser_nice": args.browser_nice, "seconds": round(seconds, 1), "uploads": done,
        "uploads_per_s": round(done / seconds, 2),
        "latency_p50_s": round(pct(run.latencies, 50), 3), "latency_p95_s": round(pct(run.latencies, 95), 3),
        "latency_max_s": round(max(run.latencies, default=float("nan")), 3),
        "page_open_p50_s": round(pct(run.opens, 50), 2), "page_open_max_s": round(max(run.opens), 2),
        "server_cpu_s_per_upload": round(cpu / max(done, 1), 4),
        "model_s_per_image": round(one, 4), "model_one_thread_wall_s": round(times[1][0], 4),
        "model_before_s_per_image": round(before[1][1], 4), "model_after_s_per_image": round(times[1][1], 4),
        "model_default_threads": default_threads,
        "model_default_threads_wall_s": round(times[default_threads][0], 4),
        "model_default_threads_cpu_s": round(times[default_threads][1], 4),
        "rss_start_mib": round(rss_start / mib), "rss_after_first_upload_mib": round((run.rss_after_first or 0) / mib),
        "rss_peak_mib": round(sampler.peak / mib), "rss_end_mib": round(rss_end / mib),
        "failed_uploads": len(run.failed), "captions_checked": checked, "captions_differing": differ,
        "outside_requests": len(outside), "requests": len(run.requests),
        "browser_cpu_s_per_upload": round(run.browser_cpu / max(done, 1), 4),
        "machine_busy_cores": round(run.machine_cpu / seconds, 2), "machine_cores": psutil.cpu_count(),
        "script_runs_per_upload": round(run.runs / done, 2) if run.runs and done else None,
        "requests_per_upload": round(run.upload_phase_requests / max(done, 1), 2),
        "script_run_cpu_s_per_upload": round(run.run_cpu / done, 4) if run.run_cpu and done else None,
        "model_cpu_s_in_server_per_upload": round(run.model_cpu / done, 4) if run.model_cpu and done else None,
        "server_idle_cpu_s_per_s": None if run.idle_cpu_per_s is None else round(run.idle_cpu_per_s, 4),
        "model_cpu_s_in_server_per_caption": round(run.model_cpu / run.captioned, 4) if run.captioned else None,
    }
    ratio = figures["server_cpu_s_per_upload"] / one
    print(f"uploads: {done} in {seconds:.0f} s = {figures['uploads_per_s']:.2f}/s "
          f"({args.sessions} sessions, pages opened in p50 {figures['page_open_p50_s']:.1f} s, "
          f"max {figures['page_open_max_s']:.1f} s)")
    print(f"caption latency: p50 {figures['latency_p50_s']:.2f} s, p95 {figures['latency_p95_s']:.2f} s, "
          f"max {figures['latency_max_s']:.2f} s")
    print(f"server CPU per upload: {figures['server_cpu_s_per_upload'] * 1000:.0f} ms; model alone, one thread: "
          f"{one * 1000:.0f} ms CPU per image (median over {len(timed)} photographs: {before[1][1] * 1000:.0f} ms "
          f"before the run, {times[1][1] * 1000:.0f} ms after, {times[1][0] * 1000:.0f} ms wall); ratio {ratio:.2f}")
    print(f"model alone, torch's default {default_threads} threads: {times[default_threads][0] * 1000:.0f} ms wall, "
          f"{times[default_threads][1] * 1000:.0f} ms CPU per image")
    print(f"browsers' CPU per upload: {figures['browser_cpu_s_per_upload'] * 1000:.0f} ms; the machine was busy "
          f"{figures['machine_busy_cores']:.2f} of {figures['machine_cores']} cores over the upload phase")
    if figures["script_run_cpu_s_per_upload"] is not None:
        in_server = figures["model_cpu_s_in_server_per_upload"]
        print(f"in the server, per upload: script runs {figures['script_run_cpu_s_per_upload'] * 1000:.0f} ms CPU, "
              f"of which the model {in_server * 1000:.0f} ms ({run.captioned} captions made, "
              f"{figures['model_cpu_s_in_server_per_caption'] * 1000:.0f} ms each; the others were cached); "
              f"server CPU / the model's in the server: {figures['server_cpu_s_per_upload'] / in_server:.2f}")
    if run.idle_cpu_per_s is not None:
        idle = run.idle_cpu_per_s
        print(f"the server with the {args.sessions} pages open and idle: {idle * 1000:.1f} ms CPU per second, "
              f"{idle / max(figures['uploads_per_s'], 1e-9) * 1000:.1f} ms per upload at this run's rate")
    runs = figures["script_runs_per_upload"]
    print(f"per upload: {'n/a (the page logs no runs)' if runs is None else runs} script runs, "
          f"{figures['requests_per_upload']:.1f} requests from the browser")
    print(f"server memory: start {figures['rss_start_mib']} MiB, after the first upload "
          f"{figures['rss_after_first_upload_mib']} MiB, peak {figures['rss_peak_mib']} MiB, "
          f"end {figures['rss_end_mib']} MiB")
    print(f"failed uploads: {len(run.failed)}; captions differing from the model's own: {differ} of {checked}; "
          f"requests to other hosts: {len(outside)} of {len(run.requests)}")
    for line in run.failed[:5]:
        print(f"  failed: {line}")
    for u in sorted(set(outside))[:5]:
        print(f"  outside: {u}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
