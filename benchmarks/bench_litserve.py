"""`captioner serve` against the same model behind LitServe: the measurement behind the choice of
FastAPI + uvicorn in docs/serving.md.

    pip install litserve        # not a dependency of captioner; only this script needs it
    python benchmarks/bench_litserve.py [--images 100] [--clients 1 4 16] [--rounds 2] [--weights W]

Both servers run on 127.0.0.1 with the same model on the CPU, batches of up to 16 gathered for up
to 10 ms, every core's threads for the model, and are sent the same distinct 640x480 JPEGs by
bench_serve.py's load generator, the two servers taking turns for --rounds rounds. LitServe
cannot take an image as the raw body (a request is JSON, or a form it pickles to its worker), so
it gets the usual LitServe form, JSON with the JPEG in base64, decoded in its worker as
`captioner serve` decodes a body (`Preprocess.load`); `captioner serve` gets the raw body. Per
server and client count: images/s, p50/p99 latency, answers by status, CPU seconds per image
and resident memory of the server's whole process tree (LitServe runs an HTTP process and an
inference process); and per server, the cores it keeps busy while no request comes (10 s,
before the load). The captions are checked to be the same.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serve  # noqa: E402
from bench_serve import HOST, ROOT, Ask, Server, free_port, make_jpegs, percentile  # noqa: E402

MAX_BATCH, WAIT_S = 16, 0.010
IDLE_S = 10.0  # seconds without a request, to measure what a server costs idle


try:
    import litserve as ls
except ImportError:  # the driver says so; only the server process needs it
    ls = None

if ls is not None:
    class CaptionAPI(ls.LitAPI):
        """The model behind LitServe: JSON {"image": base64 JPEG} in, `captioner serve`'s record out.
        Module-level: LitServe spawns its inference worker, which unpickles this."""

        weights: str | None = None

        def setup(self, device):
            import torch
            from PIL import Image

            from captioner.inference import Captioner
            from captioner.search.options import DecodeOptions

            torch.set_num_threads(len(os.sched_getaffinity(0)))
            self.cap = Captioner.load(self.weights, "cpu")
            self.options = DecodeOptions(max_len=self.cap.max_len)
            self.cap.caption_images([Image.new("RGB", (64, 64))] * 2)

        def decode_request(self, request):
            return self.cap.preprocess.load(base64.b64decode(request["image"]))

        def batch(self, images):
            return images

        def predict(self, images):
            return self.cap.caption_images(images, self.options)

        def unbatch(self, results):
            return results

        def encode_response(self, result):
            return result.to_json(None, False, model=self.cap.name, training_data=self.cap.training_data)


def litserve_main(port: int, weights: str | None) -> None:
    """Serve ``weights`` with LitServe at /v1/captions on 127.0.0.1:``port`` (this process's job)."""
    api = CaptionAPI(max_batch_size=MAX_BATCH, batch_timeout=WAIT_S, api_path="/v1/captions")
    api.weights = weights
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1, timeout=30)
    server.run(host=HOST, port=port, log_level="warning", generate_client_file=False)


class LitServe:
    """LitServe in a process of its own; its tree's CPU and memory."""

    def __init__(self, weights: str | None):
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.proc = subprocess.Popen([sys.executable, __file__, "--litserve-server", str(self.port),
                                      *(["--weights", weights] if weights else [])], cwd=ROOT,
                                     env=bench_serve._env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 180
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"LitServe exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.proc.kill()
                raise SystemExit("LitServe did not start within 180 s")
            time.sleep(0.3)

    def stop(self) -> int:
        tree = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        self.proc.terminate()
        try:
            code = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            code = None
        for p in tree:
            if p.is_running():
                p.kill()
        return code


def tree_cpu(pid: int) -> float:
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def tree_rss_mib(pid: int) -> float:
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return sum(p.memory_info().rss for p in procs) / 2**20


def run_level(url: str, pid: int, asks: list[Ask], clients: int) -> dict:
    cpu0, began = tree_cpu(pid), time.perf_counter()
    answers = asyncio.run(bench_serve._load(url, asks, clients))
    wall, cpu = time.perf_counter() - began, tree_cpu(pid) - cpu0
    ok = [s for status, s in answers if status == 200]
    return {"clients": clients, "images_per_s": len(ok) / wall, "p50_ms": 1000 * percentile(ok, 50),
            "p99_ms": 1000 * percentile(ok, 99), "by_status": bench_serve.count(answers),
            "cpu_s_per_image": cpu / max(1, len(ok)), "rss_mib": tree_rss_mib(pid)}


def captions(url: str, asks: list[Ask]) -> list[str]:
    with httpx.Client(base_url=url, timeout=60) as client:
        return [client.post("/v1/captions", content=a.body, headers=dict(a.headers)).json()["caption"]
                for a in asks]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=100)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--weights", default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--litserve-server", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if ls is None:
        raise SystemExit("this benchmark needs LitServe: pip install litserve")
    if args.litserve_server is not None:
        litserve_main(args.litserve_server, args.weights)
        return 0
    jpegs = make_jpegs(args.images)
    raw = [Ask(j, headers=(("content-type", "image/jpeg"),)) for j in jpegs]
    wrapped = [Ask(json.dumps({"image": base64.b64encode(j).decode()}).encode(),
                   headers=(("content-type", "application/json"),)) for j in jpegs]
    weights = ["--weights", args.weights] if args.weights else []
    rows: list[dict] = []
    same = None
    for round_ in range(args.rounds):
        for name in ("captioner serve", "LitServe"):
            if name == "LitServe":
                server, asks = LitServe(args.weights), wrapped
            else:
                server = Server([*weights, "--device", "cpu", "--max-batch", str(MAX_BATCH), "--max-wait-ms",
                                 str(1000 * WAIT_S)])
                asks = raw
            try:
                cpu0 = tree_cpu(server.proc.pid)
                time.sleep(IDLE_S)
                idle = (tree_cpu(server.proc.pid) - cpu0) / IDLE_S
                rows.append({"server": name, "round": round_, "idle_cpu": idle})
                print(json.dumps(rows[-1]), flush=True)
                for clients in args.clients:
                    row = run_level(server.url, server.proc.pid, asks, clients)
                    rows.append({"server": name, "round": round_, **row})
                    print(json.dumps(rows[-1]), flush=True)
                if round_ == 0:
                    got = captions(server.url, asks[:20])
                    same = got if same is None else (same == got)
            finally:
                server.stop()
    print(f"\n{args.images} images, {os.cpu_count()} cores; the same captions from both: {same is True}\n")
    print("| server | clients | images/s | p50 ms | p99 ms | answers | CPU-s/image | RSS MiB (all processes) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "idle_cpu" in r:
            continue
        print(f"| {r['server']} | {r['clients']} | {r['images_per_s']:.1f} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | "
              f"{bench_serve._statuses(r['by_status'])} | {r['cpu_s_per_image']:.3f} | {r['rss_mib']:.0f} |")
    for r in rows:
        if "idle_cpu" in r:
            print(f"{r['server']}, round {r['round'] + 1}, idle for {IDLE_S:g} s: {r['idle_cpu']:.2f} cores busy")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "same_captions": same is True}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
