"""Belady's MIN against an exhaustive optimum, LRU stack distances against an
OrderedDict LRU, and the sequence helpers (densify, dedup_batches, next_use)."""

from __future__ import annotations

from collections import OrderedDict
from functools import lru_cache

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embstore.belady import belady_hit_mask, belady_hits, belady_mrc, dedup_batches, densify, next_use
from embstore.errors import InvalidInputError, InvalidOffsetsError
from embstore.stackdist import lru_mrc, stack_distances


def brute_optimum(keys: list[int], capacity: int) -> int:
    """Most hits any demand-paging cache of ``capacity`` rows can get: try every eviction choice."""

    @lru_cache(maxsize=None)
    def best(i: int, cache: frozenset[int]) -> int:
        if i == len(keys):
            return 0
        k = keys[i]
        if k in cache:
            return 1 + best(i + 1, cache)
        if len(cache) < capacity:
            return best(i + 1, cache | {k})
        return max(best(i + 1, (cache - {v}) | {k}) for v in cache)

    return best(0, frozenset())


def lru_reference(keys, capacity: int) -> int:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for k in keys:
        if k in cache:
            hits += 1
            cache.move_to_end(k)
        else:
            cache[k] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits


small_traces = st.lists(st.integers(0, 6), min_size=0, max_size=12)


@given(small_traces, st.integers(1, 4))
@settings(max_examples=300)
def test_belady_equals_exhaustive_optimum(keys, capacity):
    assert belady_hits(np.array(keys, dtype=np.int64), capacity) == brute_optimum(keys, capacity)


@given(st.lists(st.integers(-3, 3) | st.integers(2**62, 2**62 + 3), max_size=12), st.integers(1, 4))
@settings(max_examples=100)
def test_belady_with_arbitrary_int64_keys(keys, capacity):
    assert belady_hits(np.array(keys, dtype=np.int64), capacity) == brute_optimum(keys, capacity)


@given(st.lists(st.integers(0, 30), max_size=300), st.integers(0, 40))
@settings(max_examples=150)
def test_belady_never_below_lru_and_mask_is_consistent(keys, capacity):
    k = np.array(keys, dtype=np.int64)
    mask = belady_hit_mask(k, capacity)
    assert mask.sum() == belady_hits(k, capacity) >= lru_reference(keys, capacity)
    is_first = np.zeros(len(keys), dtype=bool)
    is_first[np.unique(k, return_index=True)[1]] = True
    assert not (mask & is_first).any()  # a first access never hits


def test_belady_by_hand():
    # capacity 2, 1 2 3 1 2: at 3 the cache {1, 2} has next uses 1 -> 3, 2 -> 4, so 2 goes;
    # then 1 hits and 2 misses.
    assert belady_hit_mask(np.array([1, 2, 3, 1, 2]), 2).tolist() == [False, False, False, True, False]
    # never-used-again keys go first: at 3 the cache {1, 9} evicts 9 (no future use)
    assert belady_hits(np.array([1, 9, 3, 1, 3]), 2) == 2


@given(st.lists(st.integers(0, 20), max_size=200))
@settings(max_examples=80)
def test_belady_mrc_matches_single_runs_and_grows(keys):
    caps = np.array([0, 1, 2, 3, 5, 8, 13, 21, 100])
    k = np.array(keys, dtype=np.int64)
    mrc = belady_mrc(k, caps)
    assert mrc.tolist() == [belady_hits(k, int(c)) for c in caps]
    assert np.all(np.diff(mrc) >= 0)
    assert mrc[-1] == len(keys) - len(set(keys))


def test_belady_input_errors():
    with pytest.raises(InvalidInputError, match=">= 0"):
        belady_hits(np.array([1, 2]), -1)
    with pytest.raises(InvalidInputError, match="integer"):
        belady_hits(np.array([1.0, 2.0]), 1)
    with pytest.raises(InvalidInputError, match="integer number of rows"):
        belady_hits(np.array([1, 2]), 1.5)
    with pytest.raises(InvalidInputError, match="1-D"):
        belady_hits(np.zeros((2, 2), dtype=np.int64), 1)
    assert belady_hits(np.array([1, 1]), 0) == 0


# --------------------------------------------------------------------------- LRU stack distances


@given(st.lists(st.integers(0, 25), max_size=250))
@settings(max_examples=150)
def test_lru_mrc_equals_ordered_dict_lru_at_every_capacity(keys):
    caps = np.arange(0, 28)
    got = lru_mrc(np.array(keys, dtype=np.int64), caps)
    assert got.tolist() == [lru_reference(keys, int(c)) for c in caps]


@given(st.lists(st.integers(-5, 5) | st.integers(2**40, 2**40 + 2), max_size=60))
@settings(max_examples=100)
def test_stack_distances_by_definition(keys):
    d = stack_distances(np.array(keys, dtype=np.int64))
    for i, k in enumerate(keys):
        prev = [j for j in range(i) if keys[j] == k]
        assert d[i] == (len(set(keys[prev[-1] + 1:i])) if prev else -1)


def test_stack_distances_progress_and_reuse_of_a_pass():
    rng = np.random.default_rng(1)
    keys = rng.integers(0, 500, size=20_000)
    seen = []
    d = stack_distances(keys, progress=seen.append)
    assert sum(seen) == keys.size
    caps = np.array([1, 10, 100, 499, 500])
    assert lru_mrc(keys, caps, distances=d).tolist() == lru_mrc(keys, caps).tolist()
    assert lru_mrc(keys, caps)[-1] == keys.size - np.unique(keys).size


def test_lru_mrc_input_errors():
    with pytest.raises(InvalidInputError, match=">= 0"):
        lru_mrc(np.array([1]), np.array([-1]))
    with pytest.raises(InvalidInputError, match="integer"):
        lru_mrc(np.array([1]), np.array([0.5]))
    assert lru_mrc(np.array([1]), np.array([], dtype=np.int64)).size == 0


# --------------------------------------------------------------------------- sequence helpers


@given(st.lists(st.integers(-2**63, 2**63 - 1) | st.integers(0, 8), max_size=80))
@settings(max_examples=100)
def test_densify_is_a_relabelling(keys):
    k = np.array(keys, dtype=np.int64)
    for compact in (False, True):
        d, num = densify(k, compact=compact)
        assert d.dtype == np.int64 and (d.size == 0 or (d.min() >= 0 and d.max() < num))
        pairs = set(zip(keys, d.tolist()))
        assert len(pairs) == len(set(keys)) == len(set(d.tolist()))  # a bijection on the values present
        if compact:
            assert num == len(set(keys))


@given(st.lists(st.integers(-3, 3) | st.integers(2**50, 2**50 + 1), max_size=60),
       st.lists(st.integers(0, 60), max_size=5))
@settings(max_examples=150)
def test_dedup_batches_against_reference(keys, cuts):
    n = len(keys)
    off = np.array([0, *sorted(min(c, n) for c in cuts), n], dtype=np.int64)
    got_keys, got_off = dedup_batches(np.array(keys, dtype=np.int64), off)
    ref_keys, ref_off = [], [0]
    for b in range(len(off) - 1):
        ref_keys += list(dict.fromkeys(keys[off[b]:off[b + 1]]))
        ref_off.append(len(ref_keys))
    assert got_keys.tolist() == ref_keys and got_off.tolist() == ref_off


def test_dedup_batches_offsets_errors():
    with pytest.raises(InvalidOffsetsError, match="start at 0 and end"):
        dedup_batches(np.array([1, 2]), np.array([0, 1]))
    with pytest.raises(InvalidOffsetsError, match="non-decreasing"):
        dedup_batches(np.array([1, 2]), np.array([0, 2, 1, 2]))


@given(st.lists(st.integers(0, 5), max_size=40))
def test_next_use_by_definition(keys):
    nxt = next_use(np.array(keys, dtype=np.int64))
    n = len(keys)
    for i, k in enumerate(keys):
        later = [j for j in range(i + 1, n) if keys[j] == k]
        assert nxt[i] == (later[0] if later else n + i)


@given(st.lists(st.integers(0, 30), max_size=120),
       st.sampled_from([2**40, 2**62, 2**63 - 1, 2**64 - 1]))
@settings(max_examples=40)
def test_capacities_beyond_the_distinct_keys_take_no_memory_and_hit_every_reaccess(keys, huge):
    """A capacity above the distinct keys is a cache that never evicts; it used to size a histogram
    (lru_mrc: 7 TiB for 2**40 rows) or overflow the numba kernel (belady_hits past int64)."""
    k = np.array(keys, dtype=np.int64)
    every = len(keys) - len(set(keys))
    dtype = np.uint64 if huge > 2**63 - 1 else np.int64
    assert lru_mrc(k, np.array([0, 1, huge], dtype=dtype)).tolist() == [0, lru_reference(keys, 1), every]
    assert belady_mrc(k, np.array([huge], dtype=dtype)).tolist() == [every]
    assert belady_hits(k, huge) == every
    assert int(belady_hit_mask(k, huge).sum()) == every
