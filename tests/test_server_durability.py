"""The server's durability and lifecycle: crashes, machine failures, reloads and shutdown.

Servers run as ``embstore serve`` subprocesses where a crash (SIGKILL) or a
signal is the point, and in process (``ServerThread``) where a fault must be
injected at one exact call. Expected rows come from a dict of what each
acknowledged PUT wrote; a row is either a value some PUT wrote or its initial
value, never a mix (all of a PUT's values are one number).
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest

import embstore
from embstore.config import StoreConfig, TableConfig, TierConfig
from embstore.errors import DiskFullError, TierIOError
from embstore.server import ServerSettings, create_app
from embstore.server.testing import ServerThread, free_port, wait_healthy
from embstore.wal import WAL_DIR, WriteAheadLog, read_records
from faultfs import Tmpfs, needs_mount

N, DIM = 2000, 8
ALL = np.arange(N, dtype=np.int64)


def make_store(path: Path, home: str = "ssd", cache_rows: int = 64) -> np.ndarray:
    """One table ``t`` (a small LRU DRAM cache over ``home``, so written rows stay dirty in memory);
    returns its initial rows."""
    cfg = StoreConfig((TableConfig("t", N, DIM, tiers=(TierConfig("dram", cache_rows * DIM * 4, "lru"),
                                                       TierConfig(home))),))
    with embstore.create(path, cfg) as store:
        return store["t"].lookup(ALL)


def serve(store: Path, *flags: str, log: Path | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    out = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - the child holds it
    proc = subprocess.Popen([sys.executable, "-m", "embstore.cli", "serve", str(store), "--port", str(port), *flags],
                            stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    return proc, url


def put(client: httpx.Client, ids, value: float) -> httpx.Response:
    ids = [int(i) for i in ids]
    return client.put("/v1/tables/t/rows", json={"ids": ids, "embeddings": [[value] * DIM] * len(ids)})


def lookup(client: httpx.Client, ids) -> np.ndarray:
    resp = client.post("/v1/tables/t/lookup", json={"ids": [int(i) for i in ids]})
    assert resp.status_code == 200, resp.text
    return np.array(resp.json()["embeddings"], np.float32).reshape(-1, DIM)


def read_store(path: Path) -> np.ndarray:
    with embstore.open(path) as store:
        return store["t"].lookup(ALL)


def check_rows(got: np.ndarray, initial: np.ndarray, acked: dict[int, float],
               attempted: dict[int, set[float]]) -> None:
    """Every row is whole; an acknowledged row holds its last acknowledged value or a later attempt."""
    for i in range(N):
        row = got[i]
        if np.array_equal(row, initial[i]):
            assert i not in acked, f"row {i}: acknowledged {acked[i]}, read its initial value"
            continue
        assert (row == row[0]).all(), f"row {i} is torn: {row}"
        assert row[0] in attempted.get(i, ()), f"row {i} holds {row[0]}, which no PUT wrote"
        if i in acked:
            assert row[0] >= acked[i], f"row {i}: acknowledged {acked[i]}, read the older {row[0]}"


# --- crashes ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
def test_acknowledged_puts_survive_sigkill_at_a_random_moment(tmp_path, seed):
    """Four writers PUT (values rise per writer, each writer owns its ids) while the server flushes every
    50 ms; a SIGKILL at a random moment - between PUTs, mid-append, mid-sync, mid-flush - then a reopen:
    every acknowledged row is there, the rest old or new, none torn."""
    rnd = random.Random(seed)
    initial = make_store(tmp_path / "s")
    proc, url = serve(tmp_path / "s", "--flush-interval", "0.05")
    acked: dict[int, float] = {}
    attempted: dict[int, set[float]] = {}
    lock = threading.Lock()
    enough = threading.Event()

    def writer(k: int) -> None:
        rng = np.random.default_rng(seed * 10 + k)
        with httpx.Client(base_url=url, timeout=30) as c:
            for v in range(1, 10_000):
                ids = rng.choice(N // 4, size=int(rng.integers(1, 20)), replace=False) * 4 + k
                value = float(v * 4 + k)
                with lock:
                    for i in ids:
                        attempted.setdefault(int(i), set()).add(value)
                try:
                    resp = put(c, ids, value)
                except httpx.TransportError:  # killed
                    return
                assert resp.status_code == 204, resp.text
                with lock:
                    acked.update((int(i), value) for i in ids)
                    if len(acked) > 50:
                        enough.set()

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    try:
        for t in threads:
            t.start()
        assert enough.wait(30)
        threading.Event().wait(rnd.uniform(0, 0.5))
    finally:
        proc.kill()
        proc.wait(30)
        for t in threads:
            t.join(30)
    check_rows(read_store(tmp_path / "s"), initial, acked, attempted)
    assert acked


def test_without_durable_writes_a_kill_keeps_what_a_flush_saved(tmp_path):
    """--no-durable-writes: rows are safe once a flush covered them (here: a reload's flush), and the
    rows written after it may be lost (the documented window), but nothing is torn."""
    initial = make_store(tmp_path / "s")
    proc, url = serve(tmp_path / "s", "--no-durable-writes", "--flush-interval", "0")
    try:
        with httpx.Client(base_url=url, timeout=30) as c:
            assert put(c, [1, 2, 3], 1.5).status_code == 204
            assert c.post("/v1/admin/reload").status_code == 200  # flushes and closes the old store
            assert put(c, [3, 4], 2.5).status_code == 204
    finally:
        proc.kill()
        proc.wait(30)
    check_rows(read_store(tmp_path / "s"), initial, {1: 1.5, 2: 1.5, 3: 1.5}, {1: {1.5}, 2: {1.5}, 3: {1.5, 2.5},
                                                                          4: {2.5}})
    assert not (tmp_path / "s" / WAL_DIR).is_dir() or not any((tmp_path / "s" / WAL_DIR).iterdir())


# --- machine failures -------------------------------------------------------------------------------
@needs_mount
def test_a_full_disk_is_507_and_puts_acknowledged_after_it_survive_a_kill(tmp_path):
    """A PUT whose log append hits ENOSPC part-way is answered 507 naming the cause, lookups go on, and
    the partial record is cut off: PUTs acknowledged once space is back (appended after it in the same
    segment) are replayed after a SIGKILL, not hidden behind a torn record."""
    fs = Tmpfs(tmp_path / "fs", 8 << 20)
    try:
        path = fs.path / "s"
        initial = make_store(path, "mmap", cache_rows=N)
        proc, url = serve(path, "--flush-interval", "0", log=tmp_path / "log")
        try:
            with httpx.Client(base_url=url, timeout=30) as c:
                assert put(c, [1], 1.0).status_code == 204
                st = os.statvfs(fs.path)
                (fs.path / "filler").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - 6000))
                resp = put(c, range(100, 400), 2.0)  # a ~10 KB record into ~6 KB of space
                assert resp.status_code == 507 and "No space left" in resp.json()["detail"], resp.text
                assert (lookup(c, [1])[0] == 1.0).all()
                (fs.path / "filler").unlink()
                assert put(c, [3], 3.0).status_code == 204
                assert put(c, [5], 5.0).status_code == 204
        finally:
            proc.kill()
            proc.wait(30)
        got = read_store(path)
        assert (got[[1, 3, 5], 0] == [1.0, 3.0, 5.0]).all()
        check_rows(got, initial, {1: 1.0, 3: 3.0, 5: 5.0},
                   {1: {1.0}, 3: {3.0}, 5: {5.0}, **{i: {2.0} for i in range(100, 400)}})
    finally:
        fs.unmount()


def test_a_failed_append_leaves_no_partial_record(tmp_path, monkeypatch):
    """The log itself: a write that fails after part of a record reached the file is cut back."""
    wal = WriteAheadLog(tmp_path / "wal")
    wal.append("t", np.array([1], np.int64), np.ones((1, DIM), np.float32))
    segment = sorted((tmp_path / "wal").iterdir())[0]
    size = segment.stat().st_size
    real_write = os.write

    def short_then_enospc(fd, data):
        if len(data) > 200:
            return real_write(fd, bytes(data[:100]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", short_then_enospc)
    with pytest.raises(DiskFullError, match="write-ahead log"):
        wal.append("t", np.arange(50, dtype=np.int64), np.ones((50, DIM), np.float32))
    monkeypatch.setattr(os, "write", real_write)
    assert segment.stat().st_size == size
    wal.append("t", np.array([2], np.int64), np.full((1, DIM), 2.0, np.float32))
    wal.close()
    assert [int(ids[0]) for _, ids, _ in read_records(tmp_path / "wal")] == [1, 2]


def test_a_failed_log_sync_is_not_retried_but_made_good_by_a_flush(tmp_path):
    """After an fdatasync error Linux marks the lost pages clean, so a retried sync "succeeds" without
    them and later records sit behind a hole. The fake sync here fails once and zeroes what it should
    have saved; PUTs must then be acknowledged by a flush (which retires the damaged segment), so a
    crash image taken afterwards holds every acknowledged row."""
    initial = make_store(tmp_path / "s")
    synced = {"size": 0, "fail": True}

    def opener(path: Path) -> embstore.Store:
        store = embstore.open(path)
        real = store.sync_log

        def sync_log() -> None:
            segment = max((path / WAL_DIR).glob("*.log"))
            if synced["fail"]:
                synced["fail"] = False
                with open(segment, "r+b") as f:  # the pages the failed writeback lost
                    f.seek(synced["size"])
                    f.write(b"\0" * (segment.stat().st_size - synced["size"]))
                raise TierIOError("write-ahead log", "sync", errno.EIO)
            real()
            synced["size"] = segment.stat().st_size

        store.sync_log = sync_log
        return store

    app = create_app(ServerSettings(store=tmp_path / "s", flush_interval=0), opener=opener)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        assert put(c, [7], 7.0).status_code == 204
        assert put(c, [8], 8.0).status_code == 204
        shutil.copytree(tmp_path / "s", tmp_path / "crash")  # what a SIGKILL or power cut now leaves
        assert (lookup(c, [7, 8])[:, 0] == [7.0, 8.0]).all()
    got = read_store(tmp_path / "crash")
    check_rows(got, initial, {7: 7.0, 8: 8.0}, {7: {7.0}, 8: {8.0}})


def test_a_failed_periodic_flush_is_retried(tmp_path):
    """Without durable writes the periodic flush is all that saves a write: one that fails must not
    forget that the store is dirty (the next ticks flush it again, without waiting for a new write)."""
    make_store(tmp_path / "s")
    calls: list[str] = []
    done = threading.Event()

    def opener(path: Path) -> embstore.Store:
        store = embstore.open(path)
        real = store.flush

        def flush() -> None:
            if not calls:
                calls.append("failed")
                raise DiskFullError("ssd", "flush", errno.ENOSPC)
            real()
            calls.append("ok")
            done.set()

        store.flush = flush
        return store

    app = create_app(ServerSettings(store=tmp_path / "s", durable_writes=False, flush_interval=0.02), opener=opener)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        assert put(c, [3], 3.0).status_code == 204
        assert done.wait(20), calls
        assert calls[:2] == ["failed", "ok"]


def test_a_write_that_fails_part_way_invalidates_the_pooled_cache(tmp_path):
    """A machine failure inside a write may leave part of it applied (rows that landed in a cache
    before a lower tier failed): the pooled cache must not keep serving bags pooled before it."""
    make_store(tmp_path / "s")

    def opener(path: Path) -> embstore.Store:
        store = embstore.open(path)
        table = store["t"]
        real = table.update

        def update(ids, rows):
            real(ids[:1], rows[:1])  # the first row lands, then the disk fails
            raise DiskFullError("ssd", "write", errno.ENOSPC)

        store.update_logged = lambda name, ids, rows: update(ids, rows)
        return store

    app = create_app(ServerSettings(store=tmp_path / "s", flush_interval=0), opener=opener)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        bag = {"ids": [5, 6], "offsets": [0, 2], "mode": "sum"}
        c.post("/v1/tables/t/pooled", json=bag)  # cached
        resp = put(c, [5, 6], 9.0)
        assert resp.status_code == 507 and "ssd" in resp.json()["detail"]
        rows = lookup(c, [5, 6])
        pooled = c.post("/v1/tables/t/pooled", json=bag).json()["embeddings"][0]
        np.testing.assert_allclose(pooled, rows.sum(0), rtol=1e-6)


def test_a_reload_whose_close_fails_still_reopens_the_store(tmp_path, monkeypatch, caplog):
    """The old store's log cannot be sealed (EIO). In the reload's flush that refuses the reload (503, the
    old store keeps serving the row); in the close after a good flush its tables must still be closed
    (their tier locks released), so the reopen - which replays the log - succeeds instead of 503 until a
    restart."""
    make_store(tmp_path / "s", "mmap")  # an mmap home holds a lock on its files while open
    real_seal = WriteAheadLog.seal
    state = {"fail_in": 0}  # which seal from now on fails: 1 = the next one

    def seal(self):
        state["fail_in"] -= 1
        if state["fail_in"] == 0:
            raise TierIOError("write-ahead log", "sync", errno.EIO)
        return real_seal(self)

    monkeypatch.setattr(WriteAheadLog, "seal", seal)
    with ServerThread(create_app(ServerSettings(store=tmp_path / "s", flush_interval=0))) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        assert put(c, [1], 4.0).status_code == 204
        state["fail_in"] = 1  # the reload's flush
        resp = c.post("/v1/admin/reload")
        assert resp.status_code == 503 and "write-ahead log" in resp.json()["detail"], resp.text
        assert (lookup(c, [1]) == 4.0).all()
        state["fail_in"] = 2  # the close, after the reload's flush succeeded
        resp = c.post("/v1/admin/reload")
        assert resp.status_code == 200 and resp.json()["reloads"] == 1, resp.text
        assert "closing" in caplog.text and "before the reload failed" in caplog.text
        assert (lookup(c, [1]) == 4.0).all()
        assert put(c, [2], 5.0).status_code == 204
    assert (read_store(tmp_path / "s")[[1, 2], 0] == [4.0, 5.0]).all()


# --- reload under load ------------------------------------------------------------------------------
def test_reloads_under_concurrent_lookups_pooled_lookups_and_puts(tmp_path):
    """Reloads back to back while writers PUT and read their own rows back (plain and pooled) and readers
    look up: no answer other than 2xx, every acknowledged PUT visible at once and after the server stops,
    no pooled bag older than an acknowledged PUT."""
    initial = make_store(tmp_path / "s")
    app = create_app(ServerSettings(store=tmp_path / "s", flush_interval=0.05))
    stop = threading.Event()
    failures: list[str] = []
    acked: dict[int, float] = {}
    attempted: dict[int, set[float]] = {}
    lock = threading.Lock()
    with ServerThread(app) as srv:
        def writer(k: int) -> None:
            rng = np.random.default_rng(k)
            with httpx.Client(base_url=srv.url, timeout=30) as c:
                for v in range(1, 10_000):
                    if stop.is_set():
                        return
                    ids = rng.choice(25, size=int(rng.integers(1, 5)), replace=False) * 4 + k
                    value = float(v * 4 + k)
                    with lock:
                        for i in ids:
                            attempted.setdefault(int(i), set()).add(value)
                    resp = put(c, ids, value)
                    if resp.status_code != 204:
                        failures.append(f"PUT {resp.status_code} {resp.text}")
                        continue
                    with lock:
                        acked.update((int(i), value) for i in ids)
                    if not (lookup(c, ids) == value).all():
                        failures.append(f"lookup of {ids} after PUT {value}")
                    resp = c.post("/v1/tables/t/pooled", json={"ids": ids.tolist(), "offsets": [0, len(ids)],
                                                               "mode": "sum"})
                    if resp.status_code != 200 or resp.json()["embeddings"][0] != [value * len(ids)] * DIM:
                        failures.append(f"pooled {resp.status_code} {resp.text[:100]} after PUT {value}")

        def reader() -> None:
            rng = np.random.default_rng(99)
            with httpx.Client(base_url=srv.url, timeout=30) as c:
                while not stop.is_set():
                    ids = rng.integers(500, N, 8)
                    if not np.array_equal(lookup(c, ids), initial[ids]):
                        failures.append(f"lookup of unwritten {ids}")
                    resp = c.post("/v1/tables/t/pooled", json={"ids": ids.tolist(), "offsets": [0, 3, 8],
                                                               "mode": "mean"})
                    if resp.status_code != 200:
                        failures.append(f"pooled {resp.status_code} {resp.text}")

        threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)] + [threading.Thread(target=reader)]
        for t in threads:
            t.start()
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            for _ in range(25):
                resp = c.post("/v1/admin/reload")
                if resp.status_code != 200:
                    failures.append(f"reload {resp.status_code} {resp.text}")
        stop.set()
        for t in threads:
            t.join(60)
    assert not failures, failures[:5]
    assert acked and app.state.gate.reloads == 25
    check_rows(read_store(tmp_path / "s"), initial, acked, attempted)


# --- shutdown ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_flushes_empties_the_log_and_exits_0(tmp_path, sig):
    initial = make_store(tmp_path / "s")
    proc, url = serve(tmp_path / "s", "--flush-interval", "0")
    try:
        with httpx.Client(base_url=url, timeout=30) as c:
            assert put(c, range(0, N, 3), 1.5).status_code == 204
    finally:
        proc.send_signal(sig)
        assert proc.wait(60) == 0
    assert not any((tmp_path / "s" / WAL_DIR).iterdir())  # flushed: nothing left to replay
    want = initial.copy()
    want[::3] = 1.5
    assert np.array_equal(read_store(tmp_path / "s"), want)


@needs_mount
def test_a_failed_shutdown_flush_exits_1_and_the_log_keeps_the_rows(tmp_path):
    fs = Tmpfs(tmp_path / "fs", 8 << 20)
    try:
        path = fs.path / "s"
        make_store(path, "mmap", cache_rows=N)
        proc, url = serve(path, "--flush-interval", "0", log=tmp_path / "log")
        try:
            with httpx.Client(base_url=url, timeout=30) as c:
                assert put(c, range(0, N, 3), 1.5).status_code == 204
            st = os.statvfs(fs.path)
            (fs.path / "filler").write_bytes(b"\0" * (st.f_bavail * st.f_frsize))
        finally:
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(60)
        assert rc == 1, (tmp_path / "log").read_text()[-2000:]
        assert "embstore serve: error:" in (tmp_path / "log").read_text()
        (fs.path / "filler").unlink()
        assert (read_store(path)[::3] == 1.5).all()  # replayed from the log
    finally:
        fs.unmount()
