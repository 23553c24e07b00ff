"""Write-ahead log: durable writes for the price of the rows written, not of a flush.

``Store.flush()`` rewrites each home's whole index (a presence bitmap, or the
``log`` layout's slot map: 4 MB for a 1M-row table), so flushing to acknowledge
every small write costs the table's size. ``Store.update_logged`` instead
applies a write and appends it here; ``Store.sync_log()`` (one ``fdatasync``,
shared by every write appended before it) makes it durable. A flush seals the
current segment first and deletes the sealed ones once the tables are
flushed; opening a store replays what is left, flushes and deletes it. A
write whose apply fails after its append is cut off again (``retract``): its
caller was told it failed, so a replay must not bring it back.

::

    STORE/wal/00000001.log, 00000002.log, ...   segments, replayed in order

A record is ``<magic u32, payload bytes u32, crc32 u32>`` then the payload:
``name bytes u16, name, n u32, dim u32, ids int64[n], rows float32[n, dim]``
(little-endian). Records are appended whole with one ``write``; a crash can
leave only the last one torn, and replay stops at the first record that is
short or fails its checksum (it was never acknowledged: its sync did not
return). Replay streams a segment record by record (header, then payload),
so its memory is the largest record, not the segment; a length field larger
than what is left of the file is damage, not a reason to allocate it.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np

from embstore.atomic import fsync_dir
from embstore.errors import CorruptStoreError, TierIOError, tier_io_error

__all__ = ["WAL_DIR", "WriteAheadLog", "read_records"]

log = logging.getLogger("embstore.wal")

WAL_DIR = "wal"
_HEADER = struct.Struct("<III")
_MAGIC = 0x314C5745  # b"EWL1"
_COUNTS = struct.Struct("<II")
_READ_BUFFER = 1 << 16


def _segments(directory: Path) -> list[Path]:
    """The log's segment files, oldest first (other files in the folder are not the log's)."""
    return sorted(directory.glob("[0-9]" * 8 + ".log")) if directory.is_dir() else []


def _encode(table: str, ids: np.ndarray, rows: np.ndarray) -> bytes:
    name = table.encode()
    payload = b"".join([struct.pack("<H", len(name)), name, _COUNTS.pack(len(ids), rows.shape[1]),
                        np.ascontiguousarray(ids, "<i8").tobytes(), np.ascontiguousarray(rows, "<f4").tobytes()])
    return _HEADER.pack(_MAGIC, len(payload), zlib.crc32(payload)) + payload


def _decode(payload: bytes) -> tuple[str, np.ndarray, np.ndarray]:
    (name_len,) = struct.unpack_from("<H", payload, 0)
    name = payload[2:2 + name_len].decode()
    n, dim = _COUNTS.unpack_from(payload, 2 + name_len)
    at = 2 + name_len + _COUNTS.size
    ids = np.frombuffer(payload, "<i8", n, at).astype(np.int64)
    rows = np.frombuffer(payload, "<f4", n * dim, at + 8 * n).reshape(n, dim).astype(np.float32)
    return name, ids, rows


def _payloads(f: BinaryIO, end: int) -> Iterator[bytes]:
    """The whole, checksummed payloads of the segment open in ``f`` (``end`` bytes long), in order,
    up to the first short or damaged record; reads one record at a time. A length past ``end`` is
    damage: reading it would allocate up to 4 GiB for a record that cannot be there."""
    at = 0
    while end - at >= _HEADER.size:
        header = f.read(_HEADER.size)
        if len(header) != _HEADER.size:  # the file shrank under us: as torn as a short record
            return
        magic, size, crc = _HEADER.unpack(header)
        if magic != _MAGIC or size > end - at - _HEADER.size:
            return
        payload = f.read(size)
        if len(payload) != size or zlib.crc32(payload) != crc:
            return
        yield payload
        at += _HEADER.size + size


def _unsynced_mark(segment: Path) -> Path:
    """The mark beside a segment sealed after a failed sync: it may hold a hole (see ``_sync_failed``)."""
    return segment.with_suffix(".unsynced")


def read_records(directory: str | os.PathLike[str]) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """Every whole record of the log in ``directory``, oldest first, up to a torn tail of the last
    segment. A damaged record in an earlier segment (sealed, so synced whole) is a
    ``CorruptStoreError``: the writes after it were acknowledged and cannot be skipped; unless the
    segment is marked unsynced (its sync failed, and nothing was acknowledged through the log since),
    where the damage ends that segment's replay as a torn tail would."""
    segments = _segments(Path(directory))
    for n, path in enumerate(segments):
        with open(path, "rb", buffering=_READ_BUFFER) as f:
            end = os.fstat(f.fileno()).st_size  # the size at open; anything appended later is not replayed
            at = 0
            for payload in _payloads(f, end):
                try:
                    record = _decode(payload)
                except (ValueError, UnicodeDecodeError, struct.error) as exc:  # checksummed, yet inconsistent
                    raise CorruptStoreError(f"write-ahead log {path}: the record at offset {at} is damaged "
                                            f"({exc})") from exc
                yield record
                at += _HEADER.size + len(payload)
        if at < end:
            if n < len(segments) - 1 and not _unsynced_mark(path).exists():
                raise CorruptStoreError(f"write-ahead log {path}: the record at offset {at} is damaged, and "
                                        "later segments hold acknowledged writes")
            log.warning("write-ahead log %s: %d bytes after offset %d are a torn record; ignored (never "
                        "acknowledged)", path, end - at, at)


class WriteAheadLog:
    """Appends and syncs records in ``directory`` (created on the first append).

    Not thread-safe by itself: the store calls every method under one lock, so
    that the log's order is the order the writes were applied in. Only the
    ``fdatasync`` of a :meth:`sync_handle` runs outside it, one at a time (see
    :meth:`synced`).
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        existing = _segments(self.directory)
        self._seq = int(existing[-1].stem) + 1 if existing else 1
        self._fd = -1
        self._torn_seq: int | None = None  # a segment left with a partial record that could not be cut off
        self._unsynced_seq: int | None = None  # the latest segment whose sync failed: see _sync_failed
        self._last_start = -1  # where the current segment's last appended record begins
        self._end = 0  # bytes in the current segment
        self._durable = (self._seq, 0)  # (segment, offset): every record before it is synced or flushed

    def _segment(self, seq: int) -> Path:
        return self.directory / f"{seq:08d}.log"

    def append(self, table: str, ids: np.ndarray, rows: np.ndarray) -> None:
        """Append one record; a failed append (a full disk, EIO) raises a ``TierIOError`` and leaves no
        part of it behind: replay stops at the first torn record, so a torn one left in the middle of the
        segment would hide every acknowledged write appended after it."""
        if self._torn_seq is not None:
            raise TierIOError("write-ahead log", "append", errno.EIO,
                              f"segment {self._segment(self._torn_seq)} ends in a record that could not be "
                              "removed after a failed append; writes are refused until a flush retires it")
        record = _encode(table, ids, rows)
        try:
            if self._fd < 0:
                self.directory.mkdir(exist_ok=True)
                self._fd = os.open(self._segment(self._seq), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                                   0o644)
                fsync_dir(self.directory)
            end = os.fstat(self._fd).st_size
        except OSError as exc:
            raise tier_io_error("write-ahead log", "append", exc) from exc
        view = memoryview(record)
        try:
            while view:
                view = view[os.write(self._fd, view):]
        except OSError as exc:
            try:
                os.ftruncate(self._fd, end)  # drop the partial record
            except OSError:
                self._torn_seq = self._seq
            raise tier_io_error("write-ahead log", "append", exc) from exc
        self._last_start, self._end = end, end + len(record)

    def retract(self) -> None:
        """Cut off the record the last :meth:`append` added (no append or seal may come between): its
        write failed to apply and its caller was told so, which a replay after a crash would undo.

        The cut is synced, so that a sync that raced with the append (``sync_handle`` runs outside the
        store's lock) cannot leave the record on disk for a power cut to bring back. If the cut fails
        the record stays and a crash before the next flush replays it (logged). If its sync fails, the
        kernel has reported, and forgotten, a write-back error of this segment's pages: a later sync would
        "succeed" without them, so :meth:`sync_handle` refuses until a flush retires the segment."""
        if self._fd < 0 or self._last_start < 0:
            return
        start, self._last_start = self._last_start, -1
        try:
            os.ftruncate(self._fd, start)
            self._end = start
        except OSError as exc:
            log.error("write-ahead log %s: could not cut off the record of a write that failed (%s); if the "
                      "process dies before the next flush, its replay applies that write", self._segment(self._seq),
                      exc)
            return
        try:
            os.fdatasync(self._fd)
        except OSError as exc:
            self._sync_failed(self._seq)
            log.error("write-ahead log %s: sync failed after cutting off the record of a failed write (%s); "
                      "writes are acknowledged by a flush until one retires the segment", self._segment(self._seq),
                      exc)

    def _sync_failed(self, seq: int) -> None:
        """Segment ``seq`` lost pages to a failed sync. The kernel reported that once and marked them
        clean, so a later sync would "succeed" without them, and replay would stop at the hole, hiding
        every record after it: no log sync is allowed (writes are acknowledged by a flush) until a flush
        has retired the segment. :meth:`seal` marks it, so that replay takes its hole for a torn tail and
        goes on with the later segments (none of whose writes was acknowledged through the log).

        Keeps the latest failed segment (failures come in segment order: a sealed one is not synced
        again): an earlier one is sealed and marked already, and a flush that retires it while the
        current one fails (a retract's sync, a racing flush's seal) must not forget the current one."""
        self._unsynced_seq = seq if self._unsynced_seq is None else max(seq, self._unsynced_seq)

    def _sync(self, fd: int) -> None:
        """``fdatasync(fd)`` of the current segment, a failure raised as a ``TierIOError`` and remembered."""
        try:
            os.fdatasync(fd)
        except OSError as exc:
            self._sync_failed(self._seq)
            raise tier_io_error("write-ahead log", "sync", exc) from exc

    def position(self) -> tuple[int, int]:
        """(segment, offset) just past the last record appended: what a sync must cover to make every
        write so far durable."""
        return self._seq, (self._end if self._fd >= 0 else 0)

    def sync_handle(self, target: tuple[int, int]) -> tuple[int, int, int]:
        """(a duplicate of the current segment's descriptor, its sequence number, its length) for a
        sync that covers ``target`` (a :meth:`position`); the descriptor is -1 when an earlier sync or
        flush already covered it (group commit). The caller ``fdatasync``s and closes it outside the
        store's lock, while appends go on, then reports with :meth:`sync_failed` or :meth:`synced`."""
        if target <= self._durable:
            return -1, self._seq, 0
        if self._unsynced_seq is not None:
            raise TierIOError("write-ahead log", "sync", errno.EIO,
                              f"an earlier sync of {self._segment(self._unsynced_seq)} failed; a flush must "
                              "retire it")
        if self._fd < 0:
            return -1, self._seq, 0
        return os.dup(self._fd), self._seq, self._end

    def sync_failed(self, seq: int) -> None:
        """The ``fdatasync`` of a :meth:`sync_handle` of segment ``seq`` failed (see :meth:`_sync_failed`)."""
        self._sync_failed(seq)

    def synced(self, seq: int, end: int) -> None:
        """The ``fdatasync`` of a :meth:`sync_handle` of segment ``seq`` (``end`` bytes long) returned.

        A handle is a duplicate, sharing its open file description with the log's own descriptor, and
        Linux reports a write-back error once per description: a sync racing one that failed (a
        retract's, under the store's lock) can return success without the lost pages. So success counts
        only if no failure was reported for the segment meanwhile; the store runs handle syncs and seals
        one at a time, so that no two syncs of the log race each other."""
        if self._unsynced_seq is not None and self._unsynced_seq <= seq:
            raise TierIOError("write-ahead log", "sync", errno.EIO,
                              f"a concurrent sync of {self._segment(self._unsynced_seq)} failed; a flush must "
                              "retire it")
        self._durable = max(self._durable, (seq, end))

    def seal(self) -> int:
        """Sync and close the current segment; later appends go to a new one. Returns the first
        sequence number not sealed: segments below it may go once the store is flushed.

        A segment whose sync failed is not synced again (that would lie) but marked unsynced: the
        flush after the seal covers its records, and :meth:`drop_before` retires it with its mark.
        Until then a good seal of a later segment does not make the log durable up to its end: the
        failed segment's records before it are neither synced nor flushed."""
        if self._fd >= 0:
            if self._unsynced_seq == self._seq:
                try:
                    _unsynced_mark(self._segment(self._seq)).touch()
                    fsync_dir(self.directory)
                except OSError as exc:
                    raise tier_io_error("write-ahead log", "seal", exc) from exc
            else:
                self._sync(self._fd)
                if self._unsynced_seq is None:  # an earlier failed segment is durable only once flushed
                    self._durable = (self._seq + 1, 0)
            os.close(self._fd)
            self._fd = -1
            self._seq += 1
            self._last_start, self._end = -1, 0
        return self._seq

    def drop_before(self, seq: int) -> None:
        """Delete the sealed segments below ``seq`` (their writes are in the flushed tables)."""
        gone = [p for p in _segments(self.directory) if int(p.stem) < seq]
        for p in gone:
            p.unlink()
            _unsynced_mark(p).unlink(missing_ok=True)  # after its segment: a mark alone is ignored
        if gone:
            fsync_dir(self.directory)
        if self._torn_seq is not None and self._torn_seq < seq:
            self._torn_seq = None
        if self._unsynced_seq is not None and self._unsynced_seq < seq:
            self._unsynced_seq = None
        self._durable = max(self._durable, (seq, 0))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
