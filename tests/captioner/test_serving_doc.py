"""docs/serving.md's examples work as written: its Python client and its curl lines, run against a
real uvicorn server in this process (the tiny model, on a free localhost port)."""

from __future__ import annotations

import io
import json
import re
import shlex
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.builders import free_port, hold_gate
from tests.tiny import tiny_captioner, tiny_image

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from captioner.serve.http import create_app  # noqa: E402
from captioner.serve.service import Limits, Service  # noqa: E402

DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
TEXT = DOC.read_text(encoding="utf-8")
DOC_URL = "http://127.0.0.1:8000"


@pytest.fixture(scope="module")
def tiny():
    captioner = tiny_captioner(3)
    captioner.name = "tiny"
    return captioner


@pytest.fixture()
def server(tiny):
    """A real uvicorn serving the tiny model on a thread; (its URL, its Service)."""
    service = Service(tiny, Limits(max_wait_ms=0.0, max_queue=1))
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", service
    srv.should_exit = True
    thread.join(30)


def photos(folder: Path) -> None:
    """photo.jpg and photos/*.jpg in ``folder``, as the doc's examples expect."""
    (folder / "photos").mkdir()
    for i, path in enumerate([folder / "photo.jpg", folder / "photos" / "a.jpg", folder / "photos" / "b.jpg"]):
        buf = io.BytesIO()
        tiny_image(i, (96, 72)).save(buf, "JPEG")
        path.write_bytes(buf.getvalue())


def python_client() -> str:
    blocks = re.findall(r"```python\n(.*?)```", TEXT, re.S)
    assert len(blocks) == 1, "docs/serving.md has one Python client"
    assert DOC_URL in blocks[0]
    return blocks[0]


def test_the_python_client_captions_an_image_and_a_folder(server, tmp_path, monkeypatch, capsys):
    url, _ = server
    photos(tmp_path)
    monkeypatch.chdir(tmp_path)
    exec(compile(python_client().replace(DOC_URL, url), str(DOC), "exec"), {"__name__": "__main__"})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "tiny"  # the model card's name
    assert lines[1] and "[" in lines[1]  # the caption, then its alternatives
    assert [line.split()[0] for line in lines[2:]] == ["a.jpg", "b.jpg"]


@pytest.mark.slow
def test_the_python_client_waits_and_asks_again_when_the_server_is_busy(server, tmp_path):
    """A 503 (the line is full) is waited out as its Retry-After says, then the image is captioned."""
    url, service = server
    code = python_client().replace(DOC_URL, url)
    namespace: dict = {"__name__": "doc"}
    exec(compile(code.split("\nwith httpx.Client")[0], str(DOC), "exec"), namespace)
    release = hold_gate(service.gate)
    waiting = threading.Thread(target=service.gate.run, args=(None, 0, lambda items: items))
    waiting.start()
    deadline = time.monotonic() + 10
    while service.gate.queued < 1:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    buf = io.BytesIO()
    tiny_image(5, (64, 48)).save(buf, "PNG")
    with httpx.Client(base_url=url, timeout=60) as client:
        assert client.post("/v1/captions", content=buf.getvalue()).status_code == 503
        began = time.perf_counter()
        threading.Timer(1.5, release.set).start()  # the model is free again while the client waits
        record = namespace["caption"](client, buf.getvalue(), beam_size=2)
        with pytest.raises(RuntimeError, match="422: beam_size: must be >= 1, got 0"):
            namespace["caption"](client, buf.getvalue(), beam_size=0)
    waiting.join(10)
    assert record["caption"] and time.perf_counter() - began >= 0.9  # it waited the Retry-After second


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_the_curl_lines_answer_json(server, tmp_path):
    url, _ = server
    photos(tmp_path)
    section = TEXT.split("## curl", 1)[1].split("\n## ", 1)[0]
    lines = [line for block in re.findall(r"```bash\n(.*?)```", section, re.S) for line in block.splitlines()
             if line.startswith("curl ")]
    assert len(lines) == 3
    answers = []
    for line in lines:
        argv = shlex.split(line.replace(DOC_URL, url))
        done = subprocess.run([*argv, "--silent", "--show-error", "--fail"], cwd=tmp_path, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, (line, done.stderr)
        answers.append(json.loads(done.stdout))
    assert answers[0]["caption"] and "image" not in answers[0]
    assert len(answers[1]["alternatives"]) <= 3 and answers[1]["caption"]
    assert answers[2]["name"] == "tiny"


def test_the_answer_shown_is_demo_soft_s_for_the_example_it_names(tmp_path):
    from fastapi.testclient import TestClient

    from captioner.cli.common import load_model

    shown = json.loads(re.search(r"```json\n(.*?)```", TEXT, re.S).group(1))
    example = re.search(r"for `(app/examples/[^`]+)`", TEXT).group(1)
    service = Service(load_model("serve", None, "cpu", notice=False).captioner, Limits(max_wait_ms=0.0))
    image = (DOC.parents[1] / example).read_bytes()
    assert TestClient(create_app(service)).post("/v1/captions", content=image).json() == shown


def test_the_tables_name_every_flag_and_request_option():
    import argparse

    from captioner.cli.main import build_parser
    from captioner.serve.service import OPTIONS

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = {s for a in sub.choices["serve"]._actions for s in a.option_strings if s.startswith("--")} - {"--help"}
    table = TEXT.split("The server's flags", 1)[1].split("\n\n", 2)[1]
    assert set(re.findall(r"^\| `(--[a-z-]+)", table, re.M)) == flags
    options = TEXT.split("## Options", 1)[1].split("The server's flags", 1)[0]
    assert set(re.findall(r"`([a-z_]+)`", options)) >= set(OPTIONS)
    errors = TEXT.split("## Errors", 1)[1].split("\n## ", 1)[0]
    assert {int(x) for x in re.findall(r"\| (\d{3})\b", errors)} >= {400, 413, 415, 422, 503, 504}
