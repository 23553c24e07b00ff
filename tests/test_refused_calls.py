"""A refused call changes nothing: every public entry point of ``Table`` against a numpy model.

Random valid calls (lookup, lookup_pooled, update, read_physical, write_physical, read_with_state,
write_with_state) are interleaved with random invalid ones, each with exactly one fault: ids out of range,
negative, of the wrong dtype or rank, repeated where a physical write needs them distinct; rows of the
wrong shape or dtype, NaN/inf, beyond float16; bad offsets or mode; optimizer state of the wrong shape; a
closed table. An invalid call must raise its typed error (embstore/errors.py) and leave ``table.stats()``,
``table.lookups`` and every row exactly as they were; valid calls must read what the model holds. The
table shapes cover the direct-mapped resident fast paths (DRAM, float32 with and without optimizer state,
a mod-hashed table), LRU DRAM caches over an ssd and a RocksDB home, a bare RocksDB home (which would
store any id), int8 and float16 rows, and a QR-hashed table (two physical rows per id).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import embstore
from embstore.config import HashConfig, StoreConfig, TableConfig, TierConfig
from embstore.errors import (IdOutOfRangeError, InvalidInputError, InvalidOffsetsError, InvalidRowsError,
                             StoreClosedError)
from embstore.rows import initial_rows

ROWS, DIM = 40, 4
WHOLE = None  # a cache capacity of every row: the direct-mapped resident tier

# name -> (row dtype, optimizer state columns, (cache kind, capacity in rows) or None, home kind, hash)
SETUPS: dict[str, tuple[str, int, tuple[str, int | None] | None, str, HashConfig]] = {
    "resident-f32": ("float32", 0, ("dram", WHOLE), "ssd", HashConfig()),
    "resident-f32-state": ("float32", 2, ("dram", WHOLE), "ssd", HashConfig()),
    "resident-mmap-cache": ("float32", 0, ("mmap", WHOLE), "ssd", HashConfig()),
    "resident-f16": ("float16", 0, ("dram", WHOLE), "ssd", HashConfig()),
    "resident-mod-hash": ("float32", 0, ("dram", WHOLE), "mmap", HashConfig("mod", seed=3)),
    "lru-over-ssd": ("float32", 0, ("dram", 8), "ssd", HashConfig()),
    "lru-over-rocksdb-state": ("float32", 1, ("dram", 8), "rocksdb", HashConfig()),
    "rocksdb-home": ("float32", 0, None, "rocksdb", HashConfig()),
    "int8-lru-over-ssd": ("int8", 0, ("dram", 8), "ssd", HashConfig()),
    "qr-hash-lru": ("float32", 0, ("dram", 8), "ssd", HashConfig("qr", collisions=4)),
}


def _config(name: str) -> TableConfig:
    dtype, state_dim, cache, home, hash_cfg = SETUPS[name]
    row_bytes = {"float32": 4 * DIM, "float16": 2 * DIM, "int8": DIM + 8}[dtype] + 4 * state_dim
    tiers = (TierConfig(home),)
    if cache is not None:
        kind, rows = cache
        tiers = (TierConfig(kind, row_bytes * (ROWS if rows is WHOLE else rows), "lru"), *tiers)
    return TableConfig("t", ROWS, DIM, dtype=dtype, hash=hash_cfg, tiers=tiers)


@dataclass
class Model:
    """What the table must hold: decoded physical rows and their optimizer state, and the lookup count."""

    table: embstore.Table
    rows: np.ndarray
    state: np.ndarray
    lookups: int = 0
    log: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, table: embstore.Table) -> "Model":
        fmt = table.format
        every = np.arange(table.num_rows, dtype=np.int64)
        return cls(table, fmt.decode(fmt.encode(initial_rows(table.config.init, every, fmt.dim))),
                   np.zeros((table.num_rows, fmt.state_dim), np.float32))

    def stored(self, values: np.ndarray) -> np.ndarray:
        """``values`` as the row format reads them back (float16 and int8 round)."""
        fmt = self.table.format
        return fmt.decode(fmt.encode(np.ascontiguousarray(values, np.float32)))

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        mapper = self.table.mapper
        if mapper is None:
            return self.rows[ids]
        phys = mapper(ids)
        if phys.ndim == 1:
            return self.rows[phys]
        return mapper.combine(self.rows[phys.reshape(-1)].reshape(len(ids), phys.shape[1], self.rows.shape[1]))

    def write(self, phys: np.ndarray, values: np.ndarray, state: np.ndarray | None = None) -> None:
        """In order, so the last of a repeated row wins (``update``); a write without state zeroes it."""
        stored = self.stored(values)
        for i, p in enumerate(phys):
            self.rows[p] = stored[i]
            self.state[p] = 0 if state is None else state[i]


# --- drawing arguments ------------------------------------------------------------------------------

def _hashed(table: embstore.Table) -> bool:
    return table.mapper is not None


def _ids(data: st.DataObject, table: embstore.Table, min_size: int = 0) -> np.ndarray:
    """Raw ids a lookup or update accepts (any int64 for a hashed table), repeats included."""
    elem = st.integers(-10**9, 10**9) if _hashed(table) else st.integers(0, ROWS - 1)
    return np.array(data.draw(st.lists(elem, min_size=min_size, max_size=10)), np.int64)


def _phys(data: st.DataObject, table: embstore.Table, unique: bool, min_size: int = 0) -> np.ndarray:
    elem = st.integers(0, table.num_rows - 1)
    return np.array(data.draw(st.lists(elem, min_size=min_size, max_size=10, unique=unique)), np.int64)


def _values(data: st.DataObject, n: int, dim: int) -> np.ndarray:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    return (rng.standard_normal((n, dim)) * 3).astype(np.float32)


def _offsets(data: st.DataObject, n: int) -> np.ndarray:
    cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=4)))
    return np.array([0, *cuts, n], np.int64)


ID_FAULTS = ("int32", "float64", "two-d", "list", "high", "negative")


def _bad_ids(data: st.DataObject, ids: np.ndarray, bound: int | None) -> tuple[Any, type]:
    """``ids`` (non-empty) with one fault; ``bound`` None: any int64 is in range (a hashed lookup)."""
    faults = ID_FAULTS if bound is not None else ID_FAULTS[:4]
    fault = data.draw(st.sampled_from(faults), label="id fault")
    i = data.draw(st.integers(0, len(ids) - 1))
    if fault == "int32":
        return ids.astype(np.int32), InvalidInputError
    if fault == "float64":
        return ids.astype(np.float64), InvalidInputError
    if fault == "two-d":
        return ids.reshape(1, -1), InvalidInputError
    if fault == "list":
        return ids.tolist(), InvalidInputError
    bad = ids.copy()
    bad[i] = bound + data.draw(st.integers(0, 2**40)) if fault == "high" else -data.draw(st.integers(1, 2**40))
    return bad, IdOutOfRangeError


def _bad_values(data: st.DataObject, table: embstore.Table, values: np.ndarray) -> tuple[Any, type]:
    """Rows (n >= 1) with one fault."""
    faults = ["nan", "inf", "short", "wide", "one-d", "int32", "list"]
    if table.format.dtype.value == "float16":
        faults.append("beyond-float16")
    fault = data.draw(st.sampled_from(faults), label="row fault")
    i, j = data.draw(st.integers(0, len(values) - 1)), data.draw(st.integers(0, values.shape[1] - 1))
    bad = values.copy()
    if fault in ("nan", "inf", "beyond-float16"):
        bad[i, j] = {"nan": np.nan, "inf": -np.inf, "beyond-float16": 7e4}[fault]
        return bad, InvalidRowsError
    if fault == "short":
        return bad[1:], InvalidRowsError
    if fault == "wide":
        return np.hstack([bad, bad[:, :1]]), InvalidRowsError
    if fault == "one-d":
        return bad.reshape(-1), InvalidRowsError
    if fault == "int32":
        return bad.astype(np.int32), InvalidRowsError
    return bad.tolist(), InvalidInputError


def _bad_offsets(data: st.DataObject, offsets: np.ndarray, n: int) -> tuple[Any, type]:
    fault = data.draw(st.sampled_from(["start", "end", "decrease", "int32", "empty", "two-d"]), label="offsets fault")
    bad = offsets.copy()
    if fault == "start":
        bad[0] = data.draw(st.sampled_from([-1, 1]))
        return bad, InvalidOffsetsError
    if fault == "end":
        bad[-1] = n + data.draw(st.sampled_from([-1, 1]))
        return bad, InvalidOffsetsError
    if fault == "decrease":
        return np.array([0, n + 1, n], np.int64), InvalidOffsetsError
    if fault == "int32":
        return bad.astype(np.int32), InvalidOffsetsError
    if fault == "empty":
        return bad[:0], InvalidOffsetsError
    return bad.reshape(1, -1), InvalidOffsetsError


# --- one call each: a valid one is made and checked against the model (returns ()); an invalid one is
# returned as (call, the error it must raise) for ``_refused`` -------------------------------------------

def call_lookup(data: st.DataObject, m: Model, valid: bool) -> tuple:
    t = m.table
    ids = _ids(data, t, min_size=0 if valid else 1)
    if valid:
        np.testing.assert_array_equal(t.lookup(ids), m.lookup(ids))
        m.lookups += len(ids)
        return ()
    bad, err = _bad_ids(data, ids, None if _hashed(t) else ROWS)
    return (lambda: t.lookup(bad)), err


def call_lookup_pooled(data: st.DataObject, m: Model, valid: bool) -> tuple:
    t = m.table
    ids = _ids(data, t, min_size=0 if valid else 1)
    offsets = _offsets(data, len(ids))
    mode = data.draw(st.sampled_from(["sum", "mean"]))
    if valid:
        rows = m.lookup(ids).astype(np.float64)
        want = np.zeros((len(offsets) - 1, DIM))
        for b in range(len(offsets) - 1):
            bag = rows[offsets[b]:offsets[b + 1]]
            if len(bag):
                want[b] = bag.sum(0) if mode == "sum" else bag.mean(0)
        np.testing.assert_allclose(t.lookup_pooled(ids, offsets, mode), want, rtol=1e-5, atol=1e-4)
        m.lookups += len(ids)
        return ()
    what = data.draw(st.sampled_from(["ids", "offsets", "mode"]))
    if what == "ids":
        bad, err = _bad_ids(data, ids, None if _hashed(t) else ROWS)
        return (lambda: t.lookup_pooled(bad, offsets, mode)), err
    if what == "offsets":
        bad, err = _bad_offsets(data, offsets, len(ids))
        return (lambda: t.lookup_pooled(ids, bad, mode)), err
    return (lambda: t.lookup_pooled(ids, offsets, data.draw(st.sampled_from(["max", "SUM", ""])))), InvalidInputError


def call_update(data: st.DataObject, m: Model, valid: bool) -> tuple:
    t = m.table
    qr = t.mapper is not None and t.mapper.rows_per_id != 1
    ids = _ids(data, t, min_size=0 if valid and not qr else 1)
    values = _values(data, len(ids), DIM)
    if valid and not qr:
        t.update(ids, values)
        m.write(ids if t.mapper is None else t.mapper(ids), values)
        return ()
    if qr:  # rows of a QR table are combinations of two shared rows: never written one id at a time
        return (lambda: t.update(ids, values)), InvalidInputError
    if data.draw(st.booleans()):
        bad, err = _bad_ids(data, ids, None if _hashed(t) else ROWS)
        return (lambda: t.update(bad, values)), err
    bad, err = _bad_values(data, t, values)
    return (lambda: t.update(ids, bad)), err


def _bad_write_ids(data: st.DataObject, m: Model, ids: np.ndarray) -> tuple[Any, type]:
    """Physical ids of a write with one fault, a repeated row included (writes take distinct rows)."""
    if len(ids) > 1 and data.draw(st.booleans()):
        i, j = data.draw(st.lists(st.integers(0, len(ids) - 1), min_size=2, max_size=2, unique=True))
        bad = ids.copy()
        bad[j] = bad[i]
        return bad, InvalidInputError
    return _bad_ids(data, ids, m.table.num_rows)


def _call_physical_read(data: st.DataObject, m: Model, valid: bool, read: Any, check: Any) -> tuple:
    """A physical-row read (``read(rows)``): valid rows are ``check``ed (``check(got, rows)``) against
    the model; else the refused call and its error."""
    rows = _phys(data, m.table, unique=False, min_size=0 if valid else 1)  # repeats allowed: reads dedup
    if valid:
        check(read(rows), rows)
        return ()
    bad, err = _bad_ids(data, rows, m.table.num_rows)
    return (lambda: read(bad)), err


def call_read_physical(data: st.DataObject, m: Model, valid: bool) -> tuple:
    def check(got: np.ndarray, rows: np.ndarray) -> None:
        np.testing.assert_array_equal(got, m.rows[rows])

    return _call_physical_read(data, m, valid, m.table.read_physical, check)


def call_read_with_state(data: st.DataObject, m: Model, valid: bool) -> tuple:
    def check(got: tuple[np.ndarray, np.ndarray], rows: np.ndarray) -> None:
        np.testing.assert_array_equal(got[0], m.rows[rows])
        np.testing.assert_array_equal(got[1], m.state[rows])

    return _call_physical_read(data, m, valid, m.table.read_with_state, check)


def call_write_physical(data: st.DataObject, m: Model, valid: bool) -> tuple:
    t = m.table
    rows = _phys(data, t, unique=True, min_size=0 if valid else 1)
    values = _values(data, len(rows), t.format.dim)
    if valid:
        t.write_physical(rows, values)
        m.write(rows, values)
        return ()
    if data.draw(st.booleans()):
        bad, err = _bad_write_ids(data, m, rows)
        return (lambda: t.write_physical(bad, values)), err
    bad, err = _bad_values(data, t, values)
    return (lambda: t.write_physical(rows, bad)), err


def call_write_with_state(data: st.DataObject, m: Model, valid: bool) -> tuple:
    t = m.table
    rows = _phys(data, t, unique=True, min_size=0 if valid else 1)
    values = _values(data, len(rows), t.format.dim)
    state = _values(data, len(rows), t.format.state_dim)
    if valid:
        t.write_with_state(rows, values, state)
        m.write(rows, values, state)
        return ()
    what = data.draw(st.sampled_from(["ids", "values", "state"]))
    if what == "ids":
        bad, err = _bad_write_ids(data, m, rows)
        return (lambda: t.write_with_state(bad, values, state)), err
    if what == "values":
        bad, err = _bad_values(data, t, values)
        return (lambda: t.write_with_state(rows, bad, state)), err
    wide = np.hstack([state, np.zeros((len(rows), 1), np.float32)])
    if t.format.state_dim and data.draw(st.booleans()):
        wide = state.copy()
        wide[0, 0] = np.nan
    return (lambda: t.write_with_state(rows, values, wide)), InvalidRowsError


CALLS = {"lookup": call_lookup, "lookup_pooled": call_lookup_pooled, "update": call_update,
         "read_physical": call_read_physical, "read_with_state": call_read_with_state,
         "write_physical": call_write_physical, "write_with_state": call_write_with_state}


def _refused(m: Model, call: Callable[[], Any], err: type) -> None:
    """``call`` raises ``err`` and changes neither the statistics nor the lookup count."""
    t = m.table
    stats, lookups = t.stats(), t.lookups
    with pytest.raises(err):
        call()
    assert t.stats() == stats, m.log[-1]
    assert t.lookups == lookups == m.lookups, m.log[-1]


def _check_rows(m: Model, table: embstore.Table) -> None:
    every = np.arange(table.num_rows, dtype=np.int64)
    got, state = table.read_with_state(every)
    np.testing.assert_array_equal(got, m.rows)
    np.testing.assert_array_equal(state, m.state)


@pytest.mark.parametrize("name", sorted(SETUPS))
@settings(max_examples=20)
@given(data=st.data())
def test_refused_calls_change_nothing(name: str, data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = embstore.create(Path(tmp) / "s", StoreConfig((_config(name),)))
        closed = False
        try:
            table = store.ensure_state_dim("t", SETUPS[name][1])
            m = Model.of(table)
            if data.draw(st.booleans(), label="warm"):  # a resident tier starts full, not empty
                table.read_physical(np.arange(table.num_rows, dtype=np.int64))
            for _ in range(data.draw(st.integers(1, 16), label="calls")):
                what = data.draw(st.sampled_from(sorted(CALLS)))
                valid = data.draw(st.booleans())
                m.log.append(f"{what} {'valid' if valid else 'invalid'}")
                refused = CALLS[what](data, m, valid)
                if refused:
                    _refused(m, *refused)
            _check_rows(m, table)
            if data.draw(st.booleans(), label="close"):  # a closed table refuses every call, valid or not
                store.close()
                closed = True
                for what in sorted(CALLS):
                    if what == "update" and table.mapper is not None and table.mapper.rows_per_id != 1:
                        continue  # refused for the QR hash before the closed table is noticed
                    m.log.append(f"{what} on a closed table")
                    _refused(m, _valid_call(data, m, what), StoreClosedError)
                with embstore.open(Path(tmp) / "s") as again:  # every accepted write was flushed on close
                    _check_rows(m, again["t"])
        finally:
            if not closed:
                store.close()


def _valid_call(data: st.DataObject, m: Model, what: str) -> Callable[[], Any]:
    """A call with valid arguments (for a closed table, which must refuse it anyway)."""
    t = m.table
    ids, phys = _ids(data, t, min_size=1), _phys(data, t, unique=True, min_size=1)
    rows = _values(data, len(ids), DIM)
    values, state = _values(data, len(phys), t.format.dim), _values(data, len(phys), t.format.state_dim)
    return {"lookup": lambda: t.lookup(ids),
            "lookup_pooled": lambda: t.lookup_pooled(ids, np.array([0, len(ids)], np.int64)),
            "update": lambda: t.update(ids, rows),
            "read_physical": lambda: t.read_physical(phys),
            "read_with_state": lambda: t.read_with_state(phys),
            "write_physical": lambda: t.write_physical(phys, values),
            "write_with_state": lambda: t.write_with_state(phys, values, state)}[what]
