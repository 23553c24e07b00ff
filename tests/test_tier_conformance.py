"""One conformance suite that every tier passes (zarr's StoreTests is the model).

Each tier is exercised through the batch interface against a dict model;
persistent tiers must also return everything after flush, close and reopen.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from embstore.errors import IdOutOfRangeError
from embstore.tiers.base import Tier
from embstore.tiers.cache import DeviceTier, DRAMTier, MmapCacheTier
from embstore.tiers.mmap import MmapTier
from embstore.tiers.rocksdb import RocksDBTier
from embstore.tiers.ssd import SSDTier
from embstore.tiers.ssd_log import LogSSDTier

NUM_ROWS = 64

Factory = Callable[[Path, int], Tier]

FACTORIES: dict[str, Factory] = {
    "dram": lambda d, rb: DRAMTier(rb, NUM_ROWS * 2, "lru"),
    "dram-direct": lambda d, rb: DRAMTier(rb, NUM_ROWS, "lru", num_rows=NUM_ROWS),
    "dram-keyed": lambda d, rb: DRAMTier(rb, NUM_ROWS * 2, "lfu+tinylfu", num_rows=NUM_ROWS * 4),
    "device": lambda d, rb: DeviceTier(rb, NUM_ROWS * 2, "clock"),
    "mmap-cache": lambda d, rb: MmapCacheTier(d / "c.mmap", rb, NUM_ROWS * 2, "lfu"),
    "mmap": lambda d, rb: MmapTier(d / "mmap", NUM_ROWS, rb),
    "ssd": lambda d, rb: SSDTier(d / "ssd", NUM_ROWS, rb, queue_depth=8),
    "ssd-log": lambda d, rb: LogSSDTier(d / "ssd-log", NUM_ROWS, rb, queue_depth=8),
    "rocksdb": lambda d, rb: RocksDBTier(d / "rocks", rb),
}


# the ids a tier accepts: [0, limit), or every id >= 0 (None)
ID_LIMITS: dict[str, int | None] = {"dram": None, "dram-direct": NUM_ROWS, "dram-keyed": NUM_ROWS * 4,
                                    "device": None, "mmap-cache": None, "mmap": NUM_ROWS, "ssd": NUM_ROWS,
                                    "ssd-log": NUM_ROWS, "rocksdb": None}


@pytest.fixture(params=sorted(FACTORIES))
def factory(request) -> tuple[str, Factory]:
    return request.param, FACTORIES[request.param]


def rows_for(ids: np.ndarray, row_bytes: int, salt: int = 0) -> np.ndarray:
    return ((ids[:, None] * 7 + np.arange(row_bytes)[None, :] + salt) % 251).astype(np.uint8)


class TestTierConformance:
    def test_empty_tier_finds_nothing(self, factory, tmp_path) -> None:
        _, make = factory
        t = make(tmp_path, 16)
        rows, found = t.get(np.array([0, 5, 63], np.int64))
        assert not found.any() and rows.shape == (3, 16) and rows.dtype == np.uint8
        assert not t.contains(np.array([1], np.int64)).any()
        t.close()

    @pytest.mark.parametrize("row_bytes", [4, 68, 256])
    def test_put_get_contains(self, factory, tmp_path, row_bytes: int) -> None:
        _, make = factory
        t = make(tmp_path, row_bytes)
        ids = np.array([3, 0, 63, 17], np.int64)
        t.put(ids, rows_for(ids, row_bytes))
        probe = np.array([17, 4, 3, 63, 0], np.int64)
        rows, found = t.get(probe)
        assert found.tolist() == [True, False, True, True, True]
        np.testing.assert_array_equal(rows[found], rows_for(probe[found], row_bytes))
        assert t.contains(probe).tolist() == found.tolist()
        t.put(np.array([3], np.int64), rows_for(np.array([3]), row_bytes, salt=9))  # overwrite
        np.testing.assert_array_equal(t.get(np.array([3], np.int64))[0], rows_for(np.array([3]), row_bytes, 9))
        t.close()

    def test_delete(self, factory, tmp_path) -> None:
        _, make = factory
        t = make(tmp_path, 8)
        if not t.supports_delete:
            pytest.skip(f"{t.kind} declares supports_delete = False")
        ids = np.arange(10, dtype=np.int64)
        t.put(ids, rows_for(ids, 8))
        t.delete(np.array([2, 5], np.int64))
        assert t.contains(ids).tolist() == [i not in (2, 5) for i in range(10)]
        t.close()

    def test_rejects_wrong_row_shape(self, factory, tmp_path) -> None:
        _, make = factory
        t = make(tmp_path, 8)
        with pytest.raises(ValueError):
            t.put(np.array([1], np.int64), np.zeros((1, 9), np.uint8))
        t.close()

    def test_rejects_ids_out_of_range(self, factory, tmp_path) -> None:
        name, make = factory
        t = make(tmp_path, 8)
        bad = [-1] + ([ID_LIMITS[name]] if ID_LIMITS[name] is not None else [])
        for b in bad:
            with pytest.raises(IdOutOfRangeError):
                t.put(np.array([1, b], np.int64), np.zeros((2, 8), np.uint8))
        assert not t.contains(np.array([1], np.int64)).any()  # nothing of a refused batch landed
        t.close()

    def test_stats_count_hits_and_misses(self, factory, tmp_path) -> None:
        _, make = factory
        t = make(tmp_path, 8)
        t.put(np.array([1, 2], np.int64), rows_for(np.array([1, 2]), 8))
        t.get(np.array([1, 2, 3], np.int64))
        s = t.stats()
        assert (s.hits, s.misses) == (2, 1) and s.kind == t.kind
        t.close()



PERSISTENT = ["mmap", "rocksdb", "ssd", "ssd-log"]


def test_persistent_flags() -> None:
    for name, make in FACTORIES.items():
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            t = make(Path(d), 8)
            assert t.persistent == (name in PERSISTENT), name
            t.close()


@pytest.mark.parametrize("name", PERSISTENT)
def test_persistent_tiers_survive_reopen(name: str, tmp_path) -> None:
    make = FACTORIES[name]
    t = make(tmp_path, 40)
    ids = np.array([0, 9, 33, 63], np.int64)
    t.put(ids, rows_for(ids, 40))
    t.flush()
    t.close()
    t = make(tmp_path, 40)
    rows, found = t.get(np.arange(NUM_ROWS, dtype=np.int64))
    assert np.flatnonzero(found).tolist() == ids.tolist()
    np.testing.assert_array_equal(rows[found], rows_for(ids, 40))
    t.close()


@pytest.mark.parametrize("name", sorted(FACTORIES))
@settings(max_examples=15, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, NUM_ROWS - 1), min_size=1, max_size=10,
                                                      unique=True), st.integers(0, 250)), max_size=12))
def test_tier_matches_dict_model(name: str, ops, tmp_path_factory) -> None:
    t = FACTORIES[name](tmp_path_factory.mktemp(name), 12)
    model: dict[int, np.ndarray] = {}
    for is_put, ids, salt in ops:
        arr = np.array(ids, np.int64)
        if is_put:
            rows = rows_for(arr, 12, salt)
            t.put(arr, rows)
            model.update(zip(ids, rows))
        else:
            rows, found = t.get(arr)
            assert found.tolist() == [i in model for i in ids]
            for i, r, f in zip(ids, rows, found):
                if f:
                    np.testing.assert_array_equal(r, model[i])
    t.close()
