"""The write-ahead log's durability promise, explored systematically: a Hypothesis state machine drives one
store from one thread through logged writes, log syncs, flushes and close/reopen, with faults injected
between them (a logged write whose apply fails, a table's flush that fails, the next ``fdatasync`` failing
the way Linux's does), and checks a power-cut copy of the store against a reference model at any step.

The model: a successful ``update_logged`` is acknowledged once a later ``sync_log`` or ``flush`` returned
without error, or a close did; a write whose call raised is never acknowledged. A copy of the store, its
log segments cut anywhere at or after their last good sync (or pages there zeroed), must open and hold,
for every row, the value of its latest acknowledged write or of a later write (which may or may not have
survived); never a failed write's value, never a torn or zero row; its base value (initial, or what the
last reopen read) only if no write to it was acknowledged since.

The tables' dram caches hold every row, so that no write is written back to a home file before a flush:
a copy's tables then hold what was flushed, and the log alone carries every write since (a write-back to
the home would hide a write the log lost). The ``small-cache`` variant (slow) lets writes evict.

The random multi-thread variant is test_wal_concurrency.py; this one finds single-thread sequences of
faults (the seal bug fixed in f728b36 takes eight steps) within a few hundred examples.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import embstore
from embstore.config import StoreConfig, TableConfig, TierConfig
from embstore.wal import WAL_DIR
from homes import home_tier
from log_faults import LosingSync

ROWS, DIM = 12, 4
TABLES = ("a", "b")
PAGE = 4096
ROW_BYTES = DIM * 4

Row = tuple[str, int]

# The syncs that count are the model's, not the file system's: a tmpfs, where fsync costs nothing, runs
# several times as many examples in the same time.
FAST_TMP = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class NextSyncLoses(LosingSync):
    """:class:`LosingSync` whose failing call is chosen as the run goes (:meth:`arm`: the next call), with
    ``ftruncate`` lowering a file's synced length (a retract cuts synced bytes off too) and the lengths of
    deleted files forgotten (a store reopened after its log was dropped starts again at segment 1)."""

    def __init__(self) -> None:
        super().__init__(fail_at=0)
        self.real_truncate = os.ftruncate
        self.failures = 0

    def __call__(self, fd: int) -> None:
        if self.calls + 1 == self.fail_at:
            self.failures += 1
        super().__call__(fd)

    def arm(self) -> None:
        self.fail_at = self.calls + 1

    @property
    def armed(self) -> bool:
        return self.fail_at > self.calls

    def ftruncate(self, fd: int, length: int) -> None:
        self.real_truncate(fd, length)
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path in self.synced:
            self.synced[path] = min(self.synced[path], length)

    def durable(self, path: Path) -> int:
        return self.synced.get(str(path), 0)

    def forget_missing(self) -> None:
        self.synced = {p: n for p, n in self.synced.items() if os.path.exists(p)}


def config(home: str, cache_rows: int) -> StoreConfig:
    return StoreConfig(tuple(TableConfig(name, ROWS, DIM, tiers=(TierConfig("dram", cache_rows * ROW_BYTES, "lru"),
                                                                   home_tier(home)))
                             for name in TABLES))


def disk_full(ids, rows) -> None:
    """A logged write's apply that fails (a full disk under a write-back) before it changes anything."""
    raise embstore.DiskFullError("ssd", "write", errno.ENOSPC)


def flush_fails() -> None:
    """A table's flush that fails before it writes anything."""
    raise embstore.TierIOError("ssd", "flush", errno.EIO)


ids_strategy = st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=3, unique=True)


class WalMachine(RuleBasedStateMachine):
    """One store, one thread; ``home`` and ``cache_rows`` are set by the subclasses the tests run."""

    home = "ssd"
    cache_rows = ROWS

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="embstore-walmodel-", dir=FAST_TMP))
        self.path = self.dir / "s"
        self.store: embstore.Store | None = None
        self.sync = NextSyncLoses()
        self.real = (os.fdatasync, os.ftruncate)

    @initialize()
    def create(self) -> None:
        self.store = embstore.create(self.path, config(self.home, self.cache_rows))
        os.fdatasync, os.ftruncate = self.sync, self.sync.ftruncate  # restored by teardown
        self.base = self.read_all(self.store)  # every row's value before any write this model tracks
        self.writes: list[tuple[str, tuple[int, ...], float]] = []  # successful writes, in order
        self.acked = 0  # self.writes[:self.acked] are acknowledged
        self.failed: set[float] = set()
        self.next_value = 1.0
        self.copies = self.reopens = 0
        self.checked: tuple | None = None

    def teardown(self) -> None:
        os.fdatasync, os.ftruncate = self.real
        try:
            if self.store is not None:
                self.store.close()
        except embstore.EmbstoreError:
            pass
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    # --- the model -------------------------------------------------------------------------------------
    @staticmethod
    def read_all(store: embstore.Store) -> dict[Row, np.ndarray]:
        every = np.arange(ROWS, dtype=np.int64)
        return {(t, i): row for t in TABLES for i, row in enumerate(store[t].lookup(every))}

    def allowed(self, row: Row) -> tuple[set[float], bool]:
        """The values a copy may hold at ``row``, and whether its base value is still allowed."""
        touching = [(k, value) for k, (t, ids, value) in enumerate(self.writes) if t == row[0] and row[1] in ids]
        acked = [k for k, _ in touching if k < self.acked]
        since = acked[-1] if acked else 0
        return {value for k, value in touching if k >= since}, not acked

    def check(self, got: dict[Row, np.ndarray], what: str) -> None:
        for row, value in got.items():
            values, base_ok = self.allowed(row)
            if base_ok and np.array_equal(value, self.base[row]):
                continue
            assert (value == value[0]).all() and float(value[0]) in values, (
                f"{what}: {row} = {value.tolist()}, expected one of {sorted(values)}"
                f"{' or its base ' + str(self.base[row].tolist()) if base_ok else ''}; failed writes "
                f"{sorted(self.failed)}; writes {self.writes}, the first {self.acked} acknowledged")

    def acknowledge(self) -> None:
        self.acked = len(self.writes)

    def write_value(self) -> float:
        value, self.next_value = self.next_value, self.next_value + 1
        return value

    # --- rules -------------------------------------------------------------------------------------------
    @rule(table=st.sampled_from(TABLES), ids=ids_strategy)
    def write(self, table: str, ids: list[int]) -> None:
        value = self.write_value()
        self.store.update_logged(table, np.array(ids, np.int64), np.full((len(ids), DIM), value, np.float32))
        self.writes.append((table, tuple(ids), value))

    @rule(table=st.sampled_from(TABLES), ids=ids_strategy)
    def write_whose_apply_fails(self, table: str, ids: list[int]) -> None:
        value = self.write_value()
        target = self.store[table]
        target.update = disk_full
        try:
            with pytest.raises(embstore.DiskFullError):
                self.store.update_logged(table, np.array(ids, np.int64), np.full((len(ids), DIM), value, np.float32))
        finally:
            del target.update
        self.failed.add(value)

    @rule()
    def sync_log(self) -> None:
        try:
            self.store.sync_log()
        except embstore.TierIOError:
            return
        self.acknowledge()

    @rule()
    def flush(self) -> None:
        try:
            self.store.flush()
        except embstore.TierIOError:
            return
        self.acknowledge()
        self.sync.forget_missing()

    @rule(table=st.sampled_from(TABLES))
    def flush_whose_table_flush_fails(self, table: str) -> None:
        target = self.store[table]
        target.flush = flush_fails
        try:
            with pytest.raises(embstore.TierIOError):
                self.store.flush()
        finally:
            del target.flush

    @precondition(lambda self: not self.sync.armed)
    @rule()
    def next_sync_fails(self) -> None:
        self.sync.arm()

    @rule(fault=st.sampled_from(["none", "table"]))
    def close_and_reopen(self, fault: str) -> None:
        """A close (a clean one acknowledges everything; one whose seal's sync or table flush fails,
        nothing), then an open, which replays the log: every row must hold what the model allows, and
        from there on what it read is the base (the open flushed it)."""
        if fault == "table":
            target = self.store[TABLES[0]]
            target.hierarchy.flush = flush_fails
        try:
            self.store.close()
            self.acknowledge()
        except embstore.TierIOError:
            pass
        self.store = None
        self.reopens += 1
        self.sync.forget_missing()
        self.store = embstore.open(self.path)
        got = self.read_all(self.store)
        self.check(got, "reopened")
        self.base, self.writes, self.acked = got, [], 0
        self.sync.forget_missing()

    def crash_copy(self, cut: Callable[[Path, int, int], None]) -> None:
        """Copy the store as a power cut now may leave it, each log segment past its synced length as
        ``cut(segment, synced, size)`` leaves it; open the copy (which replays its log) and check it."""
        self.copies += 1
        copy = self.dir / f"cut{self.copies}"
        shutil.copytree(self.path, copy)
        for segment in sorted((copy / WAL_DIR).glob("*.log")) if (copy / WAL_DIR).is_dir() else []:
            good, size = self.sync.durable(self.path / WAL_DIR / segment.name), segment.stat().st_size
            if size > good:
                cut(segment, good, size)
        os.fdatasync, os.ftruncate = self.real  # the copy's own replay is not the model's
        try:
            with embstore.open(copy) as crashed:
                self.check(self.read_all(crashed), f"power cut {copy.name}")
        finally:
            os.fdatasync, os.ftruncate = self.sync, self.sync.ftruncate
        shutil.rmtree(copy)

    @rule(data=st.data())
    def power_cut(self, data: st.DataObject) -> None:
        """A power cut that keeps each log segment's synced bytes, and all, a prefix or some pages
        (zeroed) of the rest."""
        def cut(segment: Path, good: int, size: int) -> None:
            how = data.draw(st.sampled_from(["keep", "cut", "zero"]), label=f"{segment.name} after {good}")
            if how == "cut":
                os.truncate(segment, data.draw(st.integers(good, size), label="cut at"))
            elif how == "zero":
                pages = data.draw(st.sets(st.integers(good // PAGE, (size - 1) // PAGE), min_size=1), label="pages")
                with open(segment, "r+b") as f:
                    for page in pages:
                        lo, hi = max(good, page * PAGE), min(size, (page + 1) * PAGE)
                        f.seek(lo)
                        f.write(b"\0" * (hi - lo))

        self.crash_copy(cut)

    @invariant()
    def a_power_cut_losing_every_unsynced_byte_keeps_what_was_acknowledged(self) -> None:
        """After each step that acknowledged writes, lost a sync or reopened the store, the harshest power
        cut: every log segment cut at its synced length. Checked at once rather than left to a later
        ``power_cut`` step, so that a lost acknowledged write is found in fewer steps (a copy costs more
        than the rest of a step: not after every one)."""
        if self.store is None:
            return
        state = (self.acked, self.reopens, self.sync.failures)
        if state == self.checked:
            return
        self.checked = state
        self.crash_copy(lambda segment, good, size: os.truncate(segment, good))

    @invariant()
    def reads_see_every_successful_write(self) -> None:
        """The live store reads each row's latest successful write (never a failed one)."""
        if self.store is None:
            return
        for row, value in self.read_all(self.store).items():
            touching = [v for t, ids, v in self.writes if t == row[0] and row[1] in ids]
            want = np.full(DIM, touching[-1], np.float32) if touching else self.base[row]
            assert np.array_equal(value, want), f"live {row} = {value.tolist()}, wrote {want.tolist()}"


STEPS = 25


class SsdMachine(WalMachine):
    home = "ssd"


TestWalModel = SsdMachine.TestCase
TestWalModel.settings = settings(max_examples=150, stateful_step_count=STEPS, deadline=None)


def machine(home: str, cache_rows: int) -> type[WalMachine]:
    return type(f"WalMachine_{home}_{cache_rows}", (WalMachine,), {"home": home, "cache_rows": cache_rows})


@pytest.mark.slow
@pytest.mark.parametrize("home, cache_rows", [("ssd", ROWS), ("mmap", ROWS), ("ssd-log", ROWS), ("ssd", 3)],
                         ids=["ssd", "mmap", "ssd-log", "ssd-small-cache"])
def test_wal_model_long(home: str, cache_rows: int) -> None:
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(machine(home, cache_rows),
                              settings=settings(max_examples=500, stateful_step_count=40, deadline=None))
