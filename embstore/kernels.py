"""Vectorised building blocks of the lookup path (dedup, gather-pool) and of writes to a resident slab.

``unique_inverse`` keeps first-occurrence order (as the trace simulator's
per-batch dedup does), so the store and ``replay`` see the same sequence.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import threading
from typing import Iterator, Sequence

import numba
import numpy as np

from embstore.hash_index import mix64
from embstore.prefetch import prefetch_read, prefetch_row_lines


PARALLEL_MIN_ITEMS = 16_384
"""Below this many ids per call a kernel runs on the calling thread alone.

Waking the other threads costs more than such a small slice of work, and on a
machine with as many cores as torch has threads it also steals time from
torch's own parallel regions. DLRM's 26 tables of 2,048 ids a step:
fused update 3.5-4.7 -> 1.5 ms, pooling 3.3-4.9 -> 1.5 ms and dedup
1.2-1.5 -> 0.6 ms per step (BENCHMARKS.md).
"""


def threads_for(items: int) -> int:
    """Threads a parallel kernel over ``items`` ids should use."""
    return numba.get_num_threads() if items >= PARALLEL_MIN_ITEMS else 1


@contextlib.contextmanager
def kernel_threads(items: int) -> Iterator[int]:
    """Parallel numba kernels launched inside use ``threads_for(items)`` threads (restored after;
    the setting is per calling thread and does not touch torch's)."""
    prev = numba.get_num_threads()
    n = threads_for(items)
    if n == prev:
        yield n
        return
    numba.set_num_threads(n)
    try:
        yield n
    finally:
        numba.set_num_threads(prev)


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
    halves its share of a step on two cores. Arrays shorter than
    ``PARALLEL_MIN_ITEMS`` on average are done one after another on the
    calling thread: handing them to the pool costs more than the pass.
    """
    global _threads
    if len(arrays) < 2 or threads_for(sum(len(a) for a in arrays) // len(arrays)) < 2:
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


def pool_rows(rows: np.ndarray, index: np.ndarray, offsets: np.ndarray, mean: bool, out: np.ndarray) -> None:
    """out[b] = sum (or mean) of rows[index[offsets[b]:offsets[b+1]], :out.shape[1]] (see ``_pool_rows``),
    on as many threads as the number of ids warrants."""
    with kernel_threads(index.shape[0]) as threads:
        _pool_rows(rows, index, offsets, mean, out, threads)


def gather_rows(slab: np.ndarray, index: np.ndarray, out: np.ndarray) -> None:
    """out[i] = slab[index[i], :out.shape[1]] (see ``_gather_rows``), threads as for ``pool_rows``."""
    with kernel_threads(index.shape[0]):
        _gather_rows(slab, index, out)


READ_PREFETCH_DISTANCE = 16
"""Ids ahead whose row's first line the pooling and gather kernels prefetch. They
read a row once, so one read prefetch of its first line (the core's adjacent-line
prefetcher takes the rest) beat prefetching every line at distance 8, 16 or 32
in a throwaway sweep (8 x 1M x 64, Zipf ids, four rows per step: 0.74x -> 0.83-0.88x
of torch's fbgemm kernel). The whole rewrite of ``_pool_rows``: Zipf 0.56-0.58x ->
0.99-1.10x, uniform 0.85x -> 1.05-1.07x (BENCHMARKS.md). ``_gather_rows`` on a slab
with a state column: 1.10x against every line prefetched for writing at distance 8."""


@numba.njit(cache=True, nogil=True, inline="always")
def _pool_bag(rows, index, lo, hi, stop, acc):
    """acc[:] = sum of rows[index[lo:hi], :len(acc)], added in order (bit-equal to torch's sums). Four
    rows per step: four independent row loads in flight and a quarter of the accumulator loads and
    stores (which go to memory: numba cannot prove ``acc`` and ``rows`` apart), the deciding cost once
    rows miss the caches. Rows up to index[stop - 1] are prefetched ``READ_PREFETCH_DISTANCE`` ids ahead."""
    dim = acc.shape[0]
    for d in range(dim):
        acc[d] = 0.0
    j = lo
    while j + 4 <= hi:
        if j + READ_PREFETCH_DISTANCE + 3 < stop:
            for q in range(4):
                prefetch_read(rows, index[j + READ_PREFETCH_DISTANCE + q], 0)
        r0 = rows[index[j]]
        r1 = rows[index[j + 1]]
        r2 = rows[index[j + 2]]
        r3 = rows[index[j + 3]]
        for d in range(dim):
            acc[d] = (((acc[d] + r0[d]) + r1[d]) + r2[d]) + r3[d]  # torch's order: bit-equal sums
        j += 4
    while j < hi:
        r0 = rows[index[j]]
        for d in range(dim):
            acc[d] += r0[d]
        j += 1


@numba.njit(cache=True, nogil=True, inline="always")
def _divide_bag(acc, n):
    """Mean of a bag of ``n`` rows: divide, as torch's embedding_bag does (not multiply by 1/n)."""
    if n > 0:
        size = np.float32(n)
        for d in range(acc.shape[0]):
            acc[d] /= size


@numba.njit(cache=True, nogil=True, parallel=True)
def _pool_rows(rows, index, offsets, mean, out, parts):
    """out[b] = sum (or mean) of rows[index[offsets[b]:offsets[b+1]], :out.shape[1]].

    ``rows`` may be wider than ``out`` (a slab whose rows carry optimizer state
    after the embedding): pass the contiguous slab, not a strided view, so the
    inner loop vectorises. Each of ``parts`` threads pools one contiguous range
    of bags, so its prefetches run ahead across its own bag boundaries.
    """
    nb = offsets.shape[0] - 1
    for p in numba.prange(parts):
        b0 = nb * p // parts
        b1 = nb * (p + 1) // parts
        stop = offsets[b1]
        for b in range(b0, b1):
            _pool_bag(rows, index, offsets[b], offsets[b + 1], stop, out[b])
            if mean:
                _divide_bag(out[b], offsets[b + 1] - offsets[b])


@numba.njit(cache=True, nogil=True, parallel=True)
def _gather_rows(slab, index, out):
    """out[i] = slab[index[i], :out.shape[1]]: the embedding part of slab rows that carry optimizer state
    (``np.take`` on such a strided view falls back to a slow path)."""
    dim = out.shape[1]
    n = index.shape[0]
    for i in numba.prange(n):
        if i + READ_PREFETCH_DISTANCE < n:
            prefetch_read(slab, index[i + READ_PREFETCH_DISTANCE], 0)
        r = index[i]
        for d in range(dim):
            out[i, d] = slab[r, d]


_EXPONENT = np.uint32(0x7F800000)  # a float32 whose exponent bits are all set is inf or NaN


def rows_finite(rows: np.ndarray) -> bool:
    """Whether every value of C-contiguous float32 ``rows`` is finite.

    One pass over the values' bits on the calling thread (~30 GB/s here, rows
    from DRAM): ``np.isfinite(rows).all()`` builds a boolean array as large as
    the rows first and is 3x slower. One thread, like ``scatter_rows``.
    """
    return bool(_max_exponent(rows.reshape(-1).view(np.uint32)) < _EXPONENT)


@numba.njit(cache=True, nogil=True)
def _max_exponent(bits):
    """Largest exponent field of ``bits`` (float32 bit patterns): an unsigned max, which vectorises (a
    float test stays in order, and fastmath would assume the very NaNs away). Over a whole array: a loop
    over range(lo, hi) has numba wrap negative indices inside it, which kept it scalar (6x slower)."""
    m = np.uint32(0)
    for i in range(bits.shape[0]):
        m = max(m, bits[i] & _EXPONENT)
    return m


WRITE_PREFETCH_DISTANCE = 8
"""Rows ahead whose every cache line ``scatter_rows`` prefetches for writing, so that more of its row
writes miss at once than the store buffer alone lets through. Session 8's sweep (8 x 78k rows into 1M
x 64 slabs) on the machine of the time preferred the first line only at distance 4 (2.31x numpy's
``w[ids] = rows`` against 2.09-2.20x for the others); on session 19's AVX-512 machine that left the
other three lines of a 256-byte row to demand misses: 0.84x numpy, against 1.12-1.16x with every line
prefetched at distance 4, 8 or 16 (Table.update of 8 x 78k rows, old and new kernels alternating in one
process; BENCHMARKS.md)."""


@numba.njit(cache=True, nogil=True)
def scatter_rows(slab, index, rows, dirty):
    """slab[index[i], :dim] = rows[i] with the rest of that slab row (optimizer state) zeroed, and
    dirty[index[i]] set; in order, so the last row of a repeated index wins.

    On the calling thread: split over both cores it measured 0.7-2.9x numpy's
    fancy assignment on this shared machine (a parallel region waits for a
    thread that another process may hold), one thread 1.7-3.0x in the same runs.
    """
    dim = rows.shape[1]
    width = slab.shape[1]
    n = index.shape[0]
    for i in range(n):
        if i + WRITE_PREFETCH_DISTANCE < n:
            prefetch_row_lines(slab, index[i + WRITE_PREFETCH_DISTANCE])
        k = index[i]
        for d in range(dim):
            slab[k, d] = rows[i, d]
        for d in range(dim, width):
            slab[k, d] = 0.0
        dirty[k] = True


def pool(rows: np.ndarray, index: np.ndarray, offsets: np.ndarray, mode: str) -> np.ndarray:
    """Bag b = sum (or mean) of ``rows[index[offsets[b]:offsets[b+1]]]``; empty bags are zeros."""
    out = np.empty((len(offsets) - 1, rows.shape[1]), np.float32)
    pool_rows(np.ascontiguousarray(rows, np.float32), np.ascontiguousarray(index, np.int64),
              np.ascontiguousarray(offsets, np.int64), mode == "mean", out)
    return out
