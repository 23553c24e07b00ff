"""Each policy against a ten-line reference implementation: identical hit sequences."""

from __future__ import annotations

from collections import OrderedDict

import numba
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from embstore.kernels import kernel_threads
from embstore.direct_directory import DirectDirectory
from embstore.hash_index import mix64
from embstore.policies import (M_BMIN, SKETCH_MAX, SKETCH_SAMPLE_PER_SLOT, SKETCH_WIDTH_PER_SLOT, CacheDirectory,
                               directory_bytes, simulate)

MASK64 = (1 << 64) - 1
SEEDS = [0x243F6A8885A308D3, 0x13198A2E03707344, 0x2AC2E2B1C9C9A5F1, 0x6A09E667F3BCC908]


def py_mix64(x: int) -> int:
    x &= MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def py_unmix64(h: int) -> int:
    """The key whose ``py_mix64`` is ``h`` (splitmix64's finaliser is a bijection)."""
    x = h ^ (h >> 31) ^ (h >> 62)
    x = (x * pow(0x94D049BB133111EB, -1, 1 << 64)) & MASK64
    x = x ^ (x >> 27) ^ (x >> 54)
    x = (x * pow(0xBF58476D1CE4E5B9, -1, 1 << 64)) & MASK64
    return x ^ (x >> 30) ^ (x >> 60)


class RefSketch:
    """Count-min sketch, 4 rows, conservative update (raise only the counters at the minimum)."""

    def __init__(self, capacity: int) -> None:
        self.width = min(SKETCH_WIDTH_PER_SLOT * capacity, 1 << 32)
        self.rows = [[0] * self.width for _ in range(4)]
        self.adds, self.sample = 0, SKETCH_SAMPLE_PER_SLOT * capacity

    def cols(self, k: int) -> list[int]:
        return [((py_mix64(k ^ SEEDS[r]) >> 32) * self.width) >> 32 for r in range(4)]

    def add(self, k: int) -> bool:
        """Count k; True when the sketch aged (every counter halved)."""
        e = self.est(k)
        for r, c in enumerate(self.cols(k)):
            if self.rows[r][c] == e < SKETCH_MAX:
                self.rows[r][c] += 1
        self.adds += 1
        if self.adds < self.sample:
            return False
        self.rows = [[c >> 1 for c in row] for row in self.rows]
        self.adds //= 2
        return True

    def est(self, k: int) -> int:
        return min(self.rows[r][c] for r, c in enumerate(self.cols(k)))


def ref_run(policy: str, capacity: int, keys: list[int], lfu_state: list | None = None) -> list[bool]:
    """Per-access reference caches: LRU (OrderedDict), LFU (frequency -> keys in recency order), CLOCK (ring).

    With TinyLFU a missing key is admitted only when its estimate beats the victim's (for LFU: the victim's
    frequency); LFU then files it at its estimate and halves every frequency when the sketch ages.
    ``lfu_state`` receives LFU's final (frequency, keys from victim side) buckets."""
    base, tiny = policy.split("+")[0], policy.endswith("+tinylfu")
    sk = RefSketch(capacity) if tiny else None
    out = []
    lru: OrderedDict[int, None] = OrderedDict()
    buckets: dict[int, OrderedDict[int, None]] = {}
    freq: dict[int, int] = {}
    ring: list[int | None] = [None] * capacity
    refbit = [0] * capacity
    where: dict[int, int] = {}
    hand = 0
    for k in keys:
        if sk and sk.add(k) and base == "lfu":
            old, buckets = buckets, {}
            for f in sorted(old):
                buckets.setdefault(f >> 1, OrderedDict()).update(old[f])
            freq = {x: f for f, b in buckets.items() for x in b}
        if base == "lru":
            if k in lru:
                lru.move_to_end(k); out.append(True); continue
            if len(lru) >= capacity:
                v = next(iter(lru))
                if sk and sk.est(k) <= sk.est(v):
                    out.append(False); continue
                del lru[v]
            lru[k] = None
        elif base == "lfu":
            hit = k in freq
            if hit or len(freq) >= capacity:
                f = freq[k] if hit else min(buckets)
                v = k if hit else next(iter(buckets[f]))
                if not hit and sk and sk.est(k) <= f:
                    out.append(False); continue
                del buckets[f][v], freq[v]
                if not buckets[f]:
                    del buckets[f]
            freq[k] = freq_k = f + 1 if hit else (sk.est(k) if sk else 1)
            buckets.setdefault(freq_k, OrderedDict())[k] = None
            out.append(hit); continue
        else:
            if k in where:
                refbit[where[k]] = 1; out.append(True); continue
            if len(where) < capacity:
                s = len(where)
            else:
                while refbit[hand]:
                    refbit[hand] = 0; hand = (hand + 1) % capacity
                s, hand = hand, (hand + 1) % capacity
                if sk and sk.est(k) <= sk.est(ring[s]):
                    out.append(False); continue
                del where[ring[s]]
            ring[s], where[k], refbit[s] = k, s, 0
        out.append(False)
    if lfu_state is not None:
        lfu_state.extend((f, list(buckets[f])) for f in sorted(buckets))
    return out


def zipf_keys(n: int, universe: int, alpha: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, universe + 1, dtype=np.float64)
    p = ranks ** -alpha
    p /= p.sum()
    perm = rng.permutation(universe)
    return perm[rng.choice(universe, size=n, p=p)].astype(np.int64)


POLICIES = ["lru", "lfu", "clock", "lru+tinylfu", "lfu+tinylfu", "clock+tinylfu"]


@pytest.mark.parametrize("key_limit", [None, 500])  # fingerprint index / exact keys
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("capacity", [1, 7, 64])
def test_policy_matches_reference_on_zipf(policy: str, capacity: int, key_limit: int | None) -> None:
    keys = zipf_keys(3000, 500, 1.05, seed=capacity)
    ref = ref_run(policy, capacity, keys.tolist())
    d = CacheDirectory(capacity, policy, key_limit=key_limit)
    assert (d._limit > 0) == (key_limit is not None)
    got = [bool(d.access(keys[i:i + 1]).hit[0]) for i in range(len(keys))]
    assert got == ref
    assert 0 < sum(ref) < len(ref)


@pytest.mark.parametrize("policy", POLICIES)
def test_batched_access_equals_sequential(policy: str) -> None:
    """A batch of unique keys behaves exactly like the same keys one at a time."""
    rng = np.random.default_rng(1)
    keys = zipf_keys(4000, 800, 0.9, seed=2)
    bounds = [0]
    while bounds[-1] < len(keys):
        bounds.append(min(len(keys), bounds[-1] + int(rng.integers(1, 40))))
    batches = [np.unique(keys[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    flat = np.concatenate(batches)
    offsets = np.cumsum([0] + [len(b) for b in batches])
    ref = ref_run(policy, 50, flat.tolist())
    d = CacheDirectory(50, policy)
    got = np.concatenate([d.access(b).hit for b in batches])
    assert got.tolist() == ref
    assert simulate(flat, offsets, 50, policy).tolist() == ref


class RefDirectory:
    """``ref_run``'s caches one access at a time, with slots (a free stack, as the directory pops them) and
    ``remove``; ``access`` returns (hit, evicted key or None)."""

    def __init__(self, policy: str, capacity: int) -> None:
        self.base, self.cap = policy.split("+")[0], capacity
        self.sk = RefSketch(capacity) if policy.endswith("+tinylfu") else None
        self.free, self.slot = list(range(capacity - 1, -1, -1)), {}
        self.ring: list[int | None] = [None] * capacity
        self.refbit, self.hand = [0] * capacity, 0
        self.order: OrderedDict[int, None] = OrderedDict()  # lru: recency; lfu: recency within freq
        self.freq: dict[int, int] = {}

    def _victim(self) -> int:
        if self.base == "lru":
            return next(iter(self.order))
        if self.base == "lfu":
            f = min(self.freq.values())
            return next(k for k in self.order if self.freq[k] == f)
        while self.refbit[self.hand]:
            self.refbit[self.hand] = 0
            self.hand = (self.hand + 1) % self.cap
        s, self.hand = self.hand, (self.hand + 1) % self.cap
        return self.ring[s]

    def remove(self, k: int) -> int:
        if k not in self.slot:
            return -1
        s = self.slot.pop(k)
        self.ring[s], self.refbit[s] = None, 0
        self.order.pop(k, None)
        self.freq.pop(k, None)
        self.free.append(s)
        return s

    def access(self, k: int) -> tuple[bool, int | None]:
        if self.sk and self.sk.add(k) and self.base == "lfu":  # halve; equal frequencies merge, lower first
            by_old = sorted(self.order, key=lambda x: self.freq[x])  # stable: recency within a frequency
            self.freq = {x: self.freq[x] >> 1 for x in by_old}
            self.order = OrderedDict.fromkeys(by_old)
        if k in self.slot:
            if self.base == "clock":
                self.refbit[self.slot[k]] = 1
            else:
                self.order.move_to_end(k)
                self.freq[k] = self.freq.get(k, 0) + 1
            return True, None
        ev = None
        if not self.free:
            v = self._victim()
            if self.sk and self.sk.est(k) <= (self.freq[v] if self.base == "lfu" else self.sk.est(v)):
                return False, None
            self.remove(v)
            ev = v
        s = self.free.pop()
        self.slot[k], self.ring[s], self.refbit[s] = s, k, 0
        if self.base != "clock":
            self.order[k] = None
            self.freq[k] = self.sk.est(k) if self.sk and self.base == "lfu" else 1
        return False, ev


def fingerprint_mates(n: int, fp: int = 0x2545F491) -> list[int]:
    """``n`` keys below 2**63 sharing one index fingerprint (top 32 bits of mix64)."""
    return [k for k in (py_unmix64((fp << 32) | low) for low in range(1, 4 * n + 8)) if k < 1 << 63][:n]


KEY_SETS = {  # (keys, key_limit): an exact index at both ends of its range, with entries up to 63 bits wide
    # (58 key bits + up to 5 slot bits); a limit too wide for any slot bits (fingerprints); the top of int64;
    # colliding fingerprints
    "exact": (list(range(24)), 24),
    "exact-wide": ([(1 << 58) - 1 - 3 * i for i in range(23)] + [0], 1 << 58),
    "fingerprint-limit": ([(1 << 62) - i for i in range(23)] + [0], (1 << 62) + 1),
    "int64-top": ([(1 << 63) - 1 - i for i in range(24)], None),
    "fingerprint-mates": (fingerprint_mates(24), None),
}


@settings(max_examples=250, deadline=None)
@given(st.sampled_from(POLICIES), st.sampled_from([1, 2, 3, 8, 16, 23, 24]), st.sampled_from(sorted(KEY_SETS)),
       st.lists(st.tuples(st.sampled_from(["access", "access", "access", "remove", "lookup"]),
                          st.lists(st.integers(0, 23), max_size=9, unique=True)), max_size=60))
def test_access_remove_lookup_interleaved_match_reference(policy: str, capacity: int, key_set: str, ops) -> None:
    """Batches of access, remove and lookup in any order, against a reference with slots: the same hits,
    slots, evicted (key, slot) pairs, removed slots and resident map after every call. Capacities 1 and 2,
    one below the distinct keys (23 of 24) and equal to them; CLOCK's reference bits and LFU's buckets
    after removals; keys at both ends of an exact index's range and in the fingerprint fallback."""
    keys, limit = KEY_SETS[key_set]
    d = CacheDirectory(capacity, policy, key_limit=limit)
    assert (d._limit > 0) == key_set.startswith("exact")
    ref = RefDirectory(policy, capacity)
    for op, idx in ops:
        batch = [keys[i] for i in idx]
        arr = np.array(batch, np.int64)
        if op == "access":
            before = dict(ref.slot)
            r = d.access(arr)
            want = [ref.access(k) for k in batch]
            assert r.hit.tolist() == [h for h, _ in want]
            assert r.slots.tolist() == [before[k] if h else ref.slot.get(k, -1) for k, (h, _) in zip(batch, want)]
            first_out = list(dict.fromkeys(v for _, v in want if v in before))  # reported once, as it was before
            assert sorted(zip(r.evicted_keys.tolist(), r.evicted_slots.tolist())) == sorted(
                (v, before[v]) for v in first_out)
        elif op == "remove":
            assert d.remove(arr).tolist() == [ref.remove(k) for k in batch]
        else:
            assert d.lookup(arr).tolist() == [ref.slot.get(k, -1) for k in batch]
        assert d.resident == len(ref.slot) <= capacity
        assert {int(d.slot_key[s]): s for s in d.occupied_slots().tolist()} == ref.slot


def lfu_buckets(d: CacheDirectory) -> list[tuple[int, list[int]]]:
    """The directory's LFU buckets, lowest frequency first, each's keys from the victim side."""
    out, b = [], int(d._meta[M_BMIN])
    while b >= 0:
        keys, s = [], int(d._bht[b, 0])
        while s >= 0:
            keys.append(int(d.slot_key[s])); s = int(d._nxt[s])
        out.append((int(d._bfreq[b]), keys)); b = int(d._bnext[b])
    return out


@pytest.mark.parametrize("capacity", [3, 16])
def test_lfu_tinylfu_ages_like_reference(capacity: int) -> None:
    """Through many sketch agings (resident frequencies halve, buckets merge) the hit sequence and the
    final (frequency, recency) order of every resident equal the reference's."""
    keys = zipf_keys(12 * SKETCH_SAMPLE_PER_SLOT * capacity, 300, 1.0, seed=capacity)
    state: list = []
    ref = ref_run("lfu+tinylfu", capacity, keys.tolist(), state)
    d = CacheDirectory(capacity, "lfu+tinylfu")
    got = np.concatenate([d.access(np.unique(keys[i:i + 1])).hit for i in range(len(keys))])
    assert got.tolist() == ref
    assert lfu_buckets(d) == state
    assert len(state) > 1 and 0 < sum(ref) < len(ref)


def test_lfu_tinylfu_lets_a_formerly_hot_row_leave() -> None:
    """Resident frequencies age with the sketch: rows hot long ago give way to rows hot now
    (an LFU whose counts never age would keep the old rows forever)."""
    d = CacheDirectory(4, "lfu+tinylfu")
    old, new = np.arange(4, dtype=np.int64), np.arange(10, 14, dtype=np.int64)
    for _ in range(300):
        d.access(old)
    assert sorted(d.slot_key.tolist()) == old.tolist()
    for _ in range(300):
        d.access(new)
    assert sorted(d.slot_key.tolist()) == new.tolist()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=1, max_size=120), st.integers(1, 12),
       st.sampled_from(["lru", "lfu", "clock", "lru+tinylfu", "lfu+tinylfu"]), st.sampled_from([None, 31]))
def test_directory_invariants(keys: list[int], capacity: int, policy: str, key_limit: int | None) -> None:
    """Slots stay within capacity, resident keys map to their slots, evictions are reported."""
    d = CacheDirectory(capacity, policy, key_limit=key_limit)
    resident: dict[int, int] = {}
    arr = np.array(keys, np.int64)
    for i in range(0, len(arr), 5):
        batch = np.unique(arr[i:i + 5])
        r = d.access(batch)
        for k, s in zip(r.evicted_keys.tolist(), r.evicted_slots.tolist()):
            assert resident.pop(k) == s
        for k, s, hit in zip(batch.tolist(), r.slots.tolist(), r.hit.tolist()):
            if s >= 0 and not hit:  # an insert that was evicted again within its batch reports -1
                assert d.slot_key[s] == k
            if s >= 0 and d.slot_key[s] == k:  # a hit may be evicted again later in its own batch
                resident[k] = s
        assert len(resident) == d.resident <= capacity
        assert len(set(resident.values())) == len(resident)
        assert d.lookup(np.array(list(resident), np.int64)).tolist() == list(resident.values())
    gone = np.array(list(resident)[:3], np.int64)
    d.remove(gone)
    assert (d.lookup(gone) == -1).all()
    assert d.resident == len(resident) - len(gone)


@pytest.mark.parametrize("policy", ["lru", "lfu+tinylfu"])
def test_keys_sharing_a_fingerprint_are_told_apart(policy: str) -> None:
    """Keys whose index fingerprints (top 32 bits of mix64) are all equal: one probe chain, every
    match confirmed against the slot's key. Hits, lookups and removals stay exact."""
    fp = 0x9E3779B9
    keys = [k for k in (py_unmix64((fp << 32) | low) for low in range(1, 400)) if k < 1 << 63][:60]
    assert len(keys) == 60 and all(py_mix64(k) >> 32 == fp for k in keys)
    rng = np.random.default_rng(3)
    trace = np.array(keys, np.int64)[rng.integers(0, 60, 2000)]
    d = CacheDirectory(16, policy)
    got = [bool(d.access(trace[i:i + 1]).hit[0]) for i in range(len(trace))]
    assert got == ref_run(policy, 16, trace.tolist())
    resident = [k for k in keys if k in set(d.slot_key.tolist())]
    absent = [k for k in keys if k not in resident]
    assert len(resident) == 16
    slots = d.lookup(np.array(resident + absent, np.int64))
    assert d.slot_key[slots[:16]].tolist() == resident and (slots[16:] == -1).all()
    assert d.remove(np.array(resident[::2], np.int64)).tolist() == slots[:16:2].tolist()
    assert (d.lookup(np.array(resident[::2], np.int64)) == -1).all()
    assert d.slot_key[d.lookup(np.array(resident[1::2], np.int64))].tolist() == resident[1::2]


def test_an_exact_index_refuses_keys_beyond_its_limit() -> None:
    d = CacheDirectory(8, "lru", key_limit=100)
    d.access(np.array([1, 99], np.int64))
    for bad in ([100], [-1], [5, 1000]):
        with pytest.raises(ValueError, match=r"\[0, 100\)"):
            d.access(np.array(bad, np.int64))
    assert d.lookup(np.array([1, 99, 100, -1], np.int64)).tolist()[2:] == [-1, -1]
    assert sorted(d.slot_key[d.lookup(np.array([1, 99], np.int64))].tolist()) == [1, 99]


def test_exact_keys_need_room_beside_the_slot_bits() -> None:
    """Keys and slots that do not fit one word together fall back to fingerprints."""
    assert CacheDirectory(1000, "lru", key_limit=1 << 40)._limit == 1 << 40
    assert CacheDirectory(1000, "lru", key_limit=1 << 62)._limit == 0
    big = np.array([(1 << 62) + 5, 7, (1 << 62) + 5 + (1 << 40)], np.int64)
    d = CacheDirectory(2, "lru", key_limit=(1 << 63) - 1)
    assert d._limit == 0
    assert d.access(big).hit.tolist() == [False, False, False]
    assert d.access(big[1:]).hit.tolist() == [True, True]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("capacity", [1, 5, 1000, 12345])
def test_directory_bytes_predicts_what_a_directory_holds(policy: str, capacity: int) -> None:
    assert CacheDirectory(capacity, policy).nbytes == directory_bytes(capacity, policy)
    assert CacheDirectory(capacity, policy, key_limit=10**6).nbytes == directory_bytes(capacity, policy)


def test_batch_larger_than_cache_cancels_inner_inserts() -> None:
    d = CacheDirectory(4, "lru")
    d.access(np.array([100, 101], np.int64))
    r = d.access(np.arange(10, dtype=np.int64))
    assert sorted(r.evicted_keys.tolist()) == [100, 101]
    landed = r.slots >= 0
    assert landed.sum() == 4 and landed[-4:].all()  # the last four keys stay
    assert sorted(d.slot_key.tolist()) == [6, 7, 8, 9]


def test_direct_directory_never_evicts() -> None:
    d = DirectDirectory(10)
    r = d.access(np.array([3, 5], np.int64))
    assert not r.hit.any() and r.slots.tolist() == [3, 5]
    r = d.access(np.array([5, 9], np.int64))
    assert r.hit.tolist() == [True, False] and d.resident == 3
    assert d.lookup(np.array([3, 4], np.int64)).tolist() == [3, -1]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3000), st.lists(st.integers(0, 10**6), min_size=0, max_size=400), st.integers(0, 3),
       st.sampled_from([1, 2]))
def test_count_resident_counts_distinct_keys(capacity: int, raw: list[int], repeat: int, threads: int) -> None:
    """Both ways of clearing the bitmaps afterwards (few keys: per key; many: whole) leave them zero,
    so the next call counts from scratch; -1 as soon as one key is absent. With two threads each
    marks half the keys in its own bitmap, and a key in both halves still counts once."""
    d = DirectDirectory(capacity)
    keys = np.array([k % capacity for k in raw] * (repeat + 1), np.int64)
    with kernel_threads(1 << 62 if threads > 1 else 0) as n:
        assert n == min(threads, numba.get_num_threads())
        assert d.count_resident(keys, n) == (-1 if len(keys) else 0)
        d.access(np.arange(capacity, dtype=np.int64))
        for _ in range(2):
            assert d.count_resident(keys, n) == len(np.unique(keys))
            assert not d._bits.any()
        d.remove(keys[:1])
        assert d.count_resident(keys, n) == (-1 if len(keys) else 0) and not d._bits.any()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bad", [-1, -(2**40), 10, 2**40])
def test_count_resident_refuses_keys_outside_the_table(bad: int, threads: int) -> None:
    """The count is the resident fast path's only pass over unvalidated ids: an id outside the table
    must give -1 (the caller then raises), never a read outside the presence arrays, and leave the
    bitmaps clear."""
    d = DirectDirectory(10)
    d.access(np.arange(10, dtype=np.int64))
    keys = np.array([1, 2, bad, 3, 4, 4], np.int64)
    with kernel_threads(1 << 62 if threads > 1 else 0) as n:
        assert d.count_resident(keys, n) == -1
        assert not d._bits.any()
        assert d.count_resident(np.array([1, 2, 2, 9], np.int64), n) == 3


@given(st.integers(0, 2**63 - 1))
def test_mix64_matches_python_reference(x: int) -> None:
    assert int(mix64(np.uint64(x))) == py_mix64(x)
