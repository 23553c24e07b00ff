"""Compositional embeddings by the quotient-remainder trick (Shi et al., 2019).

With ``m = collisions`` and ``B = buckets`` physical rows, one table holds::

    rows [0, B - m)     quotient rows:  q(id) = (id // m) mod (B - m)
    rows [B - m, B)     remainder rows: r(id) = B - m + (id mod m)

``//`` and ``mod`` are floor division and floor modulo on exact int64 (Python
semantics: ``-1 // 4 == -1``, ``-1 mod 4 == 3``), so negative ids are defined
too and every remainder is in ``[0, m)``. The pair (q, r) depends only on
``id mod (m * (B - m))``, and within any ``m * (B - m)`` consecutive ids no two
ids share both rows: that is the id space QR represents uniquely with ``B``
rows instead of ``m * (B - m)``. Each id's embedding combines its two rows by
``mult`` (elementwise product, the paper's best), ``add``, or ``concat`` (each
physical row then holds ``dim // 2`` columns).

Note for table init: with ``mult`` the product of two small uniform rows is
tiny (scale**2); the store's initialiser may want a larger scale for QR tables.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from embstore.arrays import Ids
from embstore.errors import ConfigError
from embstore.hashing.base import MAX_ROWS, Mapper, as_id_array, check_int

COMBINES = ("mult", "add", "concat")


@njit(cache=True)
def _qr_kernel(ids, m, nq, out):  # pragma: no cover - numba
    """out[i] = (floor(id/m) mod nq, nq + id mod m); numba's // and % floor like Python."""
    for i in range(ids.shape[0]):
        x = ids[i]
        q = x // m
        out[i, 0] = q % nq
        out[i, 1] = nq + (x - q * m)


class QRHash(Mapper):
    """Two rows per id of one table of ``buckets`` rows: a quotient and a remainder row."""

    rows_per_id = 2

    def __init__(self, buckets: int, collisions: int, combine: str = "mult") -> None:
        self.collisions = check_int(collisions, "collisions", lo=1, hi=MAX_ROWS - 1)
        self.num_rows = check_int(buckets, "buckets", lo=self.collisions + 1, hi=MAX_ROWS)
        if combine not in COMBINES:
            raise ConfigError("combine", f"{combine!r} is not one of 'mult', 'add', 'concat'")
        self.combine_kind = combine
        self.quotient_rows = self.num_rows - self.collisions

    @property
    def buckets(self) -> int:
        return self.num_rows

    @property
    def unique_ids(self) -> int:
        """Size of the id range mapped without two ids sharing both rows."""
        return self.collisions * self.quotient_rows

    def __call__(self, ids: Ids) -> np.ndarray:
        arr = as_id_array(ids)
        out = np.empty((arr.shape[0], 2), np.int64)
        if arr.shape[0]:
            _qr_kernel(arr, np.int64(self.collisions), np.int64(self.quotient_rows), out)
        return out

    def row_of(self, raw_id: int) -> tuple[int, int]:
        """One id with Python ints (the reference the kernel is tested against)."""
        x = check_int(raw_id, "raw_id", lo=-(2**63), hi=2**63 - 1)
        m, nq = self.collisions, self.quotient_rows
        return (x // m) % nq, nq + x % m

    def physical_dim(self, dim: int) -> int:
        dim = check_int(dim, "dim", lo=1)
        if self.combine_kind != "concat":
            return dim
        if dim % 2:
            raise ConfigError("dim", f"QR with combine='concat' needs an even dim, got {dim}")
        return dim // 2

    def combine(self, parts: Any) -> Any:
        """(n, 2, physical_dim) -> (n, dim) by product, sum or concatenation."""
        if self.combine_kind == "mult":
            return parts[:, 0] * parts[:, 1]
        if self.combine_kind == "add":
            return parts[:, 0] + parts[:, 1]
        # explicit width, not -1: numpy and torch refuse to infer it for an empty batch (pooled lookups of
        # only empty bags, an empty training batch)
        return parts.reshape(parts.shape[0], parts.shape[1] * parts.shape[2])

    def __repr__(self) -> str:
        return f"QRHash(buckets={self.num_rows}, collisions={self.collisions}, combine={self.combine_kind!r})"
