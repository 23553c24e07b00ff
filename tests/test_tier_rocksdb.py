"""RocksDBTier against a dict model, plus persistence, corruption, real faults and SIGKILL.

Faults are real where the sandbox allows it (root, ``mount``): ENOSPC from a tiny
tmpfs, EIO from ext4 on a loop device whose backing file lives on a tmpfs that
fills up. Where mounting is impossible those tests skip, naming why, and
``test_backend_errors_are_translated`` still checks the translation with a fake
database handle.
"""

from __future__ import annotations

import errno
import random
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embstore.errors import (
    ConfigError,
    CorruptStoreError,
    DiskFullError,
    IdOutOfRangeError,
    InvalidInputError,
    StoreClosedError,
    TierIOError,
)
from embstore.tiers.rocksdb import MEMTABLES, RocksDBTier, pack_keys

RB = 24  # row bytes used by most tests
SMALL = dict(block_cache=1 << 20, write_buffer=256 << 10)


def _rows(seed: int, n: int, row_bytes: int = RB) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, row_bytes), dtype=np.uint8)


def _ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _check_model(tier: RocksDBTier, model: dict[int, bytes], extra: list[int]) -> None:
    """Every model id reads back exactly; ``extra`` ids not in the model read as absent zeros."""
    ids = np.array(sorted(set(model) | set(extra)), dtype=np.int64)
    rows, found = tier.get(ids)
    assert rows.shape == (len(ids), tier.row_bytes) and rows.dtype == np.uint8
    for i, key in enumerate(ids.tolist()):
        if key in model:
            assert found[i], key
            assert rows[i].tobytes() == model[key], key
        else:
            assert not found[i], key
            assert not rows[i].any(), key
    assert np.array_equal(tier.contains(ids), found)


# -- model-based round trip ----------------------------------------------------------------

_id = st.one_of(st.integers(0, 40), st.integers(0, 2**63 - 1))  # collisions and a sparse, huge space
_batch = st.lists(_id, min_size=0, max_size=20, unique=True)
_op = st.one_of(
    st.tuples(st.just("put"), _batch, st.integers(0, 2**32 - 1)),
    st.tuples(st.just("delete"), _batch, st.just(0)),
    st.tuples(st.just("get"), _batch, st.just(0)),
    st.tuples(st.just("reopen"), st.just([]), st.just(0)),
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_op, max_size=12))
def test_matches_dict_model(ops: list[tuple[str, list[int], int]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "db"
        tier = RocksDBTier(path, RB, **SMALL)
        model: dict[int, bytes] = {}
        seen: set[int] = set()
        try:
            for op, ids_list, seed in ops:
                ids = np.array(ids_list, dtype=np.int64)
                seen.update(ids_list)
                if op == "put":
                    rows = _rows(seed, len(ids))
                    tier.put(ids, rows)
                    model.update(zip(ids_list, (r.tobytes() for r in rows)))
                elif op == "delete":
                    tier.delete(ids)
                    for key in ids_list:
                        model.pop(key, None)
                elif op == "get":
                    _check_model(tier, {k: model[k] for k in ids_list if k in model}, ids_list)
                else:
                    tier.flush()
                    tier.close()
                    tier = RocksDBTier(path, RB, **SMALL)
            tier.flush()
            tier.close()
            tier = RocksDBTier(path, RB, **SMALL)
            _check_model(tier, model, sorted(seen) + [2**63 - 1, 0, 12345])
        finally:
            tier.close()


# -- basics ------------------------------------------------------------------------------------


def test_absent_rows_are_zero_and_counted(tmp_path: Path) -> None:
    tier = RocksDBTier(tmp_path / "db", RB, **SMALL)
    rows = _rows(1, 2)
    tier.put(_ids(7, 2**40), rows)
    got, found = tier.get(_ids(3, 7, 2**40, 8))
    assert found.tolist() == [False, True, True, False]
    assert np.array_equal(got[[1, 2]], rows) and not got[[0, 3]].any()
    assert got.flags.writeable
    stats = tier.stats()
    assert (stats.kind, stats.hits, stats.misses) == ("rocksdb", 2, 2)
    assert (stats.bytes_read, stats.bytes_written) == (2 * RB, 2 * RB)
    assert stats.resident_rows == 2
    empty, found = tier.get(np.empty(0, dtype=np.int64))
    assert empty.shape == (0, RB) and found.shape == (0,)
    tier.close()


def test_persists_across_close_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "db"
    tier = RocksDBTier(path, RB, **SMALL)
    ids = np.arange(0, 3000, 3, dtype=np.int64) * 1_000_003  # sparse ids
    rows = _rows(2, len(ids))
    tier.put(ids, rows)
    tier.delete(ids[:10])
    tier.close()
    tier.close()  # idempotent
    tier = RocksDBTier(path, RB, **SMALL)
    got, found = tier.get(ids)
    assert not found[:10].any() and found[10:].all()
    assert np.array_equal(got[10:], rows[10:])
    tier.close()


def _options_file(path: Path) -> str:
    return max(path.glob("OPTIONS-*"), key=lambda f: int(f.name.split("-")[1])).read_text()


def test_reopening_applies_the_sizes_configured_now(tmp_path: Path) -> None:
    """The configured options win over those saved in the database's OPTIONS file: a home reopened
    with other sizes (as `embstore tune` may write) runs with them, and its memory is bounded by
    ``dram_bytes`` (index and filter blocks live in the block cache, ``MEMTABLES`` memtables)."""
    tier = RocksDBTier(tmp_path, 8, block_cache=4 << 20, write_buffer=1 << 20)
    tier.put(np.arange(100, dtype=np.int64), np.ones((100, 8), np.uint8))
    tier.close()
    tier = RocksDBTier(tmp_path, 8, block_cache=3 << 20, write_buffer=2 << 20)
    assert int(tier.raw.property_int_value("rocksdb.block-cache-capacity")) == 3 << 20
    text = _options_file(tmp_path)
    assert "write_buffer_size=2097152" in text and f"max_write_buffer_number={MEMTABLES}" in text
    assert "cache_index_and_filter_blocks=true" in text and "pin_l0_filter_and_index_blocks_in_cache=true" in text
    assert tier.get(np.arange(100, dtype=np.int64))[1].all()
    tier.close()
    assert RocksDBTier.dram_bytes(3 << 20, 2 << 20) == (3 << 20) + MEMTABLES * (2 << 20)


def test_keys_are_big_endian_so_iteration_is_numeric() -> None:
    ids = _ids(0, 1, 255, 256, 2**40, 2**63 - 1)
    keys = pack_keys(ids)
    assert all(len(k) == 8 for k in keys)
    assert [int.from_bytes(k, "big") for k in keys] == ids.tolist()
    assert keys == sorted(keys)


@pytest.mark.parametrize("compression", ["none", "snappy", "lz4", "zstd", "zlib"])
def test_compressions_round_trip(tmp_path: Path, compression: str) -> None:
    tier = RocksDBTier(tmp_path / "db", RB, compression=compression, **SMALL)
    ids = np.arange(500, dtype=np.int64)
    rows = _rows(3, len(ids))
    tier.put(ids, rows)
    tier.raw.flush(True)  # through an SST file, where compression applies
    got, found = tier.get(ids)
    assert found.all() and np.array_equal(got, rows)
    tier.close()


def test_invalid_arguments(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="compression"):
        RocksDBTier(tmp_path / "a", RB, compression="brotli")
    with pytest.raises(ConfigError, match="block_cache"):
        RocksDBTier(tmp_path / "b", RB, block_cache=-1)
    with pytest.raises(ValueError, match="row_bytes"):
        RocksDBTier(tmp_path / "c", 0)
    tier = RocksDBTier(tmp_path / "db", RB, **SMALL)
    with pytest.raises(IdOutOfRangeError, match="-5"):
        tier.get(_ids(1, -5))
    with pytest.raises(IdOutOfRangeError):
        tier.put(_ids(-1), _rows(0, 1))
    with pytest.raises(IdOutOfRangeError):
        tier.delete(_ids(-(2**63)))
    with pytest.raises(InvalidInputError, match="int64"):
        tier.get(np.array([1, 2], dtype=np.int32))
    with pytest.raises(InvalidInputError, match="1-D"):
        tier.contains(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="uint8 rows"):
        tier.put(_ids(1, 2), _rows(0, 2, RB + 1))
    with pytest.raises(ValueError, match="uint8 rows"):
        tier.put(_ids(1, 2), _rows(0, 2).astype(np.float32))
    assert not tier.contains(_ids(1, 2)).any()  # nothing was written by the failed calls
    tier.close()
    with pytest.raises(StoreClosedError):
        tier.get(_ids(1))
    with pytest.raises(StoreClosedError):
        tier.flush()


# -- corruption ----------------------------------------------------------------------------------


def test_directory_that_is_not_a_database(tmp_path: Path) -> None:
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not rocksdb")
    with pytest.raises(CorruptStoreError, match="not a RocksDB database"):
        RocksDBTier(tmp_path / "other", RB)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CorruptStoreError, match="not a directory"):
        RocksDBTier(tmp_path / "file", RB)


def test_corrupt_database_at_open(tmp_path: Path) -> None:
    path = tmp_path / "db"
    tier = RocksDBTier(path, RB, **SMALL)
    tier.put(_ids(1), _rows(0, 1))
    tier.close()
    (path / "CURRENT").write_text("garbage\n")
    with pytest.raises(CorruptStoreError, match=str(path)):
        RocksDBTier(path, RB)
    tier = RocksDBTier(tmp_path / "db2", RB, **SMALL)
    tier.put(_ids(1), _rows(0, 1))
    tier.close()
    manifest = next((tmp_path / "db2").glob("MANIFEST-*"))
    manifest.write_bytes(b"\xff" * manifest.stat().st_size)
    with pytest.raises(CorruptStoreError, match="db2"):
        RocksDBTier(tmp_path / "db2", RB)


def test_wrong_length_values(tmp_path: Path) -> None:
    path = tmp_path / "db"
    tier = RocksDBTier(path, RB, **SMALL)
    tier.put(_ids(5, 6), _rows(0, 2))
    tier.raw[pack_keys(_ids(6))[0]] = b"short"
    with pytest.raises(CorruptStoreError, match="key 6 has 5 bytes"):
        tier.get(_ids(5, 6))
    assert tier.get(_ids(5))[1].all()  # the healthy row still reads
    tier.close()
    with pytest.raises(CorruptStoreError, match="rows of 24 bytes"):
        RocksDBTier(path, RB + 8)  # another row width is caught at open


def test_corrupt_table_file_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "db"
    tier = RocksDBTier(path, 256, **SMALL)
    ids = np.arange(2000, dtype=np.int64)
    tier.put(ids, _rows(4, len(ids), 256))
    tier.raw.flush(True)
    tier.close()
    for sst in path.glob("*.sst"):
        data = bytearray(sst.read_bytes())
        mid = len(data) // 3
        data[mid:mid + 4096] = bytes(b ^ 0x5A for b in data[mid:mid + 4096])
        sst.write_bytes(bytes(data))
    with pytest.raises(CorruptStoreError):
        tier = RocksDBTier(path, 256, **SMALL)
        tier.get(ids)
    tier.close()


# -- fault translation with a fake handle (runs everywhere) --------------------------------------


class _FailingDB:
    """Stands in for the rocksdict handle and fails every call with RocksDB's status text."""

    def __init__(self, message: str) -> None:
        self.message = message

    def _fail(self, *args: object, **kwargs: object) -> None:
        raise Exception(self.message)  # rocksdict raises bare Exception with the status text

    get = write = flush_wal = close = _fail


@pytest.mark.parametrize(("message", "kind", "err"), [
    ("IO error: No space left on device: While appending to file: x.log", DiskFullError, errno.ENOSPC),
    ("IO error: While fsync: x.log: Input/output error", TierIOError, errno.EIO),
    ("Corruption: block checksum mismatch", CorruptStoreError, None),
])
def test_backend_errors_are_translated(tmp_path: Path, message: str, kind: type, err: int | None,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Every call translates the status text; a write after a failed one reopens the handle first
    (the reopened handle fails the same way here)."""
    tier = RocksDBTier(tmp_path / "db", RB, **SMALL)
    opened: list[bool] = []

    def reopen(read_only: bool = False) -> _FailingDB:
        opened.append(read_only)
        return _FailingDB(message)

    real, tier._db = tier._db, _FailingDB(message)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(tier, "_open", reopen)
            for call in (lambda: tier.get(_ids(1)), lambda: tier.put(_ids(1), _rows(0, 1)),
                         lambda: tier.delete(_ids(1)), tier.flush):
                with pytest.raises(kind) as info:
                    call()
                if err is not None:
                    assert info.value.errno == err and info.value.tier == "rocksdb"
        assert opened == [False, False]  # before the delete and the flush: each follows a failed write
    finally:
        tier._db = real
        tier.close()


# -- real faults ---------------------------------------------------------------------------------


from faultfs import FailingExt4 as _FailingExt4, Tmpfs as _Tmpfs, kill_at_random_point, needs_mount  # noqa: E402


def _fill_until_error(tier: RocksDBTier, model: dict[int, bytes], batch: int, limit: int,
                      first: int = 0) -> tuple[TierIOError, np.ndarray]:
    """put + flush batches until one fails; the model holds every flushed row."""
    for start in range(first, first + limit, batch):
        ids = np.arange(start, start + batch, dtype=np.int64)
        rows = _rows(start, batch, tier.row_bytes)
        try:
            tier.put(ids, rows)
            tier.flush()
        except TierIOError as exc:
            return exc, ids
        model.update(zip(ids.tolist(), (r.tobytes() for r in rows)))
    raise AssertionError(f"no error after {limit} rows")


@needs_mount
def test_enospc_is_disk_full_and_reopens_consistent(tiny_tmpfs: _Tmpfs) -> None:
    path = tiny_tmpfs.path / "db"
    tier = RocksDBTier(path, 256, **SMALL)
    model: dict[int, bytes] = {}
    err, failed = _fill_until_error(tier, model, 512, 1 << 20)
    assert isinstance(err, DiskFullError) and err.errno == errno.ENOSPC, err
    assert tier.get(np.array(list(model)[:100], dtype=np.int64))[1].all()  # reads still work
    late, row = _ids(10**11), _rows(7, 1, 256)
    acked = False
    try:  # still full: refused with the same error ...
        tier.put(late, row)
        tier.flush()
    except DiskFullError:
        pass
    else:  # ... unless RocksDB recovered on its own (a compaction freed space): then it must be durable
        acked = True
    try:
        tier.close()
    except TierIOError:
        pass  # the WAL writer keeps its error; what was flushed is safe
    tiny_tmpfs.resize(64 << 20)
    tier = RocksDBTier(path, 256, **SMALL)
    _check_model(tier, model, [])
    found = tier.contains(failed)
    assert found.all() or not found.any()  # the failed batch is all or nothing
    got, present = tier.get(late)  # unacknowledged: absent or whole; acknowledged: there
    assert (present[0] or not acked) and (not present[0] or got[0].tobytes() == row[0].tobytes())
    tier.put(_ids(10**12), _rows(9, 1, 256))  # and the tier takes writes again
    tier.close()


@needs_mount
def test_eio_is_tier_io_error_and_reopens_consistent(failing_ext4: _FailingExt4) -> None:
    path = failing_ext4.path / "db"
    tier = RocksDBTier(path, 256, **SMALL)
    model: dict[int, bytes] = {}
    for start in range(0, 8192, 512):  # healthy disk first
        ids = np.arange(start, start + 512, dtype=np.int64)
        rows = _rows(start, 512, 256)
        tier.put(ids, rows)
        tier.flush()
        model.update(zip(ids.tolist(), (r.tobytes() for r in rows)))
    failing_ext4.start_failing()
    err, failed = _fill_until_error(tier, model, 512, 1 << 20, first=8192)
    assert type(err) is TierIOError and err.errno == errno.EIO, err
    try:
        tier.close()
    except TierIOError:
        pass
    failing_ext4.repair()
    tier = RocksDBTier(path, 256, **SMALL)
    _check_model(tier, model, [])
    found = tier.contains(failed)
    assert found.all() or not found.any()
    tier.close()


# -- crash: SIGKILL at a random point ------------------------------------------------------------

_SCHEDULE = textwrap.dedent("""
    import numpy as np

    def schedule(seed, r, row_bytes):
        '''Round r of the crash workload: (op, ids, rows); ids are sparse and overlap across rounds.'''
        rng = np.random.default_rng([seed, r])
        ids = rng.choice(3000, size=200, replace=False).astype(np.int64) * 1_000_000_007
        if r % 4 == 3:
            return "delete", ids[:50], None
        return "put", ids, rng.integers(0, 256, size=(len(ids), row_bytes), dtype=np.uint8)
""")
_CHILD = _SCHEDULE + textwrap.dedent("""
    import sys
    from embstore.tiers.rocksdb import RocksDBTier
    path, seed, row_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    tier = RocksDBTier(path, row_bytes, block_cache=1 << 20, write_buffer=256 << 10)
    for r in range(100_000):
        op, ids, rows = schedule(seed, r, row_bytes)
        print("start", r, flush=True)
        if op == "put":
            tier.put(ids, rows)
        else:
            tier.delete(ids)
        if r % 2:
            tier.flush()
            print("flushed", r, flush=True)
""")
_sched_ns: dict = {}
exec(_SCHEDULE, _sched_ns)  # the parent replays the child's exact workload
schedule = _sched_ns["schedule"]


def _kill_at_random_point(args: list[str], rnd: random.Random) -> tuple[int, int]:
    return kill_at_random_point(args, rnd, 0, 12, 0.002)


@pytest.mark.parametrize("trial", range(3))
def test_flushed_rows_survive_sigkill(tmp_path: Path, trial: int) -> None:
    """After SIGKILL every row is in its last flushed state or a later one (batches are atomic)."""
    seed, row_bytes, path = 1000 + trial, 256, tmp_path / "db"
    last, started = _kill_at_random_point([_CHILD, str(path), str(seed), str(row_bytes)],
                                          random.Random(trial))
    states: dict[int, bytes | None] = {}
    allowed: dict[int, set[bytes | None]] = {}
    for r in range(started + 1):
        op, ids, rows = schedule(seed, r, row_bytes)
        for i, key in enumerate(ids.tolist()):
            new = rows[i].tobytes() if op == "put" else None
            if r <= last:
                states[key] = new
            else:
                allowed.setdefault(key, {states.get(key)}).add(new)
    tier = RocksDBTier(path, row_bytes, **SMALL)
    ids = np.array(sorted(set(states) | set(allowed)) + [7, 10**15], dtype=np.int64)
    rows, found = tier.get(ids)
    for i, key in enumerate(ids.tolist()):
        state = rows[i].tobytes() if found[i] else None
        assert state in allowed.get(key, {states.get(key)}), f"id {key}, last flush {last}"
    tier.close()
