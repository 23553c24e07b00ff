"""Belady's MIN, the offline optimum every cache policy is judged against.

MIN (Belady, 1966; Mattson et al., 1970): on a miss with a full cache, evict
the resident key whose next use lies furthest in the future (keys never used
again first). A miss always inserts (demand paging, no bypass), which is the
setting the store's tiers live in. For that setting MIN maximises hits, so for
every capacity ``belady_hits >= hits of LRU, LFU, CLOCK, ...``.

The sequence every simulator is fed comes from the same two helpers, so the
store, ``replay`` and the bounds agree on what an "access" is:

* :func:`densify` maps arbitrary int64 keys to ``[0, K)`` (one array slot per
  distinct key in the kernels);
* :func:`dedup_batches` keeps, in each batch, only the first occurrence of each
  key: the store looks each distinct row of a batch up once (RecD-style
  deduplication), so repeats inside a batch are not cache accesses.

Complexity: next-use indices by one stable argsort (vectorised), then one pass
with a binary max-heap of next-use stamps with lazy deletion: O(n log n).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit

from embstore.arrays import Ids, Mask
from embstore.errors import InvalidInputError, InvalidOffsetsError

__all__ = ["belady_hit_mask", "belady_hits", "belady_mrc", "dedup_batches", "densify", "next_use"]


def _as_keys(keys: npt.ArrayLike, what: str = "keys") -> Ids:
    arr = np.asarray(keys)
    if arr.ndim != 1:
        raise InvalidInputError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise InvalidInputError(f"{what} must be an integer array, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise InvalidInputError(f"{what} holds values above the int64 range")
    return np.ascontiguousarray(arr, dtype=np.int64)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@njit(cache=True)
def _slot(v, shift):  # pragma: no cover - numba
    return np.int64((np.uint64(v) * _GOLDEN) >> np.uint64(shift))


@njit(cache=True)
def _hash_densify(x, out):  # pragma: no cover - numba
    """Number keys by first appearance with an open-addressing hash table
    (Fibonacci hashing, linear probing, doubled at half load): O(n) expected."""
    bits = 16
    cap = 1 << bits
    tk = np.empty(cap, dtype=np.int64)
    tv = np.full(cap, -1, dtype=np.int64)
    num = 0
    for i in range(x.shape[0]):
        v = x[i]
        j = _slot(v, 64 - bits)
        while True:
            if tv[j] < 0:
                tk[j] = v
                tv[j] = num
                out[i] = num
                num += 1
                break
            if tk[j] == v:
                out[i] = tv[j]
                break
            j = (j + 1) & (cap - 1)
        if 2 * num > cap:
            bits += 1
            ncap = cap * 2
            nk = np.empty(ncap, dtype=np.int64)
            nv = np.full(ncap, -1, dtype=np.int64)
            for a in range(cap):
                if tv[a] >= 0:
                    b = _slot(tk[a], 64 - bits)
                    while nv[b] >= 0:
                        b = (b + 1) & (ncap - 1)
                    nk[b] = tk[a]
                    nv[b] = tv[a]
            tk = nk
            tv = nv
            cap = ncap
    return num


def densify(keys: npt.ArrayLike, *, compact: bool = False) -> tuple[Ids, int]:
    """``(dense, K)``: the same sequence with keys renumbered into ``[0, K)``.

    Keys that already lie in a small non-negative range are returned as they are
    (``K = max + 1``, possibly more than the distinct count) unless ``compact``;
    others are numbered by first appearance (hash table, O(n)) and then ``K`` is
    the number of distinct keys. Kernels then index per-key arrays directly.
    """
    k = _as_keys(keys)
    if k.size == 0:
        return k, 0
    lo, hi = int(k.min()), int(k.max())
    if not compact and lo >= 0 and hi < 2 * k.size + 1024:
        return k, hi + 1
    out = np.empty(k.size, dtype=np.int64)
    num = _hash_densify(k, out)
    return out, int(num)


@njit(cache=True)
def _first_in_batch(keys, offsets, num_keys, keep):  # pragma: no cover - numba
    seen = np.full(num_keys, -1, dtype=np.int64)  # last batch each key was kept in
    for b in range(offsets.shape[0] - 1):
        for i in range(offsets[b], offsets[b + 1]):
            k = keys[i]
            if seen[k] != b:
                seen[k] = b
                keep[i] = True


def _check_offsets(offsets: npt.ArrayLike, n: int) -> npt.NDArray[np.int64]:
    off = np.asarray(offsets)
    if off.ndim != 1 or off.dtype.kind not in "iu" or off.size < 1:
        raise InvalidOffsetsError(f"batch_offsets must be a non-empty 1-D integer array, got {off.dtype} {off.shape}")
    off = off.astype(np.int64, copy=False)
    if off[0] != 0 or off[-1] != n:
        raise InvalidOffsetsError(f"batch_offsets must start at 0 and end at len(keys) = {n}, "
                                  f"got {int(off[0])} .. {int(off[-1])}")
    if np.any(np.diff(off) < 0):
        raise InvalidOffsetsError("batch_offsets must be non-decreasing")
    return np.ascontiguousarray(off)


def dedup_batches(keys: npt.ArrayLike, batch_offsets: npt.ArrayLike) -> tuple[Ids, npt.NDArray[np.int64]]:
    """Keep the first occurrence of each key in each batch, in first-occurrence order.

    Returns ``(keys, batch_offsets)`` of the deduplicated sequence; a key that
    recurs in a *later* batch is kept there again (it is a new cache access).
    """
    k = _as_keys(keys)
    off = _check_offsets(batch_offsets, k.size)
    keep = np.zeros(k.size, dtype=np.bool_)
    if k.size:
        dense, num = densify(k)
        _first_in_batch(dense, off, num, keep)
    cum = np.zeros(k.size + 1, dtype=np.int64)
    np.cumsum(keep, out=cum[1:])
    return k[keep], cum[off]


def next_use(keys: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """For each access ``i`` the index of the next access of the same key.

    Accesses whose key never recurs get ``n + i`` (past every real index, and
    distinct, so the MIN heap can tell them apart and evicts them first).
    """
    k = _as_keys(keys)
    n = k.size
    nxt = n + np.arange(n, dtype=np.int64)
    if n > 1:
        order = np.argsort(k, kind="stable")
        same = k[order[1:]] == k[order[:-1]]
        nxt[order[:-1][same]] = order[1:][same]
    return nxt


@njit(cache=True)
def _heap_push(heap, size, v):  # pragma: no cover - numba
    i = size
    heap[i] = v
    while i > 0:
        p = (i - 1) >> 1
        if heap[p] >= v:
            break
        heap[i] = heap[p]
        i = p
    heap[i] = v
    return size + 1


@njit(cache=True)
def _heap_pop(heap, size):  # pragma: no cover - numba
    top = heap[0]
    size -= 1
    v = heap[size]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= size:
            break
        if c + 1 < size and heap[c + 1] > heap[c]:
            c += 1
        if heap[c] <= v:
            break
        heap[i] = heap[c]
        i = c
    if size > 0:
        heap[i] = v
    return top, size


@njit(cache=True, _nrt=False)
def _min_kernel(keys, nxt, capacity, mask, resident, cur, heap):  # pragma: no cover - numba
    """One pass of MIN. The heap holds next-use stamps; a stamp ``t`` belongs to key
    ``keys[t]`` (or ``keys[t - n]`` for never-again stamps) and is live only while
    that key is resident with ``cur[key] == t`` (lazy deletion of stale stamps).
    ``resident`` (all False), ``cur`` (one per key) and ``heap`` (n + 1) come from
    the caller: without allocation the kernel runs free of numba's reference
    counting (``_nrt=False``, see ``embstore.policies``)."""
    n = keys.shape[0]
    size = 0
    used = 0
    hits = 0
    for i in range(n):
        k = keys[i]
        if resident[k]:
            hits += 1
            mask[i] = True
        else:
            if used >= capacity:
                while True:
                    t, size = _heap_pop(heap, size)
                    kk = keys[t] if t < n else keys[t - n]
                    if resident[kk] and cur[kk] == t:
                        resident[kk] = False
                        used -= 1
                        break
            resident[k] = True
            used += 1
        cur[k] = nxt[i]
        size = _heap_push(heap, size, nxt[i])
    return hits


def _min_scratch(n: int, num_keys: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``_min_kernel``'s working arrays for ``n`` accesses over ``num_keys`` keys."""
    return np.zeros(num_keys, np.bool_), np.zeros(num_keys, np.int64), np.empty(n + 1, np.int64)


def _check_capacity(capacity: int) -> int:
    if isinstance(capacity, (bool, np.bool_)) or not isinstance(capacity, (int, np.integer)):
        raise InvalidInputError(f"capacity must be an integer number of rows, got {capacity!r}")
    if capacity < 0:
        raise InvalidInputError(f"capacity must be >= 0 rows, got {capacity}")
    return int(capacity)


def belady_hit_mask(keys: npt.ArrayLike, capacity: int) -> Mask:
    """Per access: would MIN with ``capacity`` rows hit? (``mask.sum()`` is the hit count.)"""
    cap = _check_capacity(capacity)
    dense, num = densify(keys)
    cap = min(cap, num)  # more rows than keys never evict; and the kernel takes an int64
    mask = np.zeros(dense.size, dtype=np.bool_)
    if cap == 0 or dense.size == 0:
        return mask
    _min_kernel(dense, next_use(dense), cap, mask, *_min_scratch(dense.size, num))
    return mask


def belady_hits(keys: npt.ArrayLike, capacity: int) -> int:
    """Number of hits of Belady's MIN over ``keys`` with a cache of ``capacity`` rows."""
    return int(belady_hit_mask(keys, capacity).sum())


def belady_mrc(keys: npt.ArrayLike, capacities: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """MIN hits at each capacity (one O(n log n) pass per capacity; the key
    preparation is shared). Capacities at or above the number of distinct keys
    take no pass: every re-access hits."""
    caps = np.asarray(capacities)
    if caps.ndim != 1 or caps.dtype.kind not in "iu":
        raise InvalidInputError(f"capacities must be a 1-D integer array, got {caps.dtype} {caps.shape}")
    dense, num = densify(keys)
    n = dense.size
    nxt = next_use(dense) if n else dense
    out = np.zeros(caps.size, dtype=np.int64)
    reaccesses = int(np.count_nonzero(nxt < n)) if n else 0
    mask = np.zeros(n, dtype=np.bool_)
    for j, c in enumerate(caps.tolist()):
        cap = _check_capacity(c)
        if cap == 0 or n == 0:
            continue
        if cap >= num:
            out[j] = reaccesses
            continue
        mask[:] = False
        out[j] = _min_kernel(dense, nxt, cap, mask, *_min_scratch(n, num))
    return out
