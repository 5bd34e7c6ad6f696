"""``captioner serve``: the command and its flags. FastAPI and uvicorn are imported only once it
serves, so that the command line (and ``--help``) costs nothing more for them."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from captioner.batching import CoreShare, usable_cores
from captioner.cli.common import (
    EXIT_OK,
    UsageError,
    check_device,
    load_model,
    number,
    port_taken,
    positive,
)
from captioner.serve.service import MAX_BODY_BYTES, Limits

MAX_AUTO_PROCESSES = 8  # the default's limit: each process holds its own activations and queue
WEB = ("fastapi", "uvicorn", "multipart")  # what serving needs beyond the library (multipart: python-multipart)


def _seconds(text: str) -> float:
    value = number(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def _milliseconds(text: str) -> float:
    value = number(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of milliseconds >= 0, got {text}")
    return value


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    from captioner.inference import INFERENCE_PRECISIONS

    d = Limits()
    p = sub.add_parser(
        "serve", help="caption images over HTTP for programs: concurrent requests batched, bounded",
        description="Serve the model over HTTP (FastAPI on uvicorn). POST /v1/captions takes one image as the "
                    "raw body or as the multipart field `file`, options as query parameters or form fields "
                    "with `captioner caption`'s names (beam_size, num_captions, max_len, with_attention, ...), "
                    "and answers the JSON record `captioner caption` writes, without \"image\". GET /v1/model "
                    "(the model card), /healthz, /readyz, /docs and /openapi.json. Concurrent requests are "
                    "captioned together: up to --max-batch images, or what arrived within --max-wait-ms. Bad "
                    "input gets one line of JSON: 400 empty, 413 too large, 415 not an image, 422 a bad option, "
                    "503 (with Retry-After) when the queue is full, 504 past --timeout-s. It takes bytes only, "
                    "never paths, writes nothing to disk, and on SIGTERM finishes the requests in flight and "
                    "exits 0. docs/serving.md has examples.")
    p.add_argument("--weights", default=None,
                   help="checkpoint file, exported model folder, or a bundled demo: demo-soft (default), demo-hard, "
                        "demo-zh")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for every interface, "
                        "behind a reverse proxy)")
    p.add_argument("--port", type=positive, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--workers", type=positive, default=d.workers,
                   help="batches captioned at once, in this process (default 1: one batch at a time, taking the "
                        "cores other batches leave; several processes: --processes)")
    p.add_argument("--processes", type=positive, default=None, metavar="N",
                   help=f"server processes sharing the port, forked once the model is loaded (CPU only; default: "
                        f"one a core, at most {MAX_AUTO_PROCESSES}, on a Linux CPU, a container's CPU quota "
                        "heeded; else 1). One process keeps about 1.2 cores busy: its search and its HTTP loop "
                        "are Python, one thread at a time. Each process batches its own requests; a batch takes "
                        "the cores the others leave (every core alone, one while every process captions), so one "
                        "request is as fast as with one process (docs/serving.md)")
    p.add_argument("--max-batch", type=positive, default=None, metavar="B",
                   help="images captioned together at most (default 16 on a CPU, 64 on a GPU)")
    p.add_argument("--max-wait-ms", type=_milliseconds, default=d.max_wait_ms, metavar="T",
                   help="how long a batch waits for more requests that are on their way (being read or decoded), "
                        f"in milliseconds (default {d.max_wait_ms:g}; a lone request never waits)")
    p.add_argument("--max-queue", type=positive, default=d.max_queue, metavar="Q",
                   help=f"requests waiting for the model at most; more are refused with 503 and Retry-After "
                        f"(default {d.max_queue})")
    p.add_argument("--max-pixels", type=positive, default=d.max_pixels, metavar="P",
                   help="refuse images with more pixels than this with 413, a guard against decompression bombs "
                        f"(default Pillow's {d.max_pixels:,})")
    p.add_argument("--max-body-bytes", type=positive, default=MAX_BODY_BYTES, metavar="N",
                   help=f"refuse bodies over this many bytes with 413, before reading them (default "
                        f"{MAX_BODY_BYTES:,})")
    p.add_argument("--timeout-s", type=_seconds, default=d.timeout_s, metavar="S",
                   help=f"a request not captioned within S seconds of its arrival is answered 504 (default "
                        f"{d.timeout_s:g})")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: the GPU if there is one)")
    p.add_argument("--precision", choices=INFERENCE_PRECISIONS, default="fp32",
                   help="fp32 (default), or bf16/fp16 autocast: faster on a GPU, the same captions up to rounding")
    p.add_argument("--quiet", action="store_true", help="no access log; warnings and errors only")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    missing = [m for m in WEB if not _importable(m)]
    if missing:
        raise UsageError(f"serving needs {', '.join(missing)}: pip install fastapi uvicorn python-multipart")
    device = check_device(args.device)
    busy = port_taken(args.host, args.port)
    if busy:
        raise UsageError(f"port {args.port} on {args.host} is taken ({busy}): give another with --port")
    if args.processes is not None and args.processes > 1 and str(device) != "cpu":
        raise UsageError(f"--processes {args.processes} is for a CPU (a process forked after CUDA starts cannot use "
                         "it): run one replica a GPU, docs/serving.md")
    processes = server_processes(args.processes, device)
    captioner = load_model("serve", args.weights, device).captioner.use_precision(args.precision)
    max_batch = args.max_batch or (64 if str(device).startswith("cuda") else 16)
    limits = Limits(workers=args.workers, max_batch=max_batch, max_wait_ms=args.max_wait_ms,
                    max_queue=args.max_queue, max_pixels=args.max_pixels, max_body_bytes=args.max_body_bytes,
                    timeout_s=args.timeout_s)
    if processes > 1:
        return serve_forked(captioner, limits, args.host, args.port, processes, quiet=args.quiet)
    return serve(captioner, limits, args.host, args.port, quiet=args.quiet)


def server_processes(asked: int | None, device, cores: int | None = None) -> int:
    """The server processes to run: as ``asked``, or by default one a core (at most
    MAX_AUTO_PROCESSES) on a Linux CPU, one on a GPU or elsewhere (macOS does not spread a port's
    connections between processes, and forking after torch has started is not safe there)."""
    if asked is not None:
        return asked
    if str(device) != "cpu" or not sys.platform.startswith("linux"):
        return 1
    return max(1, min(MAX_AUTO_PROCESSES, usable_cores() if cores is None else cores))


def listening_socket(host: str, port: int):
    """A TCP socket listening on ``host``:``port`` that other processes may listen on too
    (SO_REUSEPORT). Its protocol is named: asyncio turns Nagle's algorithm off (TCP_NODELAY) only
    on sockets whose protocol says TCP, and with it on, an answer written in two parts (headers,
    then body) waits for the client's delayed acknowledgement, some 40 ms a request."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def serve_forked(captioner, limits: Limits, host: str, port: int, processes: int, *, quiet: bool = False) -> int:
    """``processes`` servers of ``captioner`` on one port, forked from this process (the model
    loaded once, its weights shared until written), their batches sharing the cores (CoreShare: a
    batch takes the cores the batches running leave it), each in a process group of its own,
    listening on a socket of its own (SO_REUSEPORT: the kernel spreads the connections evenly;
    with one shared socket, a few keep-alive connections could all land on one server). SIGTERM
    or Ctrl-C here is passed to each as SIGTERM (they finish their requests in flight); returns 0
    when all end so (130 for Ctrl-C), 1 when one fails."""
    listening_socket(host, port).close()  # the port is free: each server listens on a socket of its own
    share = CoreShare(usable_cores(), processes=processes)
    children: list[int] = []
    stopped: list[int] = []

    def stop(signum, frame) -> None:
        stopped.append(signum)
        for child in children:
            try:
                os.kill(child, signal.SIGTERM)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, stop)  # before the forks: a stop that comes meanwhile reaches them
    signal.signal(signal.SIGINT, stop)
    for _ in range(processes):
        pid = os.fork()
        if pid == 0:  # a server: its own group, so that a terminal's Ctrl-C reaches only the parent
            code = 1
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.setpgid(0, 0)
                code = serve(captioner, limits, host, port, quiet=quiet, share=share,
                             sock=listening_socket(host, port))
            except Exception as e:  # said in one line; the parent then stops the others and exits 1
                print(f"captioner serve: server process {os.getpid()} failed: {type(e).__name__}: {e}",
                      file=sys.stderr, flush=True)
            finally:
                os._exit(code)
        children.append(pid)
        if stopped:  # stopped while forking: this one too
            stop(stopped[0], None)
    print(f"captioner serve: http://{host}:{port} ({captioner.name}, {processes} processes sharing {share.cores} "
          f"core{'s' if share.cores > 1 else ''}; batches of up to {limits.max_batch}, queue {limits.max_queue} "
          f"each; API at http://{host}:{port}/docs)", file=sys.stderr)
    codes = []
    for child in children:  # a signal handled meanwhile does not end the wait (PEP 475)
        codes.append(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
        if codes[-1] != 0 and not stopped:  # one server failed: the others stop too
            stop(signal.SIGTERM, None)
    if any(c != 0 for c in codes):
        return 1
    return 130 if signal.SIGINT in stopped else EXIT_OK


def serve(captioner, limits: Limits, host: str, port: int, *, quiet: bool = False, share=None,
          sock=None) -> int:
    """Serve ``captioner`` until SIGTERM or Ctrl-C: then no new connection is taken, the requests
    in flight are answered, and this returns 0 (130 for Ctrl-C, as the other commands).
    ``share``: the CoreShare its batches take their threads from (default: this machine's cores, for
    this process's batches alone); ``sock``: a listening socket to serve on (serve_forked's) rather
    than ``host``:``port``."""
    import torch
    import uvicorn
    from PIL import Image

    from captioner.serve.http import create_app
    from captioner.serve.service import Service

    service = Service(captioner, limits, share=share or CoreShare(usable_cores()))
    torch.set_num_threads(service.share.cores)

    def warm() -> None:  # the first batch's one-off costs on each thread the batches run on, before any request
        torch.set_num_threads(service.share.cores)  # the most threads a batch takes: their pool made now
        captioner.caption_images([Image.new("RGB", (64, 64))] * 2)

    service.gate.on_each_thread(warm)
    config = uvicorn.Config(create_app(service), host=host, port=port, log_level="warning" if quiet else "info",
                            access_log=not quiet, timeout_graceful_shutdown=None, server_header=False)
    server = uvicorn.Server(config)
    # uvicorn handles SIGTERM (it stops listening, finishes the requests in flight) and raises it again
    # once done, which would end the process with the signal's status: the handler it then restores is
    # this one, so that the process exits 0 as a service manager expects of a clean stop.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    if sock is None:
        print(f"captioner serve: http://{host}:{port} ({captioner.name}, {captioner.device}; batches of up to "
              f"{limits.max_batch}, queue {limits.max_queue}; API at http://{host}:{port}/docs)", file=sys.stderr)
    server.run(sockets=None if sock is None else [sock])
    if server.force_exit:
        return 130
    return EXIT_OK


def _importable(name: str) -> bool:
    from importlib.util import find_spec

    return find_spec(name) is not None
