"""``replay_pipeline``: every cache level of a store under a training pipeline, lower levels included.

A pipeline's store does not see the trace (its working set absorbs the rows the batches in its window share):
``replay_pipeline`` runs the store's own ``Hierarchy`` over byte-less tiers on the calls the pipeline makes, so
each level's hits and misses, and the rows the home reads, are the store's own counts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import embstore
from embstore.config import StoreConfig, TableConfig, TierConfig
from embstore.errors import ConfigError, InvalidInputError
from embstore.simulator import pipeline_accesses, pipeline_min_keys, pipeline_mrc, replay_pipeline, simulate_pipeline
from embstore.belady import belady_hits
from embstore.training import TieredEmbeddingBagCollection

from cache_refs import best_reads_served

DIM = 4
RB = 4 * DIM  # float32 rows, sgd: no optimizer state
POLICIES = ["lru", "lfu", "clock", "lru+tinylfu", "lfu+tinylfu", "clock+tinylfu"]
BATCH = st.lists(st.integers(0, 47), min_size=0, max_size=14).map(lambda x: np.array(x, np.int64))


def _trace(batches: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    return (np.concatenate(batches) if batches else np.zeros(0, np.int64),
            np.cumsum([0] + [len(b) for b in batches]).astype(np.int64))


def _train(path, batches: list[np.ndarray], levels: list[tuple[str, int]], k: int, ahead: int, trained: bool):
    """One table (48 rows) with a DRAM cache over an mmap cache over an ssd home, trained through a pipeline;
    returns the per-tier stats."""
    tiers = (TierConfig("dram", levels[0][1] * RB, levels[0][0]), TierConfig("mmap", levels[1][1] * RB, levels[1][0]),
             TierConfig("ssd"))
    with embstore.create(path, StoreConfig((TableConfig("t", 48, DIM, tiers=tiers),))) as store:
        ebc = TieredEmbeddingBagCollection(store, ["t"], optimizer="sgd", lr=0.5)
        if not trained:
            ebc.eval()

        def sparse(b):
            return [torch.from_numpy(b)], [torch.tensor([0, len(b)])]
        for b in ebc.pipeline(batches, lookahead=k, announce=ahead, sparse=sparse):
            out = ebc(*sparse(b))
            if trained:
                (out * torch.arange(1, DIM + 1, dtype=torch.float32)).sum().backward()
        stats = store["t"].stats()
        ebc.release()
    return stats


@settings(max_examples=40, deadline=None)
@given(st.lists(BATCH, min_size=1, max_size=12), st.integers(0, 3), st.integers(0, 4),
       st.tuples(st.sampled_from(POLICIES), st.integers(1, 12)), st.tuples(st.sampled_from(POLICIES),
                                                                          st.integers(1, 30)), st.booleans())
def test_every_level_counts_what_the_store_counts(tmp_path_factory, batches, k, ahead, top, below, trained) -> None:
    """Two cache levels over an ssd home, any small trace, lookahead, announce and policies, trained or not:
    each level's hits and misses are the replay's, and the top level's are ``simulate_pipeline``'s too."""
    stats = _train(tmp_path_factory.mktemp("s") / "s", batches, [top, below], k, ahead, trained)
    keys, off = _trace(batches)
    res = replay_pipeline(keys, off, [top, below], lookahead=k, announce=ahead, trained=trained)
    for lv, kind in zip(res.levels, ("dram", "mmap")):
        assert (stats[kind]["hits"], stats[kind]["misses"]) == (lv.hits, lv.misses), kind
    assert res.home_reads == res.levels[1].misses
    assert res.levels[0].hits == int(simulate_pipeline(keys, off, top[1], top[0], lookahead=k, announce=ahead,
                                                       trained=trained).sum())


def test_reads_writes_and_the_home_against_a_set_model() -> None:
    """No cache: the home reads every row entering the working set and takes every row leaving it; the
    accesses are those reads, and with look-ahead the forward waits for none of them."""
    rng = np.random.default_rng(4)
    batches = [rng.integers(0, 30, rng.integers(0, 12)) for _ in range(20)]
    keys, off = _trace(batches)
    for k in range(4):
        steps = pipeline_accesses(keys, off, k)
        res = replay_pipeline(keys, off, [("lru", 0)], lookahead=k)
        n_reads = sum(r.size for _, r, _ in steps)
        n_written = sum(w.size for _, _, w in steps)
        assert res.accesses == res.home_reads == res.levels[0].misses == n_reads
        assert res.extra["home_writes"] == res.extra["written_back"] == n_written
        assert res.demand_misses == (n_reads if k == 0 else 0)
        assert res.batches == len(batches)


def test_a_cache_holding_every_row_reads_each_once_and_writes_nothing_home() -> None:
    """A cache with a slot for every row: the home reads each distinct row once (its first fetch) and takes no
    write (nothing is evicted); Belady's share is then exact."""
    rng = np.random.default_rng(5)
    batches = [rng.integers(0, 25, 10) for _ in range(30)]
    keys, off = _trace(batches)
    res = replay_pipeline(keys, off, [("lru+tinylfu", 25)], lookahead=2, announce=3, row_bytes=8)
    assert res.home_reads == np.unique(keys).size
    assert res.extra["home_writes"] == 0 and res.extra["written_back"] > 0
    lv = res.levels[0]
    assert lv.hits == lv.belady_hits == res.accesses - np.unique(keys).size
    assert lv.bytes_read == 8 * lv.hits and lv.bytes_in == 8 * lv.misses


def test_the_curve_is_one_replay_per_capacity_and_belady_bounds_it() -> None:
    rng = np.random.default_rng(6)
    p = 1 / np.arange(1, 201) ** 1.0
    batches = [rng.choice(200, 40, p=p / p.sum()) for _ in range(25)]
    keys, off = _trace(batches)
    caps = np.array([0, 5, 20, 60, 500])
    for pol in ("lru", "lfu+tinylfu"):
        got = pipeline_mrc(keys, off, caps, pol, lookahead=1, announce=2)
        want = [replay_pipeline(keys, off, [(pol, int(c))], lookahead=1, announce=2).levels[0].hits for c in caps]
        assert got.tolist() == want
    steps = pipeline_accesses(keys, off, 1)
    reads = np.concatenate([r for _, r, _ in steps])
    mins = pipeline_mrc(keys, off, caps, "belady", lookahead=1)
    assert mins.tolist() == [belady_hits(pipeline_min_keys(steps), int(c)) if c else 0 for c in caps]
    lru = pipeline_mrc(keys, off, caps, "lru", lookahead=1)
    assert (lru <= mins).all() and mins[-1] == reads.size - np.unique(reads).size


def test_bad_settings_are_refused() -> None:
    keys, off = np.array([1, 2, 1, 3]), np.array([0, 2, 4])
    for kwargs in ({"lookahead": -1}, {"lookahead": 1.5}, {"lookahead": 1, "announce": -2}):
        with pytest.raises(InvalidInputError):
            replay_pipeline(keys, off, [("lru", 2)], **kwargs)
    with pytest.raises(InvalidInputError, match="capacity"):
        replay_pipeline(keys, off, [("lru", -1)], lookahead=1)
    with pytest.raises(ConfigError, match="'nope' is not one of"):
        replay_pipeline(keys, off, [("nope", 2)], lookahead=1)
    with pytest.raises(InvalidInputError, match="capacities"):
        pipeline_mrc(keys, off, [-1], "lru", lookahead=1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 6), max_size=4).map(lambda x: np.array(x, np.int64)), min_size=1,
                max_size=7), st.integers(0, 2), st.integers(1, 3), st.booleans())
def test_belady_beside_a_pipeline_is_the_brute_force_optimum(batches, k, cap, trained) -> None:
    """MIN over ``pipeline_min_keys`` is the most reads a cache can serve: write-backs fill it without a read
    (the reads alone made a bound that LRU beat)."""
    keys, off = _trace(batches)
    steps = pipeline_accesses(keys, off, k, trained)
    res = replay_pipeline(keys, off, [("lru", cap)], lookahead=k, trained=trained)
    assert res.levels[0].belady_hits == best_reads_served(steps, cap)


@settings(max_examples=40, deadline=None)
@given(st.lists(BATCH, min_size=1, max_size=12), st.integers(0, 3), st.integers(1, 20),
       st.sampled_from(["lru", "lfu", "clock"]), st.booleans())
def test_no_policy_without_admission_beats_belady(batches, k, cap, policy, trained) -> None:
    """Told nothing and without admission a cache never bypasses, so MIN (no bypass) bounds it; a told cache
    may bypass a row needed later than every resident, and admission may refuse one, so they may not be."""
    keys, off = _trace(batches)
    lv = replay_pipeline(keys, off, [(policy, cap)], lookahead=k, trained=trained).levels[0]
    assert lv.hits <= lv.belady_hits


def test_evaluation_reads_alone_give_the_bound() -> None:
    """Not trained, nothing is written back: the bound is MIN over the reads."""
    rng = np.random.default_rng(8)
    batches = [rng.integers(0, 40, 12) for _ in range(30)]
    keys, off = _trace(batches)
    reads = np.concatenate([r for _, r, _ in pipeline_accesses(keys, off, 2, trained=False)])
    for cap in (3, 10, 25):
        assert replay_pipeline(keys, off, [("lfu", cap)], lookahead=2, trained=False).levels[0].belady_hits == \
            belady_hits(reads, cap)


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    from embstore import tracegen, traces

    p = tmp_path_factory.mktemp("tr") / "t.npz"
    traces.save(tracegen.generate(zipf_alpha=1.0, batches=12, batch_size=200, tables=2, ids=3000, seed=4), p)
    return p


def test_replay_pipeline_cli_prints_the_pipelines_reads(trace_path, capsys) -> None:
    """``replay --pipeline K``: one record per policy and capacity with the pipeline's reads as accesses, the
    replay's hits, and the rows the cache wrote home; the text table shows the same."""
    import json

    from embstore import traces
    from embstore.cli import main
    from embstore.simulator import table_keys

    assert main(["replay", str(trace_path), "--pipeline", "2", "--announce", "1", "--policy", "lru,lfu",
                 "--capacity", "50", "--per-table", "--json"]) == 0
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    trace = traces.load(trace_path)
    assert len(recs) == 4
    for r in recs:
        keys, off = table_keys(trace, trace.table_names.index(r["table"]))
        want = replay_pipeline(keys, off, [(r["policy"], 50)], lookahead=2, announce=1, row_bytes=256)
        lv = want.levels[0]
        assert (r["accesses"], r["hits"], r["belady_hit_ratio"]) == (want.accesses, lv.hits, lv.belady_hit_ratio)
        assert r["home_writes"] == want.extra["home_writes"] and r["pipeline"] == 2 and r["demand_misses"] == 0
    assert main(["replay", str(trace_path), "--pipeline", "2", "--policy", "lru", "--capacity", "50"]) == 0
    out = capsys.readouterr().out
    assert "a training pipeline with lookahead=2" in out and "to home" in out


def test_replay_refuses_pipeline_with_lookahead(trace_path, capsys) -> None:
    from embstore.cli import main

    assert main(["replay", str(trace_path), "--pipeline", "2", "--lookahead", "1"]) == 2
    assert "not both" in capsys.readouterr().err


def test_tune_for_a_pipeline_sizes_on_its_reads(trace_path, tmp_path, capsys) -> None:
    """``tune --pipeline K``: each table's accesses are the pipeline's reads, its expected hits those of
    ``replay_pipeline`` over the chosen caches, and the TOML says to train with that look-ahead."""
    import json

    from embstore import traces
    from embstore.cli import main
    from embstore.simulator import table_keys

    out = tmp_path / "s.toml"
    assert main(["tune", str(trace_path), "--dram", "256KiB", "--dim", "16", "--pipeline", "1", "--json",
                 "--out", str(out)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["pipeline"] == 1
    trace = traces.load(trace_path)
    for t in got["tables"]:
        keys, off = table_keys(trace, trace.table_names.index(t["name"]))
        res = replay_pipeline(keys, off, [(t["dram_policy"], t["dram_rows"])], lookahead=1, belady=False)
        assert t["accesses"] == res.accesses < len(keys)
    assert "ebc.pipeline(..., lookahead=1)" in out.read_text()
    assert main(["tune", str(trace_path), "--dram", "256KiB", "--dim", "16", "--pipeline", "1"]) == 0
    assert "reads from the store" in capsys.readouterr().out


def test_a_recorded_trace_counts_each_tables_own_batches() -> None:
    """A recorded trace holds one batch per table call; each table's replay (and so tune) steps through its own
    batches, as that table's store does, not through the other tables' calls, which would stretch the window."""
    from embstore.simulator import table_keys
    from embstore.traces import Trace
    from embstore.tuning import tune

    rng = np.random.default_rng(11)
    batches = [[rng.integers(0, 60, 15), rng.integers(0, 40, 9)] for _ in range(20)]

    def trace(per_call: bool) -> Trace:
        parts = [(b[t], t) for b in batches for t in (0, 1)]
        ids = np.concatenate([x for x, _ in parts])
        table = np.concatenate([np.full(x.size, t, np.int32) for x, t in parts])
        sizes = [x.size for x, _ in parts] if per_call else [b[0].size + b[1].size for b in batches]
        return Trace(ids, table, np.cumsum([0] + sizes).astype(np.int64), ("a", "b"))

    recorded, batched = trace(True), trace(False)
    assert recorded.num_batches == 2 * batched.num_batches
    for t in (0, 1):
        keys, off = table_keys(recorded, t)
        assert off.size == len(batches) + 1
        np.testing.assert_array_equal(off, table_keys(batched, t)[1])
        one = replay_pipeline(keys, off, [("lru", 10)], lookahead=2, announce=3)
        assert one.batches == len(batches)
    plans = [tune(tr, 8 << 10, row_bytes=64, pipeline=2, announce=1).tables for tr in (recorded, batched)]
    assert [(p.dram_rows, p.dram_policy, p.accesses) for p in plans[0]] == \
        [(p.dram_rows, p.dram_policy, p.accesses) for p in plans[1]]


def test_the_demos_dram_hit_ratio_is_dram_hits_over_every_tables_reads() -> None:
    """Over ``TrainResult.tier_stats`` (every table's ``stats()`` at the end of a run; the demo's test checks it
    is filled): DRAM hits over the rows read from each table's top tier, a table without a DRAM tier counting
    as all misses, as tune's expectation counts it; tables held whole in DRAM (trained in place, no tier
    counts their reads) left out of both; undefined where nothing was read or no table has a DRAM tier."""
    from types import SimpleNamespace

    from embstore.demo import dram_hit_ratio, expected_dram_hit_ratio

    stats = {"a": {"dram": {"hits": 3, "misses": 1}, "ssd": {"hits": 1, "misses": 0}},
             "b": {"dram": {"hits": 1, "misses": 3}}, "c": {"mmap": {"hits": 5, "misses": 0}},
             "d": {"dram": {"hits": 0, "misses": 0}, "ssd": {"hits": 0, "misses": 0}}}
    assert dram_hit_ratio(stats) == 4 / 13
    assert dram_hit_ratio(stats, skip=["c"]) == 4 / 8
    assert dram_hit_ratio({"c": stats["c"]}) is None
    assert dram_hit_ratio({"d": stats["d"]}) is None

    def plan(name, accesses, hits):
        return SimpleNamespace(name=name, accesses=accesses,
                               result=SimpleNamespace(levels=[SimpleNamespace(hits=h) for h in hits]))
    tuned = SimpleNamespace(tables=[plan("a", 10, [4]), plan("b", 30, [0]), plan("site", 60, [60])])
    assert expected_dram_hit_ratio(tuned) == 64 / 100
    assert expected_dram_hit_ratio(tuned, skip=["site"]) == 4 / 40
    assert expected_dram_hit_ratio(tuned, skip=["a", "b", "site"]) is None
