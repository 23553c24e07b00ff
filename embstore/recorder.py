"""Capture a store's real read traffic as a trace, so ``embstore replay`` can replay it.

Off by default: nothing is recorded unless a :class:`TraceRecorder` is attached.
Each read that reaches a table's tier hierarchy (one lookup call: its unique
physical row ids, in the order the tiers see them) becomes one batch of the
trace, tagged with the table's index in ``store.tables``. Replaying the saved
trace with ``per_table=True`` and the store's tier sizes reproduces the store's
per-tier hit counts. Calls served by a full-table DRAM fast path bypass the
hierarchy; while a recorder is attached the table takes the normal path.
Recorders nest: one attached inside another's block feeds the outer one too.
Training (``TieredEmbeddingBagCollection``) records each batch's distinct rows
per table as it enters the look-ahead window: what the model reads, above its
working set (so per-tier counts of a training run are not reproduced).

What is traffic: ``lookup`` / ``lookup_pooled`` (the server's included) and
training batches (``predict`` included). Not: ``read_physical`` and
``read_with_state`` (bulk export scans every row once, which is no workload to
tune caches for; training's fetches through them are already its batch, so
recording them would count those rows twice), writes, and calls of no ids
(they would add empty batches).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from embstore.errors import InvalidInputError
from embstore.traces import Trace, save

__all__ = ["TraceRecorder", "record"]


class TraceRecorder:
    """Collects ``(table index, row ids)`` per read call; :meth:`trace` builds the :class:`Trace`."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.names = tuple(store.tables)
        self._index = {n: i for i, n in enumerate(self.names)}
        self._ids: list[np.ndarray] = []
        self._tab: list[int] = []
        self._lock = threading.Lock()
        self._attached = False
        self._prev: dict[str, Any] = {}  # each table's recorder before this one: still fed, restored on detach

    def __call__(self, table_name: str, rows: np.ndarray) -> None:
        if len(rows) == 0:  # nothing reached the tiers (a pooled call of only empty bags): no batch, as lookup()
            return
        if self._attached:
            with self._lock:
                self._ids.append(np.array(rows, dtype=np.int64, copy=True).reshape(-1))
                self._tab.append(self._index[table_name])
        prev = self._prev.get(table_name)
        if prev is not None:  # a recorder attached before this one (nested recording) keeps recording
            prev(table_name, rows)

    def attach(self) -> "TraceRecorder":
        if self._attached:  # again: it would become its own predecessor
            return self
        self._prev = {name: t.recorder for name, t in self.store.tables.items()}
        for t in self.store.tables.values():
            t.recorder = self
        self._attached = True
        return self

    def detach(self) -> None:
        if self._attached:
            self._attached = False
            for name, t in self.store.tables.items():
                if t.recorder is self:
                    t.recorder = self._live_prev(name)

    def _live_prev(self, name: str) -> Any:
        """The nearest earlier recorder of table ``name`` that is still attached (None: recording off)."""
        prev = self._prev.get(name)
        while isinstance(prev, TraceRecorder) and not prev._attached:
            prev = prev._prev.get(name)
        return prev

    def trace(self) -> Trace:
        with self._lock:
            lens = np.array([a.size for a in self._ids], np.int64)
            ids = np.concatenate(self._ids) if self._ids else np.zeros(0, np.int64)
            table = np.repeat(np.array(self._tab, np.int32), lens)
        off = np.zeros(lens.size + 1, np.int64)
        np.cumsum(lens, out=off[1:])
        return Trace(ids, table, off, self.names)


@contextmanager
def record(store: Any, path: str | os.PathLike[str] | None = None) -> Iterator[TraceRecorder]:
    """Record every read of ``store`` inside the block; save the trace (npz) to ``path`` on exit.

    ``path`` is checked first: a recording that could not be saved is refused, not lost at the end."""
    if path is not None:
        target = Path(path)
        if target.is_dir() or not target.parent.is_dir():
            raise InvalidInputError(f"trace path {str(target)!r}: not a file in an existing directory")
    rec = TraceRecorder(store).attach()
    try:
        yield rec
    finally:
        rec.detach()
        if path is not None:
            save(rec.trace(), path)
