"""A reload or shutdown whose flush fails (a full disk, EIO) must not lose acknowledged rows.

``POST /v1/admin/reload`` flushes the open store before giving it up. When that
flush fails the reload is refused (``503`` naming the cause) and the old store
goes on serving with its unflushed rows, so that a later flush - the periodic
one, the next reload, shutdown - still saves them once the fault is gone; but
a failed data sync of a home is final, and with durable writes the reload
then goes ahead and its log replays the rows. The faults are real: a full tmpfs (ENOSPC) and ext4 on a shrunk loop device (EIO).
Servers run in process (``ServerThread``, seconds faster to start) where a copy
of the store taken while it runs stands for what a SIGKILL would leave, and as
an ``embstore serve`` subprocess where the disk must be repaired after a kill.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest

import embstore
from embstore.errors import DiskFullError
from embstore.server import ServerSettings, create_app
from embstore.server.testing import ServerThread
from faultfs import Tmpfs, needs_mount
from test_server_durability import N, check_rows, lookup, make_store, put, read_store, serve

WRITTEN = np.arange(0, N, 3)


def fill(fs: Path) -> Path:
    """Take every free block of the file system at ``fs``; returns the file to delete to free them."""
    st = os.statvfs(fs)
    filler = fs / "filler"
    filler.write_bytes(b"\0" * (st.f_bavail * st.f_frsize))
    return filler


@contextmanager
def full_disk_store(tmp_path: Path) -> Iterator[tuple[Path, np.ndarray]]:
    """A store on an 8 MiB tmpfs (one table, an mmap home under a DRAM cache of every row, so written rows
    stay dirty in memory until a flush) -> (its path, its initial rows)."""
    fs = Tmpfs(tmp_path / "fs", 8 << 20)
    try:
        yield fs.path / "s", make_store(fs.path / "s", "mmap", cache_rows=N)
    finally:
        fs.unmount()


@contextmanager
def in_process(path: Path, **settings: object) -> Iterator[tuple[object, httpx.Client]]:
    """(the app, a client of it) served by uvicorn in this process; stopping it flushes, like SIGTERM."""
    app = create_app(ServerSettings(store=path, **settings))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        yield app, c


def crash_image(path: Path, scratch: Path) -> np.ndarray:
    """The rows a SIGKILL now would leave: a copy of the open store, opened (its log replayed)."""
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(path, scratch)
    return read_store(scratch)


def expect_refused(c: httpx.Client, cause: str) -> None:
    """A reload answered 503 naming ``cause``, and the old store still serving its unflushed rows."""
    resp = c.post("/v1/admin/reload")
    assert (lookup(c, WRITTEN) == 1.5).all(), f"the reload ({resp.status_code} {resp.text}) lost the rows"
    assert resp.status_code == 503, resp.text
    assert "reload refused, still serving" in resp.json()["detail"] and cause in resp.json()["detail"], resp.text
    assert c.get("/healthz").status_code == 200


def wait_flushed(path: Path, scratch: Path, want: np.ndarray, timeout: float = 30) -> None:
    """Poll crash images of the store until they hold ``want``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if np.array_equal(crash_image(path, scratch), want):
                return
        except embstore.EmbstoreError:  # copied in the middle of a flush: try again
            pass
        assert time.monotonic() < deadline, "the periodic flush did not save the rows once space was back"
        time.sleep(0.1)


@needs_mount
@pytest.mark.parametrize("durable", [False, True], ids=["no-durable-writes", "durable-writes"])
def test_a_reload_on_a_full_disk_is_refused_and_keeps_serving_the_unflushed_rows(tmp_path, durable):
    """Without durable writes the rows live only in the old store's memory; with them the reopen's log
    replay would fail on the same full disk and leave no store open. Either way: 503, lookups go on with
    the rows, and a reload once space is back flushes them (a crash right after keeps them)."""
    with full_disk_store(tmp_path) as (path, initial), in_process(path, durable_writes=durable,
                                                                  flush_interval=0) as (_, c):
        assert put(c, WRITTEN, 1.5).status_code == 204
        filler = fill(path.parent)
        expect_refused(c, "No space left")
        expect_refused(c, "No space left")  # and again: the refusal left the old store intact
        filler.unlink()
        resp = c.post("/v1/admin/reload")
        assert resp.status_code == 200 and resp.json()["reloads"] == 1, resp.text
        assert (lookup(c, WRITTEN) == 1.5).all()
        check_rows(crash_image(path, tmp_path / "crash"), initial, dict.fromkeys(WRITTEN.tolist(), 1.5),
                   {i: {1.5} for i in WRITTEN.tolist()})


@needs_mount
def test_a_reload_while_the_periodic_flush_fails_is_refused_and_the_next_flush_saves_the_rows(tmp_path, caplog):
    """--no-durable-writes, flushing every 50 ms onto a full disk: the periodic flushes fail (the store
    stays dirty), a reload arriving meanwhile is refused instead of dropping the rows, and once space is
    back the periodic flush - no reload, no shutdown - makes them durable."""
    with full_disk_store(tmp_path) as (path, initial), in_process(path, durable_writes=False,
                                                                  flush_interval=0.05) as (_, c):
        filler = fill(path.parent)
        assert put(c, WRITTEN, 1.5).status_code == 204
        deadline = time.monotonic() + 30
        while "periodic flush failed" not in caplog.text:
            assert time.monotonic() < deadline, "no periodic flush failed on the full disk"
            time.sleep(0.02)
        expect_refused(c, "No space left")
        filler.unlink()
        want = initial.copy()
        want[WRITTEN] = 1.5
        wait_flushed(path, tmp_path / "crash", want)


def test_a_reload_on_a_failing_disk_keeps_the_rows_in_the_log(tmp_path, failing_ext4):
    """EIO (ext4 on a loop device shrunk under it) from the mmap home's msync: a failed sync is final
    (tests/test_sync_failure.py), so with durable writes the reload goes ahead, and its reopen fails while
    the disk does (503 saying so; or 409 when the pre-check cannot even read the store, which depends on
    what the page cache still holds); the server is killed, the disk replaced by an image of it, and the next
    open replays the acknowledged rows from the write-ahead log."""
    path = failing_ext4.path / "s"
    initial = make_store(path, "mmap", cache_rows=N)
    proc, url = serve(path, "--flush-interval", "0", log=tmp_path / "log")
    try:
        with httpx.Client(base_url=url, timeout=30) as c:
            assert put(c, WRITTEN, 1.5).status_code == 204
            failing_ext4.start_failing(keep=1 << 20)
            resp = c.post("/v1/admin/reload")  # 409 when the pre-check's read of the store already fails
            detail, expected = resp.json()["detail"], {409: "cannot be read", 503: "could not be reopened"}
            assert resp.status_code in expected and expected[resp.status_code] in detail, resp.text
            assert "EIO" in detail or "Input/output error" in detail, resp.text
    finally:
        proc.kill()
        proc.wait(30)
    failing_ext4.repair()
    check_rows(read_store(path), initial, dict.fromkeys(WRITTEN.tolist(), 1.5), {i: {1.5} for i in WRITTEN.tolist()})


@needs_mount
def test_a_shutdown_whose_flush_fails_without_durable_writes_says_rows_are_lost(tmp_path, caplog):
    """Shutdown cannot keep serving: with --no-durable-writes the unflushed rows die with the process.
    The failure is raised (``embstore serve`` exits 1) and the log says that rows were lost, not just
    which call failed; what is on disk is whole (each row old or new)."""
    with full_disk_store(tmp_path) as (path, initial):
        with in_process(path, durable_writes=False, flush_interval=0) as (app, c):
            assert put(c, WRITTEN, 1.5).status_code == 204
            filler = fill(path.parent)
        assert isinstance(app.state.shutdown_error, DiskFullError)
        assert "rows written since the last successful flush are lost" in caplog.text
        filler.unlink()
        check_rows(read_store(path), initial, {}, {i: {1.5} for i in WRITTEN.tolist()})
