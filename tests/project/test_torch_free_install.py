"""The torch-free path as docs/export.md gives it ("Deploy without torch"), run verbatim in a
fresh venv inside a copy of the clone: the runtime's packages from the package index, captioner
itself without its dependencies, no torch importable, no resolver errors, and a caption."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from captioner.cli.main import main as cli_main

ROOT = Path(__file__).resolve().parents[2]


def deploy_block() -> str:
    """The shell block under docs/export.md's "Deploy without torch"."""
    text = (ROOT / "docs" / "export.md").read_text(encoding="utf-8")
    section = text.split("## Deploy without torch", 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def test_the_block_installs_from_the_clone_and_never_torch():
    block = deploy_block()
    assert "pip install --no-deps captioner" not in block  # not on the package index: a clone's folder
    lines = [ln.split("#")[0].strip() for ln in block.splitlines()]
    installs = [ln for ln in lines if ln.startswith("pip install")]
    # the runtime's packages first, captioner last and without its dependencies (torch among
    # them): pip then has nothing to warn about
    assert installs[-1] == "pip install --no-deps ." and "torch" not in " ".join(installs)


@pytest.mark.slow
def test_the_deploy_commands_run_verbatim_in_a_fresh_venv(tmp_path, onnx_registry_once):
    clone = tmp_path / "captioner"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        src = ROOT / name
        if src.is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, clone / name)
    # what the block expects to find: an exported model and a photo
    # (exported in this process: the export is not what is tested here)
    assert cli_main(["export", "demo-soft", "--out", str(clone / "exported" / "demo-soft"), "--onnx",
                     "--license", "mit"]) == 0
    Image.open(ROOT / "app" / "examples" / "three-shapes.png").convert("RGB").save(clone / "photo.jpg")
    script = "set -e\n" + deploy_block() + (
        "python -c 'import importlib.util as u, sys; sys.exit(u.find_spec(\"torch\") is not None)'\n"
        "captioner --help || echo \"captioner exit $?\"\n")
    # a fresh shell: the system's Python first on the path, none of this venv's variables
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    run = subprocess.run(["bash", "-c", script], cwd=clone, capture_output=True, text=True, timeout=900, env=env)
    assert "requires torch" not in run.stderr and "dependency resolver" not in run.stderr, run.stderr
    lines = [json.loads(ln) for ln in run.stdout.splitlines() if ln.startswith("{")]
    assert run.returncode == 0, run.stdout + run.stderr
    assert len(lines) == 1 and lines[0]["caption"] and lines[0]["image"] == "photo.jpg"
    # the `captioner` command of that install: one line saying to use the runtime, exit 2
    assert "captioner exit 2" in run.stdout and "python -m captioner.onnx" in run.stderr
