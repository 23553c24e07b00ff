"""The rocksdb home, the table's entry points and the cache hierarchy pinned where a session 13 mutation
audit of ``tiers/rocksdb.py``, ``embstore/table.py`` and ``embstore/hierarchy.py`` found no test: each test
names the mutants it kills and the behaviour it pins, against a simple reference (a RocksDB-style log
writer, a dict of rows, numpy)."""

from __future__ import annotations

import contextlib
import struct

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import embstore
from embstore.config import HashConfig, StoreConfig, TableConfig, TierConfig
from embstore.errors import (ConfigError, CorruptStoreError, DiskFullError, InvalidInputError, InvalidRowsError,
                             TierIOError)
from embstore.hierarchy import Hierarchy
from embstore.tiers.cache import DRAMTier
from embstore.tiers import rocksdb as rocksdb_module
from embstore.tiers.rocksdb import RocksDBTier
from faultfs import Tmpfs, needs_mount
from test_hierarchy import ROW, FlakyHome, initial
from test_mutation_store import _FlushFailsOnce
from test_rocksdb_hardening import RB, SMALL, _FullDisk, _check, _make, _manifest

# -- the manifest check: RocksDB's log framing ---------------------------------------------------------

BLOCK, HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def write_log(records: list[int | tuple[str, int]]) -> tuple[bytes, list[tuple[int, int, int]]]:
    """A log file framed like RocksDB's ``log::Writer::AddRecord`` and its fragments (start, end, type).

    A record is a payload length, or ("leave", k): a payload that leaves exactly k bytes in its block,
    so headers land at the block's very end. A block with fewer than 7 bytes left is zero-padded; a
    record that does not fit is split into FIRST, MIDDLE..., LAST fragments (a FIRST of no payload when
    exactly a header's room is left)."""
    out, frags = bytearray(), []
    for rec in records:
        if isinstance(rec, tuple):
            off = len(out) % BLOCK
            off = 0 if BLOCK - off < HEADER else off
            rec = max(0, BLOCK - off - HEADER - rec[1])
        left, begin = rec, True
        while True:
            if BLOCK - len(out) % BLOCK < HEADER:
                out += bytes(BLOCK - len(out) % BLOCK)
            n = min(left, BLOCK - len(out) % BLOCK - HEADER)
            end = n == left
            kind = FULL if begin and end else FIRST if begin else LAST if end else MIDDLE
            start = len(out)
            out += struct.pack("<IHB", 0xDEADBEEF, n, kind) + bytes([kind]) * n
            frags.append((start, len(out), kind))
            left, begin = left - n, False
            if end:
                break
    return bytes(out), frags


def torn_at(frags: list[tuple[int, int, int]], cut: int) -> int | None:
    """Reference: the file offset of the fragment a cut at ``cut`` leaves incomplete (cut inside it, or
    ending a record's FIRST or MIDDLE fragment), None when the file ends after a whole record."""
    for start, end, kind in frags:
        if start < cut < end or (cut == end and kind in (FIRST, MIDDLE)):
            return start
    return None


records = st.lists(st.one_of(st.integers(0, 200), st.integers(0, 3 * BLOCK),
                             st.tuples(st.just("leave"), st.integers(0, 9))), min_size=1, max_size=10)


@settings(max_examples=300, deadline=None)
@given(records, st.data())
def test_torn_record_matches_a_reference_log_walk(recs, data) -> None:
    """Kills R04 (a file ending 7 bytes after a header taken for a cut header), R07 (a header cut
    in the last 7 bytes of a block read as padding), R08 (a record cut after a MIDDLE fragment taken as
    whole). The check walks only the last 32 KiB block; the reference walks the whole file the way
    RocksDB wrote it. Cuts are drawn anywhere and near every fragment boundary and block end."""
    log, frags = write_log(recs)
    marks = sorted({b for s, e, _ in frags for b in (s, e)} | set(range(BLOCK, len(log) + 1, BLOCK)))
    cut = data.draw(st.one_of(st.integers(1, len(log)),
                              st.builds(lambda m, d: min(max(m + d, 1), len(log)),
                                        st.sampled_from(marks), st.integers(-8, 8))))
    start = (cut - 1) // BLOCK * BLOCK
    got = rocksdb_module._torn_record(log[start:cut])
    want = torn_at(frags, cut)
    assert got == (None if want is None else want - start), (cut, frags)


def test_torn_record_edge_cases() -> None:
    """The named cases behind R04/R07/R08, as plain examples: an empty record ends a file whole; a
    header cut in a block's last 7 bytes is torn; a record spanning three blocks cut at the end of its
    MIDDLE fragment is torn."""
    log, frags = write_log([10, 0])
    assert rocksdb_module._torn_record(log) is None
    log, frags = write_log([("leave", 7), 5])  # the second record's header starts 7 bytes before the block end
    head = frags[1][0]
    assert head == BLOCK - HEADER and rocksdb_module._torn_record(log[:head + 3]) == head
    log, frags = write_log([3 * BLOCK])
    assert [k for _, _, k in frags] == [FIRST, MIDDLE, MIDDLE, LAST]
    assert rocksdb_module._torn_record(log[BLOCK:2 * BLOCK]) == 0


# -- back-off while the disk stays full -----------------------------------------------------------------

TINY = 4 << 20  # the tiny_tmpfs fixture's size


@needs_mount
def test_freeing_exactly_one_mib_lets_the_next_write_try_at_once(tiny_tmpfs: Tmpfs, monkeypatch) -> None:
    """Kills R14 (``>`` for ``>=`` against the 1 MiB freed): one page short of 1 MiB freed, writes still
    fail fast inside the window (the clock stands still); exactly 1 MiB freed, the next write reopens."""
    disk = _FullDisk(tiny_tmpfs, monkeypatch)
    disk.fill_until_a_reopen_fails()
    disk.fs.resize(TINY + rocksdb_module._FREED_BYTES - 4096)
    disk.refused_without_reopen()
    disk.fs.resize(TINY + rocksdb_module._FREED_BYTES)
    opens = disk.opens
    with contextlib.suppress(DiskFullError):  # the reopen may find too little space still: it tried
        disk.put()
    assert disk.opens == opens + 1
    _check(disk.tier, disk.model)


@needs_mount
def test_an_empty_write_on_a_full_disk_is_a_no_op(tiny_tmpfs: Tmpfs, monkeypatch) -> None:
    """Kills R27 (the empty-batch return dropped): a put or delete of no rows writes nothing, so it neither
    tries a reopen nor fails with DiskFullError while writes back off."""
    disk = _FullDisk(tiny_tmpfs, monkeypatch)
    disk.fill_until_a_reopen_fails()
    opens = disk.opens
    disk.tier.put(np.empty(0, np.int64), np.empty((0, disk.tier.row_bytes), np.uint8))
    disk.tier.delete(np.empty(0, np.int64))
    assert disk.opens == opens
    disk.refused_without_reopen()  # still backing off: the empty writes changed nothing
    _check(disk.tier, disk.model)


# -- opening and closing ----------------------------------------------------------------------------------


def test_a_current_naming_two_manifests_is_damage_of_current(tmp_path) -> None:
    """Kills R36 (``match`` for ``fullmatch``): CURRENT must hold exactly one manifest name on one line; one
    with a second line is reported as a damaged CURRENT (not as a missing file of a made-up name), and
    the refused open changes no file."""
    path = tmp_path / "db"
    _make(path, flushes=1)
    name = _manifest(path).name
    (path / "CURRENT").write_text(f"{name}\n{name}\n")
    with pytest.raises(CorruptStoreError, match="CURRENT is damaged"):
        RocksDBTier(path, RB, **SMALL)
    assert (path / "CURRENT").read_text() == f"{name}\n{name}\n"


def test_a_manifest_deleted_after_the_check_is_a_corrupt_store(tmp_path, monkeypatch) -> None:
    """Kills R33 (RocksDB's "No such file" no longer read as damage): a manifest that vanishes between the
    tier's own check and RocksDB's open (a race no test can time, so the deletion runs right after the
    check) is CorruptStoreError naming the directory, not a retryable TierIOError."""
    path = tmp_path / "db"
    model = _make(path, flushes=1)
    check = RocksDBTier._check_directory
    saved = _manifest(path).read_bytes()
    manifest = _manifest(path)

    def check_then_delete(self, create: bool) -> None:
        check(self, create)
        manifest.unlink()

    monkeypatch.setattr(RocksDBTier, "_check_directory", check_then_delete)
    with pytest.raises(CorruptStoreError, match="not a readable RocksDB database") as info:
        RocksDBTier(path, RB, **SMALL)
    assert str(path) in str(info.value)
    monkeypatch.undo()
    manifest.write_bytes(saved)  # put back, it opens whole: the refused open deleted nothing
    tier = RocksDBTier(path, RB, **SMALL)
    _check(tier, model)
    tier.close()


@pytest.mark.parametrize(("key", "low"), [("write_buffer", 64 << 10), ("block_cache", 0)])
def test_size_limits_are_inclusive(tmp_path, key: str, low: int) -> None:
    """Kills R40/R41 (``<=`` for ``<``): the smallest allowed memtable (64 KiB) and block cache (0, no
    cache) open and hold rows; one byte less is a ConfigError naming the option."""
    with pytest.raises(ConfigError, match=key):
        RocksDBTier(tmp_path / "bad", RB, **{**SMALL, key: low - 1})
    tier = RocksDBTier(tmp_path / "db", RB, **{**SMALL, key: low})
    ids = np.arange(300, dtype=np.int64)
    rows = np.random.default_rng(0).integers(0, 256, (len(ids), RB), np.uint8)
    tier.put(ids, rows)
    tier.raw.flush(True)  # through an SST file, read back through the (absent or tiny) block cache
    got, found = tier.get(ids)
    assert found.all() and np.array_equal(got, rows)
    tier.close()


def test_a_close_whose_wal_sync_fails_still_releases_the_database(tmp_path) -> None:
    """Kills R32 (the handle released only when close succeeds): close raises the failed sync's
    TierIOError, yet the database is unlocked, so this process opens it again and finds every row (the
    sync fails as after a real EIO, which cannot be repaired while the handle holds files on the disk)."""
    path = tmp_path / "db"
    tier = RocksDBTier(path, RB, **SMALL)
    ids = np.arange(5, dtype=np.int64)
    rows = np.full((5, RB), 7, np.uint8)
    tier.put(ids, rows)
    tier._db = _FlushFailsOnce(tier._db)
    with pytest.raises(TierIOError, match="Input/output error"):
        tier.close()
    tier = RocksDBTier(path, RB, **SMALL)
    _check(tier, dict(zip(ids.tolist(), (r.tobytes() for r in rows))))
    tier.close()


# -- the table's entry points -----------------------------------------------------------------------------

DIM, ROWS = 4, 40


def _table(tmp_path, state_dim: int = 0) -> tuple[embstore.Store, embstore.Table]:
    """A table with an 8-row LRU DRAM cache over a 16-row LRU mmap cache over a RocksDB home."""
    rb = 4 * (DIM + state_dim)
    cfg = TableConfig("t", ROWS, DIM, tiers=(TierConfig("dram", 8 * rb, "lru"), TierConfig("mmap", 16 * rb, "lru"),
                                             TierConfig("rocksdb")))
    store = embstore.create(tmp_path / "s", StoreConfig((cfg,)))
    return store, (store.ensure_state_dim("t", state_dim) if state_dim else store["t"])


def test_a_repeated_physical_row_is_named_in_the_refusal(tmp_path) -> None:
    """Kills T02 (the message naming the first id instead of the repeated one): a physical write with a
    repeated row names that row, and writes nothing."""
    store, t = _table(tmp_path, state_dim=1)
    before = t.read_physical(np.arange(ROWS, dtype=np.int64))
    ids = np.array([3, 5, 7, 5], np.int64)
    vals = np.ones((4, DIM), np.float32)
    with pytest.raises(InvalidInputError, match="row 5 appears more than once"):
        t.write_physical(ids, vals)
    with pytest.raises(InvalidInputError, match="row 5 appears more than once"):
        t.write_with_state(ids, vals, np.zeros((4, 1), np.float32))
    np.testing.assert_array_equal(t.read_physical(np.arange(ROWS, dtype=np.int64)), before)
    store.close()


@pytest.mark.parametrize("state", [np.zeros((2, 3), np.float32), np.zeros((2, 1), np.int64),
                                   np.full((2, 2), np.nan, np.float32)])
def test_bad_optimizer_state_is_named_as_such(tmp_path, state) -> None:
    """Kills T04 (the state's error raised as the rows' own): a state of the wrong shape, dtype or with a
    NaN is an InvalidRowsError that says it is about the optimizer state, and nothing is written."""
    store, t = _table(tmp_path, state_dim=2)
    ids = np.array([1, 2], np.int64)
    before = t.read_with_state(ids)
    with pytest.raises(InvalidRowsError, match="^optimizer state: "):
        t.write_with_state(ids, np.ones((2, DIM), np.float32), state)
    after = t.read_with_state(ids)
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1], before[1])
    store.close()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["lookup", "pooled", "update"]),
                          st.lists(st.integers(0, ROWS - 1), min_size=0, max_size=30)), min_size=1, max_size=12))
def test_each_level_sees_the_misses_of_the_level_above_once_per_row(tmp_path_factory, calls) -> None:
    """Kills H07 (misses fetched from the home past the middle level, which then neither counts them nor
    is promoted into) and T34/T35 (the tiers fed every id of a call, repeats included). Per call, the top
    level counts hits + misses = the distinct rows looked up, each lower level (the mmap cache, then the
    home) hits + misses = the misses of the level above; every row reads as a dict model holds it."""
    store, t = _table(tmp_path_factory.mktemp("chain"))
    model = {i: v for i, v in enumerate(t.read_physical(np.arange(ROWS, dtype=np.int64)))}
    kinds = ("dram", "mmap", "rocksdb")
    for n, (op, ids) in enumerate(calls):
        arr = np.array(ids, np.int64)
        before = t.stats()
        if op == "update":
            rows = np.stack([np.full(DIM, 100.0 * n + i, np.float32) for i in ids]) if ids else np.zeros((0, DIM))
            t.update(arr, rows.astype(np.float32))
            model.update(zip(ids, rows.astype(np.float32)))  # a repeated id: the last row wins
            continue
        if op == "lookup":
            got = t.lookup(arr)
            want = np.array([model[i] for i in ids], np.float32).reshape(-1, DIM)
        else:
            offsets = np.array([0, len(ids) // 2, len(ids)], np.int64)
            got = t.lookup_pooled(arr, offsets)
            want = np.array([sum((model[i] for i in ids[a:b]), np.zeros(DIM, np.float32))
                             for a, b in zip(offsets[:-1], offsets[1:])], np.float32)
        np.testing.assert_allclose(got, want, rtol=1e-6)
        after = t.stats()
        d = {k: {c: after[k][c] - before[k][c] for c in ("hits", "misses")} for k in kinds}
        above = len(set(ids))
        for k in kinds:
            assert d[k]["hits"] + d[k]["misses"] == above, (k, d)
            above = d[k]["misses"]
    store.close()



def _bags(rows: np.ndarray, offsets: np.ndarray, mode: str) -> np.ndarray:
    """numpy reference of a pooled lookup: per bag, the sum or mean of its rows (an empty bag is zeros)."""
    out = np.zeros((len(offsets) - 1, rows.shape[1]), np.float64)
    for b, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
        if hi > lo:
            out[b] = rows[lo:hi].sum(0) / (hi - lo if mode == "mean" else 1)
    return out


@pytest.mark.parametrize(("hash_cfg", "cache"), [(HashConfig("mod", seed=3), None), (HashConfig("qr", collisions=4), 8)],
                         ids=["mod-resident", "qr-lru"])
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_pooled_lookups_of_a_hashed_table_pool_its_lookups(tmp_path, hash_cfg, cache, mode: str) -> None:
    """Kills T14 (a mod-hashed resident table pooling the slab rows of the raw ids, not of their hashed
    rows) and T17 (a QR-hashed table always summing its bags). Raw ids are drawn below the table's row
    count, where a raw id is a valid slab row too: each bag is the numpy sum or mean of the rows
    ``lookup`` returns for its ids (empty bags included)."""
    rows_per = 4 * DIM
    cfg = TableConfig("t", ROWS, DIM, hash=hash_cfg,
                      tiers=(TierConfig("dram", rows_per * (cache or ROWS), "lru"), TierConfig("mmap")))
    rng = np.random.default_rng(1)
    with embstore.create(tmp_path / "s", StoreConfig((cfg,))) as store:
        t = store["t"]
        if hash_cfg.kind == "mod":
            t.write_physical(np.arange(ROWS, dtype=np.int64), rng.standard_normal((ROWS, DIM)).astype(np.float32))
            assert t.full_dram_tier() is not None
        else:
            t.write_physical(np.arange(t.num_rows, dtype=np.int64),
                             rng.standard_normal((t.num_rows, DIM)).astype(np.float32))
        ids = rng.integers(0, ROWS, 60).astype(np.int64)
        offsets = np.array([0, 1, 1, 17, 40, 60], np.int64)
        want = _bags(t.lookup(ids).astype(np.float64), offsets, mode)
        np.testing.assert_allclose(t.lookup_pooled(ids, offsets, mode), want, rtol=1e-5, atol=1e-5)


# -- the hierarchy --------------------------------------------------------------------------------------


def test_a_failed_write_back_counts_only_the_clean_rows_as_evicted() -> None:
    """Kills H16 (every evicted row un-counted after a failed write-back): a batch evicts a dirty row and a
    clean one and the dirty one's write-back fails; the dirty row is re-admitted (not an eviction), the
    clean one has left the cache (one eviction). Both still read as written."""
    home = FlakyHome()
    h = Hierarchy([DRAMTier(ROW, 2, "lru", num_rows=100)], home, initial)
    h.write(np.array([1], np.int64), np.full((1, ROW), 9, np.uint8))  # 1: dirty
    h.read(np.array([2], np.int64))  # 2: clean (promoted from the home's initial value)
    home.fail_at = 0
    with pytest.raises(TierIOError):
        h.read(np.array([3, 4], np.int64))  # evicts 1 and 2; writing 1 back fails
    tier = h.caches[0]
    assert tier.counters.evictions == 1
    slot_1, slot_2 = tier.directory.lookup(np.array([1, 2], np.int64)).tolist()
    assert slot_1 >= 0 and tier.dirty[slot_1] and slot_2 < 0  # 1 is back, dirty; 2 has left
    want = initial(np.array([1, 2, 3, 4], np.int64))
    want[0] = 9
    np.testing.assert_array_equal(h.read(np.array([1, 2, 3, 4], np.int64)), want)
    h.flush()
    assert home.data[1] == bytes([9] * ROW)
