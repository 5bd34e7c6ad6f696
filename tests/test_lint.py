"""The code meets its lint rules (pyproject.toml's [tool.ruff]: pyflakes and pycodestyle at
120 columns): unused imports, undefined names and stray statements fail the suite."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.fail("ruff is not installed: pip install -e '.[dev]'")
    res = subprocess.run([ruff, "check", "--output-format", "concise", "captioner", "train", "app", "benchmarks",
                          "tests"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-4000:]
