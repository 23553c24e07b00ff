"""Whole-file replacement: the old file or the new one, never a torn one, and errors that name the target."""

from __future__ import annotations

import os

import numpy as np
import pytest

from embstore import traces
from embstore.atomic import atomic_file, atomic_write


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
