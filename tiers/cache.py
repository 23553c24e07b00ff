"""Cache tiers: a preallocated slab of slots plus a directory that says who lives where.

``device`` (a torch slab on the accelerator, or on the CPU when there is none),
``dram`` (a numpy slab in host memory) and ``mmap`` used above the home (a
slab in a file mapping: MTrainS's byte-addressable SCM as a cache) differ only
in where the slab lives; slot bookkeeping, dirty bits and the eviction policy
are shared. A tier whose capacity covers the whole table gets a
:class:`~embstore.direct_directory.DirectDirectory` (slot == row id, no eviction).

The hierarchy drives a cache tier through ``directory.access`` plus
``read_slots``/``write_slots`` and the ``dirty`` bits; the plain
``get``/``put``/``contains`` of :class:`~embstore.tiers.base.Tier` are for
direct use and the conformance tests (``put`` on a full cache evicts, so it is
not a home).
"""

from __future__ import annotations

import os
from pathlib import Path

import numba
import numpy as np

from embstore.arrays import Ids, Mask, RowBytes, aligned_zeros, as_ids, check_id_range
from embstore.config import PolicySpec
from embstore.direct_directory import DirectDirectory
from embstore.errors import StoreClosedError
from embstore.kernels import scatter_rows
from embstore.policies import CacheDirectory, directory_bytes
from embstore.tiers.base import Tier


def cache_metadata_bytes(capacity_rows: int, num_rows: int, policy: PolicySpec | str = "lru",
                         count_threads: int | None = None) -> int:
    """DRAM a cache tier holds beside its slab: its directory and its dirty flags (a byte per slot).

    A tier whose capacity covers the table is direct-mapped: a presence byte per
    row, plus a bit per row per thread of distinct-count scratch once resident
    lookups run. What ``tune`` sets aside from a DRAM budget.
    """
    if capacity_rows >= num_rows:
        if count_threads is None:  # the count runs on numba's threads (embstore.kernels.threads_for)
            count_threads = numba.get_num_threads()
        return 2 * num_rows + count_threads * 8 * ((num_rows + 63) // 64)
    return directory_bytes(capacity_rows, policy) + capacity_rows


class CacheTier(Tier):
    """A bounded slab of rows with an eviction policy; volatile."""

    persistent = False
    supports_delete = True

    def __init__(self, row_bytes: int, capacity_rows: int, policy: PolicySpec | str = "lru",
                 num_rows: int | None = None) -> None:
        super().__init__(row_bytes)
        if capacity_rows < 1:
            raise ValueError(f"a {self.kind} cache needs room for at least one row of {row_bytes} bytes")
        self.num_rows = num_rows  # keys lie in [0, num_rows) when given
        full = num_rows is not None and capacity_rows >= num_rows
        self.directory: CacheDirectory | DirectDirectory = (
            DirectDirectory(num_rows) if full else CacheDirectory(capacity_rows, policy, key_limit=num_rows))
        self.slots = self.directory.capacity
        self.dirty = np.zeros(self.slots, np.bool_)

    # slab access, implemented per storage -----------------------------------
    def read_slots(self, slots: np.ndarray) -> RowBytes:
        raise NotImplementedError

    def write_slots(self, slots: np.ndarray, rows: RowBytes) -> None:
        raise NotImplementedError

    # Tier interface ----------------------------------------------------------
    def _ids(self, ids: Ids) -> Ids:
        """``ids`` as the directory needs them: a 1-D int64 array inside ``[0, num_rows)``, on an open
        tier. A direct-mapped directory indexes its flags with them, so a negative id would wrap
        around to another row (``delete([-1])`` dropped the last row) and a large one raise IndexError."""
        if self.closed:
            raise StoreClosedError(f"{self.kind} cache tier is closed")
        arr, _ = as_ids(ids)
        check_id_range(arr, self.num_rows, f"{self.kind} cache")
        return arr

    def get(self, ids: Ids) -> tuple[RowBytes, Mask]:
        ids = self._ids(ids)
        slots = self.directory.lookup(ids)
        found = slots >= 0
        rows = np.zeros((len(ids), self.row_bytes), np.uint8)
        if found.any():
            rows[found] = self.read_slots(slots[found])
        self.counters.hits += int(found.sum())
        self.counters.misses += int((~found).sum())
        self.counters.bytes_read += int(found.sum()) * self.row_bytes
        return rows, found

    def put(self, ids: Ids, rows: RowBytes) -> None:
        ids = self._ids(ids)
        self._check_rows(ids, rows)
        r = self.directory.access(ids)
        landed = r.slots >= 0
        landed[landed] &= self.directory.keys_at(r.slots[landed]) == ids[landed]
        self.write_slots(r.slots[landed], rows[landed])
        self.dirty[r.slots[landed]] = True
        self.counters.evictions += len(r.evicted_keys)
        self.counters.bytes_written += int(landed.sum()) * self.row_bytes

    def contains(self, ids: Ids) -> Mask:
        return self.directory.lookup(self._ids(ids)) >= 0

    def delete(self, ids: Ids) -> None:
        slots = self.directory.remove(self._ids(ids))
        self.dirty[slots[slots >= 0]] = False

    @property
    def resident_rows(self) -> int:
        return self.directory.resident

    @property
    def metadata_bytes(self) -> int:
        """DRAM held beside the slab (directory and dirty flags); see ``cache_metadata_bytes``."""
        return self.directory.nbytes + self.dirty.nbytes

    @property
    def capacity_rows(self) -> int:
        return self.slots


class DRAMTier(CacheTier):
    """Rows in a host-memory numpy slab."""

    kind = "dram"

    def __init__(self, row_bytes: int, capacity_rows: int, policy: PolicySpec | str = "lru",
                 num_rows: int | None = None) -> None:
        super().__init__(row_bytes, capacity_rows, policy, num_rows)
        self.slab = aligned_zeros((self.slots, row_bytes), np.uint8)

    def read_slots(self, slots: np.ndarray) -> RowBytes:
        return self.slab[slots]

    def write_slots(self, slots: np.ndarray, rows: RowBytes) -> None:
        self.slab[slots] = rows

    def overwrite_resident(self, keys: Ids, rows: np.ndarray, distinct: int) -> None:
        """Write float32 ``rows`` over resident rows ``keys`` in place (a direct-mapped float32 slab), zero
        their optimizer-state columns and mark them dirty; the last row of a repeated key wins.

        The caller has checked every key is resident (``directory.count_resident``, which also
        gives ``distinct``, the number of distinct keys) and every row valid: what the hierarchy's
        write would do here, without its gather, encode copy and split of the rows.
        """
        scatter_rows(self.slab.view(np.float32), keys, rows, self.dirty)
        self.counters.bytes_written += distinct * self.row_bytes


class MmapCacheTier(DRAMTier):
    """A cache slab in a file mapping (SCM-like capacity tier above the home); rebuilt on open."""

    kind = "mmap"

    def __init__(self, path: str | os.PathLike, row_bytes: int, capacity_rows: int,
                 policy: PolicySpec | str = "lru", num_rows: int | None = None) -> None:
        CacheTier.__init__(self, row_bytes, capacity_rows, policy, num_rows)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "wb") as f:  # contents are a cache: start empty every open
            f.truncate(self.slots * row_bytes)
        self.slab = np.memmap(self.path, dtype=np.uint8, mode="r+", shape=(self.slots, row_bytes))

    def close(self) -> None:
        """Unmap the slab (idempotent, like every tier's close)."""
        if self.closed:
            return
        del self.slab
        super().close()


class DeviceTier(CacheTier):
    """Rows in a torch tensor on the accelerator (``cuda`` when present, else the CPU)."""

    kind = "device"

    def __init__(self, row_bytes: int, capacity_rows: int, policy: PolicySpec | str = "lru",
                 num_rows: int | None = None, device: str | None = None) -> None:
        import torch

        super().__init__(row_bytes, capacity_rows, policy, num_rows)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self._torch = torch
        self.slab = torch.zeros((self.slots, row_bytes), dtype=torch.uint8, device=self.device)
        self._marks: torch.Tensor | None = None  # a flag per slot on the device, for distinct counts

    def float_rows(self):  # -> torch.Tensor
        """The slab as float32 rows, shape (slots, row_bytes // 4), on the device: a view, no copy
        (the rows of a float32 table, and after them the optimizer state a trained table carries)."""
        return self.slab.view(self._torch.float32)

    def count_distinct(self, keys, limit: int) -> int:  # keys: torch.Tensor of int64 slots on the device
        """Distinct ``keys`` counted on the device, or -1 if one lies outside ``[0, limit)``: the range
        check and the statistics of lookups whose ids never leave the device, in one read back. Keys
        are clamped into range before they index anything (an out-of-range index on a GPU is a fatal
        device-side assert, not an exception). One flag per slot, set then cleared (a byte per row of
        device memory, allocated at the first such call)."""
        t = self._torch
        if self._marks is None:
            self._marks = t.zeros(self.slots, dtype=t.bool, device=self.device)
        lo, hi = t.aminmax(keys)
        safe = keys.clamp(0, limit - 1)
        self._marks.index_fill_(0, safe, True)  # not ``marks[safe] = True``: that copies the scalar over first
        bad = (lo < 0) | (hi >= limit)
        is_bad, n = t.stack([bad.long(), self._marks.sum()]).tolist()
        self._marks.index_fill_(0, safe, False)
        return -1 if is_bad else n

    def read_slots(self, slots: np.ndarray) -> RowBytes:
        t = self._torch
        idx = t.from_numpy(np.ascontiguousarray(slots, np.int64)).to(self.device)
        return self.slab.index_select(0, idx).cpu().numpy()

    def write_slots(self, slots: np.ndarray, rows: RowBytes) -> None:
        t = self._torch
        idx = t.from_numpy(np.ascontiguousarray(slots, np.int64)).to(self.device)
        self.slab.index_copy_(0, idx, t.from_numpy(np.ascontiguousarray(rows)).to(self.device))
