"""Two ranks of `captioner` forked from a process that has torch and the captioner imported
(tests.forked), set up as torchrun sets up its workers (the variables it exports, one thread
each).

A torchrun launch starts three Python processes that each import torch: several seconds of
start-up for a few seconds of work on the tests' tiny models. Tests of what the ranks do
(train like one process, caption every image once, resume) start them here instead; the
tests of torchrun's own part (its exit codes, its stopping of the other ranks, what it prints)
keep starting it (``torchrun``): its launcher forked, and its workers forked from the launcher
by torch's own agent (benchmarks/forked_workers.py), each in a session of its own.
"""

from __future__ import annotations

import multiprocessing.connection
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from captioner.cli.main import main
from captioner.io.checkpoint import load_checkpoint
from captioner.train.config import to_toml
from tests.builders import TORCHRUN_ARGS, free_port, tiny_train_config
from tests.forked import Forked


@dataclass(frozen=True)
class Ranks:
    """What the ranks gave: each one's exit code (None: killed at the time limit) and output."""

    codes: list[int | None]
    stdout: str
    stderr: str


def two_ranks(argv: list, tmp_path: Path, cwd: Path | None = None, timeout: float = 600) -> Ranks:
    """Run ``captioner ARGV`` on two ranks (gloo on this machine) as ``torchrun --standalone
    --nproc_per_node 2 -m captioner.cli ARGV`` would; their output files go in a folder of
    ``tmp_path``. Once a rank fails, the other gets 5 s to end, then is killed (its code None),
    as torchrun stops it."""
    port = str(free_port())
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


# What lets two ranks train exactly as one process over the same global batch: dropout off
# (each rank draws its own masks); a frozen encoder read through the feature cache
# (batch-norm statistics would otherwise be per rank); SGD, because Adam divides by the
# gradient's own size and so turns rounding noise in near-zero gradients (the score's bias,
# which softmax ignores) into full-size steps.
SAME_AS_ONE = {"optim.max_steps": 6, "optim.batch_size": 4, "model.dropout": 0.0, "optim.optimizer": "sgd",
               "optim.lr": 0.05, "model.freeze_encoder": True, "data.feature_cache": True,
               "val.every_epochs": 0, "optim.save_every": 0}


def one_and_two_ranks(tiny_coco, tmp_path, **sets):
    """Train the tiny config (SAME_AS_ONE and ``sets``) in one process, this one (run folder
    tmp_path/single), and on two ranks (tmp_path/multi, ``two_ranks``); check that they end with
    the same weights; return the config and the two last checkpoints."""
    cfg = tiny_train_config(tiny_coco, **{**SAME_AS_ONE, **sets})
    cfg_path = tmp_path / "cfg.toml"
    cfg_path.write_text(to_toml(cfg))
    single, multi = tmp_path / "single", tmp_path / "multi"
    assert main(["train", "--config", str(cfg_path), "--run-dir", str(single), "--quiet"]) == 0
    two_ranks_ok(["train", "--config", str(cfg_path), "--run-dir", str(multi), "--quiet"], tmp_path)
    a, b = load_checkpoint(single / "last.pt"), load_checkpoint(multi / "last.pt")
    assert b.train_state.step == 6 and len(b.train_state.rng_per_rank) == 2
    for k, v in a.state_dict.items():
        torch.testing.assert_close(b.state_dict[k], v, rtol=1e-4, atol=1e-5)
    return cfg, a, b


def torchrun(args: list, tmp_path: Path, timeout: float = 600) -> tuple[int, str]:
    """``torchrun --standalone --nproc_per_node 2 ARGS``: (its exit code, its and its workers'
    error output). The launcher is forked from the forkserver that has torch loaded (its import
    is seconds); its agent forks its workers in turn, each a process in a session of its own
    with torchrun's variables (benchmarks/forked_workers.py)."""
    launcher = Forked([*TORCHRUN_ARGS, *args], tmp_path / "torchrun", module="torch.distributed.run")
    try:
        code = launcher.wait(timeout)
    finally:
        launcher.send_signal(signal.SIGTERM)  # still running after ``timeout``: torchrun stops its workers
    return code, launcher.stderr()
