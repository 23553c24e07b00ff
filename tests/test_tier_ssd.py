"""SSDTier against a dict model, on real files (io_uring and pread engines), plus faults and crashes.

Real faults where this machine can cause them: ENOSPC from a tiny tmpfs (needs
root to mount; skipped with a reason elsewhere, and the monkeypatched ENOSPC
tests still run), SIGKILL of a writer process. EIO cannot be caused without
device-mapper or fault injection in the kernel, so EIO (and short transfers,
ring failures, fsync errors) are injected at the lowest-level call: the numba
I/O kernel's per-request results (the cqe ``res`` values) or ``fdatasync``.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embstore.errors import (CorruptStoreError, DiskFullError, IdOutOfRangeError, InvalidInputError,
                             InvalidRowsError, StoreClosedError, TierIOError)
from embstore.tiers import io_engine, ssd
from embstore.tiers.ssd import BITMAP_FILE, SLAB_FILE, SSDTier, _runs

from crash_states import check_against_flushes, whole_lines

WIDTHS = [4, 68, 256, 1000, 5000]
ENGINES = ["io_uring", "pread"]


def make(path: Path | str, num_rows: int, row_bytes: int, engine: str, **kw) -> SSDTier:
    tier = SSDTier(path, num_rows, row_bytes, use_io_uring=(engine == "io_uring"), **kw)
    assert tier.io_engine.startswith(engine)
    return tier


def rows_for(ids: np.ndarray, row_bytes: int, version: int = 0) -> np.ndarray:
    """Deterministic, id- and version-dependent row bytes."""
    rng = np.random.default_rng([version, *ids[:4].tolist(), len(ids)])
    out = rng.integers(0, 256, size=(len(ids), row_bytes), dtype=np.uint8)
    return out


def check_model(tier: SSDTier, model: dict[int, np.ndarray], ids: np.ndarray) -> None:
    out, found = tier.get(ids)
    assert out.shape == (len(ids), tier.row_bytes) and out.dtype == np.uint8
    for k, i in enumerate(ids.tolist()):
        assert found[k] == (i in model), i
        if i in model:
            np.testing.assert_array_equal(out[k], model[i])
        else:
            assert not out[k].any()
    np.testing.assert_array_equal(tier.contains(ids), found)


def check_all(tier: SSDTier, model: dict[int, np.ndarray]) -> None:
    check_model(tier, model, np.arange(tier.num_rows, dtype=np.int64))
    assert tier.resident_rows == len(model)
    assert tier.stats().resident_rows == len(model)


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    return request.param


# -- the model test ------------------------------------------------------------------
ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.lists(st.integers(0, 10**6), min_size=0, max_size=60, unique=True)),
        st.tuples(st.just("delete"), st.lists(st.integers(0, 10**6), min_size=0, max_size=20, unique=True)),
        st.tuples(st.just("flush"), st.just([])),
        st.tuples(st.just("reopen"), st.just([])),
    ),
    min_size=1, max_size=12)


@pytest.mark.parametrize("use_uring", [True, False], ids=ENGINES)
@settings(max_examples=30, suppress_health_check=[HealthCheck.function_scoped_fixture])  # fresh dir per example
@given(row_bytes=st.sampled_from(WIDTHS), num_rows=st.integers(1, 300), small_chunks=st.booleans(),
       script=ops, data=st.data())
def test_round_trip_against_dict_model(tmp_path: Path, use_uring: bool, row_bytes: int, num_rows: int,
                                       small_chunks: bool, script: list, data: st.DataObject) -> None:
    engine = "io_uring" if use_uring else "pread"
    with tempfile.TemporaryDirectory(dir=tmp_path) as d:
        def open_tier() -> SSDTier:
            t = make(d, num_rows, row_bytes, engine, queue_depth=data.draw(st.sampled_from([1, 4, 64])))
            if small_chunks:  # exercise chunked batches and the run-length cap
                t._chunk_blocks, t._run_blocks = 3, 2
            return t

        tier = open_tier()
        model: dict[int, np.ndarray] = {}
        for version, (op, raw) in enumerate(script):
            ids = np.array([r % num_rows for r in raw], dtype=np.int64)
            ids = ids[np.sort(np.unique(ids, return_index=True)[1])]  # unique, order kept
            if op == "put":
                rows = rows_for(ids, row_bytes, version)
                tier.put(ids, rows)
                model.update({int(i): r for i, r in zip(ids, rows)})
            elif op == "delete":
                tier.delete(ids)
                for i in ids.tolist():
                    model.pop(i, None)
            elif op == "flush":
                tier.flush()
            else:
                tier.close()
                tier = open_tier()
            q = np.array(data.draw(st.lists(st.integers(0, num_rows - 1), max_size=40, unique=True)),
                         dtype=np.int64)
            check_model(tier, model, q)
        check_all(tier, model)
        tier.close()
        tier = open_tier()  # close() flushed
        check_all(tier, model)
        tier.close()


@given(blocks=st.lists(st.integers(0, 60), unique=True).map(sorted), cap=st.integers(1, 5),
       gaps=st.lists(st.integers(0, 2), min_size=61, max_size=61))
def test_runs_against_reference(blocks: list[int], cap: int, gaps: list[int]) -> None:
    b = np.array(blocks, dtype=np.int64)
    pos = np.cumsum([1] + [1 + g for g in gaps[:max(len(b) - 1, 0)]])[:len(b)] if len(b) else b
    starts, lengths = _runs(b, np.asarray(pos, dtype=np.int64), cap)
    ref_starts, ref_lengths, i = [], [], 0
    while i < len(b):
        j = i + 1
        while j < len(b) and j - i < cap and b[j] == b[j - 1] + 1 and pos[j] == pos[j - 1] + 1:
            j += 1
        ref_starts.append(i)
        ref_lengths.append(j - i)
        i = j
    assert starts.tolist() == ref_starts and lengths.tolist() == ref_lengths


# -- layout, presence, delete, counters ------------------------------------------------
@pytest.mark.parametrize("row_bytes", WIDTHS)
def test_layout_rows_never_straddle_pages(tmp_path: Path, row_bytes: int, engine: str) -> None:
    tier = make(tmp_path, 100, row_bytes, engine)
    rpb = max(1, 4096 // row_bytes)
    block = 4096 if row_bytes <= 4096 else -(-row_bytes // 4096) * 4096
    assert (tier.rows_per_block, tier.block_bytes) == (rpb, block)
    ids = np.arange(100, dtype=np.int64)
    rows = rows_for(ids, row_bytes)
    tier.put(ids, rows)
    tier.close()
    raw = np.fromfile(tmp_path / SLAB_FILE, dtype=np.uint8)
    assert len(raw) == -(-100 // rpb) * block
    for i in sorted({0, 1, min(rpb - 1, 99), min(rpb, 99), 99}):
        off = (i // rpb) * block + (i % rpb) * row_bytes
        np.testing.assert_array_equal(raw[off:off + row_bytes], rows[i])


def test_never_written_rows_are_absent_and_creation_is_sparse(tmp_path: Path, engine: str) -> None:
    tier = make(tmp_path, 50_000_000, 256, engine)  # 12.8 GB of rows: must not be written up front
    st_ = os.stat(tmp_path / SLAB_FILE)
    assert st_.st_size == 50_000_000 // 16 * 4096
    assert st_.st_blocks * 512 < (1 << 20)
    ids = np.array([0, 7, 49_999_999, 123_456], dtype=np.int64)
    out, found = tier.get(ids)
    assert not found.any() and not out.any()
    assert tier.counters.bytes_read == 0  # absent rows cost no I/O
    tier.put(ids[:2], rows_for(ids[:2], 256))
    out, found = tier.get(ids)
    assert found.tolist() == [True, True, False, False]
    assert tier.resident_rows == 2 and tier.capacity_rows == 50_000_000
    tier.close()


def test_delete_clears_presence_and_persists(tmp_path: Path, engine: str) -> None:
    tier = make(tmp_path, 64, 68, engine)
    ids = np.arange(64, dtype=np.int64)
    rows = rows_for(ids, 68)
    tier.put(ids, rows)
    tier.flush()
    gone = np.array([3, 4, 60], dtype=np.int64)
    tier.delete(gone)
    tier.delete(gone)  # deleting absent rows is a no-op
    model = {i: rows[i] for i in range(64) if i not in (3, 4, 60)}
    check_all(tier, model)
    # a put into the same page must keep the deleted rows absent and the others intact
    tier.put(np.array([5], dtype=np.int64), rows[6:7])
    model[5] = rows[6]
    check_all(tier, model)
    tier.close()
    tier = make(tmp_path, 64, 68, engine)
    check_all(tier, model)
    tier.put(gone, rows[gone])
    model.update({int(i): rows[i] for i in gone})
    check_all(tier, model)
    tier.close()


def test_counters_and_read_amplification(tmp_path: Path, engine: str) -> None:
    tier = make(tmp_path, 1600, 256, engine)  # 16 rows per page, 100 pages
    ids = np.arange(1600, dtype=np.int64)
    tier.put(ids, rows_for(ids, 256))
    assert tier.counters.bytes_written == 100 * 4096
    assert tier.counters.bytes_read == 0  # whole pages covered: no read-modify-write
    tier.counters.bytes_read = 0
    q = np.array([0, 16 * 5 + 3, 16 * 9, 16 * 9 + 1], dtype=np.int64)  # pages 0, 5, 9
    tier.delete(np.array([16 * 9 + 1], dtype=np.int64))
    out, found = tier.get(q)
    assert found.tolist() == [True, True, True, False]
    assert (tier.counters.hits, tier.counters.misses) == (3, 1)
    assert tier.counters.bytes_read == 3 * 4096
    assert tier.read_amplification == pytest.approx(3 * 4096 / (3 * 256))
    # a partial put into a page holding other present rows reads it first
    tier.put(np.array([17], dtype=np.int64), rows_for(np.array([17]), 256, 9))
    assert tier.counters.bytes_read == 4 * 4096
    s = tier.stats()
    assert (s.kind, s.hits, s.misses, s.resident_rows, s.capacity_rows) == ("ssd", 3, 1, 1599, 1600)
    tier.close()


def test_reopen_after_flush_returns_the_same(tmp_path: Path, engine: str) -> None:
    tier = make(tmp_path, 1000, 1000, engine)
    rng = np.random.default_rng(1)
    ids = rng.permutation(1000)[:500].astype(np.int64)
    rows = rows_for(ids, 1000)
    tier.put(ids, rows)
    tier.flush()
    before = tier.get(np.arange(1000, dtype=np.int64))
    other = "pread" if engine == "io_uring" else "io_uring"
    again = make(tmp_path / "x", 10, 4, engine)  # a second tier elsewhere does not interfere
    again.close()
    tier._release()  # drop without close(): nothing beyond the flush is needed
    tier.closed = True
    tier = make(tmp_path, 1000, 1000, other)  # the file format does not depend on the engine
    after = tier.get(np.arange(1000, dtype=np.int64))
    np.testing.assert_array_equal(before[0], after[0])
    np.testing.assert_array_equal(before[1], after[1])
    tier.close()


@pytest.mark.parametrize("use_uring", [True, False], ids=ENGINES)
@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(row_bytes=st.sampled_from([8, 256, 5000]), num_rows=st.integers(1, 70),
       puts=st.lists(st.lists(st.integers(0, 10**6), min_size=1, max_size=40), min_size=1, max_size=6))
def test_repeated_ids_in_one_put_last_write_wins(tmp_path: Path, use_uring: bool, row_bytes: int, num_rows: int,
                                                  puts: list) -> None:
    """A put naming an id twice stores its last row and leaves the block's other rows alone (counting
    a repeated present id twice once skipped the read of a block whose other rows were present, and
    the write zeroed them), like the log layout."""
    engine = "io_uring" if use_uring else "pread"
    with tempfile.TemporaryDirectory(dir=tmp_path) as d:
        tier = make(d, num_rows, row_bytes, engine)
        model: dict[int, np.ndarray] = {}
        for version, raw in enumerate(puts):
            ids = np.array(raw, dtype=np.int64) % num_rows  # unsorted, repeats likely
            rows = rows_for(ids, row_bytes, version) ^ np.arange(len(ids), dtype=np.uint8)[:, None]
            tier.put(ids, rows)
            model.update(zip(ids.tolist(), rows))
            check_all(tier, model)
            tier.flush()  # committed neighbours: a put into their block must read it first
        tier.close()
        tier = make(d, num_rows, row_bytes, engine)
        check_all(tier, model)
        tier.close()


# -- bad input ----------------------------------------------------------------------
def test_bad_ids_and_rows(tmp_path: Path, engine: str) -> None:
    tier = make(tmp_path, 100, 8, engine)
    good = np.arange(3, dtype=np.int64)
    tier.put(good, rows_for(good, 8))
    for bad in ([-1], [100], [5, 1000], [np.iinfo(np.int64).max]):
        arr = np.array(bad, dtype=np.int64)
        for call in (tier.get, tier.contains, tier.delete):
            with pytest.raises(IdOutOfRangeError, match=str(bad[-1] if bad[-1] != 5 else 1000)):
                call(arr)
        with pytest.raises(IdOutOfRangeError):
            tier.put(arr, np.zeros((len(arr), 8), np.uint8))
    with pytest.raises(InvalidInputError):
        tier.get(np.array([1, 2], dtype=np.int32))
    with pytest.raises(InvalidInputError):
        tier.get(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(InvalidRowsError):
        tier.put(good, np.zeros((3, 9), np.uint8))
    with pytest.raises(InvalidRowsError):
        tier.put(good, np.zeros((3, 8), np.float32))
    assert tier.resident_rows == 3 and tier.counters.bytes_written == 4096
    out, found = tier.get(np.zeros(0, dtype=np.int64))
    assert out.shape == (0, 8) and found.shape == (0,)
    tier.put(np.zeros(0, dtype=np.int64), np.zeros((0, 8), np.uint8))
    tier.close()
    tier.close()  # idempotent
    with pytest.raises(StoreClosedError):
        tier.get(good)
    with pytest.raises(ValueError):
        SSDTier(tmp_path / "q", 10, 8, queue_depth=0)
    with pytest.raises(ValueError):
        SSDTier(tmp_path / "q", 0, 8)


# -- corrupt files at open ----------------------------------------------------------
def _flushed_tier(path: Path) -> None:
    t = SSDTier(path, 100, 16)
    ids = np.arange(0, 100, 3, dtype=np.int64)
    t.put(ids, rows_for(ids, 16))
    t.close()


@pytest.mark.parametrize("damage", ["flip_bit", "truncate", "magic", "empty", "extra_bit", "count"])
def test_corrupt_bitmap_at_open(tmp_path: Path, damage: str) -> None:
    _flushed_tier(tmp_path)
    path = tmp_path / BITMAP_FILE
    data = bytearray(path.read_bytes())
    if damage == "flip_bit":
        data[-5] ^= 0x10
    elif damage == "truncate":
        data = data[:-3]
    elif damage == "magic":
        data[0] ^= 0xFF
    elif damage == "empty":
        data = bytearray()
    elif damage == "extra_bit":  # a bit past num_rows, with a matching checksum
        data[-1] |= 0x80
        import zlib
        hdr = ssd._BITMAP_HEADER
        fields = list(hdr.unpack_from(data))
        fields[-1] = 0
        body = bytes(data[hdr.size:])
        fields[-1] = zlib.crc32(body, zlib.crc32(hdr.pack(*fields)))
        data[:hdr.size] = hdr.pack(*fields)
    elif damage == "count":  # count field disagrees with the bits, checksum recomputed
        import zlib
        hdr = ssd._BITMAP_HEADER
        fields = list(hdr.unpack_from(data))
        fields[4] += 1
        fields[-1] = 0
        body = bytes(data[hdr.size:])
        fields[-1] = zlib.crc32(body, zlib.crc32(hdr.pack(*fields)))
        data[:hdr.size] = hdr.pack(*fields)
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptStoreError, match=str(tmp_path)):
        SSDTier(tmp_path, 100, 16)


def test_truncated_or_missing_slab_and_wrong_geometry(tmp_path: Path) -> None:
    _flushed_tier(tmp_path)
    with pytest.raises(CorruptStoreError, match="num_rows=100"):
        SSDTier(tmp_path, 101, 16)
    with pytest.raises(CorruptStoreError, match="row_bytes=16"):
        SSDTier(tmp_path, 100, 32)
    slab = tmp_path / SLAB_FILE
    os.truncate(slab, os.path.getsize(slab) - 4096)
    with pytest.raises(CorruptStoreError, match=str(slab)):
        SSDTier(tmp_path, 100, 16)
    slab.unlink()
    with pytest.raises(CorruptStoreError, match=str(slab)):
        SSDTier(tmp_path, 100, 16)


def test_interrupted_creation_is_recreated(tmp_path: Path) -> None:
    """Until present.bin exists the directory holds no tier; a leftover slab is reset."""
    (tmp_path / SLAB_FILE).write_bytes(b"x" * 100)
    t = SSDTier(tmp_path, 100, 16)
    assert t.resident_rows == 0 and not t.contains(np.arange(100, dtype=np.int64)).any()
    assert os.path.getsize(tmp_path / SLAB_FILE) == 4096  # 256 rows of 16 bytes per page
    t.close()


# -- engines and fallbacks -------------------------------------------------------------
@pytest.mark.parametrize("value, engine", [("1", "pread+direct"), ("yes", "pread+direct"), ("0", "io_uring+direct"),
                                           ("false", "io_uring+direct"), ("Off", "io_uring+direct")])
def test_env_var_forces_pread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str, engine: str) -> None:
    monkeypatch.setenv(ssd.NO_IO_URING_ENV, value)
    t = SSDTier(tmp_path, 10, 4)
    assert t.io_engine == engine
    t.close()


def test_io_uring_unavailable_falls_back_and_logs_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    import pyuring

    def refuse(*a: object, **k: object) -> None:
        raise pyuring.UringError(errno.EPERM, "uring_create_ex")

    monkeypatch.setattr(pyuring, "UringCtx", refuse)
    monkeypatch.setattr(io_engine, "_logged", set())
    with caplog.at_level(logging.WARNING, logger="embstore.tiers"):
        a = SSDTier(tmp_path / "a", 10, 4)
        b = SSDTier(tmp_path / "b", 10, 4)
    assert a.io_engine == b.io_engine == "pread+direct"
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert len(caplog.records) == 1 and "io_uring unavailable" in caplog.records[0].message
    ids = np.arange(10, dtype=np.int64)
    a.put(ids, rows_for(ids, 4))
    check_all(a, {i: r for i, r in zip(range(10), rows_for(ids, 4))})
    a.close()
    b.close()


def test_o_direct_refused_uses_buffered_io(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture, engine: str) -> None:
    real_open = os.open

    def no_direct(path, flags, *a, **k):  # type: ignore[no-untyped-def]
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(ssd.os, "open", no_direct)
    monkeypatch.setattr(io_engine, "_logged", set())
    with caplog.at_level(logging.WARNING, logger="embstore.tiers"):
        t = make(tmp_path, 300, 68, engine)
        t.close()
        t = make(tmp_path, 300, 68, engine)
    assert t.io_engine == engine and not t.direct
    assert sum("O_DIRECT" in r.message for r in caplog.records) == 1
    ids = np.arange(0, 300, 7, dtype=np.int64)
    rows = rows_for(ids, 68)
    t.put(ids, rows)
    t.close()
    monkeypatch.undo()
    t = make(tmp_path, 300, 68, engine)
    assert t.direct
    check_all(t, {int(i): r for i, r in zip(ids, rows)})
    t.close()


# -- fault injection at the lowest-level call ---------------------------------------------
def _kernel_name(engine: str) -> str:
    return "_uring_kernel" if engine == "io_uring" else "_pio_kernel"


def _inject(monkeypatch: pytest.MonkeyPatch, engine: str, *, write: bool, err: int = 0, short: bool = False,
            fatal: int = 0, after_calls: int = 0) -> list[int]:
    """Make the I/O kernel fail requests of one direction: every request reports -err (nothing is
    transferred), or the first is short, or the ring call itself fails with -fatal.
    The first ``after_calls`` matching calls pass through untouched. Returns a call counter."""
    real = getattr(io_engine, _kernel_name(engine))
    calls = [0]

    def fake(*args):  # type: ignore[no-untyped-def]
        if engine == "io_uring":
            ring, fd, opcode, offs, addrs, lens, qd, res = args
            is_write = opcode == io_engine._IORING_OP_WRITE
        else:
            fd, is_write, offs, addrs, lens, res = args
        if is_write != write:
            return real(*args)
        calls[0] += 1
        if calls[0] <= after_calls:
            return real(*args)
        if fatal:
            return -fatal
        if short:
            rc = real(*args)
            res[0] = lens[0] // 2
            return rc
        res[:] = -err
        return 0

    monkeypatch.setattr(io_engine, _kernel_name(engine), fake)
    return calls


def _seeded(path: Path, engine: str, row_bytes: int = 256, num_rows: int = 512) -> tuple[SSDTier, dict]:
    tier = make(path, num_rows, row_bytes, engine)
    ids = np.arange(0, num_rows, 2, dtype=np.int64)
    rows = rows_for(ids, row_bytes, 1)
    tier.put(ids, rows)
    tier.flush()
    return tier, {int(i): r for i, r in zip(ids, rows)}


def _reopen_consistent(path: Path, engine: str, model: dict, row_bytes: int = 256, num_rows: int = 512) -> None:
    tier = make(path, num_rows, row_bytes, engine)
    check_all(tier, model)
    tier.close()


@pytest.mark.parametrize("err,cls", [(errno.EIO, TierIOError), (errno.ENOSPC, DiskFullError)])
def test_write_fault(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: str, err: int, cls: type) -> None:
    tier, model = _seeded(tmp_path, engine)
    _inject(monkeypatch, engine, write=True, err=err)
    ids = np.arange(1, 512, 2, dtype=np.int64)  # new rows between the old ones: read-modify-write
    with pytest.raises(cls) as ei:
        tier.put(ids, rows_for(ids, 256, 2))
    assert ei.value.errno == err and ei.value.tier == "ssd" and ei.value.operation == "write"
    assert isinstance(ei.value.__cause__, OSError)
    check_all(tier, model)  # the failed rows never became present
    monkeypatch.undo()
    tier.close()
    _reopen_consistent(tmp_path, engine, model)


@pytest.mark.parametrize("err,cls", [(errno.EIO, TierIOError), (errno.ENOSPC, DiskFullError)])
def test_read_fault(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: str, err: int, cls: type) -> None:
    tier, model = _seeded(tmp_path, engine)
    _inject(monkeypatch, engine, write=False, err=err)
    with pytest.raises(cls) as ei:
        tier.get(np.arange(10, dtype=np.int64))
    assert ei.value.errno == err and ei.value.operation == "read"
    # read-modify-write of a partly covered page fails before anything is written
    with pytest.raises(cls):
        tier.put(np.array([1], dtype=np.int64), rows_for(np.array([1]), 256, 3))
    assert tier.counters.bytes_written == 512 // 16 * 4096  # only the seeding put wrote
    monkeypatch.undo()
    check_all(tier, model)  # the tier keeps working once the fault is gone
    tier.close()
    _reopen_consistent(tmp_path, engine, model)


@pytest.mark.parametrize("write", [False, True], ids=["read", "write"])
def test_transfer_that_stays_short_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: str,
                                    write: bool) -> None:
    tier, model = _seeded(tmp_path, engine)
    _inject(monkeypatch, engine, write=write, short=True)
    with pytest.raises(TierIOError, match="short") as ei:
        if write:
            tier.put(np.array([0], dtype=np.int64), model[0][None])
        else:
            tier.get(np.array([0], dtype=np.int64))
    assert ei.value.errno == errno.EIO
    monkeypatch.undo()
    tier.close()
    _reopen_consistent(tmp_path, engine, model)


@pytest.mark.parametrize("write", [False, True], ids=["read", "write"])
def test_one_short_transfer_is_resumed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: str,
                                       write: bool) -> None:
    """A file system may transfer part of a request (a nearly full disk); the rest is resubmitted."""
    tier, model = _seeded(tmp_path, engine)
    real = getattr(io_engine, _kernel_name(engine))
    calls = [0]

    def short_once(*args):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] > 1:
            return real(*args)
        res, lens = args[-1], (args[5] if engine == "io_uring" else args[4])
        rc = real(*args)
        if lens[0] > 4096 and res[0] == lens[0]:
            res[0] = 4096  # pretend only the first block went through (the rest is redone)
        return rc

    monkeypatch.setattr(io_engine, _kernel_name(engine), short_once)
    ids = np.arange(0, 64, dtype=np.int64)  # several rows per request, so requests span blocks
    if write:
        rows = rows_for(ids, 256, 9)
        tier.put(ids, rows)
        model.update({int(i): r for i, r in zip(ids, rows)})
    got, found = tier.get(ids)
    assert calls[0] >= 2
    for i, r, f in zip(ids.tolist(), got, found):
        assert f == (i in model) and (not f or np.array_equal(r, model[i]))
    monkeypatch.undo()
    tier.close()
    _reopen_consistent(tmp_path, engine, model)


def test_ring_failure_resets_the_ring(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure of the ring itself (not of one request) replaces the ring; the tier keeps working."""
    tier, model = _seeded(tmp_path, "io_uring")
    old_ctx = tier._engine._ctx
    _inject(monkeypatch, "io_uring", write=False, fatal=errno.EIO)
    with pytest.raises(TierIOError) as ei:
        tier.get(np.arange(4, dtype=np.int64))
    assert ei.value.errno == errno.EIO and ei.value.operation == "read"
    assert (tier.counters.hits, tier.counters.misses) == (0, 0)  # a failed get counts nothing
    monkeypatch.undo()
    assert tier._engine._ctx is not old_ctx and tier.io_engine == "io_uring+direct"
    check_all(tier, model)
    tier.close()


def test_partial_put_marks_only_written_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               engine: str) -> None:
    tier, model = _seeded(tmp_path, engine)
    tier._chunk_blocks = 4  # 64 rows of 256 bytes per chunk
    _inject(monkeypatch, engine, write=True, err=errno.EIO, after_calls=1)
    ids = np.arange(1, 512, 2, dtype=np.int64)
    rows = rows_for(ids, 256, 5)
    with pytest.raises(TierIOError):
        tier.put(ids, rows)
    monkeypatch.undo()
    first = ids[ids < 64]  # the first chunk was written and is present
    model.update({int(i): r for i, r in zip(ids, rows) if i < 64})
    check_all(tier, model)
    tier.close()
    _reopen_consistent(tmp_path, engine, model)
    assert len(first) == 32


@pytest.mark.parametrize("err,cls", [(errno.EIO, TierIOError), (errno.ENOSPC, DiskFullError)])
@pytest.mark.parametrize("where", ["fdatasync", "bitmap"])
def test_flush_fault(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: str, err: int, cls: type,
                     where: str) -> None:
    tier, model = _seeded(tmp_path, engine)
    ids = np.arange(1, 512, 2, dtype=np.int64)
    rows = rows_for(ids, 256, 7)
    tier.put(ids, rows)

    def fail(fd: int) -> None:
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(ssd, "_fdatasync" if where == "fdatasync" else "_fsync", fail)
    with pytest.raises(cls) as ei:
        tier.flush()
    assert ei.value.operation == "flush" and ei.value.errno == err
    with pytest.raises(cls):
        tier.close()  # close() flushes; it fails the same way but still releases the files
    assert tier.closed and tier._fd == -1
    assert not (tmp_path / (BITMAP_FILE + ".tmp")).exists()
    monkeypatch.undo()
    _reopen_consistent(tmp_path, engine, model)  # the last successful flush


# -- real ENOSPC on a tiny file system ------------------------------------------------------
@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()}); the injected ENOSPC tests cover this")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_real_enospc_on_write_and_flush(tiny_fs: Path, engine: str) -> None:
    d = tiny_fs / "t"
    tier = make(d, 20_000, 256, engine)  # 5 MB sparse slab on a 256 KiB file system
    ids = np.arange(0, 160, dtype=np.int64)  # ten pages
    rows = rows_for(ids, 256)
    tier.put(ids, rows)
    tier.flush()
    model = {int(i): r for i, r in zip(ids, rows)}
    spread = np.arange(160, 20_000, 16, dtype=np.int64)  # one row in each of the other pages
    with pytest.raises(DiskFullError) as ei:
        tier.put(spread, rows_for(spread, 256, 1))
    assert ei.value.errno == errno.ENOSPC and ei.value.operation == "write"
    check_all(tier, model)
    # rows in pages that already exist can still be written, but present.bin cannot be replaced
    more = np.arange(0, 16, 2, dtype=np.int64)
    tier.put(more, rows_for(more, 256, 2))
    filler = tiny_fs / "filler"
    try:  # take whatever space is left
        with open(filler, "wb", buffering=0) as f:
            while True:
                f.write(b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    assert (d / ssd.BITMAP_DELTA_FILE).stat().st_size > 0  # the first flush appended a record
    tier.delete(np.array([1, 3], dtype=np.int64))
    tier.flush()  # its small record fits in the page present.delta already holds
    with pytest.raises(DiskFullError) as ei:
        tier.close()  # folding the records into a new present.bin needs space
    assert ei.value.operation == "flush"
    # reopening sees the last successful flush (the 8 overwritten rows may hold either version); it
    # cannot fold present.delta into present.bin on the full file system and opens all the same
    tier = make(d, 20_000, 256, engine)
    out, found = tier.get(np.arange(20_000, dtype=np.int64))
    assert found.sum() == 158 and found[:160].sum() == 158 and not found[[1, 3]].any()
    for i in range(160):
        if i not in more and i not in (1, 3):
            np.testing.assert_array_equal(out[i], model[i])
    tier.close()  # nothing new to flush
    tier = make(d, 20_000, 256, engine)
    tier.delete(np.array([5], dtype=np.int64))
    with pytest.raises(DiskFullError):  # a change needs the rewrite the open could not do
        tier.flush()
    with pytest.raises(DiskFullError):
        tier.close()


# -- crash: SIGKILL while writing --------------------------------------------------------------
_CRASH_CHILD = textwrap.dedent("""
    import os, sys, numpy as np
    from embstore.tiers.ssd import SSDTier
    path, row_bytes, engine = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    n = 400
    tier = SSDTier(path, n, row_bytes, queue_depth=8, use_io_uring=(engine == "io_uring"))
    rng = np.random.default_rng(int(sys.argv[4]))
    ver = np.full(n, -1, np.int64)  # the model: version of each present row, -1 = absent
    version = 0
    while True:
        version += 1
        ids = rng.choice(n, size=int(rng.integers(1, 120)), replace=False).astype(np.int64)
        rows = np.empty((len(ids), row_bytes), np.uint8)
        rows[:] = ((ids * 7 + version) % 251).astype(np.uint8)[:, None]   # a row is one repeated byte
        rows[:, :4] = np.frombuffer(np.int32(version).tobytes(), np.uint8)  # after its version
        tier.put(ids, rows)
        ver[ids] = version
        if rng.random() < 0.3:
            gone = rng.choice(n, size=5, replace=False).astype(np.int64)
            tier.delete(gone)
            ver[gone] = -1
        if version % 5 == 0:
            np.save(f"{path}.tmp.npy", ver)  # what this flush is about to make durable
            os.replace(f"{path}.tmp.npy", f"{path}.state-{version}.npy")
            tier.flush()
            print(version, flush=True)
""")


@pytest.mark.parametrize("row_bytes", [68, 5000])
def test_sigkill_keeps_flushed_rows(tmp_path: Path, engine: str, row_bytes: int) -> None:
    """After SIGKILL the present rows are exactly those of the last flush (or of the flush that was
    running), each at least as new as at that flush and one whole version, never a torn mix."""
    script = tmp_path / "child.py"
    script.write_text(_CRASH_CHILD)
    for trial in range(2):
        d = tmp_path / f"t{trial}"
        proc = subprocess.Popen([sys.executable, str(script), str(d), str(row_bytes), engine, str(trial)],
                                stdout=subprocess.PIPE, text=True)
        confirmed = []
        target = 3 + trial * 4
        deadline = time.monotonic() + 60
        while len(confirmed) < target and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            confirmed.append(int(line))
        time.sleep(0.01 * (trial + 1))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        confirmed += [int(line) for line in whole_lines(proc.stdout.read())]
        proc.stdout.close()
        assert len(confirmed) >= target, "child died before flushing"
        tier = make(d, 400, row_bytes, engine)
        out, found = tier.get(np.arange(400, dtype=np.int64))
        tier.close()
        check_against_flushes(tmp_path, f"t{trial}", confirmed[-1], out, found)


# -- threads and fork -----------------------------------------------------------------------------
def test_concurrent_threads_see_their_own_writes(tmp_path: Path, engine: str) -> None:
    import threading

    tier = make(tmp_path, 4000, 100, engine)
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            ids = np.arange(k, 4000, 4, dtype=np.int64)  # threads share pages, not rows
            rng = np.random.default_rng(k)
            for v in range(5):
                pick = rng.permutation(ids)[:200]
                rows = rows_for(pick, 100, v * 10 + k)
                tier.put(pick, rows)
                out, found = tier.get(pick)
                assert found.all()
                np.testing.assert_array_equal(out, rows)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    tier.close()


def test_forked_child_gets_its_own_ring(tmp_path: Path, engine: str) -> None:
    tier, model = _seeded(tmp_path, engine)
    pid = os.fork()
    if pid == 0:  # child: read through the inherited tier, then leave without cleanup
        code = 1
        try:
            out, found = tier.get(np.arange(512, dtype=np.int64))
            ok = all(found[i] == (i in model) for i in range(512)) and all(
                np.array_equal(out[i], r) for i, r in model.items())
            code = 0 if ok else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    check_all(tier, model)  # the parent's ring is untouched
    tier.close()


def test_disk_and_directory_kernels_release_the_gil() -> None:
    """A look-ahead thread spends its time in these kernels (waiting on the disk, walking the cache
    directory); holding the GIL there stalled the training thread (BENCHMARKS.md, DLRM)."""
    from embstore import direct_directory, policies
    from embstore.tiers import io_engine

    kernels = [io_engine._uring_kernel, io_engine._pio_kernel, policies._access_kernel, policies._lookup_kernel,
               policies._remove_kernel, direct_directory._count_resident_serial,
               direct_directory._count_resident_parallel]
    assert [k.py_func.__name__ for k in kernels if not k.targetoptions.get("nogil")] == []
