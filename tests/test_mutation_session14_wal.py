"""``WriteAheadLog.seal`` after a failed segment (commit f728b36): what a hand-made mutation audit (session
14) found unpinned. Driven directly on the log; the expected answers follow the rule: a record is durable
once a good sync of its segment covered it or a flush retired its segment."""

from __future__ import annotations

import os

import numpy as np

from embstore.errors import TierIOError
from embstore.wal import WriteAheadLog

DIM = 3


def record(i: int) -> tuple[str, np.ndarray, np.ndarray]:
    return "t", np.array([i], np.int64), np.full((1, DIM), float(i), np.float32)


def acknowledged(wal: WriteAheadLog, target: tuple[int, int]) -> bool:
    """Whether a ``sync_log`` of ``target`` (a position) would acknowledge it now, as ``Store.sync_log``
    runs it: ``sync_handle``, then an ``fdatasync`` of the handle (real) and ``synced``."""
    try:
        fd, seq, end = wal.sync_handle(target)
    except TierIOError:
        return False
    if fd >= 0:
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)
        try:
            wal.synced(seq, end)
        except TierIOError:
            return False
    return True


def test_a_good_seal_after_a_failed_segment_acknowledges_none_of_its_records(tmp_path) -> None:
    """Kills: the ``self._unsynced_seq is None`` guard dropped from ``seal`` (and its negation), and an
    ``else`` that marks the log durable up to the end of the failed segment. Segment 1's sync fails, a
    flush seals it (marked) and fails before dropping it; segment 2 gets a record and a flush seals it
    with a good sync and fails too. No write of segment 1 was synced or flushed: a sync of a position in
    segment 1 - one taken before its failure, or at its end - must not be acknowledged; once a flush
    retires segment 1, every position up to the current one is."""
    wal = WriteAheadLog(tmp_path / "wal")
    wal.append(*record(1))
    early = wal.position()
    wal.append(*record(2))
    end_of_1 = wal.position()
    wal.sync_failed(early[0])  # a handle sync of segment 1 failed
    assert not acknowledged(wal, early)
    sealed = wal.seal()  # the flush seals segment 1 (marked unsynced) ...
    assert sealed == 2  # ... and fails: segment 1 stays
    wal.append(*record(3))
    in_2 = wal.position()
    wal.seal()  # a second flush: segment 2's sync is good; the flush fails again
    for target in (early, end_of_1, in_2, wal.position()):
        assert not acknowledged(wal, target), target
    wal.drop_before(wal.seal())  # a flush that succeeds retires segments 1..3
    for target in (early, end_of_1, in_2, wal.position()):
        assert acknowledged(wal, target), target
    wal.append(*record(4))
    assert acknowledged(wal, wal.position())
    wal.close()

