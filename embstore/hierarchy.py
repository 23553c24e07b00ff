"""A table's tiers composed into one write-back cache hierarchy.

Each cache tier caches the level below it::

    read(ids):  level 0 ──miss──▶ level 1 ──miss──▶ ... ──▶ home (never-written rows: initial values)
                rows found below are promoted into every cache level they pass (subject to admission)
    write(ids): land in level 0, dirty; rows refused by admission, or pushed out within the
                same batch, go one level down
    eviction:   a dirty victim is written one level down before anything reads that level
    flush():    dirty rows cascade top to bottom, then the home makes them durable

Invariant: the freshest copy of a row is in the highest level holding it (writes
only enter at the top; a row leaves a level only by eviction, which writes it
down when dirty). Ids given to ``read``/``write`` are unique (callers dedup).

A level below can fail (the home's disk is full or returns EIO). Then the level
above forgets the rows its batch inserted (their slots never got their bytes)
and takes back the dirty rows it evicted, and ``flush`` clears a dirty bit only
once its row is written down: the error reaches the caller, and no row reads
wrong or is lost, so a retry (another flush) still makes every write durable;
but not after a failed data sync of the home, which is final (the home refuses
until the store is reopened and its write-ahead log replayed: ``tiers/ssd.py``).
A write that fails this way changes no row in the caches: the rows a cache
cannot keep go down before it overwrites any slot, so a write answered with an
error is not made durable by a later flush (the home itself may have taken
part of a batch it failed on).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from embstore.arrays import Ids, RowBytes
from embstore.policies import AccessResult, CacheDirectory
from embstore.tiers.base import Tier, TierStats, close_all
from embstore.tiers.cache import CacheTier


class Hierarchy:
    """Cache tiers over a persistent home tier."""

    def __init__(self, caches: list[CacheTier], home: Tier, initial: Callable[[Ids], RowBytes]) -> None:
        if not home.persistent:
            raise ValueError(f"the home tier must be persistent, got {home.kind}")
        self.caches = caches
        self.home = home
        self.initial = initial  # encoded initial rows for never-written ids

    @property
    def tiers(self) -> list[Tier]:
        return [*self.caches, self.home]

    def read(self, ids: Ids) -> RowBytes:
        return self._read(0, ids)

    def write(self, ids: Ids, rows: RowBytes) -> None:
        self._write(0, ids, rows)

    def _read(self, level: int, ids: Ids) -> RowBytes:
        if len(ids) == 0:
            return np.empty((0, self.home.row_bytes), np.uint8)
        if level == len(self.caches):
            rows, found = self.home.get(ids)
            if not found.all():
                rows[~found] = self.initial(ids[~found])
            return rows
        tier = self.caches[level]
        r = tier.directory.access(ids)
        rows = np.empty((len(ids), tier.row_bytes), np.uint8)
        hit = r.hit
        rows[hit] = tier.read_slots(r.slots[hit])  # before any slot is overwritten
        self._write_back(level, tier, ids, r)
        miss = ~hit
        try:
            fetched = self._read(level + 1, ids[miss])
        except BaseException:
            self._undo(tier, ids, r)
            raise
        rows[miss] = fetched
        miss_slots = r.slots[miss]
        land = miss_slots >= 0  # -1: refused by admission or pushed out again within this batch
        land_slots = miss_slots[land]
        tier.write_slots(land_slots, fetched[land])
        tier.dirty[land_slots] = False
        n_hit = int(hit.sum())
        c = tier.counters
        c.hits += n_hit
        c.misses += len(ids) - n_hit
        c.bytes_read += n_hit * tier.row_bytes
        c.bytes_written += len(land_slots) * tier.row_bytes
        return rows

    def _write(self, level: int, ids: Ids, rows: RowBytes) -> None:
        if len(ids) == 0:
            return
        if level == len(self.caches):
            self.home.put(ids, rows)
            return
        tier = self.caches[level]
        r = tier.directory.access(ids)
        self._write_back(level, tier, ids, r)
        stays = r.slots >= 0
        stays[stays] &= tier.directory.keys_at(r.slots[stays]) == ids[stays]
        whole = stays.all()  # every row lands (a whole-table cache, a batch that fits): no copies
        if not whole:  # the rest goes down first: if that fails, this level has changed no row's bytes
            try:
                self._write(level + 1, ids[~stays], rows[~stays])
            except BaseException:
                self._undo(tier, ids, r)
                raise
        slots = r.slots if whole else r.slots[stays]
        tier.write_slots(slots, rows if whole else rows[stays])
        tier.dirty[slots] = True
        tier.counters.bytes_written += len(slots) * tier.row_bytes

    def _write_back(self, level: int, tier: CacheTier, ids: Ids, r: AccessResult) -> None:
        """Rows the batch ``ids`` (accessed as ``r``) evicted: write the dirty ones one level down (their
        bytes are still in their slots). If that fails, the batch is undone (see ``_undo``)."""
        keys, slots = r.evicted_keys, r.evicted_slots
        if len(keys) == 0:
            return
        tier.counters.evictions += len(keys)
        dirty = tier.dirty[slots]
        tier.dirty[slots] = False
        if dirty.any():
            down_keys, down_rows = keys[dirty], tier.read_slots(slots[dirty])
            try:
                self._write(level + 1, down_keys, down_rows)
            except BaseException:
                self._undo(tier, ids, r, down_keys, down_rows)
                tier.counters.evictions -= len(down_keys)  # re-admitted: they never left
                raise

    @staticmethod
    def _undo(tier: CacheTier, ids: Ids, r: AccessResult, keys: Ids | None = None,
              rows: RowBytes | None = None) -> None:
        """After a level below failed mid-batch: drop the rows the batch ``ids`` inserted into ``tier``
        (their slots hold other rows' bytes, or none) and re-admit the dirty evicted ``keys``/``rows``
        that did not reach the level below, so nothing reads wrong and no write is lost. Dropping the
        inserts frees at least as many slots as the batch evicted rows, so every one lands."""
        landed = ~r.hit & (r.slots >= 0)
        landed[landed] &= tier.directory.keys_at(r.slots[landed]) == ids[landed]
        tier.directory.remove(ids[landed])
        tier.dirty[r.slots[landed]] = False
        if keys is not None and len(keys):
            back = tier.directory.access(keys)
            tier.write_slots(back.slots, rows)
            tier.dirty[back.slots] = True

    @property
    def ranks_announced(self) -> bool:
        """Whether some cache level ranks rows by announced use (one holding its whole table does not)."""
        return any(isinstance(t.directory, CacheDirectory) for t in self.caches)

    def announce(self, ids: Ids) -> None:
        """Every cache level's directory learns that the next batch not yet announced reads the distinct
        ``ids`` (``embstore.lookahead``); a level holding its whole table has nothing to rank."""
        for tier in self.caches:
            if isinstance(tier.directory, CacheDirectory):
                tier.directory.announce(ids)

    def advance(self) -> None:
        """The oldest announced batch is over at every level."""
        for tier in self.caches:
            if isinstance(tier.directory, CacheDirectory):
                tier.directory.advance()

    def flush(self) -> None:
        """Cascade every dirty row down to the home, then make the home durable."""
        for level, tier in enumerate(self.caches):
            slots = np.flatnonzero(tier.dirty)
            if len(slots):
                keys = tier.directory.keys_at(slots)
                rows = tier.read_slots(slots)
                self._write(level + 1, keys, rows)
                tier.dirty[slots] = False  # only now: after a failure below, the next flush writes them again
        self.home.flush()

    def stats(self) -> list[TierStats]:
        return [t.stats() for t in self.tiers]

    def close(self) -> None:
        """Release every tier, even when one fails to close (the first error is raised)."""
        close_all(self.tiers)
