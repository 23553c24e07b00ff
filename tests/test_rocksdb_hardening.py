"""RocksDBTier against damage and a disk that stays full, with real files, a real database, a real tmpfs.

- A damaged database directory (CURRENT, MANIFEST or SST files missing, empty, truncated or garbage)
  is refused with CorruptStoreError naming it, by the tier and by ``embstore.open``, and the refused
  open changes none of its files: RocksDB is never left to open what it can and delete the rest.
- A LOCK held by another open handle is not damage: TierIOError with errno EAGAIN, gone once it closes.
- While the disk stays full, writes fail fast with DiskFullError instead of trying a reopen each
  (counted, with a clock the test moves), and try again after a doubling window or once space is freed.
"""

from __future__ import annotations

import errno
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import embstore
from embstore.config import StoreConfig, TableConfig, TierConfig
from embstore.errors import CorruptStoreError, DiskFullError, TierIOError
from embstore.tiers import rocksdb as rocksdb_module
from embstore.tiers.rocksdb import RocksDBTier
from faultfs import Tmpfs, needs_mount

RB = 64
SMALL = dict(block_cache=1 << 20, write_buffer=256 << 10)


def _rows(seed: int, n: int, row_bytes: int = RB) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, row_bytes), dtype=np.uint8)


def _make(path: Path, flushes: int = 2) -> dict[int, bytes]:
    """A closed database whose rows sit in ``flushes`` SST files plus a last batch close() flushes."""
    tier = RocksDBTier(path, RB, **SMALL)
    model: dict[int, bytes] = {}
    for k in range(flushes + 1):
        ids = np.arange(k * 500, k * 500 + (500 if k < flushes else 10), dtype=np.int64)
        rows = _rows(k, len(ids))
        tier.put(ids, rows)
        model.update(zip(ids.tolist(), (r.tobytes() for r in rows)))
        if k < flushes:
            tier.raw.flush(True)  # memtable -> SST file
    tier.close()
    return model


def _check(tier: RocksDBTier, model: dict[int, bytes]) -> None:
    ids = np.array(sorted(model), dtype=np.int64)
    rows, found = tier.get(ids)
    assert found.all(), ids[~found][:10]
    assert rows.tobytes() == b"".join(model[i] for i in ids.tolist())


def _db_files(path: Path) -> dict[str, bytes]:
    """The files that hold the database (CURRENT, manifests, SST files, WALs) with their contents."""
    return {p.name: p.read_bytes() for p in path.iterdir()
            if p.name == "CURRENT" or p.name.startswith("MANIFEST-") or p.suffix in (".sst", ".log")}


def _manifest(path: Path) -> Path:
    return path / (path / "CURRENT").read_text().strip()


def _sst(path: Path) -> Path:
    return min(path.glob("*.sst"))


def _cut(target: Path, size: int) -> None:
    with open(target, "r+b") as f:
        f.truncate(size)


def _garble(target: Path) -> None:
    target.write_bytes(np.random.default_rng(1).integers(0, 256, target.stat().st_size, np.uint8).tobytes())


# (what is damaged, how, what the message must say besides the path)
DAMAGE: list[tuple[str, Callable[[Path], None], str]] = [
    ("current-missing", lambda p: (p / "CURRENT").unlink(), "no CURRENT"),
    ("current-empty", lambda p: _cut(p / "CURRENT", 0), "CURRENT is damaged"),
    ("current-garbage", lambda p: (p / "CURRENT").write_text("garbage\n"), "CURRENT is damaged"),
    ("manifest-missing", lambda p: _manifest(p).unlink(), r"MANIFEST-\d+ is missing"),
    ("manifest-empty", lambda p: _cut(_manifest(p), 0), r"MANIFEST-\d+ is empty"),
    ("manifest-half", lambda p: _cut(_manifest(p), _manifest(p).stat().st_size // 2), r"MANIFEST-\d+ is truncated"),
    ("manifest-less-1", lambda p: _cut(_manifest(p), _manifest(p).stat().st_size - 1), r"MANIFEST-\d+ is truncated"),
    ("manifest-garbage", lambda p: _garble(_manifest(p)), r"MANIFEST-\d+"),
    ("sst-missing", lambda p: _sst(p).unlink(), r"\d+\.sst"),
    ("sst-empty", lambda p: _cut(_sst(p), 0), r"\d+\.sst"),
    ("sst-truncated", lambda p: _cut(_sst(p), _sst(p).stat().st_size // 2), r"\d+\.sst"),
    ("sst-garbage", lambda p: _garble(_sst(p)), r"\d+\.sst"),
]


@pytest.mark.parametrize(("damage", "expect"), [(d, e) for _, d, e in DAMAGE], ids=[n for n, _, _ in DAMAGE])
def test_damaged_database_is_refused_and_left_as_it_was(tmp_path: Path, damage: Callable[[Path], None],
                                                       expect: str) -> None:
    path = tmp_path / "db"
    _make(path)
    damage(path)
    before = _db_files(path)
    for _ in range(2):  # the refused open released the lock: a retry is refused the same way
        with pytest.raises(CorruptStoreError, match=expect) as info:
            RocksDBTier(path, RB, **SMALL)
        assert str(path) in str(info.value)
        assert _db_files(path) == before  # nothing created (no empty database), nothing deleted


@pytest.mark.parametrize("name", ["current-missing", "manifest-missing", "manifest-half", "sst-missing"])
def test_store_with_a_damaged_rocksdb_home_is_refused(tmp_path: Path, name: str) -> None:
    cfg = TableConfig("t", 1 << 40, 8, tiers=(TierConfig("dram", 1 << 16, "lru"), TierConfig("rocksdb")))
    ids = np.arange(0, 5000, 7, dtype=np.int64) * 1_000_003
    with embstore.create(tmp_path / "s", StoreConfig((cfg,))) as store:
        store["t"].update(ids, np.ones((len(ids), 8), np.float32))
    home = tmp_path / "s" / "tables" / "t" / "home"
    damage, expect = next((d, e) for n, d, e in DAMAGE if n == name)
    damage(home)
    with pytest.raises(CorruptStoreError, match=expect) as info:
        embstore.open(tmp_path / "s")
    assert str(home) in str(info.value)


def _records(data: bytes) -> set[int]:
    """Offsets where a whole record starts in a RocksDB log file, not one of its later fragments; walked
    from its first byte (a reference for the tier's check, which walks only the last 32 KiB block)."""
    starts, pos, block = set(), 0, 32768
    while pos < len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        if kind in (1, 2):  # a whole record, or the first fragment of one
            starts.add(pos)
        pos += 7 + length
    return starts


@pytest.fixture(scope="module")
def big_manifest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A database whose manifest (an edit per flush) spans two 32 KiB blocks, with a record split
    across them as fragments."""
    path = tmp_path_factory.mktemp("big") / "db"
    tier = RocksDBTier(path, RB, **SMALL)
    for n in range(2000):
        data = _manifest(path).read_bytes()
        if len(data) >= 40_000 and data[32768 + 6] in (3, 4):  # the second block starts with a fragment
            break
        tier.put(np.array([n], np.int64), _rows(n, 1))
        tier.raw.flush(True)
    else:
        raise AssertionError("no manifest record split across its first two blocks")
    tier.close()
    return path


@settings(max_examples=40)
@given(data=st.data())
def test_a_manifest_cut_inside_a_record_is_refused(big_manifest: Path, tmp_path_factory: pytest.TempPathFactory,
                                                  data: st.DataObject) -> None:
    """Anywhere but at a record boundary (where it cannot be told from an older manifest), a cut is refused;
    cuts near the block boundary and the end are drawn often, where fragments and the last records are."""
    size = _manifest(big_manifest).stat().st_size
    starts = _records(_manifest(big_manifest).read_bytes())
    cut = data.draw(st.one_of(st.integers(1, size - 1), st.integers(32768 - 16, 32768 + 16),
                              st.integers(size - 600, size - 1)).filter(lambda c: c not in starts))
    path = tmp_path_factory.mktemp("cut") / "db"
    shutil.copytree(big_manifest, path)
    _cut(_manifest(path), cut)
    with pytest.raises(CorruptStoreError, match=str(_manifest(path))):
        RocksDBTier(path, RB, **SMALL)


def test_a_manifest_cut_between_fragments_is_refused(big_manifest: Path, tmp_path: Path) -> None:
    """Cut at the block boundary, the file ends after a whole first fragment: the record is still torn."""
    path = tmp_path / "db"
    shutil.copytree(big_manifest, path)
    _cut(_manifest(path), 32768)
    with pytest.raises(CorruptStoreError, match="is truncated"):
        RocksDBTier(path, RB, **SMALL)


def test_create_if_missing_cannot_hide_a_deleted_current(tmp_path: Path) -> None:
    """Without CURRENT, RocksDB (create_if_missing) would start a new database over the old files."""
    path = tmp_path / "db"
    model = _make(path)
    (path / "CURRENT").unlink()
    before = _db_files(path)
    with pytest.raises(CorruptStoreError, match="no CURRENT"):
        RocksDBTier(path, RB, **SMALL)
    assert _db_files(path) == before
    for name in before:  # every database file gone but the metadata RocksDB leaves around them
        (path / name).unlink()
    assert {p.name for p in path.iterdir()} >= {"IDENTITY", "LOCK"}
    with pytest.raises(CorruptStoreError, match="no CURRENT"):
        RocksDBTier(path, RB, **SMALL)
    assert not (path / "CURRENT").exists()
    # put back, the database opens whole: nothing was changed by the refusals
    for name, data in before.items():
        (path / name).write_bytes(data)
    (path / "CURRENT").write_text(f"{sorted(n for n in before if n.startswith('MANIFEST-'))[-1]}\n")
    tier = RocksDBTier(path, RB, **SMALL)
    _check(tier, model)
    tier.close()


def test_deleted_directory_is_refused_when_the_tier_must_exist(tmp_path: Path) -> None:
    """A deleted database cannot be told from a new tier by its directory alone: with create=True (the
    default) it starts empty; create=False (the caller knows it made the tier) refuses it."""
    path = tmp_path / "db"
    model = _make(path)
    tier = RocksDBTier(path, RB, create=False, **SMALL)
    _check(tier, model)
    tier.close()
    shutil.rmtree(path)
    with pytest.raises(CorruptStoreError, match="is missing, yet the tier was created before") as info:
        RocksDBTier(path, RB, create=False, **SMALL)
    assert str(path) in str(info.value) and not path.exists()
    path.mkdir()
    with pytest.raises(CorruptStoreError, match="is empty, yet the tier was created before"):
        RocksDBTier(path, RB, create=False, **SMALL)
    assert not any(path.iterdir())
    tier = RocksDBTier(path, RB, **SMALL)  # the default makes a new, empty tier
    assert not tier.contains(np.array(sorted(model), np.int64)).any()
    tier.close()


@pytest.mark.parametrize("damage", ["missing", "empty", "garbage"])
def test_damaged_options_file_is_not_damage(tmp_path: Path, damage: str) -> None:
    """RocksDB reads no OPTIONS file (the tier passes every option) and writes a fresh one at open."""
    path = tmp_path / "db"
    model = _make(path)
    for options in path.glob("OPTIONS-*"):
        if damage == "missing":
            options.unlink()
        else:
            options.write_bytes(b"" if damage == "empty" else b"[Version]\n\xff\x00garbage = {")
    tier = RocksDBTier(path, RB, **SMALL)
    _check(tier, model)
    tier.close()
    assert any(b"[DBOptions]" in p.read_bytes() for p in path.glob("OPTIONS-*"))


_HOLD = """
import sys
from embstore.tiers.rocksdb import RocksDBTier
tier = RocksDBTier(sys.argv[1], 64)
print("open", flush=True)
sys.stdin.read()
tier.close()
"""


def _assert_in_use(exc: BaseException, path: Path) -> None:
    assert type(exc) is TierIOError and exc.errno == errno.EAGAIN and exc.tier == "rocksdb", repr(exc)
    assert str(path) in str(exc) and "in use by another open handle" in str(exc)


def test_lock_held_by_another_handle_is_a_retryable_io_error(tmp_path: Path) -> None:
    path = tmp_path / "db"
    model = _make(path)
    holder = RocksDBTier(path, RB, **SMALL)  # this process
    with pytest.raises(TierIOError) as info:
        RocksDBTier(path, RB, **SMALL)
    _assert_in_use(info.value, path)
    holder.close()
    child = subprocess.Popen([sys.executable, "-c", _HOLD, str(path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "open"
        with pytest.raises(TierIOError) as info:  # another process
            RocksDBTier(path, RB, **SMALL)
        _assert_in_use(info.value, path)
    finally:
        child.communicate("", timeout=60)
    assert child.returncode == 0
    tier = RocksDBTier(path, RB, **SMALL)  # once the holder is gone it opens, whole
    _check(tier, model)
    tier.close()


# -- back-off while the disk stays full (real ENOSPC from a 4 MiB tmpfs) --------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


BIG = 256  # row bytes; a 512-row put is 128 KiB, more than a full 4 MiB tmpfs has left


class _FullDisk:
    """A tier on a tiny tmpfs with a test clock, counting the read-write opens its reopens try."""

    def __init__(self, fs: Tmpfs, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fs, self.clock, self.opens, self.model = fs, _Clock(), 0, {}
        self.tier = RocksDBTier(fs.path / "db", BIG, block_cache=1 << 20, write_buffer=8 << 20)
        monkeypatch.setattr(self.tier, "_clock", self.clock, raising=False)
        real = self.tier._open

        def counting_open(read_only: bool = False) -> object:
            self.opens += not read_only
            return real(read_only)

        monkeypatch.setattr(self.tier, "_open", counting_open)
        self.next = 0

    def put(self) -> None:
        ids = np.arange(self.next, self.next + 512, dtype=np.int64)
        self.next += 512
        rows = _rows(int(ids[0]), len(ids), BIG)
        self.tier.put(ids, rows)
        self.model.update(zip(ids.tolist(), (r.tobytes() for r in rows)))

    def fill_until_a_reopen_fails(self) -> None:
        """put + flush until a write's reopen fails for space (writes may succeed, or fail without a
        reopen, before that)."""
        for _ in range(500):
            opens = self.opens
            try:
                self.put()
                self.tier.flush()
            except DiskFullError:
                if self.opens == opens + 1:
                    return
        raise AssertionError("no reopen failed on the full tmpfs")

    def refused_without_reopen(self) -> None:
        opens = self.opens
        with pytest.raises(DiskFullError, match="still full.*retry later") as info:
            self.put()
        assert info.value.errno == errno.ENOSPC and str(self.tier.path) in str(info.value)
        with pytest.raises(DiskFullError, match="still full"):
            self.tier.flush()
        assert self.opens == opens

    def refused_after_a_reopen(self) -> None:
        opens = self.opens
        with pytest.raises(DiskFullError):
            self.put()
        assert self.opens == opens + 1


@needs_mount
def test_full_disk_reopens_back_off(tiny_tmpfs: Tmpfs, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = _FullDisk(tiny_tmpfs, monkeypatch)
    disk.fill_until_a_reopen_fails()
    for _ in range(10):  # the clock stands still: writes fail fast, reads work
        disk.refused_without_reopen()
        _check(disk.tier, disk.model)
    window, windows = rocksdb_module._REOPEN_BACKOFF_MIN, []
    while len(windows) < 9:  # each failed reopen doubles the window, up to the cap
        failed_at = disk.clock.now
        disk.clock.now = failed_at + window - 1e-3
        disk.refused_without_reopen()
        disk.clock.now = failed_at + window
        disk.refused_after_a_reopen()
        windows.append(window)
        window = min(2 * window, rocksdb_module._REOPEN_BACKOFF_MAX)
    assert windows[:2] == [0.1, 0.2] and windows[-2:] == [5.0, 5.0]

    disk.fs.resize(16 << 20)  # space is freed: the next write reopens at once, mid-window
    opens = disk.opens
    disk.put()
    disk.tier.flush()
    assert disk.opens == opens + 1
    _check(disk.tier, disk.model)

    disk.fill_until_a_reopen_fails()  # full again: the successful reopen reset the window
    failed_at = disk.clock.now
    disk.clock.now = failed_at + rocksdb_module._REOPEN_BACKOFF_MIN - 1e-3
    disk.refused_without_reopen()
    disk.clock.now = failed_at + rocksdb_module._REOPEN_BACKOFF_MIN
    disk.refused_after_a_reopen()

    opens = disk.opens  # close is the last chance to sync: it tries, inside the window too
    with pytest.raises(DiskFullError):
        disk.tier.close()
    assert disk.opens == opens + 1
    disk.fs.resize(64 << 20)
    tier = RocksDBTier(disk.fs.path / "db", BIG, block_cache=1 << 20, write_buffer=8 << 20)
    _check(tier, disk.model)
    tier.close()
