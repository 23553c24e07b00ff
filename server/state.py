"""The open store behind a server: per-table services, leases, periodic flush and hot reload.

Every request that touches the store holds a *lease* on the current
:class:`Served` (the open store and its per-table batchers and pooled caches)
for as long as it uses it. Leases are counted on the event loop, so no lock is
needed. A reload closes the gate to new leases (arrivals wait, they do not
fail), waits until the leases in flight are returned, then - shielded from
cancellation - flushes the old store, closes it and opens the new one, and
reopens the gate. The store is not opened twice at once: an open store holds
an exclusive flock on ``STORE/LOCK``, so the reopen waits for the close, and a
CLI verb run on a served store is refused. A reload whose flush fails (a full disk, EIO) is
refused and the old store goes on serving, its unflushed rows still in memory:
closing it would drop every acknowledged row that is not yet in its home (all
of them without durable writes), and with durable writes the reopen's replay
would fail the same way and leave no store open.

All store calls block (numba, io_uring), so they run in worker threads
(:func:`offload`); a table serialises its own calls with its lock.

The trained models kept in the store (``STORE/models/NAME``, see
``training/registry.py``) are loaded with the store, at startup and on every
reload, so a reload picks up a newly trained model. A model's embedding-bag
collection is not thread-safe, so each model scores one request at a time:
requests queue on an asyncio lock (no worker thread waits), and the worker
holds a thread lock too, because a timed-out request abandons - does not
stop - its thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import numpy as np

import embstore
from embstore.config import StoreConfig
from embstore.errors import (CorruptStoreError, EmbstoreError, InvalidInputError, StoreNotFoundError,
                             UnknownTableError)
from embstore.server.batching import LookupBatcher
from embstore.server.errors import ApiError
from embstore.server.pooled_cache import PooledCache
from embstore.server.protocol import check_mode
from embstore.server.settings import ServerSettings
from embstore.store import CONFIG_FILE, MANIFEST_FILE, Store
from embstore.table import Table

log = logging.getLogger("embstore.server")
T = TypeVar("T")


async def offload(fn: Callable[..., T], *args: Any) -> T:
    """Run blocking ``fn(*args)`` in a worker thread; a request timeout abandons (not kills) it."""
    return await anyio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)


async def offload_shielded(fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` in a worker thread to completion, whatever cancels the caller."""
    with anyio.CancelScope(shield=True):
        return await anyio.to_thread.run_sync(fn, *args)


INLINE_MAX_IDS = 1024  # memory-resident lookups up to this size run on the event loop


class GroupCommit:
    """Durable acknowledgements: a writer waits for a sync that began after its write was logged.

    Writers arriving while a sync runs queue on one lock and share the next
    one, so N concurrent writes cost about two syncs, not N. The counters live
    on the event loop; only the sync itself (``Store.sync_log``: one
    ``fdatasync`` of the write-ahead log) runs in a worker thread, shielded:
    once started it finishes even if its request times out.

    A failed log sync is not retried: after an ``fdatasync`` error Linux marks
    the lost pages clean, so a second one "succeeds" without them, and the
    hole they leave in the log ends its replay there, hiding every write
    logged after it. Instead ``flush`` (the tables' own syncs, which also
    retire the damaged segment) makes the writes durable; until a flush
    succeeds every acknowledgement waits for one.
    """

    def __init__(self, sync: Callable[[], None], flush: Callable[[], None]) -> None:
        self._sync = sync
        self._flush = flush
        self._lock = asyncio.Lock()
        self._applied = 0  # writes applied, in the order they were noted
        self._durable = 0  # writes covered by a finished sync
        self._log_failed = False  # a log sync failed and no flush has succeeded since
        self.syncs = 0

    def note_write(self) -> int:
        """Call on the event loop once a write is applied; returns its ticket."""
        self._applied += 1
        return self._applied

    async def wait_durable(self, ticket: int) -> None:
        async with self._lock:
            if self._durable >= ticket:
                return
            target = self._applied
            if not self._log_failed:
                try:
                    await offload_shielded(self._sync)
                except Exception as exc:
                    log.error("syncing the write-ahead log failed (%s): writes are acknowledged after a flush "
                              "until one succeeds", exc)
                    self._log_failed = True
            if self._log_failed:
                await offload_shielded(self._flush)  # raises to this writer; the next one tries again
                self._log_failed = False
            self.syncs += 1
            self._durable = target


class TableService:
    """What the server keeps per table: validation, the lookup batcher and the pooled cache."""

    def __init__(self, table: Table, settings: ServerSettings) -> None:
        self.table = table
        self.cache = PooledCache(table.lookup_pooled, self._rows_of, table.dim, settings.pooled_cache_bytes)
        self.batcher = (LookupBatcher(table.lookup, offload, wait=settings.batch_wait,
                                      max_ids=settings.batch_max_ids) if settings.batching else None)
        # Run small lookups of memory-resident tables inline, but only when the table's lock is free
        # right now: a write or flush in progress sends the request to a worker thread instead, so
        # the event loop never waits on the lock.
        self._inline_ok = table.memory_resident

    def _inline(self, fn: Callable[..., T], n_ids: int, *args: Any) -> tuple[bool, T | None]:
        """(True, fn(*args)) run right here if that cannot block, else (False, None)."""
        if not self._inline_ok or n_ids > INLINE_MAX_IDS:
            return False, None
        with self.table.try_locked() as got:
            return (True, fn(*args)) if got else (False, None)

    def _rows_of(self, ids: np.ndarray) -> np.ndarray:
        return self.table.physical_rows(ids)

    def check_ids(self, ids: np.ndarray) -> None:
        """The table's own range check, done before a request joins a batch."""
        self.table.physical_rows(ids)

    async def lookup(self, ids: np.ndarray) -> np.ndarray:
        done, rows = self._inline(self.table.lookup, len(ids), ids)  # the table checks the ids itself
        if done:
            return rows
        if self.batcher is not None:
            self.check_ids(ids)  # one bad request must not fail the batch it joins
            return await self.batcher.lookup(ids)
        return await offload(self.table.lookup, ids)

    async def lookup_pooled(self, ids: np.ndarray, offsets: np.ndarray, mode: str) -> np.ndarray:
        check_mode(mode)
        self.check_ids(ids)
        done, rows = self._inline(self.cache.lookup_pooled, len(ids), ids, offsets, mode)
        if done:
            return rows
        return await offload(self.cache.lookup_pooled, ids, offsets, mode)

    def update(self, ids: np.ndarray, rows: np.ndarray, write: Callable[..., None] | None = None) -> None:
        """Blocking: write (with ``write(ids, rows)`` if given) with the cached bags holding those rows
        out of use meanwhile (see ``PooledCache.begin_write``), then invalidate them - also when the
        write fails, since a machine failure may leave part of it applied."""
        try:
            writing = self.cache.begin_write(ids)
        except InvalidInputError:  # ids the table refuses: the write below reports them
            writing = None
        try:
            (write or self.table.update)(ids, rows)
        finally:
            self.cache.end_write(writing)


class ModelService:
    """One trained model over the served store, scoring one request at a time."""

    def __init__(self, name: str, model: Any) -> None:
        self.name = name
        self.model = model
        self.spec = model.spec
        self._thread_lock = threading.Lock()
        self._queue = asyncio.Lock()

    def info(self) -> dict[str, Any]:
        s = self.spec
        return {"name": self.name, "tables": list(s.tables), "embedding_dim": s.embedding_dim,
                "dense_in_features": s.dense_in_features, "interaction": s.interaction}

    def score(self, dense: np.ndarray, ids: list[np.ndarray], offsets: list[np.ndarray]) -> np.ndarray:
        """Blocking: click probabilities, float32 (batch,)."""
        if len(dense) == 0:
            return np.zeros(0, np.float32)
        import torch

        from embstore.training.registry import predict

        with self._thread_lock:
            out = predict(self.model, torch.from_numpy(dense), [torch.from_numpy(i) for i in ids],
                          [torch.from_numpy(o) for o in offsets])
        return out.numpy().astype(np.float32, copy=False)

    async def predict(self, dense: np.ndarray, ids: list[np.ndarray], offsets: list[np.ndarray]) -> np.ndarray:
        async with self._queue:
            return await offload(self.score, dense, ids, offsets)

    def close(self) -> None:
        with self._thread_lock:
            self.model.sparse_arch.ebc.release()


def load_models(store: Store) -> tuple[dict[str, ModelService], dict[str, str]]:
    """Blocking: every model kept in ``store`` -> (services, {name: why it could not be loaded})."""
    from embstore.training.registry import list_models

    names = list_models(store.path)
    if not names:
        return {}, {}
    from embstore.training.registry import load_model

    models, broken = {}, {}
    for name in names:
        try:
            models[name] = ModelService(name, load_model(store, name))
        except Exception as exc:  # one unreadable model must not keep the store's tables from being served
            broken[name] = f"{type(exc).__name__}: {exc}"
            log.error("model %s in %s cannot be loaded: %s", name, store.path, exc)
    return models, broken


class Served:
    """One open store, its table services and its models."""

    def __init__(self, store: Store, settings: ServerSettings) -> None:
        self.store = store
        # models first: loading one may re-lay-out an empty table (optimizer state), replacing its object
        self.models, self.broken_models = load_models(store)
        self.services = {name: TableService(t, settings) for name, t in store.tables.items()}
        self.dirty = False  # rows written since the last flush
        self.durable_writes = settings.durable_writes
        self._flush_lock = threading.Lock()  # the periodic flush and the commit's fallback flush
        self.commit = GroupCommit(store.sync_log, self.flush)

    def model(self, name: str) -> ModelService:
        try:
            return self.models[name]
        except KeyError:
            pass
        if name in self.broken_models:
            raise ApiError(503, f"model {name!r} could not be loaded ({self.broken_models[name]}); fix it and "
                                "POST /v1/admin/reload")
        raise ApiError(404, f"no model {name!r}; known models: {', '.join(sorted(self.models)) or '(none)'}")

    def close(self) -> None:
        """Blocking: release the models, then flush and close the store."""
        for m in self.models.values():
            try:
                m.close()
            except Exception as exc:
                log.error("releasing model %s failed: %s", m.name, exc)
        self.store.close()

    def service(self, name: str) -> TableService:
        try:
            return self.services[name]
        except KeyError:
            raise UnknownTableError(name, list(self.services)) from None

    def update(self, name: str, ids: np.ndarray, rows: np.ndarray) -> None:
        """Blocking: apply a write; with durable writes also log it (``commit`` then makes it durable)."""
        logged = (lambda i, r: self.store.update_logged(name, i, r)) if self.durable_writes else None
        self.service(name).update(ids, rows, logged)
        self.dirty = True

    def flush(self) -> None:
        """Blocking: flush the store; a failed flush leaves it dirty, so the next periodic one retries
        (otherwise rows written before the failure would wait for some later write to be flushed)."""
        with self._flush_lock:
            self.dirty = False  # before: writes landing during the flush mark it again
            try:
                self.store.flush()
            except BaseException:
                self.dirty = True
                raise


def precheck_store(path: Path) -> None:
    """Cheap checks that ``path`` holds a readable store, before the open one is given up."""
    if not (path / MANIFEST_FILE).exists():
        raise StoreNotFoundError(f"no embstore store at {path} (missing {MANIFEST_FILE})")
    try:
        json.loads((path / MANIFEST_FILE).read_text())
        StoreConfig.from_toml(path / CONFIG_FILE)
    except (OSError, ValueError) as exc:
        raise CorruptStoreError(f"{path} cannot be read: {exc}") from exc


class StoreGate:
    """Hands out leases on the current :class:`Served`; reloads and flushes it."""

    def __init__(self, settings: ServerSettings, opener: Callable[[Path], Store] = embstore.open) -> None:
        self.settings = settings
        self._opener = opener
        self.current: Served | None = None
        self.reloads = 0
        self._active = 0
        self._reopened: asyncio.Event | None = None  # set while a reload holds the gate
        self._drained: asyncio.Event | None = None
        self._reload_lock = asyncio.Lock()
        self._unavailable = "the store is not open yet"

    @property
    def active(self) -> int:
        """Leases in flight."""
        return self._active

    async def open(self) -> None:
        self.current = await offload_shielded(self._open_served)

    def _open_served(self) -> Served:
        store = self._opener(self.settings.store)
        try:
            return Served(store, self.settings)
        except BaseException:
            store.close()
            raise

    @asynccontextmanager
    async def lease(self) -> AsyncIterator[Served]:
        """The current store, kept open until the block exits."""
        while self._reopened is not None:
            await self._reopened.wait()
        served = self.current
        if served is None:
            raise ApiError(503, self._unavailable)
        self._active += 1
        try:
            yield served
        finally:
            self._active -= 1
            if self._active == 0 and self._drained is not None:
                self._drained.set()

    async def _drain(self) -> None:
        while self._active:
            self._drained = asyncio.Event()
            await self._drained.wait()
        self._drained = None

    async def reload(self) -> Served:
        """Reopen the store from disk once the requests using the old one have finished and its rows
        are flushed."""
        async with self._reload_lock:
            try:  # refuse early and keep serving the open store
                await offload(precheck_store, self.settings.store)
            except (EmbstoreError, OSError) as exc:
                raise ApiError(409, f"reload refused, still serving the store opened before: {exc}") from exc
            self._reopened = asyncio.Event()
            try:
                await self._drain()
                await self._flush_before_reload(self.current)
                old, self.current = self.current, None
                try:
                    self.current = await offload_shielded(self._swap, old)
                except Exception as exc:
                    raise ApiError(503, self._unavailable) from exc
                self.reloads += 1
                return self.current
            finally:
                self._reopened.set()
                self._reopened = None

    async def _flush_before_reload(self, served: Served | None) -> None:
        """Flush ``served`` before it is given up; if that fails, refuse the reload (``503``) and keep it
        open and dirty, so that a later flush (periodic, the next reload, shutdown) still saves its rows
        once space is freed or the storage repaired. A failure no flush can get past (a failed data
        sync: ``TierIOError.final``) with durable writes is the exception: reopening is the cure there,
        and the write-ahead log, which no flush has emptied, replays every acknowledged write."""
        if served is None:
            return
        try:
            await offload_shielded(served.flush)
        except Exception as exc:
            final = bool(getattr(exc, "final", False))
            if final and served.durable_writes:
                log.warning("reload of %s: a sync of the open store failed for good (%s); reopening it, "
                            "its write-ahead log replays the acknowledged writes", self.settings.store, exc)
                return
            kept = "in memory and in the write-ahead log" if served.durable_writes else "in memory only"
            log.error("reload of %s refused: flushing the open store failed: %s", self.settings.store, exc)
            if final:
                raise ApiError(503, f"reload refused, still serving the store opened before: a sync failed for "
                                    f"good ({exc}); without durable writes the rows written since the last good "
                                    "flush are kept in memory only and a reload or restart loses them") from exc
            raise ApiError(503, f"reload refused, still serving the store opened before: flushing its written "
                                f"rows failed ({exc}); they are kept {kept} until a flush succeeds: free space "
                                "or repair the storage, then retry the reload") from exc

    def _swap(self, old: Served | None) -> Served:
        if old is not None:
            try:  # the flush before saved every acknowledged write, and none came since (the gate is shut)
                old.close()
            except Exception as exc:  # so reopen anyway: a close that fails here loses nothing acknowledged
                log.error("closing %s before the reload failed: %s", self.settings.store, exc)
        try:
            return self._open_served()
        except Exception as exc:
            self._unavailable = (f"the store could not be reopened ({exc}); "
                                 "fix it and POST /v1/admin/reload")
            log.error("reload of %s failed: %s", self.settings.store, exc)
            raise

    async def flush(self) -> None:
        """Flush written rows (if any) of the current store."""
        if self.current is None:  # a failed reload left nothing open: nothing to flush
            return
        async with self.lease() as served:
            if served.dirty:
                await offload_shielded(served.flush)

    async def run_flusher(self) -> None:
        """Flush every ``flush_interval`` seconds until cancelled."""
        interval = self.settings.flush_interval
        while True:
            await asyncio.sleep(interval)
            try:
                await self.flush()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep flushing later; the error is in the log
                log.error("periodic flush failed: %s", exc)

    async def close(self) -> None:
        """Wait for leases, then flush and close the store; a failed flush is raised (and logged with what
        it cost: the process is ending, so unlike a reload it cannot keep the rows served)."""
        async with self._reload_lock:
            self._reopened = asyncio.Event()
            await self._drain()
            served, self.current = self.current, None
            self._unavailable = "the server is shutting down"
            self._reopened.set()
            self._reopened = None
            if served is not None:
                await offload_shielded(self._close_served, served)

    def _close_served(self, served: Served) -> None:
        """Blocking: ``served.close()``; a failed final flush is logged saying whether rows were lost."""
        try:
            served.close()
        except Exception as exc:
            cost = ("the write-ahead log keeps the acknowledged rows and the next open replays them"
                    if served.durable_writes else
                    "rows written since the last successful flush are lost (--no-durable-writes)")
            log.error("the final flush of %s failed (%s): %s", self.settings.store, exc, cost)
            raise
