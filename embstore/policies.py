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

The index is ``embstore.hash_index``'s ``fidx_*``; a tier holding its whole table
uses ``embstore.direct_directory.DirectDirectory`` instead. Session 8
(``BENCHMARKS.md``): the policy helpers are inlined into the access loop (each
call used to pass ten arrays and their reference counts), 1.14-1.36x faster.
Inlining alone left them: numba still increfs every array an inlined helper
takes and decrefs it on each way out (the LFU hit path made ~20 out-of-line
atomic ``NRT_incref``/``NRT_decref`` calls per access; its refcount pruning
gives up on branchy code, numba issues #2345 and #2350). So every kernel here
is compiled with ``_nrt=False``, the switch numba's developers point to there:
no reference counting at all. That is safe because the kernels allocate
nothing (scratch comes from the caller) and only borrow arrays the Python
caller holds for the whole call; numba refuses to compile an allocation under
it, so one added later fails loudly. Session 17: LFU replays ran 3-4.6x faster,
announced ones 2-3x, and compiling a kernel per policy stopped paying off.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numba
import numpy as np

from embstore.arrays import Ids
from embstore.config import PolicyKind, PolicySpec
from embstore.errors import InvalidInputError
from embstore.hash_index import EMPTY, fidx_get, fidx_insert, fidx_remove, fingerprint, fp_home, index_entries, \
    index_tagging, mix64
from embstore.lookahead import (AMETA, A_CLOCK, A_FIRST, A_NANN, A_NOCC, A_NSEQ, A_ON, FIRST_RING, INF, NUSE, O_KEY, OCC,
                                 SFREQ, idle_state, map_prefetch, occ_add, occ_consume, occ_pending_head, rank_pop,
                                 rank_push, rank_top, start_state, with_room)
from embstore.prefetch import prefetch_at, prefetch_cell
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
def _policy_victim(kind, capacity, bht, ref, meta, nuse, on):
    """The base policy's victim among the rows it ranks (with announcements: the rows without an announced
    use; CLOCK's hand passes over the others)."""
    if kind == LRU:
        return meta[M_HEAD]
    if kind == LFU:
        return bht[meta[M_BMIN], 0]
    while True:
        s = meta[M_HAND]
        meta[M_HAND] = (s + 1) % capacity
        if ref[s]:
            ref[s] = 0
        elif not (on and nuse[s] != INF):
            return s


# --- announced batches (embstore.lookahead): rows with an announced use leave the base policy's lists ---

@numba.njit(cache=True, nogil=True, inline="always")
def _announce_row(kind, s, nu, capacity, slot_key, prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree, ref, meta, ah):
    """Resident slot ``s``, ranked by its base policy so far, now has an announced use: occurrence ``nu``."""
    if kind == LFU:
        ah[SFREQ][s] = bfreq[sbucket[s]]
    _policy_remove(kind, s, prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree, ref, meta)
    ah[AMETA][A_NANN] += 1
    rank_push(ah, s, nu, capacity, slot_key)


@numba.njit(cache=True, nogil=True, inline="always")
def _rerank(kind, s, nu, freq, capacity, slot_key, prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree, ref, meta,
            ah):
    """Resident slot ``s`` had an announced use that is spent; ``nu`` is its next one (INF: none, and the
    row goes back to its base policy, LFU at frequency ``freq``)."""
    if nu != INF:
        rank_push(ah, s, nu, capacity, slot_key)
        return
    ah[NUSE][s] = INF
    ah[AMETA][A_NANN] -= 1
    _policy_insert(kind, s, freq, prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree, ref, meta)


@numba.njit(cache=True, nogil=True, inline="always")
def _unrank(kind, s, on, prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree, ref, meta, ah):
    """Resident slot ``s`` loses its row (evicted or removed): it leaves the heap's live entries, or its base
    policy's list."""
    if on and ah[NUSE][s] != INF:
        ah[NUSE][s] = INF
        ah[AMETA][A_NANN] -= 1
    else:
        _policy_remove(kind, s, prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree, ref, meta)


@numba.njit(cache=True, nogil=True, _nrt=False)  # no reference counts: see the module docstring
def _halve_saved(ah, capacity):
    """The sketch aged: the saved LFU frequencies of rows waiting for an announced use halve too."""
    nuse = ah[NUSE]
    sfreq = ah[SFREQ]
    for t in range(capacity):
        if nuse[t] != INF:
            sfreq[t] >>= 1


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


@numba.njit(cache=True, nogil=True, _nrt=False)  # no reference counts: see the module docstring
def _sketch_estimate(sk, key):
    w = sk.shape[1]
    est = 255
    for r in range(SKETCH_ROWS):
        est = min(est, np.int64(sk[r, _sk_col(key, r, w)]))
    return est


@numba.njit(cache=True, nogil=True, _nrt=False)  # no reference counts: see the module docstring
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


@numba.njit(cache=True, nogil=True, inline="always")
def _access_body(keys, kind, tiny, on, capacity, ti, limit, shift, slot_key, free, slot_pos,
                 prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree, ref, sk, meta, ah,
                 out_slot, out_hit, ev_keys, ev_slots):
    """Process ``keys`` in order. Returns (evicted, hits, rejected). ``on``: announcements are allocated.
    Inlined into each kernel, so a caller passing constants gets the other branches compiled away."""
    nev = 0
    nhit = 0
    nrej = 0
    freq = np.int64(1)
    clock = ah[AMETA][A_CLOCK]
    nuse = ah[NUSE]
    size = ti.shape[0]
    n = keys.shape[0]
    for i in range(n):
        if i + _INDEX_AHEAD < n:  # the index outgrows L2 with the cache: ask for a later key's entry now
            prefetch_at(ti, fp_home(fingerprint(keys[i + _INDEX_AHEAD]), size))
        if i + _INDEX_AHEAD < n:
            if limit == 0:  # and for the slot key that will confirm a fingerprint match
                fp = fingerprint(keys[i + _INDEX_AHEAD])
                e = ti[fp_home(fp, size)]
                if (e >> shift) == fp:
                    prefetch_at(slot_key, e & ((np.int64(1) << shift) - 1))
            if tiny:
                _sketch_prefetch(sk, keys[i + _INDEX_AHEAD])
            if on:
                map_prefetch(ah, keys[i + _INDEX_AHEAD])
        k = keys[i]
        if tiny:
            freq, aged = _sketch_add(sk, k, meta)
            if aged and kind == LFU:
                _lfu_halve(prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree, meta)
                if on:
                    _halve_saved(ah, capacity)
        nu = occ_consume(ah, k, clock) if on else INF  # the row's next announced use after this batch
        s = fidx_get(ti, slot_key, k, limit, shift)
        if s >= 0:
            out_slot[i] = s
            out_hit[i] = True
            nhit += 1
            if on and nuse[s] != INF:
                ah[SFREQ][s] += 1
                _rerank(kind, s, nu, ah[SFREQ][s], capacity, slot_key, prev, nxt, sbucket, bfreq, bht, bprev,
                        bnext, bfree, ref, meta, ah)
                if kind == CLOCK and nu == INF:
                    ref[s] = 1
            else:
                _policy_hit(kind, s, prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree, ref, meta)
            continue
        out_hit[i] = False
        if meta[M_NFREE] > 0:
            meta[M_NFREE] -= 1
            s = free[meta[M_NFREE]]
        else:
            if on and ah[AMETA][A_NANN] >= capacity:  # every resident is needed in the window: MIN's choice
                v = rank_top(ah, capacity, slot_key)
                if nu >= nuse[v]:  # needed no sooner than the row needed last: bypass
                    out_slot[i] = -1
                    nrej += 1
                    continue
                rank_pop(ah)
            else:
                v = _policy_victim(kind, capacity, bht, ref, meta, nuse, on)
                if tiny and nu == INF:  # a row with an announced use is admitted over one without
                    vf = bfreq[sbucket[v]] if kind == LFU else _sketch_estimate(sk, slot_key[v])
                    if freq <= vf:
                        out_slot[i] = -1
                        nrej += 1
                        continue
            old = slot_key[v]
            fidx_remove(ti, old, v, limit, shift)
            _unrank(kind, v, on, prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree, ref, meta, ah)
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
        if nu != INF:
            ah[SFREQ][s] = freq
            ah[AMETA][A_NANN] += 1
            rank_push(ah, s, nu, capacity, slot_key)
        else:
            _policy_insert(kind, s, freq, prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree, ref, meta)
        slot_pos[s] = i
        out_slot[i] = s
    return nev, nhit, nrej


@numba.njit(cache=True, nogil=True, _nrt=False)  # no reference counts: see the module docstring
def _access_kernel(keys, kind, tiny, capacity, ti, limit, shift, slot_key, free, slot_pos, prev, nxt, sbucket, bfreq,
                   bht, bprev, bnext, bfree, ref, sk, meta, ah, out_slot, out_hit, ev_keys, ev_slots):
    """The store's access loop: one kernel for every policy (the policy passed at run time costs nothing
    measurable since the kernels run without reference counts; BENCHMARKS.md, simulator, session 17)."""
    return _access_body(keys, kind, tiny, ah[AMETA][A_ON] != 0, capacity, ti, limit, shift, slot_key, free,
                        slot_pos, prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree, ref, sk, meta, ah, out_slot,
                        out_hit, ev_keys, ev_slots)


@numba.njit(cache=True, nogil=True, _nrt=False)  # no reference counts: see the module docstring
def _lookup_kernel(keys, ti, limit, shift, slot_key, out):
    size = ti.shape[0]
    n = keys.shape[0]
    for i in range(n):
        if i + _INDEX_AHEAD < n:
            prefetch_at(ti, fp_home(fingerprint(keys[i + _INDEX_AHEAD]), size))
        out[i] = fidx_get(ti, slot_key, keys[i], limit, shift)


@numba.njit(cache=True, nogil=True, _nrt=False)  # no reference counts: see the module docstring
def _remove_kernel(keys, kind, ti, limit, shift, slot_key, free, prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree,
                   ref, meta, ah, out_slot):
    on = ah[AMETA][A_ON] != 0
    for i in range(keys.shape[0]):
        s = fidx_get(ti, slot_key, keys[i], limit, shift)
        out_slot[i] = s
        if s < 0:
            continue
        fidx_remove(ti, keys[i], s, limit, shift)
        _unrank(kind, s, on, prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree, ref, meta, ah)
        slot_key[s] = EMPTY
        free[meta[M_NFREE]] = s
        meta[M_NFREE] += 1


@numba.njit(cache=True, nogil=True, _nrt=False)  # no reference counts: see the module docstring
def _announce_kernel(keys, kind, capacity, ti, limit, shift, slot_key, prev, nxt, sbucket, bfreq, bht, bprev, bnext,
                     bfree, ref, meta, ah):
    """Batch ``A_NSEQ`` (the next one announced) uses the distinct ``keys``."""
    seq = ah[AMETA][A_NSEQ]
    n = keys.shape[0]
    for i in range(n):
        if i + _INDEX_AHEAD < n:
            map_prefetch(ah, keys[i + _INDEX_AHEAD])
            prefetch_at(ti, fp_home(fingerprint(keys[i + _INDEX_AHEAD]), ti.shape[0]))
        k = keys[i]
        o = occ_add(ah, k, seq)
        if o >= 0:  # its first pending use: a resident row starts waiting for it
            s = fidx_get(ti, slot_key, k, limit, shift)
            if s >= 0:
                _announce_row(kind, s, o, capacity, slot_key, prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree,
                              ref, meta, ah)
    ah[AMETA][A_NSEQ] = seq + 1


@numba.njit(cache=True, nogil=True, _nrt=False)  # no reference counts: see the module docstring
def _advance_kernel(lo, hi, kind, capacity, ti, limit, shift, slot_key, prev, nxt, sbucket, bfreq, bht, bprev, bnext,
                    bfree, ref, meta, ah):
    """Batch ``A_CLOCK`` (its occurrences ``[lo, hi)``) is over: the uses of it no access spent are dropped."""
    am = ah[AMETA]
    clock = am[A_CLOCK]
    occ = ah[OCC]
    mask = occ.shape[0] - 1
    for o in range(lo, hi):
        k = occ[o & mask, O_KEY]
        if occ_pending_head(ah, k) != o:  # spent by an access
            continue
        nu = occ_consume(ah, k, clock)
        s = fidx_get(ti, slot_key, k, limit, shift)
        if s >= 0:
            _rerank(kind, s, nu, ah[SFREQ][s], capacity, slot_key, prev, nxt, sbucket, bfreq, bht, bprev, bnext,
                    bfree, ref, meta, ah)
    am[A_FIRST] = hi
    am[A_CLOCK] = clock + 1


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
        self._ah = idle_state()  # announced batches (embstore.lookahead), allocated by the first announce
        self._batch_ends: collections.deque[int] = collections.deque()  # occurrence id past each pending batch

    @property
    def resident(self) -> int:
        return self.capacity - int(self._meta[M_NFREE])

    @property
    def nbytes(self) -> int:
        """Bytes of every array the directory holds (``directory_bytes`` computes it up front, without the
        look-ahead arrays a first ``announce`` allocates)."""
        own = sum(a.nbytes for a in vars(self).values() if isinstance(a, np.ndarray))
        return own + (sum(a.nbytes for a in self._ah) if self._ah[AMETA][A_ON] else 0)

    @property
    def announced(self) -> int:
        """Announced batches not yet advanced past (the current one included)."""
        return len(self._batch_ends)

    def _keys(self, keys: Ids) -> np.ndarray:
        keys = np.ascontiguousarray(keys, np.int64)
        if self._limit and len(keys) and (int(keys.min()) < 0 or int(keys.max()) >= self._limit):
            raise ValueError(f"keys must lie in [0, {self._limit}) for this directory, got "
                             f"{int(keys.min())}..{int(keys.max())}")
        return keys

    def access(self, keys: Ids) -> AccessResult:
        """Look up (and insert on miss) the unique ``keys`` in order; see module doc."""
        keys = self._keys(keys)
        n = len(keys)
        slots = np.empty(n, np.int64)
        hit = np.empty(n, np.bool_)
        ev_keys = np.empty(n, np.int64)
        ev_slots = np.empty(n, np.int64)
        nev, _, nrej = _access_kernel(
            keys, self._kind, self.policy.tinylfu, self.capacity,
            self._index, self._limit, self._shift, self.slot_key, self._free, self._slot_pos,
            self._prev, self._nxt, self._sbucket, self._bfreq, self._bht, self._bprev, self._bnext,
            self._bfree, self._ref, self._sk, self._meta, self._ah, slots, hit, ev_keys, ev_slots)
        return AccessResult(slots, hit, ev_keys[:nev], ev_slots[:nev], int(nrej))

    def announce(self, keys: Ids) -> None:
        """The next batch not yet announced uses the *distinct* ``keys`` (``embstore.lookahead``): until
        ``advance`` passes it, rows are ranked by their next announced use."""
        keys = self._keys(keys)
        if not self._limit and (keys == EMPTY).any():  # (with a key limit, _keys refused every key < 0)
            raise ValueError(f"key {EMPTY} cannot be announced: it marks an empty entry of the occurrence map")
        if not self._ah[AMETA][A_ON]:
            self._ah = start_state(self.capacity, max(len(keys), FIRST_RING))
        self._ah = with_room(self._ah, len(keys))
        _announce_kernel(keys, self._kind, self.capacity, self._index, self._limit, self._shift, self.slot_key,
                         self._prev, self._nxt, self._sbucket, self._bfreq, self._bht, self._bprev, self._bnext,
                         self._bfree, self._ref, self._meta, self._ah)
        self._batch_ends.append(int(self._ah[AMETA][A_NOCC]))

    def advance(self) -> bool:
        """The oldest announced batch is over (uses of it no access spent are dropped); False when none
        is pending."""
        if not self._batch_ends:
            return False
        hi = self._batch_ends.popleft()
        _advance_kernel(int(self._ah[AMETA][A_FIRST]), hi, self._kind, self.capacity, self._index, self._limit,
                        self._shift, self.slot_key, self._prev, self._nxt, self._sbucket, self._bfreq, self._bht,
                        self._bprev, self._bnext, self._bfree, self._ref, self._meta, self._ah)
        return True

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
                       self._bnext, self._bfree, self._ref, self._meta, self._ah, out)
        return out

    def occupied_slots(self) -> np.ndarray:
        return np.flatnonzero(self.slot_key != EMPTY)


@numba.njit(cache=True, nogil=True, inline="always")
def _simulate_body(keys, batch_offsets, ann_keys, ann_offsets, ahead, on, kind, tiny, capacity, ti, limit,
                   shift, slot_key, free, slot_pos, prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree, ref, sk,
                   meta, ah, hit_out, scratch):
    """Every batch through ``_access_body``; ``on``: each batch is announced ``ahead`` batches early.
    ``scratch``: three rows as long as the longest batch, from the caller (no allocation in here; and one
    argument, not three: CPython passes a call of 30 or more arguments as ``*args``, which numba cannot
    inline)."""
    nb = batch_offsets.shape[0] - 1
    out_slot = scratch[0]
    ev_keys = scratch[1]
    ev_slots = scratch[2]
    total = 0
    told = 0  # batches announced so far
    for b in range(nb):
        while on and told <= b + ahead and told < nb:
            _announce_kernel(ann_keys[ann_offsets[told]:ann_offsets[told + 1]], kind, capacity, ti, limit, shift,
                             slot_key, prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree, ref, meta, ah)
            told += 1
        lo = batch_offsets[b]
        hi = batch_offsets[b + 1]
        _, h, _ = _access_body(keys[lo:hi], kind, tiny, on, capacity, ti, limit, shift, slot_key, free,
                                slot_pos, prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree, ref, sk, meta, ah,
                                out_slot[: hi - lo], hit_out[lo:hi], ev_keys, ev_slots)
        if on:
            _advance_kernel(ann_offsets[b], ann_offsets[b + 1], kind, capacity, ti, limit, shift, slot_key, prev, nxt,
                            sbucket, bfreq, bht, bprev, bnext, bfree, ref, meta, ah)
        total += h
    return total


@numba.njit(cache=True, nogil=True, _nrt=False)  # no reference counts: see the module docstring
def _simulate_kernel(keys, batch_offsets, ann_keys, ann_offsets, ahead, kind, tiny, capacity, ti, limit, shift,
                     slot_key, free, slot_pos, prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree, ref, sk, meta, ah,
                     hit_out, scratch):
    """Any policy; ``ahead`` >= 0: each batch is announced that many batches early, -1: told nothing."""
    return _simulate_body(keys, batch_offsets, ann_keys, ann_offsets, ahead, ahead >= 0, kind, tiny, capacity, ti,
                          limit, shift, slot_key, free, slot_pos, prev, nxt, sbucket, bfreq, bht, bprev, bnext, bfree,
                          ref, sk, meta, ah, hit_out, scratch)


def simulate(keys: Ids, batch_offsets: np.ndarray, capacity: int, policy: PolicySpec | str = "lru", *,
             announce: int | None = None, announced: tuple[Ids, np.ndarray] | None = None) -> np.ndarray:
    """Replay ``keys`` (unique within each batch) through a fresh directory; per-access hit mask.

    The same kernel the store's cache tiers run, driven from numba over the
    whole trace (no Python per batch). ``announce=K``: before each batch is
    accessed, it and the K batches after it have been announced, and the
    directory advances past it afterwards, as ``Table.announce``/``advance``
    do in the store. ``announced`` = (keys, offsets) of what is announced per
    batch when it differs from what is accessed (a lower cache level sees only
    the misses above it but is told whole batches); by default the batches
    themselves.
    """
    keys = np.ascontiguousarray(keys, np.int64)
    off = np.ascontiguousarray(batch_offsets, np.int64)
    ann_keys, ann_off = (keys, off) if announced is None else (np.ascontiguousarray(announced[0], np.int64),
                                                               np.ascontiguousarray(announced[1], np.int64))
    if ann_off.shape != off.shape:
        raise ValueError(f"announced batches ({len(ann_off) - 1}) must match the accessed ones ({len(off) - 1})")
    both = np.concatenate([keys, ann_keys]) if announce is not None and announced is not None else keys
    d = CacheDirectory(capacity, policy, key_limit=int(both.max()) + 1 if len(both) and both.min() >= 0 else None)
    ahead = -1
    if announce is not None:
        ahead = int(announce)
        if ahead < 0:
            raise ValueError(f"announce must be >= 0 batches, got {announce}")
        ahead = min(ahead, len(ann_off))  # told past the last batch is told to the end (and fits an int64)
        if (ann_keys == EMPTY).any():  # the occurrence map would take it for a free entry: wrong hits
            raise InvalidInputError(f"key {EMPTY} cannot be announced (it marks an empty entry); replay keys >= 0")
        window = ann_off[np.minimum(np.arange(len(ann_off)) + ahead + 1, len(ann_off) - 1)] - ann_off
        d._ah = start_state(d.capacity, int(window.max(initial=0)) + 1)
    hit = np.zeros(len(keys), np.bool_)
    longest = int(np.diff(off).max(initial=0))
    arrays = (d.capacity, d._index, d._limit, d._shift, d.slot_key, d._free, d._slot_pos, d._prev, d._nxt,
              d._sbucket, d._bfreq, d._bht, d._bprev, d._bnext, d._bfree, d._ref, d._sk, d._meta, d._ah, hit,
              np.empty((3, longest), np.int64))
    _simulate_kernel(keys, off, ann_keys, ann_off, ahead, d._kind, d.policy.tinylfu, *arrays)
    return hit
