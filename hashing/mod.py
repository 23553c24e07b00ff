"""The hashing trick with a strong seeded mix: ``row = mix64(id, key(seed)) % buckets``.

Plain ``id % buckets`` would put ids that differ by a multiple of ``buckets``
(a common pattern in id allocation) together, and Python's ``hash()`` is
identity on ints and salted on strings; the splitmix64 finaliser (see
:mod:`embstore.hashing._mix`) spreads any id pattern evenly instead.
"""

from __future__ import annotations

import numpy as np

from embstore.arrays import Ids
from embstore.hashing._mix import mix64_py, mix_mod_kernel, seed_key
from embstore.hashing.base import MAX_ROWS, Mapper, as_id_array, check_int


class ModHash(Mapper):
    """Seeded 64-bit mix, then modulo ``buckets``; one row per id, no state."""

    rows_per_id = 1

    def __init__(self, buckets: int, seed: int = 0) -> None:
        self.num_rows = check_int(buckets, "buckets", lo=1, hi=MAX_ROWS)
        self.seed = check_int(seed, "seed", lo=0, hi=2**63 - 1)
        self._key = np.uint64(seed_key(self.seed))

    @property
    def buckets(self) -> int:
        return self.num_rows

    def __call__(self, ids: Ids) -> np.ndarray:
        arr = as_id_array(ids)
        out = np.empty(arr.shape[0], np.int64)
        if arr.shape[0]:
            mix_mod_kernel(arr, self._key, self.num_rows, out)
        return out

    def row_of(self, raw_id: int) -> int:
        """One id through the pure-Python reference of the same function (for tests, debugging)."""
        x = check_int(raw_id, "raw_id", lo=-(2**63), hi=2**63 - 1)
        return mix64_py(x, int(self._key)) % self.num_rows

    def __repr__(self) -> str:
        return f"ModHash(buckets={self.num_rows}, seed={self.seed})"
