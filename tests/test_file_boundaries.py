"""Bad files at embstore's boundaries: every file a verb reads, damaged every way we could think of.

The promise (README "Errors"): a corrupt, truncated, empty, wrong-typed, wrong-shaped, NaN-holding or
missing file is a typed exception from the Python API, and from the CLI exit status 2 with one line that
names the file; never a traceback, a huge allocation from a declared size, code run from a pickle, or
a silently different result. Commands that fail leave no half-written output.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import struct
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import embstore
from embstore import costmodel, traces
from embstore.cli import main
from embstore.bulk import import_rows
from embstore.config import StoreConfig
from embstore.errors import ConfigError, CorruptStoreError, EmbstoreError, InvalidInputError
from embstore.hashing._format import read_arrays, write_arrays
from faultfs import needs_mount
from test_cli import CONFIG, store_path  # noqa: F401 (a fixture)

TRACE = traces.Trace(np.array([7, 3, 3, 9, 7, 1], np.int64), np.array([0, 0, 1, 1, 0, 1], np.int32),
                     np.array([0, 4, 6], np.int64), ("user", "item"))


def cli_fails(capsys, argv: list[str], names: str | Path) -> str:
    """Run the CLI in-process: exit 2 and one line on stderr that names ``names`` (an exception escaping
    ``main`` would be the traceback a user sees, and fails the test by itself)."""
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("embstore "), err
    assert str(names) in err, err
    return err


def same_trace(a: traces.Trace, b: traces.Trace) -> bool:
    return (np.array_equal(a.ids, b.ids) and np.array_equal(a.table, b.table)
            and np.array_equal(a.batch_offsets, b.batch_offsets) and a.table_names == b.table_names)


def damaged(data: st.DataObject, raw: bytes, flip_within: int | None = None) -> bytes:
    """``raw`` cut short, or with one bit flipped (within its first ``flip_within`` bytes), as drawn."""
    out = bytearray(raw)
    if data.draw(st.booleans(), label="truncate"):
        return bytes(out[:data.draw(st.integers(0, len(out) - 1), label="length")])
    pos = data.draw(st.integers(0, (flip_within or len(out)) - 1), label="byte")
    out[pos] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    return bytes(out)


class Pwn:
    """A pickle that touches a file when unpickled: proof that a loader ran code from a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _npz_with_members(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def _npy(arr: np.ndarray, **kw) -> bytes:
    bio = io.BytesIO()
    np.save(bio, arr, **kw)
    return bio.getvalue()


# --------------------------------------------------------------------------- npz traces
@pytest.fixture(scope="module")
def npz_bytes(tmp_path_factory) -> bytes:
    p = tmp_path_factory.mktemp("npz") / "t.npz"
    traces.save(TRACE, p)
    return p.read_bytes()


@settings(max_examples=60)
@given(data=st.data())
def test_npz_trace_truncated_or_bit_flipped_is_the_same_trace_or_a_typed_error(npz_bytes, tmp_path_factory, data):
    """Zip's CRC-32 covers the arrays, so a damaged byte is either harmless (a timestamp, padding) or an
    error: never a different trace. A flipped compression method was a NotImplementedError."""
    raw = damaged(data, npz_bytes)
    p = tmp_path_factory.mktemp("bad") / "t.npz"
    p.write_bytes(raw)
    try:
        back = traces.load(p)
    except (CorruptStoreError, InvalidInputError) as exc:
        assert str(p) in str(exc)
    else:
        assert same_trace(back, TRACE)


def _zip_method_flipped(npz: bytes) -> bytes:
    """The compression method of every entry (local headers and central directory) set to 99."""
    raw = bytearray(npz)
    for sig, at in ((b"PK\x03\x04", 8), (b"PK\x01\x02", 10)):
        i = raw.find(sig)
        while i >= 0:
            raw[i + at:i + at + 2] = struct.pack("<H", 99)
            i = raw.find(sig, i + 4)
    return bytes(raw)


def test_npz_with_an_unknown_compression_method_is_a_corrupt_file(npz_bytes, tmp_path, capsys):
    """Regression: zipfile raises NotImplementedError for it, which escaped as a traceback."""
    p = tmp_path / "t.npz"
    p.write_bytes(_zip_method_flipped(npz_bytes))
    with pytest.raises(CorruptStoreError, match="not a readable npz trace"):
        traces.load(p)
    cli_fails(capsys, ["trace", "stats", p], p)


def _central_entry(raw: bytearray, name: bytes) -> int:
    """Offset of ``name``'s entry in the zip's central directory."""
    i = raw.find(b"PK\x01\x02")
    while raw[i + 46:i + 46 + len(name)] != name:
        i = raw.find(b"PK\x01\x02", i + 4)
    return i


@pytest.mark.parametrize("damage", ["encrypted flag", "comment length", "member name"])
def test_npz_with_a_damaged_zip_directory_is_corrupt_not_different(npz_bytes, tmp_path, capsys, damage):
    """Regressions found by flipping every bit of a saved trace: the 'encrypted' flag was a RuntimeError
    (a traceback); a comment length that swallowed the next directory entry, or a renamed table_names
    entry, silently gave the trace default table names."""
    raw = bytearray(npz_bytes)
    if damage == "encrypted flag":
        raw[_central_entry(raw, b"ids.npy") + 8] |= 1
    elif damage == "comment length":
        raw[_central_entry(raw, b"batch_offsets.npy") + 33] |= 1
    else:
        i = _central_entry(raw, b"table_names.npy") + 46
        raw[i:i + 15] = b"table_names.npz"
    p = tmp_path / "t.npz"
    p.write_bytes(raw)
    with pytest.raises(CorruptStoreError):
        traces.load(p)
    cli_fails(capsys, ["trace", "stats", p], p)


def test_npz_whose_header_declares_a_huge_array_is_refused_before_allocating(tmp_path, capsys):
    """Regression: numpy allocates a zip member's declared shape before reading it, so 16 bytes claiming
    10**12 ids were a 7 TiB MemoryError (exit 1, 'out of memory') instead of a corrupt file."""
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": "<i8", "fortran_order": False, "shape": (10**12,)})
    p = _npz_with_members(tmp_path / "t.npz", {"ids.npy": head.getvalue() + bytes(16),
                                               "table.npy": _npy(np.zeros(2, np.int32)),
                                               "batch_offsets.npy": _npy(np.array([0, 2]))})
    with pytest.raises(CorruptStoreError, match=r"declares shape \(1000000000000,\)"):
        traces.load(p)
    cli_fails(capsys, ["trace", "stats", p], p)
    cli_fails(capsys, ["replay", p, "--capacity", "1"], p)


def test_npz_with_a_pickled_object_array_is_refused_without_unpickling(tmp_path, capsys):
    marker = tmp_path / "pwned"
    obj = np.array([Pwn(marker), 1], dtype=object)
    p = _npz_with_members(tmp_path / "t.npz", {"ids.npy": _npy(obj, allow_pickle=True),
                                               "table.npy": _npy(np.zeros(2, np.int32)),
                                               "batch_offsets.npy": _npy(np.array([0, 2]))})
    with pytest.raises(CorruptStoreError, match="Object arrays"):
        traces.load(p)
    cli_fails(capsys, ["trace", "stats", p], p)
    assert not marker.exists()


@pytest.mark.parametrize("arrays, says", [
    (dict(ids=np.array([1.0, 2.0])), "ids must be integers"),
    (dict(ids=np.array([True, False])), "ids must be integers"),
    (dict(ids=np.zeros((1, 2), np.int64)), "1-D"),
    (dict(ids=np.array([2**64 - 1, 0], np.uint64)), "outside the int64 range"),
    (dict(table=np.array([-1, 0], np.int32)), "table indices must be >= 0"),
    (dict(table=np.array([5, 0], np.int32), table_names=np.array(["a", "b"])), "out of range for 2 table names"),
    (dict(batch_offsets=np.array([0, 3])), "must end with len(ids) = 2"),
    (dict(batch_offsets=np.array([1, 2])), "must start at 0"),
    (dict(batch_offsets=np.array([0, 2, 1, 2])), "non-decreasing"),
    (dict(batch_offsets=np.zeros(0, np.int64)), "must start at 0"),
    (dict(table_names=np.array([b"a"])), "1-D string array"),
    (dict(table_names=np.array(["a", "a"])), "unique"),
    (dict(table_names=np.array([""])), "non-empty"),
])
def test_npz_with_wrong_contents_is_an_invalid_input_naming_the_file(tmp_path, capsys, arrays, says):
    base = dict(ids=np.array([1, 2], np.int64), table=np.zeros(2, np.int32), batch_offsets=np.array([0, 2]))
    p = tmp_path / "t.npz"
    np.savez(p, **{**base, **arrays})
    with pytest.raises(InvalidInputError, match=None) as e:
        traces.load(p)
    assert says in str(e.value) and str(p) in str(e.value)
    cli_fails(capsys, ["trace", "stats", p], p)


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04", b"not a zip", b"\x93NUMPY"])
def test_empty_or_foreign_npz_is_a_corrupt_file(tmp_path, capsys, content):
    p = tmp_path / "t.npz"
    p.write_bytes(content)
    with pytest.raises(CorruptStoreError):
        traces.load(p)
    cli_fails(capsys, ["trace", "stats", p], p)


# --------------------------------------------------------------------------- Meta's torch format
META = (torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 3, 3, 4]), torch.tensor([[1, 2], [0, 1]]))


@pytest.fixture(scope="module")
def meta_bytes(tmp_path_factory) -> bytes:
    p = tmp_path_factory.mktemp("meta") / "t.pt"
    torch.save(META, p)
    return p.read_bytes()


@settings(max_examples=40)
@given(data=st.data())
def test_meta_trace_truncated_or_bit_flipped_is_the_same_trace_or_a_typed_error(meta_bytes, tmp_path_factory, data):
    raw = damaged(data, meta_bytes)
    p = tmp_path_factory.mktemp("bad") / "t.pt"
    p.write_bytes(raw)
    try:
        back = traces.load(p)
    except (CorruptStoreError, InvalidInputError) as exc:
        assert str(p) in str(exc)
    else:  # torch's zip has CRCs too: what loads is the trace that was saved
        want = traces.Trace(META[0].numpy(), np.repeat(np.arange(2, dtype=np.int32), [3, 1]),
                            np.array([0, 4]), ("table_0", "table_1"))
        assert same_trace(back, want)


@pytest.mark.parametrize("obj, error, says", [
    ({"indices": torch.tensor([1])}, CorruptStoreError, "got a dict"),
    ((torch.tensor([1]), torch.tensor([0, 1])), CorruptStoreError, "tuple of 2"),
    ([[1, 2], [0, 2], [[2]]], CorruptStoreError, "list of 3"),
    ((torch.tensor([1.0]), torch.tensor([0, 1]), torch.tensor([[1]])), InvalidInputError, "integer tensor"),
    ((torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([0, 1]), torch.tensor([[1]])), InvalidInputError,
     "dense integer tensor"),
    ((torch.tensor([1]).to_sparse(), torch.tensor([0, 1]), torch.tensor([[1]])), InvalidInputError,
     "dense integer tensor"),
    ((torch.tensor([1, 2, 3]), torch.tensor([0, 1, 3]), torch.tensor([[2, 1]])), InvalidInputError, "disagree"),
    ((torch.tensor([1, 2, 3]), torch.tensor([0, 1, 5]), torch.tensor([[1, 4]])), InvalidInputError, "from 0 to"),
    ((torch.tensor([1, 2, 3]), torch.tensor([0, 4, 3]), torch.tensor([[4, -1]])), InvalidInputError, "negative"),
    ((torch.tensor([1, 2, 3]), torch.tensor([0, 1, 3]), torch.tensor([1, 2])), InvalidInputError, "shape (tables"),
    ((torch.tensor([[1, 2, 3]]), torch.tensor([0, 1, 3]), torch.tensor([[1, 2]])), InvalidInputError, "1-D"),
    ((torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), torch.zeros((2**21, 0), dtype=torch.int64)),
     InvalidInputError, "tables but no table_names"),
])
def test_meta_file_of_the_wrong_structure_is_a_typed_error(tmp_path, capsys, obj, error, says):
    """bfloat16 and sparse tensors were a TypeError from ``.numpy()`` (a traceback)."""
    p = tmp_path / "t.pt"
    torch.save(obj, p)
    with pytest.raises(error) as e:
        traces.load(p)
    assert says in str(e.value) and str(p) in str(e.value)
    cli_fails(capsys, ["trace", "stats", p], p)


def test_meta_file_holding_a_code_running_pickle_is_refused_without_running_it(tmp_path, capsys):
    marker = tmp_path / "pwned"
    p = tmp_path / "t.pt"
    p.write_bytes(pickle.dumps(Pwn(marker)))
    with pytest.raises(CorruptStoreError, match="torch file"):
        traces.load(p)
    cli_fails(capsys, ["trace", "stats", p], p)  # one line: torch's advice ran to six, and a warning two more
    assert not marker.exists()


# --------------------------------------------------------------------------- CSV traces
@pytest.mark.parametrize("text, says", [
    ("", "expected the CSV header"),
    ("a,b\n0,1\n", "expected the CSV header"),
    ("table,id\n0,x\n", "line 2: id 'x'"),
    ("table,id\n0,1.5\n", "line 2: id '1.5'"),
    ("table,id\n0,\n", "line 2: id ''"),
    ("table,id\n0,99999999999999999999\n", "int64 range"),
    ("table,id\n0,1\n0,1,2\n", "malformed CSV"),
    ("table,id\n0\n", "rows have 1 columns"),
    ("table,id\n-1,5\n", "table indices must be >= 0"),
    ("table,id\n9999999999,1\n", "int32 range"),
    ("table,id,batch\n0,1,1\n0,2,0\n", "line 3: batch numbers must not decrease"),
    ("table,id,batch\n0,1,a\n", "line 2: batch 'a'"),
])
def test_bad_csv_is_an_invalid_input_naming_the_file(tmp_path, capsys, text, says):
    p = tmp_path / "t.csv"
    p.write_text(text)
    with pytest.raises(InvalidInputError) as e:
        traces.load(p)
    assert says in str(e.value) and str(p) in str(e.value)
    cli_fails(capsys, ["trace", "stats", p], p)


def test_csv_that_is_not_utf8_is_a_corrupt_file(tmp_path, capsys):
    p = tmp_path / "t.csv"
    p.write_bytes(b"table,id\n\xe9,1\n")
    with pytest.raises(CorruptStoreError, match="UTF-8"):
        traces.load(p)
    cli_fails(capsys, ["replay", p], p)


def test_a_missing_trace_or_a_directory_is_named(tmp_path, capsys):
    for p in (tmp_path / "nope.npz", tmp_path):
        with pytest.raises(InvalidInputError):
            traces.load(p)
        cli_fails(capsys, ["trace", "stats", p], p)
        cli_fails(capsys, ["tune", p, "--dram", "1MiB"], p)


# --------------------------------------------------------------------------- store config TOML
@pytest.mark.parametrize("body, key", [
    ('num_embeddings = "10"', "table.num_embeddings"),
    ("num_embeddings = 10.0", "table.num_embeddings"),
    ("dim = 100_000_000", "table.dim"),
    ("dtype = [5]", "table.dtype"),
    ("init = { scale = nan }", "init.scale"),
    ('init = "x"', "init"),
    ("hash = []", "hash"),
    ('tiers = "ssd"', "table.tiers"),
    ('tiers = [{ kind = 1 }]', "tiers.kind"),
    ('tiers = [{ kind = "dram", capacity = 1.5 }, { kind = "ssd" }]', "tiers.capacity"),
    ('tiers = [{ kind = "dram", capacity = 1979-05-27 }, { kind = "ssd" }]', "tiers.capacity"),
    ('tiers = [{ kind = "ssd", queue_depth = 1.0 }]', "tiers.queue_depth"),
    ('tiers = [{ kind = "rocksdb", compression = ["a"] }]', "tiers.compression"),
])
def test_toml_with_wrong_types_names_the_key_and_the_file(tmp_path, capsys, body, key):
    """Regression: the error named the key but not the file, so the CLI's one line did not say where."""
    lines = {"name": 'name = "e"', "num_embeddings": "num_embeddings = 10", "dim": "dim = 4"}
    field = body.split("=")[0].strip()
    lines[field] = body
    cfg = tmp_path / "c.toml"
    cfg.write_text("[[table]]\n" + "\n".join(lines.values()) + "\n")
    with pytest.raises(ConfigError) as e:
        StoreConfig.from_toml(cfg)
    assert e.value.key == key and str(cfg) in str(e.value)
    err = cli_fails(capsys, ["create", tmp_path / "s", "--config", cfg], cfg)
    assert repr(key) in err
    assert not (tmp_path / "s").exists()


@settings(max_examples=30)
@given(cut=st.integers(0, 120))
def test_truncated_toml_is_a_config_error_or_a_valid_config(tmp_path_factory, cut):
    text = ('[[table]]\nname = "emb"\nnum_embeddings = 300\ndim = 8\n'
            'tiers = [{ kind = "dram", capacity = "1KiB", policy = "lru" }, { kind = "ssd" }]\n')
    cfg = tmp_path_factory.mktemp("toml") / "c.toml"
    cfg.write_text(text[:cut])
    try:
        got = StoreConfig.from_toml(cfg)
    except ConfigError as exc:
        assert str(cfg) in str(exc)
    else:
        assert got.tables == () or got.tables[0].name == "emb"


# --------------------------------------------------------------------------- cost model
def test_costmodel_errors_name_the_file_and_deep_json_is_no_recursion_error(tmp_path, caplog):
    """Regressions: a field error did not name the file; JSON nested thousands deep escaped as a
    RecursionError from load() and from default_model() (replay, tune: a traceback)."""
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"dram_ns_per_row": 1.0}))
    with pytest.raises(InvalidInputError) as e:
        costmodel.load(p)
    assert str(p) in str(e.value) and "ssd_iops" in str(e.value)
    p.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(InvalidInputError, match="RecursionError"):
        costmodel.load(p)
    with caplog.at_level("WARNING", logger="embstore.costmodel"):
        assert costmodel.default_model(p) == costmodel.CostModel()
    assert any(str(p) in r.getMessage() for r in caplog.records)  # the fall-back is not silent


def test_a_missing_costmodel_falls_back_quietly(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="embstore.costmodel"):
        assert costmodel.default_model(tmp_path / "none.json") == costmodel.CostModel()
    assert not caplog.records


# --------------------------------------------------------------------------- learned-hash mapping files
@pytest.fixture(scope="module")
def mapping_bytes(tmp_path_factory) -> bytes:
    p = tmp_path_factory.mktemp("map") / "m.bin"
    write_arrays(p, {"a": 1}, {"x": np.arange(10, dtype=np.int64), "y": np.ones((3, 2), np.float32)})
    return p.read_bytes()


@settings(max_examples=60)
@given(data=st.data())
def test_mapping_file_truncated_or_bit_flipped_reads_the_same_or_is_corrupt(mapping_bytes, tmp_path_factory, data):
    raw = damaged(data, mapping_bytes)
    p = tmp_path_factory.mktemp("bad") / "m.bin"
    p.write_bytes(raw)
    try:
        meta, arrays = read_arrays(p)
    except CorruptStoreError as exc:
        assert str(p) in str(exc)
    else:  # a flip in the alignment padding changes nothing
        assert meta == {"a": 1}
        np.testing.assert_array_equal(arrays["x"], np.arange(10))
        np.testing.assert_array_equal(arrays["y"], np.ones((3, 2)))


def _mapping_with_header(path: Path, header: object) -> Path:
    head = json.dumps(header).encode()
    path.write_bytes(b"EMBHASH\x01" + struct.pack("<Q", len(head)) + head + bytes(-(16 + len(head)) % 64 + 256))
    return path


@pytest.mark.parametrize("shape", [[0, 2**70], [0, 2**62], [1] * 100])
def test_mapping_header_with_shapes_numpy_refuses_is_corrupt(tmp_path, shape):
    """Regression: an empty array with a dimension past numpy's limit, or more than 64 dimensions, was a
    bare ValueError from numpy (header files without a CRC of their own are still read)."""
    p = _mapping_with_header(tmp_path / "m.bin", {"meta": {}, "arrays": {
        "x": {"dtype": "<i8", "shape": shape, "offset": 0, "crc32": 0}}})
    with pytest.raises(CorruptStoreError, match="not a valid embstore hash mapping"):
        read_arrays(p)


def test_mapping_header_nested_too_deep_is_corrupt(tmp_path):
    p = tmp_path / "m.bin"
    head = b"[" * 50_000 + b"]" * 50_000
    p.write_bytes(b"EMBHASH\x01" + struct.pack("<Q", len(head)) + head)
    with pytest.raises(CorruptStoreError, match="RecursionError"):
        read_arrays(p)


# --------------------------------------------------------------------------- bulk import and .npy ids
def _damaged_npy_header(arr: np.ndarray) -> bytes:
    """A .npy whose header dict lost its closing brace: numpy's tokenizer raises TokenError."""
    raw = _npy(arr)
    return raw.replace(b"}", b" ", 1)


def test_npy_with_a_damaged_header_is_refused_by_import_and_hash_fit(store_path, tmp_path, capsys):
    """Regression: tokenize.TokenError (not a ValueError) escaped ``import`` and ``hash fit`` as a traceback."""
    rows = tmp_path / "rows.npy"
    rows.write_bytes(_damaged_npy_header(np.ones((4, 8), np.float32)))
    cli_fails(capsys, ["import", store_path, "emb", rows], rows)
    ids = tmp_path / "ids.npy"
    ids.write_bytes(_damaged_npy_header(np.arange(100)))
    cli_fails(capsys, ["hash", "fit", ids, "--buckets", "10", "--out", tmp_path / "m", "--quiet"], ids)
    assert not (tmp_path / "m").exists()


def test_npy_of_ids_declaring_a_huge_shape_is_refused_not_allocated(tmp_path, capsys):
    """Regression: ``hash fit`` read .npy ids whole, so 64 bytes declaring 10**12 ids were a 7 TiB
    allocation (exit 1, 'out of memory') instead of a bad file (exit 2)."""
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": "<i8", "fortran_order": False, "shape": (10**12,)})
    p = tmp_path / "ids.npy"
    p.write_bytes(head.getvalue() + bytes(64))
    cli_fails(capsys, ["hash", "fit", p, "--buckets", "10", "--out", tmp_path / "m", "--quiet"], p)


def test_import_of_rows_beyond_float32_is_one_line(store_path, tmp_path, capsys):
    """Regression: numpy's overflow RuntimeWarning added two lines (source path and code) to stderr."""
    p = tmp_path / "big.npy"
    np.save(p, np.full((2, 8), 1e300))
    with warnings.catch_warnings():  # outside pytest a warning is printed to stderr; here it would be kept
        warnings.simplefilter("error")
        err = cli_fails(capsys, ["import", store_path, "emb", p], p)
    assert "row 0" in err and "RuntimeWarning" not in err


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bulk")
    (root / "c.toml").write_text(CONFIG)
    embstore.create(root / "s", root / "c.toml").close()
    return root / "s"


@settings(max_examples=40)
@given(data=st.data())
def test_import_of_a_damaged_npy_writes_all_rows_or_none(shared_store, tmp_path_factory, data):
    rows = np.random.default_rng(0).standard_normal((20, 8)).astype(np.float32)
    raw = damaged(data, _npy(rows), flip_within=128)  # the header, and the start of the rows
    p = tmp_path_factory.mktemp("npy") / "r.npy"
    p.write_bytes(raw)
    with embstore.open(shared_store) as s:
        before = s["emb"].lookup(np.arange(300, dtype=np.int64))
        try:
            import_rows(s["emb"], p)
        except EmbstoreError as exc:
            assert str(p) in str(exc)
            np.testing.assert_array_equal(s["emb"].lookup(np.arange(300, dtype=np.int64)), before)


# --------------------------------------------------------------------------- outputs of failed commands
@needs_mount
def test_replay_plot_on_a_full_disk_keeps_the_previous_png(tmp_path, tiny_tmpfs, capsys):
    """Regression: ``--plot`` drew straight into the target, so a full disk replaced the previous plot with
    a truncated PNG."""
    trace = tmp_path / "t.npz"
    traces.save(TRACE, trace)
    png = tiny_tmpfs.path / "mrc.png"
    png.write_bytes(b"the previous plot")
    with open(tiny_tmpfs.path / "filler", "wb", buffering=0) as f:  # fill it, then free 8 KiB: less than a PNG
        try:
            while True:
                f.write(bytes(4096))
        except OSError:
            pass
    os.truncate(tiny_tmpfs.path / "filler", os.path.getsize(tiny_tmpfs.path / "filler") - 8192)
    assert main(["replay", str(trace), "--capacity", "1", "--policy", "lru", "--plot", str(png)]) == 1
    assert "No space left" in capsys.readouterr().err
    assert sorted(p.name for p in tiny_tmpfs.path.iterdir()) == ["filler", "mrc.png"]  # no temp file either
    assert png.read_bytes() == b"the previous plot"


# --------------------------------------------------------------------------- training checkpoints
TRAIN = """
[data]
kind = "synthetic"
batch_size = 64
train_batches = 2
eval_batches = 1
[model]
dense_arch = [8, 4]
over_arch = [8, 1]
[store]
defaults = { dim = 4, tiers = [{ kind = "dram", capacity = "4KiB", policy = "lru" }, { kind = "mmap" }] }
[[store.table]]
name = "a"
num_embeddings = 100
[schedule]
checkpoint_every = 1
eval_every = 2
seed = 1
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(config, out) of a finished two-step run with checkpoints step_1 and step_2."""
    from embstore.training.trainer import TrainConfig, train

    root = tmp_path_factory.mktemp("train")
    cfg = root / "t.toml"
    cfg.write_text(TRAIN)
    train(TrainConfig.from_toml(cfg), root / "run", progress=False)
    return cfg, root / "run"


@pytest.fixture()
def run(trained, tmp_path) -> tuple[Path, Path, Path]:
    """A private copy of the trained run: (config, out, the latest checkpoint's rank0.pt)."""
    cfg, out = trained
    shutil.copytree(out, tmp_path / "run")
    out = tmp_path / "run"
    return cfg, out, out / "checkpoints" / "step_2" / "rank0.pt"


def _resume_fails(capsys, cfg: Path, out: Path, names: Path) -> str:
    from embstore.training.trainer import TrainConfig, train

    with pytest.raises(CorruptStoreError) as e:
        train(TrainConfig.from_toml(cfg), out, resume=True, progress=False)
    assert str(names) in str(e.value)
    return cli_fails(capsys, ["train", cfg, "--out", out, "--resume", "--no-progress"], names)


def test_checkpoints_hold_only_what_weights_only_loading_takes(run):
    _, _, pt = run
    state = torch.load(pt, weights_only=True)
    assert state["step"] == 2 and len(state["losses"]) == 2


def test_a_checkpoint_that_would_run_code_is_refused_without_running_it(run, capsys):
    """Regression: checkpoints were loaded with weights_only=False, so a checkpoint file could run
    arbitrary code on --resume."""
    cfg, out, pt = run
    marker = out / "pwned"
    with open(pt, "wb") as f:
        torch.save({"step": 2, "model": Pwn(marker)}, f)
    try:
        err = _resume_fails(capsys, cfg, out, pt)
    finally:
        assert not marker.exists(), "loading the checkpoint ran code from it"
    assert "step_1" in err  # the earlier checkpoint is offered, not silently used


@pytest.mark.parametrize("cut", [0, 1, 100, 0.5, -1])
def test_a_truncated_checkpoint_is_a_clear_error_naming_it(run, capsys, cut):
    """Regression: torch.load's RuntimeError / EOFError escaped as a traceback."""
    cfg, out, pt = run
    raw = pt.read_bytes()
    n = int(len(raw) * cut) if isinstance(cut, float) else (cut if cut >= 0 else len(raw) + cut)
    pt.write_bytes(raw[:n])
    _resume_fails(capsys, cfg, out, pt)


@pytest.mark.parametrize("state", [
    [1, 2],
    {"step": 2},
    {"step": "2", "model": {}, "optimizer": {}, "losses": [0.5, 0.5], "evals": []},
    {"step": 2, "model": {}, "optimizer": {}, "losses": [0.5], "evals": []},
    {"step": 2, "model": {}, "optimizer": {}, "losses": [0.5, 0.5], "evals": [(2, {"auc": 0.5})]},
])
def test_a_checkpoint_of_the_wrong_structure_is_a_clear_error(run, capsys, state):
    cfg, out, pt = run
    torch.save(state, pt)
    _resume_fails(capsys, cfg, out, pt)


def test_a_checkpoint_of_another_model_is_a_clear_error(run, capsys):
    """A state dict whose tensors have other shapes: load_state_dict's RuntimeError was a traceback."""
    cfg, out, pt = run
    state = torch.load(pt, weights_only=True)
    state["model"] = {k: torch.zeros(3, 3) if v.ndim == 2 else v for k, v in state["model"].items()
                      if isinstance(v, torch.Tensor)} | {k: v for k, v in state["model"].items()
                                                          if not isinstance(v, torch.Tensor)}
    torch.save(state, pt)
    err = _resume_fails(capsys, cfg, out, pt)
    assert "does not fit" in err


@pytest.mark.parametrize("marker", [b"", b"../../etc", b"\xff\xfe", b"step_99"])
def test_a_damaged_latest_marker_is_a_clear_error(run, capsys, marker):
    """An empty marker used to resume from the checkpoints folder itself (a bare FileNotFoundError)."""
    cfg, out, _ = run
    (out / "checkpoints" / "latest").write_bytes(marker)
    _resume_fails(capsys, cfg, out, out / "checkpoints" / "latest")


def test_a_damaged_checkpoint_leaves_the_live_store_alone(run, capsys):
    """The checkpoint is read before the store is restored from it: a failed resume changes nothing."""
    cfg, out, pt = run
    before = {p.relative_to(out): p.read_bytes() for p in (out / "store").rglob("*") if p.is_file()}
    pt.write_bytes(b"")
    _resume_fails(capsys, cfg, out, pt)
    after = {p.relative_to(out): p.read_bytes() for p in (out / "store").rglob("*") if p.is_file()}
    assert after == before


def test_a_model_with_nan_weights_is_refused(run):
    """Regression: dense.pt with a NaN loaded fine and every prediction was NaN."""
    from embstore.training.registry import load_model

    _, out, _ = run
    dense = out / "store" / "models" / "dlrm" / "dense.pt"
    with embstore.open(out / "store") as s:
        load_model(s, "dlrm")  # the model as trained loads
    state = torch.load(dense, weights_only=True)
    key = next(k for k, v in state.items() if v.is_floating_point())
    state[key] = state[key].clone().fill_(float("nan"))
    torch.save(state, dense)
    with embstore.open(out / "store") as s, pytest.raises(CorruptStoreError, match="NaN"):
        load_model(s, "dlrm")
