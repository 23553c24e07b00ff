"""The ``ssd`` tier: a table's home on an SSD, one slab file read with io_uring and O_DIRECT.

Files in ``directory``::

    rows.slab      fixed-size blocks, no header; sparse until rows are written
    present.bin    header (magic, geometry, count, crc32) + packed presence bits
    present.delta  commits since present.bin: records of (magic, crc32 of the present.bin they
                   follow, count, bytes changed, crc32) + the changed bitmap bytes' offsets
                   (uint32; uint64 past 2**32 bytes) and their new values (uint8)

Layout: rows are packed into 4 KiB pages and a row never straddles a page::

    row_bytes <= 4096:  block = 1 page,  rows_per_block = 4096 // row_bytes
                        row r at byte (r // rpb) * 4096 + (r % rpb) * row_bytes
    row_bytes  > 4096:  block = ceil(row_bytes / 4096) pages, 1 row per block

Every transfer is whole blocks at block-aligned offsets into page-aligned
buffers, which is what O_DIRECT demands; the page cache is bypassed, so what a
get() costs is what the device does.

The I/O engine (io_uring through pyuring's library, driven from numba; the pread
fallback) lives in ``tiers/io_engine.py``.

This module is the ``in_place`` layout. ``layout = "log"`` (``tiers/ssd_log.py``)
subclasses it: same slab, engine and reads, but writes append to free blocks
and a slot map (``slots.bin``) replaces the presence bitmap.

Durability: ``put`` writes blocks in place (read-modify-write for blocks it
does not fully cover and that hold other present rows), then marks presence in
memory. ``flush`` fdatasyncs the slab, then commits the presence bits. Few
changed since the last commit: it appends one record of the changed bitmap
bytes to ``present.delta`` and fdatasyncs it (5 bytes per changed byte: ~5 KB
for 1,000 rows, where rewriting the bitmap cost 12.5 MB per 100M rows on every
flush). Otherwise (the records would outgrow the bitmap), and on open and on
close, it replaces ``present.bin`` atomically (temp file, fsync,
``os.replace``, fsync dir) and then removes ``present.delta``; a failed append
makes the next commit such a rewrite, as nothing may follow a torn record. On
open, records are applied in order while they are whole and name the loaded
``present.bin``'s checksum: a torn or checksum-failing last record is a commit
that never returned; records of another ``present.bin`` (a crash between
replacing it and removing them) are already in it; a damaged record with an
intact one after it is corruption (:class:`CorruptStoreError`). The log layout
frames and folds ``slots.delta`` with the same code. After a SIGKILL every
row present at the last flush is present and readable: the slab held it before
the bitmap (or a record) said so, and a row lives inside one block whose O_DIRECT
write is a single request, so it is either the old or the new version, never torn. Rows
put after the last flush read as absent if they were new. (The buffered
fallback cannot promise untorn rows wider than a page; a crash mid-copy may
leave such a row half written.)

A failed fdatasync of the slab is final. Linux reports a failed writeback
once and marks the pages it could not write clean, so a retried fdatasync
succeeds without them (PostgreSQL's "fsyncgate", 2018; a failed flush of
the device's cache under O_DIRECT is no better). So the tier never syncs or
commits again: every later flush, put, delete and close raises
:class:`TierIOError` (with the failure's errno) saying so, close still
releases the files, and the last good commit stands on disk. Reopening the
store reads that commit back, and its write-ahead log (durable writes)
replays the rows written since. Reads keep working meanwhile, but a row
written since the last good flush may read as older bytes once the kernel
drops the clean pages. A failed commit after a good fdatasync (a delta
append, a present.bin rewrite) is not final: the next flush rewrites the
index into a new file, relying on no page whose sync failed.
"""

from __future__ import annotations

import errno as _errno
import logging
import os
import struct
import threading
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from numba import njit

from embstore.arrays import Ids, Mask, RowBytes, aligned_zeros, as_ids, check_id_range
from embstore.errors import (CorruptStoreError, InvalidRowsError, StoreClosedError,
                             TierIOError, tier_io_error)
from embstore.tiers.base import SyncGuard, Tier
from embstore.tiers.delta import RECORD_HEADER, encode_record, read_records
from embstore.tiers.io_engine import Engine, log_once

log = logging.getLogger(__name__)

SLAB_FILE = "rows.slab"
BITMAP_FILE = "present.bin"
BITMAP_DELTA_FILE = "present.delta"  # presence commits appended since present.bin
LOG_MAP_FILE = "slots.bin"  # the log layout's slot map (tiers/ssd_log.py)
PAGE = 4096
RUN_BYTES = 1 << 20  # largest single request when adjacent blocks are merged
CHUNK_BYTES = 16 << 20  # block buffer per round; bounds memory of huge batches
NO_IO_URING_ENV = "EMBSTORE_NO_IO_URING"

_BITMAP_MAGIC = b"EMBSSD\x00\x01"
# magic, num_rows, row_bytes, block_bytes, present count, crc32 (of header with crc=0, then the bits)
_BITMAP_HEADER = struct.Struct("<8sQQQQI4x")
_BITMAP_DELTA_MAGIC = b"EMBSSDP\x01"


_fdatasync = os.fdatasync  # module-level so fault-injection tests can replace the call
_fsync = os.fsync


# ---------------------------------------------------------------------------
# presence bitmap kernels (packed bits, little bit order like np.packbits(bitorder="little"))
# ---------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def _bits_test(bits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    out = np.empty(ids.shape[0], np.bool_)
    for i in range(ids.shape[0]):
        r = ids[i]
        out[i] = (bits[r >> 3] >> (r & 7)) & 1
    return out


@njit(cache=True, nogil=True)
def _bits_set(bits: np.ndarray, ids: np.ndarray, value: bool, changed: np.ndarray) -> tuple[int, int]:
    """Set or clear the bits of ``ids`` and flag in ``changed`` (one bit per byte of ``bits``) each byte
    whose bit changed, so a commit finds them without a scan of the bitmap; returns (bits changed,
    bytes newly flagged)."""
    n = 0
    fresh = 0
    for i in range(ids.shape[0]):
        r = ids[i]
        b = r >> 3
        m = np.uint8(1 << (r & 7))
        old = bits[b]
        if value:
            if old & m:
                continue
            bits[b] = old | m
        else:
            if not old & m:
                continue
            bits[b] = old & ~m
        n += 1
        f = np.uint8(1 << (b & 7))
        if not changed[b >> 3] & f:
            changed[b >> 3] |= f
            fresh += 1
    return n, fresh


@njit(cache=True, nogil=True)
def _block_present(bits: np.ndarray, blocks: np.ndarray, rpb: int, num_rows: int) -> np.ndarray:
    """Number of present rows in each block."""
    out = np.zeros(blocks.shape[0], np.int64)
    for i in range(blocks.shape[0]):
        lo = blocks[i] * rpb
        hi = min(lo + rpb, num_rows)
        c = 0
        for r in range(lo, hi):
            c += (bits[r >> 3] >> (r & 7)) & 1
        out[i] = c
    return out


@njit(cache=True, nogil=True)
def _block_changed(changed: np.ndarray, blocks: np.ndarray, counts: np.ndarray, rpb: int,
                   num_rows: int) -> np.ndarray:
    """Whether each block holds rows that a put of ``counts`` rows leaves alone and whose presence
    bits (their bitmap bytes, flagged in ``changed``) changed since the last commit. Such a row may be
    absent in memory (deleted) but present in the committed bitmap, which a crash brings back: its
    bytes must survive the block's rewrite, so the block is read first."""
    out = np.zeros(blocks.shape[0], np.bool_)
    for i in range(blocks.shape[0]):
        lo = blocks[i] * rpb
        hi = min(lo + rpb, num_rows)
        if counts[i] >= hi - lo:
            continue  # every row of the block is written
        for b in range(lo >> 3, ((hi - 1) >> 3) + 1):
            if (changed[b >> 3] >> (b & 7)) & 1:
                out[i] = True
                break
    return out


_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)


def _runs(blocks: np.ndarray, positions: np.ndarray, max_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """Group sorted, distinct ``blocks`` into runs that are consecutive both in the file and at
    ``positions`` of the buffer, each at most ``max_blocks`` long.

    Returns (index of each run's first block, blocks per run).
    """
    n = len(blocks)
    brk = np.ones(n, dtype=np.bool_)
    brk[1:] = (np.diff(blocks) != 1) | (np.diff(positions) != 1)
    starts = np.flatnonzero(brk)
    lengths = np.diff(np.append(starts, n))
    if n and lengths.max() > max_blocks:  # cut long runs into pieces of max_blocks
        pos = np.arange(n) - np.repeat(starts, lengths)
        starts = np.flatnonzero(brk | (pos % max_blocks == 0))
        lengths = np.diff(np.append(starts, n))
    return starts, lengths



def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _fsync(fd)
    finally:
        os.close(fd)


class SSDTier(Tier):
    """A persistent, dense tier of ``num_rows`` fixed-size rows in one slab file.

    ``directory`` is created when it holds no tier yet (``present.bin`` is the
    commit record of creation); an existing tier must have the same
    ``num_rows`` and ``row_bytes``, else :class:`CorruptStoreError`.
    ``queue_depth`` requests are kept in flight. ``use_io_uring=False`` (or the
    environment variable ``EMBSTORE_NO_IO_URING=1``) forces the pread/pwrite path.
    """

    kind = "ssd"
    persistent = True
    supports_delete = True
    _commit_file = BITMAP_FILE  # written last at creation: its presence means the tier exists
    _delta_file = BITMAP_DELTA_FILE  # commits appended since _commit_file
    _other_layout = (LOG_MAP_FILE, 'open it with layout = "log"')

    @staticmethod
    def index_bytes(num_rows: int, row_bytes: int) -> int:
        """DRAM of the in-place home's index: one presence bit per row, and one bit per bitmap byte
        that flags the bytes changed since the last commit (what a delta record holds), in 8-byte words."""
        nbytes = (num_rows + 7) // 8
        return nbytes + -(-nbytes // 64) * 8

    def __init__(self, directory: str | os.PathLike[str], num_rows: int, row_bytes: int,
                 queue_depth: int = 64, *, use_io_uring: bool | None = None) -> None:
        super().__init__(row_bytes)
        if num_rows <= 0:
            raise ValueError(f"num_rows must be positive, got {num_rows}")
        if not 1 <= queue_depth <= 4096:
            raise ValueError(f"queue_depth must be in [1, 4096], got {queue_depth}")
        self.num_rows = int(num_rows)
        self.queue_depth = int(queue_depth)
        self.path = Path(directory)
        if self.row_bytes <= PAGE:
            self.rows_per_block = PAGE // self.row_bytes
            self.block_bytes = PAGE
        else:
            self.rows_per_block = 1
            self.block_bytes = -(-self.row_bytes // PAGE) * PAGE
        self.num_blocks = self._slab_blocks(-(-self.num_rows // self.rows_per_block))
        self.slab_bytes = self.num_blocks * self.block_bytes
        self._chunk_blocks = max(1, CHUNK_BYTES // self.block_bytes)
        self._run_blocks = max(1, RUN_BYTES // self.block_bytes)
        self._lock = threading.RLock()
        self._sync = SyncGuard("ssd", self.path / SLAB_FILE)  # a failed fdatasync of the slab is never retried
        self._fd = -1
        self._engine: Engine | None = None
        self._buf: np.ndarray | None = None
        self.direct = False  # True when the slab is open with O_DIRECT
        self._dirty_slab = False
        self._dirty_bits = False
        self._base_crc: int | None = None  # checksum of the committed index file (None: next commit rewrites it)
        self._delta_fd = -1
        self._delta_bytes = 0  # bytes of the records appended to _delta_file since the index file
        self._get_bytes = 0  # device bytes read by get(), for read_amplification
        self._get_useful = 0
        if use_io_uring is None:
            use_io_uring = os.environ.get(NO_IO_URING_ENV, "").strip().lower() in ("", "0", "false", "no", "off")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._open_files()
            self._engine = Engine(self._fd, self.queue_depth, use_io_uring)
        except TierIOError:
            self._release()
            raise
        except OSError as exc:
            self._release()
            raise tier_io_error("ssd", f"open {self.path}", exc) from exc
        except BaseException:
            self._release()
            raise

    # -- files -----------------------------------------------------------------
    def _slab_blocks(self, row_blocks: int) -> int:
        """Blocks in the slab, given the blocks the rows fill (the log layout adds spare blocks)."""
        return row_blocks

    def _open_files(self) -> None:
        """Open the slab and the row index (created on first open; the index file is the commit record)."""
        if (self.path / self._other_layout[0]).exists():
            raise CorruptStoreError(f"ssd tier: {self.path} holds a tier of another layout "
                                    f"({self._other_layout[0]}); {self._other_layout[1]}")
        if (self.path / self._commit_file).exists():
            self._resident = self._load_index()
            self._open_slab(create=False)
        else:
            self._open_slab(create=True)
            self._new_index()
            self._resident = 0
            self._write_index()

    def _new_index(self) -> None:
        self._bits = np.zeros((self.num_rows + 7) // 8, dtype=np.uint8)
        self._clear_changes()

    def _clear_changes(self) -> None:
        """Nothing changed since the last commit: one flag bit per byte of the bitmap, all clear (in
        whole 8-byte words, which a commit scans: 0.4 ms at 100M rows where bytes took 2.6 ms)."""
        self._changed = np.zeros(-(-len(self._bits) // 64) * 8, dtype=np.uint8)
        self._changed_n = 0  # flagged bytes: a delta record's entries

    @property
    def _offset_dtype(self) -> np.dtype:
        """Width of a bitmap byte offset in present.delta (fixed by the geometry)."""
        return np.dtype("<u4" if (self.num_rows + 7) // 8 <= 2**32 else "<u8")

    def _load_index(self) -> int:
        """present.bin, then the commits of present.delta that follow it; these are folded into a new
        present.bin right away (new records must not land behind a torn one)."""
        bits, count, crc = self._load_bitmap()
        path = self.path / self._delta_file
        data = self._read_delta_file()
        width = self._offset_dtype
        records, resident = read_records(data, _BITMAP_DELTA_MAGIC, width.itemsize + 1, crc, path)
        for n, body in records:
            offs = np.frombuffer(body, width, n)
            if n and int(offs.max()) >= len(bits):
                raise CorruptStoreError(f"ssd tier: {path} changes bytes beyond the bitmap of "
                                        f"{self.num_rows} rows")
            bits[offs] = np.frombuffer(body, np.uint8, n, n * width.itemsize)
        if records:
            count = self._count_bits(bits, resident, f"{self.path / BITMAP_FILE} (with {len(records)} "
                                                      f"commits of {self._delta_file})")
        self._bits = bits
        self._clear_changes()
        self._base_crc = crc
        if data:
            self._resident = count
            self._fold_on_open(self._write_bitmap)
        return count

    def _open_slab(self, create: bool) -> None:
        path = self.path / SLAB_FILE
        flags = os.O_RDWR | os.O_CLOEXEC
        if create:
            flags |= os.O_CREAT
        elif not path.exists():
            raise CorruptStoreError(f"ssd tier: {path} is missing while {self.path / self._commit_file} exists")
        try:
            self._fd = os.open(path, flags | os.O_DIRECT, 0o644)
            self.direct = True
        except OSError as exc:
            if exc.errno != _errno.EINVAL:
                raise
            log_once(log, "no-o_direct", "ssd tier: %s refuses O_DIRECT; using buffered I/O", path.parent)
            self._fd = os.open(path, flags, 0o644)
            self.direct = False
        if create:
            # leftovers of an interrupted creation hold nothing; the file stays sparse
            os.ftruncate(self._fd, 0)
            os.ftruncate(self._fd, self.slab_bytes)
            _fsync(self._fd)
            _fsync_dir(self.path)
        else:
            size = os.fstat(self._fd).st_size
            if size != self.slab_bytes:
                raise CorruptStoreError(f"ssd tier: {path} has {size} bytes, expected {self.slab_bytes} "
                                        f"({self.num_rows} rows of {self.row_bytes} bytes)")

    def _header(self, resident: int, crc: int) -> bytes:
        return _BITMAP_HEADER.pack(_BITMAP_MAGIC, self.num_rows, self.row_bytes, self.block_bytes, resident, crc)

    def _load_bitmap(self) -> tuple[np.ndarray, int, int]:
        path = self.path / BITMAP_FILE
        data = path.read_bytes()
        nbytes = (self.num_rows + 7) // 8
        if len(data) < _BITMAP_HEADER.size:
            raise CorruptStoreError(f"ssd tier: {path} is truncated ({len(data)} bytes)")
        magic, num_rows, row_bytes, block_bytes, resident, crc = _BITMAP_HEADER.unpack_from(data)
        if magic != _BITMAP_MAGIC:
            raise CorruptStoreError(f"ssd tier: {path} is not a presence bitmap (bad magic)")
        if (num_rows, row_bytes, block_bytes) != (self.num_rows, self.row_bytes, self.block_bytes):
            raise CorruptStoreError(f"ssd tier: {self.path} holds num_rows={num_rows}, row_bytes={row_bytes}; "
                                    f"opened with num_rows={self.num_rows}, row_bytes={self.row_bytes}")
        if len(data) != _BITMAP_HEADER.size + nbytes:
            raise CorruptStoreError(f"ssd tier: {path} has {len(data)} bytes, expected "
                                    f"{_BITMAP_HEADER.size + nbytes}")
        body = memoryview(data)[_BITMAP_HEADER.size:]
        if zlib.crc32(body, zlib.crc32(self._header(resident, 0))) != crc:
            raise CorruptStoreError(f"ssd tier: {path} fails its checksum")
        bits = np.frombuffer(body, dtype=np.uint8).copy()
        return bits, self._count_bits(bits, resident, str(path)), crc

    def _count_bits(self, bits: np.ndarray, resident: int, what: str) -> int:
        """The rows ``bits`` marks, checked against the stored count and num_rows."""
        if self.num_rows % 8 and bits[-1] >> (self.num_rows % 8):
            raise CorruptStoreError(f"ssd tier: {what} marks rows beyond num_rows={self.num_rows}")
        count = int(_POPCOUNT[bits].sum(dtype=np.int64))
        if count != resident:
            raise CorruptStoreError(f"ssd tier: {what} counts {resident} rows but marks {count}")
        return count

    def _write_index(self) -> None:
        """Commit the presence bits: a record of the bitmap bytes changed since the last commit, or the
        whole bitmap when none is committed yet (creation, a failed append, close) or when the records
        would outgrow it (opening would read more than the bitmap)."""
        n = self._changed_n
        if self._base_crc is not None and n == 0:
            return  # only rows already present were rewritten
        width = self._offset_dtype
        if self._base_crc is None or self._delta_bytes + RECORD_HEADER.size + n * (width.itemsize + 1) > \
                self._bits.nbytes:
            self._write_bitmap()
            return
        words = np.flatnonzero(self._changed.view(np.uint64))
        flagged = (words[:, None] * 8 + np.arange(8)).ravel()
        flagged = flagged[self._changed[flagged] != 0]
        flags = np.unpackbits(self._changed[flagged], bitorder="little").reshape(-1, 8).view(np.bool_)
        offs = ((flagged[:, None] << 3) + np.arange(8))[flags]  # bitmap bytes changed: sorted, distinct
        body = offs.astype(width).tobytes() + self._bits[offs].tobytes()
        self._append_delta(encode_record(_BITMAP_DELTA_MAGIC, self._base_crc, self._resident, len(offs), body))
        self._changed[flagged] = 0
        self._changed_n = 0

    def _write_bitmap(self) -> None:
        """Replace present.bin with the whole bitmap (and drop present.delta)."""
        body = self._bits.data
        crc = zlib.crc32(body, zlib.crc32(self._header(self._resident, 0)))
        self._replace_index((self._header(self._resident, crc), body), crc)
        self._clear_changes()

    # -- delta records (shared with the log layout) --------------------------------------
    def _read_delta_file(self) -> bytes:
        try:
            return (self.path / self._delta_file).read_bytes()
        except FileNotFoundError:
            return b""

    def _fold_on_open(self, rewrite: Any) -> None:
        """Rewrite the index file with the records folded in, so that new records never land behind a
        torn one. Where that fails (a full or read-only disk) the tier opens all the same and its next
        commit is the rewrite."""
        try:
            rewrite()
        except OSError as exc:
            log.warning("ssd tier: cannot fold %s into %s at open (%s); the next flush rewrites it",
                        self._delta_file, self._commit_file, exc)
            self._base_crc = None

    def _replace_index(self, parts: tuple[bytes | memoryview, ...], crc: int) -> None:
        """Replace the index file whole, then drop the delta records: they name the old file's
        checksum, so a crash between the two leaves them ignored. Until they are gone no record is
        appended (it would land behind them)."""
        self._replace_file(self._commit_file, parts)  # on failure the old file and its records stand
        self._base_crc = None
        if self._delta_fd >= 0:
            os.close(self._delta_fd)
            self._delta_fd = -1
        if self._delta_bytes or (self.path / self._delta_file).exists():
            (self.path / self._delta_file).unlink(missing_ok=True)
        self._delta_bytes = 0
        self._base_crc = crc

    def _append_delta(self, record: bytes) -> None:
        """Append one commit record and make it durable. A failure may leave part of it in the file, where
        a later record would be unreadable behind it: the next commit then rewrites the whole index."""
        try:
            if self._delta_fd < 0:
                self._delta_fd = os.open(self.path / self._delta_file,
                                         os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
                _fsync_dir(self.path)
            view = memoryview(record)
            while view:
                view = view[os.write(self._delta_fd, view):]
            _fdatasync(self._delta_fd)
        except OSError:
            self._base_crc = None
            raise
        self._delta_bytes += len(record)

    def _replace_file(self, name: str, parts: tuple[bytes | memoryview, ...]) -> None:
        """Atomically replace ``name``: temp file, fsync, os.replace, fsync the directory."""
        final = self.path / name
        tmp = self.path / (name + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                for part in parts:
                    view = memoryview(part).cast("B")
                    while view:
                        view = view[os.write(fd, view):]
                _fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
            _fsync_dir(self.path)
        except OSError:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            raise

    # -- helpers ---------------------------------------------------------------
    def _check_open(self) -> Engine:
        if self.closed or self._engine is None:
            raise StoreClosedError(f"ssd tier at {self.path} is closed")
        return self._engine

    def _ids(self, ids: Any) -> Ids:
        arr, _ = as_ids(ids)
        check_id_range(arr, self.num_rows, "ssd tier")
        return arr

    def _check_rows(self, ids: Ids, rows: Any) -> None:
        if not isinstance(rows, np.ndarray) or rows.dtype != np.uint8 or rows.shape != (len(ids), self.row_bytes):
            shape = getattr(rows, "shape", None)
            raise InvalidRowsError(f"ssd tier expects uint8 rows of shape ({len(ids)}, {self.row_bytes}), "
                                   f"got {getattr(rows, 'dtype', type(rows).__name__)} {shape}")

    def _buffer(self, nblocks: int) -> np.ndarray:
        """The tier's reusable page-aligned block buffer, as (nblocks, block_bytes)."""
        need = nblocks * self.block_bytes
        if self._buf is None or len(self._buf) < need:
            self._buf = aligned_zeros((max(need, PAGE),), np.uint8, PAGE)  # O_DIRECT needs aligned memory
        return self._buf[:need].reshape(nblocks, self.block_bytes)

    def _slots(self, view: np.ndarray) -> np.ndarray:
        """(nblocks, rows_per_block, row_bytes) view of a block buffer."""
        rpb, rb = self.rows_per_block, self.row_bytes
        return view[:, :rpb * rb].reshape(view.shape[0], rpb, rb)

    def _io(self, write: bool, blocks: np.ndarray, positions: np.ndarray, view: np.ndarray) -> None:
        """Transfer ``blocks`` (sorted, distinct) to/from rows ``positions`` of ``view``, merging runs."""
        if len(blocks) == 0:
            return
        starts, lengths = _runs(blocks, positions, self._run_blocks)
        bb = self.block_bytes
        offs = blocks[starts].astype(np.int64) * bb
        base = np.uint64(view.ctypes.data)
        addrs = base + positions[starts].astype(np.uint64) * np.uint64(bb)
        lens = (lengths * bb).astype(np.int64)
        self._engine.run(write, offs, addrs, lens)  # type: ignore[union-attr]

    # -- Tier API ----------------------------------------------------------------
    def get(self, ids: Ids) -> tuple[RowBytes, Mask]:
        with self._lock:
            self._check_open()
            ids = self._ids(ids)
            n = len(ids)
            out = np.zeros((n, self.row_bytes), dtype=np.uint8)
            slots, found = self._locate(ids)
            sel = np.flatnonzero(found)
            hits = len(sel)
            if hits:
                self._read_rows(slots[sel], sel, out)
            self.counters.hits += hits
            self.counters.misses += n - hits
            return out, found

    def _locate(self, ids: Ids) -> tuple[np.ndarray, Mask]:
        """(slab slot of each id, found); in place, a row's slot is its id."""
        return ids, _bits_test(self._bits, ids) if len(ids) else np.zeros(0, np.bool_)

    def _read_rows(self, rid: np.ndarray, sel: np.ndarray, out: np.ndarray) -> None:
        """out[sel] = the rows in slots ``rid``: read their distinct blocks, gather the rows out."""
        blk = rid // self.rows_per_block
        ublk, inv = np.unique(blk, return_inverse=True)
        slot = rid - blk * self.rows_per_block
        c = self._chunk_blocks
        for c0 in range(0, len(ublk), c):
            chunk = ublk[c0:c0 + c]
            view = self._buffer(len(chunk))
            try:
                self._io(False, chunk, np.arange(len(chunk)), view)
            except OSError as exc:
                raise tier_io_error("ssd", "read", exc) from exc
            nbytes = len(chunk) * self.block_bytes
            self.counters.bytes_read += nbytes
            self._get_bytes += nbytes
            m = slice(None) if len(ublk) <= c else (inv >= c0) & (inv < c0 + c)
            out[sel[m]] = self._slots(view)[inv[m] - c0, slot[m]]
        self._get_useful += len(rid) * self.row_bytes

    def put(self, ids: Ids, rows: RowBytes) -> None:
        with self._lock:
            self._check_open()
            self._sync.check("write")
            ids = self._ids(ids)
            self._check_rows(ids, rows)
            if len(ids):
                self._write(ids, rows)

    def _write(self, ids: Ids, rows: RowBytes) -> None:
        """Write rows into their own slots, block by block (read-modify-write where a block keeps others)."""
        rpb = self.rows_per_block
        order = np.argsort(ids, kind="stable")  # sorted ids sort their blocks too
        ids = ids[order]
        last = np.ones(len(ids), np.bool_)
        last[:-1] = ids[1:] != ids[:-1]
        if not last.all():  # a repeated id would count twice as overwritten and skip a needed read:
            order, ids = order[last], ids[last]  # keep its last write (the sort is stable)
        blk = ids // rpb
        rows = rows[order]
        ublk, first, counts = np.unique(blk, return_index=True, return_counts=True)
        slot = ids - blk * rpb
        c = self._chunk_blocks
        for c0 in range(0, len(ublk), c):
            chunk = ublk[c0:c0 + c]
            lo = first[c0]
            hi = first[c0 + len(chunk)] if c0 + len(chunk) < len(ublk) else len(ids)
            self._put_chunk(chunk, counts[c0:c0 + len(chunk)], ids[lo:hi], slot[lo:hi],
                            blk[lo:hi], rows[lo:hi])

    def _put_chunk(self, chunk: np.ndarray, counts: np.ndarray, ids: np.ndarray, slot: np.ndarray,
                   blk: np.ndarray, rows: np.ndarray) -> None:
        """Write the blocks of one chunk: read those holding other present rows (present now or at the
        last commit), overlay, write back."""
        view = self._buffer(len(chunk))
        pos = np.searchsorted(chunk, blk)
        present = _block_present(self._bits, chunk, self.rows_per_block, self.num_rows)
        overwritten = np.bincount(pos, weights=_bits_test(self._bits, ids), minlength=len(chunk))
        need_read = present > overwritten  # some present row of the block is not being replaced
        if self._changed_n:
            need_read |= _block_changed(self._changed, chunk, counts, self.rows_per_block, self.num_rows)
        read_pos = np.flatnonzero(need_read)
        try:
            self._io(False, chunk[read_pos], read_pos, view)
        except OSError as exc:
            raise tier_io_error("ssd", "read", exc) from exc
        self.counters.bytes_read += len(read_pos) * self.block_bytes
        if len(read_pos) < len(chunk):
            view[~need_read] = 0
        self._slots(view)[pos, slot] = rows
        self._dirty_slab = True
        try:
            self._io(True, chunk, np.arange(len(chunk)), view)
        except OSError as exc:
            raise tier_io_error("ssd", "write", exc) from exc
        self.counters.bytes_written += len(chunk) * self.block_bytes
        self._mark(ids, True)

    def _mark(self, ids: np.ndarray, present: bool) -> None:
        """Set or clear presence in memory, flagging the bitmap bytes the next commit must carry."""
        n, fresh = _bits_set(self._bits, ids, present, self._changed)
        self._resident += n if present else -n
        self._changed_n += fresh
        if n:
            self._dirty_bits = True

    def contains(self, ids: Ids) -> Mask:
        with self._lock:
            self._check_open()
            return self._locate(self._ids(ids))[1]

    def delete(self, ids: Ids) -> None:
        """Mark rows absent (durable at the next flush); their bytes stay in the slab, unread."""
        with self._lock:
            self._check_open()
            self._sync.check("delete")
            ids = self._ids(ids)
            if len(ids):
                self._mark(ids, False)

    def flush(self) -> None:
        """fdatasync the slab, then commit the index. A failed fdatasync is final (see the module
        docstring); a failed commit is retried by the next flush, which rewrites the index file whole."""
        with self._lock:
            self._check_open()
            self._sync.check("flush")
            if self._dirty_slab:
                try:
                    _fdatasync(self._fd)
                except OSError as exc:
                    raise self._sync.failed("flush", exc) from exc
                self._dirty_slab = False
            if self._dirty_bits:
                try:
                    self._write_index()
                except OSError as exc:
                    raise tier_io_error("ssd", "flush", exc) from exc
                self._dirty_bits = False

    def close(self) -> None:
        """Flush with the delta records folded into the index file (a tier closed cleanly is one index
        file), then release the files and the ring (released even when the flush fails). After a failed
        fdatasync nothing is committed and close raises: the last good commit stands."""
        with self._lock:
            if self.closed:
                return
            try:
                self._sync.check("close")
                if self._delta_bytes or self._dirty_bits:
                    self._base_crc = None
                    self._dirty_bits = True
                if self._engine is not None:
                    self.flush()
            finally:
                self._release()
                self.closed = True

    def _release(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._delta_fd >= 0:
            os.close(self._delta_fd)
            self._delta_fd = -1
        self._buf = None

    def __enter__(self) -> "SSDTier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- figures -------------------------------------------------------------------
    @property
    def io_engine(self) -> str:
        """``"io_uring"`` or ``"pread"``, plus ``"+direct"`` when the slab bypasses the page cache."""
        eng = self._engine
        name = "io_uring" if eng is not None and eng.io_uring else "pread"
        return name + ("+direct" if getattr(self, "direct", False) else "")

    @property
    def read_amplification(self) -> float:
        """Device bytes read by get() per useful row byte returned (block_bytes/row_bytes at worst)."""
        return self._get_bytes / self._get_useful if self._get_useful else 0.0

    @property
    def resident_rows(self) -> int:
        return self._resident

    @property
    def capacity_rows(self) -> int:
        return self.num_rows
