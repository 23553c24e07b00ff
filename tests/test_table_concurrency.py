"""Threads sharing one table: every lookup, pooled lookup, write, flush and stats call stays
linearizable per row, in every tier layout a table can have.

Three or four threads run random operations on one table of a store: ``update`` of 1-4 distinct ids,
every element of a written row set to a value unique to that write (so a torn row, or a row from
another write or slot, is never mistaken for a right one); ``lookup`` of ids with repeats (numpy or
torch); ``lookup_pooled`` (sum and mean) of bags whose possible results can be enumerated;
``store.flush()``; ``stats()``. Tables hold 8x the rows their top cache does, so it evicts and writes
back dirty rows all the time. A shared :class:`Clock` stamps each call's start (before it is made)
and end (after it returns), which gives the real-time history the check runs on.

The reference model, per physical row: a read that started at ``s`` and ended at ``e`` may return
the value of a write ``W`` that started before ``e`` and that no write ``W2`` supersedes before the
read began (``W.end < W2.start`` and ``W2.end < s``), or the initial row while no write to it has
ended before ``s``. A pooled bag must equal the sum (or mean) of one such choice per row. After the
run the store is flushed, closed and reopened, and each row must hold what that rule allows with
``s = e =`` the end of the run. The tier statistics must add up: each level's hits and misses are
the rows asked of it (the distinct rows of every read at the top, the misses of the level above
below it), and no bounded tier holds more rows than its capacity.

Callers' arrays are the callers' own: a writer poisons its row buffer (NaN) as soon as ``update``
returns, and a reader poisons the rows it got back once it has copied them for the check, so a
tier that kept a reference to either would serve NaN to a later read, which no rule allows.

The operation sequences are deterministic per seed; the interleaving is not (that is what the test
explores; ``sys.setswitchinterval`` is lowered so that threads switch often).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

import embstore
from embstore.config import HashConfig, StoreConfig, TableConfig, TierConfig
from embstore.rows import RowFormat, initial_rows
from homes import home_tier
from log_faults import in_thread
from test_wal_concurrency import Clock

DIM = 4
ROWS = 64  # physical rows of each table: 8x the top cache, so it evicts and writes back constantly
CACHE_ROWS = 8
ROW_BYTES = {"float32": 4 * DIM, "float16": 2 * DIM, "int8": DIM + 8}
BIG = 16_400  # ids of a big read: numba's parallel kernels (dedup count, pooling) run from 16,384 on
MAX_WRITES = 4096  # distinct write values exactly representable in float16: +-1 .. +-2048
TABLE = "t"


@dataclass(frozen=True)
class Case:
    """A table layout under test; raw ids are drawn from ``[0, raw_ids)``."""

    table: TableConfig
    raw_ids: int


def cache(kind: str, rows: int, policy: str, dtype: str = "float32") -> TierConfig:
    return TierConfig(kind, rows * ROW_BYTES[dtype], policy)


def tiered(policy: str, home: str, dtype: str = "float32") -> Case:
    """A small dram cache of ``policy`` over ``home``."""
    return Case(TableConfig(TABLE, ROWS, DIM, dtype=dtype, tiers=(cache("dram", CACHE_ROWS, policy, dtype),
                                                                  home_tier(home))), ROWS)


POLICIES = ("lru", "lfu", "clock", "lru+tinylfu")
HOMES = ("ssd", "ssd-log", "mmap", "rocksdb")
CASES: dict[str, Case] = {f"{policy}-{home}": tiered(policy, home) for policy in POLICIES for home in HOMES}
CASES.update({
    "device-dram-ssd": Case(TableConfig(TABLE, ROWS, DIM, tiers=(cache("device", 4, "lru"),
                                                                 cache("dram", CACHE_ROWS, "clock"), home_tier("ssd"))),
                            ROWS),
    # a whole-table float32 dram slab: lookups, pooling and updates of resident rows take the fast paths
    "direct-dram-mmap": Case(TableConfig(TABLE, ROWS, DIM, tiers=(cache("dram", ROWS, "lru"), home_tier("mmap"))),
                             ROWS),
    "float16-lru-ssd-log": tiered("lru", "ssd-log", "float16"),
    "int8-lfu-rocksdb": tiered("lfu+tinylfu", "rocksdb", "int8"),
    # the hashing trick: 3x as many raw ids as rows, so ids share rows
    "hashed-clock-mmap": Case(TableConfig(TABLE, 48, DIM, hash=HashConfig("mod", seed=7),
                                          tiers=(cache("dram", CACHE_ROWS, "clock"), home_tier("mmap"))), 144),
})


def write_value(index: int) -> float:
    """The value of the ``index``-th write: a distinct integer, exact in float32, float16 and int8 rows
    (a constant int8 row is stored as its bias), and far from the initial rows (|x| < 0.01)."""
    assert index < MAX_WRITES, "more writes than float16 has distinct integers for"
    return float((index // 2 + 1) * (1 if index % 2 == 0 else -1))


@dataclass
class Write:
    rows: tuple[int, ...]  # physical rows (a hashed table's ids may share one: it takes the value once)
    value: float
    start: int
    end: int


@dataclass
class Read:
    """A lookup (``offsets`` None) or a pooled lookup, with what it returned (copied before poisoning)."""

    rows: np.ndarray  # physical row of each id
    start: int
    end: int
    got: np.ndarray
    offsets: np.ndarray | None = None
    mode: str = "sum"
    thread: int = 0


@dataclass
class History:
    writes: list[Write] = field(default_factory=list)
    reads: list[Read] = field(default_factory=list)
    flushes: list[tuple[int, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, item: Write | Read) -> None:
        with self.lock:
            (self.writes if isinstance(item, Write) else self.reads).append(item)


class Model:
    """The writes to each physical row, and what a read of it over ``[s, e]`` may return."""

    def __init__(self, history: History, initial: np.ndarray) -> None:
        self.initial = initial  # (num_rows, dim) float32, through the table's row format
        self.by_row: dict[int, list[Write]] = {}
        for w in history.writes:
            for r in set(w.rows):
                self.by_row.setdefault(r, []).append(w)
        self.flushes = history.flushes

    def allowed(self, row: int, s: int, e: int) -> tuple[list[float], bool]:
        """(write values a read over [s, e] may see, whether the initial row may still show)."""
        ws = self.by_row.get(row, [])
        done = [w for w in ws if w.end < s]
        latest_start = max((w.start for w in done), default=-1)  # a write ending before that start is superseded
        values = [w.value for w in ws if w.start < e and w.end >= latest_start]
        return values, not done

    def options(self, row: int, s: int, e: int) -> list[np.ndarray]:
        """Every row value a read over [s, e] may return for ``row``."""
        values, initial_ok = self.allowed(row, s, e)
        out = [np.full(self.initial.shape[1], v, np.float32) for v in values]
        return out + [self.initial[row]] if initial_ok else out

    def explain(self, row: int, s: int, e: int) -> str:
        """The row's writes around [s, e], for a failure message."""
        near = [w for w in self.by_row.get(row, []) if w.start < e + 40 and w.end > s - 40]
        flushes = [f for f in self.flushes if s - 40 < f[1] and f[0] < e + 40]
        values, initial_ok = self.allowed(row, s, e)
        return (f"row {row}, read over [{s}, {e}]: allowed {values}{' or its initial row' if initial_ok else ''}; "
                f"writes near it: {near}; flushes near it: {flushes}")

    def check_lookup(self, read: Read) -> None:
        uniq, first, inverse = np.unique(read.rows, return_index=True, return_inverse=True)
        same = (read.got == read.got[first[inverse]]).all(axis=1)  # one call reads a row once: repeats agree
        assert same.all(), (f"thread {read.thread}: row {int(read.rows[np.argmin(same)])} read twice in one "
                            f"lookup differs: {read}")
        for row, i in zip(uniq.tolist(), first.tolist()):
            got = read.got[i]
            assert any(np.array_equal(got, opt) for opt in self.options(row, read.start, read.end)), (
                f"thread {read.thread} lookup of {len(read.rows)} rows (row {row} at position {i}) = "
                f"{got.tolist()}; " + self.explain(row, read.start, read.end))

    def check_pooled(self, read: Read) -> None:
        assert read.offsets is not None
        for b in range(len(read.offsets) - 1):
            bag = read.rows[read.offsets[b]:read.offsets[b + 1]]
            got = read.got[b]
            if not len(bag):
                assert np.array_equal(got, np.zeros_like(got)), f"empty bag {b} pooled to {got.tolist()}"
                continue
            distinct, counts = np.unique(bag, return_counts=True)
            choices = [self.options(int(r), read.start, read.end) for r in distinct]
            if not any(self._pools_to(got, [c * v for c, v in zip(counts, combo)], len(bag), read.mode)
                       for combo in _product(choices)):
                raise AssertionError(f"thread {read.thread} pooled ({read.mode}) bag {b} of rows {bag.tolist()} = "
                                     f"{got.tolist()}, no combination of allowed rows gives it; "
                                     + "; ".join(self.explain(int(r), read.start, read.end) for r in distinct))

    @staticmethod
    def _pools_to(got: np.ndarray, terms: list[np.ndarray], n: int, mode: str) -> bool:
        """Whether ``got`` is the float32 sum (or mean over ``n``) of ``terms``, within float32 rounding of
        a few additions (the order of the additions is the kernel's)."""
        exact = np.sum(np.array(terms, np.float64), axis=0)
        scale = np.sum(np.abs(np.array(terms, np.float64)), axis=0)
        if mode == "mean":
            exact, scale = exact / n, scale / n
        return bool(np.all(np.abs(got - exact) <= 4 * n * np.finfo(np.float32).eps * scale + 1e-30))


def _product(choices: list[list[np.ndarray]]) -> Iterator[list[np.ndarray]]:
    if not choices:
        yield []
        return
    for head in choices[0]:
        for rest in _product(choices[1:]):
            yield [head, *rest]


def initial_table(cfg: TableConfig, num_rows: int) -> np.ndarray:
    """What never-written rows read as, through the table's row format (float16, int8 round them)."""
    fmt = RowFormat(DIM, cfg.dtype)
    return fmt.decode(fmt.encode(initial_rows(cfg.init, np.arange(num_rows, dtype=np.int64), DIM)))


@dataclass
class Run:
    """One stress run's inputs and what it counted."""

    case: Case
    seed: int
    threads: int
    ops: int
    phys: np.ndarray  # raw id -> physical row (the hash's pure-Python reference, or the identity)
    history: History = field(default_factory=History)
    rows_read: int = 0  # distinct rows asked of the top tier, summed over reads
    ids_read: int = 0  # ids looked up, before dedup
    counted: threading.Lock = field(default_factory=threading.Lock)


def worker(store: embstore.Store, run: Run, me: int, clock: Clock, start: threading.Barrier) -> None:
    """``run.ops`` random operations: updates (35%), lookups (30%), pooled lookups (22%), stats (8%),
    flushes (5%); one op in 300 (at least one) is a big lookup (BIG ids), as many a big pooled one."""
    table = store[TABLE]
    rng = np.random.default_rng([run.seed, me])
    buffers = {n: np.empty((n, DIM), np.float32) for n in range(1, 5)}  # reused: poisoned after each write
    last_stats: dict[str, dict[str, int]] | None = None
    writes = 0
    big = rng.choice(run.ops, 2 * max(1, run.ops // 300), replace=False)
    big_lookups, big_pooled = set(big[::2].tolist()), set(big[1::2].tolist())
    start.wait()
    for k in range(run.ops):
        op = 0.5 if k in big_lookups else 0.8 if k in big_pooled else rng.random()
        if op < 0.35:
            ids = rng.choice(run.case.raw_ids, int(rng.integers(1, 5)), replace=False).astype(np.int64)
            value = write_value(writes * run.threads + me)
            writes += 1
            rows = buffers[len(ids)]
            rows.fill(value)
            s = clock()
            table.update(ids, rows)
            e = clock()
            rows.fill(np.nan)  # the table must have copied what it keeps
            run.history.add(Write(tuple(run.phys[ids].tolist()), value, s, e))
        elif op < 0.65:
            n = BIG if k in big_lookups else int(rng.integers(1, 9))
            ids = rng.integers(0, run.case.raw_ids, n).astype(np.int64)
            as_torch = rng.random() < 0.25
            s = clock()
            out = table.lookup(torch.from_numpy(ids) if as_torch else ids)
            e = clock()
            got = out.cpu().numpy().copy() if as_torch else out.copy()
            if as_torch:
                out.fill_(float("nan"))
            else:
                out.fill(np.nan)
            _count(run, ids)
            run.history.add(Read(run.phys[ids], s, e, got, thread=me))
        elif op < 0.87:
            bags = big_bags if k in big_pooled else random_bags
            ids, offsets = bags(rng, run.case.raw_ids)
            mode = "mean" if rng.random() < 0.5 else "sum"
            s = clock()
            out = table.lookup_pooled(ids, offsets, mode)
            e = clock()
            got = out.copy()
            out.fill(np.nan)
            _count(run, ids)
            run.history.add(Read(run.phys[ids], s, e, got, offsets, mode, me))
        elif op < 0.95:
            stats = table.stats()
            for name, d in stats.items():
                assert d["capacity_rows"] == 0 or d["resident_rows"] <= d["capacity_rows"], (name, d)
                if last_stats is not None:  # counters only grow (no fault here undoes an eviction)
                    for key in ("hits", "misses", "evictions", "bytes_read", "bytes_written"):
                        assert d[key] >= last_stats[name][key], (name, key, last_stats[name], d)
            last_stats = stats
        else:
            s = clock()
            store.flush()
            e = clock()
            with run.history.lock:
                run.history.flushes.append((s, e))


def _count(run: Run, ids: np.ndarray) -> None:
    with run.counted:
        run.rows_read += len(np.unique(run.phys[ids]))
        run.ids_read += len(ids)


def random_bags(rng: np.random.Generator, raw_ids: int) -> tuple[np.ndarray, np.ndarray]:
    """1-4 bags: one id repeated 1-3 times, 1-3 distinct ids each once or twice (shuffled), or empty."""
    bags: list[np.ndarray] = []
    for _ in range(int(rng.integers(1, 5))):
        kind = rng.random()
        if kind < 0.4:
            bags.append(np.full(int(rng.integers(1, 4)), rng.integers(raw_ids), np.int64))
        elif kind < 0.9:
            distinct = rng.choice(raw_ids, int(rng.integers(1, 4)), replace=False)
            bags.append(rng.permutation(np.repeat(distinct, rng.integers(1, 3, len(distinct)))).astype(np.int64))
        else:
            bags.append(np.zeros(0, np.int64))
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in bags])]).astype(np.int64)
    return np.concatenate(bags).astype(np.int64), offsets


def big_bags(rng: np.random.Generator, raw_ids: int) -> tuple[np.ndarray, np.ndarray]:
    """BIG ids in bags of one id repeated 1-7 times (their pooled values are cheap to enumerate)."""
    sizes = rng.integers(1, 8, BIG)
    sizes = sizes[:np.searchsorted(np.cumsum(sizes), BIG)]
    sizes = np.append(sizes, BIG - sizes.sum())
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return np.repeat(rng.integers(0, raw_ids, len(sizes)), sizes).astype(np.int64), offsets


@pytest.fixture()
def frequent_switches() -> Iterator[None]:
    """Switch threads every 10 us instead of 5 ms: more interleavings per run."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(old)


def physical_map(store: embstore.Store, case: Case) -> np.ndarray:
    """Raw id -> physical row by the hash's pure-Python reference (identity when unhashed)."""
    mapper = store[TABLE].mapper
    if mapper is None:
        return np.arange(case.raw_ids, dtype=np.int64)
    return np.array([mapper.row_of(i) for i in range(case.raw_ids)], np.int64)


def stress(tmp_path: Path, name: str, seed: int, threads: int, ops: int) -> Run:
    """Run the workers, check every read of the history, the statistics, and the rows after a reopen."""
    case = CASES[name]
    path = tmp_path / "s"
    store = embstore.create(path, StoreConfig((case.table,)))
    run = Run(case, seed, threads, ops, physical_map(store, case))
    num_rows = store[TABLE].num_rows
    clock, barrier = Clock(), threading.Barrier(threads)
    pool = [in_thread(lambda me=me: worker(store, run, me, clock, barrier), f"worker-{me}") for me in range(threads)]
    deadline = time.monotonic() + 300
    for thread, _ in pool:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread, _ in pool), "a worker is stuck (a deadlock?)"
    errors = [out[0] for _, out in pool if out[0] is not None]
    if errors:
        raise errors[0]

    table = store[TABLE]
    check_stats(run, table.stats(), table.lookups)
    end = clock()
    model = Model(run.history, initial_table(case.table, num_rows))
    for read in run.history.reads:
        model.check_pooled(read) if read.offsets is not None else model.check_lookup(read)

    store.flush()
    store.close()
    with embstore.open(path) as again:
        home_stats = list(again[TABLE].stats().values())[-1]
        if case.table.tiers[-1].kind.value != "rocksdb":  # RocksDB's key count is an estimate
            assert home_stats["resident_rows"] == len(model.by_row), (home_stats, sorted(model.by_row))
        rows = np.arange(num_rows, dtype=np.int64)
        final = again[TABLE].read_physical(rows)
    for row in rows.tolist():
        assert any(np.array_equal(final[row], opt) for opt in model.options(row, end, end)), (
            f"after reopening: row {row} = {final[row].tolist()}; " + model.explain(row, end, end))
    return run


def check_stats(run: Run, stats: dict[str, dict[str, int]], lookups: int) -> None:
    """Each level was asked for exactly the rows the level above missed (the top: every read's distinct
    rows); bounded caches stay within capacity and, being 8x too small, evicted."""
    assert lookups == run.ids_read
    asked = run.rows_read
    levels = list(stats.items())
    for i, (name, d) in enumerate(levels):
        assert d["hits"] + d["misses"] == asked, (name, d, asked, stats)
        asked = d["misses"]
        if d["capacity_rows"]:
            assert d["resident_rows"] <= d["capacity_rows"], (name, d)
        if i < len(levels) - 1 and d["capacity_rows"] < run.phys.max() + 1:
            assert d["evictions"] > 0, (name, d)


def check_workload(run: Run) -> None:
    """The run did what it is meant to: reads overlapped writes, big reads ran (parallel kernels),
    ids shared rows on the hashed table."""
    h = run.history
    assert h.writes and h.flushes and any(r.offsets is not None for r in h.reads)
    assert any(len(r.rows) >= BIG and r.offsets is None for r in h.reads)
    assert any(len(r.rows) >= BIG and r.offsets is not None for r in h.reads)
    overlapping = sum(any(w.start < r.end and r.start < w.end for w in h.writes) for r in h.reads[:200])
    assert overlapping > 0, "no read overlapped a write"
    if run.case.table.hash.kind.value != "none":
        assert len(np.unique(run.phys)) < len(run.phys)


@pytest.mark.parametrize("name", list(CASES))
def test_concurrent_reads_writes_and_flushes_are_linearizable_per_row(tmp_path, frequent_switches, name) -> None:
    check_workload(stress(tmp_path, name, seed=0, threads=3, ops=160))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("seed", range(1, 4))
def test_concurrent_reads_writes_and_flushes_are_linearizable_per_row_long(tmp_path, frequent_switches, name,
                                                                           seed) -> None:
    check_workload(stress(tmp_path, name, seed=seed, threads=4, ops=1500))


def test_the_model_refuses_superseded_torn_and_foreign_rows() -> None:
    """The check has teeth: a value overwritten before the read began, a row mixing two writes, another
    row's value and a wrong pooled sum are refused; overlapping writes and the initial row are allowed."""
    history = History()
    history.writes = [Write((0,), 1.0, 1, 2), Write((0,), 2.0, 3, 4), Write((0, 1), 3.0, 5, 9),
                      Write((1,), 4.0, 6, 7)]
    initial = np.arange(8, dtype=np.float32).reshape(2, DIM) / 100
    model = Model(history, initial)
    assert model.allowed(0, 0, 1) == ([], True)  # nothing started before the read ended
    assert model.allowed(0, 2, 3) == ([1.0], True)  # write 1 still running when the read began
    assert model.allowed(0, 5, 6) == ([2.0, 3.0], False)  # write 1 superseded by write 2
    assert model.allowed(1, 8, 10) == ([3.0, 4.0], False)  # 4.0 ended before the read, but 3.0 overlapped it
    assert model.allowed(1, 10, 10) == ([3.0, 4.0], False)  # neither ordered before the other
    row = lambda *values: np.array([values], np.float32)  # noqa: E731 - one row per lookup

    model.check_lookup(Read(np.array([0]), 5, 6, row(3, 3, 3, 3)))
    model.check_lookup(Read(np.array([1]), 0, 1, initial[1:]))
    for bad in (row(1, 1, 1, 1), row(2, 2, 3, 3), row(4, 4, 4, 4)):
        with pytest.raises(AssertionError):
            model.check_lookup(Read(np.array([0]), 5, 6, bad))
    with pytest.raises(AssertionError):  # the same row read twice in one call must agree
        model.check_lookup(Read(np.array([0, 0]), 5, 6, np.concatenate([row(2, 2, 2, 2), row(3, 3, 3, 3)])))
    # rows 0, 1, 0 over [5, 6]: row 0 is 2.0 or 3.0, row 1 is 3.0 or initial; 2 * 3.0 + 3.0 = 9 pools,
    # 8 does not, and the mean divides by the bag's 3 ids
    model.check_pooled(Read(np.array([0, 1, 0]), 5, 6, row(9, 9, 9, 9), np.array([0, 3]), "sum"))
    model.check_pooled(Read(np.array([0, 1, 0]), 5, 6, row(3, 3, 3, 3), np.array([0, 3]), "mean"))
    model.check_pooled(Read(np.array([0, 1, 0]), 5, 6, 6 + initial[1:], np.array([0, 3]), "sum"))
    for bad, mode in ((row(8, 8, 8, 8), "sum"), (row(9, 9, 9, 9), "mean"), (row(9, 9, 9, 8), "sum")):
        with pytest.raises(AssertionError):
            model.check_pooled(Read(np.array([0, 1, 0]), 5, 6, bad, np.array([0, 3]), mode))
    with pytest.raises(AssertionError):  # an empty bag pools to zeros
        model.check_pooled(Read(np.zeros(0, np.int64), 5, 6, row(0, 0, 0, 1), np.array([0, 0]), "sum"))
