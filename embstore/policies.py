"""Cache directories: which row sits in which slot, and which row leaves next.

One numba kernel serves both the store's cache tiers and the trace simulator,
so what ``embstore replay`` predicts is what the store does. A directory maps
keys (int64 row ids >= 0) to slots ``[0, capacity)`` with a linear-probing hash
index, and keeps one policy's bookkeeping per slot:

- ``lru``   a doubly linked recency list over slots (O(1) per access);
- ``lfu``   O(1) LFU: frequency buckets, each a recency list; the victim is the
            least recently used row among the least frequently used;
- ``clock`` one reference bit per slot and a hand (second chance);
- ``+tinylfu`` an admission filter: a count-min sketch of 4 rows x 8 counters
            per cache slot (8 bits, saturating at 255; exactly ``8 * capacity``
            wide, multiply-shift column choice) with *conservative update* (an
            access raises only the counters at the key's current minimum, so
            collisions inflate estimates far less), halved every
            ``100 * capacity`` accesses. A missing row is only admitted when its
            estimate beats the victim's. Wide, slowly aging sketches suit
            embedding traces, whose popularity is stable across batches
            (BENCHMARKS.md); 12 counters per slot measured ~0.2 points closer
            to Belady but 1.5x the bytes and ~30% slower once the sketch
            outgrows L2.
- ``lfu+tinylfu`` is LFU *with history*: a row enters at its sketch estimate
            (not at 1), so its count survives eviction, as in a "perfect LFU"
            that remembers every row; a hit adds one; the admission test
            compares the newcomer's estimate with the victim's frequency; and
            when the sketch halves, every resident frequency halves too (equal
            frequencies merge, lower old frequency first), so residents and
            newcomers stay on one scale and a row that was hot long ago can leave.
            On dlrm-like traces it comes within 0.4 points of an exact
            full-history LFU, the ceiling of online frequency policies there
            (``tools/bench/bench_policies.py``).

``access(keys)`` processes a batch's unique keys one after another, exactly as
a per-access cache would (the reference implementations in the tests are ten
lines each), and reports for every key the slot to read or fill, whether it was
a hit, and which rows resident *before* the batch were evicted (their slots
still hold their bytes until the caller overwrites them). A key inserted and
evicted again within one batch (batches larger than the cache) gets slot -1.

Memory per cache slot (``capacity`` rows; the hash index has 2 x capacity
entries of 8 bytes, a key's tag and its slot in one word: see below):

=============  ====================================================  =========
policy         arrays (bytes per slot)                               total
=============  ====================================================  =========
every policy   index 16, key 8, free list 4, position 4              32
``lru``        + prev/next 8                                         40
``lfu``        + prev/next 8, bucket of slot 4, buckets 28           72
``clock``      + reference bit 1                                     33
``+tinylfu``   + sketch 4 rows x 8 counters x 1 byte                 +32
=============  ====================================================  =========

(Whether a victim was inserted earlier in the same batch is read from the
batch's own outputs at the victim's insertion position, not from a per-slot
batch stamp: 8 bytes a slot less.)

Session 8 (``BENCHMARKS.md``): the index was a power of two >= 2 x capacity
of (int64 key, int32 slot) pairs in two arrays, 24-48 bytes a slot; it is now
exactly 2 x capacity single words, 16 bytes a slot. The policy helpers are
inlined into the access loop (each call used to pass ten arrays and their
reference counts): the access kernel got 1.14-1.36x faster at the same time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from embstore.arrays import Ids
from embstore.config import PolicyKind, PolicySpec
from embstore.prefetch import prefetch_at, prefetch_cell

EMPTY = -1
LRU, LFU, CLOCK = 0, 1, 2
_KIND_CODE = {PolicyKind.LRU: LRU, PolicyKind.LFU: LFU, PolicyKind.CLOCK: CLOCK}

# meta slots
M_NFREE, M_HEAD, M_TAIL, M_BMIN, M_NBFREE, M_HAND, M_SKADDS, M_SKSAMPLE = range(8)

_INDEX_AHEAD = 8  # keys ahead whose hash bucket the access loop prefetches
SKETCH_ROWS = 4
SKETCH_WIDTH_PER_SLOT = 8
SKETCH_SAMPLE_PER_SLOT = 100
SKETCH_MAX = 255

_SK_SEEDS = np.array([0x243F6A8885A308D3, 0x13198A2E03707344, 0x2AC2E2B1C9C9A5F1, 0x6A09E667F3BCC908],
                     dtype=np.uint64)


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
def _fingerprint(key):
    return np.int64(mix64(np.uint64(key)) >> np.uint64(32))


@numba.njit(cache=True, inline="always")
def _fp_home(fp, size):
    return np.int64((np.uint64(fp) * np.uint64(size)) >> np.uint64(32))


@numba.njit(cache=True, inline="always")
def _tag_home(tag, limit, size):
    return _fp_home(_fingerprint(tag) if limit > 0 else tag, size)


@numba.njit(cache=True, inline="always")
def fidx_get(ti, slot_key, key, limit, shift):
    """Slot of ``key`` (-1 if absent). ``limit`` > 0: exact tags, keys below it (others are absent)."""
    size = ti.shape[0]
    if limit > 0:
        if key < 0 or key >= limit:
            return np.int64(-1)
        tag = key
        i = _fp_home(_fingerprint(key), size)
    else:
        tag = _fingerprint(key)
        i = _fp_home(tag, size)
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
    tag = key if limit > 0 else _fingerprint(key)
    i = _tag_home(tag, limit, size)
    while ti[i] != EMPTY:
        i = i + 1 if i + 1 < size else 0
    ti[i] = (tag << shift) | slot


@numba.njit(cache=True, nogil=True)
def fidx_remove(ti, key, slot, limit, shift):
    """Drop the entry ``key`` -> ``slot`` (matched by its whole bits: no key read); backward-shift delete."""
    size = ti.shape[0]
    tag = key if limit > 0 else _fingerprint(key)
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


# --- LRU list / LFU buckets / CLOCK bits ---

@numba.njit(cache=True, inline="always")
def _list_unlink(s, prev, nxt, head_tail, hi, ti):
    p = prev[s]
    n = nxt[s]
    if p >= 0:
        nxt[p] = n
    else:
        head_tail[hi] = n
    if n >= 0:
        prev[n] = p
    else:
        head_tail[ti] = p


@numba.njit(cache=True, inline="always")
def _list_append(s, prev, nxt, head_tail, hi, ti):
    t = head_tail[ti]
    prev[s] = t
    nxt[s] = -1
    if t >= 0:
        nxt[t] = s
    else:
        head_tail[hi] = s
    head_tail[ti] = s


@numba.njit(cache=True, nogil=True, inline="always")
def _lfu_new_bucket(freq, after, bfreq, bht, bprev, bnext, bfree, meta):
    meta[M_NBFREE] -= 1
    b = bfree[meta[M_NBFREE]]
    bfreq[b] = freq
    bht[b, 0] = -1
    bht[b, 1] = -1
    if after < 0:
        bprev[b] = -1
        bnext[b] = meta[M_BMIN]
        if meta[M_BMIN] >= 0:
            bprev[meta[M_BMIN]] = b
        meta[M_BMIN] = b
    else:
        bprev[b] = after
        bnext[b] = bnext[after]
        if bnext[after] >= 0:
            bprev[bnext[after]] = b
        bnext[after] = b
    return b


@numba.njit(cache=True, nogil=True, inline="always")
def _lfu_drop_bucket_if_empty(b, bht, bprev, bnext, bfree, meta):
    if bht[b, 0] >= 0:
        return
    p = bprev[b]
    n = bnext[b]
    if p >= 0:
        bnext[p] = n
    else:
        meta[M_BMIN] = n
    if n >= 0:
        bprev[n] = p
    bfree[meta[M_NBFREE]] = b
    meta[M_NBFREE] += 1


@numba.njit(cache=True, nogil=True, inline="always")
def _policy_hit(kind, s, prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree, ref, meta):
    if kind == LRU:
        _list_unlink(s, prev, nxt, meta, M_HEAD, M_TAIL)
        _list_append(s, prev, nxt, meta, M_HEAD, M_TAIL)
    elif kind == LFU:
        b = sbucket[s]
        nb = bnext[b]
        if nb < 0 or bfreq[nb] != bfreq[b] + 1:
            nb = _lfu_new_bucket(bfreq[b] + 1, b, bfreq, bht, bprev, bnext, bfree, meta)
        _list_unlink(s, prev, nxt, bht[b], 0, 1)
        _list_append(s, prev, nxt, bht[nb], 0, 1)
        sbucket[s] = nb
        _lfu_drop_bucket_if_empty(b, bht, bprev, bnext, bfree, meta)
    else:
        ref[s] = 1


@numba.njit(cache=True, nogil=True, inline="always")
def _policy_insert(kind, s, freq, prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree, ref, meta):
    """Add slot ``s``; LFU files it at frequency ``freq`` (1, or its sketch estimate with TinyLFU)."""
    if kind == LRU:
        _list_append(s, prev, nxt, meta, M_HEAD, M_TAIL)
    elif kind == LFU:
        after = -1
        b = meta[M_BMIN]
        while b >= 0 and bfreq[b] < freq:
            after = b
            b = bnext[b]
        if b < 0 or bfreq[b] != freq:
            b = _lfu_new_bucket(freq, after, bfreq, bht, bprev, bnext, bfree, meta)
        _list_append(s, prev, nxt, bht[b], 0, 1)
        sbucket[s] = b
    else:
        ref[s] = 0


@numba.njit(cache=True, nogil=True, inline="always")
def _policy_remove(kind, s, prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree, ref, meta):
    if kind == LRU:
        _list_unlink(s, prev, nxt, meta, M_HEAD, M_TAIL)
    elif kind == LFU:
        b = sbucket[s]
        _list_unlink(s, prev, nxt, bht[b], 0, 1)
        _lfu_drop_bucket_if_empty(b, bht, bprev, bnext, bfree, meta)
    else:
        ref[s] = 0


@numba.njit(cache=True, nogil=True, inline="always")
def _policy_victim(kind, capacity, bht, ref, meta):
    if kind == LRU:
        return meta[M_HEAD]
    if kind == LFU:
        return bht[meta[M_BMIN], 0]
    while True:
        s = meta[M_HAND]
        meta[M_HAND] = (s + 1) % capacity
        if ref[s]:
            ref[s] = 0
        else:
            return s


@numba.njit(cache=True, inline="always")
def _sk_col(key, r, width):
    """Column of ``key`` in sketch row ``r``: multiply-shift range reduction, any width <= 2**32."""
    h = mix64(np.uint64(key) ^ _SK_SEEDS[r]) >> np.uint64(32)
    return np.int64((h * np.uint64(width)) >> np.uint64(32))


@numba.njit(cache=True, inline="always")
def _sketch_prefetch(sk, key):
    w = sk.shape[1]
    for r in range(SKETCH_ROWS):
        prefetch_cell(sk, r, _sk_col(key, r, w))


@numba.njit(cache=True, nogil=True, inline="always")
def _sketch_add(sk, key, meta):
    """Count one access of ``key`` (conservative update); returns (its estimate now, whether the sketch aged)."""
    w = sk.shape[1]
    c0 = _sk_col(key, 0, w)
    c1 = _sk_col(key, 1, w)
    c2 = _sk_col(key, 2, w)
    c3 = _sk_col(key, 3, w)
    e = min(min(sk[0, c0], sk[1, c1]), min(sk[2, c2], sk[3, c3]))
    if e < SKETCH_MAX:
        if sk[0, c0] == e:
            sk[0, c0] += 1
        if sk[1, c1] == e:
            sk[1, c1] += 1
        if sk[2, c2] == e:
            sk[2, c2] += 1
        if sk[3, c3] == e:
            sk[3, c3] += 1
        e += 1
    est = np.int64(e)
    meta[M_SKADDS] += 1
    if meta[M_SKADDS] < meta[M_SKSAMPLE]:
        return est, False
    for r in range(SKETCH_ROWS):
        for h in range(w):
            sk[r, h] >>= 1
    meta[M_SKADDS] //= 2
    return est >> 1, True


@numba.njit(cache=True, nogil=True)
def _sketch_estimate(sk, key):
    w = sk.shape[1]
    est = 255
    for r in range(SKETCH_ROWS):
        est = min(est, np.int64(sk[r, _sk_col(key, r, w)]))
    return est


@numba.njit(cache=True, nogil=True)
def _lfu_halve(prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree, meta):
    """Halve every bucket's frequency; buckets that meet merge (the lower old frequency's rows first)."""
    last = -1
    b = meta[M_BMIN]
    while b >= 0:
        nb = bnext[b]
        f = bfreq[b] >> 1
        if last >= 0 and bfreq[last] == f:
            s = bht[b, 0]
            while s >= 0:
                sbucket[s] = last
                s = nxt[s]
            t = bht[last, 1]
            h = bht[b, 0]
            nxt[t] = h
            prev[h] = t
            bht[last, 1] = bht[b, 1]
            bnext[last] = nb
            if nb >= 0:
                bprev[nb] = last
            bfree[meta[M_NBFREE]] = b
            meta[M_NBFREE] += 1
        else:
            bfreq[b] = f
            last = b
        b = nb


@numba.njit(cache=True, nogil=True)
def _access_kernel(keys, kind, tiny, capacity, ti, limit, shift, slot_key, free, slot_pos,
                   prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree, ref, sk, meta,
                   out_slot, out_hit, ev_keys, ev_slots):
    """Process ``keys`` in order. Returns (evicted, hits, rejected)."""
    nev = 0
    nhit = 0
    nrej = 0
    freq = np.int64(1)
    size = ti.shape[0]
    n = keys.shape[0]
    for i in range(n):
        if i + _INDEX_AHEAD < n:  # the index outgrows L2 with the cache: ask for a later key's entry now
            prefetch_at(ti, _fp_home(_fingerprint(keys[i + _INDEX_AHEAD]), size))
        if i + _INDEX_AHEAD < n:
            if limit == 0:  # and for the slot key that will confirm a fingerprint match
                fp = _fingerprint(keys[i + _INDEX_AHEAD])
                e = ti[_fp_home(fp, size)]
                if (e >> shift) == fp:
                    prefetch_at(slot_key, e & ((np.int64(1) << shift) - 1))
            if tiny:
                _sketch_prefetch(sk, keys[i + _INDEX_AHEAD])
        k = keys[i]
        if tiny:
            freq, aged = _sketch_add(sk, k, meta)
            if aged and kind == LFU:
                _lfu_halve(prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree, meta)
        s = fidx_get(ti, slot_key, k, limit, shift)
        if s >= 0:
            out_slot[i] = s
            out_hit[i] = True
            nhit += 1
            _policy_hit(kind, s, prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree, ref, meta)
            continue
        out_hit[i] = False
        if meta[M_NFREE] > 0:
            meta[M_NFREE] -= 1
            s = free[meta[M_NFREE]]
        else:
            v = _policy_victim(kind, capacity, bht, ref, meta)
            if tiny:
                vf = bfreq[sbucket[v]] if kind == LFU else _sketch_estimate(sk, slot_key[v])
                if freq <= vf:
                    out_slot[i] = -1
                    nrej += 1
                    continue
            old = slot_key[v]
            fidx_remove(ti, old, v, limit, shift)
            _policy_remove(kind, v, prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree, ref, meta)
            p = slot_pos[v]  # where the victim was inserted; in this batch if that position missed into v
            if p < i and not out_hit[p] and out_slot[p] == v and keys[p] == old:
                out_slot[p] = -1  # inserted earlier in this batch: it never lands
            else:
                ev_keys[nev] = old
                ev_slots[nev] = v
                nev += 1
            s = v
        slot_key[s] = k
        fidx_insert(ti, k, s, limit, shift)
        _policy_insert(kind, s, freq, prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree, ref, meta)
        slot_pos[s] = i
        out_slot[i] = s
    return nev, nhit, nrej


@numba.njit(cache=True, nogil=True)
def _lookup_kernel(keys, ti, limit, shift, slot_key, out):
    size = ti.shape[0]
    n = keys.shape[0]
    for i in range(n):
        if i + _INDEX_AHEAD < n:
            prefetch_at(ti, _fp_home(_fingerprint(keys[i + _INDEX_AHEAD]), size))
        out[i] = fidx_get(ti, slot_key, keys[i], limit, shift)


@numba.njit(cache=True, nogil=True)
def _remove_kernel(keys, kind, ti, limit, shift, slot_key, free, prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree,
                   ref, meta, out_slot):
    for i in range(keys.shape[0]):
        s = fidx_get(ti, slot_key, keys[i], limit, shift)
        out_slot[i] = s
        if s < 0:
            continue
        fidx_remove(ti, keys[i], s, limit, shift)
        _policy_remove(kind, s, prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree, ref, meta)
        slot_key[s] = EMPTY
        free[meta[M_NFREE]] = s
        meta[M_NFREE] += 1


@dataclass(frozen=True)
class AccessResult:
    """What one batch did to a directory; arrays are aligned with the batch's keys.

    ``slots[i]``: where key i's bytes are (hit) or go (miss); -1 when the key
    was rejected by admission or evicted again within the batch.
    ``evicted_keys/evicted_slots``: rows resident before the batch that left;
    their bytes are still in those slots until the caller writes new rows.
    """

    slots: np.ndarray
    hit: np.ndarray
    evicted_keys: np.ndarray
    evicted_slots: np.ndarray
    rejected: int

    @property
    def hits(self) -> int:
        return int(self.hit.sum())


def directory_bytes(capacity: int, policy: PolicySpec | str = "lru") -> int:
    """Bytes a ``CacheDirectory(capacity, policy)`` allocates (the table in the module doc), without
    building one: what a memory budget must set aside beside a partial cache's rows."""
    c = int(capacity)
    if c < 1:
        return 0
    spec = PolicySpec.parse(policy)
    kind = _KIND_CODE[spec.kind]
    n = 8 * index_entries(c) + (8 + 4 + 4) * c + 8 * 8  # index, key, free, position, meta
    n += 8 * c if kind in (LRU, LFU) else 8  # prev/next
    nb = c + 1 if kind == LFU else 1
    n += (4 * c if kind == LFU else 4) + nb * (8 + 8 + 4 + 4 + 4)  # bucket of slot; bucket arrays
    n += c if kind == CLOCK else 1
    n += SKETCH_ROWS * (min(SKETCH_WIDTH_PER_SLOT * c, 1 << 32) if spec.tinylfu else 1)
    return n


MAX_CAPACITY = 2**31 - 1  # rows one CacheDirectory holds at most


class CacheDirectory:
    """A fixed-capacity key -> slot map with an eviction policy (see module doc)."""

    def __init__(self, capacity: int, policy: PolicySpec | str = "lru", key_limit: int | None = None) -> None:
        """``key_limit``: keys are known to lie in ``[0, key_limit)`` (a table's rows), which lets the
        index hold keys themselves instead of fingerprints to confirm (no second memory access)."""
        if capacity < 1:
            raise ValueError(f"capacity must be at least one row, got {capacity}")
        if capacity > MAX_CAPACITY:  # slots are int32 in the lists and 31 bits in a fingerprint entry
            raise ValueError(f"capacity must be at most {MAX_CAPACITY} rows (2**31 - 1) per cache, got {capacity}")
        self.capacity = int(capacity)
        self.policy = PolicySpec.parse(policy)
        self._kind = _KIND_CODE[self.policy.kind]
        c = self.capacity
        self._index = np.full(index_entries(c), EMPTY, np.int64)
        self._limit, self._shift = index_tagging(c, key_limit)
        self.slot_key = np.full(c, EMPTY, np.int64)
        self._free = np.arange(c - 1, -1, -1, dtype=np.int32)  # pops slot 0 first
        self._slot_pos = np.zeros(c, np.int32)
        use_lists = self._kind in (LRU, LFU)
        self._prev = np.full(c if use_lists else 1, -1, np.int32)
        self._nxt = np.full(c if use_lists else 1, -1, np.int32)
        nb = c + 1 if self._kind == LFU else 1
        self._sbucket = np.zeros(c if self._kind == LFU else 1, np.int32)
        self._bfreq = np.zeros(nb, np.int64)
        self._bht = np.full((nb, 2), -1, np.int32)
        self._bprev = np.full(nb, -1, np.int32)
        self._bnext = np.full(nb, -1, np.int32)
        self._bfree = np.arange(nb - 1, -1, -1, dtype=np.int32)
        self._ref = np.zeros(c if self._kind == CLOCK else 1, np.uint8)
        self._sk = np.zeros((SKETCH_ROWS, min(SKETCH_WIDTH_PER_SLOT * c, 1 << 32) if self.policy.tinylfu else 1),
                            np.uint8)
        self._meta = np.zeros(8, np.int64)
        self._meta[M_NFREE] = c
        self._meta[M_HEAD] = self._meta[M_TAIL] = self._meta[M_BMIN] = -1
        self._meta[M_NBFREE] = nb
        self._meta[M_SKSAMPLE] = SKETCH_SAMPLE_PER_SLOT * c

    @property
    def resident(self) -> int:
        return self.capacity - int(self._meta[M_NFREE])

    @property
    def nbytes(self) -> int:
        """Bytes of every array the directory holds (``directory_bytes`` computes it up front)."""
        return sum(a.nbytes for a in vars(self).values() if isinstance(a, np.ndarray))

    def access(self, keys: Ids) -> AccessResult:
        """Look up (and insert on miss) the unique ``keys`` in order; see module doc."""
        keys = np.ascontiguousarray(keys, np.int64)
        n = len(keys)
        if self._limit and n and (int(keys.min()) < 0 or int(keys.max()) >= self._limit):
            raise ValueError(f"keys must lie in [0, {self._limit}) for this directory, got "
                             f"{int(keys.min())}..{int(keys.max())}")
        slots = np.empty(n, np.int64)
        hit = np.empty(n, np.bool_)
        ev_keys = np.empty(n, np.int64)
        ev_slots = np.empty(n, np.int64)
        nev, _, nrej = _access_kernel(
            keys, self._kind, self.policy.tinylfu, self.capacity,
            self._index, self._limit, self._shift, self.slot_key, self._free, self._slot_pos,
            self._prev, self._nxt, self._sbucket, self._bfreq, self._bht, self._bprev, self._bnext,
            self._bfree, self._ref, self._sk, self._meta, slots, hit, ev_keys, ev_slots)
        return AccessResult(slots, hit, ev_keys[:nev], ev_slots[:nev], int(nrej))

    def keys_at(self, slots: np.ndarray) -> np.ndarray:
        """The key each of ``slots`` holds (EMPTY where none)."""
        return self.slot_key[slots]

    def lookup(self, keys: Ids) -> np.ndarray:
        """Slots of ``keys`` (-1 where absent) without touching the policy."""
        out = np.empty(len(keys), np.int64)
        _lookup_kernel(np.ascontiguousarray(keys, np.int64), self._index, self._limit, self._shift, self.slot_key, out)
        return out

    def remove(self, keys: Ids) -> np.ndarray:
        """Drop ``keys``; returns the slots they held (-1 where absent)."""
        out = np.empty(len(keys), np.int64)
        _remove_kernel(np.ascontiguousarray(keys, np.int64), self._kind, self._index, self._limit, self._shift, self.slot_key,
                       self._free, self._prev, self._nxt, self._sbucket, self._bfreq, self._bht, self._bprev,
                       self._bnext, self._bfree, self._ref, self._meta, out)
        return out

    def occupied_slots(self) -> np.ndarray:
        return np.flatnonzero(self.slot_key != EMPTY)


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
        each thread marks a share of the keys in a bitmap of its own: 1.11-1.15
        -> 0.81-0.95 ms for 8 x 82k ids on two cores (BENCHMARKS.md).
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


@numba.njit(cache=True, nogil=True)
def _count_resident_serial(keys, present, check_present, bits):
    """``DirectDirectory.count_resident`` on the calling thread (``bits`` has one row)."""
    n = keys.shape[0]
    stop = _mark_resident(keys, 0, n, present, check_present, bits[0])
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
        stops[p] = _mark_resident(keys, n * p // parts, n * (p + 1) // parts, present, check_present, bits[p])
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
    bitmap when that is cheaper than revisiting the keys' words (a random access each)."""
    parts, words = bits.shape
    n = 0
    if keys.shape[0] * 4 >= words * parts:
        for w in range(words):
            m = np.uint64(0)
            for p in range(parts):
                m |= bits[p, w]
                bits[p, w] = 0
            n += _popcount(m)
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


@numba.njit(cache=True, nogil=True)
def _simulate_kernel(keys, batch_offsets, kind, tiny, capacity, ti, limit, shift, slot_key, free, slot_pos,
                     prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree, ref, sk, meta, hit_out):
    nb = batch_offsets.shape[0] - 1
    max_b = 0
    for b in range(nb):
        max_b = max(max_b, batch_offsets[b + 1] - batch_offsets[b])
    out_slot = np.empty(max_b, np.int64)
    ev_keys = np.empty(max_b, np.int64)
    ev_slots = np.empty(max_b, np.int64)
    total = 0
    for b in range(nb):
        lo = batch_offsets[b]
        hi = batch_offsets[b + 1]
        _, h, _ = _access_kernel(keys[lo:hi], kind, tiny, capacity, ti, limit, shift, slot_key, free, slot_pos,
                                 prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree, ref, sk, meta,
                                 out_slot[: hi - lo], hit_out[lo:hi], ev_keys, ev_slots)
        total += h
    return total


def simulate(keys: Ids, batch_offsets: np.ndarray, capacity: int, policy: PolicySpec | str = "lru") -> np.ndarray:
    """Replay ``keys`` (unique within each batch) through a fresh directory; per-access hit mask.

    The same kernel the store's cache tiers run, driven from numba over the
    whole trace (no Python per batch).
    """
    keys = np.ascontiguousarray(keys, np.int64)
    d = CacheDirectory(capacity, policy, key_limit=int(keys.max()) + 1 if len(keys) and keys.min() >= 0 else None)
    hit = np.zeros(len(keys), np.bool_)
    _simulate_kernel(keys, np.ascontiguousarray(batch_offsets, np.int64), d._kind, d.policy.tinylfu, d.capacity,
                     d._index, d._limit, d._shift, d.slot_key, d._free, d._slot_pos, d._prev, d._nxt, d._sbucket,
                     d._bfreq, d._bht, d._bprev, d._bnext, d._bfree, d._ref, d._sk, d._meta, hit)
    return hit
