"""What the page's sessions share, and how one upload is captioned and kept.

The server's settings (workers, batch, pixel limit) come from the environment that `captioner
app` sets; the process has one ``Gate`` (captioner/batching.py) for the model and one cache of captioned
images, shared between sessions. A caption is drawn once, at the size the page shows it
(app/pictures.py), into one element of markup (app/page.py), and kept with its pictures, so
that reruns (picking a word, reopening the page) encode nothing and Streamlit only hashes
bytes. The figure and the JSON are made when they are downloaded.
"""

from __future__ import annotations

import gc
import hashlib
import io
import json
import os
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import streamlit as st
import torch
from PIL import Image

from captioner.app import page
from captioner.app.pictures import Decoded, Picture, data_uri, heads_of, map_layers, seen_by_model
from captioner.batching import Gate, usable_cores
from captioner.data.images import DEFAULT_MAX_PIXELS
from captioner.inference import Captioner, DecodeOptions
from captioner.overlay import attention_figure, figure_info
from captioner.search.decoding import CaptionResult

BATCH = 4  # captions made together at most, when uploads wait for the model
RESULTS_KEPT = 32  # captioned images shared between sessions (a few hundred KB each)


class ResultCache:
    """A small least-recently-used map, safe across sessions' threads."""

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            if key not in self._items:
                return None
            self._items.move_to_end(key)
            return self._items[key]

    def put(self, key, value) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.max_entries:
                self._items.popitem(last=False)


@contextmanager
def logged_run() -> Iterator[dict]:
    """For the ``with`` block (a script run): one line in the file $CAPTIONER_APP_RUN_LOG, when set,
    "time<TAB>what<TAB>the run's CPU ms<TAB>the model's CPU ms", with what the run showed and what
    its caption cost (0 when none was made). Tests and the benchmark count the server's runs per
    upload with it, and split its CPU between the model and the rest; unset, it costs nothing."""
    entry = {"what": "-", "model_cpu": 0.0}
    start = time.thread_time()  # the script runs in a thread of its own, the caption in it
    try:
        yield entry
    finally:
        path = os.environ.get("CAPTIONER_APP_RUN_LOG")
        if path:
            with open(path, "a", encoding="utf-8") as log:
                log.write(f"{time.time():.3f}\t{entry['what']}\t{(time.thread_time() - start) * 1000:.1f}\t"
                          f"{entry['model_cpu'] * 1000:.1f}\n")


def forget_upload(upload) -> None:
    """Drop an uploaded file from Streamlit's store once the page has read it.

    Why: the page keeps the file's bytes in the session (its "upload") and the uploader keeps
    only the file's id, so the store's copy would double every upload's memory until the next
    upload replaces it. Streamlit has no public call for it: this is the one place that uses its
    private runtime (the script run's context and its uploaded-file manager). If a Streamlit
    release moves them, this does nothing and the page still works, each session then holding
    its last upload twice; tests/app/test_app.py checks that the store is left empty."""
    try:
        from streamlit.runtime.scriptrunner import get_script_run_ctx

        ctx = get_script_run_ctx()
        if ctx is not None:
            ctx.uploaded_file_mgr.remove_file(ctx.session_id, upload.file_id)
    except (ImportError, AttributeError):
        pass


def _env_count(name: str, default: int) -> int:
    """A count of at least 1 from the environment, ``default`` when unset or not a number."""
    try:
        return max(1, int(os.environ.get(name) or default))
    except ValueError:
        return default


def pixel_limit() -> int:
    """The most pixels an upload may have: CAPTIONER_APP_MAX_PIXELS (`captioner app --max-pixels`),
    else Pillow's own limit."""
    return _env_count("CAPTIONER_APP_MAX_PIXELS", DEFAULT_MAX_PIXELS)


def app_device() -> str:
    """Where the model runs: CAPTIONER_APP_DEVICE (`captioner app --device`), else the GPU if
    there is one."""
    return os.environ.get("CAPTIONER_APP_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")


def app_precision() -> str:
    """CAPTIONER_APP_PRECISION (`captioner app --precision`): fp32 unless told otherwise."""
    return os.environ.get("CAPTIONER_APP_PRECISION") or "fp32"


def default_workers(device: str) -> int:
    """Captions made at once. On a GPU one: uploads that wait are captioned together in one
    batch, and several workers would only queue on the one device. On the CPU one per core."""
    return 1 if torch.device(device).type == "cuda" else usable_cores()


@st.cache_resource
def caption_gate() -> Gate:
    """The process's one gate. CAPTIONER_APP_WORKERS captions at once (default_workers),
    each with cores / workers torch threads, so that concurrent uploads do not thrash."""
    workers = _env_count("CAPTIONER_APP_WORKERS", default_workers(app_device()))
    gate = Gate(workers, threads=max(1, usable_cores() // workers), batch=_env_count("CAPTIONER_APP_BATCH", BATCH))
    torch.set_num_threads(gate.threads)
    return gate


@st.cache_resource
def results_cache() -> ResultCache:
    return ResultCache(RESULTS_KEPT)


def settle_heap() -> None:
    """Call once a model is loaded. Streamlit runs a full garbage collection after every script
    run (unless told not to, as `captioner app` does), and Python one now and then; with torch and
    a model in the heap that walks a few hundred thousand objects, 0.1-0.2 s of CPU each time, more
    than a caption. Frozen, they are left out of every later collection (they live as long as the
    server anyway); what the runs make is still collected."""
    gc.collect()
    gc.freeze()


@dataclass
class Shown:
    """One captioned image, as the page shows it; shared by every session that shows it."""

    key: tuple  # (digest, weights, their mtime, DecodeOptions): what the caption depends on
    name: str
    result: CaptionResult
    seconds: float  # the model's own time: decoding, and its batch's captioning
    cpu: float  # the model's own CPU time: decoding, and its share of its batch's
    seen: bytes  # JPEG of the part the model saw, at most LARGE_WIDTH wide: the big view, the figure
    view: str  # HTML: the word picker, the picked word's map and the grid (page.result_html); "" without words
    waited: float = 0.0  # seconds this session waited for the model
    model: str | None = None  # the model that captioned it, as `captioner caption` names it (Captioner.name)
    training_data: str | None = None  # what that model was trained on, when known
    explain: str | None = None  # the gradient maps' kind the view shows (captioner.explain); None: the attention


def caption_image(captioner: Captioner, gate: Gate, key: tuple, name: str, data: bytes, options: DecodeOptions,
                  picture: Picture | None = None, decoded: Decoded | None = None,
                  on_wait: Callable[[int], None] | None = None, explain: str | None = None) -> Shown:
    """Caption the raw bytes (decoded as `captioner caption` decodes them, so the page gives the
    checkpoint's own caption) and draw what the page shows. ``picture``, ``decoded``: the upload as
    Picture.decode gave them for this model; without them the bytes are decoded here, once.
    ``explain``: the view shows each word's gradient map of that kind (captioner.explain), what
    made the model say it, in place of its attention."""
    start, cpu = time.perf_counter(), time.thread_time()
    if decoded is None:  # decoded before the gate, by this session's thread
        image = captioner.preprocess.load(data, pixel_limit())
        decoded = Decoded(image, image, None)
    image = decoded.image
    decoding, cpu = time.perf_counter() - start, time.thread_time() - cpu

    def caption_all(images: list[Image.Image]) -> list[CaptionResult]:
        torch.set_num_threads(gate.threads)  # the thread that runs the batch, not only the first one
        return captioner.caption_images(images, options, explain=explain)

    # Uploads waiting with the same model and settings are captioned together (Gate.run).
    done = gate.run((id(captioner), options, explain), image, caption_all, on_wait)
    result, seconds, cpu = done.result, decoding + done.seconds, cpu + done.cpu
    # Drawn outside the gate: the next caption need not wait for it.
    seen, size = seen_by_model(captioner.preprocess, decoded.view, picture, decoded.preview)
    view = ""
    if result.words:
        if picture is not None and seen is picture.preview:  # the page's preview defines the photo
            photo = f"var(--{page.photo_var(picture)})"
        else:
            photo = f"url({data_uri(seen, 'image/jpeg')})"
        prefix = "r" + hashlib.sha1(repr(key).encode()).hexdigest()[:12]  # unique on the page
        drawn = shown_maps(result, explain)
        view = page.result_html(prefix, page.words_of(result.words, result.betas), map_layers(drawn, size), photo,
                                size[0] / size[1], tuple(result.alphas.shape[1:]), heads_of(drawn), explain)
    return Shown(key, name, result, seconds, cpu, seen, view, waited=done.waited, model=captioner.name,
                 training_data=captioner.training_data, explain=explain)


def shown_maps(result: CaptionResult, explain: str | None) -> CaptionResult:
    """The result whose maps the view and the figure draw: its attention, or with ``explain``
    its gradient maps of that kind in the attention's place (one map per word, no heads)."""
    if explain is None:
        return result
    return replace(result, alphas=result.gradients[explain], alphas_heads=None)


def figure_png(shown: Shown, model: str) -> bytes:
    """The downloadable figure: the image and one panel per word under a title (the caption and
    the model), as `captioner caption --attention-dir` draws it."""
    buf = io.BytesIO()
    title = model if shown.explain is None else f"{model}, {shown.explain} maps: what made it say each word"
    attention_figure(Image.open(io.BytesIO(shown.seen)).convert("RGB"), shown_maps(shown.result, shown.explain),
                     model=title).save(buf, "PNG", pnginfo=figure_info(shown.result, title))
    return buf.getvalue()


def result_json(shown: Shown) -> str:
    """The download: the JSON line `captioner caption --with-attention` writes for the image."""
    return json.dumps(shown.result.to_json(shown.name, with_attention=True, model=shown.model,
                                           training_data=shown.training_data), ensure_ascii=False)
