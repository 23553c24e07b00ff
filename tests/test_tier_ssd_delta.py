"""The in-place ssd home's delta commits: a flush of a few changed rows appends a record of the changed
presence-bitmap bytes to present.delta instead of rewriting present.bin (mirrors the log layout's
slots.delta tests in test_tier_ssd_log.py)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from embstore.errors import CorruptStoreError, DiskFullError, TierIOError
from embstore.tiers import io_engine, ssd, ssd_log
from embstore.tiers.delta import RECORD_HEADER, encode_record
from embstore.tiers.ssd import BITMAP_DELTA_FILE, BITMAP_FILE, SSDTier
from embstore.tiers.ssd_log import LOG_DELTA_FILE, LogSSDTier
from crash_states import check_against_flushes, whole_lines

H = RECORD_HEADER


def rows_for(ids: np.ndarray, row_bytes: int, version: int) -> np.ndarray:
    """Rows that name their id and version in every 8 bytes."""
    unit = (np.asarray(ids, np.int64) * 1_000_003 + version).astype("<i8").view(np.uint8).reshape(-1, 8)
    return np.tile(unit, (1, -(-row_bytes // 8)))[:, :row_bytes].copy()


def check_all(tier: SSDTier, model: dict[int, np.ndarray]) -> None:
    """Presence and contents of every row equal the model's; the count and the bitmap agree."""
    rows, found = tier.get(np.arange(tier.num_rows, dtype=np.int64))
    assert np.flatnonzero(found).tolist() == sorted(model)
    for i, r in model.items():
        np.testing.assert_array_equal(rows[i], r, err_msg=f"row {i}")
    assert tier.resident_rows == len(model)
    assert not rows[~found].any()


def put(tier: SSDTier, model: dict, ids, version: int) -> None:
    ids = np.asarray(ids, np.int64)
    rows = rows_for(ids, tier.row_bytes, version)
    tier.put(ids, rows)
    model.update(zip(ids.tolist(), rows))


def delete(tier: SSDTier, model: dict, ids) -> None:
    ids = np.asarray(ids, np.int64)
    tier.delete(ids)
    for i in ids.tolist():
        model.pop(i, None)


def lose_process(tier: SSDTier) -> None:
    tier._release()  # drop the file descriptors the way a killed process would
    tier.closed = True


def records(path: Path, entry_bytes: int = 5) -> list[tuple[int, int, int, int]]:
    """(offset, base crc, resident, entries) of each record of a delta file."""
    data = path.read_bytes()
    out, at = [], 0
    while at < len(data):
        magic, base, count, n, _ = H.unpack_from(data, at)
        out.append((at, base, count, n))
        at += H.size + entry_bytes * n
    assert at == len(data)
    return out


def seeded(path: Path, num_rows: int = 100_000, row_bytes: int = 64) -> tuple[SSDTier, dict]:
    """A tier with every 7th row present, flushed (the first flush is too big for a record)."""
    tier = SSDTier(path, num_rows, row_bytes)
    model: dict = {}
    put(tier, model, np.arange(0, num_rows, 7), 1)
    tier.flush()
    assert not (path / BITMAP_DELTA_FILE).exists()  # 12,500 changed bytes: the whole bitmap instead
    return tier, model


def file_state(path: Path) -> tuple[bytes, int, int]:
    st_ = path.stat()
    return path.read_bytes(), st_.st_mtime_ns, st_.st_ino


# -- the point: small flushes append ------------------------------------------------------
def test_a_flush_appends_the_changed_bytes_and_leaves_present_bin_alone(tmp_path: Path) -> None:
    tier, model = seeded(tmp_path / "t")
    bitmap, delta = tmp_path / "t" / BITMAP_FILE, tmp_path / "t" / BITMAP_DELTA_FILE
    before = file_state(bitmap)
    put(tier, model, [1, 2, 3, 50_002, 99_999], 2)  # new rows, two of them in one bitmap byte
    put(tier, model, [0, 7, 14], 2)  # overwrites: no presence change
    delete(tier, model, [21, 28, 5])  # 5 was never present
    tier.flush()
    # changed bytes: 0 (rows 1-3), 2 (21), 3 (28), 6250 (50,002), 12,499 (99,999); 5 bytes each
    assert records(delta) == [(0, records(delta)[0][1], len(model), 5)]
    assert delta.stat().st_size == H.size + 5 * 5
    put(tier, model, [0, 70], 3)  # overwrites only: nothing to commit
    tier.flush()
    assert delta.stat().st_size == H.size + 5 * 5
    delete(tier, model, [99_999])
    put(tier, model, [99_998], 3)  # the same byte as 99,999: one entry
    tier.flush()
    assert [r[3] for r in records(delta)] == [5, 1] and records(delta)[1][2] == len(model)
    assert file_state(bitmap) == before  # the 12.5 KB bitmap untouched: same bytes, mtime, inode
    flushed = dict(model)
    put(tier, model, [4, 6], 9)  # not flushed: lost with the process
    delete(tier, model, [35])
    lose_process(tier)
    again = SSDTier(tmp_path / "t", 100_000, 64)
    check_all(again, flushed)
    assert not delta.exists() and bitmap.read_bytes() != before[0]  # folded into present.bin on open
    again.close()
    again = SSDTier(tmp_path / "t", 100_000, 64)
    check_all(again, flushed)
    again.close()


def test_a_row_deleted_since_the_flush_keeps_its_bytes_through_a_neighbour_put(tmp_path: Path) -> None:
    """Row 0 is flushed, deleted (in memory only) and row 1 of its block is put: the block must be read,
    not written with zeros in row 0's slot, for a crash brings row 0 back."""
    tier = SSDTier(tmp_path / "t", 100_000, 40)  # 102 rows per block
    model: dict = {}
    put(tier, model, [0, 500], 1)
    tier.flush()
    flushed = dict(model)
    delete(tier, model, [0])
    before = tier.counters.bytes_read
    put(tier, model, [1], 2)
    assert tier.counters.bytes_read == before + 4096
    put(tier, model, [600], 2)  # a block whose presence did not change: no read
    assert tier.counters.bytes_read == before + 4096
    lose_process(tier)
    again = SSDTier(tmp_path / "t", 100_000, 40)
    check_all(again, flushed)
    again.close()


def test_the_slab_is_synced_before_the_record_that_marks_its_rows(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    tier, model = seeded(tmp_path / "t")
    synced: list[str] = []
    real = ssd._fdatasync

    def spy(fd: int) -> None:
        synced.append("slab" if fd == tier._fd else "delta" if fd == tier._delta_fd else "?")
        real(fd)

    monkeypatch.setattr(ssd, "_fdatasync", spy)
    put(tier, model, [1, 2], 2)
    tier.flush()
    assert synced == ["slab", "delta"]
    tier.close()


def test_close_and_open_leave_one_bitmap_file(tmp_path: Path) -> None:
    tier, model = seeded(tmp_path / "t")
    delta = tmp_path / "t" / BITMAP_DELTA_FILE
    put(tier, model, [1], 2)
    tier.flush()
    assert delta.exists()
    tier.close()  # folds the record into present.bin
    assert not delta.exists()
    again = SSDTier(tmp_path / "t", 100_000, 64)
    check_all(again, model)
    again.close()


def test_deltas_are_folded_into_present_bin_once_they_outgrow_it(tmp_path: Path) -> None:
    tier = SSDTier(tmp_path / "t", 20_000, 64)  # a 2,500-byte bitmap
    bitmap, delta = tmp_path / "t" / BITMAP_FILE, tmp_path / "t" / BITMAP_DELTA_FILE
    model: dict = {}
    sizes, rewrites = [], 0
    for version in range(1, 100):  # 82-byte records: ~30 fit in the bitmap
        start = version * 331 % 20_000
        put(tier, model, np.arange(start, start + 80, 8) % 20_000, version)  # 10 rows, 10 bytes
        if version % 3 == 0:
            delete(tier, model, np.arange(start, start + 40, 8) % 20_000)
        stamp = bitmap.stat().st_mtime_ns, bitmap.stat().st_ino
        tier.flush()
        size = delta.stat().st_size if delta.exists() else 0
        rewrote = (bitmap.stat().st_mtime_ns, bitmap.stat().st_ino) != stamp
        assert rewrote == (size == 0)  # either a record was appended or present.bin was replaced
        rewrites += rewrote
        sizes.append(size)
    assert max(sizes) <= tier._bits.nbytes  # bounded by the bitmap
    assert 0 in sizes[2:] and rewrites >= 2 and sizes.count(0) < len(sizes) // 4
    lose_process(tier)
    again = SSDTier(tmp_path / "t", 20_000, 64)
    check_all(again, model)
    again.close()


# -- damaged or foreign records ---------------------------------------------------------------
def three_records(path: Path) -> tuple[list[dict], Path]:
    """A tier whose present.delta holds three records; returns the model after each commit (the first
    the state of present.bin) and the delta file. The process is lost after the third."""
    tier, model = seeded(path)
    states = [dict(model)]
    for version, (new, gone) in enumerate([([1, 2], [7]), ([100, 99_990], [14, 1]), ([3], [21])], 2):
        put(tier, model, new, version)
        delete(tier, model, gone)
        tier.flush()
        states.append(dict(model))
    lose_process(tier)
    delta = path / BITMAP_DELTA_FILE
    assert len(records(delta)) == 3
    return states, delta


def reopened(path: Path) -> SSDTier:
    return SSDTier(path, 100_000, 64)


@pytest.mark.parametrize("damage", ["truncated", "checksum", "zeroed", "half-header"])
def test_a_torn_last_record_is_ignored(tmp_path: Path, damage: str) -> None:
    """The third commit never returned: rows read as of the second."""
    states, delta = three_records(tmp_path / "t")
    data = bytearray(delta.read_bytes())
    last = records(delta)[-1][0]
    if damage == "truncated":
        del data[-3:]
    elif damage == "checksum":  # whole length, wrong bytes
        data[-1] ^= 0x40
    elif damage == "zeroed":  # the file grew but the record's blocks never reached the disk
        data[last:] = bytes(len(data) - last)
    else:
        del data[last + 20:]
    delta.write_bytes(bytes(data))
    again = reopened(tmp_path / "t")
    check_all(again, states[2])
    assert not delta.exists()  # folded, the torn tail dropped
    put(again, states[2], [5], 9)  # new commits work after it
    again.flush()
    lose_process(again)
    again = reopened(tmp_path / "t")
    check_all(again, states[2])
    again.close()


@pytest.mark.parametrize("how", ["stale-file", "rechecksummed"])
def test_records_of_another_present_bin_are_ignored(tmp_path: Path, how: str) -> None:
    path = tmp_path / "t"
    if how == "stale-file":  # a crash between replacing present.bin and removing the records
        states, delta = three_records(path)
        stale = delta.read_bytes()
        tier = reopened(path)  # folds them into a new present.bin
        model = dict(states[3])
        put(tier, model, [11], 5)
        tier.close()
        delta.write_bytes(stale)
        again = reopened(path)
        check_all(again, model)  # none re-applied over the newer present.bin
        again.close()
        return
    states, delta = three_records(path)
    data = bytearray(delta.read_bytes())
    at, base, count, n = records(delta)[1]  # a whole, valid record that names another present.bin
    body = bytes(data[at + H.size:at + H.size + 5 * n])
    data[at:at + H.size + 5 * n] = encode_record(ssd._BITMAP_DELTA_MAGIC, base ^ 1, count, n, body)
    want = states[1]  # from it on, none is applied
    delta.write_bytes(bytes(data))
    again = reopened(path)
    check_all(again, want)
    again.close()


@pytest.mark.parametrize("damage", ["body", "magic", "count-field", "base-field"])
def test_a_damaged_record_before_an_intact_one_is_corruption(tmp_path: Path, damage: str) -> None:
    states, delta = three_records(tmp_path / "t")
    data = bytearray(delta.read_bytes())
    at = records(delta)[0][0]
    if damage == "body":
        data[at + H.size + 2] ^= 0x01
    elif damage == "magic":
        data[at] ^= 0xFF
    elif damage == "base-field":  # a flipped bit, not a stale record: the checksum covers the field
        data[at + 8] ^= 0x01
    else:  # the length of the first record: the next intact one is found by its magic
        data[at + 20] ^= 0x07
    delta.write_bytes(bytes(data))
    with pytest.raises(CorruptStoreError, match="damaged commit record at byte 0"):
        reopened(tmp_path / "t")


@pytest.mark.parametrize("damage", ["offset", "count", "beyond-num-rows"])
def test_a_valid_record_that_contradicts_the_bitmap_is_corruption(tmp_path: Path, damage: str) -> None:
    tier = SSDTier(tmp_path / "t", 100_003, 64)  # the last bitmap byte holds 3 rows
    model: dict = {}
    put(tier, model, np.arange(0, 100_003, 7), 1)
    tier.flush()
    put(tier, model, [1], 2)
    tier.flush()
    base = records(tmp_path / "t" / BITMAP_DELTA_FILE)[0][1]
    lose_process(tier)
    offs, vals, count = np.array([5], "<u4"), np.array([0xFF], np.uint8), len(model)
    if damage == "offset":
        offs[0] = 12_501  # past the bitmap's 12,501 bytes
    elif damage == "count":
        count += 1
    else:
        offs[0], vals[0] = 12_500, 0xFF  # bits of rows 100,003.. set
    record = encode_record(ssd._BITMAP_DELTA_MAGIC, base, count, 1, offs.tobytes() + vals.tobytes())
    with open(tmp_path / "t" / BITMAP_DELTA_FILE, "ab") as f:
        f.write(record)
    with pytest.raises(CorruptStoreError, match=BITMAP_DELTA_FILE):
        SSDTier(tmp_path / "t", 100_003, 64)


def test_the_log_layout_reports_a_damaged_middle_record_too(tmp_path: Path) -> None:
    """slots.delta is read by the same code: a damaged record with an intact one after it raises."""
    tier = LogSSDTier(tmp_path / "t", 1_000, 64)
    ids = np.arange(100, dtype=np.int64)
    for version in (1, 2, 3):
        tier.put(ids[:10 * version], rows_for(ids[:10 * version], 64, version))
        tier.flush()
    lose_process(tier)
    path = tmp_path / "t" / LOG_DELTA_FILE
    data = bytearray(path.read_bytes())
    data[H.size + 3] ^= 0x01  # the body of the first of three records
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptStoreError, match="damaged commit record"):
        LogSSDTier(tmp_path / "t", 1_000, 64)


# -- failed appends ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fault", ["fdatasync", "short-write"])
@pytest.mark.parametrize("then", ["retry", "crash"])
def test_a_failed_append_is_typed_and_leads_to_a_whole_rewrite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 fault: str, then: str) -> None:
    tier, model = seeded(tmp_path / "t")
    bitmap, delta = tmp_path / "t" / BITMAP_FILE, tmp_path / "t" / BITMAP_DELTA_FILE
    put(tier, model, [1, 2], 2)
    tier.flush()  # one good record
    flushed = dict(model)
    good = delta.read_bytes()
    before = file_state(bitmap)
    put(tier, model, [3, 50_000], 3)
    delete(tier, model, [7])
    if fault == "fdatasync":  # as test_tier_ssd_log does: the slab's sync passes, the record's fails
        real_sync, calls = ssd._fdatasync, [0]

        def failing_sync(fd: int) -> None:
            calls[0] += 1
            if calls[0] == 2:
                raise OSError(errno.ENOSPC, "injected")
            real_sync(fd)
        monkeypatch.setattr(ssd, "_fdatasync", failing_sync)
    else:  # half the record reaches the file, then the disk is full
        real_write = os.write

        def short_write(fd: int, data) -> int:  # type: ignore[no-untyped-def]
            if fd != tier._delta_fd:
                return real_write(fd, data)
            if len(data) > 10:
                return real_write(fd, bytes(data)[:len(data) // 2])
            raise OSError(errno.ENOSPC, "injected")
        monkeypatch.setattr(ssd.os, "write", short_write)
    with pytest.raises(DiskFullError) as ei:
        tier.flush()
    monkeypatch.undo()
    assert isinstance(ei.value, TierIOError) and ei.value.errno == errno.ENOSPC
    assert ei.value.tier == "ssd" and ei.value.operation == "flush"
    assert len(delta.read_bytes()) > len(good)  # part or all of the failed record is in the file
    assert file_state(bitmap) == before
    if then == "crash":
        lose_process(tier)
        again = reopened(tmp_path / "t")
        # a torn record is ignored; a whole one that failed only its sync may count (never acknowledged)
        check_all(again, flushed if fault == "short-write" else model)
        again.close()
        return
    tier.flush()  # the retry rewrites present.bin whole and drops the damaged records
    assert not delta.exists() and file_state(bitmap)[1:] != before[1:]
    put(tier, model, [4], 4)  # and appends again from the new present.bin
    tier.flush()
    assert len(records(delta)) == 1
    lose_process(tier)
    again = reopened(tmp_path / "t")
    check_all(again, model)
    again.close()


def test_open_folds_what_it_can_when_present_bin_cannot_be_replaced(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk must not keep a tier with records from opening: it opens, and its next commit
    rewrites present.bin (nothing is appended behind the records it could not fold)."""
    tier, model = seeded(tmp_path / "t")
    delta = tmp_path / "t" / BITMAP_DELTA_FILE
    put(tier, model, [1, 2], 2)
    tier.flush()
    lose_process(tier)

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "injected")

    monkeypatch.setattr(ssd, "_fsync", full)
    again = reopened(tmp_path / "t")
    monkeypatch.undo()
    check_all(again, model)
    assert delta.exists() and again._base_crc is None
    put(again, model, [3], 3)
    again.flush()
    assert not delta.exists()
    lose_process(again)
    again = reopened(tmp_path / "t")
    check_all(again, model)
    again.close()


def test_index_bytes_counts_the_change_flags(tmp_path: Path) -> None:
    tier = SSDTier(tmp_path / "t", 1_000_003, 64)
    assert SSDTier.index_bytes(1_000_003, 64) == tier._bits.nbytes + tier._changed.nbytes
    assert SSDTier.index_bytes(100_000_000, 64) == 12_500_000 + 1_562_504  # flags in 8-byte words
    tier.close()


# -- against a model -------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "put", "delete", "flush", "flush", "reopen", "crash"]),
                              st.lists(st.one_of(st.integers(0, 40), st.integers(0, 3_999)),  # hot rows recur
                                       min_size=1, max_size=30)),
                    min_size=6, max_size=40),
       row_bytes=st.sampled_from([40, 700, 5000]))
def test_matches_a_dict_model_through_flushes_crashes_and_reopens(tmp_path_factory, ops, row_bytes: int) -> None:
    """Random puts, deletes, flushes, clean reopenings and lost processes: after a lost process the
    present rows are exactly those of the last flush, each at its flushed version or one written since
    (puts write in place). A 500-byte bitmap takes a few records between rewrites."""
    path = tmp_path_factory.mktemp("delta") / "t"
    tier = SSDTier(path, 4_000, row_bytes, queue_depth=8)
    model: dict[int, np.ndarray] = {}
    flushed: dict[int, np.ndarray] = {}
    since: dict[int, list[np.ndarray]] = {}  # rows written since the last flush
    for version, (op, ids) in enumerate(ops):
        arr = np.unique(np.array(ids, np.int64))
        if op == "put":
            put(tier, model, arr, version)
            for i in arr.tolist():
                since.setdefault(i, []).append(model[i])
        elif op == "delete":
            delete(tier, model, arr)
        elif op in ("flush", "reopen"):
            if op == "flush":
                tier.flush()
            else:
                tier.close()
                assert not (path / BITMAP_DELTA_FILE).exists()
                tier = SSDTier(path, 4_000, row_bytes, queue_depth=8)
            flushed, since = dict(model), {}
        else:
            lose_process(tier)
            tier = SSDTier(path, 4_000, row_bytes, queue_depth=8)
            rows, found = tier.get(np.arange(4_000, dtype=np.int64))
            assert np.flatnonzero(found).tolist() == sorted(flushed)
            for i, row in flushed.items():
                assert any(np.array_equal(rows[i], r) for r in [row, *since.get(i, [])]), f"row {i}"
            model = {i: rows[i] for i in flushed}
            flushed, since = dict(model), {}
        assert tier.resident_rows == len(model)
        delta = path / BITMAP_DELTA_FILE
        assert not delta.exists() or delta.stat().st_size <= tier._bits.nbytes
    check_all(tier, model)
    tier.flush()  # most often a record: the process is lost, the record must carry everything
    lose_process(tier)
    tier = SSDTier(path, 4_000, row_bytes, queue_depth=8)
    check_all(tier, model)
    tier.close()
    tier = SSDTier(path, 4_000, row_bytes, queue_depth=8)
    check_all(tier, model)
    tier.close()


# -- a fault at any step, against a model (both layouts) --------------------------------------------
class _Faults:
    """Fails the ``k``-th call at one point (once) with ``err``; the fakes below ask it at each call."""

    def __init__(self) -> None:
        self.point, self.k, self.err, self.fired = "", 0, 0, False

    def arm(self, point: str, k: int, err: int) -> None:
        self.point, self.k, self.err, self.fired = point, k, err, False

    def hit(self, point: str) -> int:
        if point != self.point:
            return 0
        self.k -= 1
        if self.k:
            return 0
        self.point, self.fired = "", True
        return self.err


def _install_faults(mp: pytest.MonkeyPatch, faults: _Faults, root: Path) -> None:
    """Slab transfers (half the requests of the failing call go through), fdatasync/fsync, and the writes
    of delta records and index files (half the bytes land) and renames under ``root``, each failing
    when armed."""
    real_uring, real_pio = io_engine._uring_kernel, io_engine._pio_kernel
    real_fdatasync, real_fsync, real_write, real_replace = ssd._fdatasync, ssd._fsync, os.write, os.replace

    def transfer(real, write: bool, res: np.ndarray, args: tuple, cut):  # type: ignore[no-untyped-def]
        err = faults.hit("slab-write" if write else "slab-read")
        if not err:
            return real(*args)
        k = len(res) // 2
        rc = real(*cut(k)) if k else 0
        res[k:] = -err
        return rc

    def uring(ring, fd, op, offs, addrs, lens, qd, res):  # type: ignore[no-untyped-def]
        return transfer(real_uring, op == io_engine._IORING_OP_WRITE, res, (ring, fd, op, offs, addrs, lens, qd, res),
                        lambda k: (ring, fd, op, offs[:k].copy(), addrs[:k].copy(), lens[:k].copy(), qd, res[:k]))

    def pio(fd, write, offs, addrs, lens, res):  # type: ignore[no-untyped-def]
        return transfer(real_pio, write, res, (fd, write, offs, addrs, lens, res),
                        lambda k: (fd, write, offs[:k].copy(), addrs[:k].copy(), lens[:k].copy(), res[:k]))

    def failing(real, point: str):  # type: ignore[no-untyped-def]
        def call(*args):  # type: ignore[no-untyped-def]
            err = faults.hit(point) if point != "replace" or str(args[1]).startswith(str(root)) else 0
            if err:
                raise OSError(err, os.strerror(err))
            return real(*args)
        return call

    def write(fd: int, data) -> int:  # type: ignore[no-untyped-def]
        mine = os.readlink(f"/proc/self/fd/{fd}").startswith(str(root))  # not numba's cache, say
        err = faults.hit("index-write") if mine else 0
        if err:
            real_write(fd, bytes(memoryview(data)[:len(data) // 2]))
            raise OSError(err, os.strerror(err))
        return real_write(fd, data)

    mp.setattr(io_engine, "_uring_kernel", uring)
    mp.setattr(io_engine, "_pio_kernel", pio)
    mp.setattr(ssd, "_fdatasync", failing(real_fdatasync, "fdatasync"))
    mp.setattr(ssd, "_fsync", failing(real_fsync, "fsync"))
    mp.setattr(ssd.os, "write", write)
    mp.setattr(ssd.os, "replace", failing(real_replace, "replace"))


def _read_all(tier: SSDTier) -> dict[int, np.ndarray]:
    rows, found = tier.get(np.arange(tier.num_rows, dtype=np.int64))
    return {int(i): rows[i].copy() for i in np.flatnonzero(found)}


def _check_recovered(got: dict, flushed: dict, since: dict, deleted: set, what: str) -> None:
    """Each row as of the last flush or at a version written since (whole); absent only if it was absent
    then or deleted since. Internal commits (the log's cleaner) may have made newer writes durable."""
    for i in set(got) | set(flushed):
        if i in got:
            assert any(np.array_equal(got[i], r) for r in [flushed.get(i), *since.get(i, [])] if r is not None), \
                f"{what}: row {i} is neither its flushed version nor one written since"
        else:
            assert i in deleted, f"{what}: row {i}, present at the last flush, is gone"


_FAULT = st.tuples(st.sampled_from(["slab-write", "slab-read", "fdatasync", "fsync", "index-write", "replace"]),
                   st.integers(1, 3), st.sampled_from([errno.EIO, errno.ENOSPC]), st.booleans())
_STEP = st.tuples(st.sampled_from(["put", "put", "put", "delete", "flush", "flush", "reopen", "crash"]),
                  st.lists(st.integers(0, 10**6), max_size=60), st.one_of(st.none(), _FAULT))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=st.sampled_from(["in_place", "log"]), use_uring=st.booleans(),
       row_bytes=st.sampled_from([8, 200, 1500, 5000]), num_rows=st.sampled_from([1, 5, 20, 300]),
       small=st.booleans(), steps=st.lists(_STEP, max_size=30))
def test_a_fault_at_any_step_is_typed_and_recovers_to_the_last_flush(tmp_path_factory, layout: str, use_uring: bool,
                                                                      row_bytes: int, num_rows: int, small: bool,
                                                                      steps: list) -> None:
    """EIO or ENOSPC at the n-th slab transfer (in the middle of a multi-chunk put or of a cleaning
    round), fdatasync, fsync, delta append, index rewrite or rename: the call raises the typed error
    (DiskFullError for ENOSPC), the tier's rows are each its old version or one being written, and a
    reopen after a lost process finds every row as of the last flush or newer and whole. The tier keeps
    working, and a later flush makes everything durable; only a failed fdatasync of the slab, never
    retried (tests/test_sync_failure.py), leaves it refusing until reopened. A log with 2 spare blocks
    cleans all the time."""
    path = tmp_path_factory.mktemp("faults") / "t"
    cls = LogSSDTier if layout == "log" else SSDTier
    faults = _Faults()

    def open_tier() -> SSDTier:
        t = cls(path, num_rows, row_bytes, queue_depth=2, use_io_uring=use_uring)
        if small:  # several chunks, runs and log pieces per call
            t._chunk_blocks, t._run_blocks = 2, 1
            if layout == "log":
                t._piece_blocks = 1
        return t

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ssd_log, "MIN_SPARE_BLOCKS", 2)
        _install_faults(mp, faults, path.parent)
        tier = open_tier()
        model: dict[int, np.ndarray] = {}
        flushed: dict[int, np.ndarray] = {}
        since: dict[int, list[np.ndarray]] = {}
        deleted: set[int] = set()
        for version, (op, raw, fault) in enumerate(steps):
            ids = np.array(raw, np.int64) % num_rows  # unsorted, repeated
            if fault:
                faults.arm(*fault[:3])
            before = dict(model)
            try:
                if op == "put":
                    rows = rows_for(ids, row_bytes, version) ^ np.arange(len(ids), dtype=np.uint8)[:, None]
                    for i, r in zip(ids.tolist(), rows):
                        since.setdefault(i, []).append(r)
                    tier.put(ids, rows)
                    model.update(zip(ids.tolist(), rows))
                elif op == "delete":
                    deleted.update(ids.tolist())
                    tier.delete(ids)
                    for i in ids.tolist():
                        model.pop(i, None)
                elif op == "flush":
                    tier.flush()
                    flushed, since, deleted = dict(model), {}, set()
                elif op == "reopen":
                    tier.close()
                    tier = open_tier()  # a fault in the fold of open is logged, not raised
                    flushed, since, deleted = dict(model), {}, set()
                else:
                    faults.arm("", 0, 0)
                    lose_process(tier)
                    tier = open_tier()
                    model = _read_all(tier)
                    _check_recovered(model, flushed, since, deleted, "after a lost process")
                    flushed, since, deleted = dict(model), {}, set()
                assert not faults.fired or op == "reopen", f"{fault} fired but {op} succeeded"
            except TierIOError as exc:
                assert fault is not None and faults.fired, exc
                assert exc.tier == "ssd" and exc.errno == fault[2]
                assert isinstance(exc, DiskFullError) == (fault[2] == errno.ENOSPC)
                if not tier.closed:  # what it holds now: each row its old version or one being written
                    now = _read_all(tier)
                    _check_recovered(now, before, {i: since.get(i, []) for i in ids.tolist()} if op == "put" else {},
                                     set(), f"{op} failing at {fault}")
                    model = now
                    if not fault[3] and tier._sync.failure is None:
                        continue  # carry on with the tier (after a failed fdatasync of the slab it refuses: reopen)
                    lose_process(tier)
                faults.arm("", 0, 0)
                tier = open_tier()
                model = _read_all(tier)
                _check_recovered(model, flushed, since, deleted, f"reopened after {op} failed at {fault}")
                flushed, since, deleted = dict(model), {}, set()
            finally:
                faults.arm("", 0, 0)
            assert _read_all(tier).keys() == model.keys() and tier.resident_rows == len(model)
        tier.flush()
        lose_process(tier)
        tier = open_tier()
        got = _read_all(tier)
        assert got.keys() == model.keys() and all(np.array_equal(got[i], model[i]) for i in model)
        tier.close()


# -- crash: SIGKILL while committing by records ----------------------------------------------------
_CRASH_CHILD = textwrap.dedent("""
    import os, sys, numpy as np
    from embstore.tiers.ssd import SSDTier
    path, n, row_bytes = sys.argv[1], 20_000, 68
    tier = SSDTier(path, n, row_bytes, queue_depth=8)
    rng = np.random.default_rng(int(sys.argv[2]))
    ver = np.full(n, -1, np.int64)  # the model: version of each present row, -1 = absent
    hot = rng.choice(3_000, 300, replace=False)  # rows recur (deletes hit flushed rows), ~6 a block
    version = 0
    while True:
        version += 1
        ids = np.unique(rng.choice(hot, size=int(rng.integers(1, 25))))
        rows = np.empty((len(ids), row_bytes), np.uint8)
        rows[:] = ((ids * 7 + version) % 251).astype(np.uint8)[:, None]   # a row is one repeated byte
        rows[:, :4] = np.frombuffer(np.int32(version).tobytes(), np.uint8)  # after its version
        tier.put(ids, rows)
        ver[ids] = version
        if rng.random() < 0.5:
            gone = np.unique(rng.choice(hot, size=5))
            tier.delete(gone)
            ver[gone] = -1
        if version % 3 == 0:
            np.save(f"{path}.tmp.npy", ver)  # what this flush is about to make durable
            os.replace(f"{path}.tmp.npy", f"{path}.state-{version}.npy")
            tier.flush()
            size = os.path.getsize(f"{path}/present.delta") if os.path.exists(f"{path}/present.delta") else 0
            print(f"{version} {size}", flush=True)
""")


@pytest.mark.parametrize("trial", range(3))
def test_sigkill_while_appending_records_keeps_flushed_rows(tmp_path: Path, trial: int) -> None:
    """After SIGKILL the present rows are exactly those of the last acknowledged flush (or of the one
    running), each at least as new as at that flush and never torn; most flushes were records."""
    script = tmp_path / "child.py"
    script.write_text(_CRASH_CHILD)
    d = tmp_path / "t"
    proc = subprocess.Popen([sys.executable, str(script), str(d), str(trial)], stdout=subprocess.PIPE, text=True)
    acks: list[list[int]] = []
    deadline = time.monotonic() + 60
    while len(acks) < 20 + 15 * trial and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        acks.append([int(x) for x in line.split()])
    time.sleep(0.005 * trial)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    acks += [[int(x) for x in line.split()] for line in whole_lines(proc.stdout.read())]
    proc.stdout.close()
    assert len(acks) >= 20, "the child died before flushing"
    assert sum(size > 0 for _, size in acks) > len(acks) // 2  # most commits were records
    tier = SSDTier(d, 20_000, 68)
    out, found = tier.get(np.arange(20_000, dtype=np.int64))
    tier.close()
    check_against_flushes(tmp_path, "t", acks[-1][0], out, found)
