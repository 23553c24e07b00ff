"""The ``rocksdb`` tier: rows in RocksDB (through rocksdict) for sparse or unbounded id spaces.

Layout, in raw mode (no pickling)::

    key   = id as 8-byte big-endian int64   (ids >= 0, so byte order = numeric order)
    value = the row's row_bytes bytes

Why these choices:

- Keys are packed for the whole batch at once: ``ids.astype('>i8').view('V8').tolist()``
  yields one ``bytes`` per id from C, about 5x faster than slicing a buffer in Python.
- Reads are one rocksdict multi-get with a shared all-zero ``default``: absent
  rows come back as that very object, so ``found`` is an identity test (``map`` in C)
  and ``bytearray().join`` lays every row, absent ones already zero, into one
  writable buffer with a single copy.
- Writes and deletes go through one ``WriteBatch`` per call, so a batch is
  applied atomically: a crash never leaves half a batch or half a row.
- Durability: every write goes to the write-ahead log (WAL) in the OS page cache
  as part of the write call (RocksDB's default, no ``manual_wal_flush``), so it
  survives SIGKILL of the process anyway; ``flush()`` syncs the WAL
  (``flush_wal(sync=True)``) so acknowledged writes also survive power loss.
  Syncing the WAL is one sequential fsync; flushing the memtable instead would
  write a new SST file per flush, pile up level-0 files and trigger compactions.
  Reopening replays the WAL.
- Recovery: RocksDB keeps the first background error of a failed write (ENOSPC
  appending to the WAL, writing an SST) and refuses later writes and WAL syncs
  with it ("Writer has previous error"), even after space is freed, until the
  database is reopened: its own auto-recovery comes seconds later if at all
  (never, in our tests, once a WAL sync had failed), and rocksdict binds no
  ``DB::Resume()``. So after a failed write or flush the next write, flush or
  close reopens the database in place (same options and directory, same tier
  object and counters), which replays the WAL: nothing acknowledged is lost.
  While the disk is still full that reopen fails, the write raises
  DiskFullError, and a read-only handle keeps reads working until a later
  write finds space again.
- Back-off while the disk stays full: a reopen costs 8-230 ms (it replays the
  WAL), so after one fails with ENOSPC further writes and flushes fail fast with
  DiskFullError ("still full, retry later") for a window that doubles with each
  failed reopen, from 0.1 s up to 5 s, and the first write after the window
  tries again; a write also tries at once when the disk has gained 1 MiB of free
  space since (an operator freed space: no need to wait out the window). A
  successful reopen resets the window. Reads never wait (they use the
  read-only handle), and close() always tries, being the last chance to sync.
- Damage: an existing database is checked before RocksDB opens it, because
  RocksDB silently opens what it can and then deletes the SST files no longer
  listed: a ``CURRENT`` that does not name a ``MANIFEST-*`` file, a missing or
  empty manifest, or one whose last record is cut short (truncated: RocksDB
  would drop the edits after the cut, and with them the SST files they list)
  is :class:`CorruptStoreError`, and so is every error RocksDB's own open
  reports as corruption (a missing, truncated or garbled SST file, a garbled
  manifest). A manifest cut exactly between two records cannot be told from
  an older one and still opens. ``OPTIONS-*`` files are not damage: every
  option is passed at open, RocksDB reads none of them and writes a fresh one.
  A ``LOCK`` held by another open handle (a store open in this or another
  process) is not damage either: :class:`TierIOError` with errno ``EAGAIN``,
  like the mmap tier's lock, to retry once that handle is closed.
"""

from __future__ import annotations

import contextlib
import errno
import operator
import os
import re
import struct
import time
from collections import deque
from itertools import repeat
from typing import Any, Callable

import numpy as np
import rocksdict

from embstore.arrays import Ids, Mask, RowBytes, as_ids
from embstore.errors import (
    ConfigError,
    CorruptStoreError,
    DiskFullError,
    IdOutOfRangeError,
    StoreClosedError,
    TierIOError,
    tier_io_error,
)
from embstore.tiers.base import Tier

COMPRESSIONS = ("none", "snappy", "lz4", "lz4hc", "zstd", "zlib", "bz2")
_BLOOM_BITS_PER_KEY = 10  # ~1% false positives: misses rarely touch a data block
MEMTABLES = 2  # max_write_buffer_number: the memtable being written and one being flushed
_STALL_PREFIX = "Result incomplete"  # rocksdict's text for Status::Incomplete (write stall)
_STALL_SLEEP_MIN, _STALL_SLEEP_MAX = 1e-4, 0.05
_REOPEN_BACKOFF_MIN, _REOPEN_BACKOFF_MAX = 0.1, 5.0  # seconds writes fail fast after a reopen failed for space
_FREED_BYTES = 1 << 20  # free space gained since that failure that makes the next write try at once
_LOG_BLOCK, _LOG_HEADER = 32768, 7  # RocksDB log files (the MANIFEST): 32 KiB blocks, crc32c + length + type
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4  # record types: whole record, or its first/middle/last fragment
_CURRENT = re.compile(rb"MANIFEST-[0-9]+\n")


def pack_keys(ids: Ids) -> list[bytes]:
    """8-byte big-endian keys of non-negative int64 ``ids``, one ``bytes`` each."""
    return np.ascontiguousarray(ids, dtype=">i8").view("V8").tolist()


def _is_corruption(exc: BaseException) -> bool:
    return str(exc).startswith("Corruption")


def _is_lock_error(exc: BaseException) -> bool:
    """RocksDB's refusal of a database another handle has open: "While lock file: .../LOCK: Resource
    temporarily unavailable" (another process), "lock hold by current process" (this one)."""
    text = str(exc)
    return "/LOCK:" in text and ("While lock file" in text or "lock hold by current process" in text)


def _torn_record(block: bytes) -> int | None:
    """Offset in ``block``, the last block of a RocksDB log file, of a record cut short by the end of
    the file; None when the file ends after a whole record.

    Every 32 KiB block starts with a record header (a record that does not fit is split into
    fragments), so the last block's framing is walked without the ones before it. Only framing is
    judged, not checksums (RocksDB checks those and reports corruption); framing this walk does not
    expect (an unknown type, a length past the block) is left to RocksDB too.
    """
    pos, kind, at = 0, _FULL, 0
    while len(block) - pos >= _LOG_HEADER and _LOG_BLOCK - pos >= _LOG_HEADER:
        length, new_kind = struct.unpack_from("<HB", block, pos + 4)
        if new_kind not in (_FULL, _FIRST, _MIDDLE, _LAST) or pos + _LOG_HEADER + length > _LOG_BLOCK:
            return None
        if pos + _LOG_HEADER + length > len(block):
            return pos  # the payload runs past the end of the file
        kind, at, pos = new_kind, pos, pos + _LOG_HEADER + length
    if pos < len(block) and _LOG_BLOCK - pos >= _LOG_HEADER:
        return pos  # a header cut short (a block's last 6 bytes or fewer are zero padding, not a header)
    return at if kind in (_FIRST, _MIDDLE) else None  # a record whose last fragment is missing


def _free_bytes(path: str) -> int | None:
    """Bytes an unprivileged writer may still use on the file system holding ``path``."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class _FullDiskBackoff:
    """When writes on a full disk may try another reopen (module docstring, "Back-off")."""

    def __init__(self) -> None:
        self.window = 0.0  # seconds; 0 while the last reopen did not fail for space
        self.failed_at = 0.0
        self.free: int | None = None  # free bytes just after that failure
        self.reason = ""

    def failed(self, now: float, free: int | None, reason: str) -> None:
        self.window = min(2 * self.window, _REOPEN_BACKOFF_MAX) if self.window else _REOPEN_BACKOFF_MIN
        self.failed_at, self.free, self.reason = now, free, reason

    def reset(self) -> None:
        self.window = 0.0

    def wait(self, now: float, free: int | None) -> float:
        """Seconds until a write may try a reopen; 0 when it may now (window over, or space freed)."""
        left = self.failed_at + self.window - now if self.window else 0.0
        if left <= 0 or (free is not None and self.free is not None and free >= self.free + _FREED_BYTES):
            return 0.0
        return left


class RocksDBTier(Tier):
    """A persistent tier over a RocksDB database in ``directory``.

    ``directory`` is created when missing or empty: a new, empty tier, since a
    deleted database cannot be told from one never made; a caller that knows the
    tier was made before (a store reopening its table) passes ``create=False``,
    and then a missing or empty directory is :class:`CorruptStoreError`. An
    existing non-empty directory must hold an undamaged RocksDB database (a
    ``CURRENT`` file naming a whole manifest; see the module docstring,
    "Damage"), else :class:`CorruptStoreError`. A database another handle has
    open is :class:`TierIOError` with errno ``EAGAIN``, to retry once it is closed.

    block_cache:  bytes of RocksDB's LRU block cache (uncompressed data blocks).
    write_buffer: bytes of one memtable before it is flushed to an SST file.
    compression:  one of :data:`COMPRESSIONS`; rows of floats compress poorly, so "none".

    Memory: the block cache also holds the SST files' index and filter blocks
    (level-0 ones pinned), so with up to ``MEMTABLES`` memtables RocksDB keeps
    about :meth:`dram_bytes` of DRAM, which ``tune`` charges to its budget.

    ``resident_rows`` is RocksDB's key estimate; ``capacity_rows`` is 0 (unbounded).
    Negative ids raise :class:`IdOutOfRangeError`; every id in ``[0, 2**63)`` is valid.
    """

    kind = "rocksdb"
    persistent = True
    supports_delete = True

    def __init__(self, directory: str | os.PathLike[str], row_bytes: int,
                 block_cache: int = 64 << 20, write_buffer: int = 64 << 20,
                 compression: str = "none", create: bool = True) -> None:
        super().__init__(row_bytes)
        if compression not in COMPRESSIONS:
            raise ConfigError("compression", f"unknown compression {compression!r}; "
                                             f"allowed: {', '.join(COMPRESSIONS)}")
        if int(block_cache) < 0:
            raise ConfigError("block_cache", f"must be >= 0 bytes, got {block_cache}")
        if int(write_buffer) < 64 << 10:
            raise ConfigError("write_buffer", f"must be >= 64 KiB, got {write_buffer}")
        self.path = os.fspath(directory)
        self._zero_row = bytes(self.row_bytes)  # the multi-get default; identity marks "absent"
        self._check_directory(create)
        self._opts = self._options(int(block_cache), int(write_buffer), compression)
        self._failed = False  # a write or WAL sync failed: the handle may hold a sticky background error
        self._backoff = _FullDiskBackoff()
        self._clock: Callable[[], float] = time.monotonic  # of the back-off; tests substitute their own
        try:
            self._db: Any = self._open()
        except Exception as exc:  # noqa: BLE001 - rocksdict raises bare Exception
            # a file the manifest names has vanished since _check_directory ("No such file"): damage too
            if _is_corruption(exc) or "Invalid argument" in str(exc) or "No such file" in str(exc):
                raise CorruptStoreError(f"rocksdb tier: {self.path} is not a readable RocksDB "
                                        f"database: {exc}") from exc
            raise self._error(f"open {self.path}", exc) from exc
        self._write_opts = rocksdict.WriteOptions()
        self._write_opts.no_slowdown = True  # see _write
        self._check_first_row()

    @staticmethod
    def dram_bytes(block_cache: int, write_buffer: int) -> int:
        """DRAM a home with these sizes holds: its block cache (data, index and filter blocks) and its
        memtables at their limit."""
        return int(block_cache) + MEMTABLES * int(write_buffer)

    # -- opening ---------------------------------------------------------------
    def _open(self, read_only: bool = False) -> Any:
        """A new rocksdict handle on the database (raises rocksdict's bare Exception).

        The default column family's options are passed explicitly: without them rocksdict reopens
        an existing database with the options saved in its OPTIONS file (RocksDB's 8 MiB block
        cache, the memtable it was created with, no bloom filter), not the ones configured now.
        """
        extra = {"access_type": rocksdict.AccessType.read_only()} if read_only else {}
        return rocksdict.Rdict(self.path, self._opts, column_families={"default": self._opts}, **extra)

    def _reopen(self, read_only_fallback: bool = True) -> None:
        """Replace the handle by a fresh read-write one, dropping RocksDB's sticky background error.

        The read-write open replays the WAL (and writes it to an SST file), so it
        fails while the disk is still full; then, unless ``read_only_fallback`` is
        off, a read-only handle (which writes nothing) keeps reads working, and
        the open's error is raised for the caller to translate.
        """
        self._release()
        try:
            self._db = self._open()
        except Exception:
            if read_only_fallback:
                with contextlib.suppress(Exception):  # reads then retry the open themselves
                    self._db = self._open(read_only=True)
            raise
        self._failed = False

    def _release(self) -> None:
        """Close the handle, ignoring its errors: a broken handle's close fails (it flushes the
        memtable) yet still unlocks the database, and the WAL holds every write anyway."""
        db, self._db = self._db, None
        if db is not None:
            with contextlib.suppress(Exception):
                db.close()
        del db

    def _check_directory(self, create: bool) -> None:
        """Create a missing directory (unless ``create`` is off); refuse a non-empty one that holds no
        database, or a damaged one."""
        try:
            if create:
                os.makedirs(self.path, exist_ok=True)
            entries = os.listdir(self.path)
        except (FileExistsError, NotADirectoryError) as exc:
            raise CorruptStoreError(f"rocksdb tier: {self.path} is not a directory") from exc
        except FileNotFoundError as exc:
            raise CorruptStoreError(f"rocksdb tier: {self.path} is missing, yet the tier was created "
                                    "before: its database was deleted") from exc
        except OSError as exc:
            raise tier_io_error("rocksdb", f"open {self.path}", exc) from exc
        if not entries and not create:
            raise CorruptStoreError(f"rocksdb tier: {self.path} is empty, yet the tier was created before: "
                                    "its database was deleted")
        if entries and "CURRENT" not in entries:
            raise CorruptStoreError(f"rocksdb tier: {self.path} is not a RocksDB database "
                                    f"(non-empty and no CURRENT file)")
        if entries:
            self._check_manifest()

    def _check_manifest(self) -> None:
        """Refuse a CURRENT that names no manifest, and a missing, empty or truncated manifest, before
        RocksDB opens what it can of it and deletes the SST files it no longer lists."""
        try:
            with open(os.path.join(self.path, "CURRENT"), "rb") as f:
                current = f.read(256)
        except OSError as exc:
            raise tier_io_error("rocksdb", f"read {self.path}/CURRENT", exc) from exc
        if not _CURRENT.fullmatch(current):
            raise CorruptStoreError(f"rocksdb tier: {self.path}/CURRENT is damaged: it should name the "
                                    f"MANIFEST file on one line, it holds {current[:40]!r}")
        manifest = os.path.join(self.path, current.decode().strip())
        try:
            with open(manifest, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                start = (size - 1) // _LOG_BLOCK * _LOG_BLOCK if size else 0
                f.seek(start)
                torn = _torn_record(f.read(_LOG_BLOCK))
        except FileNotFoundError as exc:
            raise CorruptStoreError(f"rocksdb tier: {manifest} is missing (named by "
                                    f"{self.path}/CURRENT): the database's file list is lost") from exc
        except OSError as exc:
            raise tier_io_error("rocksdb", f"read {manifest}", exc) from exc
        if size == 0:
            raise CorruptStoreError(f"rocksdb tier: {manifest} is empty: the database's file list is lost")
        if torn is not None:
            raise CorruptStoreError(f"rocksdb tier: {manifest} is truncated: its record at byte "
                                    f"{start + torn} is cut short by the end of the file ({size} bytes); "
                                    "opening it would drop the SST files its lost records list")

    @staticmethod
    def _options(block_cache: int, write_buffer: int, compression: str) -> Any:
        opts = rocksdict.Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.set_paranoid_checks(True)
        opts.set_write_buffer_size(write_buffer)
        opts.set_max_write_buffer_number(MEMTABLES)
        opts.set_compression_type(getattr(rocksdict.DBCompressionType, compression)())
        table = rocksdict.BlockBasedOptions()
        if block_cache > 0:
            table.set_block_cache(rocksdict.Cache(block_cache))
        else:
            table.disable_cache()
        table.set_bloom_filter(_BLOOM_BITS_PER_KEY, False)
        if block_cache > 0:  # index and filter blocks count against the cache, not beside it
            table.set_cache_index_and_filter_blocks(True)
            table.set_pin_l0_filter_and_index_blocks_in_cache(True)
        opts.set_block_based_table_factory(table)
        return opts

    def _check_first_row(self) -> None:
        """Catch a database written with another row width at open, not at the first read."""
        try:
            it = self._db.iter()
            it.seek_to_first()
            value = it.value() if it.valid() else None
            del it
        except Exception as exc:  # noqa: BLE001
            self._db.close()
            raise self._error("open", exc) from exc
        if value is not None and len(value) != self.row_bytes:
            self._db.close()
            raise CorruptStoreError(f"rocksdb tier: {self.path} holds rows of {len(value)} bytes, "
                                    f"expected row_bytes={self.row_bytes}")

    # -- helpers ---------------------------------------------------------------
    def _error(self, op: str, exc: BaseException) -> Exception:
        if _is_corruption(exc):
            return CorruptStoreError(f"rocksdb tier at {self.path}: {op} found corruption: {exc}")
        if _is_lock_error(exc):
            return TierIOError("rocksdb", op, errno.EAGAIN, f"{self.path} is in use by another open handle "
                                                            f"(a store open in this or another process); "
                                                            f"close that one, then retry ({exc})")
        return tier_io_error("rocksdb", op, exc)

    def _handle(self, op: str, write: bool = False) -> Any:
        """The handle for ``op``: reopened first when it is missing or, for a write, may hold a
        sticky error from an earlier failure (see the module docstring, "Recovery"); a write on a
        disk still full fails fast instead ("Back-off")."""
        if self.closed:
            raise StoreClosedError(f"rocksdb tier at {self.path} is closed")
        if write and self._failed:
            self._check_backoff(op)
        if self._db is None or (write and self._failed):
            try:
                self._reopen()
            except Exception as exc:  # noqa: BLE001
                err = self._error(op, exc)
                if isinstance(err, DiskFullError):
                    self._backoff.failed(self._clock(), _free_bytes(self.path), str(exc))
                raise err from exc
            self._backoff.reset()
        return self._db

    def _check_backoff(self, op: str) -> None:
        """DiskFullError, without a reopen, while the last reopen failed for space too recently."""
        now = self._clock()
        wait = self._backoff.wait(now, _free_bytes(self.path))
        if wait > 0:
            raise DiskFullError("rocksdb", op, errno.ENOSPC,
                                f"the disk holding {self.path} is still full (reopening the database failed "
                                f"{now - self._backoff.failed_at:.2f} s ago: {self._backoff.reason}); "
                                f"free space and retry later: writes try again in {wait:.2f} s, or at once "
                                "when space is freed")

    def _keys(self, ids: Any) -> tuple[Ids, list[bytes]]:
        if self.closed:
            raise StoreClosedError(f"rocksdb tier at {self.path} is closed")
        arr, _ = as_ids(ids)
        if arr.size and int(arr.min()) < 0:
            bad = int(arr[np.argmax(arr < 0)])
            raise IdOutOfRangeError(f"rocksdb tier ids must be >= 0, got {bad}")
        return arr, pack_keys(arr)

    def _multi_get(self, keys: list[bytes], op: str) -> tuple[list[bytes], Mask]:
        zero = self._zero_row
        db = self._handle(op)
        try:
            values = db.get(keys, default=zero)
        except Exception as exc:  # noqa: BLE001
            raise self._error(op, exc) from exc
        n = len(keys)
        found = np.fromiter(map(operator.is_not, values, repeat(zero)), dtype=np.bool_, count=n)
        lengths = np.fromiter(map(len, values), dtype=np.int64, count=n)
        if n and (lengths != self.row_bytes).any():
            bad = int(np.argmax(lengths != self.row_bytes))
            raise CorruptStoreError(f"rocksdb tier at {self.path}: value of key "
                                    f"{int.from_bytes(keys[bad], 'big')} has {int(lengths[bad])} "
                                    f"bytes, expected row_bytes={self.row_bytes}")
        return values, found

    # -- Tier API --------------------------------------------------------------
    def get(self, ids: Ids) -> tuple[RowBytes, Mask]:
        """Rows of ``ids`` (absent rows zero) and the found mask, from one multi-get."""
        _, keys = self._keys(ids)
        values, found = self._multi_get(keys, "get")
        rows = np.frombuffer(bytearray().join(values), dtype=np.uint8).reshape(len(keys), self.row_bytes)
        hits = int(found.sum())
        self.counters.hits += hits
        self.counters.misses += len(keys) - hits
        self.counters.bytes_read += hits * self.row_bytes
        return rows, found

    def contains(self, ids: Ids) -> Mask:
        _, keys = self._keys(ids)
        return self._multi_get(keys, "contains")[1]

    def put(self, ids: Ids, rows: RowBytes) -> None:
        """Insert or overwrite, atomically for the whole batch."""
        arr, keys = self._keys(ids)
        self._check_rows(arr, rows)
        values = np.ascontiguousarray(rows).view(f"V{self.row_bytes}").ravel().tolist()
        # deque(map(...), maxlen=0) drains the map in C: no Python loop per row
        self._write("put", lambda batch: deque(map(batch.put, keys, values), maxlen=0))
        self.counters.bytes_written += len(keys) * self.row_bytes

    def delete(self, ids: Ids) -> None:
        """Remove rows (absent ids are ignored), atomically for the whole batch."""
        _, keys = self._keys(ids)
        self._write("delete", lambda batch: deque(map(batch.delete, keys), maxlen=0))

    def _write(self, op: str, fill: Callable[[Any], object]) -> None:
        """Apply a WriteBatch that ``fill`` populates; wait out a stall, raise a background error.

        A plain blocking write that stalls (memtables full, flush pending) keeps
        waiting even after the background flush fails with ENOSPC: the put would
        hang forever. Writing with ``no_slowdown`` turns a stall into an
        ``Incomplete`` status that we retry with backoff; once RocksDB has recorded
        the background error, the retry returns it and it becomes DiskFullError.
        A written batch is consumed even when the write fails, so each try refills one.
        Any other failure marks the handle for a reopen before the next write.
        """
        delay = _STALL_SLEEP_MIN
        while True:
            batch = rocksdict.WriteBatch(raw_mode=True)
            fill(batch)
            if batch.is_empty():
                return
            db = self._handle(op, write=True)
            try:
                db.write(batch, self._write_opts)
                return
            except Exception as exc:  # noqa: BLE001
                if not str(exc).startswith(_STALL_PREFIX):
                    self._failed = True
                    raise self._error(op, exc) from exc
            time.sleep(delay)
            delay = min(delay * 2, _STALL_SLEEP_MAX)

    def flush(self) -> None:
        """Sync the WAL: every put acknowledged so far survives a crash or power loss."""
        db = self._handle("flush", write=True)
        try:
            db.flush_wal(True)
        except Exception as exc:  # noqa: BLE001
            self._failed = True
            raise self._error("flush", exc) from exc

    def close(self) -> None:
        """Sync the WAL, then release the database (idempotent; released even on error).

        After a failed write the database is reopened first, so a sticky error
        does not fail the sync once space is back; while the disk is still full
        that reopen's error is raised. rocksdict's close also flushes the memtable
        to an SST file to shorten the next open; when that fails (disk full)
        nothing is lost, since the synced WAL already holds every write, so only
        a failed reopen or WAL sync is raised.
        """
        if self.closed:
            return
        self.closed = True
        err: Exception | None = None
        try:
            if self._failed or self._db is None:
                self._reopen(read_only_fallback=False)
            self._db.flush_wal(True)
        except Exception as exc:  # noqa: BLE001
            err = self._error("close", exc)
        self._release()
        if err is not None:
            raise err

    @property
    def raw(self) -> Any:
        """The underlying ``rocksdict.Rdict`` (raw mode), for tools and benchmarks (read-only while a
        full disk keeps the read-write reopen failing)."""
        return self._handle("raw")

    @property
    def resident_rows(self) -> int:
        """RocksDB's estimate of the number of keys (exact counting would cost a read per put)."""
        if self.closed or self._db is None:
            return 0
        try:
            return int(self._db.property_int_value("rocksdb.estimate-num-keys") or 0)
        except Exception:  # noqa: BLE001 - a statistic must not fail a stats() call
            return 0

    def __repr__(self) -> str:
        return f"RocksDBTier({self.path!r}, row_bytes={self.row_bytes})"


__all__ = ["COMPRESSIONS", "RocksDBTier", "pack_keys"]
