"""Audit of the trace formats, statistics and recorder against short pure-Python references.

Every statistic of :func:`embstore.traces.trace_stats` is recomputed here with a Counter per batch; the
three file formats are built by hand (``np.savez``, ``torch.save``, text) and read back against the
trace they were built from; damaged files must raise the project's typed errors, naming the problem,
or load the very trace that was written (never a silently different one); and a recorded store's trace
holds each call's distinct rows in order and replays to the store's own per-tier hit counts.
"""

from __future__ import annotations

import gzip
import io
import math
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import embstore
from embstore.config import HashConfig, StoreConfig, TableConfig, TierConfig
from embstore.errors import CorruptStoreError, EmbstoreError, InvalidInputError
from embstore.recorder import record
from embstore.simulator import replay_trace
from embstore.traces import REUSE_THRESHOLDS, Trace, load, save, trace_stats

I64 = (-(2**63), 2**63 - 1)
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ids: a few small ones (so rows repeat), int64's extremes and huge values
ids_st = st.one_of(st.integers(0, 5), st.sampled_from([I64[0], I64[1], 2**62, -1, 2**32]), st.integers(*I64))


def _rows(trace: Trace, b: int) -> list[tuple[int, int]]:
    lo, hi = int(trace.batch_offsets[b]), int(trace.batch_offsets[b + 1])
    return list(zip(trace.table[lo:hi].tolist(), trace.ids[lo:hi].tolist()))


def _same(a: Trace, ids, table, off, names) -> None:
    assert a.ids.dtype == np.int64 and a.table.dtype == np.int32 and a.batch_offsets.dtype == np.int64
    assert a.ids.tolist() == list(ids)
    assert a.table.tolist() == list(table)
    assert a.batch_offsets.tolist() == list(off)
    assert a.table_names == tuple(names)


# --------------------------------------------------------------------------- statistics


@st.composite
def traces_st(draw):
    """Batches of (table, id) rows: empty batches, one table or many, rows repeated past every threshold."""
    n_tables = draw(st.sampled_from([1, 1, 2, 5, 40]))
    n_batches = draw(st.integers(1, 5))
    ids, table, off = [], [], [0]
    for _ in range(n_batches):
        n_rows = draw(st.integers(0, 6))  # 0: an empty batch
        batch = []
        for _ in range(n_rows):
            row = (draw(st.integers(0, n_tables - 1)), draw(ids_st))
            # most rows once or a few times; some past 8, 32, 64, 256 and 1024 lookups
            reps = draw(st.one_of(st.integers(1, 3), st.sampled_from([9, 33, 65, 257, 1025, 1100])))
            batch += [row] * reps
        order = draw(st.permutations(range(len(batch)))) if len(batch) <= 40 else range(len(batch))
        batch = [batch[i] for i in order]
        table += [t for t, _ in batch]
        ids += [i for _, i in batch]
        off.append(len(ids))
    return Trace(np.array(ids, np.int64), np.array(table, np.int32), np.array(off, np.int64),
                 tuple(f"t{i}" for i in range(n_tables)))


def reference_stats(trace: Trace) -> dict:
    """The module doc's definitions, one batch at a time with a Counter of (table, id) rows; with no lookup
    at all the ratios are undefined (NaN)."""
    n = len(trace)
    start = 0.0 if n else math.nan
    ratio = start
    rows_pct = [start] * len(REUSE_THRESHOLDS)
    lookups_pct = [start] * len(REUSE_THRESHOLDS)
    dedup: list[tuple[int, int]] = []
    for b in range(trace.num_batches):
        rows = _rows(trace, b)
        if not rows:
            continue
        c = Counter(rows)
        w = len(rows) / n  # lookup weight of the batch
        ratio += w * len(c) / len(rows)
        for j, k in enumerate(REUSE_THRESHOLDS):
            above = [v for v in c.values() if v > k]
            rows_pct[j] += w * 100.0 * len(above) / len(c)
            lookups_pct[j] += w * 100.0 * sum(above) / len(rows)
        dedup += list(dict.fromkeys(rows))  # the batch's distinct rows, in first-appearance order
    last: dict[tuple[int, int], int] = {}
    dist = []
    for i, r in enumerate(dedup):
        if r in last:
            dist.append(len(set(dedup[last[r] + 1:i])))
        last[r] = i
    return dict(ratio=ratio, rows_pct=rows_pct, lookups_pct=lookups_pct, dist=dist, n_dedup=len(dedup),
                unique=len(set(zip(trace.table.tolist(), trace.ids.tolist()))))


@given(traces_st())
@settings(max_examples=60, **SETTINGS)
def test_trace_stats_match_a_counter_per_batch(trace):
    s = trace_stats(trace)
    ref = reference_stats(trace)
    assert (s.accesses, s.batches, s.tables) == (len(trace), trace.num_batches, trace.num_tables)
    assert s.unique_rows == ref["unique"]
    assert s.unique_ratio == pytest.approx(ref["ratio"], rel=1e-12, abs=1e-12, nan_ok=True)
    assert s.dedup_factor == pytest.approx(1 / ref["ratio"], rel=1e-12, nan_ok=True)  # ratio > 0 or NaN
    assert [b.threshold for b in s.reuse] == list(REUSE_THRESHOLDS)
    np.testing.assert_allclose([b.rows_pct for b in s.reuse], ref["rows_pct"], rtol=1e-12, atol=1e-9)
    np.testing.assert_allclose([b.lookups_pct for b in s.reuse], ref["lookups_pct"], rtol=1e-12, atol=1e-9)
    rd = s.reuse_distance
    if ref["n_dedup"] == 0:  # no accesses: undefined
        assert math.isnan(rd.reaccess_pct)
    else:
        assert rd.reaccess_pct == pytest.approx(100.0 * len(ref["dist"]) / ref["n_dedup"])
    if ref["dist"]:
        assert (rd.p50, rd.p90, rd.p99) == pytest.approx(tuple(np.percentile(ref["dist"], [50, 90, 99])))
        assert rd.max == max(ref["dist"])
    else:
        assert all(math.isnan(p) for p in (rd.p50, rd.p90, rd.p99)) and rd.max is None  # no distance to rank
    # the statistics of a row do not depend on its table's number, nor on id values (only on equality)
    assert trace_stats(trace, reuse_distances=False).reuse == s.reuse


def test_reuse_thresholds_are_strictly_more_than_k():
    """A row looked up exactly k times is not "reused more than k times"."""
    for k in REUSE_THRESHOLDS:
        ids = np.array([1] * k + [2] * (k + 1), np.int64)
        s = trace_stats(Trace(ids, np.zeros(ids.size, np.int32), np.array([0, ids.size])), reuse_distances=False)
        b = {x.threshold: x for x in s.reuse}[k]
        assert b.rows_pct == pytest.approx(50.0) and b.lookups_pct == pytest.approx(100.0 * (k + 1) / ids.size)


# --------------------------------------------------------------------------- npz


@st.composite
def raw_trace_st(draw):
    n_tables = draw(st.integers(1, 6))
    n = draw(st.integers(0, 25))
    ids = draw(st.lists(ids_st, min_size=n, max_size=n))
    table = draw(st.lists(st.integers(0, n_tables - 1), min_size=n, max_size=n))
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=6)))  # repeated cuts: empty batches
    names = draw(st.sampled_from([(), tuple(f"tab {i}" for i in range(n_tables)),
                                  tuple(f"\u00e9\u8868{i}" for i in range(n_tables))]))
    return ids, table, [0, *cuts, n], names


@given(raw_trace_st(), st.sampled_from([np.int64, np.uint64]), st.sampled_from([np.int32, np.int64, np.uint8]),
       st.sampled_from([np.int64, np.int32, np.uint32]), st.booleans())
@settings(max_examples=40, **SETTINGS)
def test_npz_written_by_numpy_loads_saves_and_loads_again(raw, ids_dt, tab_dt, off_dt, compressed):
    ids, table, off, names = raw
    if ids_dt is np.uint64:
        ids = [abs(i) % 2**63 for i in ids]
    if tab_dt is np.uint8:
        table = [t % 256 for t in table]
    want_names = names or tuple(f"table_{i}" for i in range(max(table, default=0) + 1))
    arrays = dict(ids=np.array(ids, ids_dt), table=np.array(table, tab_dt), batch_offsets=np.array(off, off_dt))
    if names:
        arrays["table_names"] = np.array(names)
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "in.npz"
        (np.savez_compressed if compressed else np.savez)(p, **arrays)
        first = load(p)
        _same(first, ids, table, off, want_names)
        save(first, Path(d) / "out.npz")
        _same(load(Path(d) / "out.npz"), ids, table, off, want_names)
        assert trace_stats(load(Path(d) / "out.npz")) == trace_stats(first)


# --------------------------------------------------------------------------- Meta's dlrm_datasets format


def _torch_bytes(obj, gz: bool = False, legacy: bool = False) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, _use_new_zipfile_serialization=not legacy)
    return gzip.compress(buf.getvalue()) if gz else buf.getvalue()


@st.composite
def meta_st(draw):
    """bags[t][b]: table t, sample b; ids huge or small, duplicates inside a bag, empty bags."""
    T = draw(st.integers(1, 5))
    B = draw(st.integers(1, 7))
    bags = [[draw(st.lists(ids_st, max_size=4).map(lambda xs: xs + xs[:1] if xs and len(xs) % 2 else xs))
             for _ in range(B)] for _ in range(T)]
    return T, B, bags


def _meta_reference(T, B, bags, S):
    """Batch k holds samples [kS, (k+1)S), table-major: table 0's bags in sample order, then table 1's..."""
    ids, tab, off = [], [], [0]
    for start in range(0, B, S):
        for t in range(T):
            for b in range(start, min(B, start + S)):
                ids += bags[t][b]
                tab += [t] * len(bags[t][b])
        off.append(len(ids))
    return ids, tab, off


@given(meta_st(), st.one_of(st.none(), st.integers(1, 8)), st.booleans(), st.booleans(),
       st.sampled_from([torch.int64, torch.int32]))
@settings(max_examples=40, **SETTINGS)
def test_dlrm_file_loads_as_table_major_bags(meta, batch_size, gz, end_offset, off_dtype):
    T, B, bags = meta
    lens = [[len(bags[t][b]) for b in range(B)] for t in range(T)]
    flat = [i for t in range(T) for b in range(B) for i in bags[t][b]]  # bag t * B + b
    offsets = np.concatenate([[0], np.cumsum([n for row in lens for n in row])]).astype(np.int64)
    if not end_offset:
        offsets = offsets[:-1]  # fbgemm's offsets without the trailing total
    obj = (torch.tensor(flat, dtype=torch.int64), torch.from_numpy(offsets).to(off_dtype),
           torch.tensor(lens, dtype=torch.int32))
    want = _meta_reference(T, B, bags, batch_size or B)
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / ("t.pt.gz" if gz else "t.pt")
        p.write_bytes(_torch_bytes(obj, gz))
        got = load(p, batch_size=batch_size)
        _same(got, *want, tuple(f"table_{t}" for t in range(T)))
        save(got, Path(d) / "t.npz")  # and on through the npz form unchanged
        _same(load(Path(d) / "t.npz"), *want, tuple(f"table_{t}" for t in range(T)))


# --------------------------------------------------------------------------- CSV


@given(st.lists(st.tuples(st.integers(0, 4), ids_st, st.integers(0, 3)), max_size=15),
       st.booleans(), st.booleans(), st.sampled_from(["\n", "\r\n"]), st.data())
@settings(max_examples=50, **SETTINGS)
def test_csv_loads_what_was_written(rows, named, batched, eol, data):
    batches = sorted(b for _, _, b in rows)  # batch numbers never decrease
    rows = [(t, i, b) for (t, i, _), b in zip(rows, batches)]
    header = "table,id,batch" if batched else "table,id"
    lines = [header]
    for t, i, b in rows:
        cells = [f"feat{t}" if named else str(t), str(i)] + ([str(b)] if batched else [])
        pad = data.draw(st.sampled_from(["", " ", "\t"]))
        lines.append(",".join(pad + c + pad for c in cells))
        if data.draw(st.integers(0, 4)) == 0:
            lines.append(data.draw(st.sampled_from(["", "  ", "\t"])))  # a blank line: skipped
    text = eol.join(lines) + data.draw(st.sampled_from(["", eol, eol + eol]))
    if named:
        first = list(dict.fromkeys(t for t, _, _ in rows))
        names = tuple(f"feat{t}" for t in first) or ("table_0",)
        table = [first.index(t) for t, _, _ in rows]
    else:
        names = tuple(f"table_{i}" for i in range(max((t for t, _, _ in rows), default=0) + 1))
        table = [t for t, _, _ in rows]
    off = [0] + [k for k in range(1, len(rows)) if batched and rows[k][2] != rows[k - 1][2]] + [len(rows)]
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "t.csv"
        p.write_bytes(text.encode())
        _same(load(p), [i for _, i, _ in rows], table, off, names)


# --------------------------------------------------------------------------- bad files


def _meta(*tensors) -> bytes:
    return _torch_bytes(tuple(tensors))


T_ = torch.tensor
BAD_FILES = [
    # npz: wrong dtypes, shapes and offsets
    ("f.npz", lambda p: np.savez(p, ids=np.array([1.0]), table=np.array([0]), batch_offsets=np.array([0, 1])),
     InvalidInputError, "ids must be integers"),
    ("f.npz", lambda p: np.savez(p, ids=np.array([1]), table=np.array([0]), batch_offsets=np.array([0.0, 1.0])),
     InvalidInputError, "batch_offsets must be integers"),
    ("f.npz", lambda p: np.savez(p, ids=np.array([2**64 - 1], np.uint64), table=np.array([0]),
                                 batch_offsets=np.array([0, 1])), InvalidInputError, "int64 range"),
    ("f.npz", lambda p: np.savez(p, ids=np.array([1, 2]), table=np.array([0, 0]), batch_offsets=np.array([0, 3])),
     InvalidInputError, "end with len"),
    ("f.npz", lambda p: np.savez(p, ids=np.array([1, 2]), table=np.array([0]), batch_offsets=np.array([0, 2])),
     InvalidInputError, "table has 1 entries"),
    ("f.npz", lambda p: np.savez(p, ids=np.array([[1, 2]]), table=np.array([0, 0]), batch_offsets=np.array([0, 2])),
     InvalidInputError, "ids must be 1-D"),
    ("f.npz", lambda p: np.savez(p, ids=np.array([1, 2, 3]), table=np.array([0, 0, 0]),
                                 batch_offsets=np.array([0, 2, 1, 3])), InvalidInputError, "non-decreasing"),
    ("f.npz", lambda p: np.savez(p, ids=np.array([1]), table=np.array([-1]), batch_offsets=np.array([0, 1])),
     InvalidInputError, ">= 0"),
    ("f.npz", lambda p: np.savez(p, ids=np.array([1], object), table=np.array([0]), batch_offsets=np.array([0, 1])),
     CorruptStoreError, "not a readable npz"),
    ("f.npz", lambda p: p.write_bytes(b""), CorruptStoreError, "not an npz archive"),
    # Meta: wrong dtypes, shapes, inconsistent offsets and lengths
    ("m.pt", lambda p: p.write_bytes(_meta(T_([1.0]), T_([0, 1]), T_([[1]]))), InvalidInputError, "indices must be"),
    ("m.pt", lambda p: p.write_bytes(_meta(T_([1]), T_([0.0, 1.0]), T_([[1]]))), InvalidInputError, "offsets must be"),
    ("m.pt", lambda p: p.write_bytes(_meta(T_([1, 2]), T_([0, 1, 2]), T_([1, 1]))), InvalidInputError,
     r"lengths must have shape \(tables, batch\)"),
    ("m.pt", lambda p: p.write_bytes(_meta(T_([[1, 2]]), T_([0, 1, 2]), T_([[1, 1]]))), InvalidInputError,
     "indices and offsets must be 1-D"),
    ("m.pt", lambda p: p.write_bytes(_meta(T_([1, 2]), T_([0, 1, 2]), T_([[2, 0]]))), InvalidInputError,
     "lengths disagree"),
    ("m.pt", lambda p: p.write_bytes(_meta(T_([1, 2]), T_([0, 1, 2, 2, 2]), T_([[1, 1]]))), InvalidInputError,
     "offsets has 5 entries"),
    ("m.pt", lambda p: p.write_bytes(_meta(T_([1, 2]), T_([0, 1, 5]), T_([[1, 4]]))), InvalidInputError,
     "offsets must run from 0 to len"),
    ("m.pt", lambda p: p.write_bytes(_meta(T_([1, 2, 3]), T_([0, 2, 1, 3]), T_([[2, -1, 2]]))), InvalidInputError,
     "negative bag lengths"),
    ("m.pt", lambda p: p.write_bytes(_meta(T_([1]), T_([0, 1]))), CorruptStoreError, "should hold"),
    ("m.pt", lambda p: p.write_bytes(_torch_bytes({"indices": T_([1])})), CorruptStoreError, "should hold"),
    ("m.pt", lambda p: p.write_bytes(_torch_bytes((1, 2, 3))), CorruptStoreError, "should hold"),
    ("m.pt", lambda p: p.write_bytes(__import__("pickle").dumps((1, 2, 3))), CorruptStoreError,
     "not a readable torch file"),
    ("m.pt", lambda p: p.write_bytes(b""), CorruptStoreError, "not a readable torch file"),
    ("m.pt.gz", lambda p: p.write_bytes(gzip.compress(b"")), CorruptStoreError, "not a readable torch file"),
    # CSV
    ("c.csv", lambda p: p.write_text(""), InvalidInputError, "expected the CSV header"),
    ("c.csv", lambda p: p.write_text("table,id\n0,x\n"), InvalidInputError, "line 2: id 'x'"),
    ("c.csv", lambda p: p.write_text("table,id\n0,1.5\n"), InvalidInputError, "line 2: id '1.5'"),
    ("c.csv", lambda p: p.write_text("table,id\n\n0,1\nzero,2\n0,\n"), InvalidInputError, "line 5: id ''"),
    ("c.csv", lambda p: p.write_text(f"table,id\n0,{2**63}\n"), InvalidInputError, "line 2: id .* int64 range"),
    ("c.csv", lambda p: p.write_text(f"table,id\n0,{-(2**63) - 1}\n"), InvalidInputError, "line 2: id .* int64"),
    ("c.csv", lambda p: p.write_text("table,id\n0,1\n0,1,2\n"), InvalidInputError, "line 3: malformed CSV"),
    ("c.csv", lambda p: p.write_text("table,id\n-1,1\n"), InvalidInputError, "line 2: table indices must be >= 0"),
    ("c.csv", lambda p: p.write_text("table,id,batch\n0,1,1\n\n0,1,0\n"), InvalidInputError,
     "line 4: batch numbers must not decrease"),
    ("c.csv", lambda p: p.write_bytes(b"table,id\n\xff,1\n"), CorruptStoreError, "not a UTF-8 CSV"),
]


@pytest.mark.parametrize("name, write, exc, match", BAD_FILES)
def test_bad_files_raise_typed_errors_that_name_file_and_problem(tmp_path, name, write, exc, match):
    p = tmp_path / name
    write(p)
    with pytest.raises(exc, match=match) as info:
        load(p)
    assert str(p) in str(info.value)


def test_meta_ids_beyond_int64_are_refused_not_wrapped(tmp_path):
    """uint64 indices past int64 were cast with ``astype``: id 2**63 + 5 became -9223372036854775803, a
    silently different trace (npz and CSV refuse such ids)."""
    p = tmp_path / "u.pt"
    p.write_bytes(_meta(torch.tensor([7, 2**63 + 5], dtype=torch.uint64), T_([0, 1, 2]), T_([[1, 1]])))
    with pytest.raises(InvalidInputError, match="indices holds values outside the int64 range") as info:
        load(p)
    assert str(p) in str(info.value)
    q = tmp_path / "ok.pt"  # uint64 ids that fit load as they are
    q.write_bytes(_meta(torch.tensor([7, 2**63 - 1], dtype=torch.uint64), T_([0, 1, 2]), T_([[1, 1]])))
    assert load(q).ids.tolist() == [7, 2**63 - 1]


def test_csv_header_only_and_blank_lines_are_an_empty_trace(tmp_path):
    p = tmp_path / "h.csv"
    for text in ("table,id", "table,id\n", "table,id\n\n  \n", "table,id,batch\n"):
        p.write_text(text)
        _same(load(p), [], [], [0, 0], ("table_0",))


def test_csv_ids_with_leading_zeros_load_as_their_value(tmp_path):
    """A cell's length is not its magnitude: 25 characters of zeros and a 7 is id 7 (it was refused as
    "not an integer in the int64 range"); 20 significant digits past int64 and 5,000 digits are still refused."""
    p = tmp_path / "z.csv"
    p.write_text("table,id\n0," + "0" * 24 + "7\n0,-00000000000000000000009223372036854775808\n0,+000\n")
    t = load(p)
    assert t.ids.tolist() == [7, I64[0], 0]
    for cell in ("9223372036854775808", "0" * 30 + "9223372036854775808", "1" * 5000):
        p.write_text(f"table,id\n0,{cell}\n")
        with pytest.raises(InvalidInputError, match="int64 range"):
            load(p)


def _saved_npz() -> tuple[Trace, bytes]:
    t = Trace(np.array([5, 2**62, -3, 7, I64[0]]), np.array([0, 1, 1, 0, 2]), np.array([0, 1, 1, 5]),
              ("u", "i", "x"))
    with tempfile.TemporaryDirectory() as d:
        save(t, Path(d) / "t.npz")
        return t, (Path(d) / "t.npz").read_bytes()


_NPZ = _saved_npz()
_META_RAW = _torch_bytes((T_([10, 20, 21, 30, 40, 50]), T_([0, 1, 1, 3, 4, 5, 6]), T_([[1, 0, 2], [1, 1, 1]])))


@given(st.data())
@settings(max_examples=60, **SETTINGS)
def test_damaged_files_raise_typed_errors_or_load_unchanged(data):
    """Truncated or bit-flipped npz and torch files: a typed error, or (a flip in slack bytes) the same trace."""
    kind = data.draw(st.sampled_from(["npz", "pt", "pt.gz"]))
    if kind == "npz":
        want, raw = _NPZ[0], _NPZ[1]
    else:
        want = Trace(np.array([10, 20, 21, 30, 40, 50]), np.array([0, 0, 0, 1, 1, 1]), np.array([0, 6]))
        raw = gzip.compress(_META_RAW) if kind == "pt.gz" else _META_RAW
    if data.draw(st.booleans()):
        raw = raw[:data.draw(st.integers(0, len(raw) - 1))]
    else:
        b = bytearray(raw)
        i = data.draw(st.integers(0, len(b) - 1))
        b[i] ^= 1 << data.draw(st.integers(0, 7))
        raw = bytes(b)
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / f"t.{kind}"
        p.write_bytes(raw)
        try:
            got = load(p)
        except EmbstoreError as exc:
            assert isinstance(exc, (CorruptStoreError, InvalidInputError)) and str(p) in str(exc)
            return
    _same(got, want.ids.tolist(), want.table.tolist(), want.batch_offsets.tolist(), want.table_names)


# --------------------------------------------------------------------------- recorder

RB = 16  # float32 rows of dim 4


def _store(path: Path, levels):
    tiers = tuple(TierConfig("dram", c * RB, p) for p, c in levels) + (TierConfig("mmap"),)
    return embstore.create(path, StoreConfig((
        TableConfig("plain", 50, 4, tiers=tiers),
        TableConfig("hashed", 40, 4, hash=HashConfig("mod"), tiers=tiers))))


calls_st = st.lists(st.tuples(st.sampled_from(["plain", "hashed"]), st.sampled_from(["lookup", "pooled", "torch"]),
                              st.lists(st.integers(0, 49) | st.sampled_from([2**62, 10**12 + 7]), min_size=0,
                                       max_size=12)), max_size=25)


@given(calls_st, st.sampled_from(["lru", "lfu", "clock", "lru+tinylfu"]), st.integers(1, 12), st.integers(1, 60))
@settings(max_examples=15, **SETTINGS)
def test_recorded_trace_is_each_calls_rows_and_replays_to_the_stores_hits(calls, policy, c0, c1):
    levels = [(policy, c0), ("lru", c1)]
    with tempfile.TemporaryDirectory() as d:
        want = []
        with _store(Path(d) / "s", levels) as store:
            names = list(store.tables)
            with record(store, Path(d) / "t.npz") as rec:
                for name, how, ids in calls:
                    if name == "plain":
                        ids = [i % 50 for i in ids]
                    arr = np.array(ids, np.int64)
                    if how == "lookup":
                        store[name].lookup(arr)
                    elif how == "torch":
                        store[name].lookup(torch.from_numpy(arr))
                    else:
                        store[name].lookup_pooled(arr, np.array([0, len(arr) // 2, len(arr)]))
                    if arr.size:
                        rows = store[name].mapper(arr) if store[name].mapper is not None else arr
                        want.append((names.index(name), list(dict.fromkeys(rows.tolist()))))
            stats = {n: store[n].stats() for n in names}
        got = load(Path(d) / "t.npz")
    live = [(t, r) for t, r in want if r]
    assert got.table_names == tuple(names)
    seen = [(_rows(got, b)[0][0], [i for _, i in _rows(got, b)]) for b in range(got.num_batches) if _rows(got, b)]
    assert seen == live
    assert all(len({t for t, _ in _rows(got, b)}) <= 1 for b in range(got.num_batches))
    sim = replay_trace(got, levels, per_table=True, belady=False)
    for n in names:
        tiers = [stats[n]["dram"], stats[n]["dram#2"]]
        assert [(s["hits"], s["misses"]) for s in tiers] == [(lv.hits, lv.misses) for lv in sim[n].levels], n


def test_recorder_per_table_order_across_interleaved_calls(tmp_path):
    """Calls alternate between tables; each call is one batch of its distinct physical rows, in order."""
    with _store(tmp_path / "s", [("lru", 4)]) as store, record(store) as rec:
        h = store["hashed"].mapper(np.array([41, 1, 80, 7, 41])).tolist()
        store["plain"].lookup(np.array([3, 1, 3]))
        store["hashed"].lookup(np.array([41, 1, 41]))
        store["plain"].lookup_pooled(np.array([2, 2, 9]), np.array([0, 1, 3]))
        store["hashed"].lookup(np.array([80, 7]))
    t = rec.trace()
    _same(t, [3, 1, *dict.fromkeys(h[:2]), 2, 9, *dict.fromkeys(h[2:4])],
          [0, 0] + [1] * len(set(h[:2])) + [0, 0] + [1] * len(set(h[2:4])),
          np.cumsum([0, 2, len(set(h[:2])), 2, len(set(h[2:4]))]).tolist(), ("plain", "hashed"))
