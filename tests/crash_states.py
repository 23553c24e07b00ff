"""Checking a tier reopened after SIGKILL against the states its writer saved before each flush.

The writer children in the ssd crash tests save, before flush ``v``, an array of
each row's version (-1: absent) as ``<prefix>.state-<v>.npy`` and print ``v``
once the flush returned. Rows carry their version in their first 4 bytes and
``(id * 7 + version) % 251`` in the rest, so a torn row is visible.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def whole_lines(text: str) -> list[str]:
    """The lines a killed child finished printing: SIGKILL can land between two of print's writes
    (PYTHONUNBUFFERED makes each one a write), leaving a last line without its newline."""
    return [line for line in text.splitlines(keepends=True) if line.endswith("\n")]


def check_against_flushes(states_dir: Path, prefix: str, last_acknowledged: int, out: np.ndarray,
                          found: np.ndarray) -> None:
    """The present rows match a flush at or after the last acknowledged one (a later one may have been
    in flight), no row is older than that flush, and none is torn."""
    states = {int(p.name.split("-")[-1][:-4]): np.load(p) for p in states_dir.glob(f"{prefix}.state-*.npy")}
    candidates = [v for v in states if v >= last_acknowledged]
    matching = [v for v in candidates if np.array_equal(states[v] >= 0, found)]
    assert matching, "present rows match no flush"
    at_flush = states[matching[0]]
    for i in np.flatnonzero(found):
        version = int(np.frombuffer(out[i, :4].tobytes(), np.int32)[0])
        assert version >= at_flush[i], f"row {i} is older than its flush"
        assert (out[i, 4:] == (i * 7 + version) % 251).all(), f"row {i} is torn"
