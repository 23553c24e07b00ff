"""The pooled-embedding cache of SDM: a repeated bag is answered pooled, from memory.

Entries are keyed by (mode, the bag's ids) and bounded in bytes with LRU
eviction. Invalidation uses write epochs rather than an index of bags:

- a global counter ``epoch`` is bumped by every write, *after* the rows are in
  the table, and each written row's slot in ``row_epoch`` (a fixed array
  indexed by ``row & mask``) is set to the new value;
- a bag computed after reading ``epoch == e`` is stored with ``e``; it is
  valid while every one of its rows has ``row_epoch <= e``.

A write finished before the read began has ``row_epoch <= e`` (the read sees
it); one that lands during or after the read sets ``row_epoch > e`` and kills
the entry. A write also marks its slots busy in ``writing`` from before its rows
reach the table until its epoch is set (``begin_write`` / ``end_write``), and no
bag holding a busy row is answered from memory: otherwise, in the window between
the table's update and the epoch, a lookup could already return a new row while
a pooled request sent after it got the bag cached before the write. Rows sharing a slot only cause extra misses, never stale answers.
Rows are physical (after the table's hash), so ids hashed together invalidate
each other. The array costs 8 bytes * ``slots`` per table and no per-row work.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from embstore.arrays import as_offsets

ENTRY_OVERHEAD = 96  # bytes of bookkeeping per entry (dict slot, tuple, array header), for the budget


class PooledCache:
    """Pooled answers of one table; thread-safe."""

    def __init__(self, pool: Callable[[np.ndarray, np.ndarray, str], np.ndarray],
                 rows_of: Callable[[np.ndarray], np.ndarray], dim: int, capacity_bytes: int,
                 slots: int = 1 << 16) -> None:
        """``pool(ids, offsets, mode)`` computes bags; ``rows_of(ids)`` maps ids to physical rows."""
        if slots & (slots - 1):
            raise ValueError(f"slots must be a power of two, got {slots}")
        self._pool = pool
        self._rows_of = rows_of
        self.dim = dim
        self.capacity_bytes = capacity_bytes
        self._mask = slots - 1
        self._row_epoch = np.zeros(slots, np.int64)
        self._writing = np.zeros(slots, np.int64)  # writes in progress per slot (begin_write .. end_write)
        self._epoch = 0
        self._entries: OrderedDict[tuple[str, bytes], tuple[int, np.ndarray]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def _entry_bytes(self, key: tuple[str, bytes]) -> int:
        return len(key[1]) + 4 * self.dim + ENTRY_OVERHEAD

    def lookup_pooled(self, ids: np.ndarray, offsets: Any, mode: str) -> np.ndarray:
        """Like ``Table.lookup_pooled``; cached bags come from memory, the rest in one call."""
        offsets = as_offsets(offsets, len(ids))
        if self.capacity_bytes == 0:
            return self._pool(ids, offsets, mode)
        num_bags = len(offsets) - 1
        lens = np.diff(offsets)
        nonempty = lens > 0
        slots = self._slots(ids)
        out = np.zeros((num_bags, self.dim), np.float32)
        miss: list[int] = []
        with self._lock:
            seen = self._epoch
            bag_epoch = np.zeros(num_bags, np.int64)
            bag_busy = np.zeros(num_bags, np.int64)
            if len(ids):
                starts = offsets[:-1][nonempty]
                bag_epoch[nonempty] = np.maximum.reduceat(self._row_epoch[slots], starts)
                bag_busy[nonempty] = np.maximum.reduceat(self._writing[slots], starts)
            for b in np.flatnonzero(nonempty).tolist():
                key = (mode, ids[offsets[b]:offsets[b + 1]].tobytes())
                entry = self._entries.get(key)
                if entry is not None and entry[0] >= bag_epoch[b] and not bag_busy[b]:
                    self._entries.move_to_end(key)
                    out[b] = entry[1]
                else:
                    miss.append(b)
            self.hits += int(nonempty.sum()) - len(miss)
            self.misses += len(miss)
        if not miss:
            return out
        bags = np.array(miss, dtype=np.int64)
        sub_lens = lens[bags]
        sub_offsets = np.zeros(len(bags) + 1, np.int64)
        np.cumsum(sub_lens, out=sub_offsets[1:])
        take = np.repeat(offsets[bags] - sub_offsets[:-1], sub_lens) + np.arange(sub_offsets[-1])
        sub_ids = ids[take]
        pooled = self._pool(sub_ids, sub_offsets, mode)
        out[bags] = pooled
        with self._lock:
            for i, b in enumerate(miss):
                self._put((mode, sub_ids[sub_offsets[i]:sub_offsets[i + 1]].tobytes()), seen, pooled[i].copy())
        return out

    def _slots(self, ids: np.ndarray) -> np.ndarray:
        rows = self._rows_of(ids)
        if rows.ndim == 2:  # QR-hashed: each id reads several rows; such tables take no row writes
            rows = rows[:, 0]
        return rows & self._mask

    def _put(self, key: tuple[str, bytes], epoch: int, row: np.ndarray) -> None:
        size = self._entry_bytes(key)
        if size > self.capacity_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= size
        self._entries[key] = (epoch, row)
        self._bytes += size
        while self._bytes > self.capacity_bytes:
            k, _ = self._entries.popitem(last=False)
            self._bytes -= self._entry_bytes(k)

    def note_write(self, ids: np.ndarray) -> None:
        """Call after rows of ``ids`` were written: cached bags holding them become invalid."""
        self.end_write(self.begin_write(ids))

    def begin_write(self, ids: np.ndarray) -> np.ndarray | None:
        """Call before rows of ``ids`` are written: until :meth:`end_write`, bags holding them are pooled
        from the table, never answered from memory. Returns the token for :meth:`end_write`."""
        if self.capacity_bytes == 0 or not len(ids):
            return None
        slots = self._slots(ids)
        with self._lock:
            np.add.at(self._writing, slots, 1)
        return slots

    def end_write(self, token: np.ndarray | None) -> None:
        """Call after the write :meth:`begin_write` announced, also when it failed (a machine failure may
        leave part of it applied): cached bags holding its rows become invalid."""
        if token is None:
            return
        with self._lock:
            np.subtract.at(self._writing, token, 1)
            self._epoch += 1
            self._row_epoch[token] = self._epoch

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            total = self.hits + self.misses
            return {"hits": self.hits, "misses": self.misses, "hit_ratio": self.hits / total if total else 0.0,
                    "entries": len(self._entries), "bytes": self._bytes, "capacity_bytes": self.capacity_bytes}
