"""The store's own metadata under crashes and failed writes: ``create``, ``create_table`` and
``ensure_state_dim`` write several files; a crash between any two of them, or a write that fails, must
leave a store that opens (or, for ``create``, a path a second ``create`` takes) with every row
acknowledged before intact.

A crash is simulated by copying the store directory before every file-system step an operation takes
(``os.mkdir``, ``os.replace``, ``os.unlink``, ``os.fsync``, ...): a copy is exactly what a SIGKILL at
that moment leaves, since the page cache outlives the process. One subprocess test checks the same with
a real process exit between the config and the manifest.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

import embstore
import embstore.store
from embstore.config import StoreConfig, TableConfig, TierConfig
from embstore.hashing import LearnedHash
from homes import home_tier

DIM = 4
ROWS = 300
IDS = np.array([0, 5, 77, 299], np.int64)
_STEPS = ("mkdir", "rename", "replace", "unlink", "rmdir", "fsync", "ftruncate")


@contextmanager
def crash_images(store_dir: Path, out: Path) -> Iterator[list[Path]]:
    """Copies of ``store_dir`` taken before each file-system step made inside the block and once after
    it; a missing copy stands for a directory that did not exist yet."""
    images: list[Path] = []
    real = {name: getattr(os, name) for name in _STEPS}
    busy = False

    last: list[tuple[str, bytes]] | None = None

    def snapshot() -> None:
        nonlocal busy, last
        state = _contents(store_dir)
        if busy or state == last:  # the copy's own mkdirs; a step that changed nothing (an fsync)
            return
        busy, last = True, state
        try:
            dst = out / f"{len(images):03d}"
            if store_dir.exists():
                shutil.copytree(store_dir, dst, symlinks=True)
            images.append(dst)
        finally:
            busy = False

    def step(name: str):
        def run(*args, **kwargs):
            snapshot()
            return real[name](*args, **kwargs)
        return run

    for name in _STEPS:
        setattr(os, name, step(name))
    try:
        yield images
    finally:
        for name, fn in real.items():
            setattr(os, name, fn)
    snapshot()


def slow(*homes: str) -> list:
    """Homes whose crash images are checked only in the slow suite (each image is reopened and used)."""
    return [pytest.param(h, marks=pytest.mark.slow) for h in homes]


def _contents(root: Path) -> list[tuple[str, bytes]]:
    """Every path under ``root`` with its bytes (b"" for a folder), in order."""
    return [(str(f.relative_to(root)), f.read_bytes() if f.is_file() else b"") for f in sorted(root.rglob("*"))]


def table_cfg(name: str, home: str, **kw) -> TableConfig:
    return TableConfig(name, ROWS, DIM, tiers=(TierConfig("dram", 16 * DIM * 4, "lru"), home_tier(home)), **kw)


def learned(tmp_path: Path) -> dict:
    """A learned-hash config whose mapping file lies outside the store (create_table copies it in)."""
    trace = np.random.default_rng(0).zipf(1.3, 3000).astype(np.int64) * 7919
    LearnedHash.fit(trace, ROWS).save(tmp_path / "u.ehash")
    return {"kind": "learned", "mapping": str(tmp_path / "u.ehash")}


def store_with_rows(path: Path, home: str) -> np.ndarray:
    """A store with table ``t`` whose rows IDS were written and flushed; returns those rows."""
    rows = np.arange(len(IDS) * DIM, dtype=np.float32).reshape(-1, DIM) + 1
    with embstore.create(path, StoreConfig((table_cfg("t", home),))) as store:
        store["t"].update(IDS, rows)
    return rows


def check_and_use(image: Path, t_rows: np.ndarray, want_u: set[int | None], u_cfg: TableConfig) -> None:
    """``image`` opens with ``t`` intact and ``u`` absent (None) or with one of ``want_u``'s state_dims;
    ``u`` can then be made (again) with 2 state columns, written and read back after a reopen."""
    with embstore.open(image) as s:
        np.testing.assert_array_equal(s["t"].lookup(IDS), t_rows)
        assert set(s.tables) <= {"t", "u"}
        assert (s["u"].format.state_dim if "u" in s else None) in want_u, image
        if "u" not in s:
            s.create_table(u_cfg)  # the name is free: no debris of the interrupted call blocks it
        u = s.ensure_state_dim("u", 2)
        u.write_with_state(np.array([3], np.int64), np.full((1, DIM), 7.0, np.float32), np.ones((1, 2), np.float32))
    with embstore.open(image) as s:
        vals, state = s["u"].read_with_state(np.array([3], np.int64))
        assert (vals == 7.0).all() and (state == 1.0).all()
        np.testing.assert_array_equal(s["t"].lookup(IDS), t_rows)


@pytest.mark.parametrize("home", ["ssd", *slow("ssd-log", "rocksdb", "mmap")])
def test_a_crash_anywhere_in_create_table_leaves_a_store_that_opens(tmp_path, home: str) -> None:
    path = tmp_path / "s"
    t_rows = store_with_rows(path, home)
    u_cfg = table_cfg("u", home, hash=learned(tmp_path))
    with embstore.open(path) as store, crash_images(path, tmp_path / "img") as images:
        store.create_table(u_cfg)
    assert len(images) > 5
    for image in images:
        check_and_use(image, t_rows, {None, 0}, u_cfg)


@pytest.mark.parametrize("home", ["rocksdb", *slow("ssd", "ssd-log", "mmap")])
def test_a_crash_anywhere_in_ensure_state_dim_leaves_a_store_that_opens(tmp_path, home: str) -> None:
    path = tmp_path / "s"
    t_rows = store_with_rows(path, home)
    u_cfg = table_cfg("u", home, hash=learned(tmp_path))
    with embstore.open(path) as store:
        store.create_table(u_cfg)
    with embstore.open(path) as store, crash_images(path, tmp_path / "img") as images:
        store.ensure_state_dim("u", 1)
    assert len(images) > 3
    for image in images:
        check_and_use(image, t_rows, {0, 1}, u_cfg)


@pytest.mark.parametrize("home", ["ssd", *slow("rocksdb")])
def test_a_crash_anywhere_in_create_leaves_a_store_or_a_path_create_takes_again(tmp_path, home: str) -> None:
    cfg = StoreConfig((table_cfg("t", home), table_cfg("u", home, hash=learned(tmp_path))))
    path = tmp_path / "s"
    with crash_images(path, tmp_path / "img") as images:
        embstore.create(path, cfg).close()
    assert len(images) > 5
    reopened = 0
    for image in images:
        try:
            store = embstore.open(image)
            reopened += 1
        except embstore.StoreNotFoundError:
            store = embstore.create(image, cfg)  # nothing was acknowledged: creating it again is the repair
        with store:
            assert sorted(store.tables) == ["t", "u"]
            store["t"].update(IDS[:1], np.ones((1, DIM), np.float32))
        with embstore.open(image) as store:
            assert (store["t"].lookup(IDS[:1]) == 1.0).all()
    assert 0 < reopened < len(images)


def test_a_real_exit_between_config_and_manifest_leaves_a_store_that_opens(tmp_path) -> None:
    """The child dies (os._exit, no cleanup) right after create_table's config write."""
    path = tmp_path / "s"
    t_rows = store_with_rows(path, "ssd")
    script = textwrap.dedent(f"""
        import os
        import embstore, embstore.store
        from embstore.config import TableConfig, TierConfig
        real = embstore.store.atomic_write
        def die_after_config(target, data):
            real(target, data)
            if target.name == "config.toml":
                os._exit(3)
        embstore.store.atomic_write = die_after_config
        store = embstore.open({str(path)!r})
        store.create_table(TableConfig("u", {ROWS}, {DIM}, tiers=(TierConfig("ssd"),)))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stderr
    check_and_use(path, t_rows, {None, 0}, TableConfig("u", ROWS, DIM, tiers=(TierConfig("ssd"),)))


def _fail_manifest_writes(monkeypatch) -> None:
    """Make writing manifest.json fail with ENOSPC. A mock: a real full disk cannot be aimed at the second
    of two sub-page writes (tmpfs frees the old config's page as the new one replaces it)."""
    real = embstore.store.atomic_write

    def write(target, data):
        if Path(target).name == "manifest.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(target))
        real(target, data)

    monkeypatch.setattr(embstore.store, "atomic_write", write)


def test_a_create_table_whose_manifest_write_fails_leaves_no_table_behind(tmp_path, monkeypatch) -> None:
    path = tmp_path / "s"
    t_rows = store_with_rows(path, "ssd")
    config_before = (path / "config.toml").read_bytes()
    u_cfg = table_cfg("u", "ssd", hash=learned(tmp_path))
    with embstore.open(path) as store:
        _fail_manifest_writes(monkeypatch)
        with pytest.raises(embstore.DiskFullError, match="manifest.json"):
            store.create_table(u_cfg)
        monkeypatch.undo()
        assert "u" not in store and (path / "config.toml").read_bytes() == config_before
        assert not (path / "tables" / "u").exists()
        store["t"].update(IDS[:1], np.full((1, DIM), 9.0, np.float32))  # the store goes on
    t_rows[0] = 9.0
    check_and_use(path, t_rows, {None}, u_cfg)


def test_an_ensure_state_dim_whose_manifest_write_fails_keeps_the_table_usable(tmp_path, monkeypatch) -> None:
    path = tmp_path / "s"
    t_rows = store_with_rows(path, "ssd")
    u_cfg = table_cfg("u", "ssd", hash=learned(tmp_path))
    with embstore.open(path) as store:
        store.create_table(u_cfg)
        _fail_manifest_writes(monkeypatch)
        with pytest.raises(embstore.DiskFullError, match="manifest.json"):
            store.ensure_state_dim("u", 2)
        monkeypatch.undo()
        assert store["u"].format.state_dim == 0
        store["u"].update(np.array([1], np.int64), np.full((1, DIM), 4.0, np.float32))
    with embstore.open(path) as store:
        assert store["u"].format.state_dim == 0 and (store["u"].lookup(np.array([1], np.int64)) == 4.0).all()
        np.testing.assert_array_equal(store["t"].lookup(IDS), t_rows)


def test_a_table_added_to_config_by_hand_is_adopted_and_its_layout_recorded(tmp_path, caplog) -> None:
    path = tmp_path / "s"
    t_rows = store_with_rows(path, "ssd")
    added = StoreConfig((table_cfg("t", "ssd"), TableConfig("h", 50, 3, tiers=(TierConfig("rocksdb"),))))
    (path / "config.toml").write_text(added.to_toml())
    with caplog.at_level(logging.WARNING, logger="embstore.store"), embstore.open(path) as store:
        assert sorted(store.tables) == ["h", "t"]
        store["h"].update(np.array([2], np.int64), np.full((1, 3), 5.0, np.float32))
        np.testing.assert_array_equal(store["t"].lookup(IDS), t_rows)
    assert any("'h'" in r.getMessage() and "manifest" in r.getMessage() for r in caplog.records)
    with embstore.open(path) as store:
        assert (store["h"].lookup(np.array([2], np.int64)) == 5.0).all()
    (path / "config.toml").write_text(added.to_toml().replace("dim = 3", "dim = 6"))
    with pytest.raises(embstore.CorruptStoreError, match="another layout"):  # the entry was recorded
        embstore.open(path)
