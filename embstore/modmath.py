"""Exact modular arithmetic on int64 for moduli up to 2**63 - 1 (the id spaces of the synthetic generators).

Why: the rank -> id scrambles ``(a * rank + c) mod m`` of :mod:`embstore.tracegen` and
``training.data.SyntheticClicks`` must be bijections for every id space an int64 id can index. ``a * rank``
overflows int64 once ``a * (m - 1) > 2**63 - 1`` (uint64 a bit later), after which two ranks can share an
id. Here the product is formed by doubling (``a * r = 2 * (a // 2) * r + (a % 2) * r``) with each sum
reduced mod m: every intermediate stays below m, and a sum that would reach m is never formed (``x + y >= m``
is tested as ``x >= m - y``). Where ``a * r`` fits in int64 the plain product is used; either way the result
is the exact one, so it equals the plain formula's wherever that one did not overflow.

``addmod`` and ``mulmod`` are numba kernels, callable from other ``@njit`` code and from Python;
:func:`affine_mod` is the vectorised form over a numpy array of ranks.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit

INT64_MAX = (1 << 63) - 1

__all__ = ["INT64_MAX", "addmod", "affine_mod", "mulmod"]


@njit(cache=True)
def addmod(x, y, m):  # pragma: no cover - numba
    """``(x + y) mod m`` for ``0 <= x, y < m``, without forming ``x + y`` when it reaches m (it may pass 2**63)."""
    return x - (m - y) if x >= m - y else x + y


@njit(cache=True)
def mulmod(a, r, m):  # pragma: no cover - numba
    """``(a * r) mod m`` exactly for ``0 <= a``, ``0 <= r < m <= 2**63 - 1``: the plain product where it fits in
    int64, else double-and-add over the bits of ``a`` (at most 63 rounds), every partial sum kept below m."""
    if a == 0 or r <= INT64_MAX // a:
        return (a * r) % m
    out = a - a  # 0 of a's type
    x = r
    while a > 0:
        if a & 1:
            out = addmod(out, x, m)
        x = addmod(x, x, m)
        a >>= 1
    return out


@njit(cache=True)
def _mulmod_array(a, r, m):  # pragma: no cover - numba
    """:func:`mulmod` of one multiplier over a 1-d int64 array."""
    out = np.empty(r.shape[0], dtype=np.int64)
    for i in range(r.shape[0]):
        out[i] = mulmod(a, r[i], m)
    return out


def affine_mod(a: int, ranks: np.ndarray, c: int | np.ndarray, m: int) -> npt.NDArray[np.int64]:
    """``(a * ranks + c) mod m`` as int64, exact for ``0 <= a < 2**63`` and ``0 <= ranks, c < m <= 2**63 - 1``
    (``c`` a scalar or an array like ``ranks``). Where ``a * (m - 1)`` fits in int64 it is plain numpy (the fast
    path of small spaces)."""
    if not 1 <= m <= INT64_MAX:
        raise ValueError(f"modulus must be in [1, 2**63 - 1], got {m}")
    r = np.asarray(ranks, dtype=np.int64)
    if a * (m - 1) <= INT64_MAX:
        x = (np.int64(a) * r) % np.int64(m)
    else:
        x = _mulmod_array(np.int64(a), np.ascontiguousarray(r).ravel(), np.int64(m)).reshape(r.shape)
    c = np.asarray(c, dtype=np.int64)
    gap = np.int64(m) - c  # x + c >= m  <=>  x >= m - c; x + c itself may pass 2**63
    return np.where(x >= gap, x - gap, x + c)
