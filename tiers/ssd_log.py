"""The ``ssd`` tier's log layout (``layout = "log"``): written rows go to free blocks, never in place.

Why: a row much smaller than its 4 KiB block, written in place, costs a
read-modify-write of that block (read it, patch one row, write it: two I/Os
per row, since evicted rows rarely share a block). Training writes back every
row it evicts, so in the steady state that doubled the tier's I/O. Here a
batch of ``n`` rows is packed into ``ceil(n / rows_per_block)`` free blocks and
written whole, with no read; a slot map in memory says where each row lives.

Costs, paid for it:

- DRAM: the slot map, 4 bytes per row (int32; int64 past 2**31 slots), where
  the in-place layout keeps one presence bit per row.
- Disk: the slab has 25% more blocks than the rows fill (at least 64), so
  free blocks remain. When writes have used them up, a greedy cleaner picks
  the blocks with the fewest live rows, reads them and appends their live
  rows elsewhere (LFS's cleaner, Rosenblum & Ousterhout 1992). The emptied
  blocks become free at the next commit of the slot map.
- A commit (flush) appends the slots of the rows that moved since the last
  one to ``slots.delta`` (16 bytes per moved row); the whole map (4 bytes per
  row) is rewritten only when the deltas have grown as large as it, on open
  and on close. Rewriting it on every flush cost 4 MB per 1M rows however few moved.

Files in ``directory``::

    rows.slab    num_blocks blocks of rows_per_block slots; sparse until written
    slots.bin    header (magic, geometry, slot width, count, crc32) + one slot per row (-1: absent)
    slots.delta  commits since slots.bin: records of (magic, crc32 of the slots.bin they follow,
                 count, rows moved, crc32) + their row ids and slots (int64)

Durability: a block that the committed map (``slots.bin`` plus the delta
records that follow it) references is never written. A block emptied since
the last commit waits in limbo until the next commit, which no longer
references it. flush() fdatasyncs the slab, then appends a delta record and
fdatasyncs it (or replaces ``slots.bin`` atomically, then removes the deltas).
On open, records are applied while they are whole and name the loaded
``slots.bin``'s checksum: a torn last record is a commit that never returned;
records of an older ``slots.bin`` (a crash between rewriting the map and
removing them) are already in it; a damaged record with an intact one after it
is corruption (the framing and this fold are shared with the in-place layout's
``present.delta``, in ``tiers/ssd.py``). After a SIGKILL, every row reads as of the
last flush and is never torn: its block was written whole, and made durable,
before a committed map pointed at it. Rows written after the last flush read
as their flushed version (or as absent if they were new). A failed fdatasync
of the slab is final, as in the in-place layout (``tiers/ssd.py``): the tier
then refuses flushes (also those a put runs to free blocks), writes and a
clean close until it is reopened; the committed map never points at the
blocks whose writeback failed.
"""

from __future__ import annotations

import errno
import struct
import zlib

import numpy as np
from numba import njit

from embstore.arrays import Ids, Mask, RowBytes
from embstore.errors import CorruptStoreError, DiskFullError, tier_io_error
from embstore.tiers.delta import RECORD_HEADER, encode_record, read_records
from embstore.tiers.ssd import BITMAP_FILE, LOG_MAP_FILE, PAGE, SSDTier

SPARE_SHARE = 0.25  # spare blocks, as a share of the blocks the rows fill
MIN_SPARE_BLOCKS = 64
MAX_CLEAN_BLOCKS = 8192  # blocks one cleaning round reads at most: a round must not stall a look-ahead window

_MAP_MAGIC = b"EMBSSDL\x01"
# magic, num_rows, row_bytes, block_bytes, num_blocks, slot itemsize, resident count, crc32
_MAP_HEADER = struct.Struct("<8sQQQQQQI4x")
LOG_DELTA_FILE = "slots.delta"
_DELTA_MAGIC = b"EMBSSDD\x01"
# a record's entries (framed and read by tiers/delta.py): the moved rows' ids, then their slots, int64 each
_DELTA_ENTRY_BYTES = 16


@njit(cache=True, nogil=True)
def _repoint(slot_of: np.ndarray, live: np.ndarray, ids: np.ndarray, new_slots: np.ndarray,
             rpb: int) -> tuple[int, np.ndarray]:
    """Point ``ids`` at ``new_slots`` (-1: absent); returns (change in present rows, blocks this left
    without a live row)."""
    emptied = np.empty(ids.shape[0], np.int64)
    k = 0
    delta = 0
    for i in range(ids.shape[0]):
        r = ids[i]
        old = slot_of[r]
        if old >= 0:
            delta -= 1
            b = old // rpb
            live[b] -= 1
            if live[b] == 0:
                emptied[k] = b
                k += 1
        s = new_slots[i]
        slot_of[r] = s
        if s >= 0:
            delta += 1
            live[s // rpb] += 1
    return delta, emptied[:k]


@njit(cache=True, nogil=True)
def _live_rows_in(slot_of: np.ndarray, marked: np.ndarray, rpb: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, slots) of the rows living in the blocks flagged in ``marked``: one pass over the map."""
    n = 0
    for r in range(slot_of.shape[0]):
        s = slot_of[r]
        if s >= 0 and marked[s // rpb]:
            n += 1
    ids = np.empty(n, np.int64)
    slots = np.empty(n, np.int64)
    k = 0
    for r in range(slot_of.shape[0]):
        s = slot_of[r]
        if s >= 0 and marked[s // rpb]:
            ids[k] = r
            slots[k] = s
            k += 1
    return ids, slots


@njit(cache=True, nogil=True)
def _map_errors(slot_of: np.ndarray, num_slots: int) -> tuple[int, int]:
    """(present rows, first row whose slot is out of range or shared with an earlier row; -1 if none)."""
    seen = np.zeros((num_slots + 7) // 8, np.uint8)
    present = 0
    for r in range(slot_of.shape[0]):
        s = slot_of[r]
        if s < 0:
            if s != -1:
                return present, r
            continue
        if s >= num_slots or (seen[s >> 3] >> (s & 7)) & 1:
            return present, r
        seen[s >> 3] |= np.uint8(1 << (s & 7))
        present += 1
    return present, -1


def _last_writes(ids: Ids, rows: RowBytes) -> tuple[Ids, RowBytes]:
    """Drop all but the last write of an id repeated within one call (the tier contract allows relying
    on unique ids; this keeps a direct caller's repeated ids from corrupting the live counts)."""
    order = np.argsort(ids, kind="stable")
    s = ids[order]
    keep = np.ones(len(s), np.bool_)
    keep[:-1] = s[1:] != s[:-1]
    if keep.all():
        return ids, rows
    sel = order[keep]
    return ids[sel], rows[sel]


class LogSSDTier(SSDTier):
    """An ``ssd`` home whose writes append to free blocks (see the module docstring for why).

    Same contract, files apart, as :class:`SSDTier`; ``spare_blocks``,
    ``cleaned_blocks`` and ``moved_rows`` report the log's state.
    """

    _commit_file = LOG_MAP_FILE
    _delta_file = LOG_DELTA_FILE
    _other_layout = (BITMAP_FILE, 'it is in place: open it without layout = "log"')

    @staticmethod
    def index_bytes(num_rows: int, row_bytes: int) -> int:
        """DRAM of a new log home's index: a slot per row, a live count and a free-list entry per block."""
        rpb = max(1, PAGE // row_bytes)
        row_blocks = -(-num_rows // rpb)
        blocks = row_blocks + max(int(row_blocks * SPARE_SHARE), MIN_SPARE_BLOCKS)
        slot = 4 if blocks * rpb < 2**31 else 8
        return slot * num_rows + (4 + 8) * blocks

    def _slab_blocks(self, row_blocks: int) -> int:
        """The rows' blocks plus spare ones: as many as an existing slab was created with (its slot map
        says), so a later change of SPARE_SHARE still opens it; else SPARE_SHARE of them."""
        total = row_blocks + max(int(row_blocks * SPARE_SHARE), MIN_SPARE_BLOCKS)
        try:
            with open(self.path / LOG_MAP_FILE, "rb") as f:
                head = f.read(_MAP_HEADER.size)
            if len(head) == _MAP_HEADER.size and head[:8] == _MAP_MAGIC:
                stored = _MAP_HEADER.unpack(head)[4]
                total = stored if stored > row_blocks else total  # a damaged header is reported by the load
        except OSError:  # none yet (a new tier); an unreadable one is reported, typed, by the load
            pass
        self.spare_blocks = total - row_blocks
        return total

    # -- files -------------------------------------------------------------------
    def _open_files(self) -> None:
        rpb = self.rows_per_block
        num_slots = self.num_blocks * rpb
        self._slot_dtype = np.dtype(np.int32 if num_slots < 2**31 else np.int64)
        # regular writes leave half the spare blocks to the cleaner, which needs room to move rows into
        self._reserve = self.spare_blocks // 2
        self._piece_blocks = max(1, min(self._chunk_blocks, self.spare_blocks // 4))
        # enough victims to gain a block even when each is nearly full (2 * rpb), else a quarter of the spare
        self._clean_blocks = max(self._piece_blocks, 2 * rpb, min(self.spare_blocks // 4, MAX_CLEAN_BLOCKS))
        self._limbo: list[np.ndarray] = []
        self._moved: list[np.ndarray] = []  # rows whose slot changed since the last commit
        self.cleaned_blocks = 0  # blocks the cleaner emptied
        self.moved_rows = 0  # live rows it rewrote to do so (its write cost)
        super()._open_files()
        present = self._slot_of[self._slot_of >= 0]
        self._live = np.bincount(present // rpb, minlength=self.num_blocks).astype(np.int32)
        self._free = np.flatnonzero(self._live == 0).astype(np.int64)  # sorted; taken from the front
        self._free_head = 0

    def _map_header(self, resident: int, crc: int) -> bytes:
        return _MAP_HEADER.pack(_MAP_MAGIC, self.num_rows, self.row_bytes, self.block_bytes, self.num_blocks,
                                self._slot_dtype.itemsize, resident, crc)

    def _new_index(self) -> None:
        self._slot_of = np.full(self.num_rows, -1, self._slot_dtype)

    def _load_index(self) -> int:
        """Read and check slots.bin into the slot map; returns the present rows."""
        path = self.path / LOG_MAP_FILE
        data = path.read_bytes()
        if len(data) < _MAP_HEADER.size:
            raise CorruptStoreError(f"ssd tier: {path} is truncated ({len(data)} bytes)")
        magic, num_rows, row_bytes, block_bytes, num_blocks, width, resident, crc = _MAP_HEADER.unpack_from(data)
        if magic != _MAP_MAGIC:
            raise CorruptStoreError(f"ssd tier: {path} is not a slot map (bad magic)")
        if (num_rows, row_bytes, block_bytes, num_blocks) != (self.num_rows, self.row_bytes, self.block_bytes,
                                                              self.num_blocks):
            raise CorruptStoreError(f"ssd tier: {self.path} holds num_rows={num_rows}, row_bytes={row_bytes}; "
                                    f"opened with num_rows={self.num_rows}, row_bytes={self.row_bytes}")
        if width != self._slot_dtype.itemsize or len(data) != _MAP_HEADER.size + num_rows * width:
            raise CorruptStoreError(f"ssd tier: {path} has {len(data)} bytes, expected "
                                    f"{_MAP_HEADER.size + self.num_rows * self._slot_dtype.itemsize}")
        body = memoryview(data)[_MAP_HEADER.size:]
        if zlib.crc32(body, zlib.crc32(self._map_header(resident, 0))) != crc:
            raise CorruptStoreError(f"ssd tier: {path} fails its checksum")
        slot_of = np.frombuffer(body, dtype=self._slot_dtype.newbyteorder("<")).astype(self._slot_dtype)
        delta_path = self.path / LOG_DELTA_FILE
        num_slots = self.num_blocks * self.rows_per_block
        deltas = self._read_delta_file()
        records, last = read_records(deltas, _DELTA_MAGIC, _DELTA_ENTRY_BYTES, crc, delta_path)
        for n, record in records:
            ids = np.frombuffer(record, "<i8", n).astype(np.int64)
            if len(ids) and (ids.min() < 0 or ids.max() >= self.num_rows):
                raise CorruptStoreError(f"ssd tier: {delta_path} moves rows outside num_rows={self.num_rows}")
            slots = np.frombuffer(record, "<i8", n, 8 * n)
            if len(slots) and (slots.min() < -1 or slots.max() >= num_slots):  # would wrap in an int32 map
                raise CorruptStoreError(f"ssd tier: {delta_path} moves rows to slots outside the slab's "
                                        f"{num_slots}")
            slot_of[ids] = slots
        resident = resident if last is None else last
        count, bad = _map_errors(slot_of, num_slots)
        if bad >= 0:
            raise CorruptStoreError(f"ssd tier: {path} (with {len(records)} commits of {LOG_DELTA_FILE}) gives "
                                    f"row {bad} an invalid or shared slot")
        if count != resident:
            raise CorruptStoreError(f"ssd tier: {path} (with {len(records)} commits of {LOG_DELTA_FILE}) counts "
                                    f"{resident} rows but maps {count}")
        self._slot_of = slot_of
        self._base_crc = crc
        if deltas:  # fold them in now: new records must not land behind a torn one
            self._resident = count
            self._fold_on_open(self._write_full_map)
        return count

    def _write_index(self) -> None:
        """Commit the slot map (a delta record of the rows moved since the last commit, or the whole map
        once the deltas would outgrow it); blocks emptied before it are free from now on."""
        # not deduplicated (a sort of up to a cleaning round's 500k rows per commit): a row moved twice
        # appears twice with the same, current slot
        moved = np.concatenate(self._moved) if self._moved else np.empty(0, np.int64)
        record_bytes = RECORD_HEADER.size + _DELTA_ENTRY_BYTES * len(moved)
        if self._base_crc is None or self._delta_bytes + record_bytes > self._slot_of.nbytes:
            self._write_full_map()
        else:
            body = np.ascontiguousarray(moved, "<i8").tobytes() + self._slot_of[moved].astype("<i8").tobytes()
            self._append_delta(encode_record(_DELTA_MAGIC, self._base_crc, self._resident, len(moved), body))
        self._moved = []
        if self._limbo:  # limbo blocks hold no live row and are never written before this commit
            # limbo blocks held live rows until this window, so none is free already: a sorted insert
            # (a copy of the free list) instead of union1d, whose hashing cost 30 ms per commit at 10M rows
            rest = self._free[self._free_head:]
            emptied = np.sort(np.concatenate(self._limbo))  # each block once: emptied blocks get no rows
            self._free = np.insert(rest, np.searchsorted(rest, emptied), emptied)
            self._free_head = 0
            self._limbo = []

    def _write_full_map(self) -> None:
        """Replace slots.bin with the whole map, then drop the deltas (SSDTier._replace_index)."""
        body = self._slot_of.astype(self._slot_dtype.newbyteorder("<"), copy=False).data
        crc = zlib.crc32(body, zlib.crc32(self._map_header(self._resident, 0)))
        self._replace_index((self._map_header(self._resident, crc), body), crc)

    # -- Tier API ----------------------------------------------------------------
    def _locate(self, ids: Ids) -> tuple[np.ndarray, Mask]:
        slots = self._slot_of[ids].astype(np.int64)
        return slots, slots >= 0

    def _write(self, ids: Ids, rows: RowBytes) -> None:
        self._append(*_last_writes(ids, rows), cleaning=False)

    def delete(self, ids: Ids) -> None:
        """Mark rows absent (durable at the next flush); their slots are reclaimed like overwritten ones."""
        with self._lock:
            self._check_open()
            self._sync.check("delete")
            ids = self._ids(ids)
            if len(ids):
                delta, emptied = _repoint(self._slot_of, self._live, ids, np.full(len(ids), -1, np.int64),
                                          self.rows_per_block)
                self._moved.append(np.asarray(ids, np.int64))
                self._resident += delta
                self._limbo.append(emptied)
                self._dirty_bits = True

    # -- the log -----------------------------------------------------------------
    def _available(self) -> int:
        return len(self._free) - self._free_head

    def _append(self, ids: np.ndarray, rows: np.ndarray, cleaning: bool) -> None:
        """Write ``rows`` (unique ``ids``) into free blocks, a piece of at most ``_piece_blocks`` at a time."""
        step = self._piece_blocks * self.rows_per_block
        for lo in range(0, len(ids), step):
            self._append_piece(ids[lo:lo + step], rows[lo:lo + step], cleaning)

    def _append_piece(self, ids: np.ndarray, rows: np.ndarray, cleaning: bool) -> None:
        """Write whole free blocks, no reads, then repoint the map; the cleaner's moves skip the reserve."""
        rpb = self.rows_per_block
        need = -(-len(ids) // rpb)
        if not cleaning:
            self._make_room(need + self._reserve)
        if self._available() < need:  # the cleaner sizes its moves to what is free; this is a bug guard
            raise DiskFullError("ssd", "write", errno.ENOSPC, f"no free block in {self.path} for {len(ids)} rows")
        blocks = self._free[self._free_head:self._free_head + need]
        view = self._buffer(need)
        view[-1] = 0  # the last block's unused slots
        j = np.arange(len(ids))
        self._slots(view)[j // rpb, j % rpb] = rows
        try:
            self._io(True, blocks, np.arange(need), view)
        except OSError as exc:
            raise tier_io_error("ssd", "write", exc) from exc
        self._free_head += need
        self._dirty_slab = True
        self.counters.bytes_written += need * self.block_bytes
        new_slots = blocks[j // rpb] * rpb + j % rpb
        delta, emptied = _repoint(self._slot_of, self._live, ids, new_slots, rpb)
        self._moved.append(np.asarray(ids, np.int64))
        self._resident += delta
        self._limbo.append(emptied)
        self._dirty_bits = True

    def _make_room(self, blocks: int) -> None:
        """Get ``blocks`` free blocks: commit to free the emptied ones, clean when that is not enough."""
        while self._available() < blocks:
            if any(len(x) for x in self._limbo):
                self.flush()  # commits the map, so the emptied blocks become free
                if self._available() >= blocks:
                    return
            if not self._clean():
                raise DiskFullError("ssd", "clean", errno.ENOSPC,
                                    f"the log at {self.path} cannot free {blocks} blocks "
                                    f"({self._available()} free of {self.num_blocks})")

    def _clean(self) -> bool:
        """Move the live rows of the emptiest blocks to free ones, then commit; False when nothing moved."""
        rpb = self.rows_per_block
        used = np.flatnonzero((self._live > 0) & (self._live < rpb))
        if len(used) == 0:
            return False
        order = used[np.argsort(self._live[used], kind="stable")]
        moved = np.cumsum(self._live[order], dtype=np.int64)
        room = self._available() * rpb
        count = min(int(np.searchsorted(moved, room, side="right")), self._clean_blocks)
        # a round must gain blocks: moving k rows takes ceil(k / rpb) of them back; the gain
        # never falls as victims are added (each adds one block and less than one block of rows)
        if count == 0 or count - (-(-int(moved[count - 1]) // rpb)) <= 0:
            return False
        victims = order[:count]
        marked = np.zeros(self.num_blocks, np.bool_)
        marked[victims] = True
        ids, slots = _live_rows_in(self._slot_of, marked, rpb)
        rows = np.zeros((len(ids), self.row_bytes), np.uint8)
        got, useful = self._get_bytes, self._get_useful
        self._read_rows(slots, np.arange(len(ids)), rows)
        self._get_bytes, self._get_useful = got, useful  # read_amplification is about get()
        self._append(ids, rows, cleaning=True)
        self.cleaned_blocks += count
        self.moved_rows += len(ids)
        self.flush()
        return True
