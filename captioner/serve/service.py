"""What `captioner serve` does with a request, without the web framework: the options read with
the command line's names and rules, the bytes decoded as `captioner caption` decodes a file,
the captioning through the one batcher (``captioner.batching.Gate``), and every refusal as a
status and one line. ``http.py`` only moves bytes between this and the network.

Concurrent requests with equal options are captioned in one batch. A request is announced to
the gate while its image is decoded, so that a batch waits (up to ``max_wait_ms``) only for
images that are on their way. An image that decodes fails its request alone, never its batch:
a batch that raises is captioned again one image at a time.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from captioner.batching import CoreShare, Gate, QueueFull, WaitedTooLong
from captioner.data.images import DEFAULT_MAX_PIXELS, ImageLoadError, ImageTooLargeError
from captioner.search.options import HARD_ATTENTION, UNFAMILIAR_BELOW, DecodeOptions, OptionError, parser

MAX_BODY_BYTES = 32 * 1024 * 1024  # a phone's photo is 3-15 MB; a 640x480 JPEG about 50 KB
RETRY_AFTER_S = 1  # what a refused client is told to wait: a batch takes a second or less


@dataclass(frozen=True)
class Limits:
    """The server's settings, as `captioner serve`'s flags give them."""

    workers: int = 1  # batches captioned at once
    max_batch: int = 16  # images captioned together at most
    max_wait_ms: float = 10.0  # how long a batch waits for images on their way
    max_queue: int = 64  # requests waiting for the model at most; more: 503
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_body_bytes: int = MAX_BODY_BYTES
    timeout_s: float = 30.0  # a request not captioned by then: 504

    @property
    def admitted(self) -> int:
        """Requests read, decoded or captioned at once at most: what can run, plus the line."""
        return self.max_queue + self.workers * self.max_batch


class Refused(Exception):
    """A request the server answers with ``status`` and one line, ``message``."""

    def __init__(self, status: int, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.retry_after = status, message, retry_after


def _flag(text: str) -> bool:
    words = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}
    if text.strip().lower() not in words:
        raise argparse.ArgumentTypeError(f"must be true or false, got {text}")
    return words[text.strip().lower()]


def _choice(choices: tuple[str, ...]):
    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(choices)}, got {text}")
        return text
    return parse


# Each option a request may give, by the name `captioner caption` gives its flag (--beam-size:
# beam_size), read by the flag's own rule; the decoding options go to DecodeOptions, the rest
# say what the answer holds.
OPTIONS = {
    "beam_size": parser("beam_size"),
    "max_len": parser("max_len"),
    "length_penalty": parser("length_penalty", float),
    "num_captions": parser("num_captions"),
    "hard_attention": _choice(HARD_ATTENTION),
    "unfamiliar_below": parser("unfamiliar_below", float),
    "allow_unk": _flag,
    "max_chars": parser("max_chars"),
    "with_attention": _flag,
    "attention_heads": _flag,
}
OPTION_HELP = {
    "beam_size": "beam width; 1 = greedy (default 3)",
    "max_len": "most tokens per caption (default: the model's longest training caption; at most 100)",
    "length_penalty": "rank finished beams by score / length**P (default 0)",
    "num_captions": 'also answer "alternatives": the N best captions of the search, at most beam_size (default 1)',
    "hard_attention": f"hard-attention models: {', '.join(HARD_ATTENTION)} (default expected)",
    "unfamiliar_below": f'"unfamiliar" when "familiarity" is below this share (default {UNFAMILIAR_BELOW})',
    "allow_unk": "let captions hold <unk> (default false)",
    "max_chars": "the best caption of at most this many characters, found by the search, never cut (no caption "
                 "fits: 422 naming the shortest found; default: no budget)",
    "with_attention": 'add "alphas" (T x H x W) and "betas" (T) (default false)',
    "attention_heads": 'add each head\'s maps, "alphas_heads" (default false)',
}


@dataclass(frozen=True)
class Asked:
    """What one request asks for: its decoding options and what its answer holds."""

    options: DecodeOptions
    with_attention: bool = False
    attention_heads: bool = False


def read_options(given: list[tuple[str, str]], model_max_len: int) -> Asked:
    """The request's options, (name, text) pairs from its query and form; an unknown name, one
    given twice or a value the command line would refuse: ``Refused`` 422 in the flag's words."""
    values: dict[str, object] = {}
    for name, text in given:
        if name not in OPTIONS:
            raise Refused(422, f"unknown option {name!r}: the options are {', '.join(OPTIONS)}")
        if name in values:
            raise Refused(422, f"option {name} given twice")
        try:
            values[name] = OPTIONS[name](text)
        except argparse.ArgumentTypeError as e:
            raise Refused(422, f"{name}: {e}") from None
    show = {k: bool(values.pop(k, False)) for k in ("with_attention", "attention_heads")}
    try:
        options = DecodeOptions(**{"max_len": model_max_len, **values})
    except OptionError as e:
        raise Refused(422, str(e)) from None
    return Asked(options, **show)


class Service:
    """A loaded captioner behind the gate, with the server's limits. ``caption`` is called on a
    thread of its own per request (it waits for the batch); ``admit``/``leave`` are called by the
    event loop around it. ``threads``: the cores the batches share (``share``: shared with other
    server processes); a batch takes the threads its share gives when it starts."""

    def __init__(self, captioner, limits: Limits, threads: int = 1, share: CoreShare | None = None):
        self.captioner, self.limits = captioner, limits
        self.share = share or CoreShare(threads)
        self.gate = Gate(limits.workers, threads=self.share.cores, batch=limits.max_batch,
                         max_wait=limits.max_wait_ms / 1000, max_queue=limits.max_queue, announced=True)
        self.in_flight = 0  # requests admitted and not yet answered
        # One thread per admitted request: it decodes the image, then waits in the gate's line.
        self.pool = ThreadPoolExecutor(limits.admitted + 1, thread_name_prefix="caption")

    @property
    def ready(self) -> bool:
        return not self.gate.full and self.in_flight < self.limits.admitted

    def admit(self) -> None:
        """Take a request in, or ``Refused`` 503 when as many are in already as the server holds."""
        if not self.ready:
            raise Refused(503, f"the server is busy ({self.gate.queued} requests waiting, --max-queue "
                               f"{self.limits.max_queue}): try again shortly", retry_after=RETRY_AFTER_S)
        self.in_flight += 1
        self.gate.announce()

    def leave(self, reached: bool = True) -> None:
        """An admitted request is answered; ``reached``: it came to ``caption`` (else it is withdrawn
        from the gate, which it was announced to)."""
        self.in_flight -= 1
        if not reached:
            self.gate.withdraw()

    def caption(self, data: bytes, given: list[tuple[str, str]], arrived: float | None = None) -> dict:
        """The JSON record of the image ``data`` (an admitted request's body), as `captioner caption`
        writes it without "image"; ``Refused`` with the table's status for what cannot be captioned."""
        announced = True
        try:
            arrived = time.perf_counter() if arrived is None else arrived
            asked = read_options(given, self.captioner.max_len)
            image = self.decode(data)
            left = self.limits.timeout_s - (time.perf_counter() - arrived) - self.gate.last_seconds
            announced = False
            done = self.gate.run(asked.options, image, self._work(asked.options), timeout=max(0.0, left),
                                 announced=True)
        except QueueFull:
            raise Refused(503, f"the queue is full (--max-queue {self.limits.max_queue}): try again shortly",
                          retry_after=RETRY_AFTER_S) from None
        except WaitedTooLong:
            raise Refused(504, f"not captioned within --timeout-s {self.limits.timeout_s:g}: the server is "
                               "busy, try again later") from None
        finally:
            if announced:
                self.gate.withdraw()
        result = done.result
        if isinstance(result, Exception):
            raise Refused(422, f"the image decoded but could not be captioned: {result}")
        if result.no_fit is not None:
            raise Refused(422, result.no_fit.reason)
        return result.to_json(None, asked.with_attention, heads=asked.attention_heads, model=self.captioner.name,
                              training_data=self.captioner.training_data)

    def decode(self, data: bytes):
        """The image in ``data``, decoded as `captioner caption` decodes a file (never a path)."""
        if not isinstance(data, bytes):
            raise TypeError("the server takes bytes only")
        if not data:
            raise Refused(400, "empty body: send the image's bytes (or a multipart form with a file field)")
        try:
            return self.captioner.preprocess.load(data, self.limits.max_pixels)
        except ImageTooLargeError as e:
            raise Refused(413, f"{e}; this server's --max-pixels is {self.limits.max_pixels:,}") from None
        except ImageLoadError as e:
            raise Refused(415, f"not an image: {e}") from None

    def _work(self, options: DecodeOptions):
        """The batch's work: the images captioned together; should that raise, each alone, so that
        one image that fails fails its request only (its place holds the exception)."""
        import torch

        def work(images: list) -> list:
            with self.share.batch() as threads:
                torch.set_num_threads(threads)
                try:
                    return self.captioner.caption_images(images, options)
                except Exception as e:
                    if len(images) == 1:
                        return [e]
                out: list = []
                for image in images:
                    try:
                        out.append(self.captioner.caption_images([image], options)[0])
                    except Exception as e:  # this image's request is told; the others go on
                        out.append(e)
                return out

        return work

    def model_card(self) -> dict:
        """What ``GET /v1/model`` answers: the model in a few fields, its demo notice included."""
        from captioner.io.export import language_of

        c = self.captioner
        return {"name": c.name, "training_data": c.training_data, "vocabulary_size": len(c.vocab),
                "language": language_of(c), "tokenizer": c.vocab.tokenizer.name, "demo": c.bundled,
                "notice": c.notice(), "attention": c.model.config.attention, "max_caption_len": c.max_len,
                "familiarity": c.familiarity is not None, "device": str(c.device), "precision": c.precision,
                "limits": {k: getattr(self.limits, k) for k in Limits.__dataclass_fields__}}

