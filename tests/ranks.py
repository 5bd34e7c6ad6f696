"""Two ranks of `captioner` forked from a process that has torch and the captioner imported
(tests.forked), set up as torchrun sets up its workers (the variables it exports, one thread
each).

A torchrun launch starts three Python processes that each import torch: several seconds of
start-up for a few seconds of work on the tests' tiny models. Tests of what the ranks do
(train like one process, caption every image once, resume) start them here instead; the
tests of torchrun's own part (its exit codes, its stopping of the other ranks, what it prints)
keep starting it (builders.TORCHRUN).
"""

from __future__ import annotations

import multiprocessing.connection
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from tests.forked import Forked


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


def two_ranks(argv: list, tmp_path: Path, cwd: Path | None = None, timeout: float = 600) -> Ranks:
    """Run ``captioner ARGV`` on two ranks (gloo on this machine) as ``torchrun --standalone
    --nproc_per_node 2 -m captioner.cli ARGV`` would; their output files go in a folder of
    ``tmp_path``. Once a rank fails, the other gets 5 s to end, then is killed (its code None),
    as torchrun stops it."""
    port = str(_free_port())
    logs = tmp_path / f"ranks-{port}"
    procs = []
    for rank in range(2):
        env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
               "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "ROLE_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "TORCHELASTIC_RUN_ID": f"tests-{port}",
               "OMP_NUM_THREADS": "1"}
        # one thread each: torchrun's OMP_NUM_THREADS=1 for several workers a machine
        procs.append(Forked(argv, logs / f"rank{rank}", env=env, cwd=cwd, threads=1))
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        multiprocessing.connection.wait([p.sentinel for p in procs if p.poll() is None], 0.2)
        if any(p.poll() not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + 5)
    for p in procs:
        p.kill()
        p.wait()
    codes = [p.returncode if p.returncode >= 0 else None for p in procs]
    return Ranks(codes, "".join(p.stdout() for p in procs), "".join(p.stderr() for p in procs))


def two_ranks_ok(argv: list, tmp_path: Path, **kw) -> Ranks:
    """``two_ranks``, failing the test with the ranks' stderr unless both exit 0."""
    res = two_ranks(argv, tmp_path, **kw)
    assert res.codes == [0, 0], res.stderr[-3000:]
    return res
