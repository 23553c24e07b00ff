"""Announced batches for the cache directories: which future batch uses a row next.

A training pipeline knows its next batches' ids before it reads their rows (its
data loader reads ahead), so a cache need not guess from history alone.
``CacheDirectory.announce(keys)`` tells a directory the distinct keys of the
next batch not yet announced; ``advance()`` says the oldest announced batch is
over. Batches are numbered in announcement order (their *seq*); the batch the
directory is in is the oldest one not yet advanced past (its *clock*).

With announcements a directory ranks its rows as Belady's MIN does inside the
window it was told about, and by its own policy outside it
(``embstore.policies``). A resident row with an announced use waits in a
max-heap keyed by that use's occurrence id: its position in everything
announced, batch by batch and, within a batch, in the order its keys were
given (so announce a batch in the order it will be read). The victim is the
row needed last. A row without an announced use stays in the base policy's
list and leaves before any row with one. A missed row needed later than every
resident (or never, in the window) bypasses the cache once every resident has
an announced use. With no announcement a directory behaves exactly as its
base policy.

Memory, allocated on the first ``announce``: 16 bytes a slot (next use and
saved frequency), a heap of 2 x capacity + 1 entries (16 bytes a slot; stale
entries are skipped and the heap is rebuilt from the live ones when it
fills), and per pending announced occurrence a ring entry (32 bytes: key,
batch, next occurrence of the key, the slot it last ranked) and up to two
entries of a hash map from key to its first and last pending occurrence (48
bytes at load <= 1/2). Each record is one row of a 2-D array, so an access
costs one cache line per structure, and the kernels prefetch the map entries
of keys a few places ahead.

Layout: ``ah`` is a tuple of int64 arrays (indices below), handed to the
numba kernels as one argument.
"""

from __future__ import annotations

import numba
import numpy as np

from embstore.belady import _heap_pop, _heap_push
from embstore.hash_index import EMPTY, mix64
from embstore.prefetch import prefetch_cell

INF = np.int64(1 << 62)
"""The next use of a row no announced batch uses."""

NUSE, SFREQ, HEAP, AMETA, AMAP, OCC = range(6)  # the arrays of ``ah``
A_ON, A_HSIZE, A_CLOCK, A_NSEQ, A_NANN, A_NOCC, A_FIRST = range(7)  # AMETA: on, heap size, current batch,
# next batch to announce, residents with an announced use, next occurrence id, first live occurrence id
K_KEY, K_FIRST, K_LAST = range(3)  # AMAP columns: key (EMPTY: free entry), first pending and last occurrence
O_KEY, O_SEQ, O_NEXT, O_SLOT = range(4)  # OCC columns: key, batch, the key's next occurrence (-1: none yet),
# and the slot of the resident row last ranked by this occurrence (a heap entry is an occurrence id)


def idle_state() -> tuple:
    """The state of a directory nothing was announced to (A_ON = 0: every look-ahead branch is skipped)."""
    one = np.zeros(1, np.int64)
    return (one, one, one, np.zeros(8, np.int64), np.full((1, 3), EMPTY, np.int64), np.zeros((1, 4), np.int64))


def _pow2(n: int) -> int:
    return 1 << max(3, int(n - 1).bit_length())


def start_state(capacity: int, occurrences: int) -> tuple:
    """Arrays for ``capacity`` slots and room for ``occurrences`` pending announced occurrences."""
    ring = _pow2(occurrences)
    meta = np.zeros(8, np.int64)
    meta[A_ON] = 1
    return (np.full(capacity, INF, np.int64), np.zeros(capacity, np.int64), np.zeros(2 * capacity + 1, np.int64),
            meta, np.full((2 * ring, 3), EMPTY, np.int64), np.zeros((ring, 4), np.int64))


FIRST_RING = 256
"""Pending occurrences the first announcement makes room for at least (a ring of 20 KiB)."""


def told_bytes(capacity: int, pending: int) -> int:
    """The most memory the look-ahead state of a directory of ``capacity`` slots holds when at most
    ``pending`` occurrences are pending at once (the distinct ids of the batches announced and not
    advanced past, the one being announced included): the slot arrays and heap (32 bytes a slot), and
    a ring and map of the next power of two of the occurrences (80 bytes an entry; see ``start_state``
    and ``with_room``). What ``embstore tune --announce`` sets aside per told cache."""
    ring = _pow2(max(int(pending), FIRST_RING))
    return 8 * (4 * int(capacity) + 1) + 8 * 8 + ring * (2 * 3 + 4) * 8


def with_room(ah: tuple, more: int) -> tuple:
    """``ah``, or a copy with a larger ring and map, so that ``more`` occurrences can be announced."""
    meta = ah[AMETA]
    live = int(meta[A_NOCC] - meta[A_FIRST])
    if live + more <= len(ah[OCC]):
        return ah
    bigger = start_state(len(ah[NUSE]), live + more)  # the next power of two: at least double when it grows
    for i in (NUSE, SFREQ, HEAP, AMETA):
        bigger[i][:] = ah[i]
    ids = np.arange(meta[A_FIRST], meta[A_NOCC], dtype=np.int64)
    bigger[OCC][ids & (len(bigger[OCC]) - 1)] = ah[OCC][ids & (len(ah[OCC]) - 1)]
    _rehash(ah[AMAP], bigger[AMAP])
    return bigger


@numba.njit(cache=True, inline="always")
def _home(amap, key):
    return np.int64(mix64(np.uint64(key)) & np.uint64(amap.shape[0] - 1))


@numba.njit(cache=True, inline="always")
def map_find(amap, key):
    """The entry of ``key``, or the free entry where it would go (``amap[i, K_KEY] == EMPTY``)."""
    mask = amap.shape[0] - 1
    i = _home(amap, key)
    while amap[i, K_KEY] != EMPTY and amap[i, K_KEY] != key:
        i = (i + 1) & mask
    return i


@numba.njit(cache=True, inline="always")
def map_prefetch(ah, key):
    amap = ah[AMAP]
    prefetch_cell(amap, _home(amap, key), 0)


@numba.njit(cache=True, _nrt=False)  # called from embstore.policies' kernels, which run without NRT
def _map_delete(amap, i):
    """Free entry ``i`` (backward-shift deletion: no tombstones)."""
    mask = amap.shape[0] - 1
    j = i
    while True:
        j = (j + 1) & mask
        if amap[j, K_KEY] == EMPTY:
            break
        h = _home(amap, amap[j, K_KEY])
        stays = (i < h <= j) if i <= j else (h > i or h <= j)
        if not stays:
            for c in range(amap.shape[1]):  # not amap[i, :] = amap[j, :]: a row view needs numba's NRT
                amap[i, c] = amap[j, c]
            i = j
    amap[i, K_KEY] = EMPTY


@numba.njit(cache=True, nogil=True, _nrt=False)
def _rehash(old, new):
    for i in range(old.shape[0]):
        if old[i, K_KEY] != EMPTY:
            j = map_find(new, old[i, K_KEY])
            for c in range(old.shape[1]):
                new[j, c] = old[i, c]


@numba.njit(cache=True, inline="always")
def occ_add(ah, key, seq):
    """Record that batch ``seq`` (the newest) uses ``key``: the new occurrence's id when the key had no pending
    use before (its first pending use now), else -1."""
    meta = ah[AMETA]
    occ = ah[OCC]
    amap = ah[AMAP]
    mask = occ.shape[0] - 1
    o = meta[A_NOCC]
    meta[A_NOCC] = o + 1
    occ[o & mask, O_KEY] = key
    occ[o & mask, O_SEQ] = seq
    occ[o & mask, O_NEXT] = -1
    i = map_find(amap, key)
    if amap[i, K_KEY] == key:
        occ[amap[i, K_LAST] & mask, O_NEXT] = o
        amap[i, K_LAST] = o
        return np.int64(-1)
    amap[i, K_KEY] = key
    amap[i, K_FIRST] = o
    amap[i, K_LAST] = o
    return o


@numba.njit(cache=True, inline="always")
def occ_consume(ah, key, seq):
    """Next use of ``key`` after batch ``seq`` (its occurrence id: ids run in announcement order, batch by
    batch and, within one, in the order its keys were given; INF: none); its use in batch ``seq``, if announced
    and pending, is spent."""
    amap = ah[AMAP]
    i = map_find(amap, key)
    if amap[i, K_KEY] == EMPTY:
        return INF
    occ = ah[OCC]
    mask = occ.shape[0] - 1
    h = amap[i, K_FIRST] & mask
    if occ[h, O_SEQ] != seq:
        return amap[i, K_FIRST]
    n = occ[h, O_NEXT]
    if n < 0:
        _map_delete(amap, i)
        return INF
    amap[i, K_FIRST] = n
    return n


@numba.njit(cache=True, inline="always")
def occ_pending_head(ah, key):
    """The occurrence id of ``key``'s first pending use, -1 when none."""
    amap = ah[AMAP]
    i = map_find(amap, key)
    return amap[i, K_FIRST] if amap[i, K_KEY] == key else np.int64(-1)


@numba.njit(cache=True, inline="always")
def rank_push(ah, s, nu, capacity, slot_key):
    """Rank resident slot ``s`` by its next use, occurrence ``nu`` (< INF), in the heap, rebuilding it from
    live entries when full (a live entry: an occurrence still in the ring whose slot holds a row with that
    ``NUSE``)."""
    heap = ah[HEAP]
    meta = ah[AMETA]
    nuse = ah[NUSE]
    occ = ah[OCC]
    nuse[s] = nu
    occ[nu & (occ.shape[0] - 1), O_SLOT] = s
    if meta[A_HSIZE] == heap.shape[0]:
        size = 0
        for t in range(capacity):
            if slot_key[t] != EMPTY and nuse[t] != INF and t != s:
                size = _heap_push(heap, size, nuse[t])
        meta[A_HSIZE] = size
    meta[A_HSIZE] = _heap_push(heap, meta[A_HSIZE], nu)


@numba.njit(cache=True, inline="always")
def rank_top(ah, capacity, slot_key):
    """The resident row needed last (the heap's live top): its slot. Only called with A_NANN > 0."""
    heap = ah[HEAP]
    meta = ah[AMETA]
    nuse = ah[NUSE]
    occ = ah[OCC]
    while True:
        o = heap[0]
        if o >= meta[A_FIRST]:  # older occurrences left the ring: stale
            s = occ[o & (occ.shape[0] - 1), O_SLOT]
            if slot_key[s] != EMPTY and nuse[s] == o:
                return s
        _, size = _heap_pop(heap, meta[A_HSIZE])
        meta[A_HSIZE] = size


@numba.njit(cache=True, inline="always")
def rank_pop(ah):
    """Drop the heap's top entry (the one ``rank_top`` returned)."""
    meta = ah[AMETA]
    _, size = _heap_pop(ah[HEAP], meta[A_HSIZE])
    meta[A_HSIZE] = size
