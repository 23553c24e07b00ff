"""The public Python API: namespace, config parsing, row formats, validation at the boundary."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import example, given, strategies as st

import embstore
from embstore.config import PolicySpec, StoreConfig, TableConfig, TierConfig, parse_bytes
from embstore.rows import RowFormat, initial_rows


def test_public_namespace_is_pinned() -> None:
    assert embstore.__all__ == sorted(embstore.__all__)
    assert embstore.__all__ == [
        "ConfigError", "CorruptStoreError", "DiskFullError", "EmbstoreError", "HashConfig", "IdOutOfRangeError",
        "InitConfig", "InvalidInputError", "InvalidOffsetsError", "InvalidRowsError", "PolicySpec", "RowDType",
        "Store", "StoreClosedError", "StoreConfig", "StoreError", "StoreExistsError", "StoreInUseError",
        "StoreNotFoundError",
        "Table", "TableConfig", "TableExistsError", "TierConfig", "TierIOError", "TierKind",
        "UnknownTableError", "create", "open"]
    assert issubclass(embstore.IdOutOfRangeError, ValueError)
    assert issubclass(embstore.UnknownTableError, KeyError)


@pytest.mark.parametrize("text,expected", [(6400, 6400), ("6400", 6400), ("64KiB", 65536),
                                           ("256MiB", 256 << 20), ("2GiB", 2 << 30), ("1_000", 1000),
                                           ("1.5GiB", 3 << 29), ("0.3KiB", 307),  # whole bytes, rounded down
                                           ("9007199254740993", 2**53 + 1)])  # exact past float's 2**53
def test_parse_bytes(text, expected) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["12 parsecs", "-5", 0, True, "GiB", 1.5, "1.5", "0.5B"])
def test_parse_bytes_rejects(bad) -> None:
    with pytest.raises(embstore.ConfigError, match="capacity"):
        parse_bytes(bad)


BASE = """
[[table]]
name = "t"
num_embeddings = 100
dim = 8
tiers = [{ kind = "dram", capacity = "1KiB", policy = "lfu+tinylfu" }, { kind = "ssd" }]
"""


def test_config_round_trips_through_toml() -> None:
    cfg = StoreConfig.from_toml(BASE)
    t = cfg.tables[0]
    assert t.tiers[0].policy == PolicySpec(embstore.config.PolicyKind.LFU, True)
    assert t.tiers[0].capacity == 1024
    assert StoreConfig.from_toml(cfg.to_toml()) == cfg


@pytest.mark.parametrize("change,key", [
    (("dim = 8", "dim = 8\ncolour = 1"), "table.colour"),
    (("dim = 8", "dim = 0"), "table.dim"),
    (("dim = 8", 'dim = 8\ndtype = "int4"'), "table.dtype"),
    (('policy = "lfu+tinylfu"', 'policy = "fifo"'), "tiers.policy"),
    (('{ kind = "ssd" }', '{ kind = "dram", capacity = 5 }'), "table.tiers"),
    (('{ kind = "ssd" }', '{ kind = "ssd", capacity = 5 }'), "tiers.capacity"),
    (('{ kind = "ssd" }', '{ kind = "ssd", queue_depth = 0 }'), "tiers.queue_depth"),
    (('capacity = "1KiB", ', ''), "tiers.capacity"),
    (('{ kind = "ssd" }', '{ kind = "tape" }'), "tiers.kind"),
    (('{ kind = "ssd" }', '{ kind = "ssd", policy = "lru" }'), "tiers.policy"),  # a home has no policy
    (('{ kind = "ssd" }', '{ kind = "ssd", block_cache = "1MiB" }'), "tiers.block_cache"),  # rocksdb's
    (('{ kind = "ssd" }', '{ kind = "rocksdb", queue_depth = 8 }'), "tiers.queue_depth"),  # ssd's
    (('capacity = "1KiB", ', 'capacity = "1KiB", queue_depth = 8, '), "tiers.queue_depth"),  # on a cache
    (("num_embeddings = 100", "num_embeddings = 100000000000000"), "table.num_embeddings"),
])
def test_config_errors_name_the_key(change, key) -> None:
    with pytest.raises(embstore.ConfigError) as err:
        StoreConfig.from_toml(BASE.replace(*change))
    assert err.value.key == key and key in str(err.value)


def test_config_duplicate_names_and_bad_toml() -> None:
    with pytest.raises(embstore.ConfigError, match="duplicate"):
        StoreConfig.from_toml(BASE + BASE)
    with pytest.raises(embstore.ConfigError, match="not valid TOML"):
        StoreConfig.from_toml("[[table]\nname=")


@given(st.integers(0, 2**40), st.sampled_from(["uniform", "normal"]))
def test_initial_rows_are_deterministic_and_scaled(row: int, kind: str) -> None:
    init = embstore.InitConfig(kind, 0.5, 3)
    a = initial_rows(init, np.array([row, row + 1], np.int64), 16)
    b = initial_rows(init, np.array([row], np.int64), 16)
    np.testing.assert_array_equal(a[:1], b)
    assert not np.array_equal(a[0], a[1])
    if kind == "uniform":
        assert np.abs(a).max() <= 0.5
    assert not np.array_equal(a, initial_rows(embstore.InitConfig(kind, 0.5, 4), np.array([row, row + 1]), 16))


@given(st.integers(1, 40), st.floats(-1e3, 1e3), st.floats(0, 1e3), st.integers(0, 2**31))
def test_row_formats_round_trip(dim: int, lo: float, spread: float, seed: int) -> None:
    x = (np.random.default_rng(seed).random((3, dim)) * spread + lo).astype(np.float32)
    np.testing.assert_array_equal(RowFormat(dim, "float32").decode(RowFormat(dim, "float32").encode(x)), x)
    f16 = RowFormat(dim, embstore.RowDType.FLOAT16)
    np.testing.assert_array_equal(f16.decode(f16.encode(x)), x.astype(np.float16).astype(np.float32))
    i8 = RowFormat(dim, embstore.RowDType.INT8, state_dim=2)
    enc = i8.encode(x, np.full((3, 2), 7, np.float32))
    assert enc.shape == (3, dim + 8 + 8)
    tol = (x.max(1) - x.min(1)) / 510 * 1.001 + 1e-3 * np.abs(x).max(1) * 1e-3 + 1e-6
    assert (np.abs(i8.decode(enc) - x).max(1) <= tol).all()
    np.testing.assert_array_equal(i8.decode_state(enc), 7)


@pytest.fixture()
def table(tmp_path):
    cfg = TableConfig("t", 50, 4, tiers=(TierConfig("dram", 160, "lru"), TierConfig("ssd")))
    store = embstore.create(tmp_path / "s", StoreConfig((cfg,)))
    yield store["t"]
    store.close()


def test_lookup_validation(table) -> None:
    with pytest.raises(embstore.InvalidInputError, match="int64"):
        table.lookup(np.array([1, 2], np.int32))
    with pytest.raises(embstore.InvalidInputError, match="1-D"):
        table.lookup(np.zeros((2, 2), np.int64))
    with pytest.raises(embstore.InvalidInputError, match="ndarray or torch.Tensor"):
        table.lookup([1, 2])
    with pytest.raises(embstore.IdOutOfRangeError, match=r"id 50 outside \[0, 50\)"):
        table.lookup(np.array([1, 50], np.int64))
    with pytest.raises(embstore.IdOutOfRangeError, match="id -1"):
        table.lookup(np.array([-1], np.int64))
    assert table.lookup(np.array([], np.int64)).shape == (0, 4)


@pytest.mark.parametrize("offsets,msg", [([1, 3], "offsets\\[0\\] must be 0"), ([0, 2], "must equal len"),
                                         ([0, 2, 1, 3], "non-decreasing"), ([], "at least")])
def test_offsets_validation(table, offsets, msg) -> None:
    with pytest.raises(embstore.InvalidOffsetsError, match=msg):
        table.lookup_pooled(np.array([1, 2, 3], np.int64), np.array(offsets, np.int64))


def test_pooled_mode_and_update_validation(table) -> None:
    ids = np.array([1, 2], np.int64)
    with pytest.raises(embstore.InvalidInputError, match="mode"):
        table.lookup_pooled(ids, np.array([0, 2], np.int64), mode="max")
    before = table.lookup(ids)
    for rows, msg in [(np.ones((2, 5), np.float32), "shape"), (np.ones((2, 4), np.int64), "floating"),
                      (np.full((2, 4), np.inf, np.float32), "finite"), (np.full((2, 4), 1e39), "finite")]:
        with pytest.raises(embstore.InvalidRowsError, match=msg):
            table.update(ids, rows)
    np.testing.assert_array_equal(table.lookup(ids), before)


def test_torch_in_torch_out_and_last_write_wins(table) -> None:
    table.update(torch.tensor([3, 3, 4]), torch.tensor([[1.0] * 4, [2.0] * 4, [3.0] * 4]))
    out = table.lookup(torch.tensor([3, 4]))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    assert out[:, 0].tolist() == [2.0, 3.0]
    pooled = table.lookup_pooled(torch.tensor([3, 4, 3]), torch.tensor([0, 2, 2, 3]), mode="mean")
    assert pooled[:, 0].tolist() == [2.5, 0.0, 2.0]


def test_store_lifecycle_errors(tmp_path) -> None:
    with pytest.raises(embstore.StoreNotFoundError):
        embstore.open(tmp_path / "nothing")
    store = embstore.create(tmp_path / "s", StoreConfig.from_toml(BASE))
    with pytest.raises(embstore.UnknownTableError, match="known tables: t"):
        store["u"]
    with pytest.raises(embstore.TableExistsError):
        store.create_table(store["t"].config)
    store.create_table(TableConfig("u", 10, 2, tiers=(TierConfig("rocksdb"),)))
    store["u"].update(np.array([9], np.int64), np.ones((1, 2), np.float32))
    store.close()
    with pytest.raises(embstore.StoreClosedError):
        store["t"]
    with embstore.open(tmp_path / "s") as s:
        assert sorted(s.tables) == ["t", "u"] and s["u"].lookup(np.array([9]))[0].tolist() == [1.0, 1.0]
    (tmp_path / "s" / "manifest.json").write_text("{not json")
    with pytest.raises(embstore.CorruptStoreError, match="manifest.json"):
        embstore.open(tmp_path / "s")


@pytest.mark.parametrize("existed", [False, True])
def test_a_refused_create_leaves_no_half_made_store(tmp_path, existed: bool) -> None:
    """A tier that cannot be built (a cache below one row) fails create() and leaves the path as it was,
    so a corrected create() succeeds."""
    path = tmp_path / "s"
    if existed:
        path.mkdir()
    bad = TableConfig("t", 100, 4, tiers=(TierConfig("dram", capacity=10), TierConfig("mmap")))
    with pytest.raises(embstore.ConfigError):
        embstore.create(path, StoreConfig((bad,)))
    assert path.is_dir() == existed and (not existed or not any(path.iterdir()))
    good = TableConfig("t", 100, 4, tiers=(TierConfig("dram", capacity=160), TierConfig("mmap")))
    with embstore.create(path, StoreConfig((good,))) as store:
        assert store["t"].lookup(np.array([5], np.int64)).shape == (1, 4)


def test_a_cache_beyond_the_directory_limit_is_a_config_error_before_any_allocation(tmp_path) -> None:
    """2**31 rows is past a keyed cache's int32 slots: refused up front (not 32 GiB allocated, then overflow);
    a cache of the whole table is direct-mapped and has no such limit (checked here on a small table)."""
    too_big = TableConfig("t", 2**40, 4, tiers=(TierConfig("dram", capacity=16 * 2**31), TierConfig("rocksdb")))
    with pytest.raises(embstore.ConfigError, match="at most 2147483647"):
        embstore.create(tmp_path / "s", StoreConfig((too_big,)))
    assert not (tmp_path / "s").exists()
    with pytest.raises(ValueError, match="at most"):
        embstore.policies.CacheDirectory(2**31, "lru")


def test_optimizer_state_lives_beside_rows(tmp_path) -> None:
    cfg = TableConfig("t", 50, 4, dtype="float16", tiers=(TierConfig("dram", 100, "lru"), TierConfig("ssd")))
    store = embstore.create(tmp_path / "s", StoreConfig((cfg,)))
    t = store.ensure_state_dim("t", 2)
    assert t.format.row_bytes == 4 * 2 + 2 * 4
    ids = np.arange(10, dtype=np.int64)
    t.write_with_state(ids, np.full((10, 4), 0.5, np.float32), np.arange(20, dtype=np.float32).reshape(10, 2))
    store.close()
    with embstore.open(tmp_path / "s") as store:
        vals, state = store["t"].read_with_state(ids[::-1].copy())
        assert (vals == 0.5).all() and state[:, 0].tolist() == list(range(18, -1, -2))
        with pytest.raises(embstore.TableExistsError, match="optimizer-state"):
            store.ensure_state_dim("t", 1)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_trained_table_held_in_dram_reads_only_its_embedding(tmp_path, mode: str) -> None:
    """A table whose DRAM slab rows carry optimizer state after the embedding (as after training) is read
    straight from the slab: lookups and pooled bags equal torch on the embedding alone, never the state."""
    rows, dim = 300, 8
    cfg = TableConfig("t", rows, dim, tiers=(TierConfig("dram", rows * (dim + 1) * 4), TierConfig("mmap")))
    store = embstore.create(tmp_path / "s", StoreConfig((cfg,)))
    t = store.ensure_state_dim("t", 1)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((rows, dim), dtype=np.float32)
    t.write_with_state(np.arange(rows, dtype=np.int64), w, np.full((rows, 1), 1e6, np.float32))
    assert t.full_dram_tier() is not None
    ids = rng.integers(0, rows, 500)
    offsets = np.sort(np.r_[0, rng.integers(0, 501, 60), 500]).astype(np.int64)
    np.testing.assert_array_equal(t.lookup(ids), w[ids])
    want = torch.nn.functional.embedding_bag(torch.from_numpy(ids), torch.from_numpy(w), torch.from_numpy(offsets),
                                             mode=mode, include_last_offset=True).numpy()
    np.testing.assert_allclose(t.lookup_pooled(ids, offsets, mode), want, rtol=1e-6, atol=1e-6)
    assert t.stats()["dram"]["hits"] == 2 * len(np.unique(ids))  # distinct rows per call, as everywhere
    store.close()


@pytest.mark.parametrize("state_dim", [0, 1])
@pytest.mark.parametrize("bad", [-1, 300, 2**40])
def test_resident_pooled_lookup_refuses_ids_outside_the_table(tmp_path, state_dim: int, bad: int) -> None:
    """The resident fast path range-checks ids inside its counting pass: a bad id anywhere in the batch
    raises the same error as everywhere else, and counts nothing."""
    rows, dim = 300, 8
    cfg = TableConfig("t", rows, dim, tiers=(TierConfig("dram", rows * (dim + 1) * 4), TierConfig("mmap")))
    store = embstore.create(tmp_path / "s", StoreConfig((cfg,)))
    t = store.ensure_state_dim("t", 1) if state_dim else store["t"]
    t.write_physical(np.arange(rows, dtype=np.int64), np.ones((rows, dim), np.float32))
    assert t.full_dram_tier() is not None
    before = t.stats()["dram"]["hits"]
    ids = np.array([5, 6, bad, 7], np.int64)
    with pytest.raises(embstore.IdOutOfRangeError, match=f"id {bad} outside"):
        t.lookup_pooled(ids, np.array([0, 2, 4], np.int64))
    assert t.stats()["dram"]["hits"] == before
    np.testing.assert_array_equal(t.lookup_pooled(np.array([5, 6, 6, 299], np.int64), np.array([0, 2, 4])),
                                  np.full((2, dim), 2.0, np.float32))
    assert t.stats()["dram"]["hits"] == before + 3
    store.close()


def test_learned_hash_table_is_self_contained(tmp_path) -> None:
    from embstore.hashing import LearnedHash

    rng = np.random.default_rng(0)
    trace = rng.zipf(1.3, 5000).astype(np.int64) * 7919
    LearnedHash.fit(trace, 64).save(tmp_path / "m.ehash")
    (tmp_path / "c.toml").write_text(BASE.replace('name = "t"', 'name = "t"\nhash = { kind = "learned", '
                                                  'mapping = "m.ehash" }').replace("num_embeddings = 100",
                                                                                   "num_embeddings = 64"))
    store = embstore.create(tmp_path / "s", tmp_path / "c.toml")
    ids = trace[:50]
    rows = store["t"].lookup(ids)
    store.close()
    (tmp_path / "m.ehash").unlink()  # the store keeps its own copy
    with embstore.open(tmp_path / "s") as s:
        np.testing.assert_array_equal(s["t"].lookup(ids), rows)
        assert s["t"].config.hash.mapping == "tables/t/hash.ehash"
    with pytest.raises(embstore.ConfigError, match="hash.mapping"):
        embstore.create(tmp_path / "s2", tmp_path / "c.toml")
    assert not (tmp_path / "s2").exists()
    with embstore.open(tmp_path / "s") as s:  # re-laying out for optimizer state keeps the mapping
        s.ensure_state_dim("t", 1)
    with embstore.open(tmp_path / "s") as s:
        assert s["t"].format.state_dim == 1 and s["t"].lookup(ids).shape == (50, 8)
        # create_table adopts a mapping from outside the store too, and the store reopens with it
        LearnedHash.fit(trace, 64).save(tmp_path / "u.ehash")
        s.create_table({"name": "u", "num_embeddings": 64, "dim": 8, "tiers": [{"kind": "mmap"}],
                        "hash": {"kind": "learned", "mapping": str(tmp_path / "u.ehash")}})
    with embstore.open(tmp_path / "s") as s:
        assert s["u"].config.hash.mapping == "tables/u/hash.ehash"
        assert s["u"].lookup(ids).shape == (50, 8)


def test_float16_table_refuses_rows_beyond_its_range_and_writes_nothing(tmp_path) -> None:
    cfg = TableConfig("t", 10, 4, dtype="float16", tiers=(TierConfig("dram", 24, "lru"), TierConfig("mmap")))
    with embstore.create(tmp_path / "s", StoreConfig((cfg,))) as store:
        t = store["t"]
        ids = np.array([1, 2], np.int64)
        before = t.lookup(ids)
        for big in (7e4, -1e6, 3e38):
            rows = np.ones((2, 4), np.float32)
            rows[1, 2] = big
            with pytest.raises(embstore.InvalidRowsError, match="float16"):
                t.update(ids, rows)
            with pytest.raises(embstore.InvalidRowsError, match="float16"):
                store.update_logged("t", ids, rows)
        np.testing.assert_array_equal(t.lookup(ids), before)
        edge = np.full((2, 4), 65504.0, np.float32)  # float16's largest finite value is fine
        t.update(ids, -edge)
        np.testing.assert_array_equal(t.lookup(ids), -edge)
    with embstore.open(tmp_path / "s") as store:  # nothing refused was logged for replay
        np.testing.assert_array_equal(store["t"].lookup(ids), -edge)


_F32_MAX = float(np.finfo(np.float32).max)
_finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@given(_finite32, _finite32, st.integers(1, 9))
@example(-_F32_MAX, _F32_MAX, 4)
@example(_F32_MAX, -_F32_MAX, 9)
@example(-3e38, 3e38, 2)
@example(0.0, 1.1754944e-38, 8)  # subnormal steps: 1 / scale overflowed float32, rows decoded as garbage
def test_int8_rows_spanning_most_of_float32_round_trip_within_the_bound(a: float, b: float, dim: int) -> None:
    x = np.linspace(a, b, dim, dtype=np.float64).astype(np.float32)[None, :]
    i8 = RowFormat(dim, "int8")
    got = i8.decode(i8.encode(x))
    assert np.isfinite(got).all()
    spread = float(x.max()) - float(x.min())
    err = np.abs(got.astype(np.float64) - x.astype(np.float64)).max()
    assert err <= spread / 510 * 1.001 + 1e-6 * np.abs(x.astype(np.float64)).max() + 1e-38


def test_qr_hashed_table_pools_an_empty_batch(tmp_path) -> None:
    cfg = TableConfig("t", 20, 4, hash={"kind": "qr", "collisions": 4},
                      tiers=(TierConfig("dram", 1 << 10, "lru"), TierConfig("mmap")))
    with embstore.create(tmp_path / "s", StoreConfig((cfg,))) as store:
        t = store["t"]
        empty = np.array([], np.int64)
        for offsets, bags in (([0], 0), ([0, 0], 1), ([0, 0, 0], 2)):
            out = t.lookup_pooled(empty, np.array(offsets, np.int64), mode="mean")
            assert out.shape == (bags, 4) and not out.any()
        out = t.lookup_pooled(torch.tensor([], dtype=torch.int64), torch.tensor([0, 0]))
        assert isinstance(out, torch.Tensor) and tuple(out.shape) == (1, 4)


def test_bfloat16_torch_rows_are_accepted_as_floats(table) -> None:
    rows = torch.tensor([[1.5, -2.0, 0.25, 8.0]], dtype=torch.bfloat16)
    table.update(torch.tensor([5]), rows)
    np.testing.assert_array_equal(table.lookup(np.array([5], np.int64)), rows.float().numpy())
    with pytest.raises(embstore.InvalidInputError, match="int64"):
        table.lookup(torch.tensor([5.0], dtype=torch.bfloat16))
    with pytest.raises(embstore.InvalidInputError, match="float8"):  # no numpy twin: a typed error
        table.update(torch.tensor([5]), torch.zeros((1, 4), dtype=torch.float8_e4m3fn))


def test_a_refused_create_table_changes_nothing_and_the_store_reopens(tmp_path) -> None:
    store = embstore.create(tmp_path / "s", StoreConfig.from_toml(BASE))
    too_small = TableConfig("v", 10, 4, tiers=(TierConfig("dram", 8, "lru"), TierConfig("mmap")))
    with pytest.raises(embstore.ConfigError, match="capacity"):
        store.create_table(too_small)
    assert "v" not in store and not (tmp_path / "s" / "tables" / "v").exists()
    store.create_table(TableConfig("w", 10, 4, tiers=(TierConfig("mmap"),)))  # persists the manifest again
    store.create_table(TableConfig("v", 10, 2, tiers=(TierConfig("mmap"),)))  # the refused name is free
    store["v"].update(np.array([3], np.int64), np.ones((1, 2), np.float32))
    store.close()
    with embstore.open(tmp_path / "s") as s:
        assert sorted(s.tables) == ["t", "v", "w"]
        assert s["v"].lookup(np.array([3], np.int64)).tolist() == [[1.0, 1.0]]


@pytest.mark.parametrize("entry", [{}, {"dir": 5}, {"dir": "../../elsewhere", "state_dim": 0}, [],
                                   {"dir": "tables/t", "state_dim": "a"}, {"dir": "tables/t", "state_dim": -3},
                                   {"dir": "tables/t", "state_dim": True}, None])
def test_a_damaged_manifest_entry_is_a_corrupt_store(tmp_path, entry) -> None:
    embstore.create(tmp_path / "s", StoreConfig.from_toml(BASE)).close()
    manifest = tmp_path / "s" / "manifest.json"
    manifest.write_text(json.dumps({"format": "embstore/1", "tables": {"t": entry}}))
    with pytest.raises(embstore.CorruptStoreError, match="entry of table 't'"):
        embstore.open(tmp_path / "s")
    assert not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize("edit", [("dim = 4", "dim = 8\ndtype = \"float16\""), ("dim = 4", "dim = 8\ndtype = \"int8\""),
                                  ("num_embeddings = 100", "num_embeddings = 90"),
                                  ("seed = 0 }", "seed = 1 }"),  # never-written rows would read otherwise
                                  ('hash = { kind = "none" }', 'hash = { kind = "mod", seed = 3 }')])  # ids, rows
def test_reopening_with_another_table_layout_is_refused_even_by_a_rocksdb_home(tmp_path, edit) -> None:
    toml = BASE.replace("dim = 8", "dim = 4").replace('{ kind = "ssd" }', '{ kind = "rocksdb" }')
    with embstore.create(tmp_path / "s", StoreConfig.from_toml(toml)) as store:
        store["t"].update(np.array([1], np.int64), np.ones((1, 4), np.float32))  # 16-byte rows
    path = tmp_path / "s" / "config.toml"
    path.write_text(path.read_text().replace('dtype = "float32"\n', "").replace(*edit))
    with pytest.raises(embstore.CorruptStoreError, match="created with another layout"):
        embstore.open(tmp_path / "s")
    tiers_only = StoreConfig.from_toml(toml.replace('capacity = "1KiB"', 'capacity = "2KiB"'))
    path.write_text(tiers_only.to_toml())  # the tiers may change
    with embstore.open(tmp_path / "s") as store:
        assert store["t"].lookup(np.array([1], np.int64)).tolist() == [[1.0] * 4]


def test_a_failed_open_releases_the_tables_it_opened(tmp_path) -> None:
    cfg = StoreConfig((TableConfig("a", 20, 4, tiers=(TierConfig("mmap"),)),
                       TableConfig("b", 20, 4, tiers=(TierConfig("rocksdb"),))))
    with embstore.create(tmp_path / "s", cfg) as store:
        store["a"].update(np.array([2], np.int64), np.ones((1, 4), np.float32))
    home_b = tmp_path / "s" / "tables" / "b" / "home"
    (home_b / "CURRENT").rename(home_b / "CURRENT.bak")
    with pytest.raises(embstore.CorruptStoreError, match="not a RocksDB database"):
        embstore.open(tmp_path / "s")
    (home_b / "CURRENT.bak").rename(home_b / "CURRENT")  # repaired: the same process opens it again
    with embstore.open(tmp_path / "s") as store:
        assert store["a"].lookup(np.array([2], np.int64)).tolist() == [[1.0] * 4]


@pytest.mark.parametrize("line, key", [('init = "uniform"', "init"), ("init = 5", "init"), ('hash = "mod"', "hash"),
                                       ('hash = { kind = "learned", mapping = 5 }', "hash.mapping")])
def test_init_and_hash_must_be_tables_with_a_string_mapping(line, key) -> None:
    """``init = "uniform"`` or ``hash = "mod"`` passed validation and crashed later with an AttributeError
    (``create`` printed a traceback); a numeric mapping path crashed with a TypeError."""
    with pytest.raises(embstore.ConfigError) as err:
        StoreConfig.from_toml(BASE.replace("dim = 8", f"dim = 8\n{line}"))
    assert err.value.key == key


def test_a_config_path_with_a_bracket_is_read_as_a_file(tmp_path) -> None:
    """A one-line string with a '[' was taken for TOML text, so ``create(path, "runs[1].toml")`` failed
    with "not valid TOML"."""
    path = tmp_path / "runs[1].toml"
    path.write_text(BASE)
    assert StoreConfig.from_toml(str(path)) == StoreConfig.from_toml(BASE)
    with embstore.create(tmp_path / "s", str(path)) as store:
        assert list(store.tables) == ["t"]
    (tmp_path / "plain.toml").write_text(BASE)
    with pytest.raises(embstore.ConfigError, match="does not exist"):  # a file where a folder should be
        StoreConfig.from_toml(str(tmp_path / "plain.toml" / "c.toml"))


_POOL_DIMS = (1, 3, 8, 33, 130)


@pytest.fixture(scope="module")
def pool_stores(tmp_path_factory):
    """One table per tier layout (a small LRU cache, a whole-table DRAM slab, a bare mmap home) per dim,
    every row written with known values."""
    base = tmp_path_factory.mktemp("pool")
    rows = 40
    layouts = {"lru": lambda d: (TierConfig("dram", 8 * d * 4, "lru"), TierConfig("mmap")),
               "full": lambda d: (TierConfig("dram", rows * d * 4), TierConfig("mmap")),
               "mmap": lambda d: (TierConfig("mmap"),)}
    w = {d: np.random.default_rng(d).standard_normal((rows, d)).astype(np.float32) * 1e3 for d in _POOL_DIMS}
    stores = {}
    for name, tiers in layouts.items():
        s = embstore.create(base / name, StoreConfig(tuple(TableConfig(f"t{d}", rows, d, tiers=tiers(d))
                                                           for d in _POOL_DIMS)))
        for d in _POOL_DIMS:
            s[f"t{d}"].update(np.arange(rows), w[d])
        stores[name] = s
    yield stores, w
    for s in stores.values():
        s.close()


@given(st.lists(st.integers(0, 39), max_size=70), st.lists(st.integers(0, 70), max_size=6), st.booleans(),
       st.sampled_from(["sum", "mean"]), st.sampled_from(["lru", "full", "mmap"]), st.sampled_from(_POOL_DIMS),
       st.sampled_from(["numpy", "torch", "strided numpy", "strided torch"]))
@example([], [], False, "mean", "lru", 3, "numpy")  # one empty bag
@example([5] * 70, [0, 70, 70], True, "mean", "full", 130, "strided torch")  # one id throughout, empty bags
def test_pooled_lookup_is_bit_equal_to_torch_embedding_bag(pool_stores, ids, cuts, same, mode, layout, dim,
                                                           kind) -> None:
    """Every pooling path (torch's kernel on a resident slab, the numba kernel over deduplicated rows) gives
    torch's embedding_bag bit for bit, sums and means alike; empty bags are zeros."""
    stores, w = pool_stores
    ids = np.array([ids[0]] * len(ids) if same and ids else ids, np.int64)
    offsets = np.array([0, *sorted(c for c in cuts if c <= len(ids)), len(ids)], np.int64)
    want = torch.nn.functional.embedding_bag(torch.from_numpy(ids), torch.from_numpy(w[dim]),
                                             torch.from_numpy(offsets), mode=mode, include_last_offset=True)
    a, o = (np.repeat(ids, 2)[::2], np.repeat(offsets, 2)[::2]) if kind.startswith("strided") else (ids, offsets)
    if kind.endswith("torch"):
        a, o = (torch.from_numpy(np.repeat(ids, 2))[::2], torch.from_numpy(np.repeat(offsets, 2))[::2]) \
            if kind.startswith("strided") else (torch.from_numpy(a), torch.from_numpy(o))
    got = stores[layout][f"t{dim}"].lookup_pooled(a, o, mode)
    assert isinstance(got, torch.Tensor) == kind.endswith("torch")
    got = got.numpy() if isinstance(got, torch.Tensor) else got
    assert got.shape == (len(offsets) - 1, dim) and got.dtype == np.float32
    np.testing.assert_array_equal(got, want.numpy())
    assert not got[np.diff(offsets) == 0].any()


@pytest.mark.parametrize("layout", ["lru", "full", "mmap"])
def test_pooled_lookup_on_the_threaded_kernel_path_is_bit_equal_to_torch(pool_stores, layout) -> None:
    """Batches past PARALLEL_MIN_ITEMS split their bags over threads: still torch's sums and means exactly."""
    stores, w = pool_stores
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 40, 40_000)
    offsets = np.array([0, 1, 1, 25_000, 39_999, 40_000], np.int64)
    for mode in ("sum", "mean"):
        want = torch.nn.functional.embedding_bag(torch.from_numpy(ids), torch.from_numpy(w[33]),
                                                 torch.from_numpy(offsets), mode=mode, include_last_offset=True)
        np.testing.assert_array_equal(stores[layout]["t33"].lookup_pooled(ids, offsets, mode), want.numpy())


def test_pooled_lookup_of_read_only_ids_warns_nothing(tmp_path) -> None:
    """A server parses binary requests in place (read-only arrays); the resident pooled path must not
    hand them to torch, which warns (once per process: so a fresh one is used here)."""
    import subprocess
    import sys

    script = f"""
import warnings, numpy as np, embstore
from embstore.config import StoreConfig, TableConfig, TierConfig
warnings.simplefilter("error")
cfg = StoreConfig((TableConfig("t", 100, 4, tiers=(TierConfig("dram", 100 * 16, "lru"), TierConfig("mmap"))),))
with embstore.create({str(tmp_path / "s")!r}, cfg) as s:
    ids = np.frombuffer(np.array([1, 2, 3, 2], np.int64).tobytes(), np.int64)
    offsets = np.frombuffer(np.array([0, 2, 4], np.int64).tobytes(), np.int64)
    rows = s["t"].lookup(np.array([1, 2, 3]))  # now resident: the pooled call takes torch's fast path
    got = s["t"].lookup_pooled(ids, offsets, "sum")
    assert np.array_equal(got, np.stack([rows[0] + rows[1], rows[2] + rows[1]]))
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize("home", ["ssd", "rocksdb", "mmap"])
def test_a_table_only_read_can_still_be_laid_out_for_optimizer_state(tmp_path, home: str) -> None:
    """Reading a fresh table caches its initial rows; that is not a write: training it afterwards
    re-lays it out (it was refused as a table that "holds rows") and reads the same initial rows. A
    written row, dirty in the cache or flushed home, still refuses the change."""
    cfg = TableConfig("t", 50, 4, tiers=(TierConfig("dram", 20 * 16, "lru"), TierConfig(home)))
    store = embstore.create(tmp_path / "s", StoreConfig((cfg,)))
    ids = np.arange(0, 50, 3, dtype=np.int64)
    before = store["t"].lookup(ids)
    assert store["t"].hierarchy.caches[0].resident_rows > 0
    t = store.ensure_state_dim("t", 1)
    assert t.format.state_dim == 1
    np.testing.assert_array_equal(t.lookup(ids), before)
    t.update(ids[:2], np.ones((2, 4), np.float32))  # dirty in the cache only
    with pytest.raises(embstore.TableExistsError, match="optimizer-state"):
        store.ensure_state_dim("t", 2)
    store.flush()  # now in the home, clean in the cache
    with pytest.raises(embstore.TableExistsError, match="optimizer-state"):
        store.ensure_state_dim("t", 2)
    np.testing.assert_array_equal(store["t"].lookup(ids[:2]), np.ones((2, 4), np.float32))
    store.close()
