"""The in-place ssd home (``tiers/ssd.py``, ``tiers/delta.py``) and its I/O engine (``tiers/io_engine.py``):
behaviours that hand-made mutations showed no test pinned down (session 12 mutation audit).

- present.bin's checksum is what catches damage that keeps the count (two bits swapped); its length and
  bits past num_rows are refused even where the checksum and the count agree; a slab longer than its
  geometry is refused;
- a record holds 5 bytes per changed bitmap byte, and records are appended until the next would pass
  the bitmap's size (not sooner); a close with no presence change commits nothing;
- a present.delta that open cannot use (only stale or torn records) is folded away at open, else the next
  record lands behind it and is lost (stale) or makes the tier unopenable (torn);
- a deleted-since-the-flush row in the last (or first) presence byte of its block keeps its bytes
  through a put into the block; a put covering a whole block reads nothing;
- rows of a multiple of 4 KiB take exactly that many pages; queue_depth is bounded at 4096;
- the sync calls and their order: the slab and the directory at creation, the directory of a new
  present.delta before its first record counts, temp file before rename before directory before the
  records are dropped (a power cut, the only fault that loses unsynced data, cannot be caused here);
- the I/O kernels' own handling of real results: a transfer that ends early (end of file) is an error,
  never zeros or a hang; a failing pread/pwrite or cqe reports its errno and is raised at once, not resumed.
"""

from __future__ import annotations

import errno
import os
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from embstore.arrays import aligned_zeros
from embstore.errors import CorruptStoreError, TierIOError
from embstore.tiers import io_engine, ssd
from embstore.tiers.delta import RECORD_HEADER
from embstore.tiers.io_engine import Engine
from embstore.tiers.ssd import BITMAP_DELTA_FILE, BITMAP_FILE, SLAB_FILE, SSDTier

ENGINES = ["io_uring", "pread"]


def rows_for(ids: np.ndarray, row_bytes: int, version: int) -> np.ndarray:
    """Rows that name their id and version in every 8 bytes (never all zero)."""
    unit = (np.asarray(ids, np.int64) * 1_000_003 + version + 1).astype("<i8").view(np.uint8).reshape(-1, 8)
    return np.tile(unit, (1, -(-row_bytes // 8)))[:, :row_bytes].copy()


def put(tier: SSDTier, model: dict, ids: list[int], version: int) -> None:
    arr = np.asarray(ids, np.int64)
    rows = rows_for(arr, tier.row_bytes, version)
    tier.put(arr, rows)
    model.update(zip(arr.tolist(), rows))


def check_all(tier: SSDTier, model: dict) -> None:
    rows, found = tier.get(np.arange(tier.num_rows, dtype=np.int64))
    assert np.flatnonzero(found).tolist() == sorted(model)
    for i, r in model.items():
        np.testing.assert_array_equal(rows[i], r, err_msg=f"row {i}")
    assert tier.resident_rows == len(model)


def lose_process(tier: SSDTier) -> None:
    """Drop the descriptors without a flush, the way a killed process would."""
    tier._release()
    tier.closed = True


# -- present.bin at open ----------------------------------------------------------------------------
def _rewrite_bitmap(path: Path, body: bytes, fix_crc: bool, more_rows: int = 0) -> None:
    """present.bin with ``body`` for its bits, its count raised by ``more_rows``, its checksum kept or
    recomputed."""
    data = path.read_bytes()
    hdr = ssd._BITMAP_HEADER
    fields = list(hdr.unpack_from(data))
    fields[4] += more_rows
    if fix_crc:
        fields[-1] = 0
        fields[-1] = zlib.crc32(body, zlib.crc32(hdr.pack(*fields)))
    path.write_bytes(hdr.pack(*fields) + body)


def test_a_bitmap_damaged_without_changing_its_count_fails_its_checksum(tmp_path: Path) -> None:
    """Row 0 present, row 1 absent; swapping their bits keeps the count, so only the checksum sees it."""
    tier = SSDTier(tmp_path, 100, 16)
    tier.put(np.array([0, 5], np.int64), rows_for(np.array([0, 5]), 16, 1))
    tier.close()
    body = bytearray((tmp_path / BITMAP_FILE).read_bytes()[ssd._BITMAP_HEADER.size:])
    assert body[0] == 0b100001
    body[0] = 0b100010
    _rewrite_bitmap(tmp_path / BITMAP_FILE, bytes(body), fix_crc=False)
    with pytest.raises(CorruptStoreError, match="checksum"):
        SSDTier(tmp_path, 100, 16)


@pytest.mark.parametrize("change", [1, -1])
def test_a_bitmap_of_the_wrong_length_is_refused_even_with_a_matching_checksum(tmp_path: Path,
                                                                               change: int) -> None:
    tier = SSDTier(tmp_path, 100, 16)
    tier.close()
    body = (tmp_path / BITMAP_FILE).read_bytes()[ssd._BITMAP_HEADER.size:]
    _rewrite_bitmap(tmp_path / BITMAP_FILE, body + b"\0" if change > 0 else body[:-1], fix_crc=True)
    with pytest.raises(CorruptStoreError, match="bytes, expected"):
        SSDTier(tmp_path, 100, 16)



def test_a_bitmap_marking_a_row_past_num_rows_is_refused_even_when_its_count_agrees(tmp_path: Path) -> None:
    """100 rows: the last bitmap byte holds rows 96-103. A bit for row 103 with the count raised to
    match and the checksum recomputed passes every other check: only the num_rows check refuses it."""
    tier = SSDTier(tmp_path, 100, 16)
    tier.put(np.array([0, 99], np.int64), rows_for(np.array([0, 99]), 16, 1))
    tier.close()
    body = bytearray((tmp_path / BITMAP_FILE).read_bytes()[ssd._BITMAP_HEADER.size:])
    body[-1] |= 0x80
    _rewrite_bitmap(tmp_path / BITMAP_FILE, bytes(body), fix_crc=True, more_rows=1)
    with pytest.raises(CorruptStoreError, match="beyond num_rows=100"):
        SSDTier(tmp_path, 100, 16)


def test_a_slab_longer_than_its_geometry_is_refused(tmp_path: Path) -> None:
    tier = SSDTier(tmp_path, 100, 16)
    tier.close()
    with open(tmp_path / SLAB_FILE, "ab") as f:
        f.write(b"\0" * 4096)
    with pytest.raises(CorruptStoreError, match="8192 bytes, expected 4096"):
        SSDTier(tmp_path, 100, 16)


def test_a_close_after_only_overwrites_leaves_present_bin_alone(tmp_path: Path) -> None:
    """Overwriting present rows and deleting absent ones change no presence bit: close commits nothing
    (a rewrite would fail a close on a full disk that has nothing to commit)."""
    bitmap = tmp_path / BITMAP_FILE
    tier = SSDTier(tmp_path, 1_000, 64)
    model: dict = {}
    put(tier, model, [1, 2], 1)
    tier.close()
    before = bitmap.stat().st_ino, bitmap.stat().st_mtime_ns
    tier = SSDTier(tmp_path, 1_000, 64)
    put(tier, model, [1, 2], 2)
    tier.delete(np.array([3], np.int64))
    tier.close()
    assert (bitmap.stat().st_ino, bitmap.stat().st_mtime_ns) == before
    tier = SSDTier(tmp_path, 1_000, 64)
    check_all(tier, model)
    tier.close()

# -- present.delta that open cannot use ---------------------------------------------------------------
@pytest.mark.parametrize("leftover", ["stale", "torn"])
def test_records_open_could_not_use_are_folded_away_before_the_next_commit(tmp_path: Path,
                                                                           leftover: str) -> None:
    """Stale records (a crash between replacing present.bin and removing them) or one torn record and
    nothing else: open must still replace present.bin and drop the file, for the next flush appends a
    record, which behind stale records is ignored (an acknowledged flush lost) and behind a torn one
    makes the tier unopenable."""
    path, delta = tmp_path / "t", tmp_path / "t" / BITMAP_DELTA_FILE
    tier = SSDTier(path, 1_000, 64)
    model: dict = {}
    put(tier, model, [1, 500], 1)
    tier.flush()
    data = delta.read_bytes()
    assert len(data) > RECORD_HEADER.size  # the flush was a record
    if leftover == "stale":
        tier.close()  # folds it into a new present.bin; the old record no longer applies
        delta.write_bytes(data)
    else:
        lose_process(tier)
        delta.write_bytes(data[:-2])  # the only record, torn: its commit never returned
        model = {}
    tier = SSDTier(path, 1_000, 64)
    check_all(tier, model)
    assert not delta.exists()
    put(tier, model, [2, 999], 2)
    tier.flush()  # a record, acknowledged
    assert delta.exists()
    lose_process(tier)
    tier = SSDTier(path, 1_000, 64)
    check_all(tier, model)
    tier.close()



def test_records_are_appended_until_the_next_would_pass_the_bitmap_size(tmp_path: Path) -> None:
    """A 2,500-byte bitmap; each flush changes two rows in each of 10 new bitmap bytes: a record of
    32 + 10 * 5 = 82 bytes. 30 records fit (2,460 bytes), the 31st flush replaces present.bin instead.
    Counting a byte once per changed row, or not resetting the count after a record, folds early."""
    path, delta = tmp_path / "t", tmp_path / "t" / BITMAP_DELTA_FILE
    tier = SSDTier(path, 20_000, 64)
    model: dict = {}
    assert RECORD_HEADER.size == 32
    for k in range(1, 32):
        first = 8 * 10 * k
        put(tier, model, [r for b in range(first, first + 80, 8) for r in (b, b + 1)], k)
        tier.flush()
        if k < 31:
            assert delta.stat().st_size == 82 * k, k
    assert not delta.exists()
    lose_process(tier)
    tier = SSDTier(path, 20_000, 64)
    check_all(tier, model)
    tier.close()

# -- read-modify-write of a block -----------------------------------------------------------------------
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(row_bytes=st.sampled_from([40, 256, 1000]), block=st.integers(0, 3), data=st.data())
def test_a_row_deleted_since_the_flush_at_either_end_of_its_block_survives_a_put_into_it(
        tmp_path_factory: pytest.TempPathFactory, row_bytes: int, block: int, data: st.DataObject) -> None:
    """The deleted row may sit in the first or last presence byte of its block (one shared with the
    neighbouring block where rows_per_block is not a multiple of 8): the put must read the block, for a
    crash brings the row back."""
    path = tmp_path_factory.mktemp("rmw") / "t"
    rpb = 4096 // row_bytes
    lo, hi = block * rpb, (block + 1) * rpb - 1
    gone = data.draw(st.sampled_from([lo, lo + 1, hi - 1, hi]), label="deleted row")
    new = data.draw(st.integers(lo, hi).filter(lambda r: r != gone), label="row put")
    tier = SSDTier(path, 5 * rpb, row_bytes)
    flushed: dict = {}
    put(tier, flushed, [gone], 1)
    tier.flush()
    tier.delete(np.array([gone], np.int64))
    tier.put(np.array([new], np.int64), rows_for(np.array([new]), row_bytes, 2))
    lose_process(tier)
    tier = SSDTier(path, 5 * rpb, row_bytes)
    check_all(tier, flushed)
    tier.close()


def test_a_put_that_covers_whole_blocks_reads_nothing(tmp_path: Path) -> None:
    """Read-modify-write is for blocks a put does not cover: a block written whole is not read first,
    even when presence in it changed since the last commit."""
    tier = SSDTier(tmp_path, 1_600, 256)  # 16 rows a block
    model: dict = {}
    put(tier, model, list(range(16)), 1)
    put(tier, model, list(range(16)), 2)  # present, uncommitted
    tier.delete(np.array([3], np.int64))
    model.pop(3)
    put(tier, model, list(range(16, 48)), 3)
    tier.flush()
    tier.delete(np.array([20], np.int64))
    model.pop(20)
    put(tier, model, list(range(48)), 4)  # three whole blocks, one with a deleted-since-commit row
    assert tier.counters.bytes_read == 0
    check_all(tier, model)
    tier.close()


# -- geometry ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pages", [1, 2, 3])
def test_rows_of_whole_pages_take_exactly_their_pages(tmp_path: Path, pages: int) -> None:
    row_bytes = pages * 4096
    tier = SSDTier(tmp_path, 10, row_bytes)
    assert (tier.rows_per_block, tier.block_bytes) == (1, row_bytes)
    ids = np.arange(10, dtype=np.int64)
    rows = rows_for(ids, row_bytes, 1)
    tier.put(ids, rows)
    tier.close()
    raw = np.fromfile(tmp_path / SLAB_FILE, dtype=np.uint8)
    assert len(raw) == 10 * row_bytes
    np.testing.assert_array_equal(raw.reshape(10, row_bytes), rows)


def test_queue_depth_is_bounded_at_4096(tmp_path: Path) -> None:
    SSDTier(tmp_path / "a", 10, 8, queue_depth=4096).close()
    with pytest.raises(ValueError, match="queue_depth"):
        SSDTier(tmp_path / "b", 10, 8, queue_depth=4097)


# -- sync calls and their order ----------------------------------------------------------------------------
def test_sync_calls_and_their_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Creation syncs the slab and the folder before present.bin says the tier exists; a new present.delta's
    folder entry is synced before its first record is acknowledged, and the record after the slab; a
    rewrite syncs the temp file, renames it, syncs the folder, and only then drops present.delta."""
    events: list[str] = []
    path = tmp_path / "t"

    def name(fd: int) -> str:
        target = os.readlink(f"/proc/self/fd/{fd}")
        return "dir" if target == str(path) else os.path.basename(target)

    real_fsync, real_fdatasync, real_replace, real_unlink = ssd._fsync, ssd._fdatasync, os.replace, os.unlink

    def fsync(fd: int) -> None:
        events.append("fsync " + name(fd))
        real_fsync(fd)

    def fdatasync(fd: int) -> None:
        events.append("fdatasync " + name(fd))
        real_fdatasync(fd)

    def replace(src, dst) -> None:  # type: ignore[no-untyped-def]
        if Path(dst).parent == path:  # not numba's cache, say
            events.append("replace " + os.path.basename(dst))
        real_replace(src, dst)

    def unlink(p, *a, **k) -> None:  # type: ignore[no-untyped-def]
        if Path(p).parent == path:
            events.append("unlink " + os.path.basename(p))
        real_unlink(p, *a, **k)

    monkeypatch.setattr(ssd, "_fsync", fsync)
    monkeypatch.setattr(ssd, "_fdatasync", fdatasync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "unlink", unlink)
    tier = SSDTier(path, 100_000, 64)
    assert events == ["fsync rows.slab", "fsync dir", "fsync present.bin.tmp", "replace present.bin",
                      "fsync dir"]
    events.clear()
    tier.put(np.array([1], np.int64), rows_for(np.array([1]), 64, 1))
    tier.flush()
    assert events == ["fdatasync rows.slab", "fsync dir", "fdatasync present.delta"]
    events.clear()
    tier.close()  # folds the record into present.bin
    assert events == ["fsync present.bin.tmp", "replace present.bin", "fsync dir", "unlink present.delta"]


# -- the I/O kernels on real results -------------------------------------------------------------------------
@pytest.mark.timeout(120)  # a kernel that loops at end of file would hang
@pytest.mark.parametrize("engine", ENGINES)
def test_a_read_that_ends_early_at_end_of_file_is_a_short_read_error(tmp_path: Path, engine: str) -> None:
    """Reading past the end of a file returns fewer bytes, then none: the engine resumes once, then says
    so (EIO, "short read"), rather than taking the request as done or waiting for bytes that never come."""
    f = tmp_path / "f"
    f.write_bytes(bytes(range(256)) * 16 + b"x" * 100)  # a page and 100 bytes
    fd = os.open(f, os.O_RDONLY)
    eng = Engine(fd, 4, engine == "io_uring")
    try:
        assert eng.io_uring == (engine == "io_uring")
        buf = aligned_zeros((3 * 4096,), np.uint8, 4096)
        base = np.uint64(buf.ctypes.data)
        for off, length in [(0, 8192), (8192, 4096)]:  # past the end; wholly beyond it (one request a call)
            with pytest.raises(OSError, match="short read") as ei:
                eng.run(False, np.array([off], np.int64), np.array([base], np.uint64), np.array([length], np.int64))
            assert ei.value.errno == errno.EIO
        assert bytes(buf[:4196]) == f.read_bytes()  # what there was, was read
        eng.run(False, np.array([0], np.int64), np.array([base], np.uint64), np.array([4196], np.int64))  # fine
    finally:
        eng.close()
        os.close(fd)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_failing_transfer_reports_its_errno(tmp_path: Path, engine: str) -> None:
    """A write to a read-only descriptor fails with EBADF in pwrite and in the cqe alike: the error names
    it, not a "short write"."""
    f = tmp_path / "f"
    f.write_bytes(b"\0" * 8192)
    fd = os.open(f, os.O_RDONLY)
    eng = Engine(fd, 2, engine == "io_uring")
    try:
        buf = aligned_zeros((8192,), np.uint8, 4096)
        base = np.uint64(buf.ctypes.data)
        with pytest.raises(OSError) as ei:
            eng.run(True, np.array([0, 4096], np.int64), np.array([base, base + np.uint64(4096)], np.uint64),
                    np.array([4096, 4096], np.int64))
        assert ei.value.errno == errno.EBADF, ei.value
    finally:
        eng.close()
        os.close(fd)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_failed_request_is_raised_at_once_never_resumed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          engine: str) -> None:
    """A request that failed (res < 0) is not a short transfer: resuming it would move the file offset and
    the buffer address back by the errno. One kernel call, then the error."""
    tier = SSDTier(tmp_path, 64, 256, use_io_uring=engine == "io_uring")
    tier.put(np.arange(64, dtype=np.int64), rows_for(np.arange(64), 256, 1))
    name = "_uring_kernel" if engine == "io_uring" else "_pio_kernel"
    real, calls = getattr(io_engine, name), [0]

    def fail_once(*args):  # type: ignore[no-untyped-def]
        calls[0] += 1
        rc = real(*args)
        if calls[0] == 1:
            args[-1][0] = -errno.EIO
        return rc

    monkeypatch.setattr(io_engine, name, fail_once)
    with pytest.raises(TierIOError) as ei:
        tier.get(np.array([0], np.int64))
    assert ei.value.errno == errno.EIO and calls[0] == 1
    monkeypatch.undo()
    tier.close()
