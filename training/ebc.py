"""TieredEmbeddingBagCollection: embedding bags trained straight out of an embstore store.

One step, per table::

    ids ──hash──▶ physical rows ──dedup──▶ unique rows ──▶ working set (rows + optimizer state)
                                                              │ gather (forward)      ▲ optimizer (backward)
                                                              ▼                       │
                                            working tensor (n_unique, dim) ──embedding_bag──▶ (batch, dim)

The gradient never exists for the whole table: autograd produces it for the
working tensor only (duplicate ids summed, as torch's sparse gradients are),
and the custom autograd function's backward applies the optimizer to exactly
those rows. Rows leave the working set, written back to the store with their
optimizer state in one tier write, once no batch in the look-ahead window
needs them (see ``working_set.py``).

Protocol: one backward per forward, before the next forward. A batch whose
backward has not come when the next forward starts is retired without an
update (eval, or a dropped graph); a backward arriving later raises.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import itertools
import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from embstore.config import RowDType
from embstore.errors import IdOutOfRangeError, InvalidInputError, TierIOError
from embstore.kernels import kernel_threads, pool_rows, unique_inverse_each
from embstore.rows import FLOAT16_LIMIT, RowFormat
from embstore.table import MAX_ANNOUNCED
from embstore.training._kernels import fused_bag_step, step_rows
from embstore.training.batch import KeyedJaggedBatch, normalize
from embstore.training.optim import (DEFAULT_EPS, OptimConfig, apply_update, check_finite_gradient,
                                     check_hyperparameters, check_optimizer, finite_rows, overflow_error,
                                     state_dim)
from embstore.training.working_set import ResidentWorkingSet, make_working_set

log = logging.getLogger("embstore.training")

POOLING = ("sum", "mean")
_KIND = {"sgd": 0, "rowwise_adagrad": 1, "adagrad": 2, "adam": 3}


@dataclass
class _Batch:
    """One batch in the window: its ids, their unique rows, and where they sit in the working sets."""

    seq: int
    ids: list[np.ndarray]
    offsets: list[np.ndarray]
    uniq: list[np.ndarray] = field(default_factory=list)
    inv: list[np.ndarray] = field(default_factory=list)
    slots: list[np.ndarray] = field(default_factory=list)
    missing: list[np.ndarray] = field(default_factory=list)  # per unique row: fetched from the store
    fetched: int = 0  # rows this batch brought into the working sets
    future: cf.Future | None = None
    stepped: set[int] = field(default_factory=set)
    retired: bool = False


def _check_lookahead(k: Any, name: str = "lookahead") -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
        raise InvalidInputError(f"{name} must be an integer >= 0, got {k!r}")
    return int(k)


def _check_settings(optimizer: Any, pooling: Any, lookahead: Any, adam_step: Any) -> None:
    """The module's non-numeric settings (the constructor's and a checkpoint's)."""
    check_optimizer(optimizer)
    if pooling not in POOLING:
        raise InvalidInputError(f"pooling must be one of {', '.join(POOLING)}, got {pooling!r}")
    _check_lookahead(lookahead)
    if adam_step not in ("row", "global"):
        raise InvalidInputError(f"adam_step must be 'row' or 'global', got {adam_step!r}")


class _GatherRows(torch.autograd.Function):
    """Forward: the batch's unique rows as one working tensor. Backward: apply the optimizer to them."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, gather: Callable[[], torch.Tensor],
                step: Callable[[torch.Tensor], None]) -> torch.Tensor:
        ctx.step = step
        return gather()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.step(grad)
        return None, None, None


class _FusedBag(torch.autograd.Function):
    """Accelerator path: pool from the gathered working tensor; backward scatters bag gradients into
    row gradients (one index_add) and steps. CPU tables take ``_SlabBag`` instead."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, w: torch.Tensor, inv: torch.Tensor, offsets: torch.Tensor,
                mode: str, step: Callable[[torch.Tensor], None]) -> torch.Tensor:
        ctx.inv, ctx.offsets, ctx.mean, ctx.n, ctx.step = inv, offsets, mode == "mean", w.shape[0], step
        return F.embedding_bag(inv, w, offsets, mode=mode, include_last_offset=True)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[None, ...]:
        grad_out = grad_out.to(torch.float32).contiguous()
        lens = ctx.offsets.diff()
        n_ids = ctx.inv.shape[0]  # given, so that no read back of the lengths' sum is needed
        per_id = grad_out.repeat_interleave(lens, dim=0, output_size=n_ids)
        if ctx.mean:
            per_id = per_id / lens.clamp(min=1).repeat_interleave(lens, output_size=n_ids)[:, None].to(per_id.dtype)
        g = torch.zeros((ctx.n, grad_out.shape[1]), dtype=torch.float32, device=grad_out.device)
        g.index_add_(0, ctx.inv, per_id)
        ctx.step(g)
        return None, None, None, None, None, None


class _SlabBag(torch.autograd.Function):
    """Pool straight out of the rows' memory (a DRAM slab or a working set; no gather of the batch's rows);
    backward hands the bag gradients to a fused step that updates the rows in place."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, slab: np.ndarray, dim: int, rows: np.ndarray, inv: np.ndarray,
                n_uniq: int, offsets: np.ndarray, mode: str, step: Callable[[torch.Tensor], None]) -> torch.Tensor:
        ctx.inv, ctx.offsets, ctx.mean, ctx.n, ctx.step = inv, offsets, mode == "mean", n_uniq, step
        out = np.empty((len(offsets) - 1, dim), np.float32)
        pool_rows(slab, rows, offsets, mode == "mean", out)
        return torch.from_numpy(out)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[None, ...]:
        ctx.step(grad_out)  # a bag-gradient stepper: row gradients are summed inside the fused kernel
        return (None,) * 9


class _Teller:
    """What a pipeline told ``announce=A`` tells the tables' caches, in the order the store sees it.

    The store reads a batch's rows when its fetch runs (``lookahead`` batches
    before its step, on the prefetch thread), and only the rows the working
    set lacks: those none of the ``lookahead`` batches before it uses. So each
    table is told exactly those rows, batch by batch, and right before batch
    j's fetch reads it advances past batch j - 1 and is told up to batch
    j + A; write-backs queued between two fetches land in the earlier one's
    batch. Told and ticked on the thread that fetches, in its order, the
    store sees one sequence whatever the timing, the one
    ``embstore.simulator.pipeline_accesses`` replays from the trace.
    """

    def __init__(self, tables: Sequence[Any], lookahead: int, ahead: int) -> None:
        self.tables, self.ahead = list(tables), ahead
        self.recent: collections.deque[list[np.ndarray]] = collections.deque(maxlen=lookahead)  # last k batches
        self.untold: collections.deque[tuple[int, list[np.ndarray]]] = collections.deque()  # (seq, rows) read
        self.seen = 0  # batches read
        self.fetches = 0  # fetches the tables were readied for
        self.unadvanced = [0] * len(self.tables)  # per table: batches told and not advanced past

    def read(self, rows: list[np.ndarray]) -> None:
        """A batch was read (main thread): its physical rows per table; keeps the ones its fetch will read."""
        uniq = [u for u, _ in unique_inverse_each(rows)]
        fresh = [u if not self.recent else u[~np.isin(u, np.concatenate([b[t] for b in self.recent]))]
                 for t, u in enumerate(uniq)]
        self.recent.append(uniq)
        self.untold.append((self.seen, fresh))
        self.seen += 1

    def before_fetch(self) -> None:
        """The next batch's fetch is about to read: advance past the batch before it, tell up to A after it."""
        j = self.fetches
        self.fetches += 1
        if j:
            for t, table in enumerate(self.tables):
                if self.unadvanced[t]:
                    table.advance()
                    self.unadvanced[t] -= 1
        while self.untold and self.untold[0][0] <= j + self.ahead:
            _, rows = self.untold.popleft()
            for t, table in enumerate(self.tables):
                table.announce_rows(rows[t])
                self.unadvanced[t] += 1

    def close(self) -> None:
        """The pipeline is over: advance past every batch told (and only those: others may be told too)."""
        for t, table in enumerate(self.tables):
            while self.unadvanced[t]:
                table.advance()
                self.unadvanced[t] -= 1


def _tier_lock(ws: Any) -> Any:
    """The table's lock where the working set is the table's own tier (``Table.update`` writes rows there,
    under that lock, while a served model reads them: without it a score could pool a half-written PUT, and a
    lookup read a half-stepped row); a bounded working set holds copies, used under the collection's lock
    alone. Taken after the collection's lock, everywhere."""
    return ws.table._lock if isinstance(ws, ResidentWorkingSet) else contextlib.nullcontext()


class TieredEmbeddingBagCollection(nn.Module):
    """Pooled embedding bags over store tables, trained with a fused row-wise optimizer (SPEC section 3)."""

    def __init__(self, store: Any, tables: Sequence[str], optimizer: str = "sgd", lr: float = 0.01,
                 eps: float | None = None, betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.0,
                 pooling: str = "sum", lookahead: int = 0, adam_step: str = "row") -> None:
        super().__init__()
        if not tables or len(set(tables)) != len(tables):
            raise InvalidInputError(f"tables must be a non-empty list of distinct names, got {list(tables)}")
        _check_settings(optimizer, pooling, lookahead, adam_step)
        check_hyperparameters(lr, eps, betas, weight_decay)
        self.store = store
        self.table_names = list(tables)
        self.pooling = pooling
        self.lookahead = int(lookahead)
        self.optim = OptimConfig(optimizer, float(lr), float(DEFAULT_EPS[optimizer] if eps is None else eps),
                                 float(betas[0]), float(betas[1]), float(weight_decay), adam_step)
        found = [store[name] for name in self.table_names]  # every check before a table is re-laid out below
        dims = {t.dim for t in found}
        if len(dims) != 1:
            raise InvalidInputError(f"all tables need the same dim for a (batch, tables, dim) output; got "
                                    f"{ {t.name: t.dim for t in found} }")
        self.dim = dims.pop()
        self.tables = [store.ensure_state_dim(t.name, state_dim(optimizer, t.format.dim)) for t in found]
        self.ws = [make_working_set(t) for t in self.tables]
        # where forward's output lives: the accelerator when any table's rows are on one (the bags of host
        # tables are copied over, as TorchRec does with tables offloaded to the CPU), else the CPU
        self.device = next((ws.device for ws in self.ws if ws.device.type != "cpu"), torch.device("cpu"))
        # float16 tables: the step refuses rows it would take beyond float16's range (see _step_table)
        self._row_limit = [FLOAT16_LIMIT if t.format.dtype is RowDType.FLOAT16 else None for t in self.tables]
        # float16 / int8 tables: a stepped row is rounded to its table's format at once (see _round_to_format)
        self._format = [None if t.format.dtype is RowDType.FLOAT32 else RowFormat(t.format.dim, t.format.dtype)
                        for t in self.tables]
        self._lock = threading.RLock()
        self._pending: dict[int, _Batch] = {}  # seq -> batch not retired yet (prefetched or forwarded)
        self._queue: collections.deque[_Batch] = collections.deque()  # prefetched, not forwarded yet
        self._awaiting: list[_Batch] = []  # forwarded, backward not done yet
        self._next_seq = 0
        self._recheck_loads = False  # set by a failed fetch or write-back: fetches then re-derive what to load
        self._executor: cf.ThreadPoolExecutor | None = None
        self._writes: collections.deque[cf.Future] = collections.deque()  # write-behind jobs not reaped yet
        self.steps = 0
        self.counters = {"demand_misses": 0, "prefetched_rows": 0, "late_rows": 0, "batches": 0,
                         "stall_s": 0.0, "written_back_rows": 0}

    # --- public API ----------------------------------------------------------------
    def forward(self, ids: Any, offsets: Any = None) -> torch.Tensor:
        """Pooled bags, shape (batch, num_tables, dim); per-table (ids, offsets) lists or one KeyedJaggedBatch."""
        id_list, off_list = normalize(self.table_names, ids, offsets)
        self._retire_unfinished()
        self._reap_writes()
        if not self._queue and self._all_rows_on_accelerator():
            return self._forward_on_accelerator(id_list, off_list, torch.is_grad_enabled() and self.training)
        batch = self._take_prefetched(id_list, off_list)
        if batch is None:
            self._drain()
            batch = self._new_batch(id_list, off_list)
            try:
                self._reserve(batch)
                self._fetch(batch)
            except BaseException:
                self._retire(batch)
                raise
            self.counters["demand_misses"] += batch.fetched
        self.counters["batches"] += 1
        grad_on = torch.is_grad_enabled() and self.training
        outs = []
        for t, table in enumerate(self.tables):
            gather = self._gatherer(batch, t)
            qr = table.mapper is not None and table.mapper.rows_per_id != 1
            ws = self.ws[t]
            if ws.device.type == "cpu" and not qr:  # pool straight out of the rows' memory; fused step
                rows = batch.slots[t][batch.inv[t]]
                anchor = torch.empty(0, requires_grad=grad_on)
                step = self._stepper(batch, t, bag_grad=True) if grad_on else None
                with self._lock, _tier_lock(ws):  # a prefetch may grow the working set, a PUT write the tier
                    slab = ws.flat if isinstance(ws, ResidentWorkingSet) else ws.rows.numpy()
                    outs.append(_SlabBag.apply(anchor, slab, ws.dim, rows, batch.inv[t], len(batch.uniq[t]),
                                               batch.offsets[t], self.pooling, step))
                continue
            if grad_on and not qr:
                anchor = torch.empty(0, requires_grad=True)
                dev = self.ws[t].device
                outs.append(_FusedBag.apply(anchor, gather(), torch.from_numpy(batch.inv[t]).to(dev),
                                            torch.from_numpy(batch.offsets[t]).to(dev), self.pooling,
                                            self._stepper(batch, t)))
                continue
            if grad_on:
                anchor = torch.empty(0, requires_grad=True)
                w = _GatherRows.apply(anchor, gather, self._stepper(batch, t))
            else:
                w = gather()
            outs.append(self._pool(table, w, batch, t))
        if grad_on:
            self._awaiting.append(batch)
        else:
            self._retire(batch)
        return torch.stack([o.to(self.device) for o in outs], dim=1)

    def prefetch(self, ids: Any, offsets: Any = None) -> None:
        """Add a future batch to the look-ahead window; its rows are fetched in a background thread."""
        self._prefetch(ids, offsets)

    def _prefetch(self, ids: Any, offsets: Any = None, before: Callable[[], None] | None = None) -> _Batch:
        """``prefetch``, returning the queued batch (``pipeline`` drops the ones it never yields); ``before``
        runs on the prefetch thread right before the fetch reads (``pipeline`` tells the tables there)."""
        id_list, off_list = normalize(self.table_names, ids, offsets)
        batch = self._new_batch(id_list, off_list)
        try:
            self._reserve(batch)
        except BaseException:
            self._retire(batch)
            raise
        self._queue.append(batch)
        if self._executor is None:
            self._executor = cf.ThreadPoolExecutor(1, thread_name_prefix="embstore-prefetch")
        batch.future = self._executor.submit(self._fetch, batch, before)
        return batch

    def pipeline(self, batches: Iterable[Any], lookahead: int | None = None,
                 sparse: Callable[[Any], Any] | None = None, announce: int = 0) -> Iterator[Any]:
        """Yield ``batches`` unchanged while the next ``lookahead`` ones are prefetched.

        ``sparse(batch)`` gives the part :meth:`forward` takes: an (ids, offsets)
        pair or a KeyedJaggedBatch (default: the batch itself). ``announce=A``
        reads A batches further ahead and tells the tables' caches what the
        store will read for each (``Table.announce_rows``), so they keep the
        rows needed soonest, as Belady's MIN does inside that window. The store
        reads a batch's rows when its fetch runs, and only the rows none of the
        ``lookahead`` batches before it uses (the working set holds those), so
        a table is told just those rows, and it advances past a batch right
        before the next batch's fetch reads (see ``_Teller``; on the prefetch
        thread when ``lookahead`` > 0); past every batch told when the loop is
        left. ``embstore.simulator.pipeline_accesses`` replays that sequence. It
        changes which rows stay cached in the store, never the numbers trained.
        """
        k = self.lookahead if lookahead is None else _check_lookahead(lookahead)
        ahead = _check_lookahead(announce, "announce")
        if self._all_rows_on_accelerator():
            k = 0  # nothing to fetch: every row is already where the step runs
        if ahead and k + 1 + ahead > MAX_ANNOUNCED:  # refused now, not after reading that many batches
            raise InvalidInputError(f"pipeline: announce={ahead} with lookahead={k} keeps {k + 1 + ahead} batches "
                                    f"announced at once, more than a table keeps pending ({MAX_ANNOUNCED}); give "
                                    f"announce <= {MAX_ANNOUNCED - 1 - k}")
        get = sparse or (lambda b: b)
        it = iter(batches)
        told: collections.deque[tuple[Any, Any]] = collections.deque()  # read (and told), not prefetched
        window: collections.deque[Any] = collections.deque()  # prefetched (or, with k = 0, next), not yielded
        queued: list[_Batch] = []  # what this pipeline prefetched
        teller = _Teller(self.tables, k, ahead) if ahead else None

        def read() -> bool:
            try:
                b = next(it)
            except StopIteration:
                return False
            s = get(b) if k or ahead else None
            if s is not None and not isinstance(s, KeyedJaggedBatch) and not (isinstance(s, (tuple, list))
                                                                              and len(s) == 2):
                raise InvalidInputError("pipeline: the sparse part of a batch must be an (ids, offsets) pair or a "
                                        f"KeyedJaggedBatch (pass sparse=...), got {type(s).__name__}")
            if teller is not None:
                ids, _ = normalize(self.table_names, *((s,) if isinstance(s, KeyedJaggedBatch) else s))
                teller.read([self._physical(t, t_ids).reshape(-1) for t, t_ids in enumerate(ids)])
            told.append((b, s))
            return True

        def pull() -> bool:
            """Top the windows up: A batches read beyond the k prefetched, beyond the one yielded next."""
            while len(told) + len(window) < k + 1 + ahead and read():
                pass
            if not told or len(window) >= k + 1:
                return False
            b, s = told.popleft()
            if k:
                queued[:] = [q for q in queued if not q.retired]  # forwarded and stepped: done with
                before = teller.before_fetch if teller is not None else None
                queued.append(self._prefetch(s, before=before) if isinstance(s, KeyedJaggedBatch)
                              else self._prefetch(*s, before=before))
            window.append(b)
            return True

        try:
            while pull():
                pass
            while window:
                if teller is not None and not k:  # the fetch runs in forward, here: after the last write-back
                    cf.wait(list(self._writes))
                    teller.before_fetch()
                yield window.popleft()
                while pull():
                    pass
        finally:  # a loop left early (break, an exception) must not leave its look-ahead pinned in the queue
            self._drop_prefetched(queued)
            if teller is not None:  # nor what it told pending in the tables
                cf.wait([q.future for q in queued if q.future is not None])
                teller.close()

    def flush(self) -> None:
        """Write every dirty working-set row (with its state) back and make the tables durable."""
        self._drain()
        with self._lock:
            for ws in self.ws:
                self.counters["written_back_rows"] += ws.write_back_all()
            stores: list[Any] = []  # each store flushed once: its log too, whose older writes would replay
            for t in self.tables:
                if t.store_flush is None:
                    t.flush()
                elif t.store_flush not in stores:
                    stores.append(t.store_flush)
                    t.flush_durable()

    def release(self) -> None:
        """Drop the whole window (pending batches get no update), write rows back and stop the thread."""
        self._drain()
        with self._lock:
            for b in list(self._pending.values()):
                b.retired = True
            self._pending.clear()
            self._queue.clear()
            self._awaiting.clear()
            for ws in self.ws:
                self.counters["written_back_rows"] += ws.write_back_all()
                ws.evict_before(float("inf"))
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def stats(self) -> dict[str, Any]:
        """Counters plus working-set occupancy per table."""
        out: dict[str, Any] = dict(self.counters, steps=self.steps)
        out["working_set_rows"] = {t.name: ws.resident for t, ws in zip(self.tables, self.ws)}
        return out

    # --- checkpoint ------------------------------------------------------------------
    def get_extra_state(self) -> dict[str, Any]:
        return {"tables": list(self.table_names), "optimizer": asdict(self.optim), "pooling": self.pooling,
                "lookahead": self.lookahead, "steps": self.steps, "counters": dict(self.counters)}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint's settings, checked like the constructor's arguments (nothing changes on error)."""
        try:
            tables, optim, pooling = list(state["tables"]), OptimConfig(**state["optimizer"]), state["pooling"]
            lookahead, steps, counters = state["lookahead"], int(state["steps"]), dict(state["counters"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidInputError(f"not a TieredEmbeddingBagCollection checkpoint state: {exc!r}") from None
        if tables != self.table_names:
            raise InvalidInputError(f"checkpoint is for tables {tables}, this module has {self.table_names}")
        if optim.name != self.optim.name:
            raise InvalidInputError(f"checkpoint was trained with {optim.name!r}, this module "
                                    f"uses {self.optim.name!r} (the stored optimizer state would not match)")
        _check_settings(optim.name, pooling, lookahead, optim.adam_step)
        check_hyperparameters(optim.lr, optim.eps, (optim.beta1, optim.beta2), optim.weight_decay)
        if steps < 0:
            raise InvalidInputError(f"checkpoint steps must be >= 0, got {steps}")
        self.optim, self.pooling, self.lookahead = optim, pooling, int(lookahead)
        self.steps, self.counters = steps, counters

    # --- internals -------------------------------------------------------------------
    def _new_batch(self, id_list: list[np.ndarray], off_list: list[np.ndarray]) -> _Batch:
        with self._lock:
            batch = _Batch(self._next_seq, id_list, off_list)
            self._next_seq += 1
            self._pending[batch.seq] = batch
        return batch

    def _physical(self, t: int, ids: np.ndarray) -> np.ndarray:
        table = self.tables[t]
        if table.mapper is not None:
            return table.mapper(ids)
        if len(ids):
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= table.config.num_embeddings:
                bad = lo if lo < 0 else hi
                raise IdOutOfRangeError(f"table {table.name!r}: id {bad} outside [0, {table.config.num_embeddings})")
        return ids

    def _reserve(self, batch: _Batch) -> None:
        """Dedup the batch's rows and pin them in the working sets (caller's thread, cheap).

        Done synchronously when the batch enters the window so that a row it
        shares with the batch being trained is pinned before that batch retires.
        """
        rows = [self._physical(t, batch.ids[t]).reshape(-1) for t in range(len(self.ws))]
        for ws, (uniq, inv) in zip(self.ws, unique_inverse_each(rows)):
            if ws.table.recorder is not None:  # a trace of training: each batch's distinct rows (embstore.recorder)
                ws.table.recorder(ws.table.name, uniq)
            with self._lock:
                slots, missing = ws.reserve(uniq, batch.seq)
            batch.uniq.append(uniq)
            batch.inv.append(inv)
            batch.slots.append(slots)
            batch.missing.append(missing)
            batch.fetched += int(missing.sum())

    def _fetch(self, batch: _Batch, before: Callable[[], None] | None = None) -> None:
        """Read the batch's rows that are not in the working set yet from the store into their slots (any
        thread; fetches run one at a time). Which rows is decided now, not at reserve time: a row the batch
        shares with an earlier one whose fetch failed is read here."""
        try:
            if before is not None:
                before()
            for t, ws in enumerate(self.ws):
                if self._recheck_loads:  # after a failure: the reserve-time mask may name rows never filled
                    with self._lock:
                        load = ws.unloaded(batch.uniq[t], batch.slots[t])
                else:  # the common case: the mask taken at reserve (rechecking cost 30% of a resident step)
                    load = batch.missing[t]
                if load.any():
                    vals, st = ws.table.read_with_state(batch.uniq[t][load])  # outside the lock: the slow part
                    with self._lock:
                        ws.fill(batch.slots[t][load], vals, st)
        except BaseException:
            self._recheck_loads = True
            raise

    def _take_prefetched(self, id_list: list[np.ndarray], off_list: list[np.ndarray]) -> _Batch | None:
        """The queued batch equal to this forward's, or None (then it is fetched on demand).

        Batches queued before it were skipped (a loop that passed over a batch, a manual ``prefetch`` never
        forwarded): they are dropped, their rows unpinned. Left at the head of the queue, they would keep
        every later forward from matching and their rows pinned for good. A batch that matches none (say
        an evaluation batch between training ones) leaves the queue as it is."""
        at = next((i for i, b in enumerate(self._queue)
                   if all(np.array_equal(a, c) for a, c in zip(b.ids, id_list))
                   and all(np.array_equal(a, c) for a, c in zip(b.offsets, off_list))), None)
        if at is None:
            if self._queue:
                log.warning("forward got a batch that was not prefetched; fetching it on demand")
            return None
        if at:
            log.warning("forward skipped %d prefetched batch(es); dropping them", at)
            self._drop_prefetched(list(itertools.islice(self._queue, at)))
        b = self._queue.popleft()
        assert b.future is not None
        if not b.future.done():
            t0 = time.perf_counter()
            cf.wait([b.future])
            self.counters["stall_s"] += time.perf_counter() - t0
            self.counters["late_rows"] += b.fetched
        if b.future.exception() is not None:  # re-raise a failed prefetch, its rows unpinned
            self._retire(b)
            b.future.result()
        self.counters["prefetched_rows"] += b.fetched
        return b

    def _drop_prefetched(self, batches: Sequence[_Batch]) -> None:
        """Take ``batches`` that are still queued (prefetched, never forwarded) out of the window.

        A stale batch at the head of the queue would stop every later prefetch
        from matching and keep its rows (and every newer one) pinned for good.
        """
        drop = [b for b in batches if any(b is q for q in self._queue)]
        if not drop:
            return
        self._queue = collections.deque(q for q in self._queue if not any(q is b for b in drop))
        for b in drop:
            if b.future is not None:
                cf.wait([b.future])  # its fetch fills slots that retiring frees; a failed read concerns no one
            self._retire(b)

    def _drain(self) -> None:
        """Wait until no prefetch or write-back is in flight (a demand fetch must not race one).

        A failed prefetch is not raised here but by the forward of its batch: flush, release or another
        batch's forward must still work once the fault has cleared. A failed write-back is raised.
        """
        cf.wait([b.future for b in self._queue if b.future is not None])
        self._reap_writes(wait=True)

    def _write_behind(self, ws: Any, keys: np.ndarray, rows: np.ndarray, state: np.ndarray) -> None:
        """Write evicted rows back on the prefetch thread, off the training step's path.

        That thread runs its jobs in order, and a row evicted here can only be
        fetched again by a batch reserved after this point, whose fetch job
        comes later: no fetch reads a row older than its write-back. A failed
        write is raised by the next forward, flush or release.
        """
        if self._executor is None:
            ws.table.write_with_state(keys, rows, state)  # failing, the rows stay in the working set (_retire)
            return
        self._writes.append(self._executor.submit(self._write_back_job, ws, keys, rows, state))

    def _write_back_job(self, ws: Any, keys: np.ndarray, rows: np.ndarray, state: np.ndarray) -> None:
        """One write-behind (prefetch thread). A failed one puts its rows back into the working set, dirty,
        before any later fetch could read their stale store copies, so no trained update is lost."""
        try:
            ws.table.write_with_state(keys, rows, state)
        except BaseException:
            with self._lock:
                ws.readmit(keys, rows, state)
                self._recheck_loads = True  # a later batch's fetch must skip the rows readmitted into its slots
            raise

    def _reap_writes(self, wait: bool = False) -> None:
        """Forget finished write-behind jobs (all of them with ``wait``), raising the first failure."""
        while self._writes and (wait or self._writes[0].done()):
            self._writes.popleft().result()

    def _gatherer(self, batch: _Batch, t: int) -> Callable[[], torch.Tensor]:
        ws = self.ws[t]

        def gather() -> torch.Tensor:
            with self._lock, _tier_lock(ws):  # a resident tier's rows: a PUT on another thread must land whole
                return ws.rows[torch.from_numpy(batch.slots[t]).to(ws.device)]
        return gather

    def _stepper(self, batch: _Batch, t: int, bag_grad: bool = False) -> Callable[[torch.Tensor], None]:
        """The optimizer step of table ``t``: given unique-row gradients, or (``bag_grad``, resident
        tables) the bag gradients, which the fused kernel turns into row gradients as it updates.

        A row whose step would overflow float32 keeps its row and state (checked before storing, in the
        kernel); the others keep their update, and the step then raises ``InvalidRowsError``. Undoing
        them too would need a copy of every row stepped or a second pass over them, on a kernel bound
        by memory traffic; that costs more than the rare failed step is worth."""
        ws = self.ws[t]

        def step(grad: torch.Tensor) -> None:
            with self._lock, _tier_lock(ws):  # a resident table's rows are stepped in place: no lookup, PUT or
                self._check_step_order(batch, t)  # flush on another thread may see them half done
                grad = grad.to(torch.float32).contiguous()
                check_finite_gradient(grad, self.table_names[t])
                skipped = self._step_table(batch, t, grad, bag_grad)
                self._round_to_format(t, batch.slots[t])
                ws.dirty[batch.slots[t]] = True
                self._stepped(batch, t, skipped, len(batch.slots[t]))
        return step

    def _round_to_format(self, t: int, slots: np.ndarray) -> None:
        """Round table ``t``'s stepped rows to what its float16 / int8 format stores, as their write-back would.

        The working set holds float32. Left unrounded, a row kept there from one step to the next (a later
        batch in the look-ahead window uses it) trained on values the store never held, while one that left
        in between was rounded: the trained numbers depended on ``lookahead``, on where a pipeline was cut,
        and on a checkpoint (a flush) taken mid-window. Rounded here, every step reads its rows as stored."""
        fmt = self._format[t]
        if fmt is None or not len(slots):
            return
        ws = self.ws[t]
        idx = torch.from_numpy(slots).to(ws.device)
        if fmt.dtype is RowDType.FLOAT16:
            ws.rows[idx] = ws.rows[idx].to(torch.float16).to(torch.float32)
        else:
            ws.rows[idx] = torch.from_numpy(fmt.decode(fmt.encode(ws.rows[idx].cpu().numpy()))).to(ws.device)

    def _check_step_order(self, batch: _Batch, t: int) -> None:
        """The protocol: one backward per forward, before the next forward."""
        if t in batch.stepped:  # first: a batch whose last table stepped is retired too
            raise RuntimeError("embstore: a second backward through the same forward; its rows took the "
                               "first one's step only (call backward once per forward)")
        if batch.retired:
            raise RuntimeError("embstore: backward for a batch whose next forward already ran; "
                               "call backward once per forward, before the next forward")

    def _stepped(self, batch: _Batch, t: int, skipped: int, rows: int) -> None:
        """Table ``t`` of ``batch`` is stepped: retire the batch after its last table, then report rows
        whose step would have overflowed (they kept their values)."""
        batch.stepped.add(t)
        if len(batch.stepped) == len(self.tables):
            self._awaiting.remove(batch)
            self._retire(batch)
        if skipped:
            raise overflow_error(self.table_names[t], self.optim, skipped, rows,
                                 float16=self._row_limit[t] is not None)

    # --- tables held whole on an accelerator -----------------------------------------------
    def _all_rows_on_accelerator(self) -> bool:
        """Every table is held whole, every row present, in an accelerator's device tier: then a step
        needs nothing from the host but the ids (see ``_forward_on_accelerator``)."""
        return all(isinstance(ws, ResidentWorkingSet) and ws.device.type != "cpu" and ws.tier.directory.full
                   and ws.table.recorder is None
                   and (ws.table.mapper is None or ws.table.mapper.rows_per_id == 1) for ws in self.ws)

    def _forward_on_accelerator(self, id_list: list[np.ndarray], off_list: list[np.ndarray],
                                grad_on: bool) -> torch.Tensor:
        """``forward`` when ``_all_rows_on_accelerator``: ids are checked (and hashed) on the host, then
        deduplicated, gathered, pooled and (in backward) stepped in the device tier's slab on the device,
        with one read back per table and step. The host's dedup and slot bookkeeping of the general path
        cost more than the whole device step (BENCHMARKS.md, GPU)."""
        batch = self._new_batch(id_list, off_list)
        outs = []
        for t, ws in enumerate(self.ws):
            rows = self._physical(t, id_list[t]).reshape(-1)
            uniq, inv = torch.unique(torch.from_numpy(rows).to(ws.device), return_inverse=True)
            offs = torch.from_numpy(off_list[t]).to(ws.device)
            with _tier_lock(ws):  # enqueued before a later write's kernels: the copy sees no half-written row
                w = ws.rows.index_select(0, uniq)
            if grad_on:
                outs.append(_FusedBag.apply(torch.empty(0, requires_grad=True), w, inv, offs, self.pooling,
                                            self._accelerator_stepper(batch, t, uniq)))
            else:
                outs.append(F.embedding_bag(inv, w, offs, mode=self.pooling, include_last_offset=True))
        self.counters["batches"] += 1
        if grad_on:
            self._awaiting.append(batch)
        else:
            self._retire(batch)
        return torch.stack([o.to(self.device) for o in outs], dim=1)

    def _accelerator_stepper(self, batch: _Batch, t: int, uniq: torch.Tensor) -> Callable[[torch.Tensor], None]:
        """The step of ``_forward_on_accelerator``: updated copies of the rows, then one read back of
        (non-finite gradient values, rows whose update is not finite) before anything is stored, so a bad
        gradient leaves every row as it was and an overflowing row keeps its values (as ``_stepper``)."""
        ws = self.ws[t]

        def step(grad: torch.Tensor) -> None:
            with self._lock, _tier_lock(ws):  # the rows are stored in the table's own tier, as in _stepper
                self._check_step_order(batch, t)
                grad = grad.to(torch.float32).contiguous()
                w, st = ws.rows.index_select(0, uniq), ws.state.index_select(0, uniq)
                apply_update(self.optim, w, st, grad, self.steps + 1)
                ok = finite_rows(w, st)
                bad_grad, skipped = torch.stack([(~torch.isfinite(grad)).sum(), (~ok).sum()]).tolist()
                if bad_grad:
                    check_finite_gradient(grad, self.table_names[t])  # raises, naming the count
                if skipped:
                    w = torch.where(ok[:, None], w, ws.rows.index_select(0, uniq))
                    st = torch.where(ok[:, None], st, ws.state.index_select(0, uniq))
                ws.rows[uniq] = w
                if ws.state_dim:
                    ws.state[uniq] = st
                ws.dirty[uniq.cpu().numpy()] = True
                self._stepped(batch, t, skipped, len(uniq))
        return step

    def _step_table(self, batch: _Batch, t: int, grad: torch.Tensor, bag_grad: bool) -> int:
        """Step table ``t``'s rows of ``batch`` (caller holds the lock); returns how many rows were left
        as they were because their new row or state was not finite, or (a float16 table) a new row would
        not fit float16: written back, it would be refused at every later write-back and flush."""
        ws, limit = self.ws[t], self._row_limit[t]
        if limit is None or ws.device.type != "cpu":
            return self._optimizer_step(batch, t, grad, bag_grad, limit)
        idx = torch.from_numpy(batch.slots[t])
        before_rows, before_state = ws.rows[idx], ws.state[idx]  # copies, to undo the rows that do not fit
        skipped = self._optimizer_step(batch, t, grad, bag_grad, None)
        unfit = (ws.rows[idx].abs() >= limit).any(dim=1)
        if bool(unfit.any()):
            ws.rows[idx[unfit]] = before_rows[unfit]
            if ws.state_dim:
                ws.state[idx[unfit]] = before_state[unfit]
            skipped += int(unfit.sum())
        return skipped

    def _optimizer_step(self, batch: _Batch, t: int, grad: torch.Tensor, bag_grad: bool,
                        limit: float | None) -> int:
        """The step of ``_step_table``: rows whose new values or state would not be finite keep theirs, and on an
        accelerator also those with a new value of magnitude ``limit`` or more (the CPU kernels leave that
        check to ``_step_table``)."""
        ws, o = self.ws[t], self.optim
        if ws.device.type == "cpu":
            gstep = self.steps + 1 if o.adam_step == "global" else 0
            rows = ws.flat if isinstance(ws, ResidentWorkingSet) else ws.rows.numpy()
            with kernel_threads(len(batch.inv[t])) as parts:
                if bag_grad:
                    return fused_bag_step(_KIND[o.name], rows, ws.state.numpy(), batch.slots[t], batch.inv[t],
                                          batch.offsets[t], grad.numpy(), self.pooling == "mean", o.lr, o.eps,
                                          o.beta1, o.beta2, o.weight_decay, gstep, parts)
                return step_rows(_KIND[o.name], rows, ws.state.numpy(), batch.slots[t], grad.numpy(), o.lr, o.eps,
                                 o.beta1, o.beta2, o.weight_decay, gstep, parts)
        idx = torch.from_numpy(batch.slots[t]).to(ws.device)
        w, s = ws.rows[idx], ws.state[idx]  # copies: nothing is stored before the check
        apply_update(o, w, s, grad, self.steps + 1)
        ok = finite_rows(w, s, limit)
        skipped = int((~ok).sum())
        if skipped:
            idx, w, s = idx[ok], w[ok], s[ok]
        ws.rows[idx] = w
        if ws.state_dim:
            ws.state[idx] = s
        return skipped

    def _pool(self, table: Any, w: torch.Tensor, batch: _Batch, t: int) -> torch.Tensor:
        dev = w.device
        offs = torch.from_numpy(batch.offsets[t]).to(dev)
        inv = torch.from_numpy(batch.inv[t]).to(dev)
        if table.mapper is not None and table.mapper.rows_per_id != 1:
            n = len(batch.ids[t])
            emb = table.mapper.combine(w[inv].view(n, table.mapper.rows_per_id, w.shape[1]))  # explicit: n may be 0
            idx = torch.arange(n, device=dev)
            return F.embedding_bag(idx, emb, offs, mode=self.pooling, include_last_offset=True)
        return F.embedding_bag(inv, w, offs, mode=self.pooling, include_last_offset=True)

    def _retire_unfinished(self) -> None:
        with self._lock:
            for b in self._awaiting:
                self._retire(b)
            self._awaiting.clear()

    def _retire(self, batch: _Batch) -> None:
        """The batch leaves the window; rows no remaining batch uses go back to the store."""
        with self._lock:
            if batch.retired:
                return
            batch.retired = True
            self._pending.pop(batch.seq, None)
            if batch.stepped:
                self.steps += 1
            horizon = min(self._pending) if self._pending else float("inf")
            for ws in self.ws:
                try:
                    self.counters["written_back_rows"] += ws.evict_before(horizon, self._write_behind)
                except TierIOError as exc:  # a synchronous write-back: its rows stay in the working set, dirty
                    failed: cf.Future = cf.Future()  # raised by the next forward, flush or release, like a
                    failed.set_exception(exc)        # failed write-behind: the step that got here succeeded
                    self._writes.append(failed)

    def __repr__(self) -> str:
        return (f"TieredEmbeddingBagCollection(tables={self.table_names}, dim={self.dim}, "
                f"optimizer={self.optim.name!r}, lr={self.optim.lr}, pooling={self.pooling!r}, "
                f"lookahead={self.lookahead})")
