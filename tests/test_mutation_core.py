"""The core lookup/update path pinned where a session 11 mutation audit found no test: the counters a cache
level keeps (hits, misses, evictions, bytes) against a per-access LRU model, the home's own flush, a cache
tier used directly (put, get, delete), the resident table's statistics, float16's exact limit and the
initial-value distributions the README promises."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

import embstore
from embstore.config import InitConfig, StoreConfig, TableConfig, TierConfig
from embstore.hierarchy import Hierarchy
from embstore.rows import RowFormat, initial_rows
from embstore.tiers.cache import DeviceTier, DRAMTier, cache_metadata_bytes
from test_hierarchy import ROW, DictHome, initial


class LRUModel:
    """One LRU level fed a batch's unique ids one after another (README: "exactly like a per-access cache"),
    keeping the counters ``Hierarchy`` should keep for it."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.order: OrderedDict[int, None] = OrderedDict()
        self.hits = self.misses = self.evictions = self.bytes_read = self.bytes_written = 0

    def _access(self, ids: list[int]) -> list[bool]:
        inserted, hit = set(), []
        for k in ids:
            hit.append(k in self.order)
            if hit[-1]:
                self.order.move_to_end(k)
                continue
            if len(self.order) == self.capacity:
                victim, _ = self.order.popitem(last=False)
                self.evictions += victim not in inserted  # a row inserted and pushed out within the batch is none
            self.order[k] = None
            inserted.add(k)
        return hit

    def read(self, ids: list[int]) -> None:
        hit = self._access(ids)
        n_hit = sum(hit)
        self.hits += n_hit
        self.misses += len(ids) - n_hit
        self.bytes_read += n_hit * ROW
        self.bytes_written += sum(not h and k in self.order for k, h in zip(ids, hit)) * ROW  # rows that landed

    def write(self, ids: list[int]) -> None:
        self._access(ids)
        self.bytes_written += sum(k in self.order for k in ids) * ROW  # the rest went down a level

    def counters(self) -> tuple[int, ...]:
        return self.hits, self.misses, self.evictions, self.bytes_read, self.bytes_written


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 2, 3, 5]),
       st.lists(st.tuples(st.sampled_from(["read", "write", "flush"]),
                          st.lists(st.integers(0, 11), min_size=1, max_size=7, unique=True)), max_size=25))
@example(2, [("read", [5, 6, 7])])  # 5 is pushed out again within the batch: two rows land
@example(2, [("write", [1, 2, 3])])  # a write larger than the level: one row goes down
@example(2, [("write", [1, 2]), ("flush", [0]), ("read", [3, 4])])  # clean rows evicted count too
@example(1, [("read", [0, 1]), ("read", [0, 1, 2])])  # 1 leaves, comes back and leaves again: one eviction
def test_cache_level_counters_match_a_per_access_lru_model(capacity: int, ops) -> None:
    """hits/misses count the unique ids of reads; bytes_read the hit rows; bytes_written only the rows that
    land in the level (not those refused or pushed out again within the batch); evictions every row resident
    before the batch that left it, dirty or clean."""
    tier = DRAMTier(ROW, capacity, "lru", num_rows=100)
    h = Hierarchy([tier], DictHome(), initial)
    model = LRUModel(capacity)
    for op, ids in ops:
        arr = np.array(ids, np.int64)
        if op == "read":
            h.read(arr)
            model.read(ids)
        elif op == "write":
            h.write(arr, np.full((len(ids), ROW), 3, np.uint8))
            model.write(ids)
        else:
            h.flush()  # writes level 0's dirty rows down: none of level 0's own counters move
        s = tier.stats()
        assert (s.hits, s.misses, s.evictions, s.bytes_read, s.bytes_written) == model.counters(), (op, ids)
        assert s.resident_rows == len(model.order)


class FlushCountingHome(DictHome):
    """A DictHome that records, at each of its flushes, what it held (a flush is what makes puts durable)."""

    def __init__(self) -> None:
        super().__init__()
        self.flushed: list[dict[int, bytes]] = []

    def flush(self) -> None:
        self.flushed.append(dict(self.data))


def test_hierarchy_flush_makes_the_home_durable_after_the_cascade() -> None:
    """``flush`` ends with the home's own flush (an ssd home's fsync), after every dirty row reached it;
    without it the rows sit in the page cache and ``store.flush`` promises durability it did not give."""
    home = FlushCountingHome()
    h = Hierarchy([DRAMTier(ROW, 2, "lru", num_rows=100), DRAMTier(ROW, 3, "lru", num_rows=100)], home, initial)
    h.write(np.arange(4, dtype=np.int64), np.full((4, ROW), 9, np.uint8))
    h.flush()
    assert home.flushed == [{i: bytes([9] * ROW) for i in range(4)}]
    h.flush()  # nothing dirty: the home is still flushed (it may hold puts of its own)
    assert len(home.flushed) == 2


def test_cache_tier_used_directly_counts_and_marks_dirty() -> None:
    """``put`` on a cache tier marks its rows dirty and counts the rows it pushed out and the bytes it
    wrote; ``get`` counts hit bytes; ``delete`` clears the dirty bit, so a flush through a hierarchy writes
    the rows put and never a deleted one (its free slot maps to no key)."""
    tier = DRAMTier(ROW, 2, "lru", num_rows=100)
    home = DictHome()
    h = Hierarchy([tier], home, initial)
    tier.put(np.array([1, 2], np.int64), np.full((2, ROW), 4, np.uint8))
    tier.put(np.array([3], np.int64), np.full((1, ROW), 5, np.uint8))  # pushes 1 out
    rows, found = tier.get(np.array([1, 2, 3], np.int64))
    assert found.tolist() == [False, True, True] and rows[1:, 0].tolist() == [4, 5]
    s = tier.stats()
    assert (s.hits, s.misses, s.evictions, s.bytes_read, s.bytes_written) == (2, 1, 1, 2 * ROW, 3 * ROW)
    tier.delete(np.array([2], np.int64))
    h.flush()
    assert home.data == {3: bytes([5] * ROW)}


@pytest.mark.parametrize("make", [DRAMTier, DeviceTier])
def test_a_put_larger_than_the_cache_counts_and_keeps_only_the_rows_that_stay(make) -> None:
    """A put whose hit row (1) is pushed out later in the same batch: only the rows still resident after
    the batch are written and counted (the hit row's slot now belongs to 4, so writing 1's bytes there is
    wrong whatever order the slab's copy takes: torch's ``index_copy_`` does not promise one)."""
    tier = make(ROW, 2, "lru", num_rows=100)
    tier.put(np.array([1, 2], np.int64), np.full((2, ROW), 1, np.uint8))
    written = tier.stats().bytes_written
    tier.put(np.array([1, 3, 4], np.int64), np.array([[7] * ROW, [8] * ROW, [9] * ROW], np.uint8))
    rows, found = tier.get(np.array([1, 2, 3, 4], np.int64))
    assert found.tolist() == [False, False, True, True] and rows[2:, 0].tolist() == [8, 9]
    s = tier.stats()
    assert (s.evictions, s.bytes_written - written) == (2, 2 * ROW)


@pytest.mark.parametrize("make", [DRAMTier, DeviceTier])
def test_a_cache_of_no_rows_is_refused(make) -> None:
    """A capacity below one row is a ValueError naming the row size (the factory turns it into ConfigError)."""
    with pytest.raises(ValueError, match="at least one row of 8 bytes"):
        make(8, 0, "lru", num_rows=100)


@pytest.mark.parametrize("policy", ["lru", "lfu", "clock", "lru+tinylfu"])
@pytest.mark.parametrize("capacity", [1, 37, 100, 250])
def test_cache_metadata_bytes_is_what_a_tier_holds(policy: str, capacity: int) -> None:
    """What ``tune`` sets aside beside a cache's slab (``cache_metadata_bytes``) is what the tier holds:
    directory and dirty flags; for a whole-table tier, presence and dirty bytes per row plus each counting
    thread's bitmap."""
    tier = DRAMTier(ROW, capacity, policy, num_rows=100)
    if capacity >= 100:
        tier.directory.marks(2)  # what a resident lookup on two threads allocates
    assert tier.metadata_bytes == cache_metadata_bytes(capacity, 100, policy, count_threads=2)


def test_zeros_init_reads_never_written_rows_as_zeros() -> None:
    """``init = { kind = "zeros" }`` whatever its scale: no random draw."""
    assert not initial_rows(InitConfig("zeros", 0.5, 3), np.arange(50, dtype=np.int64), 8).any()


def test_initial_rows_are_stable_across_versions() -> None:
    """Never-written rows are not stored: a store written by one version reads them from this formula in
    the next, so the values themselves are pinned (recorded in session 11), not only their distribution."""
    ids = np.array([0, 1, 2**40], np.int64)
    want = {"uniform": [[0.343508780002594, 0.3153614103794098, -0.06491069495677948],
                        [0.33888766169548035, 0.23751816153526306, 0.0933324322104454],
                        [0.47771963477134705, 0.45827338099479675, 0.45713940262794495]],
            "normal": [[-0.29039618372917175, -0.04137082025408745, -0.5409455299377441],
                       [-0.23789501190185547, 0.13450796902179718, 0.29385921359062195],
                       [0.07543621957302094, -0.1451759785413742, 0.11497276276350021]]}
    for kind, rows in want.items():
        np.testing.assert_allclose(initial_rows(InitConfig(kind, 0.5, 3), ids, 3), rows, rtol=1e-6)


def test_table_methods_after_close_raise_and_write_nothing(tmp_path) -> None:
    """Every table call after close is a StoreClosedError, the physical-row ones (import, training) too:
    a write must not land silently in the slab of a closed cache."""
    store, table = _resident_table(tmp_path)
    store.close()
    ids, vals = np.array([1], np.int64), np.ones((1, 4), np.float32)
    for call in (lambda: table.write_physical(ids, vals), lambda: table.read_physical(ids),
                 lambda: table.write_with_state(ids, vals, np.zeros((1, 0), np.float32)),
                 lambda: table.read_with_state(ids), lambda: table.flush(), lambda: table.lookup(ids),
                 lambda: table.lookup_pooled(ids, np.array([0, 1], np.int64)), lambda: table.update(ids, vals)):
        with pytest.raises(embstore.StoreClosedError):
            call()


def test_write_physical_refuses_rows_a_float16_table_cannot_hold(tmp_path) -> None:
    """Import writes through ``write_physical``, which checks the row format's range itself (not only its
    callers): a value float16 would store as inf is refused and nothing of the batch is written."""
    cfg = TableConfig("t", 10, 4, dtype="float16", tiers=(TierConfig("dram", 80, "lru"), TierConfig("mmap")))
    with embstore.create(tmp_path / "s", StoreConfig((cfg,))) as store:
        t = store["t"]
        ids = np.array([1, 2], np.int64)
        before = t.read_physical(ids)
        rows = np.ones((2, 4), np.float32)
        rows[1, 3] = -7e4
        with pytest.raises(embstore.InvalidRowsError, match="float16"):
            t.write_physical(ids, rows)
        np.testing.assert_array_equal(t.read_physical(ids), before)


def _resident_table(tmp_path, rows: int = 50, dim: int = 4) -> tuple[embstore.Store, embstore.Table]:
    cfg = TableConfig("t", rows, dim, tiers=(TierConfig("dram", rows * dim * 4), TierConfig("mmap")))
    store = embstore.create(tmp_path / "s", StoreConfig((cfg,)))
    table = store["t"]
    table.write_physical(np.arange(rows, dtype=np.int64), np.ones((rows, dim), np.float32))
    assert table.full_dram_tier() is not None
    return store, table


def test_resident_table_statistics_count_distinct_rows(tmp_path) -> None:
    """On a whole-table DRAM slab (the fast paths), lookups count each distinct row once as a hit and its
    bytes as read, and updates its bytes as written, as the hierarchy's paths do; the table counts every
    id looked up."""
    store, table = _resident_table(tmp_path)
    rb = table.format.row_bytes
    before = table.stats()["dram"]
    ids = np.array([3, 3, 7, 9, 7], np.int64)
    table.lookup(ids)
    table.lookup_pooled(ids, np.array([0, 2, 5], np.int64))
    table.update(ids, np.full((5, 4), 2.0, np.float32))
    after = table.stats()["dram"]
    delta = {k: after[k] - before[k] for k in ("hits", "misses", "evictions", "bytes_read", "bytes_written")}
    assert delta == {"hits": 6, "misses": 0, "evictions": 0, "bytes_read": 6 * rb, "bytes_written": 3 * rb}
    assert table.lookups == 10
    store.close()


@pytest.mark.parametrize("n_rows", [1, 3])
def test_float16_limit_is_exactly_where_float16_rounds_to_inf(tmp_path, n_rows: int) -> None:
    """65520 rounds to inf in float16 and is refused, in a batch of one row too; the largest float32 below it
    rounds to 65504 and is stored as that."""
    below = np.nextafter(np.float32(65520.0), np.float32(0))
    fmt = RowFormat(4, "float16")
    for sign in (1, -1):
        rows = np.zeros((n_rows, 4), np.float32)
        rows[-1, 2] = sign * 65520.0
        with pytest.raises(embstore.InvalidRowsError, match="float16"):
            fmt.check(rows)
        rows[-1, 2] = sign * below
        fmt.check(rows)
        assert fmt.decode(fmt.encode(rows))[-1, 2] == sign * 65504.0
    cfg = TableConfig("t", 10, 4, dtype="float16", tiers=(TierConfig("dram", 80, "lru"), TierConfig("mmap")))
    with embstore.create(tmp_path / "s", StoreConfig((cfg,))) as store:
        ids = np.arange(n_rows, dtype=np.int64)
        before = store["t"].lookup(ids)
        rows = np.ones((n_rows, 4), np.float32)
        rows[0, 0] = 65520.0
        with pytest.raises(embstore.InvalidRowsError, match="float16"):
            store["t"].update(ids, rows)
        np.testing.assert_array_equal(store["t"].lookup(ids), before)


@pytest.mark.parametrize("kind", ["uniform", "normal"])
def test_initial_rows_follow_the_documented_distribution(kind: str) -> None:
    """README: never-written rows are ``uniform(-scale, scale)`` or ``normal(0, scale)``: centred on zero,
    spread over the whole range (a uniform(0, scale) or a skewed Box-Muller passes a bound check alone)."""
    scale = 0.5
    x = initial_rows(InitConfig(kind, scale, 11), np.arange(4000, dtype=np.int64), 16).astype(np.float64).ravel()
    assert abs(x.mean()) < 0.02 * scale
    if kind == "uniform":
        assert x.min() >= -scale and x.max() <= scale
        assert x.min() < -0.99 * scale and x.max() > 0.99 * scale
        assert abs(x.std() - scale / np.sqrt(3)) < 0.02 * scale
        assert abs((x < 0).mean() - 0.5) < 0.02
    else:
        assert abs(x.std() - scale) < 0.02 * scale
        assert abs((np.abs(x) < scale).mean() - 0.6827) < 0.02  # within one sigma


@pytest.mark.parametrize("row", [[0.0, 1e-45, 3e-45, 0.0], [-1e-45, 0.0, 0.0, 1e-45], [1e-43, 0.0, 5e-44, 2e-44]])
def test_int8_rows_a_few_subnormal_steps_apart_round_trip(tmp_path, row: list[float]) -> None:
    """A finite row whose spread / 255 is below float32's smallest subnormal: its scale rounded to 0 and the
    encoder divided by it (ZeroDivisionError out of ``update``, a 500 from the server). Such rows are
    multiples of the smallest subnormal, which as the scale stores them exactly."""
    x = np.array([row], np.float32)
    fmt = RowFormat(4, "int8")
    np.testing.assert_array_equal(fmt.decode(fmt.encode(x)), x)
    cfg = TableConfig("t", 10, 4, dtype="int8", tiers=(TierConfig("dram", 60, "lru"), TierConfig("mmap")))
    with embstore.create(tmp_path / "s", StoreConfig((cfg,))) as store:
        store["t"].update(np.array([3], np.int64), x)
        np.testing.assert_array_equal(store["t"].lookup(np.array([3], np.int64)), x)


def test_int8_row_ending_at_float32_max_decodes_finite() -> None:
    """A row whose scale is below the float32-safe limit but whose bias is not: 255 * scale (rounded up) +
    bias passes float32's maximum, so it must decode in float64, clamped (found by a mutation that
    checked only the scale)."""
    x = np.array([[1.0890493e38, 2e38, np.finfo(np.float32).max]], np.float32)
    fmt = RowFormat(3, "int8")
    got = fmt.decode(fmt.encode(x))
    assert np.isfinite(got).all()
    assert (np.abs(got.astype(np.float64) - x) <= (float(x.max()) - float(x.min())) / 510 * 1.001).all()


def test_update_zeroes_the_optimizer_state_on_every_path(tmp_path) -> None:
    """``update`` overwrites a row and resets its optimizer state to zeros, on a partial cache (encode with
    no state) as on a resident slab (the scatter kernel)."""
    for cap_rows in (5, 20):
        cfg = TableConfig("t", 20, 4, tiers=(TierConfig("dram", cap_rows * 20, "lru"), TierConfig("mmap")))
        with embstore.create(tmp_path / f"s{cap_rows}", StoreConfig((cfg,))) as store:
            t = store.ensure_state_dim("t", 1)
            ids = np.arange(20, dtype=np.int64)
            t.write_with_state(ids, np.ones((20, 4), np.float32), np.full((20, 1), 5.0, np.float32))
            t.update(np.array([2, 17], np.int64), np.full((2, 4), 3.0, np.float32))
            vals, state = t.read_with_state(ids)
            assert state[:, 0].tolist() == [0.0 if i in (2, 17) else 5.0 for i in range(20)]
            assert vals[[2, 17]].tolist() == [[3.0] * 4] * 2


def test_only_a_host_memory_whole_table_slab_counts_as_memory_resident(tmp_path) -> None:
    """The server runs lookups of a ``memory_resident`` table inline on its event loop: a whole-table DRAM
    slab is, a whole-table mmap cache (page faults) or a partial cache is not."""
    layouts = {"dram": (TierConfig("dram", 20 * 16), TierConfig("mmap")),
               "mmap": (TierConfig("mmap", 20 * 16), TierConfig("rocksdb")),
               "partial": (TierConfig("dram", 5 * 16, "lru"), TierConfig("mmap"))}
    cfg = StoreConfig(tuple(TableConfig(name, 20, 4, tiers=tiers) for name, tiers in layouts.items()))
    with embstore.create(tmp_path / "s", cfg) as store:
        assert {n: store[n].memory_resident for n in layouts} == {"dram": True, "mmap": False, "partial": False}


def test_a_qr_hashed_resident_table_refuses_row_writes(tmp_path) -> None:
    """A QR table's rows are combinations of two shared rows: ``update`` is refused on every path, also
    the in-place fast path of a whole-table float32 slab, and nothing is written."""
    cfg = TableConfig("q", 64, 4, hash={"kind": "qr", "collisions": 4},
                      tiers=(TierConfig("dram", "1MiB"), TierConfig("mmap")))
    with embstore.create(tmp_path / "s", StoreConfig((cfg,))) as store:
        t = store["q"]
        ids = np.arange(8, dtype=np.int64)
        t.lookup(ids)  # every physical row resident
        before = t.read_physical(np.arange(t.hierarchy.tiers[-1].num_rows, dtype=np.int64))
        with pytest.raises(embstore.InvalidInputError, match="QR"):
            t.update(ids, np.ones((8, 4), np.float32))
        after = t.read_physical(np.arange(t.hierarchy.tiers[-1].num_rows, dtype=np.int64))
        np.testing.assert_array_equal(after, before)


def test_a_table_whose_flush_fails_on_close_still_closes_its_tiers(tmp_path, monkeypatch) -> None:
    """``Table.close`` releases its tiers (their files and locks) even when the final flush fails, so
    the store can be opened again; the failure reaches the caller."""
    with embstore.create(tmp_path / "s", StoreConfig((TableConfig("t", 16, 4),))) as store:
        t = store["t"]

        def fails() -> None:
            raise embstore.TierIOError("ssd", "flush", 5)

        monkeypatch.setattr(t.hierarchy, "flush", fails)
        with pytest.raises(embstore.TierIOError):
            t.close()
        assert all(tier.closed for tier in t.hierarchy.tiers)
        monkeypatch.undo()
