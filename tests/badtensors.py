"""Corrupt safetensors files, each made from a good file's bytes: cut short, a header that is
not JSON, or JSON of the wrong shape (the header, a tensor's entry, its dtype, shape or byte
offsets, the metadata). An exported folder's model.safetensors or familiarity.safetensors
broken so must be refused in one line, never with a traceback."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable


def parts(blob: bytes) -> tuple[dict, bytes]:
    """(the header as JSON data, the tensors' bytes) of a good safetensors file."""
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def assemble(header: dict | list | bytes, data: bytes) -> bytes:
    """A safetensors file of this header (JSON data, or the header's bytes as they are) and data."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def _first(header: dict) -> str:
    return sorted(k for k in header if k != "__metadata__")[0]


def _header(change: Callable[[dict], object]) -> Callable[[bytes], bytes]:
    """The file with its header replaced by ``change(header)``."""
    def corrupt(blob: bytes) -> bytes:
        header, data = parts(blob)
        return assemble(change(header), data)
    return corrupt


def _entry(change: Callable[[dict, dict], object]) -> Callable[[bytes], bytes]:
    """The file with its first tensor's entry replaced by ``change(entry, header)``."""
    def whole(header: dict) -> dict:
        name = _first(header)
        return {**header, name: change(dict(header[name]), header)}
    return _header(whole)


def _field(key: str, value: object) -> Callable[[bytes], bytes]:
    """The first tensor's entry with ``key`` set to ``value`` (... : taken out)."""
    def change(entry: dict, header: dict) -> dict:
        if value is ...:
            entry.pop(key)
        else:
            entry[key] = value
        return entry
    return _entry(change)


def _offsets(make: Callable[[int, int, int], object]) -> Callable[[bytes], bytes]:
    """The first tensor's data_offsets replaced by ``make(lo, hi, size of the data)``."""
    def corrupt(blob: bytes) -> bytes:
        header, data = parts(blob)
        name = _first(header)
        lo, hi = header[name]["data_offsets"]
        return assemble({**header, name: {**header[name], "data_offsets": make(lo, hi, len(data))}}, data)
    return corrupt


def _negative_shape(entry: dict, header: dict) -> dict:
    """Two negative sizes whose product is the tensor's size: the byte count fits."""
    count = 1
    for s in entry["shape"]:
        count *= s
    return {**entry, "shape": [-1, -count]}


CORRUPTIONS: dict[str, Callable[[bytes], bytes]] = {
    # cut short
    "empty": lambda blob: b"",
    "cut-in-length": lambda blob: blob[:5],
    "cut-in-header": lambda blob: blob[:8 + struct.unpack("<Q", blob[:8])[0] // 2],
    "cut-in-data": lambda blob: blob[:-4],
    "length-past-the-end": lambda blob: struct.pack("<Q", 2**63) + blob[8:],
    # a header that is not JSON
    "header-not-json": lambda blob: assemble(b"not json at all", parts(blob)[1]),
    "header-not-utf8": lambda blob: assemble(b"\xff\xfe\xfa{}", parts(blob)[1]),
    "header-nested-too-deep": lambda blob: assemble(b"[" * 100_000 + b"]" * 100_000, parts(blob)[1]),
    # JSON of the wrong shape
    "header-a-list": _header(lambda header: list(header)),
    "entry-a-list": _entry(lambda entry, header: [entry["dtype"], entry["shape"]]),
    "entry-a-string": _entry(lambda entry, header: "F32"),
    "entry-null": _entry(lambda entry, header: None),
    "dtype-missing": _field("dtype", ...),
    "dtype-unknown": _field("dtype", "Q4"),
    "dtype-bf16": _field("dtype", "BF16"),
    "dtype-a-list": _field("dtype", ["F32"]),
    "shape-missing": _field("shape", ...),
    "shape-not-a-list": _field("shape", 5),
    "shape-a-string": _field("shape", "12"),
    "shape-null": _field("shape", None),
    "shape-of-floats": _entry(lambda entry, header: {**entry, "shape": [float(s) for s in entry["shape"]]}),
    "shape-negative": _entry(_negative_shape),
    "shape-overflowing": _entry(lambda entry, header: {**entry, "shape": [2**32, 2**32],
                                                       "data_offsets": [0, 0]}),
    "offsets-missing": _field("data_offsets", ...),
    "offsets-not-a-list": _field("data_offsets", 7),
    "offsets-a-string": _field("data_offsets", "0,48"),
    "offsets-one-number": _offsets(lambda lo, hi, size: [lo]),
    "offsets-three-numbers": _offsets(lambda lo, hi, size: [lo, hi, hi]),
    "offsets-of-strings": _offsets(lambda lo, hi, size: [str(lo), str(hi)]),
    "offsets-of-floats": _offsets(lambda lo, hi, size: [float(lo), float(hi)]),
    "offsets-null": _offsets(lambda lo, hi, size: [None, hi]),
    "offsets-infinite": _offsets(lambda lo, hi, size: [lo, float("inf")]),
    "offsets-nan": _offsets(lambda lo, hi, size: [float("nan"), hi]),
    "offsets-reversed": _offsets(lambda lo, hi, size: [hi, lo]),
    "offsets-negative": _offsets(lambda lo, hi, size: [lo - hi, 0]),
    "offsets-past-the-end": _offsets(lambda lo, hi, size: [size, size + hi - lo]),
    "metadata-a-list": _header(lambda header: {**header, "__metadata__": ["format", "pt"]}),
    "metadata-not-strings": _header(lambda header: {**header, "__metadata__": {"format": 1}}),
}
