"""torch.cuda's streams and graphs stood in for on a CPU, each call written to an event list, so
that a test can check the order in which a capture function uses them."""

from __future__ import annotations

import torch


def stand_in_cuda(monkeypatch) -> list:
    """Replace torch.cuda's Stream, current_stream, stream, CUDAGraph and graph; returns the list
    their calls are written to: ("wait", waiter, waited), ("on"/"off", stream) around a stream's
    context, ("record", pool, capture_error_mode) and "recorded" around a capture, "replay"."""
    events: list = []

    class Stream:
        def __init__(self, name="side"):
            self.name = name

        def wait_stream(self, other):
            events.append(("wait", self.name, other.name))

    main_stream = Stream("main")

    class StreamContext:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            events.append(("on", self.stream.name))

        def __exit__(self, *exc):
            events.append(("off", self.stream.name))

    class Graph:
        def replay(self):
            events.append("replay")

        def pool(self):
            return "new pool"

    class Recording:
        def __init__(self, graph, pool=None, capture_error_mode="global"):
            events.append(("record", pool, capture_error_mode))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            events.append("recorded")

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: main_stream)
    monkeypatch.setattr(torch.cuda, "stream", StreamContext)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", Recording)
    return events
