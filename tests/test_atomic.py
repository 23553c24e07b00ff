"""Whole-file replacement: the old file or the new one, never a torn one, and errors that name the target."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from embstore import traces
from embstore.atomic import atomic_file, atomic_write

from faultfs import needs_mount


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path) -> None:
    target = tmp_path / "f.bin"
    atomic_write(target, b"old")
    with pytest.raises(RuntimeError, match="mid-write"):
        with atomic_file(target) as f:
            f.write(b"half of the new")
            raise RuntimeError("mid-write")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["f.bin"]
    atomic_write(target, b"new")
    assert target.read_bytes() == b"new" and os.listdir(tmp_path) == ["f.bin"]


def test_a_missing_directory_is_reported_by_the_target_name(tmp_path) -> None:
    target = tmp_path / "no" / "such" / "t.npz"
    tr = traces.Trace(np.arange(4), np.zeros(4, np.int32), np.array([0, 4]))
    with pytest.raises(FileNotFoundError) as e:
        traces.save(tr, target)
    assert e.value.filename == str(target) and ".tmp" not in str(e.value)


def test_target_that_is_a_directory_is_named_not_the_temp(tmp_path) -> None:
    (tmp_path / "d").mkdir()
    with pytest.raises(IsADirectoryError) as e:
        atomic_write(tmp_path / "d", b"x")
    assert e.value.filename == str(tmp_path / "d") and ".tmp" not in str(e.value)
    assert os.listdir(tmp_path) == ["d"] and os.listdir(tmp_path / "d") == []


def test_threads_writing_one_target_never_fail_or_tear_it(tmp_path) -> None:
    """The temp name was per process only: two threads shared one temp file, so writes failed
    (FileNotFoundError when the other thread had already renamed it) or landed in the live file."""
    import threading

    target = tmp_path / "f.bin"
    errors: list[BaseException] = []
    seen: set[bytes] = set()

    def writer(c: int) -> None:
        for _ in range(150):
            try:
                atomic_write(target, bytes([c]) * (1 << 15))
            except BaseException as exc:  # noqa: BLE001 - collected for the assertion below
                errors.append(exc)

    def reader() -> None:
        for _ in range(300):
            try:
                data = target.read_bytes()
            except FileNotFoundError:
                continue
            seen.add(data if len(set(data)) != 1 else data[:1] * (len(data) == 1 << 15))

    threads = [threading.Thread(target=writer, args=(c,)) for c in (65, 66)] + [threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and seen <= {b"A", b"B"}  # every read saw one whole file
    assert target.read_bytes() in (b"A" * (1 << 15), b"B" * (1 << 15))
    assert os.listdir(tmp_path) == ["f.bin"]


@needs_mount
def test_a_full_disk_keeps_the_old_file_and_leaves_no_temp(tiny_tmpfs) -> None:
    target = tiny_tmpfs.path / "f.bin"
    atomic_write(target, b"old")
    with pytest.raises(OSError) as e:
        atomic_write(target, b"x" * (8 << 20))  # twice the 4 MiB file system
    assert e.value.errno == errno.ENOSPC
    assert target.read_bytes() == b"old" and os.listdir(tiny_tmpfs.path) == ["f.bin"]
    tr = traces.Trace(np.arange(1 << 20), np.zeros(1 << 20, np.int32), np.array([0, 1 << 20]))
    with pytest.raises(OSError):
        traces.save(tr, tiny_tmpfs.path / "f.bin")
    assert target.read_bytes() == b"old" and os.listdir(tiny_tmpfs.path) == ["f.bin"]


@needs_mount
def test_a_full_disk_inside_the_callers_block_names_the_target(tiny_tmpfs) -> None:
    """A write in the caller's block, or atomic_file's own flush and fsync, fail without a file name; the
    error must name the target (a full disk's one line then says which file could not be written)."""
    target = tiny_tmpfs.path / "f.bin"
    with pytest.raises(OSError) as e:
        with atomic_file(target) as f:
            f.write(b"x" * (8 << 20))  # twice the 4 MiB file system; buffered: may fail here or at flush
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(target)
    tr = traces.Trace(np.arange(1 << 20), np.zeros(1 << 20, np.int32), np.array([0, 1 << 20]))
    with pytest.raises(OSError) as e:
        traces.save(tr, target)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(target)
    assert os.listdir(tiny_tmpfs.path) == []


def test_an_error_that_names_its_own_file_keeps_that_name(tmp_path) -> None:
    """Only nameless errors get the target's name: one about another file the block reads stays as it is."""
    with pytest.raises(FileNotFoundError) as e:
        with atomic_file(tmp_path / "out.bin") as f:
            f.write(open(tmp_path / "missing.bin", "rb").read())
    assert e.value.filename == str(tmp_path / "missing.bin")
    assert os.listdir(tmp_path) == []
