"""`captioner serve` in this process (FastAPI's TestClient): the answer is `captioner caption`'s
record, options come with the command line's names and rules, concurrent requests are captioned
together through the shared batcher, and every bad input gets its status in one line of JSON."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import threading
import time

import pytest
from PIL import Image

from tests.builders import free_port, hold_gate
from tests.tiny import tiny_captioner, tiny_image

fastapi = pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from captioner.serve.http import create_app, read_body  # noqa: E402
from captioner.serve.service import Limits, Refused, Service  # noqa: E402


def png(seed: int = 0, size: tuple[int, int] = (40, 30)) -> bytes:
    buf = io.BytesIO()
    tiny_image(seed, size).save(buf, "PNG")
    return buf.getvalue()


def jpeg(seed: int = 0, size: tuple[int, int] = (64, 48)) -> bytes:
    buf = io.BytesIO()
    tiny_image(seed, size).save(buf, "JPEG", quality=90)
    return buf.getvalue()


@pytest.fixture(scope="module")
def tiny():
    return tiny_captioner(3)


def serve(captioner, **limits) -> tuple[Service, TestClient]:
    service = Service(captioner, Limits(**{"max_wait_ms": 0.0, **limits}))
    return service, TestClient(create_app(service), raise_server_exceptions=False)


def refusal(response, status: int) -> str:
    """The refusal's message, once its status and shape are checked: one line of JSON."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert "\n" not in response.text and "Traceback" not in response.text
    body = response.json()
    assert set(body) == {"error", "status"} and body["status"] == status
    return body["error"]


def test_the_answer_is_captioner_caption_s_record_without_the_path(tmp_path, capsys):
    """The demo model: the line `captioner caption` writes for the file, the raw body's answer and
    the multipart form's answer are one record, with options as query parameters or form fields."""
    from captioner.cli.common import load_model
    from captioner.cli.main import main

    path = tmp_path / "photo.jpg"
    path.write_bytes(jpeg(5, (96, 72)))
    assert main(["caption", str(path), "--quiet", "--beam-size", "4", "--num-captions", "2"]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line.pop("image") == str(path)
    _, client = serve(load_model("serve", None, "cpu", notice=False).captioner)
    raw = client.post("/v1/captions?beam_size=4&num_captions=2", content=path.read_bytes(),
                      headers={"content-type": "image/jpeg"})
    assert raw.status_code == 200 and raw.json() == line
    assert list(raw.json()) == list(line)  # the same keys in the same order
    form = client.post("/v1/captions", files={"file": ("x.jpg", path.read_bytes(), "image/jpeg")},
                       data={"beam_size": "4", "num_captions": "2"})
    assert form.status_code == 200 and form.json() == line
    assert line["model"] == "demo-soft" and "alternatives" in line


def test_attention_is_added_when_asked_for(tiny):
    _, client = serve(tiny)
    plain = client.post("/v1/captions", content=png(1)).json()
    shown = client.post("/v1/captions?with_attention=true", content=png(1)).json()
    assert "alphas" not in plain and len(shown["alphas"]) == len(shown["betas"]) == len(shown["words"])
    assert {k: v for k, v in shown.items() if k not in ("alphas", "betas")} == plain
    assert "image" not in plain


@pytest.mark.parametrize(("query", "message"), [
    ("beam_size=0", "beam_size: must be >= 1, got 0"),
    ("beam_size=two", "beam_size: not a whole number: 'two'"),
    ("max_len=500", "max_len: at most 100 words, got 500"),
    ("num_captions=4&beam_size=2", "num_captions 4: more than the beam size (2)"),
    ("length_penalty=nan", "length_penalty: must be a number >= 0"),
    ("hard_attention=maybe", "hard_attention: must be one of expected, argmax, sample, got maybe"),
    ("with_attention=perhaps", "with_attention: must be true or false, got perhaps"),
    ("beam=3", "unknown option 'beam': the options are beam_size, "),
    ("image=/etc/passwd", "unknown option 'image'"),
    ("beam_size=2&beam_size=3", "option beam_size given twice"),
])
def test_a_bad_option_is_refused_with_the_command_line_s_words(tiny, query, message):
    _, client = serve(tiny)
    assert message in refusal(client.post(f"/v1/captions?{query}", content=png()), 422)


def test_a_bad_option_in_a_form_is_refused_as_in_the_query(tiny):
    _, client = serve(tiny)
    r = client.post("/v1/captions", files={"file": ("x.png", png(), "image/png")}, data={"beam_size": "0"})
    assert "beam_size: must be >= 1, got 0" in refusal(r, 422)
    r = client.post("/v1/captions?beam_size=2", files={"file": ("x.png", png(), "image/png")},
                    data={"beam_size": "3"})
    assert "given twice" in refusal(r, 422)


def test_bad_input_gets_its_status_and_the_server_goes_on(tiny):
    _, client = serve(tiny, max_pixels=50 * 50, max_body_bytes=200_000)
    assert "empty body" in refusal(client.post("/v1/captions", content=b""), 400)
    assert "not an image" in refusal(client.post("/v1/captions", content=b"hello, not an image"), 415)
    assert "not an image" in refusal(client.post("/v1/captions", content=b"/etc/passwd"), 415)  # bytes, not a path
    truncated = png(2)[:60]
    assert "not an image" in refusal(client.post("/v1/captions", content=truncated), 415)
    big = refusal(client.post("/v1/captions", content=png(3, (60, 60))), 413)
    assert "3,600 pixels, over the limit of 2,500" in big and "--max-pixels" in big
    over = refusal(client.post("/v1/captions", content=b"\0" * 200_001), 413)
    assert "200,001 bytes" in over and "--max-body-bytes" in over
    assert "'file'" in refusal(client.post("/v1/captions", files={"photo": ("x.png", png(), "image/png")}), 422)
    form = client.post("/v1/captions", content=b"--x\r\nContent-Disposition: form-data; name=\"beam_size\"\r\n\r\n2"
                                               b"\r\n--x--\r\n",
                       headers={"content-type": "multipart/form-data; boundary=x"})
    assert "without a 'file' field" in refusal(form, 400)
    assert "empty body" in refusal(client.post("/v1/captions", files={"file": ("x.png", b"", "image/png")}), 400)
    assert refusal(client.get("/v1/captions"), 405)
    assert refusal(client.get("/no/such/page"), 404)
    assert client.post("/v1/captions", content=png(4)).status_code == 200  # still serving
    assert client.get("/healthz").json() == {"status": "ok"}


def test_a_body_over_the_limit_is_refused_before_it_is_read():
    """Its Content-Length says it all: not one chunk of the body is asked for."""
    import asyncio

    from starlette.requests import Request

    asked = []

    async def receive():
        asked.append(1)
        return {"type": "http.request", "body": b"x" * 1000, "more_body": True}

    scope = {"type": "http", "method": "POST", "path": "/v1/captions", "headers": [(b"content-length", b"10000000")],
             "query_string": b""}
    with pytest.raises(Refused) as e:
        asyncio.run(read_body(Request(scope, receive), 1_000_000))
    assert e.value.status == 413 and asked == []
    # Without a Content-Length (chunked): refused as soon as it passes the limit, not at its end.
    scope["headers"] = []
    with pytest.raises(Refused) as e:
        asyncio.run(read_body(Request(scope, receive), 5_500))
    assert e.value.status == 413 and len(asked) == 6


def test_a_form_is_kept_in_memory_never_on_disk(tiny, monkeypatch):
    """A file part over Starlette's 1 MB spool size would go to a temporary file: not here."""
    import tempfile

    def no_files(*args, **kwargs):
        raise AssertionError("a temporary file was made")

    monkeypatch.setattr(tempfile, "TemporaryFile", no_files)
    monkeypatch.setattr(tempfile, "NamedTemporaryFile", no_files)
    monkeypatch.setattr(tempfile, "mkstemp", no_files)
    noise = io.BytesIO()
    Image.frombytes("RGB", (700, 700), bytes(range(256)) * (700 * 700 * 3 // 256) + b"\0" * (700 * 700 * 3 % 256)) \
        .save(noise, "BMP")
    assert noise.tell() > 1_200_000
    _, client = serve(tiny)
    r = client.post("/v1/captions", files={"file": ("x.bmp", noise.getvalue(), "image/bmp")})
    assert r.status_code == 200, r.text


def test_concurrent_requests_are_captioned_together_each_its_own(tiny, monkeypatch):
    service, client = serve(tiny, max_batch=4)
    alone = {i: client.post("/v1/captions", content=png(10 + i)).json() for i in range(4)}
    sizes = []
    original = tiny.caption_images
    monkeypatch.setattr(tiny, "caption_images", lambda images, opt: sizes.append(len(images)) or original(images, opt))
    release = hold_gate(service.gate)  # the model is busy: the four wait together
    out = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, client.post("/v1/captions",
                                                                                   content=png(10 + i))))
               for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while service.gate.queued < 4 and time.monotonic() < deadline:
        time.sleep(0.005)
    release.set()
    for t in threads:
        t.join(30)
    assert sizes == [4]
    assert {i: r.json() for i, r in out.items()} == alone


def test_one_image_that_fails_fails_its_request_alone_not_its_batch(tiny, monkeypatch):
    service, client = serve(tiny, max_batch=4)
    alone = {i: client.post("/v1/captions", content=png(20 + i)).json() for i in range(3)}
    original = tiny.caption_images

    def fussy(images, opt):
        if any(im.size == (41, 31) for im in images):
            raise RuntimeError("this image breaks the model")
        return original(images, opt)

    monkeypatch.setattr(tiny, "caption_images", fussy)
    release = hold_gate(service.gate)
    bodies = [png(20), png(21), png(99, (41, 31)), png(22)]
    out = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, client.post("/v1/captions", content=bodies[i])))
               for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while service.gate.queued < 4 and time.monotonic() < deadline:
        time.sleep(0.005)
    release.set()
    for t in threads:
        t.join(30)
    assert "could not be captioned: this image breaks the model" in refusal(out[2], 422)
    assert [out[i].json() for i in (0, 1, 3)] == [alone[0], alone[1], alone[2]]


def test_a_full_queue_is_503_with_retry_after_and_not_ready(tiny):
    service, client = serve(tiny, max_queue=1)
    assert client.get("/readyz").status_code == 200
    release = hold_gate(service.gate)
    waiting = threading.Thread(target=service.gate.run, args=(None, 0, lambda items: items))
    waiting.start()
    deadline = time.monotonic() + 10
    while service.gate.queued < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    r = client.post("/v1/captions", content=png())
    assert "--max-queue 1" in refusal(r, 503) and int(r.headers["retry-after"]) >= 1
    ready = client.get("/readyz")
    assert ready.status_code == 503 and ready.json()["status"] == "busy" and "retry-after" in ready.headers
    assert client.get("/healthz").status_code == 200  # alive all the same
    release.set()
    waiting.join(10)
    assert client.get("/readyz").status_code == 200 and client.post("/v1/captions", content=png()).status_code == 200


def test_a_request_that_waits_past_the_timeout_is_504(tiny):
    service, client = serve(tiny, timeout_s=0.3)
    release = hold_gate(service.gate)
    began = time.perf_counter()
    r = client.post("/v1/captions", content=png())
    assert "--timeout-s 0.3" in refusal(r, 504) and 0.25 < time.perf_counter() - began < 5
    release.set()
    assert client.post("/v1/captions", content=png()).status_code == 200
    assert service.gate.queued == 0 and service.in_flight == 0


def test_the_model_card(tiny):
    from captioner.cli.common import load_model

    _, client = serve(load_model("serve", "demo-zh", "cpu", notice=False).captioner)
    card = client.get("/v1/model").json()
    assert card["name"] == "demo-zh" and card["language"] == "zh" and card["demo"] is True
    assert card["vocabulary_size"] > 10 and "synthetic shapes" in card["training_data"]
    assert "demo model" in card["notice"]
    _, client = serve(tiny)
    card = client.get("/v1/model").json()
    assert card["notice"] is None and card["demo"] is False and card["vocabulary_size"] == len(tiny.vocab)


def test_the_docs_load_nothing_from_another_host(tiny):
    _, client = serve(tiny)
    api = client.get("/openapi.json").json()
    post = api["paths"]["/v1/captions"]["post"]
    assert {p["name"] for p in post["parameters"]} >= {"beam_size", "num_captions", "max_len", "with_attention"}
    assert "multipart/form-data" in post["requestBody"]["content"]
    assert {"/v1/model", "/healthz", "/readyz"} <= set(api["paths"])
    page = client.get("/docs")
    assert page.status_code == 200 and "openapi.json" in page.text
    links = re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)""", page.text)
    assert links and not [u for u in links if re.match(r"(?i)([a-z]+:)?//", u)], links
    for url in links:
        assert client.get(url).status_code == 200, url
    assert not re.search(r"(?i)https?://(?!localhost|127\.0\.0\.1)", page.text)


def test_the_command_s_flags_and_its_defaults(capsys):
    from captioner.cli.main import build_parser, main

    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1" and args.port == 8000 and args.weights is None
    with pytest.raises(SystemExit) as e:
        main(["serve", "--max-batch", "0"])
    assert e.value.code == 2
    assert "--max-batch" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    helped = capsys.readouterr().out
    for flag in ("--weights", "--host", "--port", "--workers", "--processes", "--max-batch", "--max-wait-ms",
                 "--max-queue", "--max-pixels", "--timeout-s", "--max-body-bytes"):
        assert flag in helped
    assert args.processes is None  # one a core on a CPU (server_processes)
    with pytest.raises(SystemExit) as e:
        main(["serve", "--processes", "0"])
    assert e.value.code == 2 and "--processes" in capsys.readouterr().err


def test_by_default_a_cpu_gets_a_server_process_a_core_and_a_gpu_one(monkeypatch):
    from captioner.serve.cli import MAX_AUTO_PROCESSES, server_processes

    monkeypatch.setattr(sys, "platform", "linux")
    assert server_processes(None, "cpu", cores=2) == 2
    assert server_processes(None, "cpu", cores=1) == 1
    assert server_processes(None, "cpu", cores=64) == MAX_AUTO_PROCESSES == 8
    assert server_processes(None, "cuda:0", cores=16) == 1
    assert server_processes(3, "cpu", cores=2) == 3  # as asked
    monkeypatch.setattr(sys, "platform", "darwin")
    assert server_processes(None, "cpu", cores=8) == 1


def test_several_processes_are_refused_on_a_gpu_in_one_line(monkeypatch, capsys):
    """A process forked after CUDA started cannot use it: --processes is for CPUs."""
    import captioner.serve.cli as serve_cli
    from captioner.cli.main import main

    monkeypatch.setattr(serve_cli, "check_device", lambda device: "cuda:0")
    monkeypatch.setattr(serve_cli, "load_model", lambda *a: pytest.fail("the model was loaded"))
    assert main(["serve", "--processes", "2", "--device", "cuda", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err.strip()
    assert "--processes 2 is for a CPU" in err and "\n" not in err


@pytest.mark.slow
def test_the_command_line_imports_no_web_framework_until_it_serves():
    code = ("import sys; from captioner.cli.main import build_parser; build_parser().parse_args(['serve']); "
            "print(sorted(m for m in ('fastapi', 'uvicorn', 'starlette') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_without_swagger_s_files_the_docs_are_a_plain_page_of_this_server(tiny, monkeypatch):
    from captioner.serve import http

    monkeypatch.setattr(http, "_swagger_folder", lambda: None)
    _, client = serve(tiny)
    page = client.get("/docs")
    assert page.status_code == 200 and 'fetch("/openapi.json")' in page.text
    assert not re.search(r"(?i)(src|href)\s*=\s*[\"'](https?:)?//", page.text)


def test_a_character_budget_is_an_option_like_the_others_and_none_fitting_is_422(tiny):
    from captioner.data.vocab import Vocabulary
    from captioner.search.options import DecodeOptions

    _, client = serve(tiny)
    answer = client.post("/v1/captions?max_chars=9&num_captions=2", content=png(1)).json()
    want = tiny.caption(Image.open(io.BytesIO(png(1))), DecodeOptions(max_len=tiny.max_len, max_chars=9,
                                                                      num_captions=2))
    assert answer["caption"] == want.caption and all(len(a["caption"]) <= 9 for a in answer["alternatives"])
    assert "max_chars: must be >= 1, got 0" in refusal(client.post("/v1/captions?max_chars=0", content=png()), 422)
    short = tiny_captioner(3)
    short.vocab = Vocabulary([("aa" if w == "a" else w) for w in short.vocab.words])  # no one-letter word
    _, client = serve(short)
    message = refusal(client.post("/v1/captions?max_chars=1", content=png(1)), 422)
    assert message.startswith("no caption fits in 1 character "
                              "(the shortest found without a budget is ")


def test_every_decoding_option_of_the_library_is_a_request_option():
    """A field added to DecodeOptions (and so to `captioner caption`) must be given a request option."""
    from dataclasses import fields

    from captioner.search.options import DecodeOptions
    from captioner.serve.service import OPTION_HELP, OPTIONS

    assert {f.name for f in fields(DecodeOptions)} <= set(OPTIONS)
    assert {"with_attention", "attention_heads"} <= set(OPTIONS) and set(OPTION_HELP) == set(OPTIONS)


def test_workers_n_captions_n_batches_at_once(tiny):
    """--workers 2: with one batch holding the model, a request is captioned beside it, not after."""
    service, client = serve(tiny, workers=2, timeout_s=5)
    release = hold_gate(service.gate)
    try:
        began = time.perf_counter()
        assert client.post("/v1/captions", content=png(6)).status_code == 200
        assert time.perf_counter() - began < 4
    finally:
        release.set()
    assert client.get("/v1/model").json()["limits"]["workers"] == 2


def test_a_file_name_in_a_form_is_never_opened(tiny):
    """The form's file name is a client's word, never a path the server reads."""
    _, client = serve(tiny)
    r = client.post("/v1/captions", files={"file": ("/etc/passwd", b"root:x:0:0", "text/plain")})
    assert "not an image" in refusal(r, 415)
    r = client.post("/v1/captions", files={"file": ("../../../etc/hostname", png(8), "image/png")})
    assert r.status_code == 200 and "image" not in r.json()


def test_a_forked_server_that_fails_says_so_in_one_line_and_the_parent_exits_1(tiny, monkeypatch, capfd):
    """`--processes N`: a server process that cannot start (here: its serving raises) says why in one
    line of its own; the parent stops the others and exits 1, not 0."""
    import signal

    import captioner.serve.cli as serve_cli

    def broken(*args, **kwargs):
        raise RuntimeError("cannot listen")

    monkeypatch.setattr(serve_cli, "serve", broken)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = serve_cli.serve_forked(tiny, Limits(), "127.0.0.1", free_port(), 2, quiet=True)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert code == 1
    failed = [line for line in capfd.readouterr().err.splitlines() if "failed" in line]
    # each server that failed says so (the other may be stopped first, by the parent)
    assert failed and all("RuntimeError: cannot listen" in line for line in failed), failed


def test_a_batch_takes_the_cores_that_other_batches_leave(tiny, monkeypatch):
    """The server's batches share the cores (CoreShare): one alone runs on every core's threads,
    one that starts while another batch runs (another process's, here held open) on its share."""
    import torch

    from captioner.batching import CoreShare

    seen = []
    real = tiny.caption_images

    def recorded(images, options=None):
        seen.append(torch.get_num_threads())
        return real(images, options)

    monkeypatch.setattr(tiny, "caption_images", recorded)
    share = CoreShare(2)
    service = Service(tiny, Limits(max_wait_ms=0.0), share=share)
    before = torch.get_num_threads()
    try:
        service.admit()
        service.caption(png(1), [])
        service.leave()
        with share.batch():  # another server's batch
            service.admit()
            service.caption(png(2), [])
            service.leave()
    finally:
        service.pool.shutdown()
        torch.set_num_threads(before)
    assert seen == [2, 1]


def test_the_forked_servers_sockets_answer_without_waiting_for_a_delayed_ack():
    """`--processes`' listening sockets are made by the server, not by asyncio: each connection
    they accept must get TCP_NODELAY from asyncio, or every answer written in two parts waits
    some 40 ms for the client's acknowledgement (a request took twice as long so)."""
    import asyncio
    import socket

    from captioner.serve.cli import listening_socket

    async def accepted_nodelay() -> int:
        sock = listening_socket("127.0.0.1", free_port())
        seen = asyncio.get_running_loop().create_future()

        def connected(reader, writer):
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(connected, sock=sock)
        try:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            value = await asyncio.wait_for(seen, 10)
            writer.close()
            return value
        finally:
            server.close()

    assert asyncio.run(accepted_nodelay()) != 0
