"""A full disk under a whole store: typed errors, and the store reopens at its last flush."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore.config import StoreConfig, TableConfig, TierConfig
from faultfs import needs_mount
from homes import home_tier, tier_kind

DIM = 64


@needs_mount
@pytest.mark.parametrize("home", ["ssd", "ssd-log", "rocksdb"])
def test_disk_full_is_typed_and_store_reopens_at_last_flush(tiny_tmpfs, home: str) -> None:
    cfg = TableConfig("t", 200_000, DIM, tiers=(TierConfig("dram", 64 * DIM * 4, "lru"), home_tier(home)))
    path = tiny_tmpfs.path / "s"
    store = embstore.create(path, StoreConfig((cfg,)))
    table = store["t"]
    flushed: dict[int, float] = {}
    error = None
    for step in range(2000):
        ids = np.arange(step * 256, (step + 1) * 256, dtype=np.int64) % 200_000
        try:
            table.update(ids, np.full((len(ids), DIM), step + 1, np.float32))
            store.flush()
        except embstore.TierIOError as exc:
            error = exc
            break
        flushed.update(dict.fromkeys(ids.tolist(), float(step + 1)))
    assert isinstance(error, embstore.DiskFullError), error
    assert error.tier == tier_kind(home) and "ENOSPC" in str(error)
    try:
        store.close()
    except embstore.TierIOError:
        pass  # closing flushes again, into the same full disk
    tiny_tmpfs.resize(256 << 20)
    with embstore.open(path) as store:
        ids = np.array(sorted(flushed), np.int64)
        got = store["t"].lookup(ids)
        np.testing.assert_array_equal(got[:, 0], np.array([flushed[i] for i in ids.tolist()], np.float32))
