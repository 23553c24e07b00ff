"""The pooled-embedding cache's write window and ``TableService.update``: behaviours a hand-made mutation
audit of commit 34e296c (session 14) found unpinned.

``PooledCache`` is driven directly over a numpy table (each answer compared with a plain numpy pooling
of the table as it is at that moment); ``TableService.update`` over a real memory-resident table, with a
``write`` callable that does the table's update and then looks at the cache from inside the write window.
"""

from __future__ import annotations

import errno

import numpy as np
import pytest

import embstore
from embstore.config import StoreConfig, TableConfig, TierConfig
from embstore.errors import InvalidInputError, TierIOError
from embstore.server import ServerSettings
from embstore.server.pooled_cache import PooledCache
from embstore.server.state import TableService
from test_mutation_server import _pool_ref as pool_ref

DIM = 3


class Counted:
    """The table's pooling, counting the bags it was asked for (a bag not asked was answered from memory)."""

    def __init__(self, w: np.ndarray) -> None:
        self.w, self.bags = w, 0

    def __call__(self, ids, offsets, mode):
        self.bags += len(offsets) - 1
        return pool_ref(self.w, ids, offsets, mode)


def bag(cache: PooledCache, ids: list[int]) -> np.ndarray:
    return cache.lookup_pooled(np.array(ids, np.int64), np.array([0, len(ids)], np.int64), "sum")[0]


def check(cache: PooledCache, table: Counted, ids: list[int], from_memory: bool) -> None:
    """Bag ``ids`` pools to the table's rows as they are now, from memory or from the table as said."""
    before = table.bags
    got = bag(cache, ids)
    want = pool_ref(table.w, np.array(ids), np.array([0, len(ids)]), "sum")[0]
    assert np.array_equal(got, want), (ids, got, want)
    assert (table.bags == before) == from_memory, (ids, "expected a hit" if from_memory else "expected a miss")


def new_cache(rows: int = 10) -> tuple[PooledCache, Counted]:
    table = Counted(np.arange(rows * DIM, dtype=np.float32).reshape(rows, DIM))
    return PooledCache(table, lambda ids: ids, DIM, 1 << 16), table


# --- PooledCache.begin_write / end_write -----------------------------------------------------------
def test_a_bag_holding_a_row_being_written_is_pooled_from_the_table():
    """Kills: the busy check dropped from the hit test (``and not bag_busy[b]``), ``bag_busy`` never
    computed, and ``np.minimum.reduceat`` for the busy count (a bag is busy only if *all* its rows are).
    Between ``begin_write`` and ``end_write`` the table may already hold the new row (a raw lookup returns
    it): every bag holding a written row - alone or beside quiet rows - must be pooled from the table,
    while bags of quiet rows only are still answered from memory."""
    cache, table = new_cache()
    bags = [[1], [1, 2], [2, 1, 1], [2, 3], [4]]
    for ids in bags:
        check(cache, table, ids, from_memory=False)
        check(cache, table, ids, from_memory=True)
    token = cache.begin_write(np.array([1], np.int64))
    table.w[1] = -7.0  # the write lands in the table; its epoch is not set yet
    for ids in bags:
        check(cache, table, ids, from_memory=1 not in ids)
    cache.end_write(token)
    for ids in bags:
        check(cache, table, ids, from_memory=1 not in ids)  # recomputed once ...
        check(cache, table, ids, from_memory=True)  # ... then cached again


def test_overlapping_writes_keep_a_row_busy_until_the_last_one_ends():
    """Kills: ``self._writing[slots] += 1`` for ``np.add.at`` (a write naming a row twice counts it once),
    ``self._writing[token] -= 1`` or ``-= 2`` or ``= 0`` for the decrement, the decrement dropped, a token
    missing a slot, ``>`` for ``>=`` in the epoch test, ``row_epoch`` as the busy count.
    Write A names row 1 twice (and row 4), write B names row 1; A ends first: row 1 is still being written
    by B (B's rows land after a bag of row 1 was recomputed) and must not be answered from memory until B
    ends. Once every write ended, every bag is answered from memory again after one recomputation."""
    cache, table = new_cache()
    for ids in ([1], [4], [1, 4], [5]):
        check(cache, table, ids, from_memory=False)
    a = cache.begin_write(np.array([1, 4, 1], np.int64))
    b = cache.begin_write(np.array([1], np.int64))
    table.w[[1, 4]] = 100.0  # A lands
    cache.end_write(a)
    check(cache, table, [4], from_memory=False)
    check(cache, table, [4], from_memory=True)  # A's own row is free again
    check(cache, table, [1], from_memory=False)  # B still writes row 1 ...
    table.w[1] = 200.0  # ... and lands now
    check(cache, table, [1], from_memory=False)
    check(cache, table, [1, 4], from_memory=False)
    cache.end_write(b)
    for ids in ([1], [4], [1, 4], [5]):
        check(cache, table, ids, from_memory=ids == [4] or ids == [5])
        check(cache, table, ids, from_memory=True)
    # the busy counts are back to zero, and only those rows' slots were touched
    assert not cache._writing.any()


@pytest.mark.parametrize("seed", range(3))
def test_random_writes_and_bags_match_the_table_and_hit_once_recomputed(seed):
    """Kills the same family over random inputs (duplicates, overlapping writes, slots shared through the
    mask): after any sequence of begin/end pairs every answer equals the table's pooling, a bag holding a
    row of an open write is never answered from memory, and a bag recomputed with no write open is
    answered from memory the next time."""
    rng = np.random.default_rng(seed)
    table = Counted(rng.standard_normal((40, DIM)).astype(np.float32))
    cache = PooledCache(table, lambda ids: ids, DIM, 1 << 20, slots=16)  # rows 0 and 16 share a slot
    open_writes: list[tuple[np.ndarray, np.ndarray | None]] = []
    for _ in range(300):
        r = rng.random()
        if r < 0.2 and len(open_writes) < 3:
            ids = rng.integers(0, 40, rng.integers(1, 4))
            open_writes.append((ids, cache.begin_write(ids)))
            table.w[ids] = rng.standard_normal((len(ids), DIM)).astype(np.float32)  # lands at once
        elif r < 0.35 and open_writes:
            _, token = open_writes.pop(rng.integers(len(open_writes)))
            cache.end_write(token)
        else:
            ids = rng.integers(0, 40, rng.integers(1, 4)).tolist()
            busy = {int(i) & 15 for w, _ in open_writes for i in w}
            before = table.bags
            got = bag(cache, ids)
            assert np.array_equal(got, pool_ref(table.w, np.array(ids), np.array([0, len(ids)]), "sum")[0])
            if busy & {i & 15 for i in ids}:
                assert table.bags == before + 1, "a bag of a row being written was answered from memory"
            if not open_writes:
                check(cache, table, ids, from_memory=True)
    for _, token in open_writes:
        cache.end_write(token)
    assert not cache._writing.any()


def test_note_write_invalidates_and_leaves_the_rows_free():
    """Kills: ``note_write`` calling ``begin_write`` without ``end_write`` (its rows busy for ever, their
    bags never cached again). ``note_write`` is begin and end at once: the next answer is the new row,
    then it is cached."""
    cache, table = new_cache()
    check(cache, table, [2, 3], from_memory=False)
    table.w[3] = 9.0
    cache.note_write(np.array([3], np.int64))
    check(cache, table, [2, 3], from_memory=False)
    check(cache, table, [2, 3], from_memory=True)


# --- TableService.update ---------------------------------------------------------------------------
@pytest.fixture
def service(tmp_path):
    """A served memory-resident table of 64 rows with the pooled cache on."""
    cfg = StoreConfig((TableConfig("t", 64, DIM, tiers=(TierConfig("dram", 64 * DIM * 4), TierConfig("mmap"))),))
    store = embstore.create(tmp_path / "s", cfg)
    try:
        yield TableService(store["t"], ServerSettings(store=tmp_path / "s", pooled_cache_bytes=1 << 16))
    finally:
        store.close()


def pooled(service: TableService, ids: list[int]) -> np.ndarray:
    return service.cache.lookup_pooled(np.array(ids, np.int64), np.array([0, len(ids)], np.int64), "sum")[0]


def table_pooled(service: TableService, ids: list[int]) -> np.ndarray:
    return service.table.lookup_pooled(np.array(ids, np.int64), np.array([0, len(ids)], np.int64), "sum")[0]


def test_a_pooled_lookup_inside_the_write_window_answers_the_row_a_lookup_already_sees(service):
    """Kills: ``TableService.update`` announcing the write only after it (``note_write`` after the table's
    update, as before commit 34e296c), and the busy check dropped. Once the table holds the new row a raw
    lookup returns it; a pooled request sent after that lookup finished, while the update has not returned
    yet, must not get the bag cached before the write."""
    pooled(service, [5, 6])
    hits = service.cache.hits
    pooled(service, [5, 6])
    assert service.cache.hits == hits + 1  # cached
    new = np.full((1, DIM), 42.0, np.float32)
    seen: dict[str, np.ndarray] = {}

    def write(ids, rows):
        service.table.update(ids, rows)
        seen["lookup"] = service.table.lookup(np.array([5], np.int64))[0]
        seen["pooled"] = pooled(service, [5, 6])

    service.update(np.array([5], np.int64), new, write)
    assert np.array_equal(seen["lookup"], new[0])
    assert np.array_equal(seen["pooled"], table_pooled(service, [5, 6]))


def test_a_write_that_fails_after_applying_rows_invalidates_them_and_frees_them(service):
    """Kills: ``end_write`` only on success (``finally`` turned into a plain call after the write). A
    write that fails after part of it reached the table (a machine failure) must still invalidate the
    bags holding its rows (the next answer is the applied row) and end the write (the bag is cached
    again afterwards, not pooled from the table for ever)."""
    pooled(service, [7])
    new = np.full((1, DIM), -3.0, np.float32)

    def write_then_fail(ids, rows):
        service.table.update(ids, rows)
        raise TierIOError("mmap", "write", errno.EIO)

    with pytest.raises(TierIOError):
        service.update(np.array([7], np.int64), new, write_then_fail)
    assert np.array_equal(pooled(service, [7]), new[0])
    hits = service.cache.hits
    assert np.array_equal(pooled(service, [7]), new[0])
    assert service.cache.hits == hits + 1


def test_a_served_write_leaves_its_rows_cacheable(service):
    """Kills: ``end_write`` called twice (the busy count goes negative: the rows' bags are never cached
    again) and the decrement dropped. After plain updates (one naming a row twice) each bag is pooled
    from the table once, then answered from memory, and always equals the table's own pooling."""
    for ids in ([1, 2], [2, 3]):
        pooled(service, ids)
    service.update(np.array([2, 9, 2], np.int64), np.arange(3 * DIM, dtype=np.float32).reshape(3, DIM))
    service.update(np.array([3], np.int64), np.ones((1, DIM), np.float32))
    for ids in ([1, 2], [2, 3]):
        misses = service.cache.misses
        assert np.array_equal(pooled(service, ids), table_pooled(service, ids))
        assert service.cache.misses == misses + 1
        hits = service.cache.hits
        assert np.array_equal(pooled(service, ids), table_pooled(service, ids))
        assert service.cache.hits == hits + 1


def test_a_refused_write_reports_the_tables_own_error(service):
    """Kills: ``begin_write``'s ``InvalidInputError`` re-raised instead of left to the write. The cache
    maps ids to rows before the write, but the error a refused write reports is the table's own (it
    checks the rows before the ids): here rows with a NaN beside an id out of range."""
    ids = np.array([3, 999], np.int64)
    rows = np.ones((2, DIM), np.float32)
    rows[0, 0] = np.nan
    with pytest.raises(InvalidInputError) as want:
        service.table.update(ids, rows)
    with pytest.raises(InvalidInputError) as got:
        service.update(ids, rows)
    assert type(got.value) is type(want.value) and str(got.value) == str(want.value)
    assert not service.cache._writing.any()


def test_a_write_whose_announcement_fails_otherwise_is_not_made(service, monkeypatch):
    """Kills: ``except Exception`` for ``except InvalidInputError`` around ``begin_write``. Only ids the
    table refuses may skip the announcement (the write then refuses them itself); any other failure of it
    (here a MemoryError mapping the ids) must stop the write, which would otherwise land in the table with
    its bags still answered from memory."""
    pooled(service, [4])
    old = service.table.lookup(np.array([4], np.int64)).copy()

    def no_memory(ids):
        raise MemoryError("mapping ids")

    monkeypatch.setattr(service.cache, "_rows_of", no_memory)
    with pytest.raises(MemoryError):
        service.update(np.array([4], np.int64), np.full((1, DIM), 5.0, np.float32))
    monkeypatch.undo()
    assert np.array_equal(service.table.lookup(np.array([4], np.int64)), old)
    assert np.array_equal(pooled(service, [4]), table_pooled(service, [4]))
