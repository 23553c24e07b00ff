"""The log layout's promise that a block the committed slot map references is never written (session 10
mutation audit: handing emptied blocks straight back to the free list, before the commit that stops
referencing them, passed every existing test; after a crash the committed map then points at other rows)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from embstore.tiers.ssd import SLAB_FILE
from embstore.tiers.ssd_log import LOG_DELTA_FILE, LOG_MAP_FILE, LogSSDTier

RB, NR = 256, 200  # 16 rows a block


def rows(ids: np.ndarray, version: int) -> np.ndarray:
    return ((ids[:, None] * 7 + version + np.arange(RB)) % 251).astype(np.uint8)


def crash_copy(src: Path, dst: Path) -> Path:
    """The files as they are now (the slab is written with O_DIRECT): what a SIGKILL leaves behind."""
    dst.mkdir()
    for name in (SLAB_FILE, LOG_MAP_FILE, LOG_DELTA_FILE):
        if (src / name).exists():
            shutil.copyfile(src / name, dst / name)
    return dst


def test_rows_read_as_of_the_last_flush_after_a_crash_that_followed_overwrites(tmp_path: Path) -> None:
    tier = LogSSDTier(tmp_path / "t", NR, RB)
    first = np.arange(16, dtype=np.int64)  # exactly one block
    tier.put(first, rows(first, 1))
    tier.flush()
    tier.put(first, rows(first, 2))  # a new block; the flushed one is emptied, still committed
    others = np.arange(16, 48, dtype=np.int64)
    tier.put(others, rows(others, 3))  # must not land in the emptied block before a commit
    copy = crash_copy(tmp_path / "t", tmp_path / "crash")
    tier.close()
    reopened = LogSSDTier(copy, NR, RB)
    got, found = reopened.get(np.arange(48, dtype=np.int64))
    reopened.close()
    assert found[:16].all() and not found[16:].any()
    assert np.array_equal(got[:16], rows(first, 1))
