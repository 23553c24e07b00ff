"""The tier interface: a small class over *batches* of rows, never single rows.

A tier stores fixed-width rows of ``row_bytes`` bytes (the table's encoded row
format, see :mod:`embstore.rows`) keyed by int64 row ids::

    get(ids)      -> (rows uint8 (n, row_bytes), found bool (n,))   missing rows are False, not errors
    put(ids, rows)                                                   overwrite or insert
    delete(ids)                                                      only where supports_delete
    contains(ids) -> found bool (n,)
    flush()                                                          everything put so far is durable
    close()

``ids`` passed to a tier are unique within one call (the hierarchy
deduplicates first); tiers may rely on it.
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass, asdict

import numpy as np

from embstore.arrays import Ids, Mask, RowBytes
from embstore.errors import TierIOError, tier_io_error


@dataclass(frozen=True)
class TierStats:
    """Counters of one tier; hits + misses = unique ids looked up in it."""

    kind: str
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    resident_rows: int = 0
    capacity_rows: int = 0

    def as_dict(self) -> dict[str, int | str]:
        return asdict(self)


class Counters:
    """Mutable counters a tier keeps; ``snapshot`` freezes them into TierStats."""

    __slots__ = ("hits", "misses", "evictions", "bytes_read", "bytes_written")

    def __init__(self) -> None:
        self.hits = self.misses = self.evictions = self.bytes_read = self.bytes_written = 0

    def snapshot(self, kind: str, resident: int, capacity: int) -> TierStats:
        return TierStats(kind, self.hits, self.misses, self.evictions, self.bytes_read,
                         self.bytes_written, resident, capacity)


def close_all(items: "list") -> None:
    """Close every item even when some fail; the first failure is raised at the end."""
    first: Exception | None = None
    for item in items:
        try:
            item.close()
        except Exception as exc:  # noqa: BLE001 - re-raised below
            first = first or exc
    if first is not None:
        raise first


class SyncGuard:
    """Remembers that a sync of a tier's rows (fdatasync, msync) failed, and refuses what would build on it.

    Linux reports a failed writeback once and marks the pages it could not write clean, so a retried
    sync succeeds although the rows never reached the disk (PostgreSQL's "fsyncgate", 2018). A tier
    whose data sync failed therefore never syncs or commits again: its flushes, writes and close raise
    until the store is reopened, which finds the last good commit (and replays the write-ahead log).
    """

    _CURE = ("rows written since the last good flush may be lost on disk, and a retried sync would not say "
             "so; close the store and reopen it (with the write-ahead log on, the reopen replays them)")

    def __init__(self, tier: str, path: os.PathLike[str] | str) -> None:
        self.tier, self.path = tier, path
        self.failure: TierIOError | None = None

    def failed(self, operation: str, exc: OSError) -> TierIOError:
        """Record the failed sync ``exc``; returns the error to raise (typed by its errno, with the cure)."""
        err = tier_io_error(self.tier, operation, exc)
        detail = f"{exc.strerror or exc}; {self._CURE}"
        self.failure = type(err)(self.tier, operation, err.errno, detail)
        self.failure.final = True
        return self.failure

    def check(self, operation: str) -> None:
        """Raise, for ``operation``, if a sync has failed (the earlier failure's type and errno)."""
        first = self.failure
        if first is not None:
            refused = type(first)(self.tier, operation, first.errno,
                                  f"an earlier sync of {self.path} failed; {self._CURE}")
            refused.final = True
            raise refused


class Tier(abc.ABC):
    """One storage level of a table."""

    kind: str = "tier"
    persistent: bool = False
    supports_delete: bool = True
    device: str = "cpu"

    def __init__(self, row_bytes: int) -> None:
        if row_bytes <= 0:
            raise ValueError(f"row_bytes must be positive, got {row_bytes}")
        self.row_bytes = int(row_bytes)
        self.counters = Counters()
        self.closed = False

    @abc.abstractmethod
    def get(self, ids: Ids) -> tuple[RowBytes, Mask]:
        """Rows of ``ids`` (unique) and which were present; absent rows are zero bytes."""

    @abc.abstractmethod
    def put(self, ids: Ids, rows: RowBytes) -> None:
        """Store ``rows`` (uint8, (len(ids), row_bytes)) under ``ids`` (unique)."""

    @abc.abstractmethod
    def contains(self, ids: Ids) -> Mask:
        """Which ``ids`` are present."""

    def delete(self, ids: Ids) -> None:
        raise NotImplementedError(f"{self.kind} tier does not support delete")

    def flush(self) -> None:
        """Make everything put so far durable (no-op for volatile tiers)."""

    def close(self) -> None:
        self.closed = True

    @property
    def resident_rows(self) -> int:
        return 0

    @property
    def capacity_rows(self) -> int:
        return 0

    def stats(self) -> TierStats:
        return self.counters.snapshot(self.kind, self.resident_rows, self.capacity_rows)

    # helpers for subclasses -------------------------------------------------
    def _check_rows(self, ids: Ids, rows: RowBytes) -> None:
        if rows.dtype != np.uint8 or rows.ndim != 2 or rows.shape != (len(ids), self.row_bytes):
            raise ValueError(f"{self.kind} tier expects uint8 rows of shape ({len(ids)}, {self.row_bytes}), "
                             f"got {rows.dtype} {rows.shape}")
