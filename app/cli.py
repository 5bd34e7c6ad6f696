"""``captioner app``: start the web page, registered into the captioner command through an entry point."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

PAGE = Path(__file__).parent / "streamlit_app.py"


def register(sub: argparse._SubParsersAction) -> None:
    from captioner.inference import INFERENCE_PRECISIONS

    p = sub.add_parser(
        "app", help="start the web app: upload an image, see its caption and the attention for every word",
        description="Start the Streamlit web app and print its address. Models offered: the bundled demo "
                    "models that are installed, and every checkpoint (*.pt) and exported model folder (what "
                    "captioner export wrote) in $CAPTIONER_WEIGHTS_DIR (default ./weights).")
    p.add_argument("--port", type=int, default=8501, help="port to listen on (default 8501)")
    p.add_argument("--address", default="localhost",
                   help="address to listen on (default localhost; 0.0.0.0 for every interface)")
    p.add_argument("--device", default="auto",
                   help="where the model runs: cpu, cuda, cuda:N or auto (default: the GPU if there is one)")
    p.add_argument("--precision", choices=INFERENCE_PRECISIONS, default="fp32",
                   help="fp32 (default), or bf16/fp16 autocast: faster on a GPU, the same captions up to rounding")
    p.add_argument("--workers", type=int, default=None,
                   help="captions made at once, for all users together (default: on a GPU one, which batches "
                        "waiting uploads; on the CPU one per core, each with one torch thread); further uploads "
                        "wait their turn and the page says so")
    p.add_argument("--batch", type=int, default=None,
                   help="uploads captioned together at most, when several wait for the model (default 4; "
                        "1: one at a time)")
    p.add_argument("--max-pixels", type=int, default=None,
                   help="refuse uploads with more pixels than this (default: Pillow's 89,478,485, a guard "
                        "against decompression bombs); the page names this option when it refuses one")
    p.set_defaults(func=cmd_app)


def streamlit_command(port: int, address: str) -> list[str]:
    return [sys.executable, "-m", "streamlit", "run", str(PAGE), "--server.headless", "true",
            "--server.port", str(port), "--server.address", address,
            "--browser.gatherUsageStats", "false", "--client.toolbarMode", "minimal",
            # Serving, not developing: no polling of the source files for changes.
            "--server.fileWatcherType", "none",
            # No full garbage collection after every script run: with a model and a few dozen
            # results in the heap it costs about a tenth of the server's CPU per upload. Python's own
            # generational collection still frees what the runs leave in cycles.
            "--runner.postScriptGC", "false"]


def server_env(workers: int | None = None, base: dict | None = None, batch: int | None = None,
               max_pixels: int | None = None, device: str | None = None, precision: str | None = None) -> dict:
    """The server's environment. Streamlit runs every script run in a fresh thread, and glibc
    gives threads up to 8 malloc arenas per core: memory one run freed sits in an arena the next
    run may not use. Two arenas keep the server smaller (docs/app-serving.md has the figures)."""
    env = dict(os.environ if base is None else base)
    env.setdefault("MALLOC_ARENA_MAX", "2")
    if workers is not None:
        env["CAPTIONER_APP_WORKERS"] = str(workers)
    if batch is not None:
        env["CAPTIONER_APP_BATCH"] = str(batch)
    if max_pixels is not None:
        env["CAPTIONER_APP_MAX_PIXELS"] = str(max_pixels)
    if device is not None:
        env["CAPTIONER_APP_DEVICE"] = device
    if precision is not None:
        env["CAPTIONER_APP_PRECISION"] = precision
    return env


def cmd_app(args: argparse.Namespace) -> int:
    from captioner.cli.common import UsageError, check_device, port_taken

    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be between 1 and 65535, got {args.port}")
    if args.workers is not None and args.workers < 1:
        raise UsageError(f"--workers must be at least 1, got {args.workers}")
    if args.batch is not None and args.batch < 1:
        raise UsageError(f"--batch must be at least 1, got {args.batch}")
    if args.max_pixels is not None and args.max_pixels < 1:
        raise UsageError(f"--max-pixels must be at least 1, got {args.max_pixels}")
    device = check_device(args.device)  # "auto" resolved here: the server runs where this says
    busy = port_taken(args.address, args.port)
    if busy:
        raise UsageError(f"port {args.port} on {args.address} is taken ({busy}; another app?): give another "
                         f"with --port, e.g. --port {args.port + 1 if args.port < 65535 else 8502}")
    cmd = streamlit_command(args.port, args.address)
    env = server_env(args.workers, batch=args.batch, max_pixels=args.max_pixels, device=device,
                     precision=args.precision)
    if os.name == "posix":
        # Become the server, so that Ctrl-C or a supervisor's SIGTERM reaches it directly
        # instead of leaving it running behind a parent that was stopped.
        sys.stdout.flush()
        os.execve(cmd[0], cmd, env)
    try:
        return subprocess.call(cmd, env=env)
    except KeyboardInterrupt:  # Ctrl-C stops the server; not an error
        return 0
