"""A Hypothesis state machine drives a real store against a dict model.

Three-tier tables (small device and dram caches over a persistent home) are
created, looked up, updated, flushed and reopened at random. Invariants: every
read equals the model; no tier exceeds its capacity; hits + misses = unique
ids looked up.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import embstore
from embstore.config import StoreConfig, TableConfig, TierConfig
from embstore.rows import initial_rows
from homes import home_tier

DIM = 4
ROWS = 40


def three_tier(home: str, policy0: str = "lru", policy1: str = "lfu") -> TableConfig:
    row = DIM * 4
    return TableConfig("t", ROWS, DIM, tiers=(TierConfig("device", 3 * row, policy0),
                                              TierConfig("dram", 7 * row, policy1), home_tier(home)))


class StoreMachine(RuleBasedStateMachine):
    home = "ssd"

    @initialize(p0=st.sampled_from(["lru", "clock", "lru+tinylfu"]), p1=st.sampled_from(["lfu", "lru"]))
    def create(self, p0: str, p1: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="embstore-sm-"))
        self.cfg = three_tier(self.home, p0, p1)
        self.store = embstore.create(self.dir / "s", StoreConfig((self.cfg,)))
        self.model: dict[int, np.ndarray] = {}
        self.looked_up = 0

    def expected(self, ids: list[int]) -> np.ndarray:
        init = initial_rows(self.cfg.init, np.array(ids, np.int64), DIM)
        return np.stack([self.model.get(i, init[j]) for j, i in enumerate(ids)])

    @rule(ids=st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=12))
    def lookup(self, ids: list[int]) -> None:
        got = self.store["t"].lookup(np.array(ids, np.int64))
        np.testing.assert_array_equal(got, self.expected(ids))
        self.looked_up += len(set(ids))

    @rule(ids=st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=12), data=st.data())
    def lookup_pooled(self, ids: list[int], data) -> None:
        cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=3)))
        offsets = np.array([0, *cuts, len(ids)], np.int64)
        got = self.store["t"].lookup_pooled(np.array(ids, np.int64), offsets)
        rows = self.expected(ids)
        want = np.stack([rows[offsets[b]:offsets[b + 1]].sum(0) for b in range(len(offsets) - 1)])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        self.looked_up += len(set(ids))

    @rule(ids=st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=12), seed=st.integers(0, 2**16))
    def update(self, ids: list[int], seed: int) -> None:
        rows = np.random.default_rng(seed).standard_normal((len(ids), DIM)).astype(np.float32)
        self.store["t"].update(np.array(ids, np.int64), rows)
        for i, r in zip(ids, rows):  # last write wins
            self.model[i] = r

    @rule(ids=st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=4))
    def bad_update_changes_nothing(self, ids: list[int]) -> None:
        rows = np.ones((len(ids), DIM), np.float32)
        rows[-1, 0] = np.nan
        with pytest.raises(embstore.InvalidRowsError):
            self.store["t"].update(np.array(ids, np.int64), rows)
        with pytest.raises(embstore.IdOutOfRangeError):
            self.store["t"].update(np.array(ids + [ROWS], np.int64), np.ones((len(ids) + 1, DIM), np.float32))

    @rule()
    def flush(self) -> None:
        self.store.flush()

    @rule()
    def reopen(self) -> None:
        self.store.close()
        self.store = embstore.open(self.dir / "s")
        self.looked_up = 0

    @invariant()
    def capacities_and_counts(self) -> None:
        if not hasattr(self, "store"):
            return
        table = self.store["t"]
        for tier in table.hierarchy.caches:
            assert tier.resident_rows <= tier.capacity_rows
        top = table.stats()["device"]
        assert top["hits"] + top["misses"] == self.looked_up

    def teardown(self) -> None:
        if hasattr(self, "store"):
            self.store.close()
            shutil.rmtree(self.dir, ignore_errors=True)


class RocksDBStoreMachine(StoreMachine):
    home = "rocksdb"


class MmapStoreMachine(StoreMachine):
    home = "mmap"


class LogSSDStoreMachine(StoreMachine):
    home = "ssd-log"  # every write appends; the cleaner runs once the 64 spare blocks are used


SETTINGS = settings(max_examples=25, stateful_step_count=30, deadline=None)
TestSSDStore = StoreMachine.TestCase
TestSSDStore.settings = SETTINGS
TestRocksDBStore = RocksDBStoreMachine.TestCase
TestRocksDBStore.settings = SETTINGS
TestMmapStore = MmapStoreMachine.TestCase
TestLogSSDStore = LogSSDStoreMachine.TestCase
TestMmapStore.settings = SETTINGS
