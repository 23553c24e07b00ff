"""The synthetic rank -> id scrambles are bijections for every id space up to 2**63 - 1, and scrambled there.

``SyntheticClicks`` maps rank r of table t to ``(r * mult + t * 977) mod n`` and the trace generator to
``(a * r + b[t]) mod m``. Both used to form the product in 64 bits: above ~2**64 / 2654435761 ids the
synthetic product wrapped (two ranks shared an id), and above 2**62 / 3 ids the generator forced a = 1 (a
rotation: hot ranks were adjacent ids; above 2**50 it now draws a from the whole space). Where the old code
was exact (the generator: up to 2**50 ids) its output must not move (recorded benchmarks and traces depend
on it): the old formulas are written out here as the reference, and digests
of a few small-space batches and traces taken before the change pin them. Exact arithmetic: Python ints.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import typed, types

from embstore import tracegen
from embstore.errors import InvalidInputError
from embstore.modmath import addmod, affine_mod, mulmod
from embstore.training.data import SyntheticClicks, _synthetic_ids

INT64_MAX = 2**63 - 1
P, M31 = 2654435761, 2**31 - 1  # the synthetic multipliers (both prime)
PRIMES = [2, 3, 8191, M31, P, 4294967291, 2**61 - 1, 1537228672809129233, 4611686018427387847,
          9223372036854775783]
ROTATION_LIMIT = 1 << 50  # above it the draw takes any unit (the old one had < 4096, above 2**62 / 3 only a = 1)


def _multiples(k: int) -> st.SearchStrategy[int]:
    return st.integers(1, INT64_MAX // k).map(lambda i: i * k)


SPACES = st.one_of(
    st.integers(1, INT64_MAX),
    st.integers(INT64_MAX - 2**20, INT64_MAX),
    st.integers(ROTATION_LIMIT - 2**10, ROTATION_LIMIT + 2**10),
    st.integers(0, 62).map(lambda e: 1 << e),
    _multiples(P), _multiples(M31), _multiples(P * M31),
    st.sampled_from(PRIMES + [P * M31, INT64_MAX, 2 * P, 3 * M31]),
)
SEEDS = st.integers(0, 2**32)


def _ranks(data: st.DataObject, m: int) -> list[int]:
    """Edge ranks plus sampled ones, distinct."""
    edges = [0, 1, 2, m // 2, m - 2, m - 1]
    return sorted({r for r in edges if 0 <= r < m} | set(data.draw(st.lists(st.integers(0, m - 1), max_size=40))))


def _circular_gap(x: int, y: int, m: int) -> int:
    d = (x - y) % m
    return min(d, m - d)


def _digest(*arrays: np.ndarray) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------- the shared arithmetic
@given(SPACES, st.data())
@settings(max_examples=300, deadline=None)
def test_mulmod_and_affine_mod_are_exact_for_any_modulus(m, data):
    a, r, c = (data.draw(st.integers(0, m - 1)) for _ in range(3))
    assert mulmod(np.int64(a), np.int64(r), np.int64(m)) == a * r % m
    big = data.draw(st.integers(0, INT64_MAX))  # a multiplier above m (data's 4294967291 may pass a space)
    assert mulmod(np.int64(big), np.int64(r), np.int64(m)) == big * r % m
    assert addmod(np.int64(a), np.int64(c), np.int64(m)) == (a + c) % m
    ranks = _ranks(data, m)
    for mult in (a, big):
        got = affine_mod(mult, np.array(ranks, dtype=np.int64), c, m)
        assert got.dtype == np.int64 and got.tolist() == [(mult * x + c) % m for x in ranks]


# --------------------------------------------------------------------------- tracegen
def _old_draw(m: int, tables: int, rng: np.random.Generator) -> tuple[int, np.ndarray]:
    """The draw before the fix (the reference wherever it gave a > 1 a chance)."""
    top = max(2, min(m, (1 << 62) // m))
    a = 1
    for _ in range(64):
        cand = int(rng.integers(1, top))
        if math.gcd(cand, m) == 1:
            a = cand
            break
    return a, rng.integers(0, m, size=tables, dtype=np.int64)


def _old_call(a: int, b: np.ndarray, m: int, ranks: np.ndarray, tab: np.ndarray) -> np.ndarray:
    x = (np.int64(a) * ranks) % np.int64(m)
    gap = np.int64(m) - b[tab]
    return np.where(x >= gap, x - gap, x + b[tab])


def _kernel_ids(perm: tracegen._Permutation, ranks: np.ndarray, tab: np.ndarray) -> np.ndarray:
    """The drift kernel's ids when nothing is replaced (keep = 1): its affine base map (``_affine``)."""
    pair = types.UniTuple(types.int64, 2)
    moved = typed.Dict.empty(key_type=pair, value_type=types.int64)
    checked = typed.Dict.empty(key_type=pair, value_type=types.int64)
    return tracegen._drifted_ids(ranks, tab.astype(np.int32), np.int64(1), 1.0, np.int64(perm.a), perm.b,
                                 np.int64(perm.m), moved, checked, 0)


@given(SPACES, SEEDS, st.data())
@settings(max_examples=300, deadline=None)
def test_the_trace_permutation_is_an_exact_bijection_for_any_id_space(m, seed, data):
    """a is a unit mod m and ids are (a * r + b[t]) mod m exactly, in numpy and in the drift kernel: distinct
    ranks of a table get distinct ids in [0, m)."""
    perm = tracegen._Permutation.draw(m, 2, np.random.default_rng(seed))
    assert math.gcd(perm.a, m) == 1 and 0 <= perm.a < max(m, 2)
    ranks = _ranks(data, m)
    for t in (0, 1):
        r, tab = np.array(ranks, dtype=np.int64), np.full(len(ranks), t, dtype=np.int64)
        want = [(perm.a * x + int(perm.b[t])) % m for x in ranks]
        ids = perm(r, tab)
        assert ids.tolist() == want
        assert _kernel_ids(perm, r, tab).tolist() == want
        assert len(set(ids.tolist())) == len(ranks) and ids.min() >= 0 and ids.max() < m


@given(st.one_of(st.integers(1, ROTATION_LIMIT), st.integers(ROTATION_LIMIT - 2**10, ROTATION_LIMIT),
                 st.integers(0, 50).map(lambda e: 1 << e), st.sampled_from([p for p in PRIMES if p <= ROTATION_LIMIT])),
       SEEDS, st.data())
@settings(max_examples=300, deadline=None)
def test_the_trace_permutation_of_a_space_without_overflow_is_unchanged(m, seed, data):
    """Up to 2**50 ids the draw takes the same multiplier and offsets from the same random stream (and
    leaves it in the same state), and maps ranks as the old formula did."""
    rng_new, rng_old = np.random.default_rng(seed), np.random.default_rng(seed)
    perm = tracegen._Permutation.draw(m, 3, rng_new)
    a, b = _old_draw(m, 3, rng_old)
    assert perm.a == a and np.array_equal(perm.b, b)
    assert rng_new.integers(0, 2**62) == rng_old.integers(0, 2**62)
    ranks = np.array(_ranks(data, m), dtype=np.int64)
    tab = np.arange(ranks.size, dtype=np.int64) % 3
    assert np.array_equal(perm(ranks, tab), _old_call(a, b, m, ranks, tab))


@given(st.one_of(st.integers(ROTATION_LIMIT + 1, INT64_MAX), st.integers(ROTATION_LIMIT + 1, ROTATION_LIMIT + 2**10),
                 st.integers(INT64_MAX - 2**10, INT64_MAX), st.sampled_from([2**61, 2**62, 2**61 - 1, P * M31,
                                                                           4611686018427387847, 9223372036854775783])),
       SEEDS, st.data())
@settings(max_examples=300, deadline=None)
def test_the_trace_permutation_of_a_huge_space_scrambles_rather_than_rotates(m, seed, data):
    """Above 2**50 ids the multiplier is a unit drawn from the whole space, not 1 (nor -1): consecutive
    ranks are never adjacent ids (they used to be b, b+1, b+2, ...: every hot row in one cluster)."""
    perm = tracegen._Permutation.draw(m, 1, np.random.default_rng(seed))
    assert perm.a not in (1, m - 1)
    ranks = [r for r in _ranks(data, m) if r < m - 1]
    ids = perm(np.array(ranks + [r + 1 for r in ranks], dtype=np.int64), np.zeros(2 * len(ranks), dtype=np.int64))
    for x, y in zip(ids[:len(ranks)], ids[len(ranks):]):
        assert _circular_gap(int(x), int(y), m) > 1024


def test_a_trace_over_the_largest_id_space_scatters_its_hot_ids():
    """End to end: the most looked-up ids of a skewed trace over 2**63 - 1 ids lie far apart."""
    tr = tracegen.generate(zipf_alpha=1.5, ids=INT64_MAX, batches=2, batch_size=2000, tables=1, seed=1)
    assert tr.ids.min() >= 0 and tr.ids.max() < INT64_MAX
    uniq, counts = np.unique(tr.ids, return_counts=True)
    hot = [int(x) for x in uniq[np.argsort(-counts, kind="stable")[:4]]]
    assert min(_circular_gap(x, y, INT64_MAX) for i, x in enumerate(hot) for y in hot[i + 1:]) > 1024


@pytest.mark.parametrize(("m", "digest"), [(10, "bc54b9ac3ed70938"), (1_000_000, "95930e3a8d0d33f5"),
                                           (2**40, "e6c8053922a79d2f")])
def test_traces_of_spaces_without_overflow_are_bit_identical_to_before(m, digest):
    """Digests taken with the code before the fix."""
    t = tracegen.generate(zipf_alpha=1.0, ids=m, batches=2, batch_size=500, tables=3, seed=4)
    assert _digest(t.ids, t.table) == digest


def test_a_calibrated_drifting_trace_without_overflow_is_bit_identical_to_before():
    t = tracegen.generate("dlrm2021", ids=2**50, batches=2, batch_size=1100, tables=2, seed=4, drift=0.3)
    assert _digest(t.ids, t.table) == "04ef4e3a5b81f90e"


# --------------------------------------------------------------------------- SyntheticClicks
def _old_synthetic(ranks: np.ndarray, n: int, t: int) -> np.ndarray:
    """The formula before the fix: exact only while (n - 1) * mult + t * 977 < 2**64."""
    mult = np.uint64(P) if n % P else np.uint64(M31)
    with np.errstate(over="ignore"):
        return ((ranks.astype(np.uint64) * mult + np.uint64(t * 977)) % np.uint64(n)).astype(np.int64)


def _old_exact(n: int, t: int) -> bool:
    return (n - 1) * (P if n % P else M31) + t * 977 < 2**64


def _old_wrap_collision(n: int) -> list[int]:
    """Two ranks the old formula (table 0, mult P) sent to one id: r * P mod 2**64 = v0 + k * n for two k."""
    if n % P == 0 or n < 2**56:  # few k to try (2**64 / n)
        return []
    inv = pow(P, -1, 2**64)
    for v0 in range(512):
        rs = [r for k in range((2**64 - 1 - v0) // n + 1) if (r := (v0 + k * n) * inv % 2**64) < n]
        if len(rs) >= 2:
            return rs[:2]
    return []


@given(SPACES, st.integers(0, 40), st.data())
@settings(max_examples=300, deadline=None)
def test_synthetic_ids_are_an_affine_bijection_for_any_id_space(n, t, data):
    """id(r) = id(0) + r * s mod n with s a unit mod n, so rank -> id is a bijection of [0, n); distinct ranks
    (the old formula's colliding pairs among them) get distinct ids in [0, n)."""
    ranks = sorted(set(_ranks(data, n)) | set(_old_wrap_collision(n)) | ({0, P} if n == P * M31 else set()))
    ids = _synthetic_ids(np.array(ranks + [0, 1], dtype=np.int64), n, t).tolist()
    base, s = ids[-2], (ids[-1] - ids[-2]) % n
    assert math.gcd(s, n) == 1 and base == t * 977 % n
    ids = ids[:-2]
    assert ids == [(base + r * s) % n for r in ranks]
    assert len(set(ids)) == len(ranks) and all(0 <= i < n for i in ids)


@given(st.integers(0, 40), st.data())
@settings(max_examples=300, deadline=None)
def test_synthetic_ids_of_a_space_without_overflow_are_unchanged(t, data):
    limit = (2**64 - 1 - t * 977) // P + 1  # n - 1 <= (2**64 - 1 - t * 977) / P
    n = data.draw(st.one_of(st.integers(1, limit), st.integers(limit - 2**10, limit),
                            st.sampled_from([P, 2 * P, 3 * P]), st.integers(1, 1 << 16)))
    assert _old_exact(n, t)
    r = np.array(_ranks(data, n), dtype=np.int64)
    assert np.array_equal(_synthetic_ids(r, n, t), _old_synthetic(r, n, t))


@given(st.one_of(st.integers((2**64 // P) + 1, INT64_MAX), st.sampled_from([P * M31, INT64_MAX, 2**62, 2**63 - 25])),
       st.integers(0, 40), st.data())
@settings(max_examples=200, deadline=None)
def test_synthetic_ids_of_a_huge_space_scramble_consecutive_ranks(n, t, data):
    ranks = [r for r in _ranks(data, n) if r < n - 1]
    ids = _synthetic_ids(np.array(ranks + [r + 1 for r in ranks], dtype=np.int64), n, t).tolist()
    for x, y in zip(ids[:len(ranks)], ids[len(ranks):]):
        assert _circular_gap(x, y, n) > 1024


def test_a_synthetic_space_that_both_old_multipliers_divide_is_still_a_bijection():
    """n = 2654435761 * (2**31 - 1): the old fallback multiplier 2**31 - 1 divides n, so ranks 0 and P met."""
    n = P * M31
    ids = _synthetic_ids(np.array([0, P, M31], dtype=np.int64), n, 0).tolist()
    assert len(set(ids)) == 3


def test_synthetic_batches_over_huge_spaces_keep_ids_in_range():
    spaces = (INT64_MAX, P * M31, 2**62, 6_949_350_058)
    sc = SyntheticClicks(spaces, 256, 2, bag_max=3, zipf_alpha=0.3, seed=2)
    for split in ("train", "holdout"):
        b = sc.batch(1, split)
        for ids, n in zip(b.ids, spaces):
            assert ids.dtype == torch.int64 and int(ids.min()) >= 0 and int(ids.max()) < n


@pytest.mark.parametrize("n", [2**63, 2**64, 2**70])
def test_a_synthetic_id_space_above_int64_is_refused(n):
    with pytest.raises(InvalidInputError, match=r"2\*\*63 - 1"):
        SyntheticClicks((10, n), 4, 1)


def test_synthetic_batches_of_spaces_without_overflow_are_bit_identical_to_before():
    """Digests taken with the code before the fix (id spaces up to the old wrap limit, both old multipliers)."""
    sc = SyntheticClicks((1, 7, 1000, 2**31 - 1, P, 2 * P, 2**32, 6_000_000_000), 512, 2, bag_max=3, seed=5)
    got = [_digest(*[x.numpy() for x in b.ids], b.labels.numpy())
           for b in (sc.batch(0, "train"), sc.batch(1, "holdout"))]
    assert got == ["a6868836c911e848", "995753ee9997d9c3"]
