"""The installed package takes no name but its own: training and the app install as
captioner.train and captioner.app (their folders stay train/ and app/), so a user's own
`train` or `app` module is never shadowed by this project, nor shadows it."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a process of its own, importing training and the app
def test_training_and_the_app_import_under_the_project_name_and_nowhere_else(tmp_path):
    # A user's own top-level `train` and `app` modules, in the folder they work in.
    (tmp_path / "train.py").write_text("MINE = True\n")
    (tmp_path / "app.py").write_text("MINE = True\n")
    code = ("import train, app, captioner.train.loop, captioner.app.serving, captioner.train.cli, captioner.app.cli\n"
            "print(train.MINE, app.MINE, captioner.train.loop.__file__, captioner.app.serving.__file__)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[:2] == ["True", "True"]  # the user's modules, not ours
    assert Path(out[2]) == ROOT / "train" / "loop.py"
    assert Path(out[3]) == ROOT / "app" / "serving.py"


def test_entry_points_name_the_installed_modules():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    targets = list(project["project"]["entry-points"]["captioner.commands"].values())
    targets += list(project["project"]["scripts"].values())
    assert targets and all(t.startswith("captioner.") for t in targets), targets
    assert sorted(project["tool"]["setuptools"]["package-dir"]) == ["captioner.app", "captioner.train"]
