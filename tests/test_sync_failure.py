"""A failed data sync is never retried ("fsyncgate"): the home refuses to flush, write or close cleanly.

On Linux a failed writeback marks the pages it could not write clean and reports the error once: a
retried fdatasync (or msync) then succeeds although the data never reached the disk (PostgreSQL's
"fsyncgate", 2018). Each test here has a flush fail that way and checks that no later flush claims
durability, that nothing more is written or committed, and that closing and reopening the store
(which replays its write-ahead log) brings back every acknowledged row.

The fault is real where the machine can cause it: an ext4 on a loop device that shrinks under the
slab (``failing_ext4``) gives a real EIO from fdatasync, after which the kernel's own retry reports
success. That cannot be aimed at one call, so elsewhere ``LosingSync`` stands in for one sync (the ssd
tier's ``_fdatasync`` hook; the mmap tier's mapping's msync): it puts the data file back as the last
good sync left it (what the disk holds after the lost writeback, and what reads see once the kernel
has dropped the clean pages) and raises EIO; later calls are the real sync, which succeeds, as the
kernel's does.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import embstore
from embstore.config import StoreConfig, TableConfig, TierConfig
from embstore.errors import StoreClosedError, TierIOError
from embstore.tiers import mmap as mmap_mod
from embstore.tiers import ssd
from embstore.tiers.mmap import MmapTier
from embstore.tiers.ssd import SLAB_FILE, SSDTier
from embstore.tiers.ssd_log import LogSSDTier
from faultfs import needs_mount
from homes import home_tier

REFUSED = "an earlier sync"  # what every refusal after the failure says


class LosingSync:
    """A data-sync hook whose first call on ``data_file`` loses the writeback: the file goes back to its
    bytes at construction (made right after the last good sync) and EIO is raised; every other call is
    ``real``."""

    def __init__(self, data_file: Path, real: Callable[[Any], None]) -> None:
        self.data_file, self.real = data_file, real
        self.snapshot = data_file.read_bytes()
        self.failed = 0

    def __call__(self, target: Any) -> None:
        if self.failed or not self._is_data_file(target):
            self.real(target)
            return
        self.failed += 1
        fd = os.open(self.data_file, os.O_WRONLY)
        try:
            os.pwrite(fd, self.snapshot, 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    def _is_data_file(self, target: Any) -> bool:
        if not isinstance(target, int):  # a mapping: the tier maps only its rows file
            return True
        return os.path.realpath(f"/proc/self/fd/{target}") == os.path.realpath(self.data_file)


class LosingMap:
    """Stands in for an mmap tier's mapping: its msync (``flush``) goes through a :class:`LosingSync`."""

    def __init__(self, real: Any, rows_file: Path) -> None:
        self._real = real
        self._loss = LosingSync(rows_file, lambda m: m.flush())

    def flush(self, *args: Any) -> None:
        self._loss(self._real)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def lose_next_msync(tier: MmapTier) -> None:
    """The tier's next msync loses its writeback (the tier's mapping is private: no hook replaces it)."""
    tier._mmap = LosingMap(tier._mmap, tier.path / mmap_mod.ROWS_FILE)


@pytest.fixture
def buffered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ssd tier's buffered fallback (the file system refuses O_DIRECT): writes go to the page cache."""
    real_open = os.open

    def no_direct(path, flags, *args, **kw):  # type: ignore[no-untyped-def]
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(ssd.os, "open", no_direct)


def rows_of(ids: np.ndarray, row_bytes: int, version: int) -> np.ndarray:
    return np.random.default_rng([version, len(ids)]).integers(0, 256, (len(ids), row_bytes), dtype=np.uint8)


def read_all(tier: Any) -> dict[int, bytes]:
    rows, found = tier.get(np.arange(tier.num_rows, dtype=np.int64))
    return {int(i): rows[i].tobytes() for i in np.flatnonzero(found)}


def put(tier: Any, model: dict[int, bytes], ids: np.ndarray, version: int) -> None:
    rows = rows_of(ids, tier.row_bytes, version)
    tier.put(ids, rows)
    model.update({int(i): r.tobytes() for i, r in zip(ids, rows)})


def check_refused(tier: Any, untouched: dict[int, bytes]) -> None:
    """After the failed sync: flush, put and delete refuse (naming the cause and the cure), and reads of
    rows nobody wrote since the last good flush still work."""
    for call in (tier.flush, lambda: tier.put(np.array([0], np.int64), np.zeros((1, tier.row_bytes), np.uint8)),
                 lambda: tier.delete(np.array([1], np.int64))):
        with pytest.raises(TierIOError, match=REFUSED) as ei:
            call()
        assert ei.value.errno == errno.EIO and "reopen" in str(ei.value) and "may be lost" in str(ei.value)
    ids = np.array(sorted(untouched), np.int64)
    rows, found = tier.get(ids)
    assert found.all() and all(rows[k].tobytes() == untouched[i] for k, i in enumerate(ids.tolist()))


# -- the tiers ----------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [SSDTier, LogSSDTier], ids=["in_place", "log"])
def test_ssd_home_never_retries_a_failed_sync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, buffered: None,
                                              cls: type) -> None:
    """The retried fdatasync would succeed and the commit after it would mark present rows whose bytes
    are not on disk; instead flush, writes and close refuse, and a reopen finds the last good flush."""
    path = tmp_path / "t"
    tier = cls(path, 1_000, 64)
    flushed: dict[int, bytes] = {}
    put(tier, flushed, np.arange(0, 200, dtype=np.int64), 1)
    tier.flush()
    monkeypatch.setattr(ssd, "_fdatasync", LosingSync(path / SLAB_FILE, ssd._fdatasync))
    model = dict(flushed)
    put(tier, model, np.arange(100, 300, dtype=np.int64), 2)  # overwrites and new rows
    tier.delete(np.array([5], np.int64))
    with pytest.raises(TierIOError) as first:
        tier.flush()
    check_refused(tier, {i: v for i, v in flushed.items() if i < 100 and i != 5})
    assert first.value.errno == errno.EIO and first.value.operation == "flush"
    assert "reopen" in str(first.value)  # the first error already says what to do
    with pytest.raises(TierIOError, match=REFUSED):
        tier.close()  # releases the files all the same, and commits nothing
    assert tier.closed and tier._fd == -1 and tier._engine is None
    with pytest.raises(StoreClosedError):
        tier.flush()
    monkeypatch.undo()
    again = cls(path, 1_000, 64)
    assert read_all(again) == flushed
    again.close()


def test_mmap_home_never_retries_a_failed_msync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The retried msync would succeed, the bitmap commit retire the journal and the lost rows be gone;
    instead the tier refuses, and its reopen redoes the journal (it survived here: only the rows'
    writeback was lost)."""
    path = tmp_path / "t"
    tier = MmapTier(path, 64, 24)
    flushed: dict[int, bytes] = {}
    put(tier, flushed, np.arange(0, 20, dtype=np.int64), 1)
    tier.flush()
    lose_next_msync(tier)
    model = dict(flushed)
    put(tier, model, np.arange(10, 40, dtype=np.int64), 2)
    tier.delete(np.array([3], np.int64))
    del model[3]
    with pytest.raises(TierIOError) as first:
        tier.flush()
    check_refused(tier, {i: v for i, v in flushed.items() if i < 10 and i != 3})
    assert first.value.errno == errno.EIO and first.value.operation == "msync" and "reopen" in str(first.value)
    with pytest.raises(TierIOError, match=REFUSED):
        tier.close()
    assert tier.closed and tier._mmap is None and tier._lock_fd == -1
    monkeypatch.undo()
    again = MmapTier(path, 64, 24)
    assert read_all(again) == model
    again.close()


def test_a_failed_sync_inside_a_write_is_remembered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Flushes the tiers run by themselves fail the same way: the log layout's commit to free blocks (inside
    put) and the mmap journal's bound (whose error the put does not raise) leave the tier refusing."""
    log = LogSSDTier(tmp_path / "log", 64, 1024, use_io_uring=False)  # 16 blocks + 64 spare
    ids = np.arange(64, dtype=np.int64)
    log.put(ids, rows_of(ids, 1024, 1))
    log.flush()
    monkeypatch.setattr(ssd, "_fdatasync", LosingSync(tmp_path / "log" / SLAB_FILE, ssd._fdatasync))
    with pytest.raises(TierIOError):
        for version in range(2, 40):  # rewrites fill the spare blocks: put() flushes to free the emptied ones
            log.put(ids, rows_of(ids, 1024, version))
    check_refused(log, {})
    with pytest.raises(TierIOError, match=REFUSED):
        log.close()
    monkeypatch.undo()

    monkeypatch.setattr(mmap_mod, "JOURNAL_LIMIT", 1)
    tier = MmapTier(tmp_path / "mmap", 64, 24)
    lose_next_msync(tier)
    tier.put(np.array([1], np.int64), rows_of(np.array([1]), 24, 1))  # journaled and applied; its flush failed
    check_refused(tier, {})
    with pytest.raises(TierIOError, match=REFUSED):
        tier.close()


# -- the store, end to end ---------------------------------------------------------------------
DIM = 8


def _lookup(path: Path, model: dict[int, float]) -> np.ndarray:
    ids = np.array(sorted(model), np.int64)
    with embstore.open(path) as store:
        return store["t"].lookup(ids)[:, 0]


def _write(store: embstore.Store, model: dict[int, float], ids: np.ndarray, value: float) -> None:
    """A durable write (logged, then the log synced, as the server acknowledges a PUT); the model takes it
    only once acknowledged."""
    try:
        store.update_logged("t", ids, np.full((len(ids), store["t"].dim), value, np.float32))
        store.sync_log()
    except TierIOError:
        return  # refused (it reached the failed home): not acknowledged, cut from the log
    model.update(dict.fromkeys(ids.tolist(), value))


@pytest.mark.parametrize("home", ["ssd", "ssd-log", "mmap"])
def test_a_store_whose_home_sync_failed_reopens_with_every_acknowledged_row(tmp_path: Path, monkeypatch, buffered,
                                                                            home: str) -> None:
    """Durable writes, a flush whose data sync is lost, more writes, more flushes (none may succeed: each
    would drop the write-ahead log), close; the reopen replays the log and every acknowledged row is back."""
    path = tmp_path / "s"
    cfg = TableConfig("t", 2_000, DIM, tiers=(TierConfig("dram", 32 * DIM * 4, "lru"), home_tier(home)))
    store = embstore.create(path, StoreConfig((cfg,)))
    model: dict[int, float] = {}
    for step in range(4):
        _write(store, model, np.arange(step * 100, step * 100 + 150, dtype=np.int64), step + 1.0)
    store.flush()
    if home == "mmap":
        lose_next_msync(store["t"].hierarchy.home)
    else:
        monkeypatch.setattr(ssd, "_fdatasync", LosingSync(path / "tables/t/home" / SLAB_FILE, ssd._fdatasync))
    for step in range(4, 8):
        _write(store, model, np.arange(step * 100, step * 100 + 150, dtype=np.int64) % 2_000, step + 1.0)
    with pytest.raises(TierIOError):
        store.flush()
    for step in range(8, 12):  # what lands in the cache is acknowledged; what reaches the home is refused
        _write(store, model, np.arange(step * 37, step * 37 + 20, dtype=np.int64), step + 1.0)
        try:
            store.flush()  # must keep failing: a success would drop the log
        except TierIOError as exc:
            assert REFUSED in str(exc)
    try:
        store.close()
    except TierIOError as exc:
        assert REFUSED in str(exc)
    monkeypatch.undo()
    got = _lookup(path, model)
    np.testing.assert_array_equal(got, np.array([model[i] for i in sorted(model)], np.float32))


# -- a real EIO -----------------------------------------------------------------------------------
KEEP = 24 << 20  # the loop device keeps its first 24 MiB: ext4's journal (16-20 MiB) stays writable
BIG_ROWS, BIG_DIM = 147_456, 64  # a 36 MiB slab of 256-byte rows: much of it lies past KEEP


@needs_mount
def test_a_real_eio_from_fdatasync_is_not_retried(failing_ext4, tmp_path: Path, buffered: None) -> None:
    """A real lost writeback: the slab's blocks past the device's end fail, the kernel reports EIO once,
    and its next fdatasync succeeds (the journal and the commit files are healthy). The store's log lives
    on another disk, as deployments keep it. No flush may succeed after the failure; after the disk is
    repaired, the reopen replays the log and every acknowledged row reads back."""
    path = failing_ext4.path / "s"
    cfg = TableConfig("t", BIG_ROWS, BIG_DIM, tiers=(TierConfig("ssd"),))
    store = embstore.create(path, StoreConfig((cfg,)))
    (tmp_path / "wal").mkdir()
    os.symlink(tmp_path / "wal", path / "wal")
    ids = np.arange(BIG_ROWS, dtype=np.int64)
    store["t"].update(ids, np.full((BIG_ROWS, BIG_DIM), 1.0, np.float32))  # every block allocated
    store.flush()
    model = dict.fromkeys(ids.tolist(), 1.0)
    failing_ext4.start_failing(KEEP)
    _write(store, model, ids, 2.0)  # the rows reach the page cache and the log
    assert set(model.values()) == {2.0}
    flushed_after_failure = 0
    for _ in range(3):
        try:
            store.flush()
            flushed_after_failure += 1
        except TierIOError:
            pass
    try:
        store.close()
    except TierIOError:
        pass
    failing_ext4.repair()
    np.testing.assert_array_equal(_lookup(path, model), np.full(BIG_ROWS, 2.0, np.float32))
    assert flushed_after_failure == 0


# -- the server -----------------------------------------------------------------------------------
@pytest.mark.parametrize("durable", [True, False], ids=["durable", "on-apply"])
def test_a_server_reload_after_a_failed_home_sync(tmp_path: Path, monkeypatch, buffered, durable: bool) -> None:
    """No flush can get past a failed data sync, so a reload that waited for one would be refused for
    ever. With durable writes the reload goes ahead (close, reopen: the log replays every acknowledged
    PUT); without, it is refused with a message saying that the unflushed rows are in memory only."""
    import httpx

    from embstore.server import ServerSettings, create_app
    from embstore.server.testing import ServerThread

    path = tmp_path / "s"
    cfg = TableConfig("t", 2_000, DIM, tiers=(TierConfig("dram", 32 * DIM * 4, "lru"), TierConfig("ssd")))
    embstore.create(path, StoreConfig((cfg,))).close()
    app = create_app(ServerSettings(store=path, flush_interval=0, durable_writes=durable))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        def put(ids: range, value: float) -> None:
            body = {"ids": list(ids), "embeddings": [[value] * DIM] * len(ids)}
            assert c.put("/v1/tables/t/rows", json=body).status_code == 204

        put(range(0, 100), 1.0)
        assert c.post("/v1/admin/reload").status_code == 200  # a good flush, then a reopen
        monkeypatch.setattr(ssd, "_fdatasync", LosingSync(path / "tables/t/home" / SLAB_FILE, ssd._fdatasync))
        put(range(50, 150), 2.0)  # 100 rows: more than the cache, so some reach the home
        resp = c.post("/v1/admin/reload")
        monkeypatch.undo()
        if durable:
            assert resp.status_code == 200, resp.text
            assert c.post("/v1/admin/reload").status_code == 200  # the reopened home flushes and syncs again
            got = np.array(c.post("/v1/tables/t/lookup", json={"ids": list(range(150))}).json()["embeddings"])
            np.testing.assert_array_equal(got[:, 0], [1.0] * 50 + [2.0] * 100)
        else:
            assert resp.status_code == 503, resp.text
            assert "failed for good" in resp.json()["detail"] and "in memory only" in resp.json()["detail"]
