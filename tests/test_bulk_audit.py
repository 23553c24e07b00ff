"""Audit of bulk import/export (embstore/bulk.py, the import/export verbs, Table.write_physical and
read_physical) against a numpy model of the table, over every row format and several tier stacks."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import embstore
from embstore import bulk
from embstore.bulk import export_rows, import_rows
from embstore.cli import main
from embstore.config import HashConfig, InitConfig, StoreConfig, TableConfig, TierConfig
from embstore.errors import EmbstoreError, InvalidInputError, InvalidRowsError
from embstore.rows import RowFormat, initial_rows
from faultfs import needs_mount

DIM = 6
NUM = 160
FORMATS = ("float32", "float16", "int8")
STACKS = ("dram_whole_mmap", "dram_ssd", "dram_ssd_log", "dram_rocksdb", "mmap", "two_caches_ssd",
          "mmap_cache_ssd")
SETTINGS = settings(deadline=None, max_examples=150, suppress_health_check=list(HealthCheck))


def row_bytes(fmt: str) -> int:
    return RowFormat(DIM, fmt).row_bytes


def tiers(stack: str, fmt: str, cache_rows: int = 8) -> tuple[TierConfig, ...]:
    rb = row_bytes(fmt)
    if stack == "mmap":
        return (TierConfig("mmap"),)
    if stack == "dram_whole_mmap":
        return (TierConfig("dram", NUM * rb, "lru"), TierConfig("mmap"))
    if stack == "two_caches_ssd":
        return (TierConfig("dram", cache_rows * rb, "lru+tinylfu"), TierConfig("dram", 3 * cache_rows * rb, "clock"),
                TierConfig("ssd"))
    if stack == "mmap_cache_ssd":
        return (TierConfig("dram", cache_rows * rb, "lfu"), TierConfig("mmap", 3 * cache_rows * rb, "lru"),
                TierConfig("ssd", layout="log"))
    home = {"dram_ssd": TierConfig("ssd"), "dram_ssd_log": TierConfig("ssd", layout="log"),
            "dram_rocksdb": TierConfig("rocksdb")}[stack]
    return (TierConfig("dram", cache_rows * rb, "lru"), home)


def table_config(stack: str, fmt: str, seed: int = 3, **kw) -> TableConfig:
    return TableConfig(name="t", num_embeddings=NUM, dim=DIM, dtype=fmt,
                       init=InitConfig("uniform", 0.5, seed), tiers=tiers(stack, fmt), **kw)


def initial(cfg: TableConfig, ids: np.ndarray) -> np.ndarray:
    fmt = RowFormat(DIM, cfg.dtype)
    return fmt.decode(fmt.encode(initial_rows(cfg.init, ids, DIM)))


def check_rows(fmt: str, got: np.ndarray, want: np.ndarray) -> None:
    """``got`` (read back) against ``want`` (written, float32) within the format's documented bound."""
    assert got.dtype == np.float32 and got.shape == want.shape
    if fmt == "float32":
        np.testing.assert_array_equal(got, want)
    elif fmt == "float16":
        np.testing.assert_array_equal(got, want.astype(np.float16).astype(np.float32))
    else:
        if not len(want):
            return
        spread = (want.max(axis=1) - want.min(axis=1))[:, None].astype(np.float64)
        bound = spread / 510 + 1e-6 * (np.abs(want).max(axis=1)[:, None] + spread) + 1e-30
        assert (np.abs(got.astype(np.float64) - want) <= bound).all(), np.abs(got - want).max()


class Model:
    """float32 rows as the table should hold them; ``exact`` marks rows whose stored value is known bit
    for bit (never written: the initial value through the format)."""

    def __init__(self, cfg: TableConfig) -> None:
        self.cfg = cfg
        self.rows = initial(cfg, np.arange(NUM, dtype=np.int64))
        self.written = np.zeros(NUM, bool)

    def write(self, start: int, data: np.ndarray) -> None:
        self.rows[start:start + len(data)] = np.asarray(data, np.float32)
        self.written[start:start + len(data)] = True

    def check(self, got: np.ndarray) -> None:
        n = len(got)
        fresh = ~self.written[:n]
        np.testing.assert_array_equal(got[fresh], self.rows[:n][fresh])
        w = self.written[:n]
        check_rows(self.cfg.dtype.value, got[w], self.rows[:n][w])


@st.composite
def npy_inputs(draw, max_rows: int = NUM):
    n = draw(st.sampled_from([0, 1, 2, 7, 33, max_rows]))
    start = draw(st.integers(0, NUM - n))
    if draw(st.booleans()):
        start = NUM - n  # at the end
    dtype = np.dtype(draw(st.sampled_from(["<f4", "<f8", "<f2", ">f4", ">f8", "longdouble"])))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    scale = draw(st.sampled_from([1e-3, 1.0, 300.0, 6e4, 1e-41, 1e37]))
    if dtype.itemsize == 2:
        scale = min(scale, 1e4)  # float16 inputs: within their own range
    data = rng.standard_normal((n, DIM)) * scale
    if draw(st.booleans()) and n:
        data[rng.integers(0, n)] = rng.standard_normal() * scale  # a constant row (int8: zero spread)
    data = data.astype(dtype)
    order = draw(st.sampled_from(["C", "F"]))
    data = np.asarray(data, order=order)
    mmapped = draw(st.booleans())
    return start, data, mmapped


def save(path: Path, data: np.ndarray, mmapped: bool) -> Path:
    if mmapped:
        m = np.lib.format.open_memmap(path, mode="w+", dtype=data.dtype, shape=data.shape,
                                      fortran_order=data.flags.f_contiguous and not data.flags.c_contiguous)
        m[...] = data
        m.flush()
        del m
    else:
        np.save(path, data)
    return path


def cli(*args) -> int:
    return main([str(a) for a in args])


def export_via_cli(store: Path, out: Path, rows: int | None = None) -> np.ndarray:
    extra = [] if rows is None else ["--rows", rows]
    assert cli("export", store, "t", out, *extra) == 0
    got = np.load(out)
    os.unlink(out)
    return got


@SETTINGS
@given(stack=st.sampled_from(STACKS), fmt=st.sampled_from(FORMATS), imports=st.lists(npy_inputs(), min_size=1,
       max_size=3), rows=st.integers(0, NUM), chunk=st.sampled_from([1, 7, 64, 1 << 16]))
def test_import_export_against_a_model(stack, fmt, imports, rows, chunk):
    imports = [(start, np.clip(data, -60000, 60000) if fmt == "float16" else data, m)
               for start, data, m in imports]  # float16 tables refuse |x| >= 65520 (tested below)
    d = Path(tempfile.mkdtemp(prefix="bulk_audit_"))
    old_chunk = bulk.CHUNK_ROWS
    bulk.CHUNK_ROWS = chunk  # several chunks per import and export
    try:
        cfg = table_config(stack, fmt)
        embstore.create(d / "s", StoreConfig((cfg,))).close()
        model = Model(cfg)
        for i, (start, data, mmapped) in enumerate(imports):
            f = save(d / f"in{i}.npy", data, mmapped)
            assert cli("import", d / "s", "t", f, "--start", start) == 0
            model.write(start, data)
        whole = export_via_cli(d / "s", d / "out.npy")
        assert whole.shape == (NUM, DIM)
        model.check(whole)
        part = export_via_cli(d / "s", d / "out.npy", rows)
        assert part.shape == (rows, DIM)
        np.testing.assert_array_equal(part, whole[:rows])
        with embstore.open(d / "s") as s:  # exported == lookup of the same ids, bit for bit
            ids = np.arange(NUM, dtype=np.int64)
            np.testing.assert_array_equal(s["t"].lookup(ids), whole)
            np.testing.assert_array_equal(s["t"].read_physical(ids[::-1].copy()), whole[::-1])
            np.testing.assert_array_equal(s["t"].read_physical(np.zeros(3, np.int64)), whole[[0, 0, 0]])
    finally:
        bulk.CHUNK_ROWS = old_chunk
        shutil.rmtree(d, ignore_errors=True)


@SETTINGS
@given(stack=st.sampled_from([s for s in STACKS if s != "mmap"]), fmt=st.sampled_from(FORMATS),
       inp=npy_inputs(max_rows=40), dirty=st.lists(st.integers(0, NUM - 1), min_size=1, max_size=20, unique=True))
def test_import_over_dirty_cached_rows_then_reopen(stack, fmt, inp, dirty):
    start, data, mmapped = inp
    if fmt == "float16":
        data = np.clip(data, -60000, 60000)
    d = Path(tempfile.mkdtemp(prefix="bulk_audit_"))
    try:
        cfg = table_config(stack, fmt)
        model = Model(cfg)
        with embstore.create(d / "s", StoreConfig((cfg,))) as s:
            t = s["t"]
            ids = np.array(dirty, np.int64)
            vals = np.random.default_rng(len(dirty)).uniform(-2, 2, (len(ids), DIM)).astype(np.float32)
            t.update(ids, vals)  # dirty in the small cache
            for i, r in zip(ids, vals):
                model.write(int(i), r[None])
            f = save(d / "in.npy", data, mmapped)
            assert import_rows(t, f, start=start) == len(data)
            model.write(start, data)
            export_rows(t, d / "a.npy")
            a = np.load(d / "a.npy")
            model.check(a)
            np.testing.assert_array_equal(t.lookup(np.arange(NUM, dtype=np.int64)), a)
        with embstore.open(d / "s") as s:
            export_rows(s["t"], d / "b.npy")
        np.testing.assert_array_equal(np.load(d / "b.npy"), a)
    finally:
        shutil.rmtree(d, ignore_errors=True)


# --- boundaries: a typed error, a clear message, nothing written, no stray file ------------------------

@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One store per stack (float16 to also check its range), with some rows imported."""
    base = tmp_path_factory.mktemp("bulk_bounds")
    out = {}
    for stack in ("dram_ssd", "mmap", "dram_rocksdb"):
        cfg = table_config(stack, "float16")
        with embstore.create(base / stack, StoreConfig((cfg,))) as s:
            s["t"].write_physical(np.arange(10, 20, dtype=np.int64), np.full((10, DIM), 1.5, np.float32))
        out[stack] = base / stack
    return out


def snapshot(store: Path) -> np.ndarray:
    with embstore.open(store) as s:
        return s["t"].read_physical(np.arange(NUM, dtype=np.int64))


def bad_files(d: Path) -> dict[str, tuple[Path, str]]:
    rng = np.random.default_rng(0)
    ok = rng.standard_normal((5, DIM)).astype(np.float32)
    files = {}

    def put(name, arr, needle):
        np.save(d / name, arr)
        files[name] = (d / name, needle)

    put("wrongdim.npy", ok[:, :DIM - 1], f"expected shape (n, {DIM})")
    put("one_d.npy", ok[0], f"expected shape (n, {DIM})")
    put("three_d.npy", ok[None], f"expected shape (n, {DIM})")
    put("zero_d.npy", np.float32(1.0), f"expected shape (n, {DIM})")
    put("ints.npy", np.ones((5, DIM), np.int64), "floating-point")
    put("bools.npy", np.ones((5, DIM), bool), "floating-point")
    put("complex.npy", np.ones((5, DIM), np.complex64), "floating-point")
    nan = ok.copy()
    nan[3, 2] = np.nan
    put("nan.npy", nan, "row 3")
    inf = ok.copy()
    inf[4, 0] = -np.inf
    put("inf.npy", inf, "row 4")
    big = ok.astype(np.float64)
    big[2, 1] = 1e300
    put("f64_overflow.npy", big, "row 2")
    f16 = ok.copy()
    f16[1, 1] = 70000.0
    put("f16_range.npy", f16, "row 1")
    put("past_end.npy", ok, "do not fit")  # imported with --start NUM - 2
    obj = np.empty((5, DIM), object)
    obj[...] = 1.0
    np.save(d / "object.npy", obj, allow_pickle=True)
    files["object.npy"] = (d / "object.npy", "not a readable .npy")
    good = d / "good.npy"
    np.save(good, ok)
    gb = good.read_bytes()
    (d / "trunc_header.npy").write_bytes(gb[:40])
    files["trunc_header.npy"] = (d / "trunc_header.npy", "not a readable .npy")
    (d / "trunc_data.npy").write_bytes(gb[:-5])
    files["trunc_data.npy"] = (d / "trunc_data.npy", "not a readable .npy")
    (d / "dir.npy").mkdir()
    files["dir.npy"] = (d / "dir.npy", "directory")
    os.mkfifo(d / "fifo.npy")
    files["fifo.npy"] = (d / "fifo.npy", "FIFO")
    return files


@pytest.mark.parametrize("stack", ["dram_ssd", "mmap", "dram_rocksdb"])
def test_bad_imports_are_typed_and_write_nothing(shared, stack, tmp_path, capsys):
    store = shared[stack]
    before = snapshot(store)
    files = bad_files(tmp_path)
    for name, (path, needle) in files.items():
        start = NUM - 2 if name == "past_end.npy" else 0
        assert cli("import", store, "t", path, "--start", start) == 2, name
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err and err.count("\n") == 1, (name, err)
        with embstore.open(store) as s:  # the API raises a typed error too
            with pytest.raises((InvalidInputError, InvalidRowsError)) as ei:
                import_rows(s["t"], path, start=start)
            assert isinstance(ei.value, (ValueError, EmbstoreError)), name
        np.testing.assert_array_equal(snapshot(store), before, err_msg=name)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*files, "good.npy"])


def test_export_targets_and_rows(shared, tmp_path, capsys):
    store = shared["dram_ssd"]
    before = snapshot(store)
    for target in (store / "manifest.json", store / "sub.npy", store / "tables" / "t" / "x.npy"):
        existed = target.exists()
        assert cli("export", store, "t", target) == 2
        assert "inside the store" in capsys.readouterr().err
        assert target.exists() == existed
    link = tmp_path / "link.npy"  # a symlink out of the store pointing into it
    os.symlink(store / "manifest.json", link)
    assert cli("export", store, "t", link) == 2
    assert "inside the store" in capsys.readouterr().err
    assert cli("export", store, "t", tmp_path / "x.npy", "--rows", NUM + 1) == 2
    assert f"[0, {NUM}]" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ei:  # argparse's own refusal
        cli("export", store, "t", tmp_path / "x.npy", "--rows", -1)
    assert ei.value.code == 2 and "expected an integer >= 0" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.npy"]
    assert cli("export", store, "t", tmp_path / "zero.npy", "--rows", 0) == 0
    assert np.load(tmp_path / "zero.npy").shape == (0, DIM)
    np.testing.assert_array_equal(snapshot(store), before)


def test_hashed_table_exports_its_physical_rows(tmp_path):
    """README: import/export move physical rows (after hashing); a mod-hashed table has num_embeddings
    buckets, and the export of a QR table is its quotient rows then remainder rows."""
    for kind in ("mod", "qr"):
        cfg = TableConfig(name="t", num_embeddings=NUM, dim=DIM, hash=HashConfig(kind),
                          init=InitConfig("uniform", 0.5, 1), tiers=(TierConfig("mmap"),))
        with embstore.create(tmp_path / kind, StoreConfig((cfg,))) as s:
            t = s["t"]
            n = t.num_rows
            data = np.random.default_rng(1).standard_normal((n, DIM)).astype(np.float32)
            np.save(tmp_path / f"{kind}.npy", data)
            assert import_rows(t, tmp_path / f"{kind}.npy") == n
            assert export_rows(t, tmp_path / f"{kind}_out.npy") == n
            np.testing.assert_array_equal(np.load(tmp_path / f"{kind}_out.npy"), data)
            raw = np.array([5, 10**12, -7], np.int64)
            phys = t.physical_rows(raw)
            got = t.lookup(raw)
            if kind == "mod":
                np.testing.assert_array_equal(got, data[phys])
            else:
                assert phys.shape == (3, 2)


def test_create_from_toml_then_import_export(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text(f"""
[[table]]
name = "t"
num_embeddings = {NUM}
dim = {DIM}
dtype = "int8"
init = {{ kind = "normal", scale = 0.1, seed = 9 }}
tiers = [{{ kind = "dram", capacity = "{8 * row_bytes('int8')}", policy = "lru+tinylfu" }}, {{ kind = "ssd" }}]
""")
    assert cli("create", tmp_path / "s", "--config", toml) == 0
    data = np.random.default_rng(2).standard_normal((50, DIM))
    np.save(tmp_path / "in.npy", data)
    assert cli("import", tmp_path / "s", "t", tmp_path / "in.npy", "--start", NUM - 50) == 0
    got = export_via_cli(tmp_path / "s", tmp_path / "o.npy")
    with embstore.open(tmp_path / "s") as s:
        model = Model(s["t"].config)
    model.write(NUM - 50, data)
    model.check(got)


@needs_mount
@pytest.mark.parametrize("layout", ["in_place", "log", "rocksdb"])
def test_import_into_a_full_disk_is_typed_and_the_table_reads_as_before(tiny_tmpfs, tmp_path, capsys, layout):
    big, dim = 200_000, 4  # four 65,536-row chunks; a 3.2 MB sparse slab on a 4 MiB tmpfs with ~1.5 MB free
    cfg = TableConfig(name="t", num_embeddings=big, dim=dim, init=InitConfig("uniform", 0.5, 4),
                      tiers=(TierConfig("dram", 64 * dim * 4, "lru"), TierConfig("rocksdb") if layout == "rocksdb" else TierConfig("ssd", layout=layout)))
    store = tiny_tmpfs.path / "s"
    embstore.create(store, StoreConfig((cfg,))).close()
    ids = np.arange(big, dtype=np.int64)
    with embstore.open(store) as s:
        before = s["t"].read_physical(ids)
    np.save(tmp_path / "rows.npy", np.ones((big, dim), np.float32))
    filler = tiny_tmpfs.path / "filler"
    free = shutil.disk_usage(tiny_tmpfs.path).free
    filler.write_bytes(b"\0" * max(0, free - (1536 << 10)))
    rc = cli("import", store, "t", tmp_path / "rows.npy")
    err = capsys.readouterr().err
    assert rc == 1 and "No space left on device" in err and "Traceback" not in err, err
    filler.unlink()
    with embstore.open(store) as s:
        after = s["t"].read_physical(ids)
    changed = (after != before).any(axis=1)
    assert not changed.any(), f"a failed import left {changed.sum()} of {big} rows imported"


@pytest.mark.parametrize("shape", [(2**64, DIM), (2**31, 2**31), (2**70, 0)])
def test_a_header_declaring_an_impossible_shape_is_one_line_exit_2(shared, tmp_path, capsys, recwarn, shape):
    """A .npy header whose shape overflows a C long (2**64 rows) escaped open_npy as an OverflowError:
    import (and hash fit) died with a traceback and exit 1; a product past 2**63 also printed numpy's
    overflow RuntimeWarning lines before the error."""
    import io
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": "<f4", "fortran_order": False, "shape": shape})
    path = tmp_path / "huge.npy"
    path.write_bytes(head.getvalue() + bytes(96))
    before = snapshot(shared["mmap"])
    assert cli("import", shared["mmap"], "t", path) == 2
    err = capsys.readouterr().err
    assert "not a readable .npy array" in err and err.count("\n") == 1, err
    assert cli("hash", "fit", path, "--buckets", 10, "--out", tmp_path / "h") == 2
    err = capsys.readouterr().err
    assert "not a readable .npy array" in err and "Traceback" not in err, err
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in recwarn]
    np.testing.assert_array_equal(snapshot(shared["mmap"]), before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["huge.npy"]
