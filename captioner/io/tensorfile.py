"""The safetensors file format, read and written with numpy alone.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (each
tensor's dtype, shape and byte range; string metadata under "__metadata__"), then the
tensors' bytes, little-endian, row-major. Nothing in it can run code when read, which is
why an exported model keeps its weights and its familiarity record so. Reading and writing
it here needs neither torch (the torch-free runtime reads the familiarity record) nor the
``safetensors`` package (the tests hold these files equal to that package's).

A file is read only once its whole header is checked: JSON, an object, string metadata, and
for every tensor a dtype read here, a shape of sizes and a byte range inside the file that
holds exactly that many bytes. Whatever is wrong (a file cut short, a header of another
shape) is one TensorFileError naming the file, which the loaders turn into their one-line
refusal: never an exception of another kind.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np

# safetensors dtype name <-> numpy dtype (bf16 has no numpy dtype: refused, by name)
DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
          "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
MAX_HEADER = 100_000_000  # the safetensors package's own limit on the header's size


class TensorFileError(ValueError):
    """Not a readable safetensors file; the message says why, in one line."""


def write(path: str | os.PathLike, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (name -> array) to ``path``, their names sorted, as the package does."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    blobs, offset = [], 0
    for name in sorted(tensors):
        arr = np.asarray(tensors[name])
        arr = arr if arr.flags.c_contiguous else arr.copy(order="C")  # (ascontiguousarray makes a 0-d array 1-d)
        if arr.dtype not in _NAMES:
            raise TypeError(f"{name}: dtype {arr.dtype} has no safetensors name here")
        data = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the tensors start 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for data in blobs:
            f.write(data)


class Entry(NamedTuple):
    """One tensor's entry in a header, checked: its dtype, shape and byte range in the data."""

    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def printable(name: str) -> str:
    """A tensor's name as a message may show it on one line (quoted where it holds a line break
    or another control character)."""
    return name if name.isprintable() else repr(name)


def _short(value) -> str:
    """A value of a header as JSON, on one line, cut to 60 characters."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _size(value) -> bool:
    """A size or byte offset: a whole number >= 0 (JSON's true and 2.0 are none)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry(path: Path, name: str, info, size: int) -> Entry:
    """``info``, the header's entry of tensor ``name``, checked against the data's ``size`` in
    bytes; or a one-line TensorFileError saying what is wrong with it."""
    where = f"{path}: tensor {printable(name)}"
    if not isinstance(info, dict):
        raise TensorFileError(f"{where} has the entry {_short(info)}, not a JSON object")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in info:
            raise TensorFileError(f"{where} has no {key}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise TensorFileError(f"{where} has the dtype {_short(dtype)}, none of those read here "
                              f"({', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(_size(s) for s in shape):
        raise TensorFileError(f"{where} has the shape {_short(shape)}, not a list of sizes (whole numbers >= 0)")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_size(x) for x in offsets):
        raise TensorFileError(f"{where} has the data_offsets {_short(offsets)}, not two byte offsets "
                              "(whole numbers >= 0)")
    lo, hi = offsets
    item = np.dtype(DTYPES[dtype]).newbyteorder("<")
    if lo > hi:
        raise TensorFileError(f"{where} has the data_offsets {_short(offsets)}, which end before they start")
    if hi > size:
        raise TensorFileError(f"{where} has the bytes [{lo}, {hi}), past the end of the file's {size} bytes of data")
    if hi - lo != item.itemsize * math.prod(shape):  # Python's integers: no product wraps around
        raise TensorFileError(f"{where}'s {hi - lo} bytes do not fit its shape {_short(shape)} of {dtype}")
    return Entry(item, tuple(shape), lo, hi)


def read_header(path: str | os.PathLike) -> tuple[dict[str, Entry], dict[str, str], int]:
    """(name -> Entry, metadata, where the data starts): the header only, every entry checked
    (a dtype read here, a shape of sizes, a byte range within the file that fits them); or a
    one-line TensorFileError naming the file, whatever is wrong with it."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            start = f.read(8)
            if len(start) < 8:
                raise TensorFileError(f"{path} is not a safetensors file (shorter than its header)")
            (n,) = struct.unpack("<Q", start)
            total = os.fstat(f.fileno()).st_size
            if n > MAX_HEADER or n + 8 > total:
                raise TensorFileError(f"{path} is not a safetensors file (its header length {n} does not fit the "
                                      "file)")
            text = f.read(n)
    except OSError as e:
        raise TensorFileError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: arrays nested thousands deep
        raise TensorFileError(f"{path} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise TensorFileError(f"{path} is not a safetensors file (its header is not a JSON object)")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise TensorFileError(f"{path} is not a safetensors file (its __metadata__ {_short(metadata)} is not a "
                              "JSON object of strings)")
    size = total - 8 - n
    return {name: _entry(path, name, info, size) for name, info in header.items()}, metadata, 8 + n


def read(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(name -> array, metadata) of a safetensors file, or a one-line TensorFileError."""
    path = Path(path)
    header, metadata, begin = read_header(path)
    try:
        with open(path, "rb") as f:
            f.seek(begin)
            data = f.read()
    except OSError as e:
        raise TensorFileError(f"cannot read {path}: {e.strerror or e}") from None
    out = {}
    for name, entry in header.items():
        if entry.end > len(data):  # the file was cut after its header was read
            raise TensorFileError(f"{path}: tensor {printable(name)}'s bytes lie past the end of the file")
        out[name] = np.frombuffer(data, dtype=entry.dtype, count=(entry.end - entry.start) // entry.dtype.itemsize,
                                  offset=entry.start).reshape(entry.shape)
    return out, metadata
