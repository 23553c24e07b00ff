"""Integer hash indexes for numba kernels: int64 key -> slot, linear probing, backward-shift delete.

Two flavours share ``mix64`` (splitmix64's finaliser):

- ``idx_get`` / ``idx_put`` / ``idx_del``: a key array and a value array, a
  power-of-two size (the training working set's row -> slot index).
- ``fidx_*``: the cache directories' index (``embstore.policies``), one 8-byte
  word an entry, any size, ``index_entries(capacity)`` = 2 x capacity entries
  (load factor <= 1/2): 16 bytes a cache slot. Session 8 (BENCHMARKS.md) cut it
  from 24-48 bytes a slot (a power of two >= 2 x capacity of (int64 key, int32
  slot) pairs in two arrays).

Every function is ``inline="always"`` or ``nogil``: the callers are numba loops
over a batch of keys.
"""

from __future__ import annotations

import numba
import numpy as np

EMPTY = -1
"""An empty index entry (and an empty slot's key in the directories)."""


@numba.njit(cache=True, inline="always")
def mix64(x: np.uint64) -> np.uint64:
    """splitmix64 finaliser: a strong 64-bit mix for hash-table probing."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


# --- hash index: int64 key -> int32 slot, linear probing, backward-shift delete ---

@numba.njit(cache=True, inline="always")
def idx_get(tk, tv, key):
    mask = len(tk) - 1
    i = np.int64(mix64(np.uint64(key)) & np.uint64(mask))
    while True:
        k = tk[i]
        if k == key:
            return np.int64(tv[i])
        if k == EMPTY:
            return np.int64(-1)
        i = (i + 1) & mask


@numba.njit(cache=True, inline="always")
def idx_put(tk, tv, key, val):
    mask = len(tk) - 1
    i = np.int64(mix64(np.uint64(key)) & np.uint64(mask))
    while tk[i] != EMPTY and tk[i] != key:
        i = (i + 1) & mask
    tk[i] = key
    tv[i] = val


@numba.njit(cache=True, nogil=True)
def idx_del(tk, tv, key):
    mask = len(tk) - 1
    i = np.int64(mix64(np.uint64(key)) & np.uint64(mask))
    while tk[i] != key:
        if tk[i] == EMPTY:
            return
        i = (i + 1) & mask
    j = i
    while True:
        j = (j + 1) & mask
        if tk[j] == EMPTY:
            break
        h = np.int64(mix64(np.uint64(tk[j])) & np.uint64(mask))
        if i <= j:
            stays = i < h <= j
        else:
            stays = h > i or h <= j
        if not stays:
            tk[i] = tk[j]
            tv[i] = tv[j]
            i = j
    tk[i] = EMPTY



# --- the cache directory's index: tag + slot in one 8-byte entry ---
#
# An entry is ``tag << shift | slot`` (an int64 >= 0; -1 is empty). When every
# key is known to lie below a limit and its bits and the slot's fit 63 bits, the
# tag is the key itself ("exact"). Otherwise it is a fingerprint, the top 32
# bits of ``mix64(key)``, and a match is confirmed against ``slot_key[slot]``.
# The home position is multiply-shift of the key's fingerprint over any table
# size, computed from the entry alone when deletion shifts entries back.

INDEX_ENTRIES_PER_SLOT = 2.0  # load factor <= 1/2


@numba.njit(cache=True, inline="always")
def fingerprint(key):
    return np.int64(mix64(np.uint64(key)) >> np.uint64(32))


@numba.njit(cache=True, inline="always")
def fp_home(fp, size):
    return np.int64((np.uint64(fp) * np.uint64(size)) >> np.uint64(32))


@numba.njit(cache=True, inline="always")
def _tag_home(tag, limit, size):
    return fp_home(fingerprint(tag) if limit > 0 else tag, size)


@numba.njit(cache=True, inline="always")
def fidx_get(ti, slot_key, key, limit, shift):
    """Slot of ``key`` (-1 if absent). ``limit`` > 0: exact tags, keys below it (others are absent)."""
    size = ti.shape[0]
    if limit > 0:
        if key < 0 or key >= limit:
            return np.int64(-1)
        tag = key
        i = fp_home(fingerprint(key), size)
    else:
        tag = fingerprint(key)
        i = fp_home(tag, size)
    smask = (np.int64(1) << shift) - 1
    while True:
        e = ti[i]
        if (e >> shift) == tag:
            s = e & smask
            if limit > 0 or slot_key[s] == key:
                return s
        if e == EMPTY:
            return np.int64(-1)
        i = i + 1 if i + 1 < size else 0


@numba.njit(cache=True, inline="always")
def fidx_insert(ti, key, slot, limit, shift):
    """Add ``key`` -> ``slot``; the caller knows ``key`` is absent (and below ``limit`` if that is > 0)."""
    size = ti.shape[0]
    tag = key if limit > 0 else fingerprint(key)
    i = _tag_home(tag, limit, size)
    while ti[i] != EMPTY:
        i = i + 1 if i + 1 < size else 0
    ti[i] = (tag << shift) | slot


@numba.njit(cache=True, nogil=True)
def fidx_remove(ti, key, slot, limit, shift):
    """Drop the entry ``key`` -> ``slot`` (matched by its whole bits: no key read); backward-shift delete."""
    size = ti.shape[0]
    tag = key if limit > 0 else fingerprint(key)
    want = (tag << shift) | slot
    i = _tag_home(tag, limit, size)
    while ti[i] != want:
        if ti[i] == EMPTY:
            return
        i = i + 1 if i + 1 < size else 0
    j = i
    while True:
        j = j + 1 if j + 1 < size else 0
        e = ti[j]
        if e == EMPTY:
            break
        h = _tag_home(e >> shift, limit, size)
        if i <= j:
            stays = i < h <= j
        else:
            stays = h > i or h <= j
        if not stays:
            ti[i] = e
            i = j
    ti[i] = EMPTY


def index_tagging(capacity: int, key_limit: int | None) -> tuple[int, int]:
    """(limit, shift) of a directory's index entries: exact keys below ``limit`` with the slot in the low
    ``shift`` bits when both fit 63 bits, else (0, 31): 32-bit fingerprints over 31-bit slots."""
    shift = max(1, int(capacity - 1).bit_length())
    if key_limit is not None and 0 < key_limit and int(key_limit - 1).bit_length() + shift <= 63:
        return int(key_limit), shift
    return 0, 31


def index_entries(capacity: int) -> int:
    """Entries of a directory's index for ``capacity`` slots."""
    return max(16, int(capacity * INDEX_ENTRIES_PER_SLOT) + 1)
