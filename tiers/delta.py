"""Commit records that an ssd home appends between whole rewrites of its index file.

``present.delta`` (the ``in_place`` layout's presence bitmap, ``tiers/ssd.py``)
and ``slots.delta`` (the ``log`` layout's slot map, ``tiers/ssd_log.py``) hold
records of the same frame::

    magic (8 bytes), crc32 of the index file it follows (u32), resident rows
    after the commit (u64), entries (u64), crc32 (u32, of the header with this
    field 0, then the body), then ``entries`` fixed-size entries

A flush appends one record and fdatasyncs it, so its cost is the rows it
moved, not the table. The tier rewrites the index file whole, and drops the
records, when they would outgrow it, on open and on close.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

from embstore.errors import CorruptStoreError

__all__ = ["RECORD_HEADER", "encode_record", "read_records"]

RECORD_HEADER = struct.Struct("<8sIQQI")


def encode_record(magic: bytes, base_crc: int, resident: int, entries: int, body: bytes) -> bytes:
    """One commit record; ``base_crc`` ties it to the index file it follows."""
    crc = zlib.crc32(body, zlib.crc32(RECORD_HEADER.pack(magic, base_crc, resident, entries, 0)))
    return RECORD_HEADER.pack(magic, base_crc, resident, entries, crc) + body


def _intact_end(data: bytes, at: int, magic: bytes, entry_bytes: int) -> int:
    """End of the whole record with a good checksum at ``at``; -1 when there is none."""
    if at < 0 or len(data) - at < RECORD_HEADER.size:
        return -1
    m, base, count, n, crc = RECORD_HEADER.unpack_from(data, at)
    end = at + RECORD_HEADER.size + entry_bytes * n
    if m != magic or end > len(data):
        return -1
    body = memoryview(data)[at + RECORD_HEADER.size:end]
    if zlib.crc32(body, zlib.crc32(RECORD_HEADER.pack(m, base, count, n, 0))) != crc:
        return -1
    return end


def read_records(data: bytes, magic: bytes, entry_bytes: int, base_crc: int,
                 path: Path) -> tuple[list[tuple[int, bytes]], int | None]:
    """The records of ``data`` (file ``path``) that follow the index file with checksum ``base_crc``, as
    (entries, body) in order, and the resident count after the last (None when there is none).

    Reading stops at a whole record that names another index file: records of an older one (a crash
    between rewriting it and removing them) are in it already, and nothing is ever appended behind
    them. It stops at a torn or checksum-failing record too (the checksum covers the base field, so a
    flipped bit there is damage, not a stale record), which must be the last (a commit that never
    returned: after a failed append the next commit rewrites the index, never appends): one with an
    intact record anywhere after it is damage, not a crash, so CorruptStoreError.
    """
    out: list[tuple[int, bytes]] = []
    resident = None
    at = 0
    while len(data) - at >= RECORD_HEADER.size:
        _, base, count, n, _ = RECORD_HEADER.unpack_from(data, at)
        end = _intact_end(data, at, magic, entry_bytes)
        if end >= 0 and base != base_crc:
            break
        if end < 0:
            nxt = data.find(magic, at + 1)
            while nxt >= 0:
                if _intact_end(data, nxt, magic, entry_bytes) >= 0:
                    raise CorruptStoreError(f"ssd tier: {path} has a damaged commit record at byte {at} "
                                            f"with an intact one after it (at byte {nxt})")
                nxt = data.find(magic, nxt + 1)
            break
        out.append((n, data[at + RECORD_HEADER.size:end]))
        resident = count
        at = end
    return out, resident
