"""The code meets its lint rules (pyproject.toml's [tool.ruff]: pyflakes and pycodestyle at
120 columns): unused imports, undefined names and stray statements fail the suite."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing():
    if importlib.util.find_spec("ruff") is None:
        pytest.fail("ruff is not installed: pip install -e '.[dev]'")
    res = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "captioner", "train",
                          "app", "benchmarks", "studies", "tests", "tools"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
