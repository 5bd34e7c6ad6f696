"""The README's commands are ones the tools accept, its test command is the one CI runs, and
its links lead to files that exist."""

import re
import shlex
from pathlib import Path

import pytest

from captioner.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _commands(text: str) -> list[str]:
    """Every `captioner ...` and `torchrun ... -m captioner.cli ...` line of the bash blocks,
    continuation lines joined, comments dropped."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            for part in line.split("&&"):
                part = part.strip()
                if part.startswith("captioner ") or "-m captioner.cli " in part:
                    found.append(part)
    return found


COMMANDS = _commands(README) + [c for page in ("results.md", "serving.md")
                                 for c in _commands((ROOT / "docs" / page).read_text(encoding="utf-8"))]


def test_the_test_command_is_the_one_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    line = next(x for x in ci.splitlines() if "pytest" in x and "venv" in x).strip()
    assert line in README.splitlines()


def test_the_first_command_captions_the_examples_with_the_demo_model():
    assert ("python3 -m venv .venv && . .venv/bin/activate && pip install -e . && captioner caption app/examples/"
            in README.splitlines())
    assert list((ROOT / "app" / "examples").glob("*.png"))


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_in_the_docs_parses(command):
    argv = shlex.split(command.replace("<time>", "20260101-000000"))
    argv = argv[argv.index("captioner.cli") + 1:] if "captioner.cli" in argv else argv[1:]
    args = build_parser().parse_args(argv)  # argparse exits on an unknown option or a bad value
    assert args.command == argv[0]


def _outside_code(text: str) -> str:
    """``text`` without its fenced code blocks and code spans, where ``![](src)`` is an example, not a link."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"(`+)(?!`).+?(?<!`)\1(?!`)", "", text)


def test_links_lead_to_files_that_exist():
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#]+)\)", _outside_code(page.read_text(encoding="utf-8"))):
            if not target.startswith("http"):
                assert (page.parent / target).exists(), (page.name, target)


def test_the_readme_reads_in_minutes():
    assert len(README.split()) < 2600  # 2,500 before the section on own images and languages
    assert "### Train on COCO" in README  # the place the COCO and Flickr8k instructions go


def test_the_cpu_build_of_torch_is_offered_before_the_set_up_commands():
    """Someone on a laptop without a GPU reads the small install before running the 6 GB one."""
    cpu_choice = README.index("download.pytorch.org/whl/cpu")
    first_command = README.index("python3 -m venv .venv && . .venv/bin/activate && pip install -e .")
    test_command = README.index('pip install -q -e ".[dev,dvc]"')
    assert cpu_choice < first_command < test_command


def test_what_the_readme_s_commands_write_inside_the_repository_git_ignores():
    """The README's commands write their outputs (an exported folder, runs, data) into the clone;
    none of it should show up as something to commit."""
    import subprocess

    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    outputs = {m.group(1).split("/")[0] for m in re.finditer(r"--(?:out|run-dir)[= ](\S+)", README)
               if not m.group(1).startswith(("/", "~", "-")) and "/" in m.group(1)}
    assert "exported" in outputs  # the export section's folder
    for top in sorted(outputs):
        done = subprocess.run(["git", "check-ignore", "-q", f"{top}/x"], cwd=ROOT)
        assert done.returncode == 0, f"{top}/ is not ignored by git"
