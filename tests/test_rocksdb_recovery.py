"""RocksDBTier recovers in place after a full disk, with a real ENOSPC from a tiny tmpfs.

RocksDB keeps the first background error (ENOSPC while appending to the WAL or
writing an SST) and fails every later write and WAL sync with it ("Writer has
previous error"), even once space is back, until the database is reopened. The
tier reopens itself, so a long-running server or trainer takes writes again
once the operator frees space, and keeps every acknowledged row.
"""

from __future__ import annotations

import errno

import numpy as np
import pytest

import embstore
from embstore.config import StoreConfig, TableConfig, TierConfig
from embstore.errors import DiskFullError, StoreClosedError, TierIOError
from embstore.tiers.rocksdb import RocksDBTier
from faultfs import Tmpfs, needs_mount

RB = 256
BATCH = 512  # 128 KiB of rows per put: never fits in what a full 4 MiB tmpfs has left
# 8 MiB memtables fill the WAL first (ENOSPC appending to the log); 256 KiB ones hit it in an SST flush
WRITE_BUFFERS = pytest.mark.parametrize("write_buffer", [8 << 20, 256 << 10], ids=["wal", "sst"])


def _rows(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, RB), dtype=np.uint8)


def _batch(start: int) -> tuple[np.ndarray, np.ndarray]:
    return np.arange(start, start + BATCH, dtype=np.int64), _rows(start, BATCH)


def _put(tier: RocksDBTier, model: dict[int, bytes], ids: np.ndarray, rows: np.ndarray) -> None:
    """put; once it returns the rows are acknowledged, so they join the model."""
    tier.put(ids, rows)
    model.update(zip(ids.tolist(), (r.tobytes() for r in rows)))


def _assert_enospc(exc: BaseException) -> None:
    assert isinstance(exc, DiskFullError), repr(exc)
    assert exc.errno == errno.ENOSPC and exc.tier == "rocksdb", exc


def _fill(tier: RocksDBTier, model: dict[int, bytes], first: int = 0) -> np.ndarray | None:
    """put + flush batches until one fails, which must be a DiskFullError; the ids of a refused put
    (None when the put was acknowledged and its flush failed)."""
    for start in range(first, first + (1 << 20), BATCH):
        ids, rows = _batch(start)
        try:
            _put(tier, model, ids, rows)
        except TierIOError as exc:
            _assert_enospc(exc)
            return ids
        try:
            tier.flush()
        except TierIOError as exc:
            _assert_enospc(exc)
            return None
    raise AssertionError("the 4 MiB tmpfs never filled up")


def _check(tier: RocksDBTier, model: dict[int, bytes], refused: np.ndarray | None) -> None:
    """Every acknowledged row reads back exactly; a refused batch is absent or whole, never torn."""
    ids = np.array(sorted(model), dtype=np.int64)
    rows, found = tier.get(ids)
    assert found.all(), ids[~found][:10]
    want = np.frombuffer(b"".join(model[i] for i in ids.tolist()), np.uint8).reshape(len(ids), RB)
    np.testing.assert_array_equal(rows, want)
    if refused is not None and not set(refused.tolist()) & set(model):
        got, present = tier.get(refused)
        assert present.all() or not present.any()
        assert not present.any() or np.array_equal(got, _rows(int(refused[0]), BATCH))


def _write_while_full(tier: RocksDBTier, model: dict[int, bytes], first: int) -> None:
    """Writes while the disk is still full are refused with DiskFullError (the reopen they try fails)
    or acknowledged (when the reopen deleted a torn SST file, freeing space); reads work after a refusal."""
    refused = _fill(tier, model, first)
    _check(tier, model, refused)


@needs_mount
@WRITE_BUFFERS
def test_writes_resume_in_place_once_space_is_freed(tiny_tmpfs: Tmpfs, write_buffer: int) -> None:
    path = tiny_tmpfs.path / "db"
    tier = RocksDBTier(path, RB, block_cache=1 << 20, write_buffer=write_buffer)
    model: dict[int, bytes] = {}
    refused = _fill(tier, model)
    _check(tier, model, refused)  # reads work in the broken state
    _write_while_full(tier, model, 10**9)
    bytes_written = tier.stats().bytes_written

    tiny_tmpfs.resize(64 << 20)  # the operator frees space; the same tier object goes on
    for start in range(10**10, 10**10 + 4 * BATCH, BATCH):
        _put(tier, model, *_batch(start))
        tier.flush()
    gone = np.arange(10**10, 10**10 + 10, dtype=np.int64)
    tier.delete(gone)
    tier.flush()
    for key in gone.tolist():
        del model[key]
    assert not tier.contains(gone).any()
    assert tier.stats().bytes_written == bytes_written + 4 * BATCH * RB  # counters survive the reopen
    _check(tier, model, refused)
    tier.close()

    tier = RocksDBTier(path, RB, block_cache=1 << 20, write_buffer=write_buffer)
    _check(tier, model, refused)
    tier.close()


@needs_mount
def test_close_while_still_full_raises_typed_and_releases(tiny_tmpfs: Tmpfs) -> None:
    path = tiny_tmpfs.path / "db"
    tier = RocksDBTier(path, RB, block_cache=1 << 20, write_buffer=8 << 20)
    model: dict[int, bytes] = {}
    refused = _fill(tier, model)
    with pytest.raises(DiskFullError) as info:
        tier.close()
    _assert_enospc(info.value)
    tier.close()  # idempotent: the handle is already released
    with pytest.raises(StoreClosedError):
        tier.get(np.arange(3, dtype=np.int64))
    tiny_tmpfs.resize(64 << 20)
    tier = RocksDBTier(path, RB, block_cache=1 << 20, write_buffer=8 << 20)  # the lock was released
    _check(tier, model, refused)
    _put(tier, model, *_batch(10**9))
    tier.close()


@needs_mount
@WRITE_BUFFERS
def test_close_after_space_is_freed_succeeds(tiny_tmpfs: Tmpfs, write_buffer: int) -> None:
    """No write between freeing space and close(): close itself recovers, syncs and raises nothing."""
    path = tiny_tmpfs.path / "db"
    tier = RocksDBTier(path, RB, block_cache=1 << 20, write_buffer=write_buffer)
    model: dict[int, bytes] = {}
    refused = _fill(tier, model)
    tiny_tmpfs.resize(64 << 20)
    tier.close()
    tier = RocksDBTier(path, RB, block_cache=1 << 20, write_buffer=write_buffer)
    _check(tier, model, refused)
    tier.close()


@needs_mount
def test_store_over_rocksdb_home_takes_writes_after_space_is_freed(tiny_tmpfs: Tmpfs) -> None:
    """The server/trainer case: one open store keeps going after the disk was full, no reopen."""
    dim, n = 64, 200_000
    cfg = TableConfig("t", n, dim, tiers=(TierConfig("dram", 64 * dim * 4, "lru"), TierConfig("rocksdb")))
    path = tiny_tmpfs.path / "s"
    store = embstore.create(path, StoreConfig((cfg,)))
    table = store["t"]
    model = np.zeros((n, dim), np.float32)  # never-written rows read as zeros
    error = None
    for step in range(2000):
        ids = np.arange(step * 256, (step + 1) * 256, dtype=np.int64) % n
        try:
            table.update(ids, np.full((len(ids), dim), step + 1, np.float32))
            store.flush()
        except TierIOError as exc:
            error = exc
            break
        model[ids] = step + 1
    assert isinstance(error, DiskFullError), error
    tiny_tmpfs.resize(256 << 20)
    for step in range(3):
        ids = np.arange(step * 1000, step * 1000 + 300, dtype=np.int64)
        table.update(ids, np.full((len(ids), dim), -step - 1, np.float32))
        store.flush()
        model[ids] = -step - 1
    written = np.flatnonzero(model[:, 0] != 0)
    np.testing.assert_array_equal(table.lookup(written), model[written])
    store.close()
    with embstore.open(path) as store:
        np.testing.assert_array_equal(store["t"].lookup(written), model[written])
