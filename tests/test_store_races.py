"""Races in a store's lifecycle: close, a failed open or create, and the calls that overlap them.

Every interleaving is forced, not left to timing: a step is held on an event (a log sync that fails,
a table's close, a metadata write) while the other call runs up to the point that matters, which the
test sees happen (a thread queued on one of the store's locks, or finished). Real stores, files and
threads; mocks only for the faults (an EIO of one log sync, a full disk at one write).
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import embstore
import embstore.store as store_module
from embstore.config import StoreConfig, TableConfig, TierConfig
from embstore.store import CREATING_FILE, LOCK_FILE
from embstore.wal import WAL_DIR, WriteAheadLog
from log_faults import HeldLosingSync, WatchedLock, in_thread, queued_or_done, until

DIM = 4
CACHE = TierConfig("dram", 16 * DIM * 4, "lru")
CONFIG = StoreConfig((TableConfig("t", 100, DIM, tiers=(CACHE, TierConfig("ssd"))),
                      TableConfig("m", 100, DIM, tiers=(CACHE, TierConfig("mmap")))))  # the mmap home has
# a lock of its own: a table left open after its store's close keeps the store from opening again


def row(value: float) -> np.ndarray:
    return np.full((1, DIM), value, np.float32)


@pytest.fixture()
def store_path(tmp_path: Path) -> Path:
    embstore.create(tmp_path / "s", CONFIG).close()
    return tmp_path / "s"


class Pause:
    """Stands in for ``fn``: its first call sets ``entered`` and waits for ``release``, then runs ``fn``
    (or, with ``after``, runs ``fn`` first and waits after it)."""

    def __init__(self, fn: Any, after: bool = False) -> None:
        self.fn, self.after = fn, after
        self.entered, self.release = threading.Event(), threading.Event()

    def _hold(self) -> None:
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(30)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.after:
            self._hold()
        out = self.fn(*args, **kwargs)
        if self.after:
            self._hold()
        return out


def attempt(fn: Any) -> str:
    """What ``fn()`` did: the name of the exception it raised, or "succeeded" (closing the Store it made)."""
    try:
        got = fn()
    except Exception as exc:  # noqa: BLE001 - the test compares the kind
        return type(exc).__name__
    got.close()
    return "succeeded"


def attempt_before(monkeypatch, step: str, fn: Any) -> list[str]:
    """Make the first call of ``embstore.store.<step>`` begin with :func:`attempt` of ``fn``; the list
    gets its outcome."""
    real = getattr(store_module, step)
    seen: list[str] = []

    def hooked(*args: Any, **kwargs: Any) -> Any:
        if not seen:
            seen.append("running")  # ``fn`` may reach this step too: once is enough
            seen[0] = attempt(fn)
        return real(*args, **kwargs)

    monkeypatch.setattr(store_module, step, hooked)
    return seen


def fails_once(monkeypatch, step: str) -> None:
    """``embstore.store.<step>`` raises DiskFullError at its first call (a full disk cannot be aimed at one
    metadata write), then works."""
    real = getattr(store_module, step)
    calls: list[int] = []

    def full(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise embstore.DiskFullError("store", "write", errno.ENOSPC)
        return real(*args, **kwargs)

    monkeypatch.setattr(store_module, step, full)


# --- the store's lock is held until its tables are closed ---------------------------------------------------

def test_a_closing_store_stays_locked_until_its_tables_are_written_back(store_path, monkeypatch) -> None:
    """close() writes the tables' cached rows back to their homes, then gives up the store: an open in
    between would read (and write) tier files the first Store is still writing."""
    s = embstore.open(store_path)
    s["t"].update(np.array([3]), row(3.0))  # in the cache: the close writes it back
    seen = attempt_before(monkeypatch, "close_all", lambda: embstore.open(store_path))
    s.close()
    monkeypatch.undo()
    assert seen == ["StoreInUseError"]
    with embstore.open(store_path) as again:
        assert again["t"].lookup(np.array([3]))[0, 0] == 3.0


def test_a_failed_open_keeps_the_store_locked_until_its_tables_are_closed(store_path) -> None:
    """An open that fails after opening its tables (a logged write that cannot be replayed, after one
    that was) closes them before it gives up the lock."""
    log = WriteAheadLog(store_path / WAL_DIR)
    log.append("t", np.array([3]), row(3.0))
    log.append("gone", np.array([1]), row(1.0))
    log.close()
    with pytest.MonkeyPatch.context() as mp:
        seen = attempt_before(mp, "close_all", lambda: embstore.open(store_path))
        with pytest.raises(embstore.CorruptStoreError, match="unknown table 'gone'"):
            embstore.open(store_path)
    assert seen == ["StoreInUseError"]


@pytest.mark.parametrize("step", ["close_all", "_remove_contents"])
def test_a_failed_create_keeps_its_lock_until_it_has_removed_what_it_made(tmp_path, monkeypatch, step) -> None:
    """A create() that fails after building its tables (a full disk under its manifest) closes them and
    removes its folder, then lets go of the lock. A create() of the path let in before that would build
    its store in a folder being removed."""
    path = tmp_path / "s"
    fails_once(monkeypatch, "_write_manifest")
    seen = attempt_before(monkeypatch, step, lambda: embstore.create(path, CONFIG))
    with pytest.raises(embstore.DiskFullError):
        embstore.create(path, CONFIG)
    monkeypatch.undo()
    assert seen == ["StoreInUseError"]
    assert not path.exists()


@pytest.mark.parametrize("step", ["close_all", "_remove_contents"])
def test_a_create_whose_cleanup_fails_still_raises_its_error_and_lets_go(tmp_path, monkeypatch, caplog,
                                                                        step) -> None:
    """A create() that fails, and whose clean-up fails too (the folder removed under it: EBUSY, ENOENT),
    raises its first error, not the clean-up's, and releases the lock: before, the clean-up's OSError
    replaced the error and the lock was held until the process ended. A later create() of the path
    removes the debris and succeeds."""
    path = tmp_path / "s"
    path.mkdir()  # kept on failure: the clean-up empties it
    fails_once(monkeypatch, "_write_manifest")
    monkeypatch.setattr(store_module, step, lambda *a, **k: (_ for _ in ()).throw(OSError(16, "Device busy")))
    with pytest.raises(embstore.DiskFullError):
        embstore.create(path, CONFIG)
    assert "so did removing what it made" in caplog.text
    monkeypatch.undo()
    with embstore.create(path, CONFIG) as again:  # the lock was released, and the debris is removed
        again["t"].update(np.array([3]), row(3.0))
    with embstore.open(path) as reopened:
        assert reopened["t"].lookup(np.array([3]))[0, 0] == 3.0


# --- the lock file replaced under a waiting create() ----------------------------------------------------------

class PausedFlock:
    """Stands in for the store module's ``fcntl``: the first ``flock`` that thread ``name`` calls sets
    ``entered`` and waits for ``release`` (the window between opening the lock file and locking it)."""

    LOCK_EX, LOCK_NB = fcntl.LOCK_EX, fcntl.LOCK_NB

    def __init__(self, name: str) -> None:
        self.name = name
        self.entered, self.release = threading.Event(), threading.Event()

    def flock(self, fd: int, operation: int) -> None:
        if threading.current_thread().name == self.name and not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(30)
        fcntl.flock(fd, operation)


@pytest.mark.parametrize("then", ["made-again-and-locked", "made-again", "gone"])
def test_a_create_that_locked_a_removed_lock_file_takes_only_the_folders_lock(tmp_path, monkeypatch, then) -> None:
    """create() A fails (a tier too small for a row) and removes the folder it made, LOCK included,
    still holding the lock. Create B had opened that LOCK already and locks it once A lets go: a lock on a
    file no longer in the folder. Meanwhile C made the folder again and locked its new LOCK, or made it
    without locking it yet, or nobody did. B must see that its lock is not the folder's: taking it would
    make two creators at once (B clearing the files of C's running create() and building its store under
    C's lock). It takes the new LOCK if that is free, else refuses."""
    path = tmp_path / "s"
    refused = StoreConfig((TableConfig("t", 100, DIM, tiers=(TierConfig("dram", 8, "lru"), TierConfig("ssd"))),))
    flocks = PausedFlock("B")
    monkeypatch.setattr(store_module, "fcntl", flocks)
    remove = store_module._remove_contents
    b: list[tuple[threading.Thread, list[BaseException | None]]] = []

    def start_b_then_remove(*args: Any, **kwargs: Any) -> None:
        if not b:
            b.append(in_thread(lambda: embstore.create(path, CONFIG).close(), "B"))
            assert flocks.entered.wait(30)  # B has opened the LOCK about to be removed
        remove(*args, **kwargs)

    monkeypatch.setattr(store_module, "_remove_contents", start_b_then_remove)
    with pytest.raises(embstore.ConfigError):
        embstore.create(path, refused)  # A
    assert not path.exists()
    c = -1
    if then != "gone":
        path.mkdir()  # C
        (path / LOCK_FILE).touch()
    if then == "made-again-and-locked":  # C runs: it holds the new folder's lock and has marked it
        c = store_module._lock_store(path)
        (path / CREATING_FILE).touch()
    flocks.release.set()
    thread, outcome = b[0]
    thread.join(30)
    monkeypatch.undo()
    try:
        if then == "made-again":  # B took the new LOCK and made its store
            assert outcome == [None]
            with embstore.open(path) as s:
                assert set(s) == {"t", "m"}
            return
        assert isinstance(outcome[0], embstore.StoreInUseError), outcome
        if c >= 0:
            assert sorted(p.name for p in path.iterdir()) == [CREATING_FILE, LOCK_FILE]  # C's files stay
    finally:
        store_module._unlock_store(c)
    embstore.create(path, CONFIG).close()  # the path is free again
    embstore.open(path).close()


# --- log syncs and seals: one at a time ---------------------------------------------------------------------

def test_a_close_does_not_seal_the_log_beside_a_running_sync(store_path, monkeypatch) -> None:
    """sync_log A's fdatasync fails, losing write 2's pages, while sync_log B is queued to cover write 3
    and close() starts. A seal of the log run beside A (a sync of the same open file description) would
    "succeed", since Linux reports the error to A alone; B, finding the log sealed, would return at once,
    acknowledging write 3, which replay cannot reach past the hole. A power cut while the close writes
    the tables back then loses it. close() must seal only after A, as flush() does."""
    s = embstore.open(store_path)
    sync = HeldLosingSync(fail_at=2)
    monkeypatch.setattr(os, "fdatasync", sync)
    s.update_logged("t", np.array([1]), row(1.0))
    s.sync_log()
    s.update_logged("t", np.array([2]), row(2.0))
    monkeypatch.setattr(s, "_sync_lock", WatchedLock(s._sync_lock))
    a, a_out = in_thread(s.sync_log, "A")
    assert sync.entered.wait(30)
    s.update_logged("t", np.array([3]), row(3.0))
    b, b_out = in_thread(s.sync_log, "B")
    until(lambda: "B" in s._sync_lock.waiting, "B to queue behind A")
    write_back = Pause(s["t"].close)
    monkeypatch.setattr(s["t"], "close", write_back)
    c, c_out = in_thread(s.close, "C")
    until(lambda: "C" in s._sync_lock.waiting or write_back.entered.is_set(), "close to seal or to queue")
    sync.release.set()
    a.join(30)
    b.join(30)
    assert write_back.entered.wait(30)
    shutil.copytree(store_path, store_path.parent / "crash")  # a power cut while the close writes back
    write_back.release.set()
    c.join(30)
    monkeypatch.undo()
    with embstore.open(store_path.parent / "crash") as crashed:
        assert crashed["t"].lookup(np.array([1]))[0, 0] == 1.0
        if b_out[0] is None:  # write 3 was acknowledged: it must have survived
            assert crashed["t"].lookup(np.array([3]))[0, 0] == 3.0
    assert isinstance(a_out[0], embstore.TierIOError) and isinstance(b_out[0], embstore.TierIOError)
    assert c_out == [None]


# --- close() against the calls that change the store ----------------------------------------------------------

def beside_a_held_call(monkeypatch, s: embstore.Store, held: Pause, first: Any, second: Any) -> None:
    """Run ``first`` in a thread until it reaches ``held``, then ``second`` in another until it waits for
    the lock close() takes against the store's other lifecycle calls, or ends (the lock is watched even
    where the store has none, so that a call that waits for nothing is seen to end); then let both
    finish. Both must succeed."""
    lifecycle = WatchedLock(getattr(s, "_lifecycle", None))
    monkeypatch.setattr(s, "_lifecycle", lifecycle, raising=False)
    a, a_out = in_thread(first, "first")
    assert held.entered.wait(30)
    b, b_out = in_thread(second, "second")
    until(lambda: queued_or_done(lifecycle, b), "the second call to wait or return")
    held.release.set()
    a.join(30)
    b.join(30)
    assert a_out == [None] and b_out == [None], (a_out, b_out)


def test_a_second_close_returns_once_the_store_is_closed(store_path, monkeypatch) -> None:
    """Two threads close a store (a server's shutdown beside its reload): the one that finds it closing
    must not return before the store is given up, or its caller's reopen is refused."""
    s = embstore.open(store_path)
    write_back = Pause(s["t"].close)
    monkeypatch.setattr(s["t"], "close", write_back)

    def close_and_reopen() -> None:
        s.close()
        embstore.open(store_path).close()

    beside_a_held_call(monkeypatch, s, write_back, s.close, close_and_reopen)


def test_a_flush_running_when_the_store_closes_leaves_the_next_owners_log_alone(store_path, monkeypatch) -> None:
    """A flush deletes the log segments it sealed once its tables are flushed. A close that did not wait
    for it gives up the store while it runs: the next open starts the log again at segment 1, which the
    late end of the flush then deletes, and a power cut loses a write that open acknowledged."""
    s = embstore.open(store_path)
    s.update_logged("t", np.array([1]), row(1.0))  # the flush seals segment 1
    last = s[list(s)[-1]]
    tables_flushed = Pause(last.flush, after=True)  # held once every table is flushed
    monkeypatch.setattr(last, "flush", tables_flushed)
    after: list[embstore.Store] = []

    def close_then_write_and_sync() -> None:
        s.close()
        after.append(embstore.open(store_path))
        after[0].update_logged("t", np.array([2]), row(2.0))
        after[0].sync_log()  # acknowledged

    beside_a_held_call(monkeypatch, s, tables_flushed, s.flush, close_then_write_and_sync)
    shutil.copytree(store_path, store_path.parent / "crash")  # a power cut now
    after[0].close()
    with embstore.open(store_path.parent / "crash") as crashed:
        np.testing.assert_array_equal(crashed["t"].lookup(np.array([1, 2]))[:, 0], [1.0, 2.0])


@pytest.mark.parametrize("change", ["create_table", "ensure_state_dim"])
def test_a_table_made_while_the_store_closes_is_closed_with_it(store_path, monkeypatch, change) -> None:
    """create_table and ensure_state_dim open a table's tiers. A close that ran while they did would
    miss the new table: its tiers stay open (the mmap home's lock held) after the store is given up, and
    the store cannot be opened again."""
    s = embstore.open(store_path)
    manifest = Pause(store_module._write_manifest)
    monkeypatch.setattr(store_module, "_write_manifest", manifest)
    if change == "create_table":
        call = lambda: s.create_table(TableConfig("n", 100, DIM, tiers=(CACHE, TierConfig("mmap"))))  # noqa: E731
    else:
        call = lambda: s.ensure_state_dim("m", 2)  # noqa: E731
    beside_a_held_call(monkeypatch, s, manifest, call, s.close)
    monkeypatch.undo()
    with embstore.open(store_path) as again:
        assert set(again) == ({"t", "m", "n"} if change == "create_table" else {"t", "m"})
        assert again["m"].format.state_dim == (2 if change == "ensure_state_dim" else 0)


def test_a_failed_close_leaves_the_store_closed(store_path, monkeypatch) -> None:
    """A close whose table fails to close has given up the store all the same: the Store must count as
    closed, so that its tables are refused and a second close does nothing (closing the lock's
    descriptor again would close whatever file reuses its number)."""
    s = embstore.open(store_path)

    def fails() -> None:
        raise embstore.TierIOError("ssd", "flush", errno.EIO)

    monkeypatch.setattr(s["t"], "close", fails)
    with pytest.raises(embstore.TierIOError):
        s.close()
    monkeypatch.undo()
    with pytest.raises(embstore.StoreClosedError):
        s["t"]
    fd = os.open(store_path / "config.toml", os.O_RDONLY)  # the lowest free number: the lock's, most likely
    try:
        s.close()
        os.fstat(fd)  # still open
    finally:
        os.close(fd)
    s.tables["t"].close()  # the table the failed close skipped (its tiers hold no lock)


def test_an_open_refused_by_a_later_table_releases_the_tables_before_it(store_path) -> None:
    """A table in config.toml whose tiers are refused (a cache too small for a row) fails the open after
    the tables before it were opened: they must be closed (the mmap home's lock released), or the store
    stays unopenable in this process once the config is put right."""
    good = (store_path / "config.toml").read_text()
    bad = StoreConfig((*CONFIG.tables, TableConfig("z", 100, DIM, tiers=(TierConfig("dram", 8, "lru"),
                                                                         TierConfig("ssd")))))
    (store_path / "config.toml").write_text(bad.to_toml())
    with pytest.raises(embstore.ConfigError, match="holds no row"):
        embstore.open(store_path)
    (store_path / "config.toml").write_text(good)
    with embstore.open(store_path) as s:
        assert set(s) == {"t", "m"}
