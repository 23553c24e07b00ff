"""Row formats across tier stacks, against a numpy reference of the documented quantisation (audit).

Per table the rows are float32, float16 or int8 row-wise (``x = q * scale + bias``, README: "an int8 row
reads back within (max - min) / 510 of what was written (plus float32 rounding)"), converted once at the
table boundary; every tier holds the same bytes and lookups return float32. Edge rows: constant rows
(max == min), magnitudes near and beyond float16's 65504, near float32's limit, subnormals, negative
zeros; dims of 1 and not a multiple of 4 or 8. Rows are read back through ``lookup`` and
``lookup_pooled`` (sum, mean) after evictions, after ``flush`` and after close + reopen, and must be
bit-identical at every stage (an evicted and re-read row is never re-quantised). Bad rows raise
``InvalidRowsError`` and write nothing. What ``tests/test_refused_calls.py`` and
``tests/test_api.py`` already cover (every entry point's refusals at DIM 4, RowFormat round trips of
linspace rows) is not repeated here.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

import embstore
from embstore.config import StoreConfig, TableConfig, TierConfig
from embstore.errors import InvalidRowsError
from embstore.rows import RowFormat

ROWS = 24
CACHE = 5  # rows in a partial cache: a batch of more ids than this evicts
F32_MAX = float(np.finfo(np.float32).max)
TINY = 2.0**-149  # float32's smallest subnormal

# name -> tiers as (kind, capacity in rows: None for the home, ROWS for a whole-table cache, policy)
STACKS = {
    "dram-only": (("dram", ROWS, "lru"), ("mmap", None, None)),  # resident: the table lives in DRAM
    "dram-over-ssd": (("dram", CACHE, "lru"), ("ssd", None, None)),
    "dram-over-ssd-log": (("dram", CACHE, "clock"), ("ssd-log", None, None)),
    "dram-over-rocksdb": (("dram", CACHE, "lfu"), ("rocksdb", None, None)),
    "mmap-cache-over-ssd": (("mmap", CACHE, "lru"), ("ssd", None, None)),
    "mmap-home": (("mmap", None, None),),
    "device-over-dram-over-ssd": (("device", CACHE - 2, "lru"), ("dram", CACHE, "lru"), ("ssd", None, None)),
    "device-whole": (("device", ROWS, "lru"), ("mmap", None, None)),
}
DTYPES = ("float32", "float16", "int8")


def _config(stack: str, dtype: str, dim: int) -> StoreConfig:
    rb = RowFormat(dim, dtype).row_bytes
    tiers = []
    for kind, rows, policy in STACKS[stack]:
        if rows is None:
            tiers.append(TierConfig("ssd", layout="log") if kind == "ssd-log" else TierConfig(kind))
        else:
            tiers.append(TierConfig(kind, rows * rb, policy, device="cpu") if kind == "device"
                         else TierConfig(kind, rows * rb, policy))
    return StoreConfig((TableConfig("t", ROWS, dim, dtype=dtype, init={"kind": "uniform", "scale": 0.5, "seed": 3},
                                    tiers=tuple(tiers)),))


# --- the reference ----------------------------------------------------------------------------------

def _ulp(x: np.ndarray) -> np.ndarray:
    return np.spacing(np.abs(np.asarray(x, np.float32))).astype(np.float64)


def check_against_reference(dtype: str, written: np.ndarray, got: np.ndarray) -> None:
    """``got`` (what the table read back) is ``written`` in ``dtype`` within the documented bound."""
    assert got.dtype == np.float32 and got.shape == written.shape
    assert np.isfinite(got).all()
    if dtype == "float32":
        np.testing.assert_array_equal(got.view(np.uint32), written.view(np.uint32))  # bit-exact, -0.0 too
        return
    if dtype == "float16":
        ref = written.astype(np.float16).astype(np.float32)  # round to nearest even, subnormals included
        np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))
        return
    x = written.astype(np.float64)
    g = got.astype(np.float64)
    spread = x.max(axis=1, keepdims=True) - x.min(axis=1, keepdims=True)
    # (max - min) / 510, plus float32 rounding: of the stored scale and bias, of q * scale and of the sum
    # (one ulp of the row's largest magnitude covers them), and of a subnormal scale (its step, 2**-149)
    row_ulp = _ulp(np.abs(written).max(axis=1, keepdims=True))
    bound = spread / 510 * (1 + 1e-6) + 2 * row_ulp + _ulp(written) + TINY
    err = np.abs(g - x)
    bad = np.argwhere(err > bound)
    assert not len(bad), (f"int8 row {bad[0][0]}: wrote {written[bad[0][0]].tolist()}, read "
                          f"{got[bad[0][0]].tolist()}; error {err[tuple(bad[0])]:g} > bound {bound[bad[0][0], 0]:g}")
    const = spread[:, 0] == 0
    np.testing.assert_array_equal(g[const], x[const])  # a constant row is stored exactly (its bias)


# --- drawing rows -----------------------------------------------------------------------------------

def _row(kind: str, dim: int, dtype: str, rng: np.random.Generator) -> np.ndarray:
    f16 = dtype == "float16"
    if kind == "normal":
        r = rng.standard_normal(dim) * 10.0 ** rng.integers(-3, 4)
    elif kind == "constant":
        r = np.full(dim, rng.choice([0.0, -0.0, 1.5, -7e4 if not f16 else -65504.0, 1e-40, 3e38 if not f16 else 1.0]))
    elif kind == "near-f16-max":
        r = rng.uniform(65000.0, 65519.99, dim) * rng.choice([-1.0, 1.0], dim)
    elif kind == "beyond-f16":  # only float32 and int8 tables take these
        r = rng.uniform(65520.0, 1e6, dim) * rng.choice([-1.0, 1.0], dim) if not f16 else rng.uniform(-1, 1, dim)
    elif kind == "near-f32-max":
        r = rng.uniform(-F32_MAX, F32_MAX, dim) if not f16 else rng.uniform(-65504, 65504, dim)
    elif kind == "subnormal":  # float32 subnormal multiples of 2**-149, a few steps or many apart
        r = rng.integers(-rng.choice([3, 200, 400, 700, 5000, 2**22]), 2**10, dim).astype(np.float64) * TINY
    elif kind == "f16-subnormal":  # float16's subnormal range (steps of 2**-24), and below it
        r = rng.uniform(-2.0**-14, 2.0**-14, dim) * rng.choice([1.0, 1e-3])
    else:  # "zeros": signed zeros mixed
        r = rng.choice([0.0, -0.0], dim)
    r = np.asarray(r, np.float64).astype(np.float32)
    if rng.random() < 0.2:
        r[rng.integers(0, dim)] = -0.0
    return r


KINDS = ("normal", "constant", "near-f16-max", "beyond-f16", "near-f32-max", "subnormal", "f16-subnormal", "zeros")


@st.composite
def batches(draw, dim: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(distinct ids, float32 rows) of one update."""
    ids = draw(st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=12, unique=True))
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=len(ids), max_size=len(ids)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return np.array(ids, np.int64), np.stack([_row(k, dim, dtype, rng) for k in kinds])


def _pool_ref(rows: np.ndarray, ids: np.ndarray, offsets: np.ndarray, mode: str) -> np.ndarray:
    out = np.zeros((len(offsets) - 1, rows.shape[1]), np.float64)
    for b in range(len(offsets) - 1):
        bag = rows[ids[offsets[b]:offsets[b + 1]]].astype(np.float64)
        if len(bag):
            out[b] = bag.sum(axis=0) / (len(bag) if mode == "mean" else 1)
    return out


def check_pooled(table: embstore.Table, rows: np.ndarray, rng: np.random.Generator) -> None:
    """lookup_pooled (sum and mean) pools exactly the rows lookup returns, within float32 summation."""
    ids = rng.integers(0, ROWS, rng.integers(0, 16)).astype(np.int64)
    cuts = np.sort(rng.integers(0, len(ids) + 1, rng.integers(0, 4)))
    offsets = np.concatenate([[0], cuts, [len(ids)]]).astype(np.int64)
    for mode in ("sum", "mean"):
        got = table.lookup_pooled(ids, offsets, mode=mode)
        assert got.dtype == np.float32 and got.shape == (len(offsets) - 1, rows.shape[1])
        ref = _pool_ref(rows, ids, offsets, mode)
        absum = _pool_ref(np.abs(rows), ids, offsets, "sum")
        ok = absum < F32_MAX / 2  # a float32 sum of rows near float32's limit may overflow: not this check's
        tol = absum * 2.0**-19 + 2.0**-149  # float32 summation of up to 16 rows, in any order
        assert (np.abs(got.astype(np.float64) - ref)[ok] <= tol[ok]).all(), (mode, got, ref)
        empty = np.diff(offsets) == 0
        assert not got[empty].any()


# --- the property -----------------------------------------------------------------------------------

CASES = [(s, d) for s in STACKS for d in DTYPES]


@pytest.mark.parametrize("stack,dtype", CASES)
@settings(max_examples=25, deadline=None)
@given(data=st.data(), dim=st.sampled_from([1, 3, 5, 7, 13]))
def test_rows_read_back_within_the_format_bound_and_identical_across_tiers(stack: str, dtype: str, dim: int,
                                                                          data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "s"
        store = embstore.create(path, _config(stack, dtype, dim))
        t = store["t"]
        every = np.arange(ROWS, dtype=np.int64)
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
        initial = t.lookup(every)
        written: dict[int, np.ndarray] = {}
        for _ in range(data.draw(st.integers(1, 3))):
            ids, rows = data.draw(batches(dim, dtype))
            t.update(ids, rows)
            for i, r in zip(ids.tolist(), rows):
                written[int(i)] = r
            got = t.lookup(ids)  # straight after the write: still in the top tier
            check_against_reference(dtype, rows, got)
        w_ids = np.array(sorted(written), np.int64)
        w_rows = np.stack([written[i] for i in w_ids.tolist()])
        first = t.lookup(every)  # every row: evicts the written ones from a partial cache
        check_against_reference(dtype, w_rows, first[w_ids])
        untouched = np.setdiff1d(every, w_ids)
        np.testing.assert_array_equal(first[untouched].view(np.uint32), initial[untouched].view(np.uint32))
        check_pooled(t, first, rng)
        for _ in range(2):  # re-read after evictions: the bytes moved between tiers, never re-quantised
            order = rng.permutation(every)
            np.testing.assert_array_equal(t.lookup(order).view(np.uint32), first[order].view(np.uint32))
        store.flush()
        np.testing.assert_array_equal(t.lookup(w_ids[::-1]).view(np.uint32), first[w_ids[::-1]].view(np.uint32))
        store.close()
        with embstore.open(path) as store:
            t = store["t"]
            again = t.lookup(every)
            np.testing.assert_array_equal(again.view(np.uint32), first.view(np.uint32))
            check_pooled(t, first, rng)
            # rewriting what was read back: float32 and float16 store the same bytes (a fixed point); int8
            # re-quantises (near float32's limit its rounded scale moves the top value by an ulp or two)
            t.update(w_ids, again[w_ids])
            reread = t.lookup(every)
            if dtype == "int8":
                check_against_reference(dtype, again[w_ids], reread[w_ids])
            else:
                np.testing.assert_array_equal(reread.view(np.uint32), first.view(np.uint32))


# --- bad rows ---------------------------------------------------------------------------------------

def _faults(dtype: str, dim: int) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = [
        ("nan", np.nan), ("inf", np.inf), ("-inf", -np.inf), ("beyond-f32", 1e39),
        ("int-dtype", "int32"), ("bool-dtype", "bool"), ("complex-dtype", "complex64"),
        ("wrong-dim", dim + 1), ("short-dim", dim - 1), ("wrong-n", None), ("1-d", None),
    ]
    if dtype == "float16":
        out += [("f16-limit", 65520.0), ("-f16-limit", -65520.0), ("beyond-f16", 1e5)]
    return out


def _bad_rows(fault: str, arg: object, rows: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    n, dim = rows.shape
    if fault in ("nan", "inf", "-inf", "beyond-f32", "f16-limit", "-f16-limit", "beyond-f16"):
        bad = rows.astype(np.float64)  # float64 so 1e39 is not inf before the table sees it
        bad[rng.integers(0, n), rng.integers(0, dim)] = arg
        return bad
    if fault.endswith("-dtype"):
        with np.errstate(invalid="ignore", over="ignore"):
            return np.clip(rows, -1e6, 1e6).astype(arg)
    if fault in ("wrong-dim", "short-dim"):
        return np.zeros((n, max(arg, 0)), np.float32)
    if fault == "wrong-n":
        return np.zeros((n + 1, dim), np.float32)
    return rows.reshape(-1)  # 1-d


@pytest.mark.parametrize("stack", ["dram-only", "dram-over-ssd", "dram-over-rocksdb", "mmap-cache-over-ssd"])
@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=10, deadline=None)
@given(data=st.data(), dim=st.sampled_from([1, 5, 13]))
def test_bad_rows_raise_invalid_rows_and_write_nothing(stack: str, dtype: str, dim: int, data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "s"
        with embstore.create(path, _config(stack, dtype, dim)) as store:
            t = store["t"]
            every = np.arange(ROWS, dtype=np.int64)
            ids, rows = data.draw(batches(dim, dtype))
            t.update(ids, rows)
            before = t.lookup(every)
            rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
            for fault, arg in _faults(dtype, dim):
                if fault == "short-dim" and dim == 1:
                    continue
                new_ids, new_rows = data.draw(batches(dim, dtype))
                bad = _bad_rows(fault, arg, new_rows, rng)
                with pytest.raises(InvalidRowsError):
                    t.update(new_ids, bad)
                after = t.lookup(every)
                np.testing.assert_array_equal(after.view(np.uint32), before.view(np.uint32), err_msg=fault)
        with embstore.open(path) as store:
            np.testing.assert_array_equal(store["t"].lookup(every).view(np.uint32), before.view(np.uint32))


# --- the int8 bound at subnormal spreads (a defect this audit found) -------------------------------------

@pytest.mark.parametrize("steps", [256, 300, 382, 637, 1000, 2**20 + 7])
def test_int8_row_a_few_hundred_subnormal_steps_wide_reads_back_within_the_bound(tmp_path, steps: int) -> None:
    """A row spanning k float32 subnormal steps with k / 255 not near an integer: its float32 scale
    rounded *down* to a whole number of steps (300 / 255 = 1.18 -> 1), so (x - min) / scale passed 255 and
    the top values were clamped: 382 steps read back 127 steps off, against a bound of 382 / 510."""
    x = (np.array([[0, steps // 3, steps - 1, steps]], np.float64) * TINY).astype(np.float32)
    fmt = RowFormat(4, "int8")
    check_against_reference("int8", x, fmt.decode(fmt.encode(x)))
    check_against_reference("int8", -x, fmt.decode(fmt.encode(-x)))
    with embstore.create(tmp_path / "s", _config("dram-over-ssd", "int8", 4)) as store:
        store["t"].update(np.array([2], np.int64), x)
        check_against_reference("int8", x, store["t"].lookup(np.array([2], np.int64)))


@given(st.integers(-2**23, 2**23), st.integers(1, 2**33), st.integers(1, 9))
@example(0, 382, 2)
@example(-5, 300, 3)
@settings(max_examples=200, deadline=None)
def test_int8_subnormal_and_small_normal_spreads_meet_the_bound(lo_steps: int, width: int, dim: int) -> None:
    """Rows of float32 multiples of 2**-149 (subnormals and the smallest normals), spread ``width`` steps."""
    rng = np.random.default_rng(width * 31 + dim)
    q = np.concatenate([[lo_steps, lo_steps + width], lo_steps + rng.integers(0, width + 1, dim)])[:max(dim, 2)]
    x = (q.astype(np.float64) * TINY).astype(np.float32)[None, :]
    fmt = RowFormat(x.shape[1], "int8")
    check_against_reference("int8", x, fmt.decode(fmt.encode(x)))


# --- one-element views with a negative stride (a defect this audit found) ---------------------------------

@pytest.mark.parametrize("stack", ["device-whole", "device-over-dram-over-ssd", "dram-only", "dram-over-rocksdb"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_element_reversed_views_are_ordinary_ids_and_rows(tmp_path, stack: str, dtype: str) -> None:
    """``ids[::-1]`` of one id and ``rows[::-1]`` of one row have a negative stride that numpy still calls
    C-contiguous, and torch.from_numpy refuses: lookup_pooled on a resident table, lookup on a device one
    and update / write_physical into a device tier raised torch's ValueError, the write after the cache had
    given the row a slot, so the row then read another row's bytes until evicted."""
    dim = 5
    with embstore.create(tmp_path / "s", _config(stack, dtype, dim)) as store:
        t = store["t"]
        every = np.arange(ROWS, dtype=np.int64)
        before = t.lookup(every)  # makes every row of a whole-table tier resident: the fast paths
        one = np.array([7], np.int64)[::-1]
        assert one.strides[0] < 0 and one.flags.c_contiguous
        np.testing.assert_array_equal(t.lookup(one), before[[7]])
        np.testing.assert_array_equal(t.lookup_pooled(one, np.array([0, 1], np.int64)), before[[7]])
        np.testing.assert_array_equal(t.lookup_pooled(one, np.array([0, 1], np.int64), mode="mean"), before[[7]])
        empty_offsets = np.array([0], np.int64)[::-1]
        assert t.lookup_pooled(np.array([], np.int64), empty_offsets).shape == (0, dim)
        row = np.full((2, dim), 2.5, np.float32)[::-2]
        assert row.strides[0] < 0 and row.flags.c_contiguous
        for ids in (np.array([5], np.int64), one):
            t.update(ids, row)
            np.testing.assert_array_equal(t.lookup(ids), row)
        t.write_physical(np.array([9], np.int64), np.full((2, dim), -1.5, np.float32)[::-2])
        expect = before.copy()
        expect[[5, 7]] = 2.5
        expect[9] = -1.5
        np.testing.assert_array_equal(t.lookup(every), expect)
        np.testing.assert_array_equal(t.read_physical(np.array([9], np.int64)[::-1]), expect[[9]])
    with embstore.open(tmp_path / "s") as store:
        np.testing.assert_array_equal(store["t"].lookup(every), expect)
