"""The directory of a cache tier that holds a whole table: slot == row id, nothing is ever evicted.

A tier whose capacity covers every row of its table needs no hash probe and no
policy bookkeeping (fbgemm does the same when a table fits), only a presence
flag per row. Its ``count_resident`` is the resident lookup paths' single pass
over a call's ids: range check, residency check and the distinct-row count for
the tier statistics, in a bitmap of one bit per row.
"""

from __future__ import annotations

import numba
import numpy as np

from embstore.arrays import Ids
from embstore.hash_index import EMPTY
from embstore.policies import AccessResult


class DirectDirectory:
    """A cache that can hold the whole id space: slot == key, nothing is ever evicted.

    Used when a tier's capacity covers every row of the table (fbgemm does the
    same when a table fits): no hash probe, no policy bookkeeping.
    """

    def __init__(self, num_rows: int) -> None:
        self.capacity = int(num_rows)
        self.present = np.zeros(num_rows, np.bool_)
        self._resident = 0
        self._bits = np.zeros((0, 0), np.uint64)

    @property
    def full(self) -> bool:
        """Every row is resident (then no key needs its ``present`` flag checked)."""
        return self._resident == self.capacity

    def marks(self, threads: int) -> np.ndarray:
        """Scratch bitmaps for counting distinct keys: one bit per row, a bitmap per thread, shape
        (threads, words). Kept all zero between calls (the kernels using it clear what they set)."""
        if self._bits.shape[0] < threads:
            self._bits = np.zeros((threads, (self.capacity + 63) // 64), np.uint64)
        return self._bits[:threads]

    def count_resident(self, keys: Ids, threads: int = 1) -> int:
        """Number of distinct ``keys`` if every one is resident, else -1 (no dedup array needed).

        Keys outside ``[0, capacity)`` also give -1, so a caller may pass ids it
        has not range-checked and validate them only on the slow path. With
        ``threads`` > 1 (numba set to as many, ``embstore.kernels.kernel_threads``)
        each thread marks a share of the keys in a bitmap of its own: in the
        flow of ``bench_dram`` (torch pooling between counts) 4-7% faster pooled
        calls than one thread on two cores (BENCHMARKS.md, sessions 6 and 26).
        """
        marks = self.marks(threads)
        if threads == 1:
            return int(_count_resident_serial(keys, self.present, not self.full, marks))
        return int(_count_resident_parallel(keys, self.present, not self.full, marks))

    @property
    def nbytes(self) -> int:
        """The presence flags (a byte per row) and the scratch bitmaps of the distinct count."""
        return self.present.nbytes + self._bits.nbytes

    @property
    def resident(self) -> int:
        return self._resident

    @property
    def slot_key(self) -> np.ndarray:
        """Built over the whole table: callers on a hot path use :meth:`keys_at`."""
        return np.where(self.present, np.arange(self.capacity), EMPTY)

    def keys_at(self, slots: np.ndarray) -> np.ndarray:
        """The key each of ``slots`` holds (slot == key; EMPTY where the row is absent)."""
        return np.where(self.present[slots], slots, EMPTY)

    def access(self, keys: Ids) -> AccessResult:
        hit = self.present[keys]
        miss = keys[~hit]
        self.present[miss] = True
        self._resident += len(miss)
        empty = np.empty(0, np.int64)
        return AccessResult(keys.astype(np.int64, copy=True), hit, empty, empty, 0)

    def lookup(self, keys: Ids) -> np.ndarray:
        return np.where(self.present[keys], keys, -1)

    def remove(self, keys: Ids) -> np.ndarray:
        out = self.lookup(keys)
        self._resident -= int((out >= 0).sum())
        self.present[keys] = False
        return out

    def occupied_slots(self) -> np.ndarray:
        return np.flatnonzero(self.present)


@numba.njit(cache=True, nogil=True, inline="always")
def _mark_resident(keys, lo, hi, present, check_present, bits):
    """Set the bit of each of keys[lo:hi] in ``bits`` (branch-free: repeated keys would mispredict);
    stops at a key outside ``present`` or, with ``check_present``, not resident. Returns where it
    stopped (``hi`` when every key is resident)."""
    size = present.shape[0]
    for i in range(lo, hi):
        k = keys[i]
        if k < 0 or k >= size or (check_present and not present[k]):
            return i
        bits[k >> 6] |= np.uint64(1) << np.uint64(k & 63)
    return hi


@numba.njit(cache=True, nogil=True, inline="always")
def _unmark(keys, lo, hi, bits):
    """Zero what ``_mark_resident`` set for keys[lo:hi]: the whole bitmap when that is the cheaper
    pass (a sequential memset against a random access per key)."""
    if (hi - lo) * 16 >= bits.shape[0]:
        bits[:] = 0
    else:
        for i in range(lo, hi):
            bits[keys[i] >> 6] = 0


@numba.njit(cache=True, nogil=True, inline="always")
def _load_lines(bits):
    """The OR of the first word of each cache line of ``bits``, read in order: zero, as a bitmap is
    clear between calls. A call with many keys marks nearly every line, and by then the bitmap has
    gone cold (torch's pooling streams rows through the caches between calls); one sequential pass
    brings it back at the memory's streaming rate instead of a random miss per line. In
    ``bench_dram``'s flow: a Zipf count 131-186 -> 90-125 us a table (AMD Zen 5, session 26)."""
    acc = np.uint64(0)
    for w in range(0, bits.shape[0], 8):
        acc |= bits[w]
    return acc != 0


@numba.njit(cache=True, nogil=True, inline="always")
def _mark_share(keys, lo, hi, present, check_present, bits):
    """``_mark_resident`` of keys[lo:hi], the bitmap's lines loaded first when the share marks most."""
    if (hi - lo) * 4 >= bits.shape[0] and _load_lines(bits):
        bits[:] = 0  # not reached: the bitmap is clear between calls (the test keeps the loads)
    return _mark_resident(keys, lo, hi, present, check_present, bits)


@numba.njit(cache=True, nogil=True)
def _count_resident_serial(keys, present, check_present, bits):
    """``DirectDirectory.count_resident`` on the calling thread (``bits`` has one row)."""
    n = keys.shape[0]
    stop = _mark_share(keys, 0, n, present, check_present, bits[0])
    if stop < n:
        _unmark(keys, 0, stop, bits[0])
        return -1
    return _count_and_clear(keys, bits)


@numba.njit(cache=True, nogil=True, parallel=True)
def _count_resident_parallel(keys, present, check_present, bits):
    """``DirectDirectory.count_resident`` with one share of the keys per row of ``bits``."""
    n = keys.shape[0]
    parts = bits.shape[0]
    stops = np.empty(parts, np.int64)
    for p in numba.prange(parts):
        stops[p] = _mark_share(keys, n * p // parts, n * (p + 1) // parts, present, check_present, bits[p])
    failed = False
    for p in range(parts):
        if stops[p] < n * (p + 1) // parts:
            failed = True
    if failed:
        for p in range(parts):
            _unmark(keys, n * p // parts, stops[p], bits[p])
        return -1
    return _count_and_clear(keys, bits)


@numba.njit(cache=True, nogil=True)
def _count_and_clear(keys, bits):
    """Distinct keys marked in the OR of ``bits``' rows, which are left all zero. Sweeps the whole
    bitmap when that is cheaper than revisiting the keys' words (a random access each).

    The sweep folds the rows into row 0, then counts row 0: contiguous loops, which LLVM
    vectorises. With the rows' loop inside the words' loop instead, it did not, and the sweep took
    half of a 20k-id count (50 -> 16 us a call on AMD Zen 5; BENCHMARKS.md, session 26).
    """
    parts, words = bits.shape
    n = 0
    if keys.shape[0] * 4 >= words * parts:
        first = bits[0]
        for p in range(1, parts):
            row = bits[p]
            for w in range(words):
                first[w] |= row[w]
                row[w] = 0
        for w in range(words):
            n += _popcount(first[w])
            first[w] = 0
    else:
        for i in range(keys.shape[0]):
            w = keys[i] >> 6
            m = np.uint64(0)
            for p in range(parts):
                m |= bits[p, w]
                bits[p, w] = 0
            n += _popcount(m)
    return n


@numba.njit(cache=True, nogil=True, inline="always")
def _popcount(x):
    """Set bits of a uint64 (the SWAR sum, which LLVM turns into one popcnt)."""
    x = x - ((x >> np.uint64(1)) & np.uint64(0x5555555555555555))
    x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333))
    x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return np.int64((x * np.uint64(0x0101010101010101)) >> np.uint64(56))
