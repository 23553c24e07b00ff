"""Write-ahead log behaviours that hand-made mutations of ``embstore/wal.py`` showed no test pinned down
(session 10 mutation audit): checksums end replay, a flush drops only sealed segments, a seal syncs the
segment it closes, and a refused log is writable again once a flush retired its torn segment."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from embstore.errors import DiskFullError, TierIOError
from embstore.wal import WriteAheadLog, read_records
from faultfs import Tmpfs, needs_mount

DIM = 3


def record(i: int) -> tuple[str, np.ndarray, np.ndarray]:
    return "t", np.array([i, i + 100], np.int64), np.full((2, DIM), float(i), np.float32)


def replayed(directory) -> list[tuple[str, list[int], list[list[float]]]]:
    return [(name, ids.tolist(), rows.tolist()) for name, ids, rows in read_records(directory)]


def expected(*indices: int) -> list[tuple[str, list[int], list[list[float]]]]:
    return [(name, ids.tolist(), rows.tolist()) for name, ids, rows in map(record, indices)]


def test_a_record_whose_payload_fails_its_checksum_ends_replay(tmp_path) -> None:
    """A damaged byte inside a record (its length intact) is a torn tail: it and what follows are not
    replayed, rather than applied as garbage rows."""
    wal = WriteAheadLog(tmp_path / "wal")
    for i in range(3):
        wal.append(*record(i))
    wal.close()
    (segment,) = sorted((tmp_path / "wal").iterdir())
    data = bytearray(segment.read_bytes())
    one = len(data) // 3  # three records of one size
    data[one + one - 2] ^= 0x40  # a bit of the second record's last row value
    segment.write_bytes(bytes(data))
    assert replayed(tmp_path / "wal") == expected(0)


def test_a_flush_drops_only_the_segments_it_sealed(tmp_path) -> None:
    """A write logged between a flush's seal and its drop (another thread's update_logged) lands in the
    next segment, which the flush does not cover: it must stay in the log."""
    wal = WriteAheadLog(tmp_path / "wal")
    wal.append(*record(1))
    sealed = wal.seal()
    wal.append(*record(2))  # after the seal: not in the flushed tables
    wal.drop_before(sealed)
    assert replayed(tmp_path / "wal") == expected(2)
    wal.close()


def test_seal_syncs_the_segment_it_closes(tmp_path, monkeypatch) -> None:
    """sync_log after a flush's seal syncs the new segment only, so the writes appended to the sealed one
    are durable only through the seal's own fdatasync. Losing unsynced page-cache data (a power cut)
    cannot be caused in a test, so the fdatasync calls are observed instead: each call's file and size."""
    synced: list[tuple[str, int]] = []
    real = os.fdatasync

    def spy(fd: int) -> None:
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), os.fstat(fd).st_size))
        real(fd)

    monkeypatch.setattr(os, "fdatasync", spy)
    wal = WriteAheadLog(tmp_path / "wal")
    wal.append(*record(1))
    wal.append(*record(2))
    wal.seal()
    (segment,) = sorted((tmp_path / "wal").iterdir())
    assert (str(segment), segment.stat().st_size) in synced
    wal.close()


def test_a_log_refused_after_an_uncut_torn_append_accepts_writes_once_a_flush_retired_it(tmp_path,
                                                                                         monkeypatch) -> None:
    """A failed append whose partial record cannot be cut off refuses further appends (they would hide
    behind it) only until a flush has sealed and dropped that segment. The write fails with ENOSPC and the
    cut with EIO; a failing ftruncate after a failed write cannot be caused on a real file system here,
    so both calls are replaced for the one append."""
    wal = WriteAheadLog(tmp_path / "wal")
    wal.append(*record(1))
    real_write, real_truncate = os.write, os.ftruncate

    def short_then_full(fd: int, data) -> int:
        monkeypatch.setattr(os, "write", real_write)
        real_write(fd, bytes(data)[:5])
        raise OSError(errno.ENOSPC, "No space left on device")

    def broken_truncate(fd: int, length: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "write", short_then_full)
    monkeypatch.setattr(os, "ftruncate", broken_truncate)
    with pytest.raises(TierIOError):
        wal.append(*record(2))
    monkeypatch.setattr(os, "ftruncate", real_truncate)
    with pytest.raises(TierIOError, match="refused until a flush"):
        wal.append(*record(3))
    wal.drop_before(wal.seal())  # what Store.flush does once the tables are flushed
    wal.append(*record(4))
    wal.close()
    assert replayed(tmp_path / "wal") == expected(4)


@needs_mount
def test_a_failed_append_leaves_no_bytes_behind_for_later_records_to_hide_behind(tmp_path) -> None:
    """An append cut short by a full disk (a real one: a tiny tmpfs) is removed again, so the records
    appended once there is room again replay."""
    fs = Tmpfs(tmp_path / "fs", 64 << 10)
    try:
        wal = WriteAheadLog(fs.path / "wal")
        wal.append(*record(1))
        filler = fs.path / "filler"
        with open(filler, "wb", buffering=0) as f, pytest.raises(OSError):
            while True:  # take every free page; the segment keeps the rest of its own
                f.write(b"x" * 4096)
        big = ("t", np.arange(400, dtype=np.int64), np.ones((400, DIM), np.float32))  # > one page
        with pytest.raises(DiskFullError):
            wal.append(*big)
        filler.unlink()
        wal.append(*record(3))
        wal.close()
        assert replayed(fs.path / "wal") == expected(1, 3)
    finally:
        fs.unmount()
