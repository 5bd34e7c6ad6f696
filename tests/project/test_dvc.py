"""Release weights through DVC: add, push to a local remote, pull back, load."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from captioner.inference import Captioner, DecodeOptions
from tests.tiny import tiny_captioner, tiny_image

# The dvc of this environment first (a venv's bin may not be on PATH), then any on PATH.
_here = Path(sys.executable).parent / "dvc"
DVC = str(_here) if _here.exists() else (shutil.which("dvc") or "dvc")
needs_dvc = pytest.mark.skipif(shutil.which(DVC) is None, reason="dvc is not installed (pip install -e '.[dvc]')")


def _run(*args, cwd):
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    res = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, f"{args}: {res.stdout}\n{res.stderr}"
    return res.stdout


@pytest.mark.slow  # git and seven dvc processes
@needs_dvc
def test_weights_round_trip_through_a_local_remote(tmp_path):
    repo, remote = tmp_path / "repo", tmp_path / "remote"
    repo.mkdir()
    _run("git", "init", "-q", cwd=repo)
    _run(DVC, "init", "-q", cwd=repo)
    _run(DVC, "remote", "add", "-d", "local", str(remote), cwd=repo)
    (repo / "weights").mkdir()
    cap = tiny_captioner(seed=4)
    cap.save(repo / "weights" / "release.pt")
    _run(DVC, "add", "weights", cwd=repo)
    tracked = (repo / "weights.dvc").read_text()
    assert "path: weights" in tracked and "md5:" in tracked
    _run(DVC, "push", cwd=repo)

    shutil.rmtree(repo / "weights")
    shutil.rmtree(repo / ".dvc" / "cache")
    _run(DVC, "pull", cwd=repo)
    again = Captioner.load(repo / "weights" / "release.pt")
    image = tiny_image(3)
    opts = DecodeOptions(beam_size=2, max_len=6)
    assert again.caption(image, opts).words == cap.caption(image, opts).words


def test_the_project_tracks_its_weights_folder():
    root = Path(__file__).parents[2]
    text = (root / "weights.dvc").read_text()
    assert "path: weights" in text
    assert "/weights" in (root / ".gitignore").read_text().split()
