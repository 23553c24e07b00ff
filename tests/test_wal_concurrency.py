"""The durability promise under concurrency: threads write (``update_logged``), sync (``sync_log``) and
flush a store at random while the log's ``fdatasync`` fails now and then the way Linux's does; a copy
of the store taken at any moment, with the log's unsynced bytes cut or zeroed as a power cut may leave
them, opens and holds every acknowledged write.

A write is acknowledged once a ``sync_log`` (any thread's) or a ``flush`` that began after it returned
has returned without error; ``close`` at the end acknowledges what it covers the same way. For each
row, a copy taken after the acknowledgement must hold that write's value or the value of a write that
is not known to come before it (a later write may or may not have survived; one that overlapped the
acknowledged one in time may have been applied after it). A write whose apply failed (reported to its
caller) must never come back, nor must a row hold anything else (a torn row, zeros).

Faults: ``RandomLosingSync`` replaces ``os.fdatasync`` (the log's; the tiers bind their own sync at
import and are covered by test_sync_failure.py): a failing call turns the bytes written since the
file's last good sync into zeros (a lost write-back whose pages the kernel dropped), raises EIO once,
and later calls really sync, as Linux's do. A table's flush, and the apply of a logged write, fail at
random too (raising before they touch anything: a full disk cannot be aimed at one call). Mocks only
for those faults; files, threads and the store are real.

What a power cut leaves is modelled, not taken from a live copy: ``shutil.copytree`` of a directory in
which another thread is mid-way through writing a table's files mixes files from before and after that
write, which no power cut leaves. So writes and flushes hold a shared ``Gate`` and a copy holds it
alone; log syncs run beside a copy (they only sync, or zero what a failed sync lost: both are states a
power cut can leave). Instead of racing appends, the copy then cuts each log segment anywhere after
its last good sync, or zeroes whole pages there, or keeps it: a real power cut keeps the synced bytes
and any part of the rest.

The threads' operation sequences, the faults and the power-cut choices are deterministic per seed;
the interleaving is not (that is what the test explores), so a seed that fails may need a few runs.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

import embstore
import embstore.store as store_module
from embstore.config import StoreConfig, TableConfig, TierConfig
from embstore.store import CREATING_FILE
from embstore.wal import WAL_DIR
from homes import home_tier
from log_faults import in_thread

ROWS, DIM = 40, 4
TABLES = ("a", "b")
PAGE = 4096


def config(home: str) -> StoreConfig:
    """Two tables of ROWS rows, each a 6-row dram cache (writes evict and write back) over ``home``."""
    return StoreConfig(tuple(TableConfig(name, ROWS, DIM, tiers=(TierConfig("dram", 6 * DIM * 4, "lru"),
                                                                   home_tier(home)))
                             for name in TABLES))


class Clock:
    """A global order of events across threads (stamps are taken after a call returns or before it starts)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._now = 0

    def __call__(self) -> int:
        with self._lock:
            self._now += 1
            return self._now


class Gate:
    """Writes and flushes hold it shared; a copy holds it alone, so that it sees no table file half-written."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._alone = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._alone)
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextmanager
    def alone(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._alone)
            self._alone = True
            self._cond.wait_for(lambda: self._shared == 0)
        try:
            yield
        finally:
            with self._cond:
                self._alone = False
                self._cond.notify_all()


class RandomLosingSync:
    """``os.fdatasync`` that fails at random calls (deterministic per seed and call number) as Linux's
    does: the bytes written since the file's last good sync become zeros, EIO is raised once, and later
    calls really sync. Keeps, per file, how many bytes a good sync made durable (the size *before* the
    call: bytes appended during it may not be synced); ``ftruncate`` (a retract) lowers that, and a sync
    that raced a truncate counts only up to the shortest length cut to meanwhile (the bytes below it were
    written back: a later failing sync must not zero what it synced, while the store took it as synced)."""

    def __init__(self, seed: int, rate: float) -> None:
        self.seed, self.rate = seed, rate
        self.real_sync, self.real_truncate = os.fdatasync, os.ftruncate
        self._lock = threading.Lock()
        self.calls = self.failures = 0
        self.synced: dict[str, int] = {}
        self._generation: dict[str, int] = {}
        self._cuts: dict[str, list[tuple[int, int]]] = {}  # path -> (generation after, length) of each truncate

    def _fails(self, call: int) -> bool:
        return bool(np.random.default_rng([self.seed, 7, call]).random() < self.rate)

    def __call__(self, fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        with self._lock:
            self.calls += 1
            if self._fails(self.calls):
                self.failures += 1
                good, size = self.synced.get(path, 0), os.fstat(fd).st_size
                with open(path, "r+b") as f:  # under the lock: a concurrent truncate cannot be undone
                    f.seek(good)
                    f.write(b"\0" * max(0, size - good))
                raise OSError(errno.EIO, "Input/output error")
            before, generation = os.fstat(fd).st_size, self._generation.get(path, 0)
        self.real_sync(fd)
        with self._lock:
            cut = min((length for g, length in self._cuts.get(path, ()) if g > generation), default=before)
            self.synced[path] = max(self.synced.get(path, 0), min(before, cut))

    def ftruncate(self, fd: int, length: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        with self._lock:
            self.real_truncate(fd, length)
            self.synced[path] = min(self.synced.get(path, 0), length)
            self._generation[path] = self._generation.get(path, 0) + 1
            self._cuts.setdefault(path, []).append((self._generation[path], length))

    def durable(self) -> dict[str, int]:
        with self._lock:
            return dict(self.synced)


@dataclass
class Write:
    table: str
    ids: tuple[int, ...]
    value: float
    start: int
    end: int


@dataclass
class Copy:
    path: Path
    at: int  # taken with no write or flush running; every stamp below it came before


@dataclass
class History:
    """What the threads did, in Clock stamps."""

    writes: list[Write] = field(default_factory=list)
    failed: list[Write] = field(default_factory=list)  # update_logged raised: never acknowledged
    syncs: list[tuple[int, int]] = field(default_factory=list)  # (start, end) of each sync or flush that returned
    copies: list[Copy] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def acknowledged_at(self, w: Write) -> float:
        """When ``w`` became durable: the first return of a sync or flush that began after it returned."""
        return min((end for start, end in self.syncs if start > w.end), default=float("inf"))


def power_cut(store: Path, copy: Path, durable: dict[str, int], rng: np.random.Generator) -> None:
    """Copy ``store`` to ``copy``, then leave each log segment as a power cut may: its synced bytes, and
    all of the rest, a prefix of it, or the rest with some pages lost (zeros)."""
    shutil.copytree(store, copy)
    for seg in sorted((copy / WAL_DIR).glob("*.log")) if (copy / WAL_DIR).is_dir() else []:
        good, size = durable.get(str(store / WAL_DIR / seg.name), 0), seg.stat().st_size
        if size <= good:
            continue
        mode = rng.integers(3)
        if mode == 1:
            os.truncate(seg, int(rng.integers(good, size + 1)))
        elif mode == 2:
            with open(seg, "r+b") as f:
                for page in range(good // PAGE, (size - 1) // PAGE + 1):
                    if rng.random() < 0.5:
                        lo, hi = max(good, page * PAGE), min(size, (page + 1) * PAGE)
                        f.seek(lo)
                        f.write(b"\0" * (hi - lo))


class Faults:
    """A table's flush and a logged write's apply fail at random (deterministic per seed and call)."""

    def __init__(self, store: embstore.Store, seed: int, rate: float) -> None:
        self.lock, self.calls, self.seed, self.rate = threading.Lock(), 0, seed, rate
        for table in store.tables.values():
            table.flush = self._failing(table.flush, "flush")
            table.update = self._failing(table.update, "write")

    def _failing(self, real, what: str):
        def call(*args):
            with self.lock:
                self.calls += 1
                fails = np.random.default_rng([self.seed, 11, self.calls]).random() < self.rate
            if fails:
                raise embstore.DiskFullError("ssd", what, errno.ENOSPC)
            return real(*args)
        return call


def worker(store: embstore.Store, path: Path, me: int, seed: int, ops: int, clock: Clock, gate: Gate,
           history: History, sync: RandomLosingSync, copies: Path) -> None:
    """``ops`` random operations: writes (60%), log syncs (27%), flushes (9%), power-cut copies (4%)."""
    rng = np.random.default_rng([seed, me])
    for k in range(ops):
        op = rng.random()
        if op < 0.60:
            table = TABLES[int(rng.integers(len(TABLES)))]
            ids = tuple(int(i) for i in rng.choice(ROWS, int(rng.integers(1, 4)), replace=False))
            value = float(me * 100_000 + k + 1)
            with gate.shared():
                start = clock()
                try:
                    store.update_logged(table, np.array(ids, np.int64), np.full((len(ids), DIM), value, np.float32))
                    ok = True
                except embstore.DiskFullError:
                    ok = False
                w = Write(table, ids, value, start, clock())
            with history.lock:
                (history.writes if ok else history.failed).append(w)
        elif op < 0.96:
            is_flush = op >= 0.87
            with gate.shared() if is_flush else _nothing():
                start = clock()
                try:
                    store.flush() if is_flush else store.sync_log()
                except embstore.TierIOError:  # a lost sync, a refused one, a table's failed flush
                    continue
                end = clock()
            with history.lock:
                history.syncs.append((start, end))
        else:
            with gate.alone():
                at = clock()
                target = copies / f"t{me}-{k}"
                power_cut(path, target, sync.durable(), np.random.default_rng([seed, me, k]))
            with history.lock:
                history.copies.append(Copy(target, at))


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def expected_values(history: History, copy: Copy) -> dict[tuple[str, int], tuple[set[float], bool]]:
    """Per written row: the values ``copy`` may hold, and whether its initial value is still allowed."""
    writes = [w for w in history.writes if w.end < copy.at]
    assert all(w.start > copy.at for w in history.writes if w.end > copy.at)  # the gate kept copies apart
    by_row: dict[tuple[str, int], list[Write]] = {}
    for w in writes:
        for i in w.ids:
            by_row.setdefault((w.table, i), []).append(w)
    out = {}
    for row, ws in by_row.items():
        acked = [w for w in ws if history.acknowledged_at(w) < copy.at]
        # a write that returned before an acknowledged one began was applied before it: superseded
        allowed = {w.value for w in ws if not any(v.start > w.end for v in acked)}
        out[row] = (allowed, not acked)
    return out


def check_copy(history: History, copy: Copy, initial: dict[str, np.ndarray]) -> None:
    """``copy`` opens, and each row holds what :func:`expected_values` allows."""
    expected = expected_values(history, copy)
    with embstore.open(copy.path) as s:
        for name in TABLES:
            got = s[name].lookup(np.arange(ROWS, dtype=np.int64))
            for i in range(ROWS):
                allowed, initial_ok = expected.get((name, i), (set(), True))
                row = got[i]
                if initial_ok and np.array_equal(row, initial[name][i]):
                    continue
                acked = [w for w in history.writes if w.table == name and i in w.ids
                         and history.acknowledged_at(w) < copy.at]
                assert (row == row[0]).all() and float(row[0]) in allowed, (
                    f"{copy.path.name}: {name}[{i}] = {row.tolist()}, expected one of {sorted(allowed)}"
                    f"{' or its initial row' if initial_ok else ''}; acknowledged before the copy: {acked}")


def stress(tmp_path: Path, monkeypatch, home: str, seed: int, threads: int, ops: int,
           sync_rate: float = 0.08, fault_rate: float = 0.04) -> History:
    """Run ``threads`` workers for ``ops`` operations each, close the store, check every copy."""
    path = tmp_path / "s"
    copies = tmp_path / "copies"
    copies.mkdir()
    embstore.create(path, config(home)).close()
    store = embstore.open(path)
    initial = {name: store[name].lookup(np.arange(ROWS, dtype=np.int64)) for name in TABLES}
    sync = RandomLosingSync(seed, sync_rate)
    monkeypatch.setattr(os, "fdatasync", sync)
    monkeypatch.setattr(os, "ftruncate", sync.ftruncate)
    Faults(store, seed, fault_rate)
    clock, gate, history = Clock(), Gate(), History()
    errors: list[BaseException] = []

    def run(me: int) -> None:
        try:
            worker(store, path, me, seed, ops, clock, gate, history, sync, copies)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test
            errors.append(exc)

    pool = [threading.Thread(target=run, args=(me,), daemon=True) for me in range(threads)]
    for t in pool:
        t.start()
    deadline = time.monotonic() + 120
    for t in pool:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in pool), "a worker is stuck (a deadlock?)"
    if errors:
        raise errors[0]
    start = clock()
    try:
        store.close()  # acknowledges every write, unless its seal's sync fails
        history.syncs.append((start, clock()))
    except embstore.TierIOError:
        pass
    final = Copy(copies / "closed", clock())
    power_cut(path, final.path, sync.durable(), np.random.default_rng([seed, 99]))
    history.copies.append(final)
    monkeypatch.undo()
    for copy in history.copies:
        check_copy(history, copy, initial)
    return history


@pytest.mark.parametrize("home", ["ssd", "mmap"])
@pytest.mark.parametrize("seed", range(3))
def test_acknowledged_writes_survive_a_power_cut_amid_concurrent_syncs_and_flushes(tmp_path, monkeypatch,
                                                                                   home, seed) -> None:
    history = stress(tmp_path, monkeypatch, home, seed, threads=3, ops=80)
    # the run checked what it is meant to: a copy taken mid-run that must hold acknowledged writes
    assert any(history.acknowledged_at(w) < c.at for c in history.copies[:-1] for w in history.writes)


@pytest.mark.slow
@pytest.mark.parametrize("home", ["ssd", "mmap", "ssd-log"])
@pytest.mark.parametrize("seed", range(3, 15))
def test_acknowledged_writes_survive_a_power_cut_amid_concurrent_syncs_and_flushes_long(
        tmp_path, monkeypatch, home, seed) -> None:
    stress(tmp_path, monkeypatch, home, seed, threads=4, ops=300)


# --- create() racing another create() ---------------------------------------------------------------------
# create() checks the folder, then takes its lock. A create() that held the lock during the checks and
# finished before the lock was taken left a whole store, which the checks had not seen. The race is
# made deterministic by finishing the other create() inside the first lock attempt.

def finish_another_create_before_the_lock(monkeypatch, path: Path) -> None:
    """Make create()'s first lock attempt wait for another create() of ``path`` that was running
    (holding the lock, past the checks) to finish: it writes row 3 and closes the store."""
    real = store_module._lock_store
    calls = []

    def lock(p: Path) -> int:
        calls.append(p)
        if len(calls) == 1:
            (path / CREATING_FILE).unlink(missing_ok=True)  # the other create() is past its own checks
            with embstore.create(path, config("ssd")) as other:
                other["a"].update(np.array([3]), np.full((1, DIM), 3.0, np.float32))
        return real(p)

    monkeypatch.setattr(store_module, "_lock_store", lock)


@pytest.mark.parametrize("debris", [True, False], ids=["creating-mark-seen", "empty-folder-seen"])
def test_a_create_that_raced_a_finishing_create_refuses_instead_of_clearing_its_store(tmp_path, monkeypatch,
                                                                                       debris) -> None:
    """The other create() was seen mid-way (its ``.creating`` mark: debris once its lock is free) or not
    yet started (an empty folder); either way the store it made must stay, and this create() must refuse."""
    path = tmp_path / "s"
    path.mkdir()
    if debris:
        (path / CREATING_FILE).touch()
    finish_another_create_before_the_lock(monkeypatch, path)
    with pytest.raises(embstore.StoreExistsError):
        embstore.create(path, config("mmap"))
    monkeypatch.undo()
    with embstore.open(path) as s:
        assert s["a"].lookup(np.array([3]))[0, 0] == 3.0


def test_a_create_refused_by_a_running_create_leaves_its_folder_alone(tmp_path, monkeypatch) -> None:
    """Two create()s of a folder that did not exist: the one that finds the lock taken must not delete
    the folder (it did not make what is in it), even though the folder was missing when it looked."""
    path = tmp_path / "s"
    real = store_module._lock_store
    held: list[embstore.Store] = []
    calls = []

    def lock(p: Path) -> int:
        calls.append(p)
        if len(calls) == 1:  # the other create() made the folder and finished first; its store is open
            held.append(embstore.create(path, config("ssd")))
            held[0]["a"].update(np.array([4]), np.full((1, DIM), 4.0, np.float32))
        return real(p)

    monkeypatch.setattr(store_module, "_lock_store", lock)
    with pytest.raises(embstore.StoreInUseError):
        embstore.create(path, config("ssd"))
    monkeypatch.undo()
    held[0].close()
    with embstore.open(path) as s:
        assert s["a"].lookup(np.array([4]))[0, 0] == 4.0


# --- targeted races the random runs reach too rarely ------------------------------------------------------

class ScriptedSync:
    """``os.fdatasync`` whose calls numbered in ``fail`` lose the file's bytes written since its last good
    sync (zeros) and raise EIO, which Linux reports to that one call; call ``hold`` waits for ``release``,
    then really syncs (and "succeeds" if a failed call lost its pages meanwhile); the rest are real."""

    def __init__(self, fail: set[int], hold: int = 0) -> None:
        self.real, self.fail, self.hold = os.fdatasync, fail, hold
        self.entered, self.release = threading.Event(), threading.Event()
        self.calls = 0
        self.synced: dict[str, int] = {}

    def __call__(self, fd: int) -> None:
        self.calls += 1
        path, size = os.readlink(f"/proc/self/fd/{fd}"), os.fstat(fd).st_size
        if self.calls in self.fail:
            good = self.synced.get(path, 0)
            with open(path, "r+b") as f:
                f.seek(good)
                f.write(b"\0" * max(0, size - good))
            raise OSError(errno.EIO, "Input/output error")
        if self.calls == self.hold:
            self.entered.set()
            assert self.release.wait(30)
        self.real(fd)
        self.synced[path] = size


def disk_full(ids, rows) -> None:
    """A logged write's apply that fails (a full disk under a write-back), before it changes anything."""
    raise embstore.DiskFullError("ssd", "write", errno.ENOSPC)


def table_flush_fails() -> None:
    """A table's flush that fails (an I/O error writing its home)."""
    raise embstore.TierIOError("ssd", "flush", errno.EIO)


def row(value: float) -> np.ndarray:
    return np.full((1, DIM), value, np.float32)


def sync_then_power_cut(store: embstore.Store, crash: Path) -> bool:
    """Whether a ``sync_log`` now acknowledges the store's writes; then copy the store to ``crash``, as a
    power cut would leave it."""
    try:
        store.sync_log()
        acknowledged = True
    except embstore.TierIOError:
        acknowledged = False
    shutil.copytree(store.path, crash)
    return acknowledged


def sync_refused_and_row_1_kept(store: embstore.Store, monkeypatch, crash: Path) -> None:
    """A ``sync_log`` now must refuse; had it acknowledged, the power-cut copy must hold row 1 of "a"."""
    acknowledged = sync_then_power_cut(store, crash)
    monkeypatch.undo()
    with embstore.open(crash) as crashed:
        if acknowledged:
            assert crashed["a"].lookup(np.array([1]))[0, 0] == 1.0
    assert not acknowledged


def test_a_log_sync_racing_a_failed_retract_does_not_acknowledge(tmp_path, monkeypatch) -> None:
    """``sync_log`` fdatasyncs outside the store's lock; a logged write whose apply fails meanwhile is cut
    from the log and the cut synced, under that lock only. If that sync fails, the pages lost include the
    records ``sync_log`` is covering, and its own fdatasync (a duplicate descriptor) returns success:
    ``sync_log`` must fail all the same (``WriteAheadLog.synced``), or a crash loses a write it
    acknowledged."""
    path = tmp_path / "s"
    embstore.create(path, config("ssd")).close()
    with embstore.open(path) as store:
        fake = ScriptedSync(fail={2}, hold=1)
        monkeypatch.setattr(os, "fdatasync", fake)
        store.update_logged("a", np.array([1]), row(1.0))
        syncer, outcome = in_thread(store.sync_log)
        assert fake.entered.wait(30)
        real_update = store["a"].update
        monkeypatch.setattr(store["a"], "update", disk_full)
        with pytest.raises(embstore.DiskFullError):
            store.update_logged("a", np.array([2]), row(2.0))  # its retract's sync is call 2: it fails
        monkeypatch.setattr(store["a"], "update", real_update)
        fake.release.set()
        syncer.join(30)
        shutil.copytree(path, tmp_path / "crash")  # a power cut now
        monkeypatch.undo()
    with embstore.open(tmp_path / "crash") as crashed:
        if outcome[0] is None:  # acknowledged: it must have survived
            assert crashed["a"].lookup(np.array([1]))[0, 0] == 1.0
    assert isinstance(outcome[0], embstore.TierIOError)


def test_a_failed_sync_of_the_new_segment_during_a_flush_is_not_forgotten(tmp_path, monkeypatch) -> None:
    """A flush retires a segment whose sync failed. While it flushes the tables, a write goes to the new
    segment and another's apply fails, and the sync of its cut fails too, losing the first write's record.
    The flush's end must retire only the old segment's failure: forgetting the new one's lets the next
    ``sync_log`` "succeed" (Linux reported the error once, to the cut's sync) and acknowledge a write that
    a crash then loses."""
    path = tmp_path / "s"
    embstore.create(path, config("ssd")).close()
    with embstore.open(path) as store:
        monkeypatch.setattr(os, "fdatasync", ScriptedSync(fail={1, 2}))
        store.update_logged("a", np.array([1]), row(1.0))
        with pytest.raises(embstore.TierIOError):
            store.sync_log()  # call 1 fails: segment 1 must be retired by a flush
        table = store["a"]
        real_flush, real_update = table.flush, table.update

        def flush_then_writes() -> None:  # as other threads would write while the flush runs
            real_flush()
            store.update_logged("a", np.array([5]), row(5.0))  # segment 2, after its table was flushed
            monkeypatch.setattr(table, "update", disk_full)
            with pytest.raises(embstore.DiskFullError):
                store.update_logged("a", np.array([6]), row(6.0))  # the cut's sync (call 2) fails
            monkeypatch.setattr(table, "update", real_update)

        monkeypatch.setattr(table, "flush", flush_then_writes)
        store.flush()
        monkeypatch.setattr(table, "flush", real_flush)
        acknowledged = sync_then_power_cut(store, tmp_path / "crash")
        monkeypatch.undo()
    with embstore.open(tmp_path / "crash") as crashed:
        assert crashed["a"].lookup(np.array([1]))[0, 0] == 1.0  # the flush covered it
        if acknowledged:
            assert crashed["a"].lookup(np.array([5]))[0, 0] == 5.0
    assert not acknowledged


def test_a_flush_that_fails_after_sealing_a_failed_segment_acknowledges_nothing(tmp_path, monkeypatch) -> None:
    """A log sync fails, then a flush seals the damaged segment (marked, not synced again) and fails to
    flush a table. The segment's writes are neither synced nor flushed: a ``sync_log`` asked for nothing
    new since the seal must refuse, not take the seal for a sync and acknowledge them."""
    path = tmp_path / "s"
    embstore.create(path, config("ssd")).close()
    with embstore.open(path) as store:
        monkeypatch.setattr(os, "fdatasync", ScriptedSync(fail={1}))
        store.update_logged("a", np.array([1]), row(1.0))
        with pytest.raises(embstore.TierIOError):
            store.sync_log()
        real_flush = store["a"].flush

        monkeypatch.setattr(store["a"], "flush", table_flush_fails)
        with pytest.raises(embstore.TierIOError):
            store.flush()
        monkeypatch.setattr(store["a"], "flush", real_flush)
        sync_refused_and_row_1_kept(store, monkeypatch, tmp_path / "crash")


def test_a_seal_after_a_failed_segment_does_not_acknowledge_that_segment(tmp_path, monkeypatch) -> None:
    """A retract's sync fails (segment 1 loses its unsynced pages), a flush seals segment 1 (marked) and
    fails to flush a table; a write goes to segment 2, and a second flush seals segment 2 (a good sync)
    and fails too. Segment 1's writes are still neither synced nor flushed: the good seal of a later
    segment must not let a ``sync_log`` take them for durable (found by the stress test above: the
    copy's replay stopped at segment 1's hole and lost an acknowledged write)."""
    path = tmp_path / "s"
    embstore.create(path, config("ssd")).close()
    with embstore.open(path) as store:
        monkeypatch.setattr(os, "fdatasync", ScriptedSync(fail={1}))
        table = store["a"]
        real_flush, real_update = table.flush, table.update
        store.update_logged("a", np.array([1]), row(1.0))
        monkeypatch.setattr(table, "update", disk_full)
        with pytest.raises(embstore.DiskFullError):
            store.update_logged("a", np.array([2]), row(2.0))  # the cut's sync (call 1) fails: row 1 lost
        monkeypatch.setattr(table, "update", real_update)

        monkeypatch.setattr(table, "flush", table_flush_fails)
        with pytest.raises(embstore.TierIOError):
            store.flush()  # seals segment 1 with its mark
        store.update_logged("b", np.array([3]), row(3.0))  # segment 2
        with pytest.raises(embstore.TierIOError):
            store.flush()  # seals segment 2: its sync (call 2) succeeds
        monkeypatch.setattr(table, "flush", real_flush)
        sync_refused_and_row_1_kept(store, monkeypatch, tmp_path / "crash")
