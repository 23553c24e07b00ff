"""Each policy against a ten-line reference implementation: identical hit sequences."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from embstore.policies import (SKETCH_MAX, SKETCH_SAMPLE_PER_SLOT, SKETCH_WIDTH_PER_SLOT, CacheDirectory,
                               DirectDirectory, mix64, simulate)

MASK64 = (1 << 64) - 1
SEEDS = [0x243F6A8885A308D3, 0x13198A2E03707344, 0x2AC2E2B1C9C9A5F1, 0x6A09E667F3BCC908]


def py_mix64(x: int) -> int:
    x &= MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


class RefSketch:
    def __init__(self, capacity: int) -> None:
        self.width = 1 << max(4, (SKETCH_WIDTH_PER_SLOT * capacity - 1).bit_length())
        self.rows = [[0] * self.width for _ in range(4)]
        self.adds, self.sample = 0, SKETCH_SAMPLE_PER_SLOT * capacity

    def add(self, k: int) -> None:
        for r in range(4):
            h = py_mix64(k ^ SEEDS[r]) & (self.width - 1)
            self.rows[r][h] = min(SKETCH_MAX, self.rows[r][h] + 1)
        self.adds += 1
        if self.adds >= self.sample:
            self.rows = [[c >> 1 for c in row] for row in self.rows]
            self.adds //= 2

    def est(self, k: int) -> int:
        return min(self.rows[r][py_mix64(k ^ SEEDS[r]) & (self.width - 1)] for r in range(4))


def ref_run(policy: str, capacity: int, keys: list[int]) -> list[bool]:
    """Per-access reference caches: LRU (OrderedDict), LFU (freq, last use), CLOCK (ring)."""
    base, tiny = policy.split("+")[0], policy.endswith("+tinylfu")
    sk = RefSketch(capacity) if tiny else None
    out, tick = [], 0
    lru: OrderedDict[int, None] = OrderedDict()
    freq: dict[int, tuple[int, int]] = {}
    ring: list[int | None] = [None] * capacity
    refbit = [0] * capacity
    where: dict[int, int] = {}
    hand = 0
    for k in keys:
        tick += 1
        if sk:
            sk.add(k)
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
            if k in freq:
                freq[k] = (freq[k][0] + 1, tick); out.append(True); continue
            if len(freq) >= capacity:
                v = min(freq, key=lambda x: freq[x])
                if sk and sk.est(k) <= sk.est(v):
                    out.append(False); continue
                del freq[v]
            freq[k] = (1, tick)
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
    return out


def zipf_keys(n: int, universe: int, alpha: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, universe + 1, dtype=np.float64)
    p = ranks ** -alpha
    p /= p.sum()
    perm = rng.permutation(universe)
    return perm[rng.choice(universe, size=n, p=p)].astype(np.int64)


POLICIES = ["lru", "lfu", "clock", "lru+tinylfu", "lfu+tinylfu", "clock+tinylfu"]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("capacity", [1, 7, 64])
def test_policy_matches_reference_on_zipf(policy: str, capacity: int) -> None:
    keys = zipf_keys(3000, 500, 1.05, seed=capacity)
    ref = ref_run(policy, capacity, keys.tolist())
    d = CacheDirectory(capacity, policy)
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


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=1, max_size=120), st.integers(1, 12),
       st.sampled_from(["lru", "lfu", "clock"]))
def test_directory_invariants(keys: list[int], capacity: int, policy: str) -> None:
    """Slots stay within capacity, resident keys map to their slots, evictions are reported."""
    d = CacheDirectory(capacity, policy)
    resident: dict[int, int] = {}
    arr = np.array(keys, np.int64)
    for i in range(0, len(arr), 5):
        batch = np.unique(arr[i:i + 5])
        r = d.access(batch)
        for k, s in zip(r.evicted_keys.tolist(), r.evicted_slots.tolist()):
            assert resident.pop(k) == s
        for k, s in zip(batch.tolist(), r.slots.tolist()):
            if s >= 0 and d.slot_key[s] == k:  # a hit may be evicted again later in its own batch
                resident[k] = s
        assert len(resident) == d.resident <= capacity
        assert len(set(resident.values())) == len(resident)
        assert d.lookup(np.array(list(resident), np.int64)).tolist() == list(resident.values())
    gone = np.array(list(resident)[:3], np.int64)
    d.remove(gone)
    assert (d.lookup(gone) == -1).all()
    assert d.resident == len(resident) - len(gone)


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


@given(st.integers(0, 2**63 - 1))
def test_mix64_matches_python_reference(x: int) -> None:
    assert int(mix64(np.uint64(x))) == py_mix64(x)
