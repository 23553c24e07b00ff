"""Trace container, file formats (npz, Meta's torch files, CSV), statistics and the `trace` verbs.

A tiny Meta-format example used below (T = 2 tables, B = 3 samples)::

    lengths = [[1, 0, 2],      bag t*B+b:  (0,0)=[10]  (0,1)=[]    (0,2)=[20, 21]
               [1, 1, 1]]                  (1,0)=[30]  (1,1)=[40]  (1,2)=[50]
    offsets = [0, 1, 1, 3, 4, 5, 6]
    indices = [10, 20, 21, 30, 40, 50]
"""

from __future__ import annotations

import gzip
import io
import json
import math
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embstore import traces
from embstore.cli import main as cli_main
from embstore.errors import CorruptStoreError, InvalidInputError
from embstore.traces import REUSE_THRESHOLDS, Trace, dense_keys, load, save, trace_stats

META = (torch.tensor([10, 20, 21, 30, 40, 50]), torch.tensor([0, 1, 1, 3, 4, 5, 6]),
        torch.tensor([[1, 0, 2], [1, 1, 1]]))


def _eq(a: Trace, b: Trace) -> None:
    np.testing.assert_array_equal(a.ids, b.ids)
    np.testing.assert_array_equal(a.table, b.table)
    np.testing.assert_array_equal(a.batch_offsets, b.batch_offsets)
    assert a.table_names == b.table_names
    assert a.ids.dtype == np.int64 and a.table.dtype == np.int32 and a.batch_offsets.dtype == np.int64


# --------------------------------------------------------------------------- Trace


def test_trace_casts_integer_dtypes_and_names_tables():
    t = Trace(np.array([5, 6], dtype=np.int32), np.array([0, 2], dtype=np.int64), np.array([0, 1, 2]))
    assert t.ids.dtype == np.int64 and t.table.dtype == np.int32 and t.batch_offsets.dtype == np.int64
    assert t.table_names == ("table_0", "table_1", "table_2")
    assert (len(t), t.num_batches, t.num_tables) == (2, 2, 3)


def test_empty_trace_is_valid():
    t = Trace(np.zeros(0, np.int64), np.zeros(0, np.int32), np.array([0]))
    assert len(t) == 0 and t.num_batches == 0 and t.num_tables == 1


@pytest.mark.parametrize("ids, table, off, names, match", [
    ([1, 2], [0], [0, 2], (), "table has 1 entries but ids has 2"),
    ([1, 2], [0, 0], [1, 2], (), "start at 0"),
    ([1, 2], [0, 0], [0, 1], (), "end with len"),
    ([1, 2, 3], [0, 0, 0], [0, 2, 1, 3], (), "non-decreasing"),
    ([1, 2], [0, 3], [0, 2], ("a", "b"), "table index 3 is out of range"),
    ([1, 2], [0, -1], [0, 2], (), ">= 0"),
    ([1.5, 2.0], [0, 0], [0, 2], (), "integer array"),
    ([1, 2], [0, 0], [0, 2], ("a", "a"), "unique"),
    ([1, 2], [0, 2**40], [0, 2], (), "int32 range"),
])
def test_trace_validation(ids, table, off, names, match):
    with pytest.raises(InvalidInputError, match=match):
        Trace(np.array(ids), np.array(table), np.array(off), names)


@st.composite
def trace_strategy(draw):
    n = draw(st.integers(0, 40))
    ids = draw(st.lists(st.integers(-2**63, 2**63 - 1) | st.integers(0, 20), min_size=n, max_size=n))
    t = draw(st.integers(1, 4))
    table = draw(st.lists(st.integers(0, t - 1), min_size=n, max_size=n))
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=5)))
    named = draw(st.booleans())
    names = tuple(f"feature {i}" for i in range(t)) if named else ()
    return Trace(np.array(ids, dtype=np.int64), np.array(table, dtype=np.int32),
                 np.array([0, *cuts, n], dtype=np.int64), names)


@given(trace_strategy())
@settings(max_examples=60)
def test_npz_round_trip(trace):
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "t.npz"
        save(trace, p)
        back = load(p)
    _eq(back, trace)


def test_save_writes_the_spec_keys(tmp_path):
    t = Trace(np.array([3, 4]), np.array([0, 1]), np.array([0, 2]), ("u", "i"))
    save(t, tmp_path / "t.npz")
    with np.load(tmp_path / "t.npz") as z:
        assert sorted(z.files) == ["batch_offsets", "ids", "table", "table_names"]
        assert z["ids"].dtype == np.int64 and z["table"].dtype == np.int32
        assert list(z["table_names"]) == ["u", "i"]
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary file left behind


@given(trace_strategy())
@settings(max_examples=60)
def test_dense_keys_number_rows_by_first_appearance(trace):
    keys, k = dense_keys(trace)
    ref: dict[tuple[int, int], int] = {}
    expect = [ref.setdefault((int(t), int(i)), len(ref)) for t, i in zip(trace.table, trace.ids)]
    assert keys.tolist() == expect and k == len(ref)


# --------------------------------------------------------------------------- Meta format


def _write_meta(path: Path, obj, gz: bool) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = gzip.compress(buf.getvalue()) if gz else buf.getvalue()
    path.write_bytes(data)


@pytest.mark.parametrize("gz, name", [(False, "t.pt"), (True, "t.pt.gz"), (True, "trace.bin")])
@pytest.mark.parametrize("batch_size, ids, table, off", [
    (None, [10, 20, 21, 30, 40, 50], [0, 0, 0, 1, 1, 1], [0, 6]),
    (3, [10, 20, 21, 30, 40, 50], [0, 0, 0, 1, 1, 1], [0, 6]),
    (2, [10, 30, 40, 20, 21, 50], [0, 1, 1, 0, 0, 1], [0, 3, 6]),
    (1, [10, 30, 40, 20, 21, 50], [0, 1, 1, 0, 0, 1], [0, 2, 3, 6]),
])
def test_meta_format_hand_made(tmp_path, gz, name, batch_size, ids, table, off):
    p = tmp_path / name
    _write_meta(p, META, gz)
    t = load(p, batch_size=batch_size)
    assert t.ids.tolist() == ids
    assert t.table.tolist() == table
    assert t.batch_offsets.tolist() == off
    assert t.table_names == ("table_0", "table_1")


def test_meta_offsets_without_trailing_end(tmp_path):
    ind, off, lens = META
    _write_meta(tmp_path / "t.pt", (ind.to(torch.int32), off[:-1], lens.to(torch.int32)), gz=False)
    assert load(tmp_path / "t.pt", batch_size=2).ids.tolist() == [10, 30, 40, 20, 21, 50]


@given(st.integers(1, 4), st.integers(1, 6), st.integers(1, 7), st.randoms(use_true_random=False))
@settings(max_examples=30)
def test_meta_batches_against_reference(t_n, b_n, s, rnd):
    """Every batch holds, table by table, the bags of its samples in sample order."""
    lens = [[rnd.randint(0, 3) for _ in range(b_n)] for _ in range(t_n)]
    bags = [[[rnd.randint(0, 99) for _ in range(lens[t][b])] for b in range(b_n)] for t in range(t_n)]
    flat = [i for t in range(t_n) for b in range(b_n) for i in bags[t][b]]
    offsets = np.concatenate([[0], np.cumsum([lens[t][b] for t in range(t_n) for b in range(b_n)])])
    obj = (torch.tensor(flat, dtype=torch.int64), torch.tensor(offsets), torch.tensor(lens))
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "t.pt"
        _write_meta(p, obj, gz=False)
        got = load(p, batch_size=s)
    ids, tab, off = [], [], [0]
    for start in range(0, b_n, s):
        for t in range(t_n):
            for b in range(start, min(b_n, start + s)):
                ids += bags[t][b]
                tab += [t] * len(bags[t][b])
        off.append(len(ids))
    assert got.ids.tolist() == ids and got.table.tolist() == tab and got.batch_offsets.tolist() == off


@pytest.mark.parametrize("obj, exc, match", [
    ((torch.tensor([1]), torch.tensor([0, 1])), CorruptStoreError, "should hold"),
    ({"indices": torch.tensor([1])}, CorruptStoreError, "should hold"),
    ((torch.tensor([1.0]), torch.tensor([0, 1]), torch.tensor([[1]])), InvalidInputError, "integer tensor"),
    ((torch.tensor([1]), torch.tensor([0, 1]), torch.tensor([1])), InvalidInputError, "shape"),
    ((torch.tensor([1, 2]), torch.tensor([0, 1, 2]), torch.tensor([[2, 0]])), InvalidInputError, "disagree"),
    ((torch.tensor([1, 2]), torch.tensor([0, 1, 2, 2]), torch.tensor([[1, 1]])), InvalidInputError, "needs 3"),
    ((torch.tensor([1, 2]), torch.tensor([0, 1, 3]), torch.tensor([[1, 2]])), InvalidInputError, "from 0 to"),
])
def test_meta_bad_contents(tmp_path, obj, exc, match):
    p = tmp_path / "bad.pt"
    _write_meta(p, obj, gz=False)
    with pytest.raises(exc, match=match) as info:
        load(p)
    assert str(p) in str(info.value)


def test_meta_corrupt_files(tmp_path):
    p = tmp_path / "junk.pt"
    p.write_bytes(b"definitely not a torch file")
    with pytest.raises(CorruptStoreError, match="junk.pt.*not a readable torch file"):
        load(p)
    good = tmp_path / "good.pt.gz"
    _write_meta(good, META, gz=True)
    cut = tmp_path / "cut.pt.gz"
    cut.write_bytes(good.read_bytes()[:40])
    with pytest.raises(CorruptStoreError, match=r"cut.pt.gz.*\(gzipped\)"):
        load(cut)


def test_meta_refuses_pickled_code(tmp_path):
    """torch.load runs with weights_only=True: a file carrying arbitrary objects is refused."""

    p = tmp_path / "evil.pt"
    torch.save((torch.tensor([1]), torch.tensor([0, 1]), Counter({"x": 1})), p)
    with pytest.raises(CorruptStoreError):
        load(p)


# --------------------------------------------------------------------------- CSV


def test_csv_with_table_indices(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("table,id\n0,5\n1,7\n0,5\n")
    t = load(p)
    assert t.ids.tolist() == [5, 7, 5] and t.table.tolist() == [0, 1, 0]
    assert t.batch_offsets.tolist() == [0, 3] and t.table_names == ("table_0", "table_1")


def test_csv_with_names_and_batches(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("table,id,batch\nitem,5,0\nuser,7,0\nitem, 9 ,3\nuser,-2,4\n")
    t = load(p)
    assert t.table_names == ("item", "user")
    assert t.table.tolist() == [0, 1, 0, 1] and t.ids.tolist() == [5, 7, 9, -2]
    assert t.batch_offsets.tolist() == [0, 2, 3, 4]


def test_csv_header_only_is_an_empty_trace(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("table,id\n")
    assert len(load(p)) == 0


@pytest.mark.parametrize("text, match", [
    ("tab,id\n0,1\n", "expected the CSV header"),
    ("table,id\n0,1\n0,x\n", "line 3: id 'x' is not an integer"),
    ("table,id,batch\n0,1,2\n0,1,1\n", "line 3: batch numbers must not decrease"),
    ("table,id\n0,1\n0,1,2\n", "malformed CSV"),
])
def test_csv_errors(tmp_path, text, match):
    p = tmp_path / "t.csv"
    p.write_text(text)
    with pytest.raises(InvalidInputError, match=match) as info:
        load(p)
    assert "t.csv" in str(info.value)


# --------------------------------------------------------------------------- npz and generic errors


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(InvalidInputError, match="nope.npz.*does not exist"):
        load(tmp_path / "nope.npz")
    with pytest.raises(InvalidInputError, match="is a directory"):
        load(tmp_path)


def test_corrupt_npz(tmp_path):
    p = tmp_path / "bad.npz"
    p.write_bytes(b"PK\x03\x04 truncated zip")
    with pytest.raises(CorruptStoreError, match="bad.npz"):
        load(p)
    q = tmp_path / "missing.npz"
    np.savez(q, ids=np.array([1]), table=np.array([0]))
    with pytest.raises(CorruptStoreError, match="lacks the array.*batch_offsets"):
        load(q)
    r = tmp_path / "text.npz"
    r.write_text("ids,table\n1,0\n")  # not a zip at all: said so, not numpy's advice to unpickle it
    with pytest.raises(CorruptStoreError, match="not an npz archive") as err:
        load(r)
    assert "pickle" not in str(err.value)


def test_npz_wrong_dtypes(tmp_path):
    p = tmp_path / "float.npz"
    np.savez(p, ids=np.array([1.5]), table=np.array([0]), batch_offsets=np.array([0, 1]))
    with pytest.raises(InvalidInputError, match="float.npz.*ids must be integers"):
        load(p)
    q = tmp_path / "names.npz"
    np.savez(q, ids=np.array([1]), table=np.array([0]), batch_offsets=np.array([0, 1]), table_names=np.array([1]))
    with pytest.raises(InvalidInputError, match="table_names must be a 1-D string array"):
        load(q)
    r = tmp_path / "bad_off.npz"
    np.savez(r, ids=np.array([1, 2]), table=np.array([0, 0]), batch_offsets=np.array([0, 1]))
    with pytest.raises(InvalidInputError, match="bad_off.npz.*end with len"):
        load(r)


def test_format_guess_and_batch_size_rules(tmp_path):
    t = Trace(np.array([1, 2]), np.array([0, 0]), np.array([0, 2]))
    odd = tmp_path / "trace.data"
    save(t, odd)  # an npz without the suffix: sniffed from its contents
    _eq(load(odd), t)
    with pytest.raises(InvalidInputError, match="Meta's torch format only"):
        load(odd, batch_size=4)
    with pytest.raises(InvalidInputError, match="unknown trace format"):
        load(odd, format="parquet")
    m = tmp_path / "m.pt"
    _write_meta(m, META, gz=False)
    with pytest.raises(InvalidInputError, match="positive number of samples"):
        load(m, batch_size=0)


# --------------------------------------------------------------------------- statistics


def _reference_stats(trace: Trace):
    """Per-batch Counter of (table, id) rows and brute-force reuse distances."""
    n_total = len(trace)
    u_sum, rows_pct, lookups = 0, np.zeros(len(REUSE_THRESHOLDS)), np.zeros(len(REUSE_THRESHOLDS))
    dedup = []
    for b in range(trace.num_batches):
        s, e = trace.batch_offsets[b], trace.batch_offsets[b + 1]
        rows = list(zip(trace.table[s:e].tolist(), trace.ids[s:e].tolist()))
        if not rows:
            continue
        c = Counter(rows)
        u_sum += len(c)
        for j, k in enumerate(REUSE_THRESHOLDS):
            rows_pct[j] += (e - s) / n_total * 100 * sum(v > k for v in c.values()) / len(c)
            lookups[j] += 100 * sum(v for v in c.values() if v > k) / n_total
        dedup += list(dict.fromkeys(rows))
    dist = []
    for i, r in enumerate(dedup):
        prev = [j for j in range(i) if dedup[j] == r]
        if prev:
            dist.append(len(set(dedup[prev[-1] + 1:i])))
    return u_sum / n_total, rows_pct, lookups, dist, len(dedup)


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 6)), min_size=1, max_size=60),
       st.lists(st.integers(0, 60), max_size=4))
@settings(max_examples=80)
def test_trace_stats_against_reference(pairs, cuts):
    n = len(pairs)
    off = np.array([0, *sorted(min(c, n) for c in cuts), n])
    t = Trace(np.array([p[1] for p in pairs]), np.array([p[0] for p in pairs]), off)
    s = trace_stats(t)
    ratio, rows_pct, lookups, dist, n_dedup = _reference_stats(t)
    assert s.accesses == n and s.batches == len(off) - 1
    assert s.unique_rows == len(set(pairs))
    assert s.unique_ratio == pytest.approx(ratio)
    assert s.dedup_factor == pytest.approx(1 / ratio)
    assert [b.threshold for b in s.reuse] == list(REUSE_THRESHOLDS)
    np.testing.assert_allclose([b.rows_pct for b in s.reuse], rows_pct, atol=1e-9)
    np.testing.assert_allclose([b.lookups_pct for b in s.reuse], lookups, atol=1e-9)
    rd = s.reuse_distance
    assert rd.reaccess_pct == pytest.approx(100 * len(dist) / n_dedup)
    if dist:
        assert (rd.p50, rd.p90, rd.p99) == pytest.approx(tuple(np.percentile(dist, [50, 90, 99])))
        assert rd.max == max(dist)


def test_trace_stats_reuse_histogram_by_hand():
    # one batch: row 7 x12 (reused > 1 and > 8), row 8 x2 (> 1), row 9 x1
    ids = np.array([7] * 12 + [8, 8, 9])
    s = trace_stats(Trace(ids, np.zeros(15, np.int32), np.array([0, 15])), reuse_distances=False)
    assert s.unique_ratio == pytest.approx(3 / 15) and s.dedup_factor == pytest.approx(5.0)
    by_k = {b.threshold: (b.rows_pct, b.lookups_pct) for b in s.reuse}
    assert by_k[1] == pytest.approx((200 / 3, 100 * 14 / 15))
    assert by_k[8] == pytest.approx((100 / 3, 100 * 12 / 15))
    assert by_k[32] == (0.0, 0.0)
    assert s.reuse_distance is None


def test_trace_stats_of_empty_trace():
    s = trace_stats(Trace(np.zeros(0, np.int64), np.zeros(0, np.int32), np.array([0])))
    assert s.accesses == 0 and s.unique_rows == 0
    # nothing was looked up: every ratio is undefined (NaN; null in --json), not a measured 0
    assert math.isnan(s.unique_ratio) and math.isnan(s.dedup_factor)
    assert all(math.isnan(b.rows_pct) and math.isnan(b.lookups_pct) for b in s.reuse)
    rd = s.reuse_distance
    assert math.isnan(rd.reaccess_pct) and math.isnan(rd.p50) and rd.max is None


# --------------------------------------------------------------------------- command line


def test_cli_gen_then_stats(tmp_path, capsys):
    out = tmp_path / "g.npz"
    assert cli_main(["trace", "gen", "--like", "dlrm2022", "--batches", "3", "--batch-size", "2048",
                     "--tables", "2", "--seed", "5", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert cli_main(["trace", "stats", str(out), "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    ref = trace_stats(load(out))
    assert rec["accesses"] == 3 * 2048 * 2 == ref.accesses
    assert rec["unique_ratio"] == pytest.approx(ref.unique_ratio)
    assert [b["lookups_pct"] for b in rec["reuse"]] == pytest.approx([b.lookups_pct for b in ref.reuse])
    assert cli_main(["trace", "stats", str(out)]) == 0
    text = capsys.readouterr().out
    assert "dedup" in text and "reused > k" in text and "p50" in text


def test_cli_stats_meta_with_batch_size(tmp_path, capsys):
    p = tmp_path / "m.pt.gz"
    _write_meta(p, META, gz=True)
    assert cli_main(["trace", "stats", str(p), "--batch-size", "2", "--json", "--no-reuse-distance"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["batches"] == 2 and rec["accesses"] == 6 and rec["reuse_distance"] is None


def test_cli_errors_are_one_line_exit_2(tmp_path, capsys):
    assert cli_main(["trace", "stats", str(tmp_path / "none.npz")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "does not exist" in err
    assert cli_main(["trace", "gen", "--out", str(tmp_path / "x.npz")]) == 2
    assert "--like" in capsys.readouterr().err
    assert cli_main(["trace", "gen", "--like", "dlrm2021", "--batch-size", "100",
                     "--out", str(tmp_path / "x.npz")]) == 2
    assert "batch_size * pooling > 1024" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli_main(["trace", "gen", "--zipf", "1", "--batches", "0", "--out", str(tmp_path / "x.npz")])
    assert info.value.code == 2


def test_csv_id_beyond_int64_names_its_line(tmp_path):
    """An id that Python reads as an integer but int64 cannot hold escaped as a bare StopIteration."""
    p = tmp_path / "t.csv"
    p.write_text("table,id\n0,1\n0,99999999999999999999\n")
    with pytest.raises(InvalidInputError, match="line 3: id '99999999999999999999' is not an integer in the int64"):
        load(p)


def test_csv_header_errors_are_said_once_and_a_byte_order_mark_is_no_column(tmp_path):
    """A wrong header read "malformed CSV: trace file ..: expected the CSV header", the file named twice;
    a spreadsheet's UTF-8 byte-order mark made the header '\\ufefftable,id'."""
    p = tmp_path / "t.csv"
    p.write_text("id,table\n1,0\n")
    with pytest.raises(InvalidInputError) as info:
        load(p)
    assert "malformed" not in str(info.value) and str(info.value).count("t.csv") == 1
    p.write_text("\ufefftable,id\n0,7\n1,8\n", encoding="utf-8")
    _eq(load(p), Trace(np.array([7, 8]), np.array([0, 1]), np.array([0, 2])))


def test_a_huge_table_index_without_names_is_refused_not_numbered(tmp_path):
    """One stray table index of 2**31 - 1 in a 4-access file made the loader name two billion tables
    (minutes, then MemoryError); Meta's lengths of shape (2**31, 0) did the same."""
    ids, off = np.arange(4), np.array([0, 4])
    big = traces.MAX_DEFAULT_TABLES
    assert Trace(ids, np.array([0, 0, 0, big - 1]), off).num_tables == big
    with pytest.raises(InvalidInputError, match="no table_names"):
        Trace(ids, np.array([0, 0, 0, 2**31 - 1]), off)
    assert Trace(ids, np.array([0, 0, 0, 2]), off, ("a", "b", "c")).num_tables == 3  # named: any count
    np.savez(tmp_path / "t.npz", ids=ids, table=np.array([0, 0, 0, 2**31 - 1], np.int32), batch_offsets=off)
    (tmp_path / "t.csv").write_text(f"table,id\n0,1\n{2**31 - 1},2\n")
    torch.save((torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                torch.zeros((2**31, 0), dtype=torch.long)), tmp_path / "t.pt")
    for name in ("t.npz", "t.csv", "t.pt"):
        with pytest.raises(InvalidInputError, match="no table_names"):
            load(tmp_path / name)


def test_cli_gen_checks_out_before_the_work_and_names_the_sub_verb(tmp_path, capsys):
    """--out naming a directory failed after generating, with the temp file's name in the message."""
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_text("")
    for out in (tmp_path / "d", tmp_path / "no" / "t.npz", tmp_path / "f" / "t.npz"):
        assert cli_main(["trace", "gen", "--zipf", "1", "--batches", "1", "--batch-size", "2",
                         "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("embstore trace gen: error: --out") and "\n" not in err and ".tmp" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "f"]


def test_module_exports():
    assert set(traces.__all__) <= set(dir(traces))


# --------------------------------------------------------------------------- recorder (a store's own trace)
def _rec_store(path: Path):
    import embstore
    from embstore.config import HashConfig, StoreConfig, TableConfig, TierConfig

    return embstore.create(path, StoreConfig((
        TableConfig("lru", 60, 4, tiers=(TierConfig("dram", 8 * 16, "lru"), TierConfig("mmap"))),
        TableConfig("full", 60, 4, tiers=(TierConfig("dram", 60 * 16), TierConfig("mmap"))),  # resident fast path
        TableConfig("mod", 60, 4, hash=HashConfig("mod"), tiers=(TierConfig("mmap"),)))))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["lru", "full", "mod"]), st.booleans(),
                          st.lists(st.integers(-5, 70), min_size=1, max_size=12)), max_size=8))
def test_recorder_records_each_calls_unique_physical_rows_and_skips_refused_calls(calls):
    """One batch per call that reaches the tiers: its distinct physical rows in first-appearance order
    (hashed ids after the hash); a call refused for bad ids records nothing; the file loads back."""
    import embstore
    from embstore.recorder import record

    with tempfile.TemporaryDirectory() as d:
        with _rec_store(Path(d) / "s") as store, record(store, Path(d) / "t.npz"):
            want = []
            for name, pooled, ids in calls:
                arr = np.array(ids, np.int64)
                try:
                    if pooled:
                        store[name].lookup_pooled(arr, np.array([0, len(arr)], np.int64))
                    else:
                        store[name].lookup(arr)
                except embstore.IdOutOfRangeError:
                    assert name != "mod" and (arr.min() < 0 or arr.max() >= 60)
                    continue
                rows = store[name].mapper(arr) if name == "mod" else arr
                want.append((list(store.tables).index(name), list(dict.fromkeys(rows.tolist()))))
        got = load(Path(d) / "t.npz")
    assert got.table_names == ("lru", "full", "mod") and got.num_batches == len(want)
    for b, (t, rows) in enumerate(want):
        lo, hi = got.batch_offsets[b], got.batch_offsets[b + 1]
        assert got.ids[lo:hi].tolist() == rows and set(got.table[lo:hi].tolist()) <= {t}


@pytest.mark.parametrize("lookahead", [0, 2])
def test_recorder_records_training_batches_too(tmp_path, lookahead):
    """Training reads rows through the working set, not lookup(): each batch still becomes one trace batch
    per table, holding its distinct physical rows (hashed for 'mod'), prefetched or not."""
    import torch

    from embstore.recorder import record
    from embstore.training import TieredEmbeddingBagCollection

    rng = np.random.default_rng(3)
    batches = [([torch.from_numpy(rng.integers(0, 60, 9)), torch.from_numpy(rng.integers(0, 10**9, 9))],
                [torch.tensor([0, 4, 9])] * 2) for _ in range(4)]
    with _rec_store(tmp_path / "s") as store, record(store, tmp_path / "t.npz"):
        ebc = TieredEmbeddingBagCollection(store, ["lru", "mod"], optimizer="sgd", lr=0.1, lookahead=lookahead)
        for ids, offs in ebc.pipeline(batches):
            ebc(ids, offs).sum().backward()
        ebc.flush()
        want = [(t, set((store["mod"].mapper(x.numpy()) if t == 2 else x.numpy()).tolist()))
                for ids, _ in batches for t, x in zip((0, 2), ids)]
    got = load(tmp_path / "t.npz")
    assert got.num_batches == len(want)
    for b, (t, rows) in enumerate(want):
        lo, hi = got.batch_offsets[b], got.batch_offsets[b + 1]
        assert set(got.table[lo:hi].tolist()) == {t} and set(got.ids[lo:hi].tolist()) == rows and hi - lo == len(rows)


def test_recorder_refuses_a_path_it_could_not_save_to_before_recording(tmp_path):
    import embstore
    from embstore.recorder import record

    with _rec_store(tmp_path / "s") as store:
        for bad in (tmp_path / "no" / "t.npz", tmp_path):
            with pytest.raises(embstore.InvalidInputError, match="not a file in an existing directory"):
                with record(store, bad):
                    pass
            assert all(t.recorder is None for t in store.tables.values())


def test_recorded_trace_saves_loads_and_replays(tmp_path, capsys):
    from embstore.recorder import record

    with _rec_store(tmp_path / "s") as store:
        with record(store, tmp_path / "t.npz") as rec:
            store["lru"].lookup(np.array([5, 3, 5, 7]))
            store["mod"].lookup_pooled(np.array([10**12, 3, 3]), np.array([0, 1, 3]))
            store["full"].lookup(np.array([1, 2]))
        store["lru"].lookup(np.array([9]))  # after the block: not recorded
        assert all(t.recorder is None for t in store.tables.values())
    got = load(tmp_path / "t.npz")
    _eq(got, rec.trace())
    assert got.num_batches == 3 and got.ids[:3].tolist() == [5, 3, 7]
    assert cli_main(["replay", str(tmp_path / "t.npz"), "--json", "--policy", "lru", "--capacity", "4"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line)["accesses"] == got.ids.size


def test_nested_recorders_both_see_every_read(tmp_path):
    """A recording inside another's block used to detach the outer one for good: it missed every later read."""
    from embstore.recorder import record

    with _rec_store(tmp_path / "s") as store:
        t = store["lru"]
        with record(store) as outer:
            t.lookup(np.array([1]))
            with record(store) as inner:
                t.lookup(np.array([2]))
            t.lookup(np.array([3]))
        assert outer.trace().ids.tolist() == [1, 2, 3] and inner.trace().ids.tolist() == [2]
        assert t.recorder is None
        # detached out of order: the outer one stops at once, the inner one goes on, then recording is off
        a = record(store)
        outer = a.__enter__()
        b = record(store)
        inner = b.__enter__()
        t.lookup(np.array([4]))
        a.__exit__(None, None, None)
        t.lookup(np.array([5]))
        b.__exit__(None, None, None)
        t.lookup(np.array([6]))
        assert outer.trace().ids.tolist() == [4] and inner.trace().ids.tolist() == [4, 5]
        assert all(x.recorder is None for x in store.tables.values())


def test_recorder_across_threads_keeps_every_call_whole(tmp_path):
    import threading

    from embstore.recorder import record

    with _rec_store(tmp_path / "s") as store, record(store) as rec:
        def work(k: int) -> None:
            rng = np.random.default_rng(k)
            for i in range(100):
                store[("lru", "full", "mod")[(k + i) % 3]].lookup(rng.integers(0, 60, rng.integers(1, 20)))
        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    got = rec.trace()
    assert got.num_batches == 400
    for b in range(got.num_batches):
        lo, hi = got.batch_offsets[b], got.batch_offsets[b + 1]
        assert len(set(got.table[lo:hi].tolist())) == 1 and len(set(got.ids[lo:hi].tolist())) == hi - lo
