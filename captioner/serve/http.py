"""The FastAPI application of `captioner serve`: the network side of ``service.Service``.

Imported only to serve (FastAPI is not imported by ``captioner`` otherwise). Every answer that
is not a caption is one line of JSON, ``{"error": ..., "status": ...}``, never a traceback. A
request's body is read here, bounded: a Content-Length over the limit is refused before a byte of
the body is read, a body without one as soon as it passes the limit. A multipart form is parsed in
memory (nothing is written to disk), its file field ``file``, its other fields options.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.formparsers import MultiPartException, MultiPartParser

from captioner.serve.service import OPTION_HELP, OPTIONS, Refused, Service

log = logging.getLogger("captioner.serve")

FILE_FIELD = "file"


class _InMemoryParser(MultiPartParser):
    """Starlette's multipart parser with its files kept in memory: the body is already in memory,
    bounded by the server's limit, and the server writes nothing to disk."""

    spool_max_size = 1 << 62


def error(status: int, message: str, retry_after: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse({"error": message, "status": status}, status_code=status, headers=headers)


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, at most ``limit`` bytes: ``Refused`` 413 before reading a body whose
    Content-Length is over it, or as soon as one without it passes it."""
    length = request.headers.get("content-length")
    if length is not None:
        try:
            declared = int(length)
        except ValueError:
            raise Refused(400, f"Content-Length is not a number: {length!r}") from None
        if declared > limit:
            raise Refused(413, f"the body is {declared:,} bytes, over this server's limit of {limit:,} "
                               "(--max-body-bytes)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise Refused(413, f"the body is over this server's limit of {limit:,} bytes (--max-body-bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


async def image_and_fields(request: Request, body: bytes) -> tuple[bytes, list[tuple[str, str]]]:
    """The image's bytes and the form's option fields: a multipart form's ``file`` and its other
    fields, or the raw body and none."""
    if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
        return body, []

    async def stream():
        yield body

    try:
        form = await _InMemoryParser(request.headers, stream(), max_files=1, max_fields=len(OPTIONS),
                                     max_part_size=64 * 1024).parse()
    except MultiPartException as e:
        raise Refused(400, f"a multipart form that cannot be read: {e.message}") from None
    data, fields = None, []
    for name, value in form.multi_items():
        if isinstance(value, UploadFile):
            if name != FILE_FIELD:
                raise Refused(422, f"unknown file field {name!r}: send the image as the field {FILE_FIELD!r}")
            data = await value.read()
        elif name == FILE_FIELD:
            raise Refused(422, f"the field {FILE_FIELD!r} must be a file (curl -F {FILE_FIELD}=@photo.jpg)")
        else:
            fields.append((name, value))
    if data is None:
        raise Refused(400, f"a multipart form without a {FILE_FIELD!r} field: send the image as "
                           f"-F {FILE_FIELD}=@photo.jpg")
    return data, fields


def _captions_openapi() -> dict:
    options = {name: {"type": "boolean" if name in ("allow_unk", "with_attention", "attention_heads")
                      else "string" if name == "hard_attention"
                      else "number" if name in ("length_penalty", "unfamiliar_below") else "integer",
                      "description": OPTION_HELP[name]} for name in OPTIONS}
    binary = {"schema": {"type": "string", "format": "binary"}}
    err = {"content": {"application/json": {"schema": {"type": "object", "properties": {
        "error": {"type": "string"}, "status": {"type": "integer"}}}}}}
    return {
        "parameters": [{"name": n, "in": "query", "required": False, "schema": s} for n, s in options.items()],
        "requestBody": {"required": True, "content": {
            "image/jpeg": binary, "image/png": binary, "application/octet-stream": binary,
            "multipart/form-data": {"schema": {"type": "object", "required": [FILE_FIELD], "properties": {
                FILE_FIELD: {"type": "string", "format": "binary"}, **options}}}}},
        "responses": {
            "200": {"description": "the caption's JSON record, as `captioner caption` writes it, without \"image\""},
            "400": {"description": "empty body, or a form without its file", **err},
            "413": {"description": "over --max-pixels, or a body over --max-body-bytes", **err},
            "415": {"description": "not an image", **err},
            "422": {"description": "an unknown option or a bad value", **err},
            "503": {"description": "the queue is full (with Retry-After)", **err},
            "504": {"description": "not captioned within --timeout-s", **err}},
    }


def create_app(service: Service) -> FastAPI:
    """The application serving ``service``; its threads are shut down with it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        service.pool.shutdown(wait=True)

    app = FastAPI(title="captioner", summary="Image captions with visual attention (Show, Attend and Tell)",
                  version=_version(), docs_url=None, redoc_url=None, openapi_url="/openapi.json",
                  lifespan=lifespan)

    @app.exception_handler(Refused)
    async def refused(request: Request, e: Refused):
        return error(e.status, e.message, e.retry_after)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return error(e.status_code, str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        return error(422, "; ".join(str(x.get("msg")) for x in e.errors()) or "invalid request")

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        log.exception("unexpected error")
        return error(500, f"internal error: {type(e).__name__}")

    @app.post("/v1/captions", summary="Caption one image", openapi_extra=_captions_openapi(),
              description="The image as the raw body (any content type but multipart), or as the file field "
                          f"`{FILE_FIELD}` of a multipart form. Options as query parameters or form fields, with "
                          "`captioner caption`'s names (beam_size for --beam-size) and rules.")
    async def captions(request: Request) -> JSONResponse:
        arrived = time.perf_counter()
        service.admit()
        reached = False
        try:
            body = await read_body(request, service.limits.max_body_bytes)
            data, fields = await image_and_fields(request, body)
            reached = True
            given = list(request.query_params.multi_items()) + fields
            record = await asyncio.get_running_loop().run_in_executor(service.pool, service.caption, data, given,
                                                                      arrived)
        finally:
            service.leave(reached)
        return JSONResponse(record)

    @app.get("/v1/model", summary="The model: name, training data, vocabulary, language, notice")
    async def model() -> dict:
        return service.model_card()

    @app.get("/healthz", summary="The server is alive")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz", summary="The model is loaded and the queue is not full")
    async def readyz():
        body = {"queued": service.gate.queued, "max_queue": service.limits.max_queue,
                "in_flight": service.in_flight}
        if service.ready:
            return {"status": "ready", **body}
        return JSONResponse({"status": "busy", **body}, status_code=503, headers={"Retry-After": "1"})

    _add_docs(app)
    return app


def _swagger_folder() -> Path | None:
    """Swagger UI's files, installed with the package swagger-ui-bundle-v2 (5.x reads OpenAPI 3.1)."""
    try:
        from swagger_ui_bundle import swagger_ui_path
    except ImportError:
        return None
    folder = Path(swagger_ui_path)
    return folder if (folder / "swagger-ui-bundle.js").is_file() else None


PLAIN_DOCS = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>captioner: API</title>
<style>body{font:15px/1.5 system-ui,sans-serif;max-width:52rem;margin:2rem auto;padding:0 1rem}
code{background:#f3f3f3;padding:0 .2em}</style></head>
<body><h1>captioner: API</h1><p>The OpenAPI description: <a href="ROOT/openapi.json">openapi.json</a>
(Swagger UI is shown here when the package swagger-ui-bundle-v2 is installed).</p><div id="paths"></div>
<script>
fetch("ROOT/openapi.json").then(r => r.json()).then(api => {
  const out = document.getElementById("paths");
  for (const [path, ops] of Object.entries(api.paths)) for (const [verb, op] of Object.entries(ops)) {
    const h = document.createElement("h2"); h.textContent = verb.toUpperCase() + " " + path; out.append(h);
    const p = document.createElement("p"); p.textContent = (op.summary || "") + ". " + (op.description || "");
    out.append(p);
    for (const q of op.parameters || []) {
      const d = document.createElement("div"); d.textContent = q.name + ": " + (q.schema.description || "");
      out.append(d);
    }
  }
});
</script></body></html>
"""


def _add_docs(app: FastAPI) -> None:
    """/docs from this server alone: Swagger UI from the installed package's files, or a plain page
    that reads /openapi.json. No asset from another host either way."""
    from fastapi.openapi.docs import get_swagger_ui_html
    from fastapi.staticfiles import StaticFiles

    folder = _swagger_folder()
    if folder is not None:
        app.mount("/docs/assets", StaticFiles(directory=folder), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")
        if folder is None:
            return HTMLResponse(PLAIN_DOCS.replace("ROOT", root))
        return get_swagger_ui_html(openapi_url=f"{root}/openapi.json", title="captioner: API",
                                   swagger_js_url=f"{root}/docs/assets/swagger-ui-bundle.js",
                                   swagger_css_url=f"{root}/docs/assets/swagger-ui.css",
                                   swagger_favicon_url=f"{root}/docs/assets/favicon-32x32.png",
                                   swagger_ui_parameters={"validatorUrl": None})


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("captioner")
    except PackageNotFoundError:
        return "0"
