"""A table: validation, hashing, dedup and row formats in front of a tier hierarchy.

Every public call validates everything before touching a tier or a counter, so
a rejected call changes nothing: not a row, not ``stats()``, not ``lookups``.
The physical-row calls (export/import, training) raise the same typed errors
as ``lookup``: ids in ``[0, num_rows)``, distinct for writes (a tier takes each
row once per call), finite float rows of the physical width. Lookups
deduplicate first (RecD's unique-then-gather): the tiers only ever see each row
once per call, and the pooled path pools from the unique rows through the
inverse index.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import numpy as np

from embstore.arrays import Ids, as_ids, as_offsets, as_rows, check_id_range
from embstore.config import RowDType, TableConfig
from embstore.direct_directory import DirectDirectory
from embstore.errors import InvalidInputError, InvalidRowsError, StoreClosedError
from embstore.hierarchy import Hierarchy
from embstore.kernels import (gather_rows, kernel_threads, pool, pool_rows, rows_finite, unique_inverse,
                              unique_last)
from embstore.tiers.cache import DeviceTier, DRAMTier, MmapCacheTier
from embstore.rows import RowFormat

POOL_MODES = ("sum", "mean")
# Ids already on a whole-table device tier's device are range-checked and counted there
# (``DeviceTier.count_distinct``, one read back) only when this is True. Off by default: on the H100 the one
# measurement of that path (20 calls, first use included) averaged 9.3 ms a call, against 0.93 ms for
# copying the ids to the host, counting them with the numba pass and copying them back (BENCHMARKS.md,
# GPU); whether its steady state is faster was not measured. Tests turn it on to run that path.
COUNT_DEVICE_IDS_ON_DEVICE = False
MAX_ANNOUNCED = 1024  # announced batches a table keeps pending: more means an advance() is missing


class Table:
    """One embedding table of a store (see SPEC section 1)."""

    def __init__(self, config: TableConfig, fmt: RowFormat, hierarchy: Hierarchy, mapper: Any | None) -> None:
        self.config = config
        self.format = fmt
        self.hierarchy = hierarchy
        self.mapper = mapper
        self.num_rows = mapper.num_rows if mapper is not None else config.num_embeddings
        self.device = next((t.device for t in hierarchy.caches if t.kind == "device"), "cpu")
        self._lock = threading.RLock()
        self._closed = False
        self.lookups = 0  # ids looked up (before dedup) by calls that answered
        self.recorder: Any | None = None  # optional access recorder (trace capture)
        self.announced = 0  # batches announced and not yet advanced past
        self.store_flush: Callable[[], None] | None = None  # its Store's flush, set by the Store (flush_durable)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def dim(self) -> int:
        return self.config.dim

    # --- id handling -----------------------------------------------------------
    def physical_rows(self, ids: Ids) -> np.ndarray:
        """Raw ids -> physical row ids, (n,) or (n, rows_per_id) for QR; IdOutOfRangeError when unhashed ids
        fall outside the table."""
        if self.mapper is not None:
            return self.mapper(ids)
        check_id_range(ids, self.config.num_embeddings, f"table {self.name!r}",
                       "; give the table a hash (hash = { kind = 'mod' }) to accept any id")
        return ids

    def _physical_ids(self, rows: Any, distinct: bool) -> Ids:
        """Validated physical row ids: 1-D int64 in ``[0, num_rows)``; ``distinct`` refuses a repeated row
        (writes: the hierarchy takes each row once, and which copy should win is the caller's choice)."""
        arr, _ = as_ids(rows, "physical row ids")
        check_id_range(arr, self.num_rows, f"table {self.name!r}: physical row ids",
                       " (physical rows are numbered from 0 to num_rows - 1, after hashing)")
        if distinct and not _increasing(arr):
            uniq, inv = unique_inverse(arr)
            if len(uniq) != len(arr):
                row = int(uniq[np.bincount(inv).argmax()])
                raise InvalidInputError(f"table {self.name!r}: physical row ids must be distinct in a write; row "
                                        f"{row} appears more than once (keep the copy you want to write)")
        return arr

    def _physical_values(self, values: Any, n: int, state: Any = None) -> tuple[np.ndarray, np.ndarray | None]:
        """Validated float32 (n, physical dim) rows this format can hold and, when given, float32
        (n, state_dim) optimizer state; the same checks as ``update``'s rows."""
        vals, _ = as_rows(values, n, self.format.dim)
        self.format.check(vals)
        if state is None:
            return vals, None
        try:
            st, _ = as_rows(state, n, self.format.state_dim)
        except InvalidRowsError as exc:
            raise InvalidRowsError(f"optimizer state: {exc}") from None
        return vals, st

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"table {self.name!r} is closed")

    def _read_unique(self, rows: np.ndarray) -> np.ndarray:
        """Decoded float32 rows for unique physical row ids."""
        if self.recorder is not None:
            self.recorder(self.name, rows)
        return self.format.decode(self.hierarchy.read(rows))

    def _gather(self, ids: Ids) -> np.ndarray:
        """float32 (n, dim) rows for raw ids (validated)."""
        rows = self.physical_rows(ids)
        flat = rows.reshape(-1)
        uniq, inv = unique_inverse(flat)
        vals = self._read_unique(uniq)[inv]
        if rows.ndim == 2:  # QR: (n, rows_per_id); the explicit width also reshapes an empty batch
            vals = self.mapper.combine(vals.reshape(len(ids), rows.shape[1], vals.shape[1]))
        return vals

    @property
    def memory_resident(self) -> bool:
        """Whether the top tier covers every row (direct-mapped DRAM or device): lookups cost microseconds."""
        top = self.hierarchy.caches[0] if self.hierarchy.caches else None
        return top is not None and top.kind in ("dram", "device") and isinstance(top.directory, DirectDirectory)

    @contextlib.contextmanager
    def try_locked(self) -> Iterator[bool]:
        """Hold the table's lock if it is free right now; yields whether it was taken (never waits).

        Lets an event loop run a small in-memory lookup inline without ever
        blocking on a write or flush in progress.
        """
        got = self._lock.acquire(blocking=False)
        try:
            yield got
        finally:
            if got:
                self._lock.release()

    def full_dram_tier(self) -> DRAMTier | None:
        """The top tier when it is a direct-mapped DRAM slab of the whole table in float32, else None.

        Training updates such a table in place (rows and optimizer state share
        each slab row) and marks the tier's dirty bits, instead of copying rows
        out and back every step.
        """
        top = self.hierarchy.caches[0] if self.hierarchy.caches else None
        if (isinstance(top, DRAMTier) and isinstance(top.directory, DirectDirectory)
                and self.format.dtype is RowDType.FLOAT32 and not isinstance(top, MmapCacheTier)):
            return top
        return None

    def _resident_tier(self) -> DRAMTier | None:
        """The top tier when it is a direct-mapped float32 slab in host memory or a file mapping, else None."""
        top = self.hierarchy.caches[0] if self.hierarchy.caches else None
        if (isinstance(top, DRAMTier) and isinstance(top.directory, DirectDirectory)
                and self.format.dtype is RowDType.FLOAT32):
            return top
        return None

    def _resident_slab(self, rows: np.ndarray) -> np.ndarray | None:
        """The top tier's float32 slab when it holds every one of ``rows`` (a full-table DRAM tier);
        None also when a row is out of range (the caller's validating path then reports it).

        This is the fast path for DRAM-resident tables: no dedup copy, the
        bags are pooled straight out of the slab; stats still count unique rows.
        A trained table's slab rows carry the optimizer state after the
        embedding (shape (slots, dim + state_dim)); callers read the first
        ``dim`` columns.
        """
        top = self._resident_tier()
        if top is None or rows.ndim != 1 or self.recorder is not None:
            return None
        with kernel_threads(len(rows)) as threads:
            n = top.directory.count_resident(rows, threads)
        if n < 0:
            return None
        top.counters.hits += n
        top.counters.bytes_read += n * top.row_bytes
        return top.slab.view(np.float32)

    def device_tier(self) -> DeviceTier | None:
        """The top tier when it is a direct-mapped device slab of the whole table in float32, else None:
        lookups then gather and pool on the device, and training steps the rows in place there."""
        top = self.hierarchy.caches[0] if self.hierarchy.caches else None
        if (isinstance(top, DeviceTier) and isinstance(top.directory, DirectDirectory)
                and self.format.dtype is RowDType.FLOAT32):
            return top
        return None

    def _device_rows(self, ids: Any) -> tuple[Any, int, bool] | None:
        """For a table held whole in a device tier: (the call's physical rows as an int64 tensor on the
        device, how many ids, whether the caller gave torch) when every row is resident, having counted
        the distinct rows in the tier's statistics; None otherwise (nothing counted, the caller takes
        the validating path, which also raises every input error).

        By default the ids are checked and counted on the host as the DRAM path does, and copied over
        unless they are already there. With ``COUNT_DEVICE_IDS_ON_DEVICE``, ids already on the device
        stay there: the range check and the distinct count run on the device with one read back
        (``DeviceTier.count_distinct``).
        """
        top = self.device_tier()
        if top is None or self.recorder is not None or (self.mapper is not None and self.mapper.rows_per_id != 1):
            return None
        import torch

        if (COUNT_DEVICE_IDS_ON_DEVICE and isinstance(ids, torch.Tensor) and ids.device == top.slab.device
                and self.mapper is None
                and ids.dtype == torch.int64 and ids.dim() == 1 and len(ids) and top.directory.full):
            idx = ids.detach()
            n = top.count_distinct(idx, self.num_rows)  # -1 when an id is out of range
            if n < 0:
                return None
        else:
            arr, _ = as_ids(ids)
            rows = self.physical_rows(arr)
            with kernel_threads(len(rows)) as threads:
                n = top.directory.count_resident(rows, threads)
            if n < 0:
                return None
            if (isinstance(ids, torch.Tensor) and ids.device == top.slab.device and ids.dtype == torch.int64
                    and rows is arr):
                idx = ids.detach().contiguous()  # unhashed ids already on the device: no second copy over
            else:
                # a read-only array (a server's binary request parsed in place) makes torch warn: copy it
                idx = torch.from_numpy(rows if rows.flags.writeable else rows.copy()).to(top.device)
        top.counters.hits += n
        top.counters.bytes_read += n * top.row_bytes
        return idx, len(idx), isinstance(ids, torch.Tensor)

    def _device_out(self, out: Any, as_torch: bool) -> Any:
        """A device lookup's result: the tensor itself for torch callers, else float32 numpy."""
        return out if as_torch else out.cpu().numpy()

    def _out(self, arr: np.ndarray, as_torch: bool) -> Any:
        if not as_torch:
            return arr
        import torch

        return torch.from_numpy(arr).to(self.device)

    # --- public API ----------------------------------------------------------------
    def lookup(self, ids: Any) -> Any:
        """Rows of ``ids``: shape (len(ids), dim), float32; numpy in -> numpy out, torch in -> torch out."""
        if self.device_tier() is not None:
            with self._lock:
                self._check_open()
                dev = self._device_rows(ids)
                if dev is not None:
                    idx, n, as_torch = dev
                    out = self.device_tier().float_rows()[:, :self.dim].index_select(0, idx)
                    self.lookups += n
                    return self._device_out(out, as_torch)
        arr, as_torch = as_ids(ids)
        with self._lock:
            self._check_open()
            rows = self.physical_rows(arr)
            slab = self._resident_slab(rows)
            if slab is not None:
                if slab.shape[1] == self.dim:
                    out = np.take(slab, rows, axis=0)
                else:  # rows + optimizer state
                    out = np.empty((len(rows), self.dim), np.float32)
                    gather_rows(slab, np.ascontiguousarray(rows, np.int64), out)
            else:
                out = self._gather(arr) if len(arr) else np.zeros((0, self.dim), np.float32)
            self.lookups += len(arr)  # only now: a refused call counts nothing
        return self._out(np.ascontiguousarray(out, np.float32), as_torch)

    def lookup_pooled(self, ids: Any, offsets: Any, mode: str = "sum") -> Any:
        """Bags ``ids[offsets[b]:offsets[b+1]]`` pooled by ``mode`` ("sum" | "mean") -> (num_bags, dim)."""
        if mode not in POOL_MODES:
            raise InvalidInputError(f"mode must be one of {', '.join(POOL_MODES)}, got {mode!r}")
        if self.device_tier() is not None:
            out = self._device_pooled(ids, offsets, mode)
            if out is not None:
                return out
        arr, as_torch = as_ids(ids)
        offs = as_offsets(offsets, len(arr))
        with self._lock:
            self._check_open()
            # unhashed ids go to the resident check unvalidated: its counting pass range-checks them, and
            # only a miss (or a bad id) takes the validating path below
            slab = self._resident_slab(arr) if self.mapper is None else None
            rows = arr if slab is not None else self.physical_rows(arr)
            if slab is None and self.mapper is not None:
                slab = self._resident_slab(rows)
            if slab is not None and slab.shape[1] == self.dim:
                out = _torch_pool(slab, rows, offs, mode)
            elif slab is not None:  # rows + optimizer state: torch would copy the strided slab, numba pools it
                out = np.empty((len(offs) - 1, self.dim), np.float32)
                pool_rows(slab, np.ascontiguousarray(rows, np.int64), offs, mode == "mean", out)
            elif rows.ndim == 2:  # QR: combine per id, then pool
                vals = self._gather(arr)
                out = pool(vals, np.arange(len(arr), dtype=np.int64), offs, mode)
            else:
                uniq, inv = unique_inverse(rows)
                out = pool(self._read_unique(uniq), inv, offs, mode)
            self.lookups += len(arr)
        return self._out(out, as_torch)

    def _device_pooled(self, ids: Any, offsets: Any, mode: str) -> Any:
        """``lookup_pooled`` on the device for a table held whole in a device tier, or None (nothing
        counted) when the call must take the validating path. The offsets are checked on the host."""
        import torch
        import torch.nn.functional as F

        num_ids = len(ids) if isinstance(ids, (np.ndarray, torch.Tensor)) and ids.ndim == 1 else None
        if num_ids is None:
            return None
        offs = as_offsets(offsets, num_ids)
        with self._lock:
            self._check_open()
            dev = self._device_rows(ids)
            if dev is None:
                return None
            idx, n, as_torch = dev
            rows_f = self.device_tier().float_rows()
            offs_t = torch.from_numpy(offs[:-1].copy()).to(rows_f.device)
            if rows_f.shape[1] == self.dim:
                out = F.embedding_bag(idx, rows_f, offs_t, mode=mode)
            else:  # rows + optimizer state: pool the unique rows' embeddings, not a copy of the strided slab
                uniq, inv = torch.unique(idx, return_inverse=True)
                out = F.embedding_bag(inv, rows_f.index_select(0, uniq)[:, :self.dim], offs_t, mode=mode)
            self.lookups += n
        return self._device_out(out, as_torch)

    def announce(self, ids: Any) -> None:
        """Tell the table's caches the ids a coming batch will read, before it reads them.

        Batches are announced in the order they will be read, each once; a
        cache then keeps the rows the announced batches need soonest and lets
        go of those needed last or never, as Belady's MIN does inside the
        window (``embstore.lookahead``), and ranks the rest by its own policy.
        Call ``advance()`` when the oldest announced batch's reads are done. A
        training pipeline knows its next batches' ids (its data loader reads
        ahead); ``TieredEmbeddingBagCollection.pipeline(..., announce=K)`` does
        this for you. Announcing changes which rows stay cached, never what a
        read returns. Raises InvalidInputError for bad ids and when
        ``MAX_ANNOUNCED`` batches are pending (an ``advance()`` is missing).
        """
        arr, _ = as_ids(ids)
        with self._lock:
            self._check_room()
            self._announce(self.physical_rows(arr).reshape(-1))  # validated even when no cache ranks them

    def announce_rows(self, rows: Any) -> None:
        """``announce`` by physical row ids (after hashing), in the order they will be read.

        What a training pipeline tells: its working set already holds a batch's rows that the batches
        before it use, so it reads (and announces) only the others (``TieredEmbeddingBagCollection.pipeline``).
        """
        arr = self._physical_ids(rows, distinct=False)
        with self._lock:
            self._check_room()
            self._announce(arr)

    def _check_room(self) -> None:
        self._check_open()
        if self.announced >= MAX_ANNOUNCED:
            raise InvalidInputError(f"table {self.name!r}: {self.announced} announced batches are pending; "
                                    "call advance() after each announced batch is read")

    def _announce(self, rows: Ids) -> None:
        """Tell the caches the distinct ``rows`` (first-occurrence order) as the next batch (lock held)."""
        if self.hierarchy.ranks_announced:
            self.hierarchy.announce(unique_inverse(rows)[0])
        self.announced += 1

    def advance(self) -> bool:
        """The oldest announced batch has been read (its announced uses no read spent are dropped); False
        when no announced batch is pending."""
        with self._lock:
            self._check_open()
            if not self.announced:
                return False
            self.hierarchy.advance()
            self.announced -= 1
            return True

    def _checked_update(self, ids: Any, rows: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        arr, _ = as_ids(ids)
        vals, _ = as_rows(rows, len(arr), self.dim)
        self.format.check(vals)
        if self.mapper is not None and self.mapper.rows_per_id != 1:
            raise InvalidInputError(f"table {self.name!r}: rows of a QR-hashed table are combinations of two "
                                    "shared rows and cannot be overwritten one id at a time; train it instead")
        return arr, vals, self.physical_rows(arr)

    def check_update(self, ids: Any, rows: Any) -> tuple[np.ndarray, np.ndarray]:
        """Every check ``update`` makes, without writing: (int64 ids, float32 rows) as it would write them."""
        return self._checked_update(ids, rows)[:2]

    def update(self, ids: Any, rows: Any) -> None:
        """Overwrite rows of ``ids``; for a repeated id (or ids hashed together) the last row wins."""
        arr, _ = as_ids(ids)
        with self._lock:
            if self._update_resident(arr, rows):
                return
        arr, vals, phys = self._checked_update(arr, rows)
        with self._lock:
            self._check_open()
            uniq, last = unique_last(phys)
            if len(uniq) == len(phys):  # distinct already (the common case): no gather
                self.hierarchy.write(phys, self.format.encode(vals))
            else:
                self.hierarchy.write(uniq, self.format.encode(vals[last]))

    def _update_resident(self, ids: Ids, rows: Any) -> bool:
        """``update`` of a table whose top tier is a whole-table float32 slab holding every row of the batch:
        checked, then written in place, in three passes on the calling thread (ids: range, residency and
        the distinct count in the directory's bitmap; rows: finiteness; the scatter, in order, which
        marks the rows dirty). No dedup copy, encode copy or split: in ``bench_dram.py`` 0.66x ->
        1.2-1.7x numpy's ``w[ids] = rows`` (session 10).

        Returns False, having changed nothing, when the call is not that case: rows that are not
        float32 C-contiguous (n, dim) numpy, a closed table, a QR hash, an id outside the table or
        not yet resident, a non-finite value. ``update`` then takes the validating path, which
        raises exactly the errors it always did or writes through the hierarchy.
        """
        top = self._resident_tier()
        if top is None or self._closed or not len(ids) or not isinstance(rows, np.ndarray):
            return False
        rows = np.asarray(rows)  # a subclass (np.matrix: reshape keeps it 2-D) as the plain array it holds
        if (rows.dtype != np.float32 or rows.shape != (len(ids), self.dim) or not rows.flags.c_contiguous
                or (self.mapper is not None and self.mapper.rows_per_id != 1)):
            return False
        phys = ids if self.mapper is None else self.mapper(ids)
        distinct = top.directory.count_resident(phys)  # one thread, like the rest of this path (kernels.py)
        if distinct < 0 or not rows_finite(rows):
            return False
        top.overwrite_resident(phys, rows, distinct)
        return True

    def read_physical(self, rows: Ids) -> np.ndarray:
        """float32 rows by physical row id (no hashing; repeats allowed); for export and training."""
        arr = self._physical_ids(rows, distinct=False)
        with self._lock:
            self._check_open()
            return self.format.decode(self._read_physical(arr))

    def write_physical(self, rows: Ids, values: np.ndarray) -> None:
        """Overwrite physical rows (distinct ids, float32 (n, physical dim)); for import."""
        arr = self._physical_ids(rows, distinct=True)
        vals, _ = self._physical_values(values, len(arr))
        with self._lock:
            self._check_open()
            self.hierarchy.write(arr, self.format.encode(vals))

    def read_with_state(self, rows: Ids) -> tuple[np.ndarray, np.ndarray]:
        """(float32 (n, physical dim), float32 optimizer state (n, state_dim)) of physical rows."""
        arr = self._physical_ids(rows, distinct=False)
        with self._lock:
            self._check_open()
            data = self._read_physical(arr)
            return self.format.decode(data), self.format.decode_state(data)

    def write_with_state(self, rows: Ids, values: np.ndarray, state: np.ndarray) -> None:
        """Write distinct physical rows together with their optimizer state (one tier write for both)."""
        arr = self._physical_ids(rows, distinct=True)
        vals, st = self._physical_values(values, len(arr), state)
        with self._lock:
            self._check_open()
            self.hierarchy.write(arr, self.format.encode(vals, st))

    def _read_physical(self, rows: Ids) -> np.ndarray:
        """Encoded rows of validated physical ids; the tiers see each row once (they take distinct ids)."""
        if _increasing(rows):
            return self.hierarchy.read(rows)
        uniq, inv = unique_inverse(rows)
        data = self.hierarchy.read(uniq)
        return data if len(uniq) == len(rows) else data[inv]

    def stats(self) -> dict[str, dict[str, int]]:
        """Per tier (keyed by kind, fastest first): hits, misses, evictions, bytes moved, occupancy."""
        out: dict[str, dict[str, int]] = {}
        with self._lock:
            for s in self.hierarchy.stats():
                key = s.kind if s.kind not in out else f"{s.kind}#{sum(k.startswith(s.kind) for k in out) + 1}"
                d = s.as_dict()
                d.pop("kind")
                out[key] = d
        return out

    def flush(self) -> None:
        with self._lock:
            self._check_open()
            self.hierarchy.flush()

    def flush_durable(self) -> None:
        """Make every write so far durable and final: the store's flush when the table belongs to one. A
        flush of this table alone leaves older writes of its rows in the store's write-ahead log, which the
        open after a crash replays over newer ones (a bulk import's)."""
        if self.store_flush is None:
            self.flush()
        else:
            self.store_flush()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self.hierarchy.flush()
            finally:
                self.hierarchy.close()

    def __repr__(self) -> str:
        tiers = " > ".join(t.kind for t in self.hierarchy.tiers)
        return f"<Table {self.name!r} {self.config.num_embeddings}x{self.dim} {self.config.dtype.value} [{tiers}]>"


def _increasing(ids: Ids) -> bool:
    """Whether ``ids`` are strictly increasing, hence distinct: import and export pass ascending ranges,
    which skip the dedup hash pass (about 7 int64 of scratch per id, 0.5 GiB for a 10M-row write)."""
    return len(ids) < 2 or bool((ids[1:] > ids[:-1]).all())


_TORCH_BAG_MODES = {"sum": 0, "mean": 1}
"""``torch.embedding_bag``'s mode codes (ATen's EmbeddingBagMode)."""


def _torch_pool(slab: np.ndarray, rows: np.ndarray, offsets: np.ndarray, mode: str) -> np.ndarray:
    """Pool bags straight out of a resident float32 slab with torch's embedding_bag (fbgemm kernels).

    Calls the ATen op itself, with the offsets' last entry (``include_last_offset``): the functional
    wrapper's checks repeat ours and cost a few microseconds a call. Read-only index arrays (a server's
    binary request parsed in place) are copied: torch warns on them, and a warning filter cannot be
    set per call in a threaded server."""
    import torch

    rows, offsets = (a if a.flags.writeable else a.copy() for a in (rows, offsets))
    out = torch.embedding_bag(torch.from_numpy(slab), torch.from_numpy(rows), torch.from_numpy(offsets),
                              False, _TORCH_BAG_MODES[mode], False, None, True)[0]
    return out.numpy()
