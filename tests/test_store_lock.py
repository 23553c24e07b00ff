"""One open Store per store directory: a second open, in this process or another, is refused.

Without the lock a second process (``embstore stats`` beside a server) replayed and deleted the first
one's write-ahead log under it; the first kept appending to the deleted segment, so a write it had
acknowledged was gone after a crash. Real processes and files throughout.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import embstore
from embstore.config import StoreConfig, TableConfig, TierConfig
from embstore.store import CREATING_FILE, LOCK_FILE, _lock_store

DIM = 4
CONFIG = StoreConfig((TableConfig("t", 100, DIM, tiers=(TierConfig("dram", 16 * DIM * 4, "lru"),
                                                        TierConfig("ssd"))),))


def row(value: float) -> np.ndarray:
    return np.full((1, DIM), value, np.float32)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from embstore.cli import main; raise SystemExit(main())", *args],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture()
def store_path(tmp_path):
    embstore.create(tmp_path / "s", CONFIG).close()
    return tmp_path / "s"


def test_a_second_open_in_this_process_is_refused_until_the_first_closes(store_path) -> None:
    s = embstore.open(store_path)
    with pytest.raises(embstore.StoreInUseError, match="is open elsewhere"):
        embstore.open(store_path)
    s["t"].update(np.array([3]), row(3.0))  # the refused open touched nothing
    s.close()
    with embstore.open(store_path) as again:
        assert again["t"].lookup(np.array([3]))[0, 0] == 3.0


def test_a_store_being_created_cannot_be_opened_or_created_again(tmp_path) -> None:
    s = embstore.create(tmp_path / "s", CONFIG)
    with pytest.raises(embstore.StoreInUseError):
        embstore.open(tmp_path / "s")
    s.close()


def test_another_process_cannot_open_a_served_store_and_delete_its_log(store_path) -> None:
    """The audit's scenario: a CLI verb on a store a server holds, then an acknowledged write, then a crash."""
    with embstore.open(store_path) as s:
        s.update_logged("t", np.array([5]), row(5.0))
        s.sync_log()
        for verb in (["stats", str(store_path)], ["export", str(store_path), "t", str(store_path.parent / "x.npy")]):
            r = cli(*verb)
            assert r.returncode == 2, r.stderr
            assert "is open elsewhere" in r.stderr
        assert sorted(p.name for p in (store_path / "wal").iterdir()) == ["00000001.log"]
        s.update_logged("t", np.array([6]), row(6.0))
        s.sync_log()  # acknowledged
        shutil.copytree(store_path, store_path.parent / "crash")  # what a power cut would leave
    with embstore.open(store_path.parent / "crash") as c:
        np.testing.assert_array_equal(c["t"].lookup(np.array([5, 6]))[:, 0], [5.0, 6.0])


def test_the_lock_dies_with_a_killed_process(store_path) -> None:
    script = textwrap.dedent(f"""
        import os, signal, numpy as np, embstore
        s = embstore.open({str(store_path)!r})
        s.update_logged("t", np.array([7]), np.full((1, {DIM}), 7.0, np.float32))
        s.sync_log()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr
    with embstore.open(store_path) as s:  # not refused: the flock went with the process
        assert s["t"].lookup(np.array([7]))[0, 0] == 7.0


def test_a_failed_close_still_releases_the_store(store_path, monkeypatch) -> None:
    s = embstore.open(store_path)
    table = s["t"]
    real_close = table.close

    def fails() -> None:
        real_close()  # the tiers are released, as close_all does, and then the close reports a failure
        raise embstore.TierIOError("ssd", "flush", 5)

    monkeypatch.setattr(table, "close", fails)
    with pytest.raises(embstore.TierIOError):
        s.close()
    embstore.open(store_path).close()


def test_a_failed_open_releases_the_lock(store_path) -> None:
    (store_path / "config.toml").write_text("not = [toml")
    with pytest.raises(embstore.CorruptStoreError):
        embstore.open(store_path)
    fd = _lock_store(store_path)  # free again
    os.close(fd)


def test_create_does_not_clear_the_folder_of_a_create_still_running(tmp_path) -> None:
    """A folder with ``.creating`` is debris only if no create() holds it: a second create() must not
    delete a running one's files."""
    p = tmp_path / "s"
    p.mkdir()
    fd = _lock_store(p)  # the running create()
    (p / CREATING_FILE).touch()
    (p / "tables").mkdir()
    try:
        with pytest.raises(embstore.StoreInUseError):
            embstore.create(p, CONFIG)
        assert (p / CREATING_FILE).exists() and (p / "tables").is_dir()
    finally:
        os.close(fd)
    embstore.create(p, CONFIG).close()  # debris now: cleared and created
    with embstore.open(p) as s:
        assert s["t"].config.num_embeddings == 100


def test_a_folder_holding_only_a_lock_file_is_empty_to_create(tmp_path) -> None:
    p = tmp_path / "s"
    p.mkdir()
    (p / LOCK_FILE).touch()
    embstore.create(p, CONFIG).close()
    with pytest.raises(embstore.StoreExistsError):
        embstore.create(p, CONFIG)


def test_a_new_store_is_published_to_a_running_server_through_a_symlink_and_reload(tmp_path) -> None:
    """The README's way to publish a newly trained store: the served store cannot be opened beside the
    server, so the new one is made in another directory, the served symlink is pointed at it, and a
    reload opens it (taking its lock, after giving up the old one's)."""
    import httpx

    from embstore.server import ServerSettings, create_app
    from embstore.server.testing import ServerThread

    for version, value in (("v1", 1.0), ("v2", 2.0)):
        with embstore.create(tmp_path / version, CONFIG) as s:
            s["t"].update(np.array([4]), row(value))
    served = tmp_path / "current"
    served.symlink_to(tmp_path / "v1")
    app = create_app(ServerSettings(store=served, token="secret", batching=False))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as client:
        def value_of_row_4() -> float:
            r = client.post("/v1/tables/t/lookup", json={"ids": [4]})
            assert r.status_code == 200, r.text
            return r.json()["embeddings"][0][0]

        assert value_of_row_4() == 1.0
        with pytest.raises(embstore.StoreInUseError):
            embstore.open(served)
        (tmp_path / "next").symlink_to(tmp_path / "v2")
        os.replace(tmp_path / "next", served)
        r = client.post("/v1/admin/reload", headers={"Authorization": "Bearer secret"})
        assert r.status_code == 200, r.text
        assert value_of_row_4() == 2.0
        embstore.open(tmp_path / "v1").close()  # the old store was given up
