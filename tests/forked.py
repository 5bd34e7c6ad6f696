"""`captioner ARGV` in a process of its own, forked from a forkserver that has torch and the
captioner imported: what `python -m captioner.cli ARGV` does, without its seconds of imports.

Tests that need a process of its own for what they test (a signal, a kill, a rank of two)
but not a fresh interpreter start it here; the tests of `python -m` itself or of a variable read
at import keep starting real processes. torchrun's launcher is forked here too (``module``),
and it forks its workers in turn (benchmarks/forked_workers.py, tests.ranks.torchrun). The
forkserver is started once per test process, on first use; a forked process gets back Python's
own signal handlers.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from pathlib import Path

# What the forkserver imports before it forks: what `captioner train` and `caption` load.
PRELOAD = ["torch", "torchvision", "captioner.cli.main", "captioner.train", "captioner.train.loop",
           "captioner.inference"]


def _run(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str, threads: int | None,
         module: str | None = None) -> None:
    """The forked process: its output into ``out`` and ``err``, ``main(argv)``'s exit code as
    the process's, as `python -m captioner.cli` gives it; with ``module``, `python -m MODULE
    ARGV`'s."""
    import torch

    fout, ferr = open(out, "w"), open(err, "w")  # noqa: SIM115 (open until the process ends)
    os.dup2(fout.fileno(), 1)
    os.dup2(ferr.fileno(), 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.update(env)
    os.chdir(cwd)
    if threads is not None:
        torch.set_num_threads(threads)
    from captioner.cli.main import main

    code = 1
    try:
        if module is None:
            code = main(argv)
        else:
            from benchmarks.forked_workers import run_as_main

            code = run_as_main(["-m", module, *argv])  # torchrun's workers forked from it too
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)


class Forked:
    """A started `captioner ARGV`, with subprocess.Popen's ways: ``pid``, ``poll()``, ``wait()``,
    ``send_signal()``, ``returncode`` (minus the signal's number for a process a signal ended);
    its output is read from files in ``logs`` (``stdout()``, ``stderr()``)."""

    def __init__(self, argv: list, logs: Path, env: dict[str, str] | None = None, cwd: Path | None = None,
                 threads: int | None = None, module: str | None = None) -> None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        logs.mkdir(parents=True, exist_ok=True)
        self._out, self._err = logs / "stdout.txt", logs / "stderr.txt"
        self._proc = ctx.Process(target=_run, args=([str(a) for a in argv], dict(env or {}), str(cwd or Path.cwd()),
                                                    str(self._out), str(self._err), threads, module))
        self._proc.start()
        self.pid = self._proc.pid

    @property
    def sentinel(self) -> int:
        return self._proc.sentinel

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise TimeoutError(f"captioner (pid {self.pid}) still running after {timeout} s")
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def stdout(self) -> str:
        return self._out.read_text() if self._out.exists() else ""

    def stderr(self) -> str:
        return self._err.read_text() if self._err.exists() else ""
