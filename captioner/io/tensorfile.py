"""The safetensors file format, read and written with numpy alone.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (each
tensor's dtype, shape and byte range; string metadata under "__metadata__"), then the
tensors' bytes, little-endian, row-major. Nothing in it can run code when read, which is
why an exported model keeps its weights and its familiarity record so. Reading and writing
it here needs neither torch (the torch-free runtime reads the familiarity record) nor the
``safetensors`` package (the tests hold these files equal to that package's).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

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


def read_header(path: str | os.PathLike) -> tuple[dict, dict[str, str], int]:
    """(name -> {"dtype", "shape", "data_offsets"}, metadata, where the data starts): the header only."""
    path = Path(path)
    with open(path, "rb") as f:
        start = f.read(8)
        if len(start) < 8:
            raise TensorFileError(f"{path} is not a safetensors file (shorter than its header)")
        (n,) = struct.unpack("<Q", start)
        if n > MAX_HEADER or n + 8 > path.stat().st_size:
            raise TensorFileError(f"{path} is not a safetensors file (its header length {n} does not fit the file)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, ValueError):
            raise TensorFileError(f"{path} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise TensorFileError(f"{path} is not a safetensors file (its header is not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    return header, metadata, 8 + n


def read(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(name -> array, metadata) of a safetensors file, or a one-line TensorFileError."""
    path = Path(path)
    header, metadata, begin = read_header(path)
    size = path.stat().st_size - begin
    out = {}
    with open(path, "rb") as f:
        f.seek(begin)
        data = f.read()
    for name, info in header.items():
        try:
            dtype = np.dtype(DTYPES[info["dtype"]]).newbyteorder("<")
            shape = tuple(int(s) for s in info["shape"])
            lo, hi = (int(x) for x in info["data_offsets"])
        except KeyError as e:
            raise TensorFileError(f"{path}: tensor {name} has an unknown dtype or no {e}") from None
        if not 0 <= lo <= hi <= size or hi - lo != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
            raise TensorFileError(f"{path}: tensor {name}'s bytes do not fit its shape {list(shape)}")
        out[name] = np.frombuffer(data, dtype=dtype, count=(hi - lo) // dtype.itemsize, offset=lo).reshape(shape)
    return out, metadata
