"""`captioner serve` under load: the same JPEGs from 1, 4, 16 and 64 concurrent clients.

    python benchmarks/bench_serve.py [--images 200] [--clients 1 4 16 64] [--weights W] [--device cpu]
                                     [--bad 1000] [--no-overload] [--no-reference] [--rounds 1]
                                     [--json FILE]
                                     [-- SERVER FLAGS...]

Starts `captioner serve` on a free 127.0.0.1 port (flags after -- go to it), makes --images
distinct 640x480 JPEGs in memory (the generated photographs of bench_caption.py), and for each
client count sends each image once from that many concurrent clients: an asyncio httpx script,
bounded (a fixed number of requests, each with a timeout), that stops by itself and talks to
127.0.0.1 only. Per level it prints images/s, latency p50/p95/p99 of the captioned requests,
answers by status (transport errors by name), the server's CPU seconds per image (its process's
user+system time over the level) and its peak resident memory so far (VmHWM).

References, on the same images and device: `captioner caption DIR` (the images written to a
temporary folder; its throughput is (N - 1) images over its wall time on N images less its
wall time on one, so that start-up and loading the model are left out), and the time to caption
one image in this process (`Captioner.caption` on each JPEG's bytes once, decoding included:
the median and p99).

--rounds R (default 1) repeats the references and the levels R times, in turn, each round
with a server of its own, and reports each figure's median over the rounds (answers summed),
and each round's ratios: a machine whose speed drifts from one minute to the next then moves
the reference and the level it is compared with together.

The overload run: a second server with a short line (--max-queue 4, --max-batch 4, --timeout-s
3, so it holds 8 requests: workers x batch + queue) is sent 4x as many clients as it holds, two
passes over the images. Every request must get a caption, a 503 or a 504 (none lost), the
server must be up afterwards and exit 0 on SIGTERM without a traceback (no crash), and the
accepted requests' p99 is compared with --timeout-s.

The bad-input run (--bad N, default 1,000; 0 skips it): a third server, with --max-pixels
4,000,000 and --max-body-bytes 2,000,000 so that each bad input is cheap to send, first
captions 20 images (its memory then is "before"), then takes N requests cycling through every
bad input of the table in docs/serving.md (not an image, a truncated JPEG, a path as the body,
empty, too many pixels, a body over the limit, a bad option, an unknown option, a form without
its file, a form with another file field), each checked for its own status. A body over the
limit is sent as its headers and its first 64 KB only: its 413 must come before the rest. Then:
is the server alive (/healthz, and a caption), and its RSS after over before.

The last lines are the issue's targets, each "met" or "NOT met". Exit 1 when a request was lost,
the server crashed or a bad input got another status than its own; the speed targets only print.
--json writes every figure to a file.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
# this checkout's `captioner` (as the servers it starts get it), then its benchmarks
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from bench_caption import photo_images  # noqa: E402  (the caption benchmark's photographs)

HOST = "127.0.0.1"
CLIENT_TIMEOUT_S = 120.0  # one request's limit on the client's side: the load always ends

# The overload run's server: a short line, so that a few dozen clients are 4x what it holds.
OVERLOAD_FLAGS = {"--max-queue": 4, "--max-batch": 4, "--timeout-s": 3}
# The bad-input run's server: small limits, so that over-the-limit inputs are cheap to send.
BAD_FLAGS = {"--max-pixels": 4_000_000, "--max-body-bytes": 2_000_000}


def make_jpegs(n: int, seed: int = 0) -> list[bytes]:
    """``n`` distinct 640x480 JPEGs (quality 90), as bytes."""
    out = []
    for im in photo_images(n, seed):
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _env() -> dict:
    """The benchmark's environment, with this checkout's `captioner` first on the path."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _flags(named: dict) -> list[str]:
    return [str(x) for kv in named.items() for x in kv]


class Server:
    """`captioner serve` in its own process, on a free localhost port; its stderr goes to a
    temporary file of the benchmark's, read for tracebacks."""

    def __init__(self, flags: list[str]):
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.flags = flags
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-m", "captioner.cli", "serve", "--host", HOST, "--port",
                                      str(self.port), "--quiet", *flags], stdout=subprocess.DEVNULL,
                                     stderr=self.log, cwd=ROOT, env=_env())
        deadline = time.monotonic() + 180
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited with {self.proc.returncode}:\n{self.stderr()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.proc.kill()
                raise SystemExit(f"the server did not start within 180 s:\n{self.stderr()}")
            time.sleep(0.2)

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def pids(self) -> list[int]:
        """The server's process and its children (the servers `--processes N` forks)."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        found = children.read_text().split() if children.exists() else []
        return [self.proc.pid, *map(int, found)]

    def cpu(self) -> float:
        """The server's user + system CPU seconds so far, its forked servers' included."""
        total = 0
        for pid in self.pids():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except FileNotFoundError:
                continue
            total += int(fields[11]) + int(fields[12])
        return total / os.sysconf("SC_CLK_TCK")

    def memory(self, key: str) -> int:
        """VmHWM (peak) or VmRSS (now), in bytes, summed over the server's processes (forked ones
        share the model's pages until written: the sum counts them once each)."""
        total = 0
        for pid in self.pids():
            try:
                lines = Path(f"/proc/{pid}/status").read_text().splitlines()
            except FileNotFoundError:
                continue
            total += next((int(line.split()[1]) * 1024 for line in lines if line.startswith(key + ":")), 0)
        return total

    def alive(self) -> bool:
        """Up and answering: /healthz, and a caption of a small image."""
        if self.proc.poll() is not None:
            return False
        buf = io.BytesIO()
        Image.new("RGB", (64, 48), (200, 40, 40)).save(buf, "JPEG")
        try:
            return (httpx.get(f"{self.url}/healthz", timeout=10).status_code == 200
                    and httpx.post(f"{self.url}/v1/captions", content=buf.getvalue(), timeout=60).status_code == 200)
        except httpx.HTTPError:
            return False

    def stop(self) -> int:
        """SIGTERM, as a service manager stops it; its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


@dataclass(frozen=True)
class Ask:
    """One request: the body, the query string, its headers; ``declared``: send only ``body`` after
    a Content-Length of ``declared`` (a body over the limit, whose 413 must come before the rest)."""

    body: bytes
    query: str = ""
    headers: tuple[tuple[str, str], ...] = ()
    declared: int | None = None


async def _partial(port: int, ask: Ask, timeout: float) -> int:
    """Headers announcing ``ask.declared`` bytes, then ``ask.body`` only: the status answered."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), timeout)
    try:
        head = (f"POST /v1/captions{ask.query} HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
                f"Content-Type: application/octet-stream\r\nContent-Length: {ask.declared}\r\n"
                "Connection: close\r\n\r\n")
        writer.write(head.encode() + ask.body)
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout)
        return int(line.split()[1])
    finally:
        writer.close()


async def _load(url: str, asks: list[Ask], clients: int,
                timeout: float = CLIENT_TIMEOUT_S) -> list[tuple[object, float]]:
    """Each request sent once, from ``clients`` concurrent clients, in order; for each (in the
    order of ``asks``) its status or the name of its transport error, and its seconds."""
    port = int(url.rsplit(":", 1)[1])
    todo = iter(range(len(asks)))
    out: list[tuple[object, float]] = [("not sent", 0.0)] * len(asks)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        async def worker():
            for i in todo:
                ask = asks[i]
                began = time.perf_counter()
                try:
                    if ask.declared is not None:
                        status: object = await _partial(port, ask, timeout)
                    else:
                        r = await client.post(f"/v1/captions{ask.query}", content=ask.body, headers=dict(ask.headers))
                        status = r.status_code
                except (httpx.HTTPError, OSError, asyncio.TimeoutError, ValueError, IndexError) as e:
                    status = type(e).__name__
                out[i] = (status, time.perf_counter() - began)

        await asyncio.gather(*(worker() for _ in range(clients)))
    return out


def percentile(xs: list[float], q: float) -> float:
    """The nearest-rank percentile (NaN for none)."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, max(0, math.ceil(len(xs) * q / 100) - 1))]


def count(answers: list[tuple[object, float]]) -> dict[str, int]:
    by: dict[str, int] = {}
    for status, _ in answers:
        by[str(status)] = by.get(str(status), 0) + 1
    return dict(sorted(by.items()))


def level(server: Server, jpegs: list[bytes], clients: int, passes: int = 1) -> dict:
    """Each image sent ``passes`` times from ``clients`` concurrent clients: the level's figures."""
    asks = [Ask(j, headers=(("content-type", "image/jpeg"),)) for _ in range(passes) for j in jpegs]
    cpu0, mine0, began = server.cpu(), time.process_time(), time.perf_counter()
    answers = asyncio.run(_load(server.url, asks, clients))
    wall, cpu, mine = time.perf_counter() - began, server.cpu() - cpu0, time.process_time() - mine0
    ok = [s for status, s in answers if status == 200]
    return {"clients": clients, "requests": len(answers), "wall_s": wall, "images_per_s": len(ok) / wall,
            "p50_ms": 1000 * percentile(ok, 50), "p95_ms": 1000 * percentile(ok, 95),
            "p99_ms": 1000 * percentile(ok, 99), "by_status": count(answers),
            "cpu_s_per_image": cpu / max(1, len(ok)), "peak_rss_mib": server.memory("VmHWM") / 2**20,
            # the cores the server and this load generator kept busy: on the server's machine, they share them
            "server_cores": cpu / wall, "client_cores": mine / wall}


def median_of_rounds(records: list[dict]) -> dict:
    """One record from the rounds' records of the same figures: each measured figure's median,
    the answers by status and the requests summed, anything else as the first round has it."""
    out = dict(records[0])
    for key, value in records[0].items():
        if key == "by_status":
            total: dict[str, int] = {}
            for r in records:
                for status, n in r[key].items():
                    total[status] = total.get(status, 0) + n
            out[key] = dict(sorted(total.items()))
        elif key == "requests":
            out[key] = sum(r[key] for r in records)
        elif isinstance(value, float):  # a measured figure (counts, such as the clients, are ints)
            out[key] = statistics.median(r[key] for r in records)
    return out


def reference(jpegs: list[bytes], weights: str | None, device: str) -> dict:
    """`captioner caption DIR` on the images (start-up left out), and one image in-process. Both in
    processes of their own, so that this one (the load generator) never runs torch's threads."""
    extra = ["--weights", weights] if weights else []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "images"
        folder.mkdir()
        for i, data in enumerate(jpegs):
            (folder / f"{i:04d}.jpg").write_bytes(data)
        walls = {}
        for name, target in (("one", str(folder / "0000.jpg")), ("all", str(folder))):
            began = time.perf_counter()
            subprocess.run([sys.executable, "-m", "captioner.cli", "caption", target, "--quiet", "--device", device,
                            "--out", str(Path(tmp) / f"{name}.jsonl"), *extra], check=True, cwd=ROOT, env=_env(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            walls[name] = time.perf_counter() - began
        code = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); import bench_serve; "
                f"print(*bench_serve.one_image_ms({str(folder)!r}, {weights!r}, {device!r}))")
        done = subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=_env(), capture_output=True,
                              text=True)
    extra_s = walls["all"] - walls["one"]
    median_ms, p99_ms = map(float, done.stdout.split()[-2:])
    return {"images": len(jpegs), "caption_dir_wall_s": walls["all"], "caption_one_wall_s": walls["one"],
            "caption_dir_images_per_s": (len(jpegs) - 1) / extra_s if extra_s > 0 else float("nan"),
            "one_image_in_process_ms": median_ms, "one_image_in_process_p99_ms": p99_ms}


def one_image_ms(folder: str, weights: str | None, device: str) -> tuple[float, float]:
    """The median and the p99 of the time to caption one of the JPEGs in ``folder`` in this
    process (`Captioner.caption` on its bytes, decoding included), each JPEG once, the model loaded
    and warmed up first: the same images the levels send, whose captions differ in length."""
    from captioner.cli.common import check_device
    from captioner.inference import Captioner

    cap = Captioner.load(weights, check_device(device))
    cap.caption_images([Image.new("RGB", (64, 64))] * 2)
    files = sorted(Path(folder).glob("*.jpg"))
    times = []
    for path in files:
        data = path.read_bytes()
        began = time.perf_counter()
        cap.caption(data)
        times.append(1000 * (time.perf_counter() - began))
    return statistics.median(times), percentile(times, 99)


def overload(jpegs: list[bytes], base: list[str]) -> dict:
    """4x more clients than the server holds, two passes: none lost, no crash, p99 vs the timeout."""
    flags = _flags(OVERLOAD_FLAGS)
    server = Server([*base, *flags])
    holds = OVERLOAD_FLAGS["--max-batch"] + OVERLOAD_FLAGS["--max-queue"]  # one worker: batch + line
    try:
        got = level(server, jpegs, 4 * holds, passes=2)
        alive = server.alive()
    finally:
        code = server.stop()
    lost = sum(v for k, v in got["by_status"].items() if k not in ("200", "503", "504"))
    crashed = not alive or code != 0 or "Traceback" in server.stderr()
    return {"server_flags": flags, "holds": holds, **got, "lost": lost, "timeout_s": OVERLOAD_FLAGS["--timeout-s"],
            "alive_after": alive, "exit_code": code, "crashes": int(crashed)}


def bad_kinds(good: bytes) -> dict[str, tuple[Ask, int]]:
    """Every bad input of the table, as sent to a server with BAD_FLAGS: (request, its status)."""
    max_pixels, max_body = BAD_FLAGS["--max-pixels"], BAD_FLAGS["--max-body-bytes"]
    bomb = io.BytesIO()
    Image.new("L", (2500, max_pixels // 2500 + 10)).save(bomb, "PNG")  # a few KB, over the pixel limit
    form = b'--x\r\nContent-Disposition: form-data; name="beam_size"\r\n\r\n2\r\n--x--\r\n'
    other = (b'--x\r\nContent-Disposition: form-data; name="photo"; filename="a.jpg"\r\n'
             b"Content-Type: image/jpeg\r\n\r\n" + good + b"\r\n--x--\r\n")
    multipart = (("content-type", "multipart/form-data; boundary=x"),)
    return {
        "not an image": (Ask(b"this is not an image. " * 40), 415),
        "a truncated JPEG": (Ask(good[:2000]), 415),
        "a path as the body": (Ask(b"/etc/passwd"), 415),
        "empty": (Ask(b""), 400),
        "too many pixels": (Ask(bomb.getvalue()), 413),
        "a body over the limit": (Ask(b"\0" * 65536, declared=max_body + 1), 413),
        "a bad option": (Ask(good, "?beam_size=0"), 422),
        "an unknown option": (Ask(good, "?path=/etc/passwd"), 422),
        "a form without its file": (Ask(form, headers=multipart), 400),
        "a form with another file field": (Ask(other, headers=multipart), 422),
    }


def bad_inputs(jpegs: list[bytes], base: list[str], n: int) -> dict:
    """``n`` requests cycling through ``bad_kinds``: each its status, alive after, RSS after / before."""
    flags = _flags(BAD_FLAGS)
    server = Server([*base, *flags])
    try:
        asyncio.run(_load(server.url, [Ask(j) for j in (jpegs * 20)[:20]], 4))  # serving as usual first
        rss0 = server.memory("VmRSS")
        kinds = bad_kinds(jpegs[0])
        names = [list(kinds)[i % len(kinds)] for i in range(n)]
        began = time.perf_counter()
        answers = asyncio.run(_load(server.url, [kinds[k][0] for k in names], 8))
        wall = time.perf_counter() - began
        alive = server.alive()
        rss1 = server.memory("VmRSS")
    finally:
        code = server.stop()
    wrong: dict[str, dict[str, int]] = {}
    for name, (status, _) in zip(names, answers):
        if status != kinds[name][1]:
            wrong.setdefault(name, {}).setdefault(str(status), 0)
            wrong[name][str(status)] += 1
    return {"server_flags": flags, "requests": n, "wall_s": wall, "by_status": count(answers),
            "kinds": {k: v[1] for k, v in kinds.items()}, "wrong_status": wrong, "each_its_status": not wrong,
            "alive_after": alive, "exit_code": code, "traceback": "Traceback" in server.stderr(),
            "rss_before_mib": rss0 / 2**20, "rss_after_mib": rss1 / 2**20, "rss_after_over_before": rss1 / rss0}


def checks(report: dict) -> list[tuple[str, bool, bool]]:
    """The issue's targets: (line, met, a correctness check rather than a speed target)."""
    out = []
    levels = {r["clients"]: r for r in report.get("levels", [])}
    ref = report.get("reference")
    if ref and 16 in levels:
        ratio = levels[16]["images_per_s"] / ref["caption_dir_images_per_s"]
        out.append((f"16 clients / caption DIR: {ratio:.2f}x (target >= 0.8)", ratio >= 0.8, False))
    if ref and 1 in levels:  # each image's latency against the time to caption that image in process, at p99
        ratio = levels[1]["p99_ms"] / ref["one_image_in_process_p99_ms"]
        out.append((f"1 client p99 / in-process p99, the same images: {ratio:.2f}x (target <= 1.5)", ratio <= 1.5,
                    False))
    if "exit_code" in report:
        out.append((f"the levels' server: exit {report['exit_code']} on SIGTERM (target 0)", report["exit_code"] == 0,
                    True))
    for r in levels.values():
        failed = sum(v for k, v in r["by_status"].items() if k != "200")
        out.append((f"{r['clients']} clients: {failed} of {r['requests']} not captioned (target 0)", not failed, True))
    o = report.get("overload")
    if o:
        out.append((f"overload ({o['clients']} clients, the server holds {o['holds']}): {o['crashes']} crashes, "
                    f"{o['lost']} lost of {o['requests']} (target 0, 0)", not o["crashes"] and not o["lost"], True))
        p99 = o["p99_ms"] / 1000
        out.append((f"overload: accepted p99 {p99:.2f} s (target <= --timeout-s {o['timeout_s']} s)",
                    p99 <= o["timeout_s"] or o["by_status"].get("200", 0) == 0, True))
    b = report.get("bad")
    if b:
        wrong = sum(sum(v.values()) for v in b["wrong_status"].values())
        out.append((f"bad input: {wrong} of {b['requests']} got another status than their own (target 0)",
                    not wrong, True))
        out.append((f"bad input: alive after: {'yes' if b['alive_after'] else 'NO'}, exit {b['exit_code']}"
                    f"{', a traceback' if b['traceback'] else ''} (target yes, 0)",
                    b["alive_after"] and b["exit_code"] == 0 and not b["traceback"], True))
        out.append((f"bad input: RSS after / before: {b['rss_after_over_before']:.3f} (target <= 1.1)",
                    b["rss_after_over_before"] <= 1.1, True))
    return out


def print_report(report: dict) -> None:
    print(f"\n{report['images']} images (640x480 JPEG), {report['cores']} cores, load average "
          f"{report['load_average_before']:.1f} before the run (other work on the machine skews every figure); "
          f"server flags: {' '.join(report['server_flags']) or '(defaults)'}")
    print("\n| clients | images/s | p50 ms | p95 ms | p99 ms | answers | server CPU-s/image | peak RSS MiB "
          "| cores busy: server + load generator |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in report.get("levels", []):
        print(f"| {r['clients']} | {r['images_per_s']:.1f} | {r['p50_ms']:.0f} | {r['p95_ms']:.0f} | "
              f"{r['p99_ms']:.0f} | {_statuses(r['by_status'])} | {r['cpu_s_per_image']:.3f} | "
              f"{r['peak_rss_mib']:.0f} | {r['server_cores']:.2f} + {r['client_cores']:.2f} |")
    ref = report.get("reference")
    if ref:
        print(f"\n`captioner caption DIR`: {ref['caption_dir_images_per_s']:.1f} images/s (start-up left out; "
              f"{ref['caption_dir_wall_s']:.1f} s in all for {ref['images']}); one image in-process: "
              f"{ref['one_image_in_process_ms']:.1f} ms at the median, {ref['one_image_in_process_p99_ms']:.1f} ms "
              f"at p99 (each image once)")
        one = next((r for r in report.get("levels", []) if r["clients"] == 1), None)
        if one:  # the target's reading compares like with like; this one, the images' spread too
            print(f"1 client p99 / in-process median: {one['p99_ms'] / ref['one_image_in_process_ms']:.2f}x "
                  f"(in process alone, p99 / median: "
                  f"{ref['one_image_in_process_p99_ms'] / ref['one_image_in_process_ms']:.2f}x)")
    o = report.get("overload")
    if o:
        print(f"\noverload ({' '.join(o['server_flags'])}), {o['clients']} clients, {o['requests']} requests: "
              f"{_statuses(o['by_status'])}; accepted p50/p99 {o['p50_ms']:.0f}/{o['p99_ms']:.0f} ms; "
              f"exit {o['exit_code']}")
    b = report.get("bad")
    if b:
        print(f"\nbad input ({' '.join(b['server_flags'])}), {b['requests']} requests in {b['wall_s']:.1f} s: "
              f"{_statuses(b['by_status'])}; RSS {b['rss_before_mib']:.0f} -> {b['rss_after_mib']:.0f} MiB")
        for name, want in b["kinds"].items():
            got = b["wrong_status"].get(name)
            print(f"  {name}: {want}" + (f"; other statuses: {got}" if got else ""))
    for i, r in enumerate(report.get("rounds", []), 1):  # each round's speed targets, as checks() reads them
        speed = [line for line, _, correctness in checks(r) if not correctness]
        if speed:
            print(f"round {i}: " + "; ".join(speed))
    print()
    for line, met, _ in report["checks"]:
        print(f"{line}: {'met' if met else 'NOT met'}")


def _statuses(by: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in by.items())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    server_flags: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, server_flags = argv[:at], argv[at + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=200, help="distinct 640x480 JPEGs (default 200)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64],
                   help="concurrent clients, one level each (default 1 4 16 64)")
    p.add_argument("--weights", default=None, help="the model, as `captioner serve --weights` (default demo-soft)")
    p.add_argument("--device", default="cpu", help="the servers' and the references' device (default cpu)")
    p.add_argument("--no-reference", action="store_true", help="skip `captioner caption DIR` and the in-process time")
    p.add_argument("--no-overload", action="store_true", help="skip the overload run")
    p.add_argument("--bad", type=int, default=1000, metavar="N", help="bad-input requests (default 1000; 0: none)")
    p.add_argument("--rounds", type=int, default=1,
                   help="references and levels this many times in turn, each figure's median reported (default 1)")
    p.add_argument("--json", type=Path, default=None, help="write every figure to this file")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    base = [*(["--weights", args.weights] if args.weights else []), "--device", args.device]
    jpegs = make_jpegs(args.images)
    report: dict = {"images": args.images, "server_flags": server_flags, "cores": os.cpu_count(),
                    "device": args.device, "weights": args.weights or "demo-soft",
                    "load_average_before": os.getloadavg()[0]}
    rounds: list[dict] = []
    for _ in range(args.rounds):
        this: dict = {}
        if not args.no_reference:
            this["reference"] = reference(jpegs, args.weights, args.device)
            print(json.dumps({"reference": this["reference"]}), flush=True)
        if args.clients:
            server = Server([*base, *server_flags])
            try:
                this["levels"] = []
                for clients in args.clients:
                    this["levels"].append(level(server, jpegs, clients))
                    print(json.dumps({"level": this["levels"][-1]}), flush=True)
            finally:
                this["exit_code"] = server.stop()
        rounds.append(this)
    if rounds and "reference" in rounds[0]:
        report["reference"] = median_of_rounds([r["reference"] for r in rounds])
    if rounds and "levels" in rounds[0]:
        report["levels"] = [median_of_rounds([r["levels"][i] for r in rounds]) for i in range(len(args.clients))]
        report["exit_code"] = next((r["exit_code"] for r in rounds if r["exit_code"] != 0), 0)
    if args.rounds > 1:
        report["rounds"] = rounds
    if not args.no_overload:
        report["overload"] = overload(jpegs, base)
        print(json.dumps({"overload": report["overload"]}), flush=True)
    if args.bad:
        report["bad"] = bad_inputs(jpegs, base, args.bad)
        print(json.dumps({"bad": report["bad"]}), flush=True)
    report["checks"] = checks(report)
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if any(not met and correctness for _, met, correctness in report["checks"]) else 0


if __name__ == "__main__":
    sys.exit(main())
