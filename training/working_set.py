"""A table's working set: the rows (and optimizer state) of every batch in the look-ahead window.

ScratchPipe/Bagpipe-style: rows enter when a batch is prefetched (or demanded
by a forward) and leave only once no batch still in the window uses them;
leaving writes them back to the store when dirty. While a row is in the
working set every read and update of it goes here, so a row updated by step i
and needed by step i+1 is never read stale from the store, and the store's own
eviction policy is untouched.

Not thread-safe by itself: the owning module serialises access with one lock;
only ``Table.read_with_state`` (the slow part of a prefetch) runs outside it.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from embstore.table import Table
from embstore.training._index import SlotIndex

Writer = Callable[["WorkingSet", np.ndarray, np.ndarray, np.ndarray], None]  # (working set, keys, rows, state)


class WorkingSet:
    """Slots of rows + state on the table's device, keyed by physical row id."""

    def __init__(self, table: Table, capacity: int = 1024) -> None:
        self.table = table
        self.device = torch.device(table.device)
        self.dim = table.format.dim
        self.state_dim = table.format.state_dim
        self.index = SlotIndex(capacity)
        self.rows = torch.zeros((capacity, self.dim), dtype=torch.float32, device=self.device)
        self.state = torch.zeros((capacity, self.state_dim), dtype=torch.float32, device=self.device)
        self.key = np.full(capacity, -1, np.int64)  # physical row per slot, -1 = free
        self.last_use = np.full(capacity, -1, np.int64)  # latest batch sequence number using the slot
        self.dirty = np.zeros(capacity, np.bool_)
        self.loaded = np.zeros(capacity, np.bool_)  # the slot holds its row's bytes (a fetch may have failed)
        self._free = np.arange(capacity - 1, -1, -1, dtype=np.int64)  # stack, top at the end
        self._nfree = capacity

    @property
    def capacity(self) -> int:
        return len(self.key)

    @property
    def resident(self) -> int:
        return self.capacity - self._nfree

    def reserve(self, uniq: np.ndarray, seq: int) -> tuple[np.ndarray, np.ndarray]:
        """Slots for unique rows ``uniq`` used by batch ``seq``; (slots, mask of rows to load)."""
        slots = self.index.find(uniq)
        missing = slots < 0
        if missing.any():
            slots[missing] = self._allocate(uniq[missing])
        self.last_use[slots] = np.maximum(self.last_use[slots], seq)
        return slots, missing

    def _allocate(self, keys: np.ndarray) -> np.ndarray:
        """Free slots for ``keys`` (none of them held yet): clean, not loaded, used by no batch so far."""
        n = len(keys)
        if n > self._nfree:
            self._grow(self.resident + n)
        new = self._free[self._nfree - n:self._nfree][::-1].copy()
        self._nfree -= n
        self.key[new] = keys
        self.dirty[new] = False
        self.loaded[new] = False
        self.index.put(keys, new)
        return new

    def unloaded(self, uniq: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Mask of the batch's rows (``uniq`` in ``slots``) whose bytes are not in the working set yet.

        Asked when the batch is fetched, not when it was reserved: a row another
        batch reserved first is only here if that batch's fetch succeeded.
        """
        return ~self.loaded[slots]

    def fill(self, slots: np.ndarray, rows: np.ndarray, state: np.ndarray) -> None:
        """Store rows read from the table into freshly reserved slots."""
        if len(slots):
            idx = torch.from_numpy(slots).to(self.device)
            self.rows[idx] = torch.from_numpy(rows).to(self.device)
            if self.state_dim:
                self.state[idx] = torch.from_numpy(state).to(self.device)
            self.loaded[slots] = True

    def readmit(self, keys: np.ndarray, rows: np.ndarray, state: np.ndarray) -> None:
        """Take back evicted dirty rows whose write-back failed, so the update is not lost.

        A row a later batch reserved meanwhile gets these bytes in its slot (its
        fetch, queued behind the write, then skips it instead of reading the
        stale store copy); the others come back unpinned and dirty, to be
        written again by the next eviction or flush.
        """
        if len(keys) == 0:
            return
        slots = self.index.find(keys)
        absent = slots < 0
        if absent.any():
            slots[absent] = self._allocate(keys[absent])
        take = ~self.loaded[slots]  # a loaded slot already holds a newer copy (never expected; kept as is)
        self.fill(slots[take], rows[take], state[take])
        self.dirty[slots[take]] = True

    def evict_before(self, seq: float, write: Writer | None = None) -> int:
        """Drop every row no batch with sequence >= ``seq`` uses; returns how many were written back dirty.

        ``write(working_set, keys, rows, state)`` stores the dirty ones (default: the
        table's ``write_with_state`` right away); it gets copies, so the slots
        are free for reuse as soon as this returns.
        """
        occupied = self.key >= 0
        victims = np.flatnonzero(occupied & (self.last_use < seq))
        if len(victims) == 0:
            return 0
        dirty = victims[self.dirty[victims]]
        self._write_back(dirty, write)
        keys = self.key[victims]
        if len(victims) == int(occupied.sum()):
            self.index = SlotIndex(max(self.index.count, 1024))
        else:
            self.index.delete(keys)
        self.key[victims] = -1
        self.last_use[victims] = -1
        self.dirty[victims] = False
        self.loaded[victims] = False
        self._free[self._nfree:self._nfree + len(victims)] = victims
        self._nfree += len(victims)
        return len(dirty)

    def write_back_all(self) -> int:
        """Write every dirty row to the store and mark it clean (it stays resident)."""
        slots = np.flatnonzero(self.dirty)
        self._write_back(slots)
        return len(slots)

    def _write_back(self, slots: np.ndarray, write: Writer | None = None) -> None:
        """Write the rows of ``slots`` in the order of their keys: not in slot order, which depends on how
        slots were reused, so the store's caches see a sequence a simulator can replay from the trace
        (``embstore.simulator.pipeline_accesses``)."""
        if len(slots) == 0:
            return
        slots = slots[np.argsort(self.key[slots], kind="stable")]
        idx = torch.from_numpy(slots).to(self.device)
        rows = self.rows[idx].cpu().numpy()
        state = self.state[idx].cpu().numpy()
        keys = self.key[slots]
        if write is None:
            self.table.write_with_state(keys, rows, state)
        else:
            write(self, keys, rows, state)
        self.dirty[slots] = False

    def _grow(self, need: int) -> None:
        old = self.capacity
        cap = old
        while cap < need:
            cap *= 2
        extra = cap - old
        dev = self.device
        self.rows = torch.cat([self.rows, torch.zeros((extra, self.dim), dtype=torch.float32, device=dev)])
        self.state = torch.cat([self.state, torch.zeros((extra, self.state_dim), dtype=torch.float32, device=dev)])
        self.key = np.concatenate([self.key, np.full(extra, -1, np.int64)])
        self.last_use = np.concatenate([self.last_use, np.full(extra, -1, np.int64)])
        self.dirty = np.concatenate([self.dirty, np.zeros(extra, np.bool_)])
        self.loaded = np.concatenate([self.loaded, np.zeros(extra, np.bool_)])
        free = np.empty(cap, np.int64)
        free[:extra] = np.arange(cap - 1, old - 1, -1, dtype=np.int64)
        free[extra:extra + self._nfree] = self._free[:self._nfree]
        self._free = free
        self._nfree += extra


class ResidentWorkingSet:
    """The working set of a table whose top tier is a full-table float32 slab: that slab itself.

    Rows and their optimizer state are trained in place in the tier's memory
    (``rows``/``state`` are strided views of it) and marked dirty in the tier's
    own dirty bits, so ``Table.flush`` writes them home; nothing is copied out
    and back per step. A row not yet in the slab is loaded through the
    hierarchy (which puts it there) by the batch that first claims it.

    The slab is a DRAM tier's (host memory) or a device tier's (a torch tensor
    on the accelerator: HBM-resident training, as fbgemm's TBE does when a
    table fits; on a CPU-only machine that tensor is host memory too). On the
    host ``flat`` is the slab as a numpy array, what the fused numba kernels
    take; on an accelerator it is None and steps run as torch operations on
    the views.
    """

    def __init__(self, table: Table, tier) -> None:  # tier: a DRAMTier or DeviceTier with a DirectDirectory
        self.table = table
        self.tier = tier
        self.dim = table.format.dim
        self.state_dim = table.format.state_dim
        if isinstance(tier.slab, torch.Tensor):  # a device tier
            rows_f = tier.float_rows()
            self.device = rows_f.device
            flat = rows_f.numpy() if self.device.type == "cpu" else None
            self.rows, self.state = rows_f[:, :self.dim], rows_f[:, self.dim:]
        else:
            self.device = torch.device("cpu")
            flat = tier.slab.view(np.float32)
            self.rows = torch.from_numpy(flat[:, :self.dim])
            self.state = torch.from_numpy(flat[:, self.dim:])
        self.flat = flat  # contiguous (rows, dim + state_dim) in host memory: what the numba kernels take
        self.dirty = tier.dirty  # the tier's own write-back bits

    @property
    def resident(self) -> int:
        """Rows held outside the store for the window: none, the slab is the store's own tier."""
        return 0

    def reserve(self, uniq: np.ndarray, seq: int) -> tuple[np.ndarray, np.ndarray]:
        """Slots are row ids; rows not yet in DRAM are to be loaded.

        Loading is a read through the hierarchy, which writes a row into the
        slab only while it is absent; a row is only ever stepped once present,
        so a second (late) load of it is a plain read and cannot undo a step.
        """
        return uniq.copy(), ~self.tier.directory.present[uniq]

    def unloaded(self, uniq: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Rows not in DRAM when the batch is fetched. Not the reserve-time mask: a row can look present
        then because an earlier batch's read is inserting it, and that read may fail and take it out."""
        return ~self.tier.directory.present[uniq]

    def fill(self, slots: np.ndarray, rows: np.ndarray, state: np.ndarray) -> None:
        """Nothing to copy: reading through the hierarchy already put the rows in the slab."""

    def evict_before(self, seq: float, write: Writer | None = None) -> int:
        return 0  # the slab holds the whole table; dirty rows go home on Table.flush()

    def write_back_all(self) -> int:
        return 0


def make_working_set(table: Table) -> WorkingSet | ResidentWorkingSet:
    """Train in place when the table's top tier holds all of it in float32 (DRAM or device), else a bounded
    working set."""
    tier = table.full_dram_tier() or table.device_tier()
    return ResidentWorkingSet(table, tier) if tier is not None else WorkingSet(table)
