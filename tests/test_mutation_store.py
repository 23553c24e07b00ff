"""Store metadata, config, bulk import/export and rocksdb-home behaviours that hand-made mutations of
``embstore/store.py``, ``config.py``, ``bulk.py``, ``atomic.py``, ``tiers/rocksdb.py``, ``tiers/factory.py``
and ``commands/store_cmds.py`` showed no test pinned down (session 11 mutation audit)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import embstore
from embstore.atomic import atomic_write
from embstore.config import StoreConfig, TableConfig, TierConfig
from embstore.tiers.factory import build_tiers

DIM = 4
ROWS = 64


def table_cfg(name: str, home: TierConfig, **kw) -> TableConfig:
    return TableConfig(name, ROWS, DIM, tiers=(TierConfig("dram", 8 * DIM * 4, "lru"), home), **kw)


def rows_of(ids: np.ndarray, value: float = 1.0) -> np.ndarray:
    return (np.arange(len(ids) * DIM, dtype=np.float32).reshape(-1, DIM) + value)


def test_create_table_clears_the_debris_of_an_interrupted_attempt(tmp_path) -> None:
    """A table folder the manifest does not name is debris (a create_table that died after building the
    tiers): a new create_table of that name, here with another home, starts from it cleared."""
    with embstore.create(tmp_path / "s", StoreConfig((table_cfg("t", TierConfig("ssd")),))) as store:
        debris = store.path / "tables" / "u"
        _, home = build_tiers((TierConfig("ssd"),), DIM * 4, ROWS, debris)  # what the died attempt built
        home.close()
        u = store.create_table(table_cfg("u", TierConfig("rocksdb")))
        ids = np.array([1, 9], np.int64)
        u.update(ids, rows_of(ids))
        np.testing.assert_array_equal(u.lookup(ids), rows_of(ids))


def test_a_table_added_to_the_config_by_hand_starts_from_a_cleared_folder(tmp_path) -> None:
    """open() adopts a config table the manifest lacks (a create_table that died between the two files)
    after deleting what its folder holds: here an ssd home's files where the config names rocksdb."""
    one = StoreConfig((table_cfg("t", TierConfig("ssd")),))
    embstore.create(tmp_path / "s", one).close()
    _, home = build_tiers((TierConfig("ssd"),), DIM * 4, ROWS, tmp_path / "s" / "tables" / "u")
    home.close()
    two = StoreConfig((*one.tables, table_cfg("u", TierConfig("rocksdb"))))
    (tmp_path / "s" / "config.toml").write_text(two.to_toml())
    ids = np.array([0, 63], np.int64)
    with embstore.open(tmp_path / "s") as store:
        store["u"].update(ids, rows_of(ids))
    with embstore.open(tmp_path / "s") as store:
        np.testing.assert_array_equal(store["u"].lookup(ids), rows_of(ids))


def test_a_manifest_table_missing_from_the_config_is_a_corrupt_store(tmp_path) -> None:
    """A table the manifest lists but config.toml lacks (edited away by hand) is refused, not silently
    dropped from the store with its rows."""
    two = StoreConfig((table_cfg("t", TierConfig("ssd")), table_cfg("u", TierConfig("ssd"))))
    embstore.create(tmp_path / "s", two).close()
    (tmp_path / "s" / "config.toml").write_text(StoreConfig(two.tables[:1]).to_toml())
    with pytest.raises(embstore.CorruptStoreError, match="lacks table 'u'"):
        embstore.open(tmp_path / "s")


@pytest.mark.parametrize("depth,ok", [(1, True), (4096, True), (0, False), (4097, False)])
def test_queue_depth_bounds_are_inclusive(depth: int, ok: bool) -> None:
    """An ssd home's queue_depth may be anything in [1, 4096], both ends included."""
    if ok:
        assert TierConfig("ssd", queue_depth=depth).queue_depth == depth
    else:
        with pytest.raises(embstore.ConfigError, match="tiers.queue_depth"):
            TierConfig("ssd", queue_depth=depth)


def test_a_dense_home_holds_up_to_2_to_the_40_rows() -> None:
    """2**40 rows still fit a dense (ssd) home; one more needs rocksdb."""
    assert TableConfig("t", 2**40, 4).num_embeddings == 2**40
    with pytest.raises(embstore.ConfigError, match="table.num_embeddings"):
        TableConfig("t", 2**40 + 1, 4)
    assert TableConfig("t", 2**40 + 1, 4, tiers=(TierConfig("rocksdb"),)).num_embeddings == 2**40 + 1


@pytest.mark.parametrize("tiers,key", [
    ((TierConfig("rocksdb"), TierConfig("ssd")), "tiers.kind"),  # a home kind as a cache
    ((TierConfig("ssd"), TierConfig("rocksdb")), "tiers.kind"),
])
def test_a_home_kind_is_refused_as_a_cache(tiers, key: str) -> None:
    """Only the last tier may be an ssd or rocksdb home."""
    with pytest.raises(embstore.ConfigError) as err:
        TableConfig("t", 10, 4, tiers=tiers)
    assert err.value.key == key


def test_a_policy_names_tinylfu_at_most_once() -> None:
    """'lru+tinylfu+tinylfu' is a typo, refused rather than read as 'lru+tinylfu'."""
    with pytest.raises(embstore.ConfigError, match="policy"):
        embstore.config.PolicySpec.parse("lru+tinylfu+tinylfu")
    assert str(embstore.config.PolicySpec.parse("tinylfu+lfu")) == "lfu+tinylfu"


def test_init_scale_zero_is_allowed() -> None:
    """scale = 0 (every never-written row zero) is a valid init; a negative scale is not."""
    assert embstore.InitConfig("uniform", 0).scale == 0.0
    with pytest.raises(embstore.ConfigError, match="init.scale"):
        embstore.InitConfig("uniform", -0.5)


@pytest.mark.parametrize("name", [".", "..", ".hidden", "-x", "a/b", "", "x" * 129])
def test_table_names_that_are_not_plain_folder_names_are_refused(name: str) -> None:
    """A table's name is its folder under tables/: '..' (the store itself), a hidden or path-like name
    is refused."""
    with pytest.raises(embstore.ConfigError, match="table.name"):
        TableConfig(name, 10, 4)


def test_atomic_write_syncs_the_data_before_the_rename_and_the_folder_after(tmp_path, monkeypatch) -> None:
    """The temp file is fsynced before os.replace (else a power cut can leave the new name on empty
    data) and the folder after it (else the rename itself may be lost). A power cut cannot be caused in
    a test, so the fsync and replace calls are observed instead, in order."""
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("fsync " + os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def replace(src, dst) -> None:
        events.append(f"replace {dst}")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    atomic_write(tmp_path / "f", b"data")
    monkeypatch.undo()
    assert (tmp_path / "f").read_bytes() == b"data"
    temp = [e for e in events if e.startswith("fsync ") and ".f.tmp" in e]
    assert temp and events.index(temp[-1]) < events.index(f"replace {tmp_path / 'f'}"), events
    assert events[-1] == f"fsync {tmp_path}", events


def test_two_mmap_caches_of_a_table_keep_separate_files(tmp_path) -> None:
    """Each mmap cache level has its own file (cache-<level>.mmap): two levels sharing one would
    overwrite each other's rows."""
    tiers = (TierConfig("mmap", 4 * DIM * 4), TierConfig("mmap", 16 * DIM * 4), TierConfig("ssd"))
    ids = np.arange(ROWS, dtype=np.int64)
    rows = rows_of(ids)
    with embstore.create(tmp_path / "s", StoreConfig((TableConfig("t", ROWS, DIM, tiers=tiers),))) as store:
        store["t"].update(ids, rows)
        for _ in range(2):
            np.testing.assert_array_equal(store["t"].lookup(ids[::-1]), rows[::-1])
    assert sorted(p.name for p in (tmp_path / "s" / "tables" / "t").glob("cache-*")) == ["cache-0.mmap",
                                                                                         "cache-1.mmap"]


class _FlushFailsOnce:
    """A rocksdict handle whose WAL sync fails once, as after a real EIO (which leaves RocksDB's sticky
    background error behind; a loop-device EIO cannot be repaired while the database holds files on it)."""

    def __init__(self, db) -> None:
        self._db = db

    def flush_wal(self, sync: bool) -> None:
        raise Exception("IO error: While fsync: 000003.log: Input/output error")

    def __getattr__(self, name: str):
        return getattr(self._db, name)


def test_a_rocksdb_write_after_a_failed_flush_reopens_the_database_first(tmp_path, monkeypatch) -> None:
    """A failed WAL sync may leave a sticky error in the handle: the next write goes through a fresh
    handle, and every row written before and after reads back after a reopen."""
    from embstore.tiers.rocksdb import RocksDBTier

    tier = RocksDBTier(tmp_path / "db", DIM, write_buffer=1 << 20)
    tier.put(np.array([1], np.int64), np.full((1, DIM), 1, np.uint8))
    tier._db = _FlushFailsOnce(tier._db)
    opened: list[bool] = []
    real_open = tier._open
    monkeypatch.setattr(tier, "_open", lambda read_only=False: opened.append(read_only) or real_open(read_only))
    with pytest.raises(embstore.TierIOError):
        tier.flush()
    tier.put(np.array([2], np.int64), np.full((1, DIM), 2, np.uint8))
    assert opened == [False]
    tier.close()
    tier = RocksDBTier(tmp_path / "db", DIM, write_buffer=1 << 20)
    rows, found = tier.get(np.array([1, 2, 3], np.int64))
    tier.close()
    assert found.tolist() == [True, True, False] and rows[:, 0].tolist() == [1, 2, 0]


@given(st.text(max_size=40).filter(bool), st.sampled_from(["none", "lz4", "zstd", "snappy"]),
       st.sampled_from(["lru", "lfu", "clock", "lru+tinylfu"]), st.integers(1, 4096))
@settings(max_examples=60, deadline=None)
def test_any_config_round_trips_through_toml(mapping: str, compression: str, policy: str, depth: int) -> None:
    """to_toml writes TOML that from_toml reads back as the same config: any mapping path (quotes,
    backslashes, control characters), every policy and tier option."""
    cfg = StoreConfig((
        TableConfig("a", 10, 4, hash={"kind": "learned", "mapping": mapping},
                    tiers=(TierConfig("dram", 4096, policy), TierConfig("ssd", queue_depth=depth, layout="log"))),
        TableConfig("b", 10, 4, init=embstore.InitConfig("normal", 0.5, 7),
                    tiers=(TierConfig("mmap", 4096, policy), TierConfig("rocksdb", compression=compression))),
    ))
    assert StoreConfig.from_toml(cfg.to_toml()) == cfg


def test_a_database_of_another_kind_in_a_rocksdb_home_is_a_corrupt_store(tmp_path) -> None:
    """A RocksDB database written by another program (rocksdict's own comparator: RocksDB says "Invalid
    argument") is a store damaged, not a disk failing."""
    import rocksdict

    from embstore.tiers.rocksdb import RocksDBTier

    rocksdict.Rdict(str(tmp_path / "db")).close()
    with pytest.raises(embstore.CorruptStoreError, match="not a readable RocksDB database"):
        RocksDBTier(tmp_path / "db", DIM, write_buffer=1 << 20)


@pytest.fixture
def store_dir(tmp_path) -> Path:
    tiers = (TierConfig("dram", 8 * DIM * 4, "lru"), TierConfig("ssd"))
    embstore.create(tmp_path / "s", StoreConfig((TableConfig("t", ROWS, DIM, tiers=tiers),))).close()
    return tmp_path / "s"


def test_import_may_fill_the_table_to_its_last_row(store_dir, tmp_path) -> None:
    """Rows start..start+n-1 may end at the table's last row; one more is refused, nothing written."""
    from embstore.bulk import import_rows

    rows = np.arange(4 * DIM, dtype=np.float32).reshape(4, DIM)
    np.save(tmp_path / "r.npy", rows)
    with embstore.open(store_dir) as store:
        assert import_rows(store["t"], tmp_path / "r.npy", start=ROWS - 4) == 4
        np.testing.assert_array_equal(store["t"].lookup(np.arange(ROWS - 4, ROWS)), rows)
        before = store["t"].lookup(np.arange(ROWS))
        with pytest.raises(embstore.InvalidInputError, match="do not fit"):
            import_rows(store["t"], tmp_path / "r.npy", start=ROWS - 3)
        np.testing.assert_array_equal(store["t"].lookup(np.arange(ROWS)), before)


def test_imported_rows_are_durable_when_import_returns(store_dir, tmp_path) -> None:
    """import_rows flushes: a SIGKILL right after it returns (a copy of the folder: the page cache
    outlives the process) keeps every imported row, though they sat in the DRAM cache."""
    from embstore.bulk import import_rows

    rows = np.arange(6 * DIM, dtype=np.float32).reshape(6, DIM) + 0.5
    np.save(tmp_path / "r.npy", rows)
    with embstore.open(store_dir) as store:
        import_rows(store["t"], tmp_path / "r.npy", start=10)
        shutil.copytree(store_dir, tmp_path / "killed")
    with embstore.open(tmp_path / "killed") as store:
        np.testing.assert_array_equal(store["t"].lookup(np.arange(10, 16)), rows)


@pytest.mark.parametrize("n", [0, 1, 37, ROWS])
def test_export_writes_exactly_the_first_n_rows_and_reports_them(store_dir, tmp_path, n: int) -> None:
    """export_rows(rows=n) writes rows 0..n-1 as they read (the initial value of never-written ones),
    and its progress callbacks add up to n; n above the table is refused and writes no file."""
    from embstore.bulk import export_rows

    with embstore.open(store_dir) as store:
        t = store["t"]
        ids = np.array([0, 5, 36, 63], np.int64)
        t.update(ids, rows_of(ids, 3.0))
        seen: list[int] = []
        assert export_rows(t, tmp_path / "out.npy", rows=n, progress=seen.append) == n
        np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), t.lookup(np.arange(n)).reshape(n, DIM))
        assert sum(seen) == n
        with pytest.raises(embstore.InvalidInputError, match="rows must be in"):
            export_rows(t, tmp_path / "over.npy", rows=ROWS + 1)
    assert not (tmp_path / "over.npy").exists()


def test_import_progress_adds_up_to_the_rows_imported(store_dir, tmp_path) -> None:
    """The import's progress callbacks add up to the rows in the file."""
    from embstore.bulk import import_rows

    np.save(tmp_path / "r.npy", np.ones((9, DIM), np.float32))
    seen: list[int] = []
    with embstore.open(store_dir) as store:
        import_rows(store["t"], tmp_path / "r.npy", progress=seen.append)
    assert sum(seen) == 9


def test_cli_export_rows_limits_the_dump(store_dir, tmp_path, capsys) -> None:
    """`embstore export --rows N` writes the first N rows only, as the store reads them."""
    from embstore.cli import main

    assert main(["export", str(store_dir), "t", str(tmp_path / "out.npy"), "--rows", "7"]) == 0
    assert "exported 7 rows" in capsys.readouterr().out
    with embstore.open(store_dir) as store:
        np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), store["t"].lookup(np.arange(7)))


def test_cli_export_into_a_missing_folder_is_a_usage_error(store_dir, tmp_path, capsys) -> None:
    """An export target whose folder does not exist exits 2 (bad arguments) naming that folder, not 1
    (a failure of the store)."""
    from embstore.cli import main

    target = tmp_path / "no" / "such" / "out.npy"
    assert main(["export", str(store_dir), "t", str(target)]) == 2
    assert f"{target.parent} is not a directory" in capsys.readouterr().err
    assert not target.parent.exists()


def test_a_created_store_holds_no_creating_mark(store_dir) -> None:
    """create() removes its .creating mark once the manifest is in place: a store as created holds only
    its config, manifest, tables and log."""
    assert not (store_dir / ".creating").exists()
    assert {"config.toml", "manifest.json", "tables"} <= {p.name for p in store_dir.iterdir()}


def test_the_log_replayed_at_open_is_not_replayed_again_over_newer_rows(store_dir, tmp_path) -> None:
    """open() replays the write-ahead log, flushes and drops it: rows imported (and flushed) after that
    open survive a later crash, rather than being overwritten by a second replay of the old writes.
    Crashes are copies of the folder (the page cache outlives a SIGKILL)."""
    from embstore.bulk import import_rows

    ids = np.array([3, 4], np.int64)
    store = embstore.open(store_dir)
    store.update_logged("t", ids, rows_of(ids, 1.0))
    store.sync_log()
    shutil.copytree(store_dir, tmp_path / "crash1")
    store.close()
    np.save(tmp_path / "new.npy", rows_of(ids, 9.0))
    store = embstore.open(tmp_path / "crash1")
    np.testing.assert_array_equal(store["t"].lookup(ids), rows_of(ids, 1.0))  # replayed
    import_rows(store["t"], tmp_path / "new.npy", start=3)  # flushed when it returns
    shutil.copytree(tmp_path / "crash1", tmp_path / "crash2")
    store.close()
    with embstore.open(tmp_path / "crash2") as store:
        np.testing.assert_array_equal(store["t"].lookup(ids), rows_of(ids, 9.0))


@pytest.mark.parametrize("fmt", ["embstore/2", None])
def test_a_manifest_of_another_format_is_refused(store_dir, fmt) -> None:
    """A manifest whose format is not embstore/1 (a newer version, or none) is refused at open rather
    than read as if it were one."""
    path = store_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["format"] = fmt
    path.write_text(json.dumps(manifest))
    with pytest.raises(embstore.CorruptStoreError, match="not an embstore/1 manifest"):
        embstore.open(store_dir)


@pytest.mark.parametrize("home", ["ssd", "mmap", "rocksdb"])
def test_a_home_given_a_capacity_in_python_is_refused(home: str) -> None:
    """The home holds every row: a capacity on it is refused from Python too, not only from TOML (where
    the key check catches it first)."""
    with pytest.raises(embstore.ConfigError) as err:
        TableConfig("t", 10, 4, tiers=(TierConfig(home, capacity=4096),))
    assert err.value.key == "tiers.capacity"


def test_a_learned_hash_needs_a_mapping() -> None:
    """kind = 'learned' without a mapping file is a config error naming hash.mapping (a store would
    otherwise fail at create with a TypeError)."""
    with pytest.raises(embstore.ConfigError, match="hash.mapping"):
        embstore.HashConfig("learned")
