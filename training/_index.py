"""Row id -> working-set slot: a growable open-addressing hash index.

Physical row ids can be as large as 2^62 (rocksdb homes), so a direct array is
out; this reuses the store's linear-probing kernels (``embstore.policies``)
and keeps the load factor <= 1/2 by rebuilding at twice the size. The
kernels run without numba's reference counting (``_nrt=False``: see
``embstore.policies``), which otherwise cost atomic calls on every key.
"""

from __future__ import annotations

import numba
import numpy as np

from embstore.hash_index import EMPTY, idx_del, idx_get, idx_put


@numba.njit(cache=True, nogil=True, _nrt=False)
def _find(tk, tv, keys, out):
    for i in range(keys.shape[0]):
        out[i] = idx_get(tk, tv, keys[i])


@numba.njit(cache=True, nogil=True, _nrt=False)
def _put(tk, tv, keys, vals):
    for i in range(keys.shape[0]):
        idx_put(tk, tv, keys[i], vals[i])


@numba.njit(cache=True, nogil=True, _nrt=False)
def _delete(tk, tv, keys):
    for i in range(keys.shape[0]):
        idx_del(tk, tv, keys[i])


class SlotIndex:
    """Map unique int64 keys (>= 0) to int64 slots."""

    def __init__(self, capacity: int = 1024) -> None:
        size = 16
        while size < 2 * capacity:
            size *= 2
        self._tk = np.full(size, EMPTY, np.int64)
        self._tv = np.zeros(size, np.int64)
        self.count = 0

    def find(self, keys: np.ndarray) -> np.ndarray:
        """Slots of ``keys``; -1 where absent."""
        out = np.empty(len(keys), np.int64)
        _find(self._tk, self._tv, keys, out)
        return out

    def put(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Insert keys that are not present yet."""
        if self.count + len(keys) > len(self._tk) // 2:
            self._grow(self.count + len(keys))
        _put(self._tk, self._tv, keys, slots)
        self.count += len(keys)

    def delete(self, keys: np.ndarray) -> None:
        """Remove keys that are present."""
        _delete(self._tk, self._tv, keys)
        self.count -= len(keys)

    def _grow(self, need: int) -> None:
        live = self._tk != EMPTY
        keys, vals = self._tk[live], self._tv[live]
        size = len(self._tk)
        while size < 2 * need:
            size *= 2
        self._tk = np.full(size, EMPTY, np.int64)
        self._tv = np.zeros(size, np.int64)
        _put(self._tk, self._tv, keys, vals)
