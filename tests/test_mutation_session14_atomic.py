"""``embstore/atomic.py``: behaviours a hand-made mutation audit of commits a96cc70 (an ``OSError`` in
``atomic_file`` names the target) and e26b14e (``copy_tree_durably``) found unpinned (session 14), and
one bug it found (a tier error raised inside an ``atomic_file`` block turns into a ``TypeError``)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

import embstore
from embstore.atomic import atomic_file, atomic_write, copy_tree_durably
from embstore.bulk import export_rows
from embstore.config import StoreConfig, TableConfig, TierConfig
from embstore.errors import TierIOError


# --- atomic_file: which errors get the target's name -----------------------------------------------
def test_a_failed_fsync_of_the_temp_file_names_the_target(tmp_path, monkeypatch) -> None:
    """Kills: the naming block dropped around the caller's block and the final flush/fsync, or narrowed to
    the caller's block alone. ``os.fsync`` of the written temp file fails (EIO, no file name, as Linux
    reports a lost write-back): the error names the target (not the temp file, not nothing), the old
    file is kept and no temp file is left."""
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")

    def fsync(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError) as e:
        atomic_write(target, b"new")
    assert e.value.errno == errno.EIO and e.value.filename == str(target)
    monkeypatch.undo()
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["f.bin"]


def test_an_oserror_without_an_errno_is_raised_unchanged(tmp_path) -> None:
    """Kills: the ``exc.errno is None`` test dropped from ``_naming``. An ``OSError`` that carries only a
    message (no errno: ``OSError("...")``, ``shutil.SameFileError``) is not rebuilt as
    ``OSError(None, None, target)``, which would lose the message; it propagates as it was raised."""
    raised = OSError("the caller's own message")
    with pytest.raises(OSError) as e:
        with atomic_file(tmp_path / "out.bin") as f:
            f.write(b"x")
            raise raised
    assert e.value is raised and str(e.value) == "the caller's own message"
    assert os.listdir(tmp_path) == []


def test_a_tier_error_inside_the_block_keeps_its_type_and_attributes(tmp_path) -> None:
    """A ``TierIOError`` (an ``OSError`` subclass with its own constructor and no file name) raised inside
    an ``atomic_file`` block - ``export_rows`` reads tier rows inside one - must propagate as that error:
    same class, message and ``final`` flag (the store's "only a reopen recovers" mark). ``_naming`` used to
    rebuild it by calling ``TierIOError(errno, strerror, path)``, and a ``TypeError`` came out."""
    err = TierIOError("ssd", "read", errno.EIO)
    err.final = True
    with pytest.raises(TierIOError) as e:
        with atomic_file(tmp_path / "out.bin") as f:
            f.write(b"x")
            raise err
    assert type(e.value) is TierIOError and str(e.value) == str(err) and e.value.final
    assert os.listdir(tmp_path) == []


def test_export_of_a_table_whose_tier_read_fails_raises_the_tier_error(tmp_path, monkeypatch) -> None:
    """``embstore export`` of a table whose tier read fails (EIO): the CLI answers a ``TierIOError`` with one
    line and exit status 1; the ``TypeError`` that ``_naming`` made of it escaped as a traceback.
    ``export_rows`` must raise the tier's error and leave no output file."""
    cfg = StoreConfig((TableConfig("t", 16, 4, tiers=(TierConfig("dram", 16 * 4 * 4), TierConfig("mmap"))),))
    with embstore.create(tmp_path / "s", cfg) as store:
        table = store["t"]

        def read_physical(ids):
            raise TierIOError("mmap", "read", errno.EIO)

        monkeypatch.setattr(table, "read_physical", read_physical)
        with pytest.raises(TierIOError):
            export_rows(table, tmp_path / "rows.npy")
    assert not (tmp_path / "rows.npy").exists()


# --- copy_tree_durably ------------------------------------------------------------------------------
class SyncRecorder:
    """Inodes ``os.fsync`` was called on (a power cut cannot be caused here: the syscalls are checked)."""

    def __init__(self, monkeypatch) -> None:
        self.synced: list[tuple[int, int]] = []
        real = os.fsync

        def fsync(fd: int) -> None:
            real(fd)
            st = os.fstat(fd)
            self.synced.append((st.st_dev, st.st_ino))

        monkeypatch.setattr(os, "fsync", fsync)


def inode(p: Path) -> tuple[int, int]:
    st = p.stat()
    return st.st_dev, st.st_ino


def test_copy_tree_durably_syncs_every_copied_file_and_folder_and_the_targets_entry(tmp_path, monkeypatch) -> None:
    """Kills: the files' fsync dropped, the folders' fsync dropped, the walk over ``source`` instead of the
    copy, and the final fsync of ``target``'s parent dropped (without it the copy's own directory entry
    may not survive a power cut: the copy is complete but unreachable). Every file and folder of the copy,
    and the folder holding it, is fsynced; the copy equals the source byte for byte."""
    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    (src / "empty").mkdir()
    files = {"top.bin": b"1" * 10, "a/x": b"2" * 5000, "a/b/y": b"", "a/b/z": b"3"}
    for rel, data in files.items():
        (src / rel).write_bytes(data)
    (tmp_path / "dst").mkdir()
    target = tmp_path / "dst" / "copy"
    rec = SyncRecorder(monkeypatch)
    copy_tree_durably(src, target)
    monkeypatch.undo()
    for rel, data in files.items():
        assert (target / rel).read_bytes() == data
    wanted = {p: inode(p) for p in [target, *target.rglob("*")]}
    assert len(wanted) == 1 + len(files) + 3
    assert [p for p, ino in wanted.items() if ino not in rec.synced] == []
    assert inode(tmp_path / "dst") in rec.synced
    assert inode(src) not in rec.synced
