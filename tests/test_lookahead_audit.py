"""Audit of the told cache (``Table.announce``/``advance``, ``embstore.lookahead``) on real tiered tables.

A Hypothesis state machine interleaves announce / advance / lookup / lookup_pooled / update / flush /
close + reopen on a table behind one or two small DRAM caches (policies with and without TinyLFU) over an
ssd or a rocksdb home, unhashed or mod-hashed, and compares every read to a dict model. Invariants: the
pending count of the table and of every cache directory agree with the model; no cache holds more rows
than its capacity; per the README's stats semantics a cache level's hits + misses are the distinct rows
that reached it (level 0: the distinct rows of every read; a lower level: the misses of the one above);
the directory's look-ahead books (residents waiting for an announced use) are consistent; and every row
resident in the top cache holds the model's value. Boundary calls (bad ids, 2-D ids, wrong dtypes, empty
batches, advance with nothing pending, very many batches, tables with no cache tier or a QR hash) either
work as documented or raise a typed error and change nothing. Also: told caches over a failing home (the
hierarchy's undo path), and three defects found here (each test failed before its fix): the simulators
raised IndexError / OverflowError for announce >= 2**63 - 2 (``simulate`` clamps the window), counted wrong
hits for key -1 (EMPTY, the occurrence map's free entry: now refused), and ``pipeline(announce=A)`` with
lookahead + A + 1 > MAX_ANNOUNCED read 1,025 batches before the tables refused it blaming a missing
advance() (now refused up front, and by ``schedule.announce``).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import embstore
from embstore.belady import dedup_batches
from embstore.config import StoreConfig, TableConfig, TierConfig
from embstore.errors import ConfigError, IdOutOfRangeError, InvalidInputError, StoreClosedError, TierIOError
from embstore.hash_index import EMPTY
from embstore.hierarchy import Hierarchy
from embstore.lookahead import AMETA, A_NANN, A_ON, INF, NUSE
from embstore.policies import CacheDirectory, simulate
from embstore.rows import initial_rows
from embstore.simulator import miss_ratio_curve, replay_keys
from embstore.table import MAX_ANNOUNCED
from embstore.tiers.cache import DRAMTier
from embstore.training import TieredEmbeddingBagCollection
from embstore.training.testing import loss_of, random_batches
from embstore.training.trainer import ScheduleConfig

from cache_refs import optimum_with_bypass
from homes import home_tier
from test_hierarchy import ROW, FlakyHome, initial, newest
from test_training_prefetch import DIM as TP_DIM
from test_training_prefetch import ROWS as TP_ROWS
from test_training_prefetch import cold_store

DIM = 4
RB = 4 * DIM
ROWS = 40
RAW = 120  # raw ids of the mod-hashed table: three per row on average, so ids collide


def _config(home: str, p0: str, p1: str | None, hashed: bool) -> TableConfig:
    caches = (TierConfig("dram", 5 * RB, p0),) + ((TierConfig("dram", 9 * RB, p1),) if p1 else ())
    return TableConfig("t", ROWS, DIM, hash={"kind": "mod"} if hashed else {"kind": "none"},
                       tiers=caches + (home_tier(home),))


class ToldTableMachine(RuleBasedStateMachine):
    home = "ssd"

    @initialize(p0=st.sampled_from(["lfu+tinylfu", "lru", "clock", "lfu", "lru+tinylfu"]),
                p1=st.sampled_from([None, "lfu", "lru+tinylfu"]), hashed=st.booleans())
    def create(self, p0: str, p1: str | None, hashed: bool) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="embstore-told-"))
        self.cfg = _config(self.home, p0, p1, hashed)
        self.hashed = hashed
        self.store = embstore.create(self.dir / "s", StoreConfig((self.cfg,)))
        self.model: dict[int, np.ndarray] = {}  # physical row -> value written
        self.pending = 0  # batches announced, not advanced past
        self.reached = [0] * (3 if p1 else 2)  # per level (caches, then home): distinct rows read there
        self.read_rows = 0

    @property
    def table(self):
        return self.store["t"]

    def _phys(self, ids: list[int]) -> np.ndarray:
        arr = np.array(ids, np.int64)
        return self.table.mapper(arr) if self.hashed else arr

    def _ids(self, draw) -> list[int]:
        return draw(st.lists(st.integers(0, (RAW if self.hashed else ROWS) - 1), max_size=12))

    def expected(self, ids: list[int]) -> np.ndarray:
        phys = self._phys(ids)
        init = initial_rows(self.cfg.init, phys, DIM)
        return np.stack([self.model.get(int(p), init[j]) for j, p in enumerate(phys)]) if len(ids) else \
            np.zeros((0, DIM), np.float32)

    def _count_read(self, ids: list[int]) -> None:
        self.read_rows += len(set(self._phys(ids).tolist()))

    # --- rules -------------------------------------------------------------------------------------------
    @rule(data=st.data(), as_torch=st.booleans())
    def announce(self, data, as_torch: bool) -> None:
        ids = np.array(self._ids(data.draw), np.int64)
        if self.pending == MAX_ANNOUNCED:  # an advance() is missing: refused, nothing changes
            with pytest.raises(InvalidInputError, match="advance"):
                self.table.announce(ids)
            return
        self.table.announce(torch.from_numpy(ids) if as_torch else ids)
        self.pending += 1

    @rule(n=st.integers(20, 80), seed=st.integers(0, 2**16))
    def announce_many(self, n: int, seed: int) -> None:
        """Many batches pending at once: the ring and map grow while rows wait for their uses."""
        rng = np.random.default_rng(seed)
        hi = RAW if self.hashed else ROWS
        n = min(n, MAX_ANNOUNCED - self.pending)
        for _ in range(n):
            self.table.announce(rng.integers(0, hi, int(rng.integers(0, 15))).astype(np.int64))
        self.pending += n

    @rule(kind=st.sampled_from(["range", "neg", "float", "int32", "2d", "list", "scalar", "torch_int32"]))
    def announce_refused(self, kind: str) -> None:
        """A refused announcement raises a typed error and changes nothing (checked by the invariants)."""
        bad = {"range": np.array([1, ROWS + 3], np.int64), "neg": np.array([-1, 2], np.int64),
               "float": np.array([1.0, 2.0]), "int32": np.array([1, 2], np.int32),
               "2d": np.array([[1, 2], [3, 4]], np.int64), "list": [1, 2], "scalar": np.int64(3),
               "torch_int32": torch.tensor([1, 2], dtype=torch.int32)}[kind]
        if self.hashed and kind in ("range", "neg") and self.pending < MAX_ANNOUNCED:  # a hashed table takes any id
            self.table.announce(bad)
            self.pending += 1
            return
        out_of_range = kind in ("range", "neg") and self.pending < MAX_ANNOUNCED
        with pytest.raises(IdOutOfRangeError if out_of_range else InvalidInputError):
            self.table.announce(bad)

    @rule()
    def advance(self) -> None:
        assert self.table.advance() is (self.pending > 0)
        self.pending = max(0, self.pending - 1)

    @rule()
    def advance_all(self) -> None:
        while self.table.advance():
            self.pending -= 1
        assert self.pending == 0

    @rule(data=st.data(), as_torch=st.booleans())
    def lookup(self, data, as_torch: bool) -> None:
        ids = self._ids(data.draw)
        arr = np.array(ids, np.int64)
        got = self.table.lookup(torch.from_numpy(arr) if as_torch else arr)
        got = got.numpy() if as_torch else got
        np.testing.assert_array_equal(got, self.expected(ids))
        self._count_read(ids)

    @rule(data=st.data(), mode=st.sampled_from(["sum", "mean"]))
    def lookup_pooled(self, data, mode: str) -> None:
        ids = self._ids(data.draw)
        cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=3)))
        offsets = np.array([0, *cuts, len(ids)], np.int64)
        got = self.table.lookup_pooled(np.array(ids, np.int64), offsets, mode=mode)
        rows = self.expected(ids)
        want = np.zeros((len(offsets) - 1, DIM), np.float32)
        for b in range(len(offsets) - 1):
            bag = rows[offsets[b]:offsets[b + 1]]
            if len(bag):
                want[b] = bag.sum(0) if mode == "sum" else bag.mean(0)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        self._count_read(ids)

    @rule(data=st.data(), seed=st.integers(0, 2**16))
    def update(self, data, seed: int) -> None:
        ids = self._ids(data.draw)
        rows = np.random.default_rng(seed).standard_normal((len(ids), DIM)).astype(np.float32)
        self.table.update(np.array(ids, np.int64), rows)
        for p, r in zip(self._phys(ids).tolist(), rows):  # last write wins, also for ids hashed together
            self.model[p] = r

    @rule()
    def flush(self) -> None:
        self.store.flush()

    @rule()
    def reopen(self) -> None:
        """Announcements live in the process: a reopened table has none pending and counts from zero."""
        t = self.table
        self.store.close()
        with pytest.raises(StoreClosedError):
            t.announce(np.array([1], np.int64))
        with pytest.raises(StoreClosedError):
            t.advance()
        self.store = embstore.open(self.dir / "s")
        self.pending = 0
        self.read_rows = 0

    # --- invariants --------------------------------------------------------------------------------------
    @invariant()
    def books(self) -> None:
        if not hasattr(self, "store"):
            return
        t = self.table
        assert t.announced == self.pending
        caches = t.hierarchy.caches
        for tier in caches:
            assert tier.resident_rows <= tier.capacity_rows
            d = tier.directory
            assert isinstance(d, CacheDirectory)
            assert d.announced == self.pending
            if d._ah[AMETA][A_ON]:
                occupied = np.flatnonzero(d.slot_key != EMPTY)
                waiting = int((d._ah[NUSE][occupied] != INF).sum())
                assert int(d._ah[AMETA][A_NANN]) == waiting
                free = np.flatnonzero(d.slot_key == EMPTY)
                assert (d._ah[NUSE][free] == INF).all()
        stats = list(t.stats().values())
        assert stats[0]["hits"] + stats[0]["misses"] == self.read_rows
        for upper, lower in zip(stats[:len(caches)], stats[1:]):
            assert lower["hits"] + lower["misses"] == upper["misses"]
        # the top cache's resident rows hold the freshest copy: the model's value
        top = caches[0]
        occupied = np.flatnonzero(top.directory.slot_key != EMPTY)
        if len(occupied):
            keys = top.directory.slot_key[occupied]
            got = t.format.decode(top.read_slots(occupied))
            init = initial_rows(self.cfg.init, keys, DIM)
            want = np.stack([self.model.get(int(k), init[j]) for j, k in enumerate(keys)])
            np.testing.assert_array_equal(got, want)

    def teardown(self) -> None:
        if hasattr(self, "store"):
            self.store.close()
            shutil.rmtree(self.dir, ignore_errors=True)


class RocksDBToldTableMachine(ToldTableMachine):
    home = "rocksdb"


SETTINGS = settings(max_examples=20, stateful_step_count=30, deadline=None)
TestToldTableOverSSD = ToldTableMachine.TestCase
TestToldTableOverSSD.settings = SETTINGS
TestToldTableOverRocksDB = RocksDBToldTableMachine.TestCase
TestToldTableOverRocksDB.settings = SETTINGS


# --- boundaries ----------------------------------------------------------------------------------------------

def test_told_tables_without_a_ranking_cache_and_with_a_qr_hash(tmp_path) -> None:
    """A table with no cache tier counts and drops announcements like any other (nothing ranks them); a
    QR-hashed table is told both rows of every id, any int64 id; empty batches are batches; an advance with
    nothing pending returns False and leaves the next announcement where it belongs."""
    cfg = StoreConfig((TableConfig("home", ROWS, DIM, tiers=(TierConfig("ssd"),)),
                       TableConfig("qr", ROWS, DIM, hash={"kind": "qr", "collisions": 4},
                                   tiers=(TierConfig("dram", 3 * RB, "lfu+tinylfu"), TierConfig("ssd")))))
    with embstore.create(tmp_path / "s", cfg) as store:
        for name in ("home", "qr"):
            t = store[name]
            want = t.lookup(np.arange(ROWS, dtype=np.int64))
            assert not t.advance() and t.announced == 0
            t.announce(np.array([], np.int64))
            t.announce(np.array([], np.int32))  # an empty batch of another integer dtype is an empty batch
            t.announce(np.arange(ROWS, dtype=np.int64)[::-1])
            assert t.announced == 3
            ids = np.array([3, 3, 7, 0], np.int64)
            if name == "qr":
                t.announce(np.array([-(2**63), 2**63 - 1, 5], np.int64))
                for d in (tier.directory for tier in t.hierarchy.caches):
                    assert d.announced == 4
            np.testing.assert_array_equal(t.lookup(ids), want[ids])
            while t.advance():
                pass
            assert t.announced == 0 and not t.advance()
            np.testing.assert_array_equal(t.lookup(np.arange(ROWS, dtype=np.int64)), want)


@pytest.mark.parametrize("home", ["ssd", "rocksdb"])
def test_a_table_told_the_most_batches_it_keeps_reads_right(tmp_path, home) -> None:
    """1,024 batches pending (the ring and map grow many times over), a refused 1,025th changes nothing;
    reads and writes stay right while they are advanced past one by one, and after a reopen."""
    rng = np.random.default_rng(11)
    cfg = StoreConfig((_config(home, "lfu+tinylfu", "lru", hashed=False),))
    with embstore.create(tmp_path / "s", cfg) as store:
        t = store["t"]
        want = t.lookup(np.arange(ROWS, dtype=np.int64))
        batches = [rng.integers(0, ROWS, int(rng.integers(0, 20))).astype(np.int64) for _ in range(MAX_ANNOUNCED)]
        for b in batches:
            t.announce(b)
        with pytest.raises(InvalidInputError, match="advance"):
            t.announce(np.array([1], np.int64))
        assert t.announced == MAX_ANNOUNCED
        assert all(tier.directory.announced == MAX_ANNOUNCED for tier in t.hierarchy.caches)
        for i, b in enumerate(batches):
            if i % 3 == 0 and len(b):
                rows = rng.standard_normal((len(b), DIM)).astype(np.float32)
                t.update(b, rows)
                want[b] = rows[[len(b) - 1 - list(b[::-1]).index(k) for k in b]]  # last write wins
            else:
                np.testing.assert_array_equal(t.lookup(b), want[b])
            assert t.advance()
            for tier in t.hierarchy.caches:
                assert tier.resident_rows <= tier.capacity_rows
        assert not t.advance()
        np.testing.assert_array_equal(t.lookup(np.arange(ROWS, dtype=np.int64)), want)
    with embstore.open(tmp_path / "s") as store:
        assert store["t"].announced == 0
        np.testing.assert_array_equal(store["t"].lookup(np.arange(ROWS, dtype=np.int64)), want)


N_KEYS = 21


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["read", "write", "flush", "announce", "advance"]),
                          st.lists(st.integers(0, N_KEYS - 1), max_size=9, unique=True),
                          st.integers(0, 255), st.none() | st.integers(0, 3)), min_size=1, max_size=50),
       st.lists(st.tuples(st.sampled_from([1, 2, 3, 5]),
                          st.sampled_from(["lru", "lfu", "clock", "lru+tinylfu", "lfu+tinylfu"])),
                min_size=1, max_size=2))
def test_told_caches_over_a_failing_home_lose_nothing(seq, levels) -> None:
    """``test_hierarchy``'s failing home (a get or put fails mid-read, mid-write, mid-write-back, mid-flush)
    under caches told batches: a failed batch's undo (rows removed while they wait for an announced use,
    evicted dirty rows re-admitted) leaves every row reading as the model says, and the look-ahead books
    consistent."""
    def init_of(k: int) -> bytes:
        return initial(np.array([k]))[0].tobytes()

    home = FlakyHome()
    h = Hierarchy([DRAMTier(ROW, cap, pol, num_rows=N_KEYS) for cap, pol in levels], home, initial)
    model: dict[int, bytes] = {}
    pending = 0
    for op, ids, val, fail_at in seq:
        arr = np.array(ids, np.int64)
        rows = np.array([[val, i, *range(ROW - 2)] for i in ids], np.uint8).reshape(len(ids), ROW)
        if op == "announce":
            h.announce(arr)
            pending += 1
            continue
        if op == "advance":
            if pending:
                h.advance()
                pending -= 1
            continue
        home.fail_at = fail_at
        try:
            if op == "write":
                h.write(arr, rows)
            elif op == "read":
                assert [g.tobytes() for g in h.read(arr)] == [model.get(i, init_of(i)) for i in ids]
            else:
                h.flush()
                assert home.data == model
        except TierIOError:
            assert fail_at is not None
            if op == "write":
                home.fail_at = None
                h.write(arr, rows)  # the caller retries it
        if op == "write":
            model.update({i: r.tobytes() for i, r in zip(ids, rows)})
        home.fail_at = None
        assert [newest(h, k) for k in range(N_KEYS)] == [model.get(k, init_of(k)) for k in range(N_KEYS)]
        for t in h.caches:
            d = t.directory
            assert d.resident <= t.capacity_rows and d.announced == pending
            if d._ah[AMETA][A_ON]:
                occupied = np.flatnonzero(d.slot_key != EMPTY)
                assert int(d._ah[AMETA][A_NANN]) == int((d._ah[NUSE][occupied] != INF).sum())
    h.flush()
    assert home.data == model


@pytest.mark.parametrize("ahead", [2**62, 2**63 - 2, 2**63 - 1, np.int64(2**63 - 1), np.uint64(2**64 - 1), 2**64,
                                   10**30])
def test_told_past_the_last_batch_is_told_to_the_end(ahead) -> None:
    """``announce=K`` for any K >= 0 the simulators accept: a window past the last batch is a window to the end
    (K near or past 2**63 raised IndexError / OverflowError: the window's end overflowed an int64)."""
    rng = np.random.default_rng(0)
    keys = np.concatenate([rng.choice(50, 10, replace=False) for _ in range(20)]).astype(np.int64)
    off = np.arange(0, 201, 10, dtype=np.int64)
    whole = simulate(keys, off, 8, "lfu+tinylfu", announce=20)
    assert simulate(keys, off, 8, "lfu+tinylfu", announce=ahead).tolist() == whole.tolist()
    lv = replay_keys(keys, off, [("lfu+tinylfu", 8), ("lfu", 16)], announce=ahead).levels
    assert [x.hits for x in lv] == [x.hits for x in replay_keys(keys, off, [("lfu+tinylfu", 8), ("lfu", 16)],
                                                                  announce=20).levels]
    assert miss_ratio_curve(keys, off, [4, 8], "lru", announce=ahead).tolist() == \
        miss_ratio_curve(keys, off, [4, 8], "lru", announce=20).tolist()


def test_a_pipeline_refuses_an_announce_window_no_table_keeps(tmp_path) -> None:
    """pipeline(announce=A) keeps lookahead + 1 + A batches announced; past ``MAX_ANNOUNCED`` the tables would
    refuse the 1,025th after the pipeline read that many batches, blaming a missing advance(). It is refused
    before a batch is read; at the limit it runs; ``schedule.announce`` is refused when the config is read."""
    store = cold_store(tmp_path / "s", "sgd")
    ebc = TieredEmbeddingBagCollection(store, ["a", "b"], optimizer="sgd")
    batches = random_batches(1, 4, [TP_ROWS, TP_ROWS], batch=4, max_len=2, dim=TP_DIM)
    read = []

    def source():
        for b in batches:
            read.append(b)
            yield b
    try:
        with pytest.raises(InvalidInputError, match="announce <= 1022"):
            next(iter(ebc.pipeline(source(), lookahead=1, sparse=lambda b: b[:2], announce=MAX_ANNOUNCED - 1)))
        assert read == [] and store["a"].announced == store["b"].announced == 0
        n = 0
        for ids, offs, w in ebc.pipeline(batches, lookahead=1, sparse=lambda b: b[:2], announce=MAX_ANNOUNCED - 2):
            loss_of(ebc(ids, offs), w).backward()
            n += 1
        assert n == len(batches) and store["a"].announced == store["b"].announced == 0
    finally:
        store.close()
    ScheduleConfig(lookahead=2, announce=MAX_ANNOUNCED - 3)
    with pytest.raises(ConfigError, match="schedule.announce"):
        ScheduleConfig(lookahead=2, announce=MAX_ANNOUNCED - 2)


def test_the_key_marking_an_empty_entry_is_never_announced() -> None:
    """Key -1 is EMPTY, the free entry of the occurrence map: announced, its uses were lost (occ_add took a
    free entry for its own) and another key's chain was overwritten, so ``simulate(announce=K)`` counted
    wrong hits (``[-1], [-1], [5], [-1]`` in one slot told everything: 1 hit, not MIN's 2). It is refused
    with a typed error by the simulators and by a directory without a key limit, which stays as it was."""
    keys = np.array([-1, -1, 5, -1], np.int64)
    off = np.arange(5, dtype=np.int64)
    assert simulate(keys, off, 1, "lru").tolist() == [False, True, False, False]  # told nothing: fine
    for call in (lambda: simulate(keys, off, 1, "lru", announce=3),
                 lambda: replay_keys(keys, off, [("lfu+tinylfu", 1)], announce=0),
                 lambda: miss_ratio_curve(keys, off, [1, 2], "lru", announce=1)):
        with pytest.raises(InvalidInputError, match="key -1"):
            call()
    d = CacheDirectory(2, "lru")
    d.announce(np.array([5, -2], np.int64))
    with pytest.raises(ValueError, match="key -1"):
        d.announce(np.array([3, -1], np.int64))
    assert d.announced == 1 and d.access(np.array([-2, 5, -1], np.int64)).hit.tolist() == [False] * 3


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(-12, -2) | st.integers(-(2**63), -(2**63) + 5), min_size=1, max_size=30),
       st.lists(st.integers(0, 30), max_size=6), st.integers(1, 4), st.sampled_from(["lru", "lfu+tinylfu"]))
def test_other_negative_keys_told_everything_are_still_optimal(keys, cuts, capacity, policy) -> None:
    """Keys below -1 (any int64 but EMPTY) told the whole trace still get MIN-with-bypass's hits."""
    raw = np.array(keys, np.int64)
    k, off = dedup_batches(raw, np.unique(np.array([0, *[c % (len(raw) + 1) for c in cuts], len(raw)], np.int64)))
    assert int(simulate(k, off, capacity, policy, announce=len(off)).sum()) == optimum_with_bypass(k.tolist(),
                                                                                                 capacity)
