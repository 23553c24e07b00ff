"""The ssd tier's log layout: writes append whole blocks (no read-modify-write), a greedy cleaner
reclaims space, and the committed slot map keeps every flushed row across crashes and reopenings."""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import embstore
from embstore.config import StoreConfig, TableConfig, TierConfig
from embstore.errors import ConfigError, CorruptStoreError, DiskFullError, TierIOError
from embstore.tiers import io_engine, ssd, ssd_log
from embstore.tiers.delta import RECORD_HEADER, encode_record
from embstore.tiers.ssd import SSDTier
from embstore.tiers.ssd_log import LogSSDTier
from crash_states import whole_lines


def rows_for(ids: np.ndarray, row_bytes: int, version: int) -> np.ndarray:
    """Rows that name their id and version in every 8 bytes, so a torn row is visible."""
    unit = (np.asarray(ids, np.int64) * 1_000_003 + version).astype("<i8").view(np.uint8).reshape(-1, 8)
    return np.tile(unit, (1, -(-row_bytes // 8)))[:, :row_bytes].copy()


def check_all(tier: LogSSDTier, model: dict[int, np.ndarray]) -> None:
    ids = np.arange(tier.num_rows, dtype=np.int64)
    rows, found = tier.get(ids)
    assert np.flatnonzero(found).tolist() == sorted(model)
    for i in model:
        np.testing.assert_array_equal(rows[i], model[i], err_msg=f"row {i}")
    assert int(tier._live.sum()) == tier.resident_rows == len(model)  # live counts agree with the map
    free = tier._free[tier._free_head:]
    assert len(np.unique(free)) == len(free) and not tier._live[free].any()  # a free block is empty, once
    assert np.all(np.diff(free) > 0)  # kept sorted: taken from the front


def test_writes_never_read_but_in_place_does(tmp_path: Path) -> None:
    """The point of the layout: rows written next to present rows cost no read."""
    even = np.arange(0, 4096, 2, dtype=np.int64)
    odd = np.arange(1, 4096, 64, dtype=np.int64)  # one new row in each block of present rows
    for cls, reads in ((LogSSDTier, False), (SSDTier, True)):
        tier = cls(tmp_path / cls.__name__, 4096, 64)
        tier.put(even, rows_for(even, 64, 1))
        before = tier.counters.bytes_read
        tier.put(odd, rows_for(odd, 64, 2))
        assert (tier.counters.bytes_read > before) is reads, cls.__name__
        rows, found = tier.get(np.concatenate([even, odd]))
        assert found.all()
        np.testing.assert_array_equal(rows, np.concatenate([rows_for(even, 64, 1), rows_for(odd, 64, 2)]))
        tier.close()


def test_cleaner_reclaims_space_and_keeps_every_row(tmp_path: Path) -> None:
    """Overwrite a full table many times over: the slab never grows, the cleaner runs, nothing is lost."""
    rng = np.random.default_rng(0)
    tier = LogSSDTier(tmp_path / "t", 3000, 200)  # 20 rows per block, 150 blocks + 64 spare
    size = os.path.getsize(tmp_path / "t" / ssd.SLAB_FILE)
    model: dict[int, np.ndarray] = {}
    all_ids = np.arange(3000, dtype=np.int64)
    tier.put(all_ids, rows_for(all_ids, 200, 0))
    model.update(zip(all_ids.tolist(), rows_for(all_ids, 200, 0)))
    for v in range(1, 200):
        ids = np.unique(rng.integers(0, 3000, 150))
        tier.put(ids, rows_for(ids, 200, v))
        model.update(zip(ids.tolist(), rows_for(ids, 200, v)))
        if v % 50 == 0:
            tier.flush()
    assert tier.cleaned_blocks > 0
    assert os.path.getsize(tmp_path / "t" / ssd.SLAB_FILE) == size
    check_all(tier, model)
    tier.close()
    tier = LogSSDTier(tmp_path / "t", 3000, 200)
    check_all(tier, model)
    tier.close()


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "put", "put", "delete", "get", "flush", "reopen"]),
                              st.lists(st.integers(0, 99), min_size=1, max_size=40), st.integers(0, 1000)),
                    max_size=60),
       row_bytes=st.sampled_from([40, 700, 2048, 5000]))
def test_matches_dict_model_through_cleaning_and_reopens(ops, row_bytes: int, tmp_path_factory) -> None:
    """Random puts (repeated ids too), deletes, flushes and reopenings against a dict, with 20 spare
    blocks so the cleaner runs all the time (a put takes at least one whole block)."""
    path = tmp_path_factory.mktemp("log") / "t"
    saved = ssd_log.MIN_SPARE_BLOCKS
    ssd_log.MIN_SPARE_BLOCKS = 20
    try:
        tier = LogSSDTier(path, 100, row_bytes, queue_depth=4)
        model: dict[int, np.ndarray] = {}
        for op, ids, version in ops:
            arr = np.array(ids, np.int64)
            if op == "put":
                rows = rows_for(arr, row_bytes, version) ^ np.arange(len(arr), dtype=np.uint8)[:, None]
                tier.put(arr, rows)
                model.update(zip(ids, rows))  # a repeated id: the last write wins
            elif op == "delete":
                tier.delete(np.unique(arr))
                for i in ids:
                    model.pop(i, None)
            elif op == "get":
                rows, found = tier.get(np.unique(arr))
                for i, r, f in zip(np.unique(arr).tolist(), rows, found):
                    assert f == (i in model)
                    if f:
                        np.testing.assert_array_equal(r, model[i])
            elif op == "flush":
                tier.flush()
            else:
                tier.close()
                tier = LogSSDTier(path, 100, row_bytes, queue_depth=4)
            assert tier.resident_rows == len(model)
        check_all(tier, model)
        tier.close()
        tier = LogSSDTier(path, 100, row_bytes, queue_depth=4)
        check_all(tier, model)
        tier.close()
    finally:
        ssd_log.MIN_SPARE_BLOCKS = saved


def test_one_row_puts_are_compacted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each one-row put takes a whole block; with 4 spare blocks the cleaner must pack them together
    (hypothesis found this: the cleaner used to move one victim at a time, which gains nothing)."""
    monkeypatch.setattr(ssd_log, "MIN_SPARE_BLOCKS", 4)
    tier = LogSSDTier(tmp_path / "t", 100, 40)  # 102 rows per block: 1 block + 4 spare
    model = {}
    for i in [0, 1, 2, 0, 3, 4, 5, 6, 1, 7]:
        row = rows_for(np.array([i]), 40, len(model))
        tier.put(np.array([i], np.int64), row)
        model[i] = row[0]
    assert tier.cleaned_blocks > 0
    check_all(tier, model)
    tier.close()


@settings(max_examples=60, deadline=None)
@given(row_bytes=st.sampled_from([8, 100, 1000, 2048, 4096, 5000]),
       size=st.sampled_from(["one row", "under a block", "one block", "a block and one", "two blocks"]),
       spare=st.sampled_from([4, 8, 64]),
       ops=st.lists(st.tuples(st.sampled_from(["put", "put", "put", "put", "delete", "flush", "reopen"]),
                              st.lists(st.integers(0, 10**6), max_size=30), st.integers(0, 1000)),
                    max_size=60))
def test_tiny_tables_through_many_cleanings_and_reopens(tmp_path_factory, row_bytes: int, size: str, spare: int,
                                                        ops: list) -> None:
    """Tables of one row, fewer rows than a block, exactly one block, or just past it, with as few as 4
    spare blocks (the real minimum is 64; with 1 or 2 the log can wedge with no free block to clean
    into): the same rows written over and over (the cleaner runs on most puts), deletes, reopens
    between cleanings; every row and count matches a dict after each step and after reopening."""
    rpb = max(1, 4096 // row_bytes)
    num_rows = {"one row": 1, "under a block": max(1, rpb // 2), "one block": rpb, "a block and one": rpb + 1,
                "two blocks": 2 * rpb}[size]
    path = tmp_path_factory.mktemp("tiny") / "t"
    saved = ssd_log.MIN_SPARE_BLOCKS
    ssd_log.MIN_SPARE_BLOCKS = spare
    try:
        tier = LogSSDTier(path, num_rows, row_bytes, queue_depth=1)
        model: dict[int, np.ndarray] = {}
        for op, raw, version in ops:
            ids = np.array(raw, np.int64) % num_rows  # unsorted, repeated: the last write wins
            if op == "put":
                rows = rows_for(ids, row_bytes, version) ^ np.arange(len(ids), dtype=np.uint8)[:, None]
                tier.put(ids, rows)
                model.update(zip(ids.tolist(), rows))
            elif op == "delete":
                tier.delete(ids)
                for i in ids.tolist():
                    model.pop(i, None)
            elif op == "flush":
                tier.flush()
            else:
                tier.close()
                tier = LogSSDTier(path, num_rows, row_bytes, queue_depth=1)
            check_all(tier, model)
        tier.close()
        tier = LogSSDTier(path, num_rows, row_bytes, queue_depth=1)
        check_all(tier, model)
        tier.close()
    finally:
        ssd_log.MIN_SPARE_BLOCKS = saved


def test_one_block_table_rewritten_row_by_row_cleans_many_times(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full one-block table with two spare blocks, its rows rewritten one at a time, reopened every
    25 writes: each rewrite leaves two part-filled blocks, so the cleaner runs again and again."""
    monkeypatch.setattr(ssd_log, "MIN_SPARE_BLOCKS", 2)
    path = tmp_path / "t"
    tier = LogSSDTier(path, 16, 256)  # 16 rows of 256 bytes: one block, 3 in the slab
    ids = np.arange(16, dtype=np.int64)
    tier.put(ids, rows_for(ids, 256, 0))
    model = dict(zip(ids.tolist(), rows_for(ids, 256, 0)))
    cleaned = 0
    for v in range(1, 201):
        i = np.array([v * 5 % 16], np.int64)
        tier.put(i, rows_for(i, 256, v))
        model[int(i[0])] = rows_for(i, 256, v)[0]
        if v % 25 == 0:
            check_all(tier, model)
            cleaned += tier.cleaned_blocks
            tier.close()
            tier = LogSSDTier(path, 16, 256)
            check_all(tier, model)
    assert cleaned >= 100 and tier.num_blocks == 3
    tier.close()


def test_unflushed_writes_are_not_visible_after_a_lost_process(tmp_path: Path) -> None:
    """Without close(), a reopen sees the last flush: overwritten rows at their flushed version."""
    tier = LogSSDTier(tmp_path / "t", 1000, 64)
    ids = np.arange(1000, dtype=np.int64)
    tier.put(ids, rows_for(ids, 64, 1))
    tier.flush()
    tier.put(ids[:500], rows_for(ids[:500], 64, 2))
    tier.delete(ids[900:])
    tier._release()  # drop the file descriptors the way a killed process would
    tier.closed = True
    again = LogSSDTier(tmp_path / "t", 1000, 64)
    check_all(again, {int(i): r for i, r in zip(ids, rows_for(ids, 64, 1))})
    again.close()


def _lose_process(tier: LogSSDTier) -> None:
    tier._release()  # drop the file descriptors the way a killed process would
    tier.closed = True


def test_a_flush_appends_the_moved_rows_instead_of_rewriting_the_map(tmp_path: Path) -> None:
    tier = LogSSDTier(tmp_path / "t", 100_000, 64)
    ids = np.arange(0, 100_000, 7, dtype=np.int64)
    tier.put(ids, rows_for(ids, 64, 1))
    tier.flush()
    map_file, delta_file = tmp_path / "t" / ssd.LOG_MAP_FILE, tmp_path / "t" / ssd_log.LOG_DELTA_FILE
    before, logged = map_file.read_bytes(), delta_file.stat().st_size
    model = {int(i): r for i, r in zip(ids, rows_for(ids, 64, 1))}
    for version in (2, 3):
        few = ids[version * 10:version * 10 + 50]
        tier.put(few, rows_for(few, 64, version))
        tier.delete(ids[-version:])
        tier.flush()
        model.update({int(i): r for i, r in zip(few, rows_for(few, 64, version))})
        for i in ids[-version:]:
            model.pop(int(i), None)
    assert map_file.read_bytes() == before  # 400 KB map untouched
    assert 0 < delta_file.stat().st_size - logged < 5_000  # two records of ~52 moved rows
    tier.put(ids[:5], rows_for(ids[:5], 64, 9))  # not flushed: lost with the process
    _lose_process(tier)
    again = LogSSDTier(tmp_path / "t", 100_000, 64)
    check_all(again, model)
    assert not delta_file.exists() and map_file.read_bytes() != before  # folded into the map on open
    again.close()


def test_deltas_are_folded_into_the_map_once_they_outgrow_it(tmp_path: Path) -> None:
    tier = LogSSDTier(tmp_path / "t", 2_000, 64)
    delta_file = tmp_path / "t" / ssd_log.LOG_DELTA_FILE
    model = {}
    sizes = []
    for version in range(1, 40):
        ids = np.arange(version * 37 % 2_000, version * 37 % 2_000 + 60, dtype=np.int64) % 2_000
        tier.put(ids, rows_for(ids, 64, version))
        model.update({int(i): r for i, r in zip(ids, rows_for(ids, 64, version))})
        tier.flush()
        sizes.append(delta_file.stat().st_size if delta_file.exists() else 0)
    assert max(sizes) <= tier._slot_of.nbytes and 0 in sizes[2:]  # bounded by the map; compacted on the way
    _lose_process(tier)
    again = LogSSDTier(tmp_path / "t", 2_000, 64)
    check_all(again, model)
    again.close()


@pytest.mark.parametrize("damage", ["torn-last", "other-map"])
def test_a_torn_or_foreign_delta_record_is_ignored(tmp_path: Path, damage: str) -> None:
    tier = LogSSDTier(tmp_path / "t", 1_000, 64)
    delta_file = tmp_path / "t" / ssd_log.LOG_DELTA_FILE
    ids = np.arange(100, dtype=np.int64)
    tier.put(ids, rows_for(ids, 64, 1))
    tier.flush()
    tier.put(ids[:10], rows_for(ids[:10], 64, 2))
    tier.flush()
    first = delta_file.read_bytes()
    tier.put(ids[:10], rows_for(ids[:10], 64, 3))
    tier.flush()
    _lose_process(tier)
    model = {int(i): r for i, r in zip(ids, rows_for(ids, 64, 1))}
    if damage == "torn-last":  # the third commit never finished: rows read as of the second
        delta_file.write_bytes(delta_file.read_bytes()[:-3])
        model.update({int(i): r for i, r in zip(ids[:10], rows_for(ids[:10], 64, 2))})
    else:  # whole records that follow another slots.bin (a crash between rewriting the map and
        data = delta_file.read_bytes()  # removing them leaves such): none is applied, from the first on
        out, at = [], 0
        while at < len(data):
            magic, base, count, n, _ = RECORD_HEADER.unpack_from(data, at)
            end = at + RECORD_HEADER.size + 16 * n
            out.append(encode_record(magic, base ^ 1, count, n, data[at + RECORD_HEADER.size:end]))
            at = end
        delta_file.write_bytes(b"".join(out))
        model = {}  # every commit here was a record: slots.bin is the empty map of creation
    assert len(first) > 0
    again = LogSSDTier(tmp_path / "t", 1_000, 64)
    check_all(again, model)
    again.close()


def test_a_failed_delta_append_leads_to_a_whole_map_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = LogSSDTier(tmp_path / "t", 1_000, 64)
    ids = np.arange(100, dtype=np.int64)
    tier.put(ids, rows_for(ids, 64, 1))
    tier.flush()
    tier.put(ids[:10], rows_for(ids[:10], 64, 2))
    real = ssd._fdatasync
    calls = {"n": 0}

    def failing(fd: int) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # the slab's sync passes, the delta record's fails
            raise OSError(errno.EIO, "injected")
        real(fd)

    monkeypatch.setattr(ssd, "_fdatasync", failing)
    with pytest.raises(TierIOError):
        tier.flush()
    monkeypatch.setattr(ssd, "_fdatasync", real)
    tier.flush()  # the retry rewrites the whole map and drops the damaged deltas
    assert not (tmp_path / "t" / ssd_log.LOG_DELTA_FILE).exists()
    _lose_process(tier)
    again = LogSSDTier(tmp_path / "t", 1_000, 64)
    model = {int(i): r for i, r in zip(ids, rows_for(ids, 64, 1))}
    model.update({int(i): r for i, r in zip(ids[:10], rows_for(ids[:10], 64, 2))})
    check_all(again, model)
    again.close()


@pytest.mark.parametrize("damage", ["checksum", "truncated", "magic", "shared-slot", "geometry"])
def test_corrupt_slot_map_at_open(tmp_path: Path, damage: str) -> None:
    tier = LogSSDTier(tmp_path / "t", 100, 64)
    ids = np.arange(10, dtype=np.int64)
    tier.put(ids, rows_for(ids, 64, 1))
    tier.close()
    path = tmp_path / "t" / ssd.LOG_MAP_FILE
    data = bytearray(path.read_bytes())
    head = ssd_log._MAP_HEADER.size
    if damage == "checksum":
        data[head + 5] ^= 1
    elif damage == "truncated":
        del data[-3:]
    elif damage == "magic":
        data[0] ^= 0xFF
    elif damage == "shared-slot":  # a valid checksum over a map that gives two rows one slot
        slots = np.frombuffer(bytes(data[head:]), np.int32).copy()
        slots[1] = slots[0]
        fields = list(ssd_log._MAP_HEADER.unpack_from(bytes(data)))
        body = slots.tobytes()
        fields[-1] = 0
        import zlib
        fields[-1] = zlib.crc32(body, zlib.crc32(ssd_log._MAP_HEADER.pack(*fields)))
        data = bytearray(ssd_log._MAP_HEADER.pack(*fields) + body)
    path.write_bytes(bytes(data))
    if damage == "geometry":
        with pytest.raises(CorruptStoreError, match="num_rows"):
            LogSSDTier(tmp_path / "t", 101, 64)
        return
    with pytest.raises(CorruptStoreError):
        LogSSDTier(tmp_path / "t", 100, 64)


@pytest.mark.parametrize("slot", [2**32 - 1, 2**32 + 1, 2**40, -2])
def test_a_delta_record_with_a_slot_outside_the_slab_is_corruption(tmp_path: Path, slot: int) -> None:
    """A whole record (good checksum) that moves a row to a slot the slab lacks is damage: it once
    wrapped into the int32 map (2**32 - 1 read as -1: the row silently absent)."""
    tier = LogSSDTier(tmp_path / "t", 100, 64)
    ids = np.arange(10, dtype=np.int64)
    tier.put(ids, rows_for(ids, 64, 1))
    tier.close()
    head = (tmp_path / "t" / ssd.LOG_MAP_FILE).read_bytes()[:ssd_log._MAP_HEADER.size]
    crc = ssd_log._MAP_HEADER.unpack(head)[-1]
    body = np.array([0], "<i8").tobytes() + np.array([slot], "<i8").tobytes()
    (tmp_path / "t" / ssd_log.LOG_DELTA_FILE).write_bytes(encode_record(ssd_log._DELTA_MAGIC, crc, 9, 1, body))
    with pytest.raises(CorruptStoreError, match="slot"):
        LogSSDTier(tmp_path / "t", 100, 64)


def test_an_unreadable_slot_map_is_a_typed_error(tmp_path: Path) -> None:
    """slots.bin that cannot be read (here a directory: EISDIR) fails open with TierIOError, not a raw
    OSError from sizing the slab."""
    LogSSDTier(tmp_path / "t", 100, 64).close()
    (tmp_path / "t" / ssd.LOG_MAP_FILE).unlink()
    (tmp_path / "t" / ssd.LOG_MAP_FILE).mkdir()
    with pytest.raises(TierIOError) as ei:
        LogSSDTier(tmp_path / "t", 100, 64)
    assert ei.value.errno == errno.EISDIR and ei.value.tier == "ssd"


def test_spare_share_is_read_back_from_the_slot_map(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A slab keeps the spare it was created with, whatever SPARE_SHARE is when it is reopened."""
    tier = LogSSDTier(tmp_path / "t", 100_000, 64)
    ids = np.arange(0, 100_000, 3, dtype=np.int64)
    tier.put(ids, rows_for(ids, 64, 1))
    blocks = tier.num_blocks
    tier.close()
    monkeypatch.setattr(ssd_log, "SPARE_SHARE", 0.5)
    again = LogSSDTier(tmp_path / "t", 100_000, 64)
    assert again.num_blocks == blocks
    check_all(again, {int(i): r for i, r in zip(ids, rows_for(ids, 64, 1))})
    again.close()
    fresh = LogSSDTier(tmp_path / "new", 100_000, 64)
    assert fresh.num_blocks > blocks  # a new slab takes the new share
    fresh.close()


def test_layouts_do_not_open_each_other(tmp_path: Path) -> None:
    LogSSDTier(tmp_path / "log", 100, 64).close()
    SSDTier(tmp_path / "inplace", 100, 64).close()
    with pytest.raises(CorruptStoreError, match="log"):
        SSDTier(tmp_path / "log", 100, 64)
    with pytest.raises(CorruptStoreError, match="in place"):
        LogSSDTier(tmp_path / "inplace", 100, 64)


def _fail_writes(monkeypatch: pytest.MonkeyPatch, err: int, after: int = 0) -> None:
    real = io_engine._uring_kernel
    calls = [0]

    def fake(ring, fd, opcode, offs, addrs, lens, qd, res):  # type: ignore[no-untyped-def]
        if opcode == io_engine._IORING_OP_WRITE:
            calls[0] += 1
            if calls[0] > after:
                res[:] = -err
                return 0
        return real(ring, fd, opcode, offs, addrs, lens, qd, res)

    monkeypatch.setattr(io_engine, "_uring_kernel", fake)


@pytest.mark.parametrize("err,cls", [(errno.EIO, TierIOError), (errno.ENOSPC, DiskFullError)])
@pytest.mark.parametrize("during", ["append", "cleaning"])
def test_write_fault_leaves_the_map_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int,
                                              cls: type, during: str) -> None:
    tier = LogSSDTier(tmp_path / "t", 2000, 200)
    ids = np.arange(2000, dtype=np.int64)
    tier.put(ids, rows_for(ids, 200, 1))
    tier.flush()
    model = {int(i): r for i, r in zip(ids, rows_for(ids, 200, 1))}
    if during == "append":
        _fail_writes(monkeypatch, err)
    else:  # the fault starts when the cleaner does, so it hits the cleaner's own writes
        real_clean = tier._clean

        def failing_clean() -> bool:
            _fail_writes(monkeypatch, err)
            return real_clean()
        monkeypatch.setattr(tier, "_clean", failing_clean)
    with pytest.raises(cls) as ei:
        for v in range(2, 10_000):
            part = np.sort(np.random.default_rng(v).choice(2000, 100, replace=False))
            tier.put(part, rows_for(part, 200, v))
            model.update(zip(part.tolist(), rows_for(part, 200, v)))
    assert ei.value.tier == "ssd" and ei.value.errno == err
    assert tier.cleaned_blocks == 0  # no cleaning round completed
    monkeypatch.undo()
    check_all(tier, model)  # nothing the failed call wrote is visible
    some = ids[::7]
    tier.put(some, rows_for(some, 200, 1000))  # and the tier keeps working
    model.update(zip(some.tolist(), rows_for(some, 200, 1000)))
    tier.close()
    again = LogSSDTier(tmp_path / "t", 2000, 200)
    check_all(again, model)
    again.close()


def test_store_config_layout(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tiers.layout"):
        TierConfig("ssd", layout="append")
    with pytest.raises(ConfigError, match="tiers.layout"):
        TierConfig("rocksdb", layout="log")
    cfg = TableConfig("t", 5000, 8, tiers=(TierConfig("dram", 40 * 100, "lru"), TierConfig("ssd", layout="log")))
    assert TierConfig.from_dict(cfg.tiers[-1].to_dict()).layout == "log"
    ids = np.arange(5000, dtype=np.int64)
    rows = np.random.default_rng(0).standard_normal((5000, 8)).astype(np.float32)
    with embstore.create(tmp_path / "s", StoreConfig((cfg,))) as store:
        store["t"].update(ids, rows)
        assert isinstance(store["t"].hierarchy.home, LogSSDTier)
    with embstore.open(tmp_path / "s") as store:  # the layout is part of the saved config
        assert isinstance(store["t"].hierarchy.home, LogSSDTier)
        np.testing.assert_array_equal(store["t"].lookup(ids), rows)


CHILD = r"""
import sys, numpy as np
sys.path.insert(0, {tests!r})
from test_tier_ssd_log import rows_for
from embstore.tiers import ssd_log
ssd_log.MIN_SPARE_BLOCKS = 8
tier = ssd_log.LogSSDTier(sys.argv[1], {rows}, {rb}, queue_depth=8)
step = 0
while True:
    ids = np.random.default_rng(step).choice({rows}, {per}, replace=False).astype(np.int64)
    tier.put(ids, rows_for(ids, {rb}, step))
    if step % 4 == 3:
        tier.flush()
        print(f"{{step}} {{tier.cleaned_blocks}}", flush=True)
    step += 1
"""


@pytest.mark.parametrize("trial", range(3))
def test_crash_while_overwriting_and_cleaning(tmp_path: Path, trial: int) -> None:
    """SIGKILL a child that overwrites random rows (the cleaner busy): every row reads exactly as of the
    last acknowledged flush or as a later write of it, never torn."""
    rows, rb, per = 400, 1000, 60  # 4 rows per block, 100 blocks + 8 spare
    code = CHILD.format(tests=str(Path(__file__).parent), rows=rows, rb=rb, per=per)
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "t")], stdout=subprocess.PIPE, text=True)
    rng = random.Random(trial)
    want, acks = rng.randint(3, 15), []
    deadline = time.monotonic() + 60
    while len(acks) < want and time.monotonic() < deadline:
        line = child.stdout.readline()
        if not line:
            break
        acks.append([int(x) for x in line.split()])
    time.sleep(rng.random() * 0.03)
    os.kill(child.pid, signal.SIGKILL)
    rest, _ = child.communicate()
    acks += [[int(x) for x in line.split()] for line in whole_lines(rest)]
    assert acks, "the child never completed a flush"
    last, _ = acks[-1]
    if last >= 15:
        assert acks[-1][1] > 0, "the cleaner should have run by then"
    writes: dict[int, list[int]] = {}
    for step in range(last + 200):
        for i in np.random.default_rng(step).choice(rows, per, replace=False).tolist():
            writes.setdefault(i, []).append(step)
    saved = ssd_log.MIN_SPARE_BLOCKS
    ssd_log.MIN_SPARE_BLOCKS = 8
    try:
        tier = LogSSDTier(tmp_path / "t", rows, rb, queue_depth=8)
    finally:
        ssd_log.MIN_SPARE_BLOCKS = saved
    got, found = tier.get(np.arange(rows, dtype=np.int64))
    for i in range(rows):
        acked = [s for s in writes.get(i, []) if s <= last]
        if not acked:
            continue
        assert found[i], f"row {i} lost"
        later = [s for s in writes[i] if s >= acked[-1]]
        assert any(np.array_equal(got[i], rows_for(np.array([i]), rb, s)[0]) for s in later), f"row {i} torn or old"
    tier.close()
