"""MmapTier against a dict model, plus persistence, corruption, journal replay, real faults, SIGKILL.

"Crash" states are produced two ways: copying the tier's files while it is open
(the page cache is shared, so the copy is exactly what a SIGKILLed process leaves
behind), and a real SIGKILL of a writer process. Faults are real where the
sandbox can mount (tiny tmpfs for ENOSPC, ext4 on a shrinking loop device for
EIO); tests that touch a failing mapping run in a child process, so a SIGBUS
would fail the test instead of killing pytest.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embstore.errors import (
    CorruptStoreError,
    DiskFullError,
    IdOutOfRangeError,
    InvalidInputError,
    StoreClosedError,
    TierIOError,
)
from embstore.tiers.mmap import BITMAP_FILE, JOURNAL_FILE, ROWS_FILE, MmapTier

RB = 24
NR = 64


def _rows(seed: int, n: int, row_bytes: int = RB) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, row_bytes), dtype=np.uint8)


def _ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _check_model(tier: MmapTier, model: dict[int, bytes]) -> None:
    """Every id of the tier reads as the model says: its bytes, or absent and zero."""
    ids = np.arange(tier.num_rows, dtype=np.int64)
    rows, found = tier.get(ids)
    assert found.tolist() == [i in model for i in range(tier.num_rows)]
    for key, value in model.items():
        assert rows[key].tobytes() == value, key
    assert not rows[~found].any()
    assert np.array_equal(tier.contains(ids), found)
    assert tier.resident_rows == len(model)


def _crash_copy(src: Path, dst: Path) -> Path:
    """What a SIGKILL would leave: the files as the page cache holds them right now."""
    dst.mkdir()
    for name in (ROWS_FILE, BITMAP_FILE, JOURNAL_FILE):
        if (src / name).exists():
            shutil.copyfile(src / name, dst / name)
    return dst


# -- model-based round trip ----------------------------------------------------------------

_batch = st.lists(st.integers(0, NR - 1), max_size=12, unique=True)
_op = st.one_of(
    st.tuples(st.just("put"), _batch, st.integers(0, 2**32 - 1)),
    st.tuples(st.just("delete"), _batch, st.just(0)),
    st.tuples(st.just("get"), _batch, st.just(0)),
    st.tuples(st.just("reopen"), st.just([]), st.just(0)),
    st.tuples(st.just("crash"), st.just([]), st.just(0)),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_op, max_size=14))
def test_matches_dict_model(ops: list[tuple[str, list[int], int]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t0"
        tier = MmapTier(path, NR, RB)
        model: dict[int, bytes] = {}
        try:
            for step, (op, ids_list, seed) in enumerate(ops):
                ids = np.array(ids_list, dtype=np.int64)
                if op == "put":
                    rows = _rows(seed, len(ids))
                    tier.put(ids, rows)
                    model.update(zip(ids_list, (r.tobytes() for r in rows)))
                elif op == "delete":
                    tier.delete(ids)
                    for key in ids_list:
                        model.pop(key, None)
                elif op == "get":
                    rows, found = tier.get(ids)
                    assert found.tolist() == [k in model for k in ids_list]
                    for i, key in enumerate(ids_list):
                        assert rows[i].tobytes() == model.get(key, bytes(RB))
                elif op == "reopen":
                    tier.flush()
                    tier.close()
                    tier = MmapTier(path, NR, RB)
                else:  # the journal must bring back even what was never flushed
                    copy = MmapTier(_crash_copy(path, Path(tmp) / f"crash{step}"), NR, RB)
                    _check_model(copy, model)
                    copy.close()
            tier.close()
            tier = MmapTier(path, NR, RB)
            _check_model(tier, model)
        finally:
            tier.close()


# -- basics ------------------------------------------------------------------------------------


def test_absent_rows_are_zero_and_counted(tmp_path: Path) -> None:
    tier = MmapTier(tmp_path / "t", NR, RB)
    rows = _rows(1, 2)
    tier.put(_ids(7, 63), rows)
    got, found = tier.get(_ids(3, 7, 63, 0))
    assert found.tolist() == [False, True, True, False]
    assert np.array_equal(got[[1, 2]], rows) and not got[[0, 3]].any()
    assert got.flags.writeable and got.flags.owndata  # a copy, not a view of the mapping
    stats = tier.stats()
    assert (stats.kind, stats.hits, stats.misses) == ("mmap", 2, 2)
    assert (stats.bytes_read, stats.bytes_written) == (2 * RB, 2 * RB)
    assert (stats.resident_rows, stats.capacity_rows) == (2, NR)
    tier.delete(_ids(7, 8))
    assert tier.resident_rows == 1 and tier.get(_ids(7))[1].tolist() == [False]
    empty, found = tier.get(np.empty(0, dtype=np.int64))
    assert empty.shape == (0, RB) and found.shape == (0,)
    tier.close()


def test_persists_across_close_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "t"
    tier = MmapTier(path, 5000, 40)
    ids = np.arange(0, 5000, 7, dtype=np.int64)
    rows = _rows(2, len(ids), 40)
    tier.put(ids, rows)
    tier.delete(ids[:10])
    tier.close()
    tier.close()  # idempotent
    assert os.path.getsize(path / JOURNAL_FILE) == 0  # the flush at close retired the journal
    tier = MmapTier(path, 5000, 40)
    got, found = tier.get(ids)
    assert not found[:10].any() and found[10:].all()
    assert np.array_equal(got[10:], rows[10:])
    assert tier.resident_rows == len(ids) - 10
    tier.close()


def test_creation_reserves_blocks_but_writes_no_rows(tmp_path: Path) -> None:
    probe = tmp_path / "probe"
    fd = os.open(probe, os.O_RDWR | os.O_CREAT)
    try:
        os.posix_fallocate(fd, 0, 1 << 20)
        try:
            os.lseek(fd, 0, os.SEEK_DATA)
            pytest.skip("this filesystem reports fallocated extents as data; cannot observe 'unwritten'")
        except OSError as exc:
            assert exc.errno == errno.ENXIO
    finally:
        os.close(fd)
    size = 1 << 30  # 1 GiB: created without writing a byte of it
    tier = MmapTier(tmp_path / "big", size // 256, 256)
    rows_file = tmp_path / "big" / ROWS_FILE
    st_ = rows_file.stat()
    assert st_.st_size == size and st_.st_blocks * 512 >= size  # reserved: no SIGBUS later
    with open(rows_file, "rb") as f:
        with pytest.raises(OSError) as info:
            os.lseek(f.fileno(), 0, os.SEEK_DATA)  # nothing written up front
        assert info.value.errno == errno.ENXIO
    got, found = tier.get(_ids(0, size // 256 - 1))
    assert not found.any() and not got.any()
    tier.close()


def test_invalid_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="num_rows"):
        MmapTier(tmp_path / "a", 0, RB)
    with pytest.raises(ValueError, match="row_bytes"):
        MmapTier(tmp_path / "b", NR, 0)
    tier = MmapTier(tmp_path / "t", NR, RB)
    with pytest.raises(IdOutOfRangeError, match=r"64 outside \[0, 64\)"):
        tier.get(_ids(1, NR))
    with pytest.raises(IdOutOfRangeError, match="-1"):
        tier.put(_ids(-1), _rows(0, 1))
    with pytest.raises(IdOutOfRangeError):
        tier.delete(_ids(2**62))
    with pytest.raises(IdOutOfRangeError):
        tier.contains(_ids(-(2**63)))
    with pytest.raises(InvalidInputError, match="int64"):
        tier.get(np.array([1], dtype=np.uint64))
    with pytest.raises(ValueError, match="uint8 rows"):
        tier.put(_ids(1, 2), _rows(0, 2, RB - 1))
    assert not tier.contains(_ids(1, 2)).any()  # nothing written by the failed calls
    assert os.path.getsize(tier.path / JOURNAL_FILE) == 0
    with pytest.raises(TierIOError, match="open elsewhere"):
        MmapTier(tmp_path / "t", NR, RB)  # one writer per directory
    tier.close()
    with pytest.raises(StoreClosedError):
        tier.get(_ids(1))
    with pytest.raises(StoreClosedError):
        tier.flush()


# -- journal: redo of torn rows, torn tails --------------------------------------------------


def test_replay_repairs_a_torn_row(tmp_path: Path) -> None:
    path = tmp_path / "t"
    tier = MmapTier(path, NR, 4096)
    old, new = _rows(1, 3, 4096), _rows(2, 3, 4096)
    tier.put(_ids(4, 5, 6), old)
    tier.flush()
    tier.put(_ids(4, 5, 6), new)  # journaled, applied, not flushed
    copy = _crash_copy(path, tmp_path / "crash")
    with open(copy / ROWS_FILE, "r+b") as f:  # as if the kill came mid-scatter
        f.seek(5 * 4096 + 1000)
        f.write(old[1, 1000:].tobytes())
    tier.close()
    tier = MmapTier(copy, NR, 4096)
    got, found = tier.get(_ids(4, 5, 6))
    assert found.all() and np.array_equal(got, new)
    assert os.path.getsize(copy / JOURNAL_FILE) == 0  # replayed, flushed, retired
    tier.close()


def test_torn_journal_tail_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "t"
    tier = MmapTier(path, NR, RB)
    first, second = _rows(1, 2), _rows(2, 2)
    tier.put(_ids(1, 2), first)
    tier.put(_ids(2, 3), second)  # the last record; the crash cuts it short before its scatter
    copy = _crash_copy(path, tmp_path / "crash")
    size = os.path.getsize(copy / JOURNAL_FILE)
    os.truncate(copy / JOURNAL_FILE, size - 5)
    with open(copy / ROWS_FILE, "r+b") as f:  # undo the second scatter: it never happened
        f.seek(2 * RB)
        f.write(first[1].tobytes() + bytes(RB))
    tier.close()
    tier = MmapTier(copy, NR, RB)
    _check_model(tier, {1: first[0].tobytes(), 2: first[1].tobytes()})
    tier.close()


def test_journal_of_an_older_generation_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "t"
    tier = MmapTier(path, NR, RB)
    tier.put(_ids(1), _rows(1, 1))
    stale = (path / JOURNAL_FILE).read_bytes()
    tier.delete(_ids(1))
    tier.close()  # flush: generation + 1
    (path / JOURNAL_FILE).write_bytes(stale)  # a crash between bitmap commit and truncation
    tier = MmapTier(path, NR, RB)
    _check_model(tier, {})
    tier.close()


# -- corruption -----------------------------------------------------------------------------------


def _make(path: Path) -> None:
    tier = MmapTier(path, NR, RB)
    tier.put(_ids(1, 2), _rows(0, 2))
    tier.close()


@pytest.mark.parametrize(("damage", "message"), [
    (lambda p: os.truncate(p / ROWS_FILE, NR * RB - 1), "has 1535 bytes"),
    (lambda p: (p / ROWS_FILE).unlink(), "rows.bin is missing"),
    (lambda p: os.truncate(p / BITMAP_FILE, 10), "truncated"),
    (lambda p: os.truncate(p / BITMAP_FILE, 41), "expected 48"),
    (lambda p: (p / BITMAP_FILE).write_bytes(b"X" * 48), "bad magic"),
    (lambda p: _flip(p / BITMAP_FILE, 45), "checksum"),
    (lambda p: _flip(p / BITMAP_FILE, 30), "checksum"),  # the generation field
])
def test_corrupt_files_at_open(tmp_path: Path, damage, message: str) -> None:
    path = tmp_path / "t"
    _make(path)
    damage(path)
    with pytest.raises(CorruptStoreError, match=message):
        MmapTier(path, NR, RB)
    with pytest.raises(CorruptStoreError):  # and again: a failed open leaves no lock behind
        MmapTier(path, NR, RB)


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_geometry_mismatch_and_not_a_directory(tmp_path: Path) -> None:
    path = tmp_path / "t"
    _make(path)
    with pytest.raises(CorruptStoreError, match="num_rows=64, row_bytes=24"):
        MmapTier(path, NR + 1, RB)
    with pytest.raises(CorruptStoreError, match="num_rows=64, row_bytes=24"):
        MmapTier(path, NR, RB * 2)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CorruptStoreError, match="not a directory"):
        MmapTier(tmp_path / "file", NR, RB)


def test_journal_record_with_bad_ids_is_corrupt(tmp_path: Path) -> None:
    import zlib

    path = tmp_path / "t"
    _make(path)
    header = struct.Struct("<4sB3xQQI4x")
    ids = np.array([NR + 5], dtype="<i8").tobytes()
    row = bytes(RB)
    raw = header.pack(b"EJR1", 1, 1, 1, 0)  # generation 1: the one the close above committed
    crc = zlib.crc32(raw, zlib.crc32(ids + row))
    (path / JOURNAL_FILE).write_bytes(header.pack(b"EJR1", 1, 1, 1, crc) + ids + row)
    with pytest.raises(CorruptStoreError, match="ids outside"):
        MmapTier(path, NR, RB)


# -- real faults -----------------------------------------------------------------------------------


from faultfs import FailingExt4 as _FailingExt4, Tmpfs as _Tmpfs, kill_at_random_point, _run, needs_mount  # noqa: E402


@needs_mount
def test_enospc_at_create_is_disk_full(tiny_tmpfs: _Tmpfs) -> None:
    path = tiny_tmpfs.path / "t"
    with pytest.raises(DiskFullError) as info:
        MmapTier(path, 1 << 20, 64)  # 64 MiB on a 4 MiB file system
    assert info.value.errno == errno.ENOSPC and info.value.tier == "mmap"
    tiny_tmpfs.resize(128 << 20)
    tier = MmapTier(path, 1 << 20, 64)  # the interrupted creation is simply redone
    tier.put(_ids(5), _rows(5, 1, 64))
    tier.close()
    tier = MmapTier(path, 1 << 20, 64)
    assert tier.get(_ids(5))[1].all()
    tier.close()


@needs_mount
def test_enospc_at_open_of_a_sparse_copy(tmp_path: Path, tiny_tmpfs: _Tmpfs) -> None:
    src = tmp_path / "src"
    tier = MmapTier(src, 1 << 17, 64)  # 8 MiB
    tier.put(_ids(3), _rows(3, 1, 64))
    tier.close()
    dst = tiny_tmpfs.path / "t"
    res = _run("cp", "-r", "--sparse=always", str(src), str(dst))
    assert res.returncode == 0, res.stderr
    with pytest.raises(DiskFullError):  # a later store into a hole would have been SIGBUS
        MmapTier(dst, 1 << 17, 64)
    tiny_tmpfs.resize(64 << 20)
    tier = MmapTier(dst, 1 << 17, 64)
    assert tier.get(_ids(3))[1].all()
    tier.close()


@needs_mount
def test_enospc_on_journal_is_disk_full_and_reopens_consistent(tiny_tmpfs: _Tmpfs) -> None:
    path = tiny_tmpfs.path / "t"
    num_rows, rb = 4096, 512  # 2 MiB of rows on a 4 MiB file system
    tier = MmapTier(path, num_rows, rb)
    model: dict[int, bytes] = {}
    rng = np.random.default_rng(0)
    error = None
    for step in range(1000):
        ids = rng.choice(num_rows, size=64, replace=False).astype(np.int64)
        rows = _rows(step, 64, rb)
        try:
            tier.put(ids, rows)  # never flushed: the journal grows until the disk is full
        except DiskFullError as exc:
            error = exc
            break
        model.update(zip(ids.tolist(), (r.tobytes() for r in rows)))
    assert error is not None and error.errno == errno.ENOSPC
    got, found = tier.get(ids)  # the failed put changed nothing
    assert found.tolist() == [k in model for k in ids.tolist()]
    for i, key in enumerate(ids.tolist()):
        assert got[i].tobytes() == model.get(key, bytes(rb))
    try:
        tier.close()
    except DiskFullError:
        pass  # the bitmap could not be rewritten; the journal still has every put
    tiny_tmpfs.resize(64 << 20)
    tier = MmapTier(path, num_rows, rb)
    _check_model(tier, model)
    tier.close()


_EIO_BATCH = textwrap.dedent("""
    import numpy as np

    NUM_ROWS, RB = 65536, 256  # 16 MiB of rows: most of them past the 8 MiB that keeps working

    def batch(r):
        ids = np.arange(r, NUM_ROWS, 200, dtype=np.int64)  # rows spread over the whole file
        return ids, np.random.default_rng(r).integers(0, 256, size=(len(ids), RB), dtype=np.uint8)
""")
_EIO_CHILD = _EIO_BATCH + textwrap.dedent("""
    import sys
    from embstore.errors import TierIOError
    from embstore.tiers.mmap import MmapTier

    tier = MmapTier(sys.argv[1], NUM_ROWS, RB)
    for r in range(200):
        if r == 6:
            print("ready", flush=True)
            sys.stdin.readline()  # the parent makes the disk fail now
        try:
            tier.put(*batch(r))
            tier.flush()
        except TierIOError as exc:
            print("error", type(exc).__name__, exc.errno, flush=True)
            break
        print("flushed", r, flush=True)
    try:
        tier.close()
    except TierIOError as exc:
        print("close-error", exc.errno, flush=True)
    print("done", flush=True)
""")


@needs_mount
def test_eio_is_tier_io_error_and_reopens_consistent(failing_ext4: _FailingExt4) -> None:
    path = failing_ext4.path / "t"
    child = subprocess.Popen([sys.executable, "-c", _EIO_CHILD, str(path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        head = []
        for line in child.stdout:  # "flushed 0" .. "flushed 5", then "ready"
            head.append(line)
            if line.strip() == "ready":
                break
        assert head and head[-1].strip() == "ready", "".join(head)
        failing_ext4.start_failing()
        out, err = child.communicate("go\n", timeout=120)
    finally:
        if child.poll() is None:  # never leave a child waiting on its stdin
            child.kill()
            child.communicate()
    assert child.returncode == 0, f"child died with {child.returncode} (SIGBUS is -7): {err}"
    lines = head + out.splitlines()
    errors = [line.split() for line in lines if line.startswith("error")]
    assert errors and errors[0][1:] == ["TierIOError", str(errno.EIO)], out
    flushed = [int(line.split()[1]) for line in lines if line.startswith("flushed")]
    assert flushed[:6] == list(range(6))

    failing_ext4.repair()
    ns: dict = {}
    exec(_EIO_BATCH, ns)
    tier = MmapTier(path, ns["NUM_ROWS"], ns["RB"])
    last = flushed[-1]
    for r in range(last + 2):
        ids, rows = ns["batch"](r)
        got, found = tier.get(ids)
        if r <= last:
            assert found.all() and np.array_equal(got, rows), r
        else:  # the failed round: each row complete or absent, never torn
            for i in range(len(ids)):
                assert not found[i] or np.array_equal(got[i], rows[i])
    tier.close()


# -- crash: SIGKILL at a random point ------------------------------------------------------------

_SCHEDULE = textwrap.dedent("""
    import numpy as np

    NUM_ROWS, ROW_BYTES = 1024, 6144  # rows straddle pages: a kill in a page fault tears a row
    FLUSH_EVERY = 8

    def schedule(seed, r):
        '''Round r: (op, ids, rows); 3 MiB puts that overwrite earlier, flushed rows.

        Rows are a random 8-byte pattern tiled (cheap to make, so the writer spends
        its time in puts, where a kill can tear rows).
        '''
        rng = np.random.default_rng([seed, r])
        ids = rng.choice(NUM_ROWS, size=512, replace=False).astype(np.int64)
        if r % 6 == 5:
            return "delete", ids[:128], None
        pattern = rng.integers(0, 256, size=(len(ids), 8), dtype=np.uint8)
        return "put", ids, np.tile(pattern, (1, ROW_BYTES // 8))
""")
_CHILD = _SCHEDULE + textwrap.dedent("""
    import sys
    from embstore.tiers.mmap import MmapTier
    path, seed = sys.argv[1], int(sys.argv[2])
    tier = MmapTier(path, NUM_ROWS, ROW_BYTES)
    for r in range(100_000):
        op, ids, rows = schedule(seed, r)
        print("start", r, flush=True)
        if op == "put":
            tier.put(ids, rows)
        else:
            tier.delete(ids)
        if r % FLUSH_EVERY == FLUSH_EVERY - 1:
            tier.flush()
            print("flushed", r, flush=True)
""")
_sched_ns: dict = {}
exec(_SCHEDULE, _sched_ns)
schedule = _sched_ns["schedule"]


def _kill_at_random_point(args: list[str], rnd: random.Random) -> tuple[int, int]:
    return kill_at_random_point(args, rnd, 10, 30, 0.003)


@pytest.mark.parametrize("trial", range(3))
def test_flushed_rows_survive_sigkill(tmp_path: Path, trial: int) -> None:
    """After SIGKILL every row is in its last flushed state or a later one, never torn.

    Rounds after the last reported flush, up to the last one started, may have
    been applied (the journal keeps every whole put, flushed or not).
    """
    seed, path = 2000 + trial, tmp_path / "t"
    last, started = _kill_at_random_point([_CHILD, str(path), str(seed)], random.Random(trial))
    states: dict[int, bytes | None] = {}
    allowed: dict[int, set[bytes | None]] = {}
    for r in range(started + 1):
        op, ids, rows = schedule(seed, r)
        for i, key in enumerate(ids.tolist()):
            new = rows[i].tobytes() if op == "put" else None
            if r <= last:
                states[key] = new
            else:
                allowed.setdefault(key, {states.get(key)}).add(new)
    tier = MmapTier(path, _sched_ns["NUM_ROWS"], _sched_ns["ROW_BYTES"])
    got, found = tier.get(np.arange(_sched_ns["NUM_ROWS"], dtype=np.int64))
    for key in range(_sched_ns["NUM_ROWS"]):
        state = got[key].tobytes() if found[key] else None
        assert state in allowed.get(key, {states.get(key)}), f"row {key}, last flush {last}"
    tier.close()
