"""A single-file container of a JSON header plus raw arrays, opened with mmap.

Why not ``.npz``: ``np.load(mmap_mode="r")`` ignores mmap for zip members,
and a directory of ``.npy`` files cannot be replaced atomically. Layout::

    bytes 0..8     magic b"EMBHASH\\x01"
    bytes 8..16    header length H (uint64, little endian)
    bytes 16..16+H header, UTF-8 JSON: {"meta": {...}, "arrays": {name: {"dtype", "shape", "offset", "crc32"}},
                   "crc32": CRC-32 of the canonical JSON of meta and arrays}
    then each array's raw little-endian bytes at data_start + offset, where
    data_start is the first 64-byte boundary after the header

Writes go to a temporary file, are fsynced and renamed over the target, so a
reader sees the old file or the new one, never half of one. Reads check magic,
header (its own CRC-32, so a damaged digit that still parses is caught; files
written before it had one are read without that check), sizes and each
array's CRC-32 and raise :class:`CorruptStoreError` naming the path.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from embstore.atomic import atomic_file
from embstore.errors import CorruptStoreError
from embstore.files import not_a_regular_file

MAGIC = b"EMBHASH\x01"
_ALIGN = 64


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _header_crc(meta: Any, descr: Any) -> int:
    """CRC-32 of the header's content in canonical JSON (the same text before writing and after reading)."""
    return zlib.crc32(json.dumps({"meta": meta, "arrays": descr}, sort_keys=True).encode())


def _json_int(value: Any, what: str) -> int:
    """An integer header value; JSON floats and booleans are corruption, not numbers to truncate."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an integer, got {value!r}")
    return value


def write_arrays(path: str | os.PathLike[str], meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    """Write ``meta`` and ``arrays`` to ``path`` atomically."""
    path = Path(path)
    plain = {name: np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False) for name, a in arrays.items()}
    descr: dict[str, Any] = {}
    pos = 0  # offsets count from the data start, the first 64-byte boundary after the header
    for name, a in plain.items():
        descr[name] = {"dtype": a.dtype.str, "shape": list(a.shape), "offset": pos,
                       "crc32": zlib.crc32(memoryview(a).cast("B"))}
        pos = _align(pos + a.nbytes)
    head = json.dumps({"meta": meta, "arrays": descr, "crc32": _header_crc(meta, descr)}, sort_keys=True).encode()
    data_start = _align(16 + len(head))
    with atomic_file(path) as f:
        f.write(MAGIC + struct.pack("<Q", len(head)) + head)
        for name, a in plain.items():
            f.write(b"\0" * (data_start + descr[name]["offset"] - f.tell()))
            f.write(memoryview(a).cast("B"))


def read_arrays(path: str | os.PathLike[str], verify: bool = True) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(meta, arrays) with each array a read-only mmap of the file. Raises
    FileNotFoundError when the file is absent, CorruptStoreError when unreadable."""
    path = Path(path)

    def bad(why: str) -> CorruptStoreError:
        return CorruptStoreError(f"{path}: not a valid embstore hash mapping ({why})")

    kind = not_a_regular_file(path)  # a FIFO would block open() forever (a directory: IsADirectoryError below)
    if kind not in (None, "a directory"):
        raise bad(f"it is {kind}, not a regular file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        start = f.read(16)
        if len(start) < 16 or start[:8] != MAGIC:
            raise bad("wrong magic bytes; expected a file written by LearnedHash.save")
        (hlen,) = struct.unpack("<Q", start[8:])
        if hlen > size - 16:
            raise bad(f"header length {hlen} exceeds the file size {size}")
        try:
            header = json.loads(f.read(hlen).decode())
            meta, descr = header["meta"], header["arrays"]
            if not isinstance(meta, dict) or not isinstance(descr, dict):
                raise TypeError("meta and arrays must be objects")
        except (ValueError, KeyError, TypeError, RecursionError) as exc:  # RecursionError: JSON nested too deep
            raise bad(f"header: {type(exc).__name__}: {exc}") from None
        if "crc32" in header and header["crc32"] != _header_crc(meta, descr):
            raise bad("the header fails its CRC-32 check")
    data_start = _align(16 + hlen)
    arrays: dict[str, np.ndarray] = {}
    for name, d in descr.items():
        try:
            if not isinstance(d["dtype"], str):
                raise TypeError(f"dtype must be a string, got {d['dtype']!r}")
            dtype = np.dtype(d["dtype"])
            if dtype.kind not in "iuf" or dtype.fields is not None or dtype.subdtype is not None:
                raise TypeError(f"dtype {d['dtype']!r} is not a plain integer or float type")
            if not isinstance(d["shape"], list):
                raise TypeError(f"shape must be a list, got {d['shape']!r}")
            shape = tuple(_json_int(s, "shape") for s in d["shape"])
            offset = data_start + _json_int(d["offset"], "offset")
            crc = _json_int(d["crc32"], "crc32")
        except (KeyError, TypeError, ValueError) as exc:
            raise bad(f"array {name!r}: {exc}") from None
        nbytes = dtype.itemsize * math.prod(shape)  # Python ints: a huge shape cannot wrap around
        if offset < data_start or offset + nbytes > size or any(s < 0 for s in shape):
            raise bad(f"array {name!r} of {nbytes} bytes at offset {offset} does not fit in {size} bytes")
        try:  # numpy refuses more than 64 dimensions, or a dimension past 2**63 even of an empty array
            if nbytes == 0:
                arr = np.empty(shape, dtype)
            else:
                arr = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape).view(np.ndarray)
        except ValueError as exc:
            raise bad(f"array {name!r} of shape {list(shape)}: {exc}") from None
        if verify and zlib.crc32(memoryview(np.ascontiguousarray(arr)).cast("B")) != crc:
            raise bad(f"array {name!r} fails its CRC-32 check")
        arrays[name] = arr
    return meta, arrays
