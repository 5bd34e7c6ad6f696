"""The `captioner` command leaves quickly: Python's shutdown walks every object still alive,
several times over, and torch, torchvision and the library leave some 340,000 of them from
their imports alone (docs/benchmarks.md has the seconds)."""

from __future__ import annotations

import gc
import runpy
import tomllib
from pathlib import Path

import pytest

import captioner.cli.main as cli

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_automatic_gc():
    """Only the collections the code asks for, and nothing left frozen afterwards."""
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.enable()


def test_the_command_collects_its_garbage_then_freezes_the_rest(monkeypatch, no_automatic_gc):
    """Garbage in a cycle is collected before the freeze, so its finalizers still run; what is
    alive is frozen, so that shutdown's collections skip it."""
    finalized = []

    class Cycle:
        def __del__(self):
            finalized.append(True)

    def command() -> int:
        loop = Cycle()
        loop.me = loop
        return 3

    monkeypatch.setattr(cli, "main", command)
    with pytest.raises(SystemExit) as done:
        cli.run()
    assert done.value.code == 3
    assert finalized == [True]
    assert gc.get_freeze_count() > 0


def test_argparse_s_exits_freeze_too(monkeypatch, no_automatic_gc):
    """--help, --version and a usage error leave main() by SystemExit: the same quick exit."""
    monkeypatch.setattr(cli, "main", lambda: cli.build_parser().parse_args(["--version"]))
    with pytest.raises(SystemExit) as done:
        cli.run()
    assert done.value.code == 0 and gc.get_freeze_count() > 0


def test_a_command_that_raises_is_not_frozen(monkeypatch, no_automatic_gc):
    """A traceback's objects are the process's last word; nothing is frozen on the way out."""
    def command() -> int:
        raise RuntimeError("broken")

    monkeypatch.setattr(cli, "main", command)
    with pytest.raises(RuntimeError):
        cli.run()
    assert gc.get_freeze_count() == 0


def test_another_program_s_main_exits_the_same_way(no_automatic_gc):
    with pytest.raises(SystemExit) as done:
        cli.run(lambda: 4)
    assert done.value.code == 4 and gc.get_freeze_count() > 0


def test_the_installed_command_and_python_m_both_go_through_run(monkeypatch):
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["captioner"] == "captioner.cli.main:run"
    ran = []
    monkeypatch.setattr(cli, "run", lambda *command: ran.append(True))
    runpy.run_module("captioner.cli", run_name="__main__")  # what torchrun's `-m captioner.cli` runs
    assert ran == [True]
    monkeypatch.setattr(cli, "run", lambda command: ran.append(command.__module__))
    runpy.run_module("studies.attention", run_name="__main__")
    assert ran == [True, "studies.attention.cli"]
