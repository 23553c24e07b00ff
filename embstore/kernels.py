"""Vectorised building blocks of the lookup path: dedup, gather-pool.

``unique_inverse`` keeps first-occurrence order (as the trace simulator's
per-batch dedup does), so the store and ``replay`` see the same sequence.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from typing import Sequence

import numba
import numpy as np

from embstore.policies import mix64
from embstore.prefetch import PREFETCH_DISTANCE, prefetch_row


@numba.njit(cache=True, nogil=True)
def _unique_inverse(ids, uniq, inverse, first):
    """Linear-probing dedup; a slot is (key, position + 1), 0 marking it empty, so a probe touches one
    cache line (separate key/value/used arrays cost three misses once the table outgrows L2)."""
    n = ids.shape[0]
    size = 16
    while size < 2 * n:
        size *= 2
    mask = size - 1
    table = np.zeros((size, 2), np.int64)
    nu = 0
    for i in range(n):
        k = ids[i]
        h = np.int64(mix64(np.uint64(k)) & np.uint64(mask))
        while table[h, 1] != 0 and table[h, 0] != k:
            h = (h + 1) & mask
        if table[h, 1] == 0:
            table[h, 0] = k
            table[h, 1] = nu + 1
            uniq[nu] = k
            first[nu] = i
            nu += 1
        inverse[i] = table[h, 1] - 1
    return nu


def unique_inverse(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(unique ids in first-occurrence order, inverse) with ``uniq[inverse] == ids``."""
    uniq, inverse, _ = _unique(ids)
    return uniq, inverse


_threads: cf.ThreadPoolExecutor | None = None
_threads_lock = threading.Lock()


def _forget_threads() -> None:
    """A forked child inherits the pool object but not its threads: start a fresh one there."""
    global _threads, _threads_lock
    _threads, _threads_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_threads)


def unique_inverse_each(arrays: Sequence[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """``unique_inverse`` of each array, the arrays spread over the CPU's cores.

    The dedup is a serial hash-table pass; a training step needs it for every
    table, so doing the tables side by side (the kernel releases the GIL)
    halves its share of a step on two cores.
    """
    global _threads
    if len(arrays) < 2 or numba.get_num_threads() < 2:
        return [unique_inverse(a) for a in arrays]
    with _threads_lock:
        if _threads is None:
            _threads = cf.ThreadPoolExecutor(numba.get_num_threads(), thread_name_prefix="embstore-dedup")
    return list(_threads.map(unique_inverse, arrays))


def unique_last(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(unique ids, position of each one's *last* occurrence): last write wins."""
    n = len(ids)
    uniq, _, first = _unique(np.ascontiguousarray(ids[::-1]))
    return uniq, n - 1 - first


def _unique(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ids = np.ascontiguousarray(ids, np.int64)
    uniq = np.empty(len(ids), np.int64)
    inverse = np.empty(len(ids), np.int64)
    first = np.empty(len(ids), np.int64)
    nu = _unique_inverse(ids, uniq, inverse, first)
    return uniq[:nu], inverse, first[:nu]


@numba.njit(cache=True, nogil=True, parallel=True)
def pool_rows(rows, index, offsets, mean, out):
    """out[b] = sum (or mean) of rows[index[offsets[b]:offsets[b+1]], :out.shape[1]].

    ``rows`` may be wider than ``out`` (a slab whose rows carry optimizer state
    after the embedding): pass the contiguous slab, not a strided view, so the
    inner loop vectorises.
    """
    nb = offsets.shape[0] - 1
    dim = out.shape[1]
    n_ids = index.shape[0]
    for b in numba.prange(nb):
        lo = offsets[b]
        hi = offsets[b + 1]
        acc = out[b]
        for d in range(dim):
            acc[d] = 0.0
        for j in range(lo, hi):
            if j + PREFETCH_DISTANCE < n_ids:
                prefetch_row(rows, index[j + PREFETCH_DISTANCE], dim)
            r = index[j]
            for d in range(dim):
                acc[d] += rows[r, d]
        if mean and hi > lo:
            size = np.float32(hi - lo)
            for d in range(dim):
                acc[d] /= size  # divide, as torch's embedding_bag does, for bit-equal means


@numba.njit(cache=True, nogil=True, parallel=True)
def gather_rows(slab, index, out):
    """out[i] = slab[index[i], :out.shape[1]]: the embedding part of slab rows that carry optimizer state
    (``np.take`` on such a strided view falls back to a slow path)."""
    dim = out.shape[1]
    n = index.shape[0]
    for i in numba.prange(n):
        if i + PREFETCH_DISTANCE < n:
            prefetch_row(slab, index[i + PREFETCH_DISTANCE], dim)
        r = index[i]
        for d in range(dim):
            out[i, d] = slab[r, d]


def pool(rows: np.ndarray, index: np.ndarray, offsets: np.ndarray, mode: str) -> np.ndarray:
    """Bag b = sum (or mean) of ``rows[index[offsets[b]:offsets[b+1]]]``; empty bags are zeros."""
    out = np.empty((len(offsets) - 1, rows.shape[1]), np.float32)
    pool_rows(np.ascontiguousarray(rows, np.float32), np.ascontiguousarray(index, np.int64),
              np.ascontiguousarray(offsets, np.int64), mode == "mean", out)
    return out
