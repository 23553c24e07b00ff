"""Mattson LRU stack distances: the LRU hit count at every capacity in one pass.

LRU is a stack algorithm (Mattson et al., 1970): the cache of ``C`` rows always
holds the ``C`` most recently used keys. So an access hits an LRU cache of ``C``
rows exactly when fewer than ``C`` *other* distinct keys were used since the
previous access of the same key. That count is the access's stack distance
``d`` (``-1`` for a first access), and ``hits(C) = #{i : 0 <= d_i < C}``.

``d_i`` is computed with a Fenwick tree over access times holding a 1 at the
latest access of every key: ``d_i`` is the number of ones strictly between the
previous access of ``keys[i]`` and ``i``. One pass, O(n log n), numba.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
from numba import njit

from embstore.belady import densify
from embstore.errors import InvalidInputError

__all__ = ["lru_mrc", "stack_distances"]

_CHUNK = 1 << 22  # accesses per kernel call when reporting progress


@njit(cache=True)
def _stack_kernel(keys, last, tree, out, start, end):  # pragma: no cover - numba
    """Accesses ``start..end-1``; ``last[k]`` is 1 + the time of k's latest access
    (0: never), ``tree`` a 1-based Fenwick tree over times with one slot per access."""
    m = tree.shape[0] - 1
    for i in range(start, end):
        k = keys[i]
        p = last[k]  # 1-based position of the previous access, 0 if none
        if p == 0:
            out[i] = -1
        else:
            # ones at positions p+1 .. i (1-based) = prefix(i) - prefix(p)
            s = 0
            j = i
            while j > 0:
                s += tree[j]
                j -= j & (-j)
            j = p
            while j > 0:
                s -= tree[j]
                j -= j & (-j)
            out[i] = s
            j = p
            while j <= m:
                tree[j] -= 1
                j += j & (-j)
        j = i + 1
        while j <= m:
            tree[j] += 1
            j += j & (-j)
        last[k] = i + 1


def stack_distances(keys: npt.ArrayLike, progress: Callable[[int], object] | None = None) -> npt.NDArray[np.int64]:
    """LRU stack distance of every access (distinct other keys since the key's
    previous access), ``-1`` for first accesses. ``progress(n)`` is called after
    each chunk of ``n`` accesses (e.g. ``tqdm.update``)."""
    dense, num = densify(keys)
    n = dense.size
    out = np.empty(n, dtype=np.int64)
    last = np.zeros(max(num, 1), dtype=np.int64)
    tree = np.zeros(n + 1, dtype=np.int32 if n < 2**31 else np.int64)
    for start in range(0, n, _CHUNK):
        end = min(n, start + _CHUNK)
        _stack_kernel(dense, last, tree, out, start, end)
        if progress is not None:
            progress(end - start)
    return out


def lru_mrc(keys: npt.ArrayLike, capacities: npt.ArrayLike,
            distances: npt.NDArray[np.int64] | None = None) -> npt.NDArray[np.int64]:
    """LRU hits for each capacity (in rows), from one stack-distance pass.

    Pass ``distances`` (from :func:`stack_distances` of the same keys) to reuse
    a pass across calls.
    """
    caps = np.asarray(capacities)
    if caps.ndim != 1 or caps.dtype.kind not in "iu":
        raise InvalidInputError(f"capacities must be a 1-D integer array, got {caps.dtype} {caps.shape}")
    if caps.size and caps.min() < 0:
        raise InvalidInputError(f"capacities must be >= 0 rows, got {int(caps.min())}")
    d = stack_distances(keys) if distances is None else np.asarray(distances)
    if caps.size == 0:
        return np.zeros(0, dtype=np.int64)
    # a distance is below the number of accesses, so capacities past it all hit every reuse: clamping
    # them keeps the histogram as small as the trace (not 2**40 slots) and uint64 capacities in range
    caps = np.minimum(caps, d.size).astype(np.int64)
    top = int(caps.max())
    reuse = d[d >= 0]
    # hist[x] = accesses with distance x (x < top); hits(C) = sum_{x < C} hist[x]
    hist = np.bincount(np.minimum(reuse, top), minlength=top + 1)[:top]
    cum = np.zeros(top + 1, dtype=np.int64)
    np.cumsum(hist, out=cum[1:])
    return cum[caps]
