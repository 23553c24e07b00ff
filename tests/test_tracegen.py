"""The synthetic trace generator: published statistics at several scales, Zipf mode, determinism."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embstore.belady import belady_hits, dedup_batches
from embstore.errors import InvalidInputError
from embstore.traces import dense_keys, trace_stats
from embstore.tracegen import PROFILES, ReuseProfile, _make_distinct, _spread, generate

TOLERANCE = 3.0  # percentage points


def _assert_matches(stats, prof: ReuseProfile) -> None:
    assert 100 * stats.unique_ratio == pytest.approx(100 * prof.unique_ratio, abs=TOLERANCE)
    assert [b.threshold for b in stats.reuse] == list(prof.thresholds)
    for b, rows, lookups in zip(stats.reuse, prof.rows_pct, prof.lookups_pct):
        assert b.rows_pct == pytest.approx(rows, abs=TOLERANCE), f"rows reused > {b.threshold}"
        assert b.lookups_pct == pytest.approx(lookups, abs=TOLERANCE), f"lookups on rows reused > {b.threshold}"


@pytest.mark.parametrize("like", ["dlrm2021", "dlrm2022"])
@pytest.mark.parametrize("batches, batch_size, tables, pooling", [
    (6, 4096, 8, 1),
    (6, 16384, 2, 1),
    (3, 8192, 4, 3),
    (30, 2048, 1, 1),  # ~2k lookups a batch: the >1024 rows exist in some batches only
])
def test_published_statistics_at_several_scales(like, batches, batch_size, tables, pooling):
    t = generate(like, batches=batches, batch_size=batch_size, tables=tables, pooling=pooling, seed=3)
    assert len(t) == batches * batch_size * tables * pooling and t.num_batches == batches
    _assert_matches(trace_stats(t, reuse_distances=False), PROFILES[like])


def test_each_batch_matches_when_batches_are_large():
    t = generate("dlrm2021", batches=3, batch_size=8192, tables=4, seed=1)
    for b in range(3):
        s, e = t.batch_offsets[b], t.batch_offsets[b + 1]
        one = type(t)(t.ids[s:e], t.table[s:e], np.array([0, e - s]), t.table_names)
        _assert_matches(trace_stats(one, reuse_distances=False), PROFILES["dlrm2021"])


def test_layout_tables_and_id_space():
    t = generate("dlrm2022", batches=4, batch_size=4096, tables=5, ids=50_000, seed=2)
    assert t.ids.min() >= 0 and t.ids.max() < 50_000
    assert t.table_names == tuple(f"table_{i}" for i in range(5))
    n = 4096 * 5
    assert np.array_equal(t.batch_offsets, np.arange(5) * n)
    for b in range(4):
        tab = t.table[b * n:(b + 1) * n]
        assert np.all(np.diff(tab) >= 0)  # table-major inside a batch
        per_table = np.bincount(tab, minlength=5)
        assert per_table.sum() == n and np.all(np.abs(per_table - 4096) <= 4096 // 4)


def test_deterministic_for_a_seed():
    a = generate("dlrm2021", batches=2, batch_size=2048, tables=3, seed=7)
    b = generate("dlrm2021", batches=2, batch_size=2048, tables=3, seed=7)
    c = generate("dlrm2021", batches=2, batch_size=2048, tables=3, seed=8)
    assert np.array_equal(a.ids, b.ids) and np.array_equal(a.table, b.table)
    assert not np.array_equal(a.ids, c.ids)
    z1 = generate(zipf_alpha=0.9, batches=2, batch_size=100, tables=2, seed=1)
    z2 = generate(zipf_alpha=0.9, batches=2, batch_size=100, tables=2, seed=1)
    assert np.array_equal(z1.ids, z2.ids)


def test_hot_rows_recur_across_batches():
    """Caches must have something to find: the hottest rows of a batch come back in the next."""
    t = generate("dlrm2021", batches=4, batch_size=4096, tables=4, seed=0)
    keys, _ = dense_keys(t)
    n = t.batch_offsets[1]
    first, second = keys[:n], keys[n:2 * n]
    hot = np.argsort(np.bincount(first))[-20:]
    assert np.isin(hot, second).mean() >= 0.8
    dk, off = dedup_batches(keys, t.batch_offsets)
    assert belady_hits(dk, 5000) > 0.2 * dk.size


def test_zipf_alpha_controls_cross_batch_reuse_in_calibrated_mode():
    def reuse(alpha: float) -> float:
        t = generate("dlrm2021", zipf_alpha=alpha, batches=4, batch_size=4096, tables=2, seed=0)
        return trace_stats(t).reuse_distance.reaccess_pct

    assert reuse(0.6) < reuse(1.0) < reuse(1.3)


def test_zipf_mode_follows_the_law():
    """Most popular id's share vs the bounded continuous Zipf law the sampler implements."""
    m, alpha, n = 1000, 1.2, 200_000
    t = generate(zipf_alpha=alpha, batches=4, batch_size=n // 4, tables=1, ids=m, seed=4)
    counts = np.sort(np.bincount(t.ids, minlength=m))[::-1]
    norm = (1 - (m + 1) ** (1 - alpha)) / (alpha - 1)
    for r in range(3):
        p = ((r + 1) ** (1 - alpha) - (r + 2) ** (1 - alpha)) / (alpha - 1) / norm
        assert counts[r] / n == pytest.approx(p, rel=0.05)
    per_batch = [set(t.ids[t.batch_offsets[b]:t.batch_offsets[b + 1]].tolist()) for b in range(4)]
    assert len(per_batch[0] & per_batch[1]) > 0.5 * len(per_batch[1])


def test_zipf_mode_uniform_and_alpha_one():
    t = generate(zipf_alpha=0.0, batches=1, batch_size=50_000, tables=1, ids=10, seed=0)
    assert np.bincount(t.ids, minlength=10) / 50_000 == pytest.approx(np.full(10, 0.1), abs=0.01)
    t = generate(zipf_alpha=1.0, batches=1, batch_size=50_000, tables=1, ids=100, seed=0)
    top = np.sort(np.bincount(t.ids, minlength=100))[::-1][0] / 50_000
    assert top == pytest.approx(math.log(2) / math.log(101), rel=0.05)


def test_profile_from_measured_stats_round_trips():
    src = generate("dlrm2022", batches=4, batch_size=4096, tables=4, seed=11)
    prof = ReuseProfile.from_stats(trace_stats(src, reuse_distances=False), name="mine")
    again = generate(prof, batches=4, batch_size=8192, tables=2, seed=12)
    _assert_matches(trace_stats(again, reuse_distances=False), prof)


@pytest.mark.parametrize("kwargs, match", [
    (dict(), "give like"),
    (dict(like="dlrm2099"), "unknown profile 'dlrm2099'; known: dlrm2021, dlrm2022"),
    (dict(like="dlrm2021", batch_size=1024), r"batch_size \* pooling > 1024"),
    (dict(like="dlrm2021", batch_size=2048, ids=100), "distinct ids in one batch"),
    (dict(zipf_alpha=-1.0), "zipf_alpha must be in"),
    (dict(zipf_alpha=1.0, batches=0), "batches must be a positive integer"),
    (dict(zipf_alpha=1.0, tables=True), "tables must be a positive integer"),
    (dict(zipf_alpha=1.0, seed=-1), "seed must be a non-negative integer"),
    # these crashed inside numpy (ValueError, MemoryError for 58 TiB) instead of naming the argument
    (dict(zipf_alpha=1.0, ids=2**64), "ids must be at most 2\\*\\*63 - 1"),
    (dict(zipf_alpha=1.0, pooling=10**20), "at most 1,099,511,627,776 fit one trace"),
    (dict(zipf_alpha=1.0, batches=10**6, batch_size=10**6), "lookups; at most"),
    (dict(zipf_alpha=1.0, tables=(1 << 20) + 1, batch_size=1), "tables must be at most 1,048,576"),
])
def test_generate_errors(kwargs, match):
    with pytest.raises(InvalidInputError, match=match):
        generate(**{"batches": 1, "batch_size": 2048, **kwargs})


def test_profile_validation():
    with pytest.raises(InvalidInputError, match="same non-zero length"):
        ReuseProfile("x", 0.1, (50.0,), (90.0, 80.0), (1, 8))
    with pytest.raises(InvalidInputError, match="never increase"):
        ReuseProfile("x", 0.1, (10.0, 20.0), (90.0, 80.0), (1, 8))
    with pytest.raises(InvalidInputError, match="start at 1"):
        ReuseProfile("x", 0.1, (50.0, 10.0), (90.0, 80.0), (2, 8))
    with pytest.raises(InvalidInputError, match="unique_ratio"):
        ReuseProfile("x", 0.0, (50.0, 10.0), (90.0, 80.0), (1, 8))


# --------------------------------------------------------------------------- building blocks


@given(st.integers(1, 300), st.integers(1, 2000), st.integers(0, 50), st.data())
@settings(max_examples=200)
def test_spread_hits_exact_sum_within_bounds(u, lo, width, data):
    hi = lo + width
    total = data.draw(st.integers(u * lo, u * hi))
    c = _spread(u, total, lo, hi, np.random.default_rng(data.draw(st.integers(0, 9))))
    assert c.size == u and c.sum() == total and c.min() >= lo and c.max() <= hi


@given(st.lists(st.integers(0, 30), min_size=1, max_size=30), st.integers(0, 20))
@settings(max_examples=200)
def test_make_distinct_gives_increasing_ranks_in_range(ranks, extra):
    m = len(ranks) + extra
    r = np.sort(np.minimum(np.array(ranks, dtype=np.int64), m - 1))
    _make_distinct(r, np.array([0, r.size], dtype=np.int64), m)
    assert np.all(np.diff(r) > 0) and r[0] >= 0 and r[-1] < m
