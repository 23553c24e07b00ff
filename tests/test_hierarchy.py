"""The write-back hierarchy against a dict model, on a simple persistent home."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from embstore.arrays import HUGE_PAGE, aligned_zeros
from embstore.errors import IdOutOfRangeError, InvalidInputError, StoreClosedError, TierIOError
from embstore.hierarchy import Hierarchy
from embstore.kernels import gather_rows, pool, pool_rows, unique_inverse, unique_inverse_each, unique_last
from embstore.tiers.base import Tier
from kernel_threads import kernel_path
from embstore.tiers.cache import DeviceTier, DRAMTier, MmapCacheTier

ROW = 8


class DictHome(Tier):
    """A persistent-by-declaration home backed by a dict: the reference model's twin."""

    kind = "dicthome"
    persistent = True

    def __init__(self) -> None:
        super().__init__(ROW)
        self.data: dict[int, bytes] = {}

    def get(self, ids):
        rows = np.zeros((len(ids), ROW), np.uint8)
        found = np.array([int(i) in self.data for i in ids], bool)
        for j, i in enumerate(ids):
            if found[j]:
                rows[j] = np.frombuffer(self.data[int(i)], np.uint8)
        return rows, found

    def put(self, ids, rows):
        for i, r in zip(ids, rows):
            self.data[int(i)] = r.tobytes()

    def contains(self, ids):
        return np.array([int(i) in self.data for i in ids], bool)


def initial(ids: np.ndarray) -> np.ndarray:
    return np.repeat((ids % 251).astype(np.uint8)[:, None], ROW, axis=1)


def make(policies=("lru", "lfu"), caps=(3, 6)) -> Hierarchy:
    caches = [DeviceTier(ROW, caps[0], policies[0], num_rows=1000), DRAMTier(ROW, caps[1], policies[1], num_rows=1000)]
    return Hierarchy(caches, DictHome(), initial)


ops = st.lists(st.tuples(st.sampled_from(["read", "write", "flush"]),
                         st.lists(st.integers(0, 20), min_size=1, max_size=9, unique=True),
                         st.integers(0, 255)), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops, st.sampled_from(["lru", "lfu", "clock", "lru+tinylfu"]), st.sampled_from(["lru", "clock", "lfu+tinylfu"]))
def test_hierarchy_matches_dict_model(seq, p0, p1) -> None:
    h = make((p0, p1))
    model: dict[int, np.ndarray] = {}
    reads = 0
    for op, ids, val in seq:
        arr = np.array(ids, np.int64)
        if op == "write":
            rows = np.array([[val, i, *range(ROW - 2)] for i in ids], np.uint8)
            h.write(arr, rows)
            model.update({i: r for i, r in zip(ids, rows)})
        elif op == "read":
            got = h.read(arr)
            want = np.stack([model.get(i, initial(np.array([i]))[0]) for i in ids])
            np.testing.assert_array_equal(got, want)
            reads += len(ids)
        else:
            h.flush()  # everything acknowledged is now in the home itself
            assert {i: r.tobytes() for i, r in model.items()} == h.home.data
        for t in h.caches:
            assert t.directory.resident <= t.capacity_rows
    top = h.caches[0].stats()
    assert top.hits + top.misses == reads


class FlakyHome(DictHome):
    """A DictHome whose ``fail_at``-th get or put from now raises (a full disk, an EIO), then works again."""

    fail_at: int | None = None

    def _maybe_fail(self, op: str) -> None:
        if self.fail_at is not None:
            self.fail_at -= 1
            if self.fail_at < 0:
                self.fail_at = None
                raise TierIOError("flaky", op, 5)

    def get(self, ids):
        self._maybe_fail("read")
        return super().get(ids)

    def put(self, ids, rows):
        self._maybe_fail("write")
        super().put(ids, rows)


def newest(h: Hierarchy, key: int) -> bytes:
    """A row's bytes in the highest level holding it (the hierarchy's invariant), read without touching a policy."""
    for t in h.caches:
        s = int(t.directory.lookup(np.array([key], np.int64))[0])
        if s >= 0:
            return t.read_slots(np.array([s]))[0].tobytes()
    return h.home.data.get(key, initial(np.array([key]))[0].tobytes())


N_KEYS = 21


@settings(max_examples=120, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["read", "write", "flush"]),
                          st.lists(st.integers(0, N_KEYS - 1), min_size=1, max_size=9, unique=True),
                          st.integers(0, 255), st.none() | st.integers(0, 3)), min_size=1, max_size=40),
       st.lists(st.tuples(st.sampled_from([1, 2, 5, N_KEYS]), st.sampled_from(["lru", "lfu", "clock", "lru+tinylfu"])),
                min_size=1, max_size=2))
def test_a_failing_home_loses_no_write_and_corrupts_no_row(seq, levels) -> None:
    """The home fails (``fail_at``-th call) in the middle of a read, a write, an eviction's write-back or
    a flush. The error reaches the caller; afterwards every row still reads as the dict model says (no
    cache slot is left mapped to another row's bytes, no evicted dirty row is dropped), a write retried
    after its failure lands, and a flush that follows a failed one makes every row durable."""
    home = FlakyHome()
    h = Hierarchy([DRAMTier(ROW, cap, pol, num_rows=N_KEYS) for cap, pol in levels], home, initial)
    model: dict[int, bytes] = {}
    for op, ids, val, fail_at in seq:
        arr = np.array(ids, np.int64)
        rows = np.array([[val, i, *range(ROW - 2)] for i in ids], np.uint8)
        home.fail_at = fail_at
        try:
            if op == "write":
                h.write(arr, rows)
            elif op == "read":
                got = h.read(arr)
                assert [g.tobytes() for g in got] == [model.get(i, initial(np.array([i]))[0].tobytes()) for i in ids]
            else:
                h.flush()
                assert home.data == model
        except TierIOError:
            assert fail_at is not None
            if op == "write":  # a failed write changed no row (a later flush must not make it durable)
                home.fail_at = None
                assert [newest(h, k) for k in range(N_KEYS)] == [
                    model.get(k, initial(np.array([k]))[0].tobytes()) for k in range(N_KEYS)]
                h.write(arr, rows)  # the caller retries it
        if op == "write":
            model.update({i: r.tobytes() for i, r in zip(ids, rows)})
        home.fail_at = None
        assert [newest(h, k) for k in range(N_KEYS)] == [model.get(k, initial(np.array([k]))[0].tobytes())
                                                         for k in range(N_KEYS)]
        for t in h.caches:
            assert t.directory.resident <= t.capacity_rows
    h.flush()
    assert home.data == model


def test_a_failed_flush_is_retried_by_the_next() -> None:
    """Dirty bits are cleared only once their rows are written down: a flush after a failed one still
    writes them (it used to return having written nothing, the rows clean in the cache only)."""
    home = FlakyHome()
    h = Hierarchy([DRAMTier(ROW, 4, "lru", num_rows=100)], home, initial)
    h.write(np.array([1, 2], np.int64), np.full((2, ROW), 9, np.uint8))
    home.fail_at = 0
    with pytest.raises(TierIOError):
        h.flush()
    h.flush()
    assert sorted(home.data) == [1, 2]


def test_a_failed_home_read_leaves_no_row_mapped_to_garbage() -> None:
    """A read whose home fetch fails must not leave its ids resident in slots that never got their bytes."""
    home = FlakyHome()
    h = Hierarchy([DRAMTier(ROW, 4, "lru", num_rows=100)], home, initial)
    h.read(np.array([7], np.int64))
    home.fail_at = 0
    with pytest.raises(TierIOError):
        h.read(np.array([5, 6], np.int64))
    ids = np.array([5, 6, 7], np.int64)
    np.testing.assert_array_equal(h.read(ids), initial(ids))


def test_a_failed_write_back_keeps_the_evicted_dirty_rows() -> None:
    home = FlakyHome()
    h = Hierarchy([DRAMTier(ROW, 2, "lru", num_rows=100)], home, initial)
    h.write(np.array([1, 2], np.int64), np.full((2, ROW), 9, np.uint8))
    home.fail_at = 0
    with pytest.raises(TierIOError):
        h.read(np.array([3], np.int64))  # evicts 1 (dirty): its write-back fails
    assert h.caches[0].counters.evictions == 0  # 1 is back in the cache: nothing was evicted
    assert h.read(np.array([1, 2, 3], np.int64))[:, 0].tolist() == [9, 9, 3]


def test_a_write_whose_rest_fails_below_changes_no_row() -> None:
    """A write of 3 rows into a 2-row cache: one goes down to the home, which fails. The caller is told
    the write failed (the server answers 507/503 and cuts it from its log), so no row of it may read as
    written or reach the home at the next flush (two used to land dirty in the cache and be flushed)."""
    home = FlakyHome()
    h = Hierarchy([DRAMTier(ROW, 2, "lru", num_rows=100)], home, initial)
    h.write(np.array([1], np.int64), np.full((1, ROW), 5, np.uint8))
    h.flush()  # row 1 clean: its eviction writes nothing back, the put of the rest is the first home call
    home.fail_at = 0
    with pytest.raises(TierIOError):
        h.write(np.array([1, 2, 3], np.int64), np.full((3, ROW), 7, np.uint8))
    ids = np.array([1, 2, 3], np.int64)
    want = initial(ids)
    want[0] = 5
    np.testing.assert_array_equal(h.read(ids), want)
    h.flush()
    assert home.data == {1: bytes([5] * ROW)}


class WriteBackCheckingHome(DictHome):
    """Refuses a put that would not change the home: a clean row written back (every write in the test
    below carries a fresh value, so a dirty row always differs from the home's copy)."""

    def put(self, ids, rows):
        for i, r in zip(ids, rows):
            have = self.data.get(int(i), initial(np.array([i]))[0].tobytes())
            assert have != r.tobytes(), f"row {int(i)} written back clean"
        super().put(ids, rows)


@settings(max_examples=100, deadline=None)
@given(ops, st.sampled_from(["lru", "lfu", "clock", "lru+tinylfu"]), st.sampled_from([1, 2, 4, 1000]))
def test_only_dirty_rows_are_written_back(seq, policy, capacity) -> None:
    """Evicting or flushing a row that was only read (promoted) never writes it down; every dirty row
    reaches the home with its latest value (checked by the flushes)."""
    h = Hierarchy([DRAMTier(ROW, capacity, policy, num_rows=1000), DRAMTier(ROW, 3, "lru", num_rows=1000)],
                  WriteBackCheckingHome(), initial)
    model: dict[int, bytes] = {}
    for n, (op, ids, _) in enumerate(seq):
        arr = np.array(ids, np.int64)
        if op == "write":
            rows = np.array([[n % 256, n // 256, 1 + i % 250, *range(ROW - 3)] for i in ids], np.uint8)
            h.write(arr, rows)
            model.update({i: r.tobytes() for i, r in zip(ids, rows)})
        elif op == "read":
            h.read(arr)
        else:
            h.flush()
            assert h.home.data == model
    h.flush()
    assert h.home.data == model


def test_flush_writes_everything_home() -> None:
    h = make()
    ids = np.arange(15, dtype=np.int64)
    rows = np.repeat(np.arange(15, dtype=np.uint8)[:, None] + 7, ROW, axis=1)
    h.write(ids, rows)
    assert len(h.home.data) < 15  # most rows still only in caches
    h.flush()
    assert {i: np.frombuffer(b, np.uint8)[0] for i, b in h.home.data.items()} == {i: i + 7 for i in range(15)}
    assert not any(t.dirty.any() for t in h.caches)


def test_eviction_writes_dirty_rows_down() -> None:
    h = Hierarchy([DRAMTier(ROW, 2, "lru", num_rows=100)], DictHome(), initial)
    h.write(np.array([1, 2], np.int64), np.full((2, ROW), 9, np.uint8))
    h.read(np.array([3, 4], np.int64))  # evicts 1 and 2
    assert sorted(h.home.data) == [1, 2]
    assert h.caches[0].stats().evictions == 2


def test_full_capacity_tier_uses_direct_slots() -> None:
    t = DRAMTier(ROW, 100, "lru", num_rows=50)
    h = Hierarchy([t], DictHome(), initial)
    ids = np.array([49, 0, 7], np.int64)
    np.testing.assert_array_equal(h.read(ids), initial(ids))
    assert t.directory.lookup(ids).tolist() == [49, 0, 7]


@pytest.mark.parametrize("capacity", [10, 4])  # direct-mapped (covers the table) / keyed
@pytest.mark.parametrize("bad", [-1, 10, 2**40])
def test_cache_tier_refuses_ids_outside_the_table(capacity: int, bad: int) -> None:
    """get/contains/delete check ids like put does: a direct-mapped tier used to index its presence flags
    with them, so ``delete([-1])`` dropped row 9 (numpy wraps) and an id past the end raised IndexError."""
    t = DRAMTier(ROW, capacity, "lru", num_rows=10)
    t.put(np.array([9, 1], np.int64), np.full((2, ROW), 5, np.uint8))
    for op in (t.get, t.contains, t.delete):
        with pytest.raises(IdOutOfRangeError):
            op(np.array([1, bad], np.int64))
    for bad_ids in (np.array([1.0]), np.array([1], np.int32), np.array([[1]], np.int64)):
        with pytest.raises(InvalidInputError):
            t.get(bad_ids)
    assert t.contains(np.array([9, 1], np.int64)).all() and t.resident_rows == 2


@pytest.mark.parametrize("kind", ["dram", "device", "mmap"])
def test_cache_tier_after_close(kind: str, tmp_path) -> None:
    """Like every other tier: use after close is a StoreClosedError, and close is idempotent (the mmap
    cache's second close used to raise AttributeError)."""
    t = {"dram": lambda: DRAMTier(ROW, 4, "lru", num_rows=10), "device": lambda: DeviceTier(ROW, 4, "lru", num_rows=10),
         "mmap": lambda: MmapCacheTier(tmp_path / "c.mmap", ROW, 4, "lru", num_rows=10)}[kind]()
    ids = np.array([1], np.int64)
    t.put(ids, np.ones((1, ROW), np.uint8))
    t.close()
    t.close()
    for call in (lambda: t.get(ids), lambda: t.contains(ids), lambda: t.delete(ids),
                 lambda: t.put(ids, np.ones((1, ROW), np.uint8))):
        with pytest.raises(StoreClosedError):
            call()


@given(st.lists(st.integers(-5, 5), max_size=50))
def test_unique_inverse_and_last(ids: list[int]) -> None:
    arr = np.array(ids, np.int64)
    u, inv = unique_inverse(arr)
    np.testing.assert_array_equal(u[inv], arr)
    assert len(u) == len(set(ids)) and list(u) == list(dict.fromkeys(ids))
    u2, last = unique_last(arr)
    assert sorted(u2.tolist()) == sorted(set(ids))
    for k, pos in zip(u2, last):
        assert arr[pos] == k and k not in ids[pos + 1:]


@given(st.lists(st.lists(st.integers(-3, 40), max_size=30), max_size=6), st.booleans())
def test_unique_inverse_each_equals_one_at_a_time(arrays: list[list[int]], parallel: bool) -> None:
    arrs = [np.array(a, np.int64) for a in arrays]
    with kernel_path(parallel):
        each = unique_inverse_each(arrs)
    for (u, inv), a in zip(each, arrs, strict=True):
        u1, inv1 = unique_inverse(a)
        np.testing.assert_array_equal(u, u1)
        np.testing.assert_array_equal(inv, inv1)


def test_unique_inverse_each_works_in_a_forked_child() -> None:
    """The dedup thread pool is per process: a child forked after the parent used it must not hang."""
    import os

    arrs = [np.arange(100, dtype=np.int64) % 7 for _ in range(4)]
    with kernel_path(parallel=True):
        unique_inverse_each(arrs)  # the parent's pool exists now
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            ok = all(len(u) == 7 for u, _ in unique_inverse_each(arrs))
            os._exit(0 if ok else 1)
    deadline = 30
    import time

    start = time.monotonic()
    while time.monotonic() - start < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    raise AssertionError("unique_inverse_each hung in a forked child")


@given(st.lists(st.integers(0, 19), max_size=60), st.integers(1, 6), st.booleans())
def test_gather_rows_reads_the_leading_columns(idx: list[int], extra: int, parallel: bool) -> None:
    slab = np.random.default_rng(1).standard_normal((20, 5 + extra)).astype(np.float32)
    out = np.empty((len(idx), 5), np.float32)
    with kernel_path(parallel):
        gather_rows(slab, np.array(idx, np.int64), out)
    np.testing.assert_array_equal(out, slab[idx, :5])


@given(st.lists(st.integers(0, 9), max_size=40), st.data(), st.booleans())
def test_pool_matches_numpy(idx: list[int], data, parallel: bool) -> None:
    rows = np.random.default_rng(0).standard_normal((10, 4)).astype(np.float32)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(idx)), max_size=5)))
    offsets = np.array([0, *cuts, len(idx)], np.int64)
    for mode in ("sum", "mean"):
        with kernel_path(parallel):
            got = pool(rows, np.array(idx, np.int64), offsets, mode)
        for b in range(len(offsets) - 1):
            bag = rows[idx[offsets[b]:offsets[b + 1]]]
            want = np.zeros(4, np.float32) if len(bag) == 0 else (bag.sum(0) if mode == "sum" else bag.mean(0))
            np.testing.assert_allclose(got[b], want, rtol=1e-5, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 39), max_size=200), st.data(), st.integers(0, 3), st.booleans(),
       st.sampled_from(["sum", "mean"]))
def test_pool_rows_equals_torch_embedding_bag_bit_for_bit(idx: list[int], data, extra: int, parallel: bool,
                                                          mode: str) -> None:
    """The pooling kernel adds four rows per step but in torch's order, so its sums are torch's to the
    bit; bags long and short, split between threads, over slab rows that carry extra columns."""
    import torch

    dim = 5
    slab = np.random.default_rng(len(idx)).standard_normal((40, dim + extra)).astype(np.float32)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(idx)), max_size=8)))
    offsets = np.array([0, *cuts, len(idx)], np.int64)
    ids = np.array(idx, np.int64)
    out = np.full((len(offsets) - 1, dim), np.nan, np.float32)
    with kernel_path(parallel):
        pool_rows(slab, ids, offsets, mode == "mean", out)
    want = torch.nn.functional.embedding_bag(torch.from_numpy(ids), torch.from_numpy(slab[:, :dim].copy()),
                                             torch.from_numpy(offsets[:-1]), mode=mode).numpy()
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("shape,dtype", [((3, 7), np.uint8), ((1000, 64), np.float32), ((9000, 256), np.uint8)])
def test_aligned_zeros_starts_on_a_line_or_huge_page(shape: tuple[int, int], dtype: type) -> None:
    a = aligned_zeros(shape, dtype)
    nbytes = a.nbytes
    assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous and not a.any()
    assert a.ctypes.data % (HUGE_PAGE if nbytes >= HUGE_PAGE else 64) == 0
    assert aligned_zeros(shape, dtype, 4096).ctypes.data % 4096 == 0


def test_dram_slab_rows_start_on_cache_lines() -> None:
    """A 256-byte row must span 4 cache lines, not 5 (numpy's own buffers start 16 bytes into a page)."""
    tier = DRAMTier(256, 10_000)
    assert tier.slab.ctypes.data % 64 == 0


def test_kernel_threads_by_work_size() -> None:
    """Small calls run on the calling thread; large ones on all of numba's; the setting is restored."""
    import numba

    from embstore import kernels

    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)  # not whatever an earlier test (or a bug) left
    full = numba.get_num_threads()
    with kernels.kernel_threads(kernels.PARALLEL_MIN_ITEMS - 1) as n:
        assert n == 1 and numba.get_num_threads() == 1
    assert numba.get_num_threads() == full
    with kernels.kernel_threads(kernels.PARALLEL_MIN_ITEMS) as n:
        assert n == full == numba.get_num_threads()
    try:
        with kernels.kernel_threads(0):
            raise KeyError("boom")
    except KeyError:
        pass
    assert numba.get_num_threads() == full
