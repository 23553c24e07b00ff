"""Micro-batching: concurrent lookups of one table become one tier read.

Requests queue on the event loop. When the table is idle, the first one waits
``wait`` seconds (bounded, may be 0) for company, then everything queued is
concatenated and read with a single ``Table.lookup`` in a worker thread
(so the tiers see each distinct row once and the SSD tier one io_uring batch).
While that read runs, new requests queue up and go together as the next batch
as soon as it finishes: under load batches form by themselves, with no wait.
At most one read per table is in flight, since the table serialises its calls
anyway. Each request gets its slice of the result.

Input is validated per request before it is queued, so one bad request never
fails the batch it would have joined.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

Offload = Callable[..., Awaitable[np.ndarray]]


@dataclass
class BatchStats:
    requests: int = 0
    batches: int = 0
    ids: int = 0


class LookupBatcher:
    """Coalesces ``lookup(ids)`` calls made on one event loop."""

    def __init__(self, lookup: Callable[[np.ndarray], np.ndarray], offload: Offload, *,
                 wait: float = 0.0, max_ids: int = 1 << 16) -> None:
        self._lookup = lookup
        self._offload = offload
        self.wait = wait
        self.max_ids = max_ids
        self.stats = BatchStats()
        self._queue: deque[tuple[np.ndarray, asyncio.Future]] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task | None = None

    async def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Rows of ``ids`` (already validated), read together with concurrent callers'."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._queue.append((ids, fut))
        self.stats.requests += 1
        if self._task is None and self._timer is None:
            if self.wait > 0:
                self._timer = loop.call_later(self.wait, self._start)
            else:
                self._start()
        return await fut

    def _start(self) -> None:
        self._timer = None
        if self._task is None and self._queue:
            self._task = asyncio.get_running_loop().create_task(self._drain())

    def _take(self) -> list[tuple[np.ndarray, asyncio.Future]]:
        """Queued requests up to ``max_ids`` ids (at least one), skipping abandoned ones."""
        batch: list[tuple[np.ndarray, asyncio.Future]] = []
        total = 0
        while self._queue and (not batch or total + len(self._queue[0][0]) <= self.max_ids):
            ids, fut = self._queue.popleft()
            if not fut.done():  # a caller that timed out has cancelled its future
                batch.append((ids, fut))
                total += len(ids)
        return batch

    async def _drain(self) -> None:
        try:
            while self._queue:
                batch = self._take()
                if not batch:
                    continue
                ids = batch[0][0] if len(batch) == 1 else np.concatenate([b[0] for b in batch])
                self.stats.batches += 1
                self.stats.ids += len(ids)
                try:
                    rows = await self._offload(self._lookup, ids)
                except Exception as exc:  # delivered to every caller of the batch
                    for _, fut in batch:
                        if not fut.done():
                            fut.set_exception(exc)
                    continue
                start = 0
                for part, fut in batch:
                    end = start + len(part)
                    if not fut.done():
                        fut.set_result(rows[start:end])
                    start = end
        finally:
            self._task = None
