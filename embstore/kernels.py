"""Vectorised building blocks of the lookup path: dedup, gather-pool, software prefetch.

``unique_inverse`` keeps first-occurrence order (as the trace simulator's
per-batch dedup does), so the store and ``replay`` see the same sequence.

Random rows of a slab far larger than the caches are the cost of every pooled
lookup and training step: one DRAM miss per row, which a loop doing real work
per row does not overlap by itself. ``prefetch_row`` asks for a row several
iterations ahead (as fbgemm's JIT kernels do), which took the row update of a
training step from 12 ms to 5 ms per table-batch here.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from typing import Sequence

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from embstore.policies import mix64

PREFETCH_DISTANCE = 8  # rows ahead: 2-8 measured alike, 16 slower (bags of 20 rows, 2 threads)
_LINE_FLOATS = 16  # float32 per 64-byte cache line


@intrinsic
def _prefetch(typingctx, arr, row, col):  # type: ignore[no-untyped-def]
    """LLVM ``prefetch`` of ``&arr[row, col]`` (rw=1: the line will be written, locality 3: keep it)."""
    sig = types.void(arr, row, col)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        idx = [context.cast(builder, args[i], signature.args[i], types.intp) for i in (1, 2)]
        ptr = cgutils.get_item_pointer2(context, builder, ary.data, cgutils.unpack_tuple(builder, ary.shape),
                                        cgutils.unpack_tuple(builder, ary.strides), aryty.layout, idx)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 1), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return sig, codegen


@numba.njit(cache=True, inline="always")
def prefetch_row(arr, row, width):
    """Start loading the cache lines of ``arr[row, :width]`` (a C-contiguous 2-D float32 array)."""
    for c in range(0, width, _LINE_FLOATS):
        _prefetch(arr, row, c)
    _prefetch(arr, row, width - 1)  # a row not aligned to a line ends in one more


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
    n = index.shape[0]
    for b in numba.prange(nb):
        lo = offsets[b]
        hi = offsets[b + 1]
        acc = out[b]
        for d in range(dim):
            acc[d] = 0.0
        for j in range(lo, hi):
            if j + PREFETCH_DISTANCE < n:
                prefetch_row(rows, index[j + PREFETCH_DISTANCE], dim)
            r = index[j]
            for d in range(dim):
                acc[d] += rows[r, d]
        if mean and hi > lo:
            n = np.float32(hi - lo)
            for d in range(dim):
                acc[d] /= n  # divide, as torch's embedding_bag does, for bit-equal means


def pool(rows: np.ndarray, index: np.ndarray, offsets: np.ndarray, mode: str) -> np.ndarray:
    """Bag b = sum (or mean) of ``rows[index[offsets[b]:offsets[b+1]]]``; empty bags are zeros."""
    out = np.empty((len(offsets) - 1, rows.shape[1]), np.float32)
    pool_rows(np.ascontiguousarray(rows, np.float32), np.ascontiguousarray(index, np.int64),
              np.ascontiguousarray(offsets, np.int64), mode == "mean", out)
    return out

