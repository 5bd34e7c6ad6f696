"""torchrun's workers forked from its launcher rather than started as new interpreters.

A launcher forked from a process that has torch and the captioner imported (the GPU check's
``--fork``, the tests' ``tests.ranks.torchrun``) still started each worker as a new Python that
imported torch again: seconds of start-up and shutdown for a second of work at tiny sizes.
``fork_workers()``, called in such a launcher before torch.distributed.run's main, makes torch's
elastic agent fork each worker from the launcher instead. The worker is otherwise what torchrun
makes: a process of its own, in a session of its own (torchrun stops it with ``killpg``), with
the variables torchrun gives it, its output where torchrun sends it, and its exit code or the
signal that ended it as torchrun reads them. What a fork cannot give is a fresh interpreter:
torch is already imported, so its thread count is set from ``OMP_NUM_THREADS`` here.
"""

from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
import time
import traceback


def run_as_main(args: list[str]) -> int:
    """``python ARGS`` (``-m MODULE ...`` or ``SCRIPT ...``, ``-u`` ignored) in this process, as
    its ``__main__``: the exit code it would give. torchrun (``-m torch.distributed.run``) run
    this way forks its workers from this process too (fork_workers)."""
    args = [a for a in args if a != "-u"]
    try:
        if args[:2] == ["-m", "torch.distributed.run"]:
            fork_workers()
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            sys.modules.pop(args[1], None)  # preloaded for its imports: run afresh as __main__
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            runpy.run_path(args[0], run_name="__main__")
        return 0
    except SystemExit as e:
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1


class ForkedWorker:
    """What torch's SubprocessHandler keeps of its worker's Popen: ``pid``, ``poll()``,
    ``wait(timeout)`` and ``returncode`` (minus the signal's number for a worker a signal ended)."""

    def __init__(self, args: tuple, env: dict[str, str], stdout, stderr) -> None:
        self.args, self.returncode = args, None
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:  # the worker
            code = 1
            try:
                os.setsid()
                for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
                    signal.signal(sig, signal.SIG_DFL)  # not the launcher's handlers
                signal.signal(signal.SIGINT, signal.default_int_handler)
                for stream, fd in ((stdout, 1), (stderr, 2)):
                    if stream is not None:
                        os.dup2(stream.fileno(), fd)
                os.environ.clear()
                os.environ.update(env)
                if env.get("OMP_NUM_THREADS", "").isdigit():
                    import torch

                    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
                code = run_as_main(list(args[1:]))
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)

    def poll(self) -> int | None:
        if self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(list(self.args), timeout)
            time.sleep(0.02)
        return self.returncode


def fork_workers() -> None:
    """From now on, torch's elastic agent in this process forks its workers (ForkedWorker)."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    def popen(handler, args: tuple, env: dict[str, str]) -> ForkedWorker:
        return ForkedWorker(args, env, handler._stdout, handler._stderr)

    subprocess_handler.SubprocessHandler._popen = popen
