"""The synthetic trace generator: published statistics at several scales, Zipf mode, determinism."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embstore.belady import belady_hits, dedup_batches
from embstore.cli import main
from embstore.errors import InvalidInputError
from embstore.traces import dense_keys, load, trace_stats
from embstore.tracegen import PROFILES, ReuseProfile, _DriftingRanking, _make_distinct, _Permutation, _spread, generate

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


# --------------------------------------------------------------------------- temporal locality (drift)


def _digest(t) -> str:
    h = hashlib.sha256()
    for a in (t.ids, t.table, t.batch_offsets):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def test_no_drift_is_the_trace_of_before():
    """Digests taken with the generator before drift existed (session 10): the default must not move."""
    kw = dict(batches=3, batch_size=2048, tables=3, ids=100_000, seed=5)
    assert _digest(generate("dlrm2021", **kw)) == "921943c69fdb6443"
    assert _digest(generate("dlrm2021", drift=0.0, **kw)) == "921943c69fdb6443"
    kw = dict(batches=3, batch_size=500, tables=2, ids=10_000, seed=5)
    assert _digest(generate(zipf_alpha=0.9, drift=0, **kw)) == "54ccc81a0af65d01"


def _batch_profiles(t) -> list[list[np.ndarray]]:
    """Per batch and table, the sorted counts of its ids (what the calibration shapes; ids aside)."""
    out = []
    for b in range(t.num_batches):
        s, e = t.batch_offsets[b], t.batch_offsets[b + 1]
        tab, ids = t.table[s:e], t.ids[s:e]
        out.append([np.sort(np.unique(ids[tab == k], return_counts=True)[1]) for k in range(t.num_tables)])
    return out


@pytest.mark.parametrize("like", ["dlrm2021", None])
def test_drift_is_deterministic_and_moves_ids_not_counts(like):
    kw = dict(like=like, zipf_alpha=None if like else 1.1, batches=8, batch_size=2048, tables=3, ids=50_000)
    a = generate(drift=0.1, seed=4, **kw)
    assert np.array_equal(a.ids, generate(drift=0.1, seed=4, **kw).ids)
    assert not np.array_equal(a.ids, generate(drift=0.1, seed=5, **kw).ids)
    still = generate(drift=0.0, seed=4, **kw)
    assert np.array_equal(a.table, still.table) and a.ids.min() >= 0 and a.ids.max() < 50_000
    n = a.batch_offsets[1]
    assert np.array_equal(a.ids[:n], still.ids[:n])  # batch 0 is drawn before any replacement
    assert not np.array_equal(a.ids[n:], still.ids[n:])
    for pa, ps in zip(_batch_profiles(a), _batch_profiles(still)):  # ids distinct: no counts merged
        assert all(np.array_equal(x, y) for x, y in zip(pa, ps))


@pytest.mark.parametrize("drift", [0.01, 0.2, 1.0])
@pytest.mark.parametrize("like", ["dlrm2021", "dlrm2022"])
def test_published_statistics_hold_with_drift(like, drift):
    t = generate(like, batches=6, batch_size=4096, tables=4, seed=3, drift=drift)
    _assert_matches(trace_stats(t, reuse_distances=False), PROFILES[like])


def test_drift_in_an_id_space_a_batch_nearly_fills():
    """Newcomers must not repeat an id the batch already holds, even when few ids are free."""
    kw = dict(batches=6, batch_size=2048, tables=2, ids=400, seed=1)  # ~300 of 400 ids in use per batch
    for pa, ps in zip(_batch_profiles(generate("dlrm2021", drift=0.5, **kw)),
                      _batch_profiles(generate("dlrm2021", **kw))):
        assert all(np.array_equal(x, y) for x, y in zip(pa, ps))


def _hot_recur(t, k: int = 200, later: int = 50) -> float:
    """Share of batch 0's k most looked-up rows that batch ``later`` looks up at all."""
    keys, _ = dense_keys(t)
    off = t.batch_offsets
    top = np.argsort(-np.bincount(keys[off[0]:off[1]]), kind="stable")[:k]
    return float(np.isin(top, keys[off[later]:off[later + 1]]).mean())


def test_drift_makes_hot_rows_fade_at_the_modelled_rate():
    """A hot row survives 50 batches with probability (1 - R) ** 50: the share of batch 0's hot rows
    still in batch 50 falls from drift 0's by that factor."""
    share = {r: _hot_recur(generate("dlrm2021", batches=51, batch_size=2048, tables=4, ids=100_000, seed=0,
                                    drift=r)) for r in (0.0, 0.005, 0.02, 0.1)}
    assert share[0.0] >= 0.8
    assert share[0.0] > share[0.005] > share[0.02] > share[0.1]
    for r in (0.005, 0.02, 0.1):
        assert share[r] / share[0.0] == pytest.approx((1 - r) ** 50, abs=0.12), r


def test_drift_lowers_cross_batch_reuse_in_zipf_mode():
    def reuse(drift: float) -> float:
        t = generate(zipf_alpha=1.0, batches=20, batch_size=1000, tables=2, ids=100_000, seed=2, drift=drift)
        return trace_stats(t).reuse_distance.reaccess_pct

    assert reuse(0.0) > reuse(0.05) > reuse(0.5) > reuse(1.0)


def test_ranking_replaces_occupants_geometrically():
    """Against the model itself: every rank drawn every batch changes occupant w.p. R per batch; a rank
    drawn only at batches 0 and B kept its occupant w.p. (1 - R) ** B; the ranking stays a permutation."""
    m, k, r = 1_000_000, 4000, 0.05
    perm = _Permutation.draw(m, 2, np.random.default_rng(0))
    ranking = _DriftingRanking(perm, r, seed=9)
    ranks, tab = np.tile(np.arange(k), 2), np.repeat(np.arange(2, dtype=np.int32), k)
    lazy = np.arange(500_000, 500_000 + k), np.zeros(k, dtype=np.int32)  # ranks skipped in between
    first, lazy_first = ranking.ids(ranks, tab, 0), ranking.ids(*lazy, 0)
    prev, changed = first, []
    for b in range(1, 11):
        cur = ranking.ids(ranks, tab, b)
        assert all(np.unique(cur[tab == t]).size == k for t in (0, 1))
        changed.append(np.mean(cur != prev))
        prev = cur
    assert np.mean(changed) == pytest.approx(r, abs=0.006)
    assert np.mean(ranking.ids(*lazy, 10) == lazy_first) == pytest.approx((1 - r) ** 10, abs=0.03)
    assert np.mean(prev == first) == pytest.approx((1 - r) ** 10, abs=0.03)


@pytest.mark.parametrize("drift", [-0.1, 1.5, float("nan"), "0.1", True, None])
def test_drift_must_be_a_rate(drift):
    with pytest.raises(InvalidInputError, match=r"drift must be a number in \[0, 1\]"):
        generate("dlrm2021", batches=1, batch_size=2048, drift=drift)


def test_trace_gen_drift_flag(tmp_path, capsys):
    out = tmp_path / "t.npz"
    args = ["trace", "gen", "--like", "dlrm2021", "--batches", "3", "--batch-size", "2048", "--tables", "2",
            "--seed", "6", "--out", str(out)]
    assert main(args + ["--drift", "0.3"]) == 0
    want = generate("dlrm2021", batches=3, batch_size=2048, tables=2, seed=6, drift=0.3)
    assert np.array_equal(load(out).ids, want.ids)
    with pytest.raises(SystemExit) as exc:  # a usage error, before any work
        main(args + ["--drift", "2"])
    assert exc.value.code == 2
    assert "--drift: expected a number in [0, 1], got '2'" in capsys.readouterr().err


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
