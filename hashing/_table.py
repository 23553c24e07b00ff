"""An open-addressing (linear probing) int64 -> row table as two flat arrays.

Why not ``np.searchsorted`` on sorted ids: a binary search over millions of
ids costs ~20 dependent cache misses per lookup (a few M ids/s); a hash table
costs about one, and two flat arrays save and mmap as they are::

    keys  int64 (capacity,)   the known raw id in each slot
    rows  int32|int64 (capacity,)   its row, or -1 for an empty slot

An id's home slot is ``mix64(id, table_key) % capacity``; a lookup walks
forward (wrapping) until it finds the id or an empty slot. ``capacity`` is
``ceil(n / load_factor)`` and at least ``n + 1``, so every walk ends. Unknown
ids fall back to ``reserved_start + mix64(id, seed_key) % reserved_rows``.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from embstore.hashing._mix import mix64

EMPTY = -1


@njit(cache=True)
def _build(keys, rows, table_key, tkeys, trows):  # pragma: no cover - numba
    cap = np.uint64(tkeys.shape[0])
    for i in range(keys.shape[0]):
        h = np.int64(mix64(keys[i], table_key) % cap)
        while trows[h] != -1:
            h += 1
            if h == tkeys.shape[0]:
                h = 0
        tkeys[h] = keys[i]
        trows[h] = rows[i]


@njit(cache=True)
def lookup_kernel(ids, tkeys, trows, table_key, reserved_start, reserved_rows, seed_key, out):  # pragma: no cover
    """out[i] = row of ids[i] in the table, else its hashed row in the reserved region."""
    cap = np.uint64(tkeys.shape[0])
    n_slots = tkeys.shape[0]
    res = np.uint64(reserved_rows)
    for i in range(ids.shape[0]):
        x = ids[i]
        h = np.int64(mix64(x, table_key) % cap)
        while True:
            r = trows[h]
            if r == -1:
                out[i] = reserved_start + np.int64(mix64(x, seed_key) % res)
                break
            if tkeys[h] == x:
                out[i] = r
                break
            h += 1
            if h == n_slots:
                h = 0


def row_dtype(num_rows: int) -> np.dtype:
    """int32 rows when they fit (smaller mapping), else int64."""
    return np.dtype(np.int32) if num_rows <= 2**31 - 1 else np.dtype(np.int64)


def build_table(keys: np.ndarray, rows: np.ndarray, num_rows: int, table_key: int,
                load_factor: float) -> tuple[np.ndarray, np.ndarray]:
    """Slots for unique ``keys`` -> ``rows``; returns (tkeys, trows)."""
    n = int(keys.shape[0])
    cap = max(n + 1, math.ceil(n / load_factor))
    tkeys = np.zeros(cap, np.int64)
    trows = np.full(cap, EMPTY, row_dtype(num_rows))
    if n:
        _build(np.ascontiguousarray(keys, np.int64), np.ascontiguousarray(rows, trows.dtype),
               np.uint64(table_key), tkeys, trows)
    return tkeys, trows
