"""The ``mmap`` tier: MTrainS's byte-addressable SCM tier, as rows in a memory-mapped file.

Files in ``directory``::

    rows.bin      num_rows * row_bytes bytes; row i at offset i * row_bytes (no header)
    present.bin   header (magic, num_rows, row_bytes, generation, crc32) + packed presence bits
    journal.bin   records of the puts and deletes since the last flush (redo log)
    LOCK          flock'ed while a tier has the directory open

Why:

- **Byte-addressable**: a row is read or written in place through the mapping
  with numpy fancy indexing (one vectorised gather or scatter per batch), no
  block I/O and no per-row Python loop; the kernel pages rows in and out.
- **No SIGBUS on a full disk**: storing into a mapped page of a sparse file
  whose blocks cannot be allocated kills the process with SIGBUS, which no
  handler can turn into an error. ``rows.bin`` is therefore reserved with
  ``os.posix_fallocate`` when the tier is created and again when it is opened
  (a no-op when already allocated, but it repairs a file copied sparse).
  The blocks are reserved as unwritten extents: nothing is written up front and
  reads of never-written rows cost no I/O. A full disk surfaces as
  :class:`DiskFullError` at create/open time instead of a signal later.
  (A failing *device* can still raise SIGBUS on a read through the mapping;
  only block tiers can report EIO for reads.)
- **Presence**: never-written rows must read as absent, not as zero rows, so a
  bitmap of written rows is kept in memory (one bool per row, packed to bits
  on disk) and replaced atomically at ``flush()``: write a temp file, fsync,
  ``os.replace``, fsync the directory. ``present.bin`` is the commit record of
  the tier: until it exists (an interrupted creation) the directory counts as
  never created.
- **No torn rows**: overwriting a row in place is not atomic, so a SIGKILL in the
  middle of a put could leave a row half old, half new. Each put and delete is
  first appended to ``journal.bin`` (one ``pwritev``, crc32-checked) and only
  then applied to the mapping. Opening replays the journal records of the
  current generation, redoing any put that a crash cut short; a record cut short
  itself (the crash came before the mapping was touched) is dropped.
  ``flush()`` msyncs the mapping, persists the bitmap with the next generation
  number (which retires the journal's records) and truncates the journal.
  A journal larger than :data:`JOURNAL_LIMIT` triggers a flush by itself.
- **Limits**: the journal lives in the page cache (it is not fsynced per put),
  so the no-tear promise covers a killed process, not a power cut: after a power
  cut or an EIO, a row *overwritten* since the last flush may be half written
  when both its writeback and its journal record were lost. Rows committed by
  the last flush and not overwritten since are always intact.
- **A failed msync is final**: Linux reports a failed writeback once and marks
  the pages it could not write clean, so a retried msync succeeds without them
  (PostgreSQL's "fsyncgate", 2018). So the tier never commits again: every
  later flush, put, delete and close raises :class:`TierIOError` (with the
  failure's errno) saying so, close still unmaps, and the last committed
  bitmap and the journal stay on disk. Reopening (after repairing the disk)
  redoes the journal's records; rows whose journal pages were lost too come
  back from the store's write-ahead log (durable writes). Reads keep working
  meanwhile, but a row written since the last good flush may read as older
  bytes once the kernel drops the clean pages. A failed bitmap commit after a
  good msync is not final: the next flush writes it again, whole.
- One process, one thread: a ``LOCK`` file (flock) keeps a second tier off the
  directory; calls on one tier are not synchronised.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from embstore.arrays import Ids, Mask, RowBytes, as_ids, check_id_range
from embstore.errors import (
    CorruptStoreError,
    StoreClosedError,
    TierIOError,
    tier_io_error,
)
from embstore.tiers.base import SyncGuard, Tier

ROWS_FILE = "rows.bin"
BITMAP_FILE = "present.bin"
JOURNAL_FILE = "journal.bin"
LOCK_FILE = "LOCK"
JOURNAL_LIMIT = 64 << 20  # bytes of journal that trigger an automatic flush

_BITMAP_MAGIC = b"EMBMMAP\x01"
_BITMAP_HEADER = struct.Struct("<8sQQQI4x")  # magic, num_rows, row_bytes, generation, crc32
_REC_MAGIC = b"EJR1"
_REC_HEADER = struct.Struct("<4sB3xQQI4x")  # magic, op, generation, count, crc32 of header+payload
_PUT, _DELETE = 1, 2


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, buffers: list[Any], offset: int) -> int:
    """pwritev every buffer at ``offset``, resuming after short writes; returns bytes written."""
    views = [memoryview(b).cast("B") for b in buffers]
    total = 0
    while views:
        n = os.pwritev(fd, views, offset + total)
        if n == 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        total += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    return total


class MmapTier(Tier):
    """A persistent, dense tier of ``num_rows`` rows in a memory-mapped file.

    ``directory`` is created when it holds no tier yet; an existing tier must have
    been created with the same ``num_rows`` and ``row_bytes``, else
    :class:`CorruptStoreError`. Ids must lie in ``[0, num_rows)``.
    """

    kind = "mmap"
    persistent = True
    supports_delete = True

    def __init__(self, directory: str | os.PathLike[str], num_rows: int, row_bytes: int) -> None:
        super().__init__(row_bytes)
        if num_rows <= 0:
            raise ValueError(f"num_rows must be positive, got {num_rows}")
        self.num_rows = int(num_rows)
        self.path = Path(directory)
        self._size = self.num_rows * self.row_bytes
        self._sync = SyncGuard("mmap", self.path / ROWS_FILE)  # a failed msync is never retried
        self._generation = 0
        self._dirty = False
        self._journal_fd = self._lock_fd = -1
        self._journal_size = 0
        self._mmap: mmap.mmap | None = None
        self._rows: np.ndarray | None = None
        try:
            self._lock()
            if (self.path / BITMAP_FILE).exists():
                self._present = self._load_bitmap()
            else:
                self._present = self._create()
            self._map_rows()
            self._open_journal()
            self._replay()
        except BaseException:
            self._release()
            raise
        self._resident = int(np.count_nonzero(self._present))

    # -- creation and opening --------------------------------------------------
    def _lock(self) -> None:
        """One MmapTier per directory at a time; the flock dies with the process, even on SIGKILL."""
        if self.path.exists() and not self.path.is_dir():
            raise CorruptStoreError(f"mmap tier: {self.path} is not a directory")
        lock = self.path / LOCK_FILE
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            raise tier_io_error("mmap", f"lock {lock} (is the tier open elsewhere?)", exc) from exc

    def _create(self) -> np.ndarray:
        """Reserve rows.bin and commit an empty bitmap (the bitmap marks the tier as created)."""
        rows = self.path / ROWS_FILE
        try:
            fd = os.open(rows, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                os.ftruncate(fd, 0)  # a leftover of an interrupted creation holds nothing
                os.posix_fallocate(fd, 0, self._size)
                os.fsync(fd)
            finally:
                os.close(fd)
            (self.path / JOURNAL_FILE).unlink(missing_ok=True)
        except OSError as exc:
            raise tier_io_error("mmap", f"create {rows}", exc) from exc
        present = np.zeros(self.num_rows, dtype=np.bool_)
        self._write_bitmap(present, 0)
        return present

    def _load_bitmap(self) -> np.ndarray:
        path = self.path / BITMAP_FILE
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise tier_io_error("mmap", f"read {path}", exc) from exc
        nbytes = (self.num_rows + 7) // 8
        if len(data) < _BITMAP_HEADER.size:
            raise CorruptStoreError(f"mmap tier: {path} is truncated ({len(data)} bytes)")
        magic, num_rows, row_bytes, gen, crc = _BITMAP_HEADER.unpack_from(data)
        if magic != _BITMAP_MAGIC:
            raise CorruptStoreError(f"mmap tier: {path} is not a presence bitmap (bad magic)")
        if (num_rows, row_bytes) != (self.num_rows, self.row_bytes):
            raise CorruptStoreError(f"mmap tier: {self.path} holds num_rows={num_rows}, row_bytes={row_bytes}; "
                                    f"opened with num_rows={self.num_rows}, row_bytes={self.row_bytes}")
        if len(data) != _BITMAP_HEADER.size + nbytes:
            raise CorruptStoreError(f"mmap tier: {path} has {len(data)} bytes, expected "
                                    f"{_BITMAP_HEADER.size + nbytes}")
        body = data[_BITMAP_HEADER.size:]
        header = _BITMAP_HEADER.pack(magic, num_rows, row_bytes, gen, 0)
        if zlib.crc32(body, zlib.crc32(header)) != crc:
            raise CorruptStoreError(f"mmap tier: {path} fails its checksum")
        self._generation = gen
        bits = np.frombuffer(body, dtype=np.uint8)
        return np.unpackbits(bits, count=self.num_rows, bitorder="little").astype(np.bool_)

    def _write_bitmap(self, present: np.ndarray, generation: int) -> None:
        """Atomically replace present.bin: temp file, fsync, os.replace, fsync the directory."""
        body = np.packbits(present, bitorder="little").tobytes()
        header = _BITMAP_HEADER.pack(_BITMAP_MAGIC, self.num_rows, self.row_bytes, generation, 0)
        crc = zlib.crc32(body, zlib.crc32(header))
        header = _BITMAP_HEADER.pack(_BITMAP_MAGIC, self.num_rows, self.row_bytes, generation, crc)
        final = self.path / BITMAP_FILE
        tmp = self.path / (BITMAP_FILE + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _write_all(fd, [header, body], 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
            _fsync_dir(self.path)
        except OSError as exc:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            raise tier_io_error("mmap", f"write {final}", exc) from exc
        self._generation = generation

    def _map_rows(self) -> None:
        path = self.path / ROWS_FILE
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError as exc:
            raise CorruptStoreError(f"mmap tier: {path} is missing") from exc
        except OSError as exc:
            raise tier_io_error("mmap", f"open {path}", exc) from exc
        try:
            size = os.fstat(fd).st_size
            if size != self._size:
                raise CorruptStoreError(f"mmap tier: {path} has {size} bytes, expected "
                                        f"num_rows * row_bytes = {self._size}")
            try:
                os.posix_fallocate(fd, 0, self._size)  # see the module docstring: no SIGBUS
                self._mmap = mmap.mmap(fd, self._size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as exc:
                raise tier_io_error("mmap", f"map {path}", exc) from exc
        finally:
            os.close(fd)
        self._mmap.madvise(mmap.MADV_RANDOM)  # rows are gathered at random: no read-ahead
        self._rows = np.frombuffer(self._mmap, dtype=np.uint8).reshape(self.num_rows, self.row_bytes)

    # -- journal ------------------------------------------------------------------
    def _open_journal(self) -> None:
        path = self.path / JOURNAL_FILE
        try:
            self._journal_fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            self._journal_size = os.fstat(self._journal_fd).st_size
        except OSError as exc:
            raise tier_io_error("mmap", f"open {path}", exc) from exc


    def _append(self, op: int, ids: Ids, rows: RowBytes | None) -> None:
        """Append one record; on failure cut the journal back so no garbage precedes later records."""
        payload: list[Any] = [ids.astype("<i8", copy=False)]
        if rows is not None:
            payload.append(rows)
        crc = 0
        for part in payload:
            crc = zlib.crc32(memoryview(part).cast("B"), crc)
        header = _REC_HEADER.pack(_REC_MAGIC, op, self._generation, len(ids), 0)
        crc = zlib.crc32(header, crc)
        header = _REC_HEADER.pack(_REC_MAGIC, op, self._generation, len(ids), crc)
        try:
            self._journal_size += _write_all(self._journal_fd, [header, *payload], self._journal_size)
        except OSError as exc:
            try:
                os.ftruncate(self._journal_fd, self._journal_size)
            except OSError:
                pass  # replay stops at the torn record anyway
            raise tier_io_error("mmap", "journal append", exc) from exc

    def _replay(self) -> None:
        """Redo the journal records of the current generation; drop a torn tail."""
        if self._journal_size == 0:
            return
        try:
            data = os.pread(self._journal_fd, self._journal_size, 0)
        except OSError as exc:
            raise tier_io_error("mmap", "journal read", exc) from exc
        pos, applied = 0, False
        rb = self.row_bytes
        while pos + _REC_HEADER.size <= len(data):
            magic, op, gen, count, crc = _REC_HEADER.unpack_from(data, pos)
            if magic != _REC_MAGIC or op not in (_PUT, _DELETE) or count > self.num_rows:
                break
            end = pos + _REC_HEADER.size + count * (8 + (rb if op == _PUT else 0))
            if end > len(data):
                break
            body = memoryview(data)[pos + _REC_HEADER.size:end]
            check = zlib.crc32(_REC_HEADER.pack(magic, op, gen, count, 0), zlib.crc32(body))
            if check != crc:
                break
            if gen == self._generation:
                ids = np.frombuffer(body[:count * 8], dtype="<i8").astype(np.int64)
                if count and (ids.min() < 0 or ids.max() >= self.num_rows):
                    raise CorruptStoreError(f"mmap tier: {self.path / JOURNAL_FILE} holds a record "
                                            f"with ids outside [0, {self.num_rows})")
                if op == _PUT:
                    self._rows[ids] = np.frombuffer(body[count * 8:], dtype=np.uint8).reshape(count, rb)
                    self._present[ids] = True
                else:
                    self._present[ids] = False
                applied = True
            pos = end
        if applied:
            self._dirty = True
            self.flush()
        else:
            self._truncate_journal()

    def _truncate_journal(self) -> None:
        try:
            os.ftruncate(self._journal_fd, 0)
        except OSError as exc:
            raise tier_io_error("mmap", "journal truncate", exc) from exc
        self._journal_size = 0

    # -- Tier API ----------------------------------------------------------------
    def _ids(self, ids: Any) -> Ids:
        if self.closed:
            raise StoreClosedError(f"mmap tier at {self.path} is closed")
        arr, _ = as_ids(ids)
        check_id_range(arr, self.num_rows, "mmap tier")
        return arr

    def get(self, ids: Ids) -> tuple[RowBytes, Mask]:
        """Gather rows through the mapping; never-written (or deleted) rows read as zeros."""
        arr = self._ids(ids)
        found = self._present[arr]
        rows = self._rows[arr]
        hits = int(np.count_nonzero(found))
        if hits != len(arr):
            rows[~found] = 0
        self.counters.hits += hits
        self.counters.misses += len(arr) - hits
        self.counters.bytes_read += hits * self.row_bytes
        return rows, found

    def contains(self, ids: Ids) -> Mask:
        return self._present[self._ids(ids)]

    def put(self, ids: Ids, rows: RowBytes) -> None:
        """Journal the batch, then scatter it into the mapping."""
        arr = self._ids(ids)
        self._check_rows(arr, rows)
        self._sync.check("write")
        if not len(arr):
            return
        rows = np.ascontiguousarray(rows)
        self._append(_PUT, arr, rows)
        self._rows[arr] = rows
        self._resident += int(len(arr) - np.count_nonzero(self._present[arr]))
        self._present[arr] = True
        self._dirty = True
        self.counters.bytes_written += len(arr) * self.row_bytes
        self._maybe_flush()

    def delete(self, ids: Ids) -> None:
        """Mark rows absent (their bytes stay until overwritten; reads mask them)."""
        arr = self._ids(ids)
        self._sync.check("delete")
        if not len(arr):
            return
        self._append(_DELETE, arr, None)
        self._resident -= int(np.count_nonzero(self._present[arr]))
        self._present[arr] = False
        self._dirty = True
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        """Bound the journal. A failure here is not the put's: the put is journaled and
        applied, so it is not raised; the next explicit flush() (or write) reports it."""
        if self._journal_size > JOURNAL_LIMIT:
            try:
                self.flush()
            except TierIOError:
                pass

    def flush(self) -> None:
        """msync the rows, then commit the bitmap atomically; the journal is then retired. A failed
        msync is final (see Limits in the module docstring); a failed commit is retried by the next flush."""
        if self.closed:
            raise StoreClosedError(f"mmap tier at {self.path} is closed")
        self._sync.check("flush")
        if not self._dirty:
            return
        try:
            self._mmap.flush()
        except OSError as exc:
            raise self._sync.failed("msync", exc) from exc
        self._write_bitmap(self._present, self._generation + 1)
        self._dirty = False
        self._truncate_journal()

    def close(self) -> None:
        """Flush and unmap (idempotent); the mapping is released even when the flush fails. After a
        failed msync nothing is committed and close raises: the journal stays for the reopen to redo."""
        if self.closed:
            return
        try:
            self._sync.check("close")
            self.flush()
        finally:
            self.closed = True
            self._release()

    def _release(self) -> None:
        self._rows = None  # the array exports the mmap's buffer; drop it before closing
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # someone still holds a view of the rows: unmapped when it is freed
            self._mmap = None
        for fd in (self._journal_fd, self._lock_fd):
            if fd >= 0:
                os.close(fd)
        self._journal_fd = self._lock_fd = -1

    @property
    def resident_rows(self) -> int:
        return self._resident

    @property
    def capacity_rows(self) -> int:
        return self.num_rows

    def __repr__(self) -> str:
        return f"MmapTier({str(self.path)!r}, num_rows={self.num_rows}, row_bytes={self.row_bytes})"


__all__ = ["BITMAP_FILE", "JOURNAL_FILE", "JOURNAL_LIMIT", "LOCK_FILE", "MmapTier", "ROWS_FILE"]
