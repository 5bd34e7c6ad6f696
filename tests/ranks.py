"""Two ranks of `captioner` forked from a process that has torch and the captioner imported,
set up as torchrun sets up its workers (the variables it exports, one thread each).

A torchrun launch starts three Python processes that each import torch: several seconds of
start-up for a few seconds of work on the tests' tiny models. Tests of what the ranks do
(train like one process, caption every image once, resume) start them here instead; the
tests of torchrun's own part (its exit codes, its stopping of the other ranks, what it prints)
keep starting it (builders.TORCHRUN).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# What each rank imports before its fork: the forkserver loads it once per test process.
PRELOAD = ["torch", "torchvision", "captioner.cli.main", "captioner.train", "captioner.train.loop"]


@dataclass(frozen=True)
class Ranks:
    """What the ranks gave: each one's exit code (None: killed at the time limit) and output."""

    codes: list[int | None]
    stdout: str
    stderr: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """One rank: torchrun's variables, its output into ``out`` and ``err``, ``main(argv)``'s
    exit code as the process's."""
    import torch

    fout, ferr = open(out, "w"), open(err, "w")  # noqa: SIM115 (open until the process ends)
    os.dup2(fout.fileno(), 1)
    os.dup2(ferr.fileno(), 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.update(env)
    os.chdir(cwd)
    torch.set_num_threads(1)  # torchrun's OMP_NUM_THREADS=1 for several workers a machine
    from captioner.cli.main import main

    code = 1
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)


def two_ranks(argv: list[str], tmp_path: Path, cwd: Path | None = None, timeout: float = 600) -> Ranks:
    """Run ``captioner ARGV`` on two ranks (gloo on this machine) as ``torchrun --standalone
    --nproc_per_node 2 -m captioner.cli ARGV`` would; their output files go in a folder of
    ``tmp_path``. Once a rank fails, the other gets 5 s to end, then is killed (its code None),
    as torchrun stops it."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    port = str(_free_port())
    logs = tmp_path / f"ranks-{port}"
    logs.mkdir(parents=True)
    procs, files = [], []
    for rank in range(2):
        env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
               "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "ROLE_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "TORCHELASTIC_RUN_ID": f"tests-{port}",
               "OMP_NUM_THREADS": "1"}
        out, err = logs / f"rank{rank}.out", logs / f"rank{rank}.err"
        p = ctx.Process(target=_rank, args=([str(a) for a in argv], env, str(cwd or Path.cwd()), str(out), str(err)))
        p.start()
        procs.append(p)
        files.append((out, err))
    # As torchrun: once a rank fails, the others are stopped (a few seconds' grace to end).
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        multiprocessing.connection.wait([p.sentinel for p in procs if p.is_alive()], 0.2)
        if any(p.exitcode not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + 5)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    codes = [p.exitcode if p.exitcode is not None and p.exitcode >= 0 else None for p in procs]
    read = [(o.read_text(), e.read_text()) for o, e in files]
    return Ranks(codes, "".join(o for o, _ in read), "".join(e for _, e in read))


def two_ranks_ok(argv: list[str], tmp_path: Path, **kw) -> Ranks:
    """``two_ranks``, failing the test with the ranks' stderr unless both exit 0."""
    res = two_ranks(argv, tmp_path, **kw)
    assert res.codes == [0, 0], res.stderr[-3000:]
    return res
