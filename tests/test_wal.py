"""The store's write-ahead log: logged writes survive SIGKILL without a flush, torn tails are ignored,
replay keeps the order writes were applied in, and flushes drop only what they cover."""

from __future__ import annotations

import errno
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import embstore
from embstore.config import StoreConfig, TableConfig, TierConfig
from embstore.wal import WAL_DIR, WriteAheadLog, read_records
from faultfs import needs_mount
from log_faults import HeldLosingSync, LosingSync, WatchedLock, in_thread, queued_or_done, until

ROWS, DIM = 200, 4
CONFIG = StoreConfig((TableConfig("t", ROWS, DIM, tiers=(TierConfig("dram", 64 * DIM * 4, "lru"), TierConfig("ssd"))),
                      TableConfig("h", ROWS, DIM, hash={"kind": "mod"},
                                  tiers=(TierConfig("dram", 64 * DIM * 4, "lru"), TierConfig("ssd")))))


def run_and_kill(store_path, body: str) -> None:
    """Run ``body`` (with ``store`` open, ``np`` imported) in a child that SIGKILLs itself at the end."""
    script = textwrap.dedent(f"""
        import os, signal
        import numpy as np
        import embstore
        store = embstore.open({str(store_path)!r})
    """) + textwrap.dedent(body) + "\nos.kill(os.getpid(), signal.SIGKILL)\n"
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == -9, r.stderr


def rows_of(value: float) -> np.ndarray:
    return np.full((1, DIM), value, np.float32)


@pytest.fixture()
def store_path(tmp_path):
    embstore.create(tmp_path / "s", CONFIG).close()
    return tmp_path / "s"


def test_synced_writes_survive_sigkill_and_unlogged_ones_do_not(store_path) -> None:
    run_and_kill(store_path, """
        for i in range(5):
            store.update_logged("t", np.array([i]), np.full((1, 4), i + 1.0, np.float32))
        store.update_logged("h", np.array([2**40 + 3]), np.full((1, 4), 7.0, np.float32))
        store["t"].update(np.array([9]), np.full((1, 4), 9.0, np.float32))  # not logged, never flushed
        store.sync_log()
    """)
    with embstore.open(store_path) as s:
        got = s["t"].lookup(np.arange(10, dtype=np.int64))
        assert (got[:5] == np.arange(1, 6, dtype=np.float32)[:, None]).all()
        assert not (got[9] == 9.0).all()  # the control: an unlogged write died with the process
        assert (s["h"].lookup(np.array([2**40 + 3])) == 7.0).all()
    assert not any((store_path / WAL_DIR).iterdir())  # replayed, flushed and dropped on open


def test_writes_after_a_flush_stay_logged_and_the_last_write_wins(store_path) -> None:
    run_and_kill(store_path, """
        store.update_logged("t", np.array([1, 2]), np.full((2, 4), 1.0, np.float32))
        store.flush()
        store.update_logged("t", np.array([2, 3]), np.full((2, 4), 2.0, np.float32))
        store.update_logged("t", np.array([3]), np.full((1, 4), 3.0, np.float32))
        store.sync_log()
    """)
    with embstore.open(store_path) as s:
        assert (s["t"].lookup(np.array([1, 2, 3])) == np.array([[1.0], [2.0], [3.0]], np.float32)).all()


def test_a_torn_tail_is_ignored_and_whole_records_are_replayed(store_path) -> None:
    run_and_kill(store_path, """
        for i in range(3):
            store.update_logged("t", np.array([i]), np.full((1, 4), 10.0 + i, np.float32))
        store.sync_log()
    """)
    (segment,) = sorted((store_path / WAL_DIR).iterdir())
    data = segment.read_bytes()
    segment.write_bytes(data[:-5])  # the third record loses its last bytes, as a crash mid-append would
    assert [int(ids[0]) for _, ids, _ in read_records(store_path / WAL_DIR)] == [0, 1]
    with embstore.open(store_path) as s:
        got = s["t"].lookup(np.arange(3, dtype=np.int64))
    assert (got[:2] == np.array([[10.0], [11.0]], np.float32)).all() and not (got[2] == 12.0).all()


def test_damage_before_the_last_segment_is_refused_not_skipped(store_path) -> None:
    run_and_kill(store_path, """
        store.update_logged("t", np.array([1]), np.full((1, 4), 1.0, np.float32))
        store.flush()
        store.update_logged("t", np.array([2]), np.full((1, 4), 2.0, np.float32))
        store._wal.seal()  # as a flush that died before dropping segments would leave it
        store.update_logged("t", np.array([3]), np.full((1, 4), 3.0, np.float32))
        store.sync_log()
    """)
    first, last = sorted((store_path / WAL_DIR).glob("*.log"))
    (store_path / WAL_DIR / "notes.txt").write_text("not a segment")
    first.write_bytes(first.read_bytes()[:-1])
    with pytest.raises(embstore.CorruptStoreError, match="later segments hold acknowledged writes"):
        embstore.open(store_path)


def test_a_refused_write_is_not_logged(store_path) -> None:
    with embstore.open(store_path) as s:
        for ids, rows in [(np.array([ROWS]), rows_of(1.0)), (np.array([1]), rows_of(np.nan)),
                          (np.array([1]), np.ones((1, DIM + 1), np.float32))]:
            with pytest.raises(ValueError):
                s.update_logged("t", ids, rows)
        assert list(read_records(store_path / WAL_DIR)) == []


def test_a_logged_write_to_an_unknown_table_is_a_corrupt_store(store_path) -> None:
    run_and_kill(store_path, """
        store.update_logged("t", np.array([1]), np.full((1, 4), 1.0, np.float32))
        store.sync_log()
    """)
    (segment,) = sorted((store_path / WAL_DIR).iterdir())
    segment.write_bytes(segment.read_bytes().replace(b"\x01\x00t", b"\x01\x00x"))
    segment_crc_fixed = _refresh_crc(segment.read_bytes())
    segment.write_bytes(segment_crc_fixed)
    with pytest.raises(embstore.CorruptStoreError, match="unknown table 'x'"):
        embstore.open(store_path)


def _refresh_crc(record: bytes) -> bytes:
    import struct
    import zlib

    magic, size, _ = struct.unpack_from("<III", record)
    payload = record[12:12 + size]
    return struct.pack("<III", magic, size, zlib.crc32(payload)) + payload


@settings(max_examples=12, deadline=None)
@given(st.lists(st.one_of(st.tuples(st.just("w"), st.lists(st.integers(0, 20), min_size=1, max_size=4),
                                    st.floats(-4, 4, allow_nan=False, width=32)),
                          st.tuples(st.just("flush"), st.just([]), st.just(0.0))), min_size=1, max_size=12))
def test_any_sequence_of_logged_writes_and_flushes_survives_a_kill(tmp_path_factory, ops) -> None:
    path = tmp_path_factory.mktemp("wal") / "s"
    embstore.create(path, CONFIG).close()
    model: dict[int, float] = {}
    lines = []
    for kind, ids, value in ops:
        if kind == "flush":
            lines.append("store.flush()")
        else:
            lines.append(f"store.update_logged('t', np.array({ids}), np.full(({len(ids)}, 4), {value!r}, np.float32))")
            model.update({i: np.float32(value) for i in ids})
    lines.append("store.sync_log()")
    run_and_kill(path, "\n".join(lines))
    with embstore.open(path) as s:
        keys = np.array(sorted(model), np.int64)
        np.testing.assert_array_equal(s["t"].lookup(keys)[:, 0], np.array([model[k] for k in keys], np.float32))


def _write_segments(directory, records_per_segment: list[int], dim: int = DIM) -> list[tuple[int, float]]:
    """Segments of ``n`` records each through the real appender; returns (id, value) of every record."""
    wal = WriteAheadLog(directory)
    written = []
    for count in records_per_segment:
        for _ in range(count):
            i = len(written)
            wal.append("t", np.array([i, i + 1]), np.full((2, dim), i / 7, np.float32))
            written.append((i, np.float32(i / 7)))
        wal.seal()
    wal.close()
    return written


def _replay_peak(directory) -> tuple[list[tuple[int, float]], int]:
    """(id, value) of each replayed record, and the peak bytes Python allocated while replaying."""
    tracemalloc.start()
    try:
        got = [(int(ids[0]), rows[0, 0]) for _, ids, rows in read_records(directory)]
        return got, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_replay_streams_a_segment_of_many_records(tmp_path) -> None:
    written = _write_segments(tmp_path, [3000], dim=256)  # ~6 MB in one segment, 2 KiB a record
    (segment,) = tmp_path.glob("*.log")
    got, peak = _replay_peak(tmp_path)
    assert got == written
    assert peak < segment.stat().st_size // 8  # record by record, not the segment whole


def _append_absurd_header(segment) -> None:
    with open(segment, "ab") as f:
        f.write(struct.pack("<III", 0x314C5745, 0xFFFFFFF0, 0) + b"\x00" * 100)


def test_an_absurd_length_in_the_last_segment_is_a_torn_tail(tmp_path) -> None:
    written = _write_segments(tmp_path, [5])
    _append_absurd_header(next(tmp_path.glob("*.log")))
    got, peak = _replay_peak(tmp_path)
    assert got == written and peak < 1 << 20  # no 4 GiB read of a record that cannot be there


def test_an_absurd_length_before_the_last_segment_is_corruption(tmp_path) -> None:
    _write_segments(tmp_path, [5, 1])
    first, _ = sorted(tmp_path.glob("*.log"))
    at = first.stat().st_size
    _append_absurd_header(first)
    tracemalloc.start()
    try:
        with pytest.raises(embstore.CorruptStoreError, match=f"offset {at} is damaged"):
            list(read_records(tmp_path))
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()


def test_a_logged_write_refused_by_a_racing_close_is_not_replayed(store_path, monkeypatch) -> None:
    store = embstore.open(store_path)
    table = store["t"]
    check = table.check_update

    def close_meanwhile(ids, rows):  # another thread closes the store between the checks and the log
        out = check(ids, rows)
        store.close()
        return out

    monkeypatch.setattr(table, "check_update", close_meanwhile)
    with pytest.raises(embstore.StoreClosedError):
        store.update_logged("t", np.array([7]), rows_of(5.0))
    assert list(read_records(store_path / WAL_DIR)) == []
    with embstore.open(store_path) as s:
        assert s["t"].lookup(np.array([7]))[0, 0] != 5.0


@pytest.mark.parametrize("payload", [
    struct.pack("<H", 1) + b"t" + struct.pack("<II", 1000, 4) + b"\0" * 24,  # counts past the payload
    struct.pack("<H", 2) + b"\xff\xfe" + struct.pack("<II", 0, 4),           # a name that is not UTF-8
    struct.pack("<H", 9) + b"t",                                             # cut inside the name
])
def test_a_checksummed_but_inconsistent_record_is_a_corrupt_store(store_path, payload: bytes) -> None:
    import zlib

    (store_path / WAL_DIR).mkdir()
    (store_path / WAL_DIR / "00000001.log").write_bytes(
        struct.pack("<III", 0x314C5745, len(payload), zlib.crc32(payload)) + payload)
    with pytest.raises(embstore.CorruptStoreError, match="record at offset 0 is damaged"):
        embstore.open(store_path)


def _fill(path) -> None:
    """Take every free page of the file system holding ``path``."""
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc


@needs_mount
def test_a_logged_write_that_fails_to_apply_is_cut_from_the_log(tiny_tmpfs, tmp_path) -> None:
    """A full disk: the small record still fits in the log segment's last page, then the ssd home's
    write-back of an evicted row fails. The write is reported failed (DiskFullError), so a crash image
    taken then must not replay it; writes acknowledged before and after it replay."""
    path = tiny_tmpfs.path / "s"
    cfg = StoreConfig((TableConfig("t", 100_000, DIM, tiers=(TierConfig("dram", 2 * DIM * 4, "lru"),
                                                              TierConfig("ssd"))),))
    failed = np.array([256 * 10, 256 * 20, 256 * 30], np.int64)  # rows in blocks no write has touched
    with embstore.create(path, cfg) as store:
        initial = store["t"].lookup(failed)
        store.update_logged("t", np.array([0]), rows_of(1.0))
        store.sync_log()
        _fill(tiny_tmpfs.path / "filler")
        with pytest.raises(embstore.DiskFullError) as info:
            store.update_logged("t", failed, np.full((3, DIM), 2.0, np.float32))
        assert info.value.tier == "ssd"  # the log append succeeded; applying the write failed
        assert [r[1].tolist() for r in read_records(path / WAL_DIR)] == [[0]]
        shutil.copytree(path, tmp_path / "crash")  # what a SIGKILL now leaves
        (tiny_tmpfs.path / "filler").unlink()
        store.update_logged("t", np.array([7]), rows_of(3.0))  # the log goes on after the cut
        store.sync_log()
        shutil.copytree(path, tmp_path / "crash2")
    with embstore.open(tmp_path / "crash") as s:
        assert (s["t"].lookup(np.array([0])) == 1.0).all()
        np.testing.assert_array_equal(s["t"].lookup(failed), initial)
    with embstore.open(tmp_path / "crash2") as s:
        np.testing.assert_array_equal(s["t"].lookup(np.array([0, 7]))[:, 0], [1.0, 3.0])


def test_a_failed_sync_of_the_cut_refuses_log_syncs_until_a_flush(store_path, monkeypatch) -> None:
    """After an fdatasync error the kernel forgets it, so a later sync would "succeed" without the lost
    pages: sync_log must refuse until a flush retires the segment. Mocks: the apply's failure and the
    EIO cannot be aimed at these two calls for real (the ENOSPC test above covers the real cut)."""
    with embstore.open(store_path) as s:
        s.update_logged("t", np.array([1]), rows_of(1.0))

        def disk_fails(ids, rows):
            raise embstore.DiskFullError("ssd", "write", errno.ENOSPC)

        def eio(fd):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(s["t"], "update", disk_fails)
        monkeypatch.setattr(os, "fdatasync", eio)
        with pytest.raises(embstore.DiskFullError):
            s.update_logged("t", np.array([2]), rows_of(2.0))
        monkeypatch.undo()
        assert [r[1].tolist() for r in read_records(store_path / WAL_DIR)] == [[1]]  # cut all the same
        with pytest.raises(embstore.TierIOError, match="a flush must retire it"):
            s.sync_log()
        s.flush()
        s.update_logged("t", np.array([3]), rows_of(3.0))
        s.sync_log()  # a new segment syncs again
        np.testing.assert_array_equal(s["t"].lookup(np.array([1, 3]))[:, 0], [1.0, 3.0])


def test_a_failed_log_sync_is_not_retried(store_path, monkeypatch) -> None:
    """A retried sync would "succeed" without the lost pages, acknowledging a write that replay cannot
    reach (it stops at the hole): sync_log refuses until a flush has made the writes durable instead."""
    with embstore.open(store_path) as s:
        monkeypatch.setattr(os, "fdatasync", LosingSync(fail_at=2))
        s.update_logged("t", np.array([1]), rows_of(1.0))
        s.sync_log()
        s.update_logged("t", np.array([2]), rows_of(2.0))
        with pytest.raises(embstore.TierIOError, match="Input/output error"):
            s.sync_log()
        s.update_logged("t", np.array([3]), rows_of(3.0))
        with pytest.raises(embstore.TierIOError, match="an earlier sync .* failed; a flush must retire it"):
            s.sync_log()
        shutil.copytree(store_path, store_path.parent / "crash")  # a crash now loses only unacknowledged rows
        s.flush()  # acknowledges 2 and 3 (the tables' own syncs) and retires the damaged segment
        s.update_logged("t", np.array([4]), rows_of(4.0))
        s.sync_log()  # a fresh segment syncs again
        shutil.copytree(store_path, store_path.parent / "crash2")
    with embstore.open(store_path.parent / "crash") as c:
        assert c["t"].lookup(np.array([1]))[0, 0] == 1.0
    with embstore.open(store_path.parent / "crash2") as c:
        np.testing.assert_array_equal(c["t"].lookup(np.array([1, 2, 3, 4]))[:, 0], [1.0, 2.0, 3.0, 4.0])


def test_a_failed_seal_leaves_a_log_that_replays_after_a_failed_flush(store_path, monkeypatch) -> None:
    """A flush whose seal fails, then one whose tables fail to flush: the damaged segment, sealed without
    a retried sync, is marked unsynced, so its hole ends its replay like a torn tail instead of being
    damage before a later segment that refuses the store's next open (and later writes must not be
    acknowledged through the log)."""
    with embstore.open(store_path) as s:
        monkeypatch.setattr(os, "fdatasync", LosingSync(fail_at=2))
        s.update_logged("t", np.array([1]), rows_of(1.0))
        s.sync_log()
        s.update_logged("t", np.array([2]), rows_of(2.0))
        with pytest.raises(embstore.TierIOError):
            s.flush()  # the seal's sync fails
        monkeypatch.undo()

        def disk_fails() -> None:
            raise embstore.TierIOError("ssd", "flush", errno.EIO)

        monkeypatch.setattr(s["t"], "flush", disk_fails)
        with pytest.raises(embstore.TierIOError):
            s.flush()
        s.update_logged("t", np.array([3]), rows_of(3.0))
        with pytest.raises(embstore.TierIOError, match="a flush must retire it"):
            s.sync_log()
        shutil.copytree(store_path, store_path.parent / "crash")
        monkeypatch.undo()
    with embstore.open(store_path.parent / "crash") as c:  # opens: the hole is the last segment's tail
        assert c["t"].lookup(np.array([1]))[0, 0] == 1.0
    with embstore.open(store_path) as s:  # the clean close flushed everything
        np.testing.assert_array_equal(s["t"].lookup(np.array([1, 2, 3]))[:, 0], [1.0, 2.0, 3.0])


def test_a_write_logged_while_a_flush_retires_a_failed_segment_stays_logged(store_path, monkeypatch) -> None:
    """After a failed log sync, a flush retires the damaged segment. A write logged while that flush runs
    (after its table was flushed, so the flush does not cover it) must land in a segment the flush keeps:
    a later sync_log acknowledges it, and a crash must then replay it."""
    with embstore.open(store_path) as s:
        monkeypatch.setattr(os, "fdatasync", LosingSync(fail_at=2))
        s.update_logged("t", np.array([1]), rows_of(1.0))
        s.sync_log()
        s.update_logged("t", np.array([2]), rows_of(2.0))
        with pytest.raises(embstore.TierIOError):
            s.sync_log()
        table_flush = s["t"].flush

        def flush_then_a_concurrent_write() -> None:
            table_flush()
            s.update_logged("t", np.array([5]), rows_of(5.0))  # as another thread would, mid-flush

        monkeypatch.setattr(s["t"], "flush", flush_then_a_concurrent_write)
        s.flush()
        monkeypatch.setattr(s["t"], "flush", table_flush)
        s.sync_log()  # acknowledges write 5
        shutil.copytree(store_path, store_path.parent / "crash")
    with embstore.open(store_path.parent / "crash") as c:
        np.testing.assert_array_equal(c["t"].lookup(np.array([1, 2, 5]))[:, 0], [1.0, 2.0, 5.0])


def one_synced_write_and_one_to_lose(s, monkeypatch) -> HeldLosingSync:
    """Log write 1 and sync it, then log write 2: the next log sync fails (held), losing write 2's pages."""
    sync = HeldLosingSync(fail_at=2)
    monkeypatch.setattr(os, "fdatasync", sync)
    s.update_logged("t", np.array([1]), rows_of(1.0))
    s.sync_log()
    s.update_logged("t", np.array([2]), rows_of(2.0))
    return sync


def run_beside_a_failing_sync(s, sync: HeldLosingSync, other) -> BaseException | None:
    """Run ``s.sync_log()`` (it fails, held) and ``other()`` in threads; release the failure once
    ``other`` has returned or queued for the log's sync lock behind it. Returns what ``other`` raised."""
    s._sync_lock = WatchedLock(s._sync_lock)
    a, synced = in_thread(s.sync_log, "sync")
    assert sync.entered.wait(30)
    b, outcome = in_thread(other, "other")
    until(lambda: queued_or_done(s._sync_lock, b), "the other call to queue behind the sync or return")
    sync.release.set()
    a.join(30)
    b.join(30)
    assert isinstance(synced[0], embstore.TierIOError)
    return outcome[0]


def test_a_sync_racing_a_failed_one_does_not_acknowledge(store_path, monkeypatch) -> None:
    """Two concurrent sync_log calls: when one fails, the other must not report the lost write
    durable. Its sync, on a duplicate of the same descriptor, would "succeed" without the lost pages."""
    with embstore.open(store_path) as s:
        sync = one_synced_write_and_one_to_lose(s, monkeypatch)

        def write_and_sync() -> None:
            s.update_logged("t", np.array([3]), rows_of(3.0))
            s.sync_log()

        raised = run_beside_a_failing_sync(s, sync, write_and_sync)
        shutil.copytree(store_path, store_path.parent / "crash")
        monkeypatch.undo()
    with embstore.open(store_path.parent / "crash") as c:
        assert c["t"].lookup(np.array([1]))[0, 0] == 1.0
        if raised is None:  # write 3 was acknowledged: it must have survived
            assert c["t"].lookup(np.array([3]))[0, 0] == 3.0
    assert isinstance(raised, embstore.TierIOError)


def test_a_flush_racing_a_failed_log_sync_leaves_a_store_that_opens(store_path, monkeypatch) -> None:
    """A flush whose seal races a failing log sync, then fails to flush its table: the seal must not
    take the damaged segment for synced, or its hole is damage before the next segment and the
    store cannot be opened after a crash."""
    with embstore.open(store_path) as s:
        sync = one_synced_write_and_one_to_lose(s, monkeypatch)
        table_flush = s["t"].flush

        def disk_fails() -> None:
            raise embstore.TierIOError("ssd", "flush", errno.EIO)

        monkeypatch.setattr(s["t"], "flush", disk_fails)
        assert isinstance(run_beside_a_failing_sync(s, sync, s.flush), embstore.TierIOError)
        s.update_logged("t", np.array([3]), rows_of(3.0))  # a later segment
        shutil.copytree(store_path, store_path.parent / "crash")
        monkeypatch.setattr(s["t"], "flush", table_flush)
        monkeypatch.setattr(os, "fdatasync", sync.real)
    with embstore.open(store_path.parent / "crash") as c:
        assert c["t"].lookup(np.array([1]))[0, 0] == 1.0


def test_a_sync_with_nothing_new_to_cover_does_not_sync(store_path, monkeypatch) -> None:
    """Group commit: a sync_log whose writes an earlier sync or flush covered returns without an
    fdatasync; a new write needs one again."""
    calls: list[int] = []
    real = os.fdatasync

    def counting(fd: int) -> None:
        calls.append(fd)
        real(fd)

    with embstore.open(store_path) as s:
        monkeypatch.setattr(os, "fdatasync", counting)
        s.sync_log()  # nothing logged yet
        assert calls == []
        s.update_logged("t", np.array([1]), rows_of(1.0))
        s.sync_log()
        assert len(calls) == 1
        s.sync_log()
        assert len(calls) == 1
        s.update_logged("t", np.array([2]), rows_of(2.0))
        s.flush()  # its seal syncs the segment
        n = len(calls)
        s.sync_log()
        assert len(calls) == n
        s.update_logged("t", np.array([3]), rows_of(3.0))
        s.sync_log()
        assert len(calls) == n + 1
        monkeypatch.undo()
