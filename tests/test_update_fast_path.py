"""Table.update against a numpy model on every kind of top tier, above all a DRAM tier holding the whole
table (direct-mapped), whose update writes straight into the slab.

What must hold on every path: the last row of a repeated id (or of ids hashed to one row) wins; a batch
holding a NaN or inf anywhere, a value float16 cannot hold, or an id outside the table is refused with the
same typed error as before and writes nothing (not even the rows before the bad one); written rows reach
the home on flush (their dirty bits were set); bytes_written counts the distinct rows written.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import embstore
from embstore.config import HashConfig, StoreConfig, TableConfig, TierConfig
from embstore.hashing import ModHash

ROWS, DIM = 48, 4
F16_LIMIT = 65520.0  # float16 rounds this magnitude to inf: the store refuses it

# name -> (dtype, state columns, top tier (kind, capacity in rows or None for the whole table), hash seed)
SETUPS = {
    "dram-resident-f32": ("float32", 0, ("dram", None), None),
    "dram-resident-f32-state": ("float32", 1, ("dram", None), None),
    "dram-resident-f16": ("float16", 0, ("dram", None), None),
    "dram-resident-int8": ("int8", 0, ("dram", None), None),
    "dram-resident-mod-hash": ("float32", 0, ("dram", None), 3),
    "mmap-cache-resident": ("float32", 0, ("mmap", None), None),
    "dram-lru-partial": ("float32", 0, ("dram", ROWS // 4), None),
}


def _config(name: str, rows: int = ROWS, dim: int = DIM) -> TableConfig:
    dtype, state_dim, (kind, cap_rows), seed = SETUPS[name]
    row_bytes = {"float32": 4 * dim, "float16": 2 * dim, "int8": dim + 8}[dtype] + 4 * state_dim
    cache = TierConfig(kind, row_bytes * (rows if cap_rows is None else cap_rows), "lru")
    hash_cfg = HashConfig("mod", seed=seed) if seed is not None else HashConfig()
    return TableConfig("t", rows, dim, dtype=dtype, hash=hash_cfg, tiers=(cache, TierConfig("ssd")))


def _open(path: Path, name: str, rows: int = ROWS, dim: int = DIM) -> tuple[embstore.Store, embstore.Table]:
    store = embstore.create(path, StoreConfig((_config(name, rows, dim),)))
    table = store.ensure_state_dim("t", SETUPS[name][1])
    return store, table


def _stored(name: str, rows: np.ndarray) -> np.ndarray:
    """What a float32 row reads back as in this setup's format (int8 is checked with a tolerance)."""
    return rows.astype(np.float16).astype(np.float32) if SETUPS[name][0] == "float16" else rows


def _expected_error(name: str, ids: np.ndarray, rows: np.ndarray) -> tuple[type, str] | None:
    """The error the store must raise for this batch, in its documented order (rows, then ids), or None."""
    bad = ~np.isfinite(rows)
    if bad.any():
        return embstore.InvalidRowsError, f"row {int(np.argwhere(bad)[0][0])} holds NaN or inf"
    if SETUPS[name][0] == "float16" and (np.abs(rows) >= F16_LIMIT).any():
        return embstore.InvalidRowsError, "must fit float16"
    if SETUPS[name][3] is None and len(ids) and (ids.min() < 0 or ids.max() >= ROWS):
        return embstore.IdOutOfRangeError, f"id {int(ids.min() if ids.min() < 0 else ids.max())} outside"
    return None


def _check_rows(name: str, got: np.ndarray, want: np.ndarray) -> None:
    if SETUPS[name][0] == "int8":  # within (max - min) / 510 of what was written, per row
        tol = (want.max(1) - want.min(1)) / 510 * 1.001 + 1e-6 * (1 + np.abs(want).max(1))
        assert (np.abs(got - want).max(1) <= tol).all()
    else:
        np.testing.assert_array_equal(got, want)


values = st.floats(-1e4, 1e4, width=32) | st.sampled_from([np.nan, np.inf, -np.inf, 7e4, 1e39])
batch = st.integers(0, 12).flatmap(lambda n: st.tuples(
    st.lists(st.integers(-2, ROWS + 1) | st.integers(0, 5), min_size=n, max_size=n),  # in range, repeats, bad
    st.lists(st.lists(st.floats(-1e4, 1e4, width=32), min_size=DIM, max_size=DIM), min_size=n, max_size=n),
    st.lists(st.tuples(st.integers(0, max(n - 1, 0)), st.integers(0, DIM - 1), values), max_size=2)))


@settings(max_examples=25)
@given(name=st.sampled_from(sorted(SETUPS)), warm=st.booleans(), batches=st.lists(batch, min_size=1, max_size=6))
def test_update_then_lookup_matches_a_numpy_model(name: str, warm: bool, batches: list) -> None:
    """Random batches (repeated ids, ids outside the table, NaN/inf/too large values anywhere) against a
    model; ``warm`` first reads every row, so a whole-table cache starts full rather than empty. Each
    refused batch leaves rows and statistics as they were; after a close and reopen the home has every
    accepted write."""
    with tempfile.TemporaryDirectory() as tmp:
        mapper = ModHash(ROWS, SETUPS[name][3]) if SETUPS[name][3] is not None else None
        everything = np.arange(ROWS, dtype=np.int64)
        with embstore.create(Path(tmp) / "ref", StoreConfig((_config(name),))) as ref:
            model = ref["t"].read_physical(everything)  # never-written rows: their initial values
        store, table = _open(Path(tmp) / "s", name)
        if warm:
            table.lookup(everything if mapper is None else np.arange(4 * ROWS, dtype=np.int64))
        for raw_ids, raw_rows, poison in batches:
            ids = np.array(raw_ids, np.int64)
            rows = np.array(raw_rows, np.float32).reshape(len(ids), DIM)
            for i, j, v in poison:
                if len(ids):
                    with np.errstate(over="ignore"):
                        rows[i, j] = np.float32(v)
            before, stats = table.read_physical(everything), table.stats()
            error = _expected_error(name, ids, rows)
            if error is not None:
                with pytest.raises(error[0], match=error[1]):
                    table.update(ids, rows)
                assert table.stats() == stats
                np.testing.assert_array_equal(table.read_physical(everything), before)
                continue
            table.update(ids, rows)
            kind, cap_rows = SETUPS[name][2]
            written = table.stats()[kind]["bytes_written"] - stats[kind]["bytes_written"]
            phys = ids if mapper is None else mapper(ids)
            if cap_rows is None:  # a whole-table cache: every distinct row lands in it, once
                assert written == len(np.unique(phys)) * table.format.row_bytes
            for p, r in zip(phys, rows):  # in order: the last row of a repeated row wins
                model[p] = _stored(name, r)
            _check_rows(name, table.read_physical(everything), model)
            if len(raw_ids):
                np.testing.assert_array_equal(table.lookup(ids), table.read_physical(phys))
        store.close()
        with embstore.open(Path(tmp) / "s") as again:
            _check_rows(name, again["t"].read_physical(everything), model)


def _resident(tmp: Path, rows: int, dim: int, state_dim: int = 0) -> tuple[embstore.Store, embstore.Table]:
    name = "dram-resident-f32-state" if state_dim else "dram-resident-f32"
    store, table = _open(tmp, name, rows, dim)
    assert table.full_dram_tier() is not None
    return store, table


@pytest.mark.parametrize("state_dim", [0, 1])
@pytest.mark.parametrize("repeats", [False, True])
def test_large_batches_on_a_full_resident_table(tmp_path, state_dim: int, repeats: bool) -> None:
    """Batches large enough to run on every kernel thread (>= 16,384 ids), on a table every row of which is
    resident: distinct ids, and ids with repeats (the last wins), against numpy's ``w[ids] = rows``
    applied in order; an update writes zeros into the optimizer state of its rows, as ever; the statistics
    count the distinct rows."""
    rows, dim = 50_000, 8
    store, table = _resident(tmp_path / "s", rows, dim, state_dim)
    rng = np.random.default_rng(1)
    w = rng.standard_normal((rows, dim), dtype=np.float32)
    state = np.full((rows, state_dim), 5.0, np.float32)
    table.write_with_state(np.arange(rows, dtype=np.int64), w, state)
    for _ in range(3):
        ids = rng.integers(0, rows, 30_000) if repeats else rng.permutation(rows)[:30_000]
        vals = rng.standard_normal((len(ids), dim), dtype=np.float32)
        written = table.stats()["dram"]["bytes_written"]
        table.update(ids, vals)
        for i, v in zip(ids, vals):  # numpy's fancy assignment does not promise an order for repeats
            w[i] = v
        state[ids] = 0.0
        got, got_state = table.read_with_state(np.arange(rows, dtype=np.int64))
        np.testing.assert_array_equal(got, w)
        np.testing.assert_array_equal(got_state, state)
        assert table.stats()["dram"]["bytes_written"] - written == len(np.unique(ids)) * table.format.row_bytes
    store.close()
    with embstore.open(tmp_path / "s") as again:
        np.testing.assert_array_equal(again["t"].read_physical(np.arange(rows, dtype=np.int64)), w)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("bad", ["nan", "inf", "id-high", "id-negative"])
def test_a_refused_large_batch_writes_nothing(tmp_path, where: str, bad: str) -> None:
    """One bad value or id anywhere in a batch large enough for every kernel thread: the error names it as
    before, and no row of the batch (not even those before the bad one) was written or marked dirty."""
    rows, dim, n = 40_000, 8, 20_000
    store, table = _resident(tmp_path / "s", rows, dim)
    rng = np.random.default_rng(2)
    w = rng.standard_normal((rows, dim), dtype=np.float32)
    table.write_physical(np.arange(rows, dtype=np.int64), w)
    store.flush()
    ids = rng.permutation(rows)[:n]
    vals = rng.standard_normal((n, dim), dtype=np.float32)
    pos = {"first": 0, "middle": n // 2, "last": n - 1}[where]
    if bad in ("nan", "inf"):
        vals[pos, dim - 1] = np.nan if bad == "nan" else -np.inf
        error, msg = embstore.InvalidRowsError, f"rows must be finite; row {pos} holds NaN or inf"
    else:
        ids[pos] = rows if bad == "id-high" else -3
        error, msg = embstore.IdOutOfRangeError, f"id {ids[pos]} outside \\[0, {rows}\\)"
    stats = table.stats()
    with pytest.raises(error, match=msg):
        table.update(ids, vals)
    assert table.stats() == stats
    np.testing.assert_array_equal(table.read_physical(np.arange(rows, dtype=np.int64)), w)
    assert not table.hierarchy.caches[0].dirty.any()  # nothing to write back: the flush above cleaned all


def test_update_input_errors_on_a_resident_table(tmp_path) -> None:
    """Shapes, dtypes and kinds that the fast path does not take still get their own errors, and rows it
    does not take as they are (torch, float64, strided, an ndarray subclass) are written all the same."""
    store, table = _resident(tmp_path / "s", 100, DIM)
    table.write_physical(np.arange(100, dtype=np.int64), np.zeros((100, DIM), np.float32))  # every row resident
    ids = np.array([1, 2], np.int64)
    for rows, msg in [(np.ones((2, DIM + 1), np.float32), "shape"), (np.ones((3, DIM), np.float32), "shape"),
                      (np.ones((2, DIM), np.int32), "floating"), (np.full((2, DIM), 1e39), "finite")]:
        with pytest.raises(embstore.InvalidRowsError, match=msg):
            table.update(ids, rows)
    with pytest.raises(embstore.InvalidInputError, match="int64"):
        table.update(ids.astype(np.int32), np.ones((2, DIM), np.float32))
    import torch

    table.update(torch.tensor([1, 2]), torch.full((2, DIM), 3.0))
    table.update(np.array([3, 4], np.int64), np.full((2, DIM), 4.0))  # float64
    table.update(np.array([5, 6], np.int64), np.full((DIM, 2), 5.0, np.float32).T)  # not C-contiguous
    table.update(np.array([7, 8], np.int64), np.matrix(np.full((2, DIM), 6.0, np.float32)))  # a subclass
    np.testing.assert_array_equal(table.lookup(np.arange(1, 9, dtype=np.int64)), np.repeat([3, 3, 4, 4, 5, 5, 6, 6],
                                                                                          DIM).reshape(8, DIM))
    store.close()
    with pytest.raises(embstore.StoreClosedError):
        table.update(ids, np.ones((2, DIM), np.float32))
