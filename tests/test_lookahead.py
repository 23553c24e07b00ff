"""Announced batches (``embstore.lookahead``): directories, the simulator, the store's tables, ``replay``."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import embstore
from embstore import tracegen
from embstore.belady import dedup_batches
from embstore.cli import main
from embstore.config import StoreConfig, TableConfig, TierConfig
from embstore.errors import IdOutOfRangeError, InvalidInputError, StoreClosedError
from embstore.hash_index import EMPTY
from embstore.lookahead import AMETA, A_CLOCK, A_NANN, A_ON, INF, NUSE, O_KEY, O_SEQ, OCC, told_bytes
from embstore.policies import CacheDirectory, simulate
from embstore.simulator import miss_ratio_curve, replay_keys, replay_trace
from embstore.table import MAX_ANNOUNCED
from embstore.traces import dense_keys, save

from cache_refs import OPS, AnnouncedReference, optimum_with_bypass, run_side_by_side
from cached_stores import DIM, RB, cached_store

POLICIES = ["lru", "lfu", "clock", "lru+tinylfu", "lfu+tinylfu", "clock+tinylfu"]

@settings(max_examples=300, deadline=None)
@given(OPS, st.integers(1, 8), st.sampled_from(["lru", "lfu"]))
def test_a_directory_told_batches_matches_the_reference(ops, capacity, policy) -> None:
    run_side_by_side(CacheDirectory(capacity, policy, key_limit=16), AnnouncedReference(capacity, policy), ops)


def _resident(d: CacheDirectory) -> dict[int, int]:
    occupied = np.flatnonzero(d.slot_key != EMPTY)
    return dict(zip(d.slot_key[occupied].tolist(), occupied.tolist()))


@settings(max_examples=200, deadline=None)
@given(OPS, st.integers(1, 8), st.sampled_from(POLICIES))
def test_every_policy_keeps_its_books_with_announcements(ops, capacity, policy) -> None:
    """Hits are rows held before the access; holdings change only by the batch's inserts and evictions;
    the rows waiting for an announced use are exactly the residents some pending batch uses, each ranked by
    the first such batch."""
    d = CacheDirectory(capacity, policy, key_limit=16)
    pending: list[list[int]] = []  # announced batches not advanced past
    for op, keys in ops:
        if op == "announce":
            d.announce(np.array(keys, np.int64))
            pending.append(keys)
        elif op == "advance":
            if pending:
                pending.pop(0)
            d.advance()
        elif op == "remove":
            before = _resident(d)
            assert d.remove(np.array(keys, np.int64)).tolist() == [before.get(k, -1) for k in keys]
            assert set(_resident(d)) == set(before) - set(keys)
        else:
            before = _resident(d)
            r = d.access(np.array(keys, np.int64))
            after = _resident(d)
            for k, s, h in zip(keys, r.slots.tolist(), r.hit.tolist()):
                assert not h or before[k] == s
                assert k in before or not h
            assert set(r.evicted_keys.tolist()) <= set(before)
            landed = {k for k, s, h in zip(keys, r.slots.tolist(), r.hit.tolist()) if not h and s >= 0}
            assert set(after) == (set(before) - set(r.evicted_keys.tolist())) | landed
            if pending:
                pending[0] = [k for k in pending[0] if k not in keys]  # this batch's uses of them are spent
        assert len(_resident(d)) <= capacity
        if not d._ah[AMETA][A_ON]:  # nothing announced yet
            continue
        clock = int(d._ah[AMETA][A_CLOCK])
        nuse = d._ah[NUSE]
        occ = d._ah[OCC]
        for k, s in _resident(d).items():
            uses = [clock + i for i, b in enumerate(pending) if k in b]
            nu = int(nuse[s])
            assert nu == INF if not uses else (occ[nu & (len(occ) - 1), O_KEY] == k
                                               and occ[nu & (len(occ) - 1), O_SEQ] == uses[0]), (k, uses)
        assert int(d._ah[AMETA][A_NANN]) == sum(1 for s in _resident(d).values() if nuse[s] != INF)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=40), st.lists(st.integers(0, 40), max_size=8),
       st.integers(1, 4), st.sampled_from(POLICIES))
def test_a_window_over_the_whole_trace_is_optimal(keys, cuts, capacity, policy) -> None:
    """Every batch announced from the start: the cache ranks rows by the position of their next use, as MIN
    does, and bypasses a row used later than every resident, so it gets the most hits any cache of that size
    can (found by trying every choice), however the accesses are cut into batches."""
    raw = np.array(keys, np.int64)
    k, off = dedup_batches(raw, np.unique(np.array([0, *[c % (len(raw) + 1) for c in cuts], len(raw)], np.int64)))
    hits = int(simulate(k, off, capacity, policy, announce=len(off)).sum())
    assert hits == optimum_with_bypass(k.tolist(), capacity)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 30), max_size=150), st.lists(st.integers(0, 150), max_size=15),
       st.integers(1, 12), st.integers(0, 4), st.sampled_from(POLICIES))
def test_simulate_steps_the_directory_the_store_steps(keys, cuts, capacity, ahead, policy) -> None:
    """simulate(announce=K) does what a table does when each batch and the K after it were announced before
    the batch is read, and it advances afterwards."""
    raw = np.array(keys, np.int64)
    off = np.unique(np.array([0, *[c % (len(raw) + 1) for c in cuts], len(raw)], np.int64))
    k, off = dedup_batches(raw, off)
    nb = len(off) - 1
    d = CacheDirectory(capacity, policy, key_limit=31)
    want = []
    told = 0
    for b in range(nb):
        while told <= b + ahead and told < nb:
            d.announce(k[off[told]:off[told + 1]])
            told += 1
        want.append(d.access(k[off[b]:off[b + 1]]).hit)
        d.advance()
    got = simulate(k, off, capacity, policy, announce=ahead)
    assert got.tolist() == (np.concatenate(want).tolist() if want else [])


def test_the_ring_and_map_grow_when_many_batches_are_pending() -> None:
    rng = np.random.default_rng(0)
    batches = [rng.choice(5000, 400, replace=False) for _ in range(40)]
    d = CacheDirectory(300, "lru", key_limit=5000)
    ref = AnnouncedReference(300, "lru")
    for b in batches:  # 16,000 pending uses: the first announce sized the ring for 400 (512 entries)
        d.announce(b)
        ref.announce(b.tolist())
    grown = d.nbytes
    for b in batches:
        r = d.access(b)
        slots, hits, _ = ref.access(b.tolist())
        assert r.hit.tolist() == hits and r.slots.tolist() == slots
        assert d.advance() and ref.advance()
    assert not d.advance() and d.announced == 0
    assert grown > CacheDirectory(300, "lru", key_limit=5000).nbytes + 16 * 16_000


def test_announcing_turns_a_scan_into_hits() -> None:
    """Three rows cycling through a two-row cache: LRU misses every access; told two batches ahead, the
    cache evicts the row needed last, as MIN does, and gets the most hits possible (18 of 30)."""
    keys = np.array([0, 1, 2] * 10, np.int64)
    off = np.arange(31, dtype=np.int64)
    assert simulate(keys, off, 2, "lru").sum() == 0
    told = simulate(keys, off, 2, "lru", announce=2)
    assert int(told.sum()) == optimum_with_bypass(keys.tolist(), 2) == 18


def test_simulate_refuses_mismatched_announcements() -> None:
    keys = np.arange(4, dtype=np.int64)
    with pytest.raises(ValueError, match="announced batches"):
        simulate(keys, np.array([0, 2, 4]), 2, "lru", announce=1, announced=(keys, np.array([0, 4])))
    with pytest.raises(ValueError, match="announce must be >= 0"):
        simulate(keys, np.array([0, 2, 4]), 2, "lru", announce=-1)
    with pytest.raises(InvalidInputError, match="announce must be an integer"):
        replay_keys(keys, np.array([0, 4]), [("lru", 2)], announce=-1)
    with pytest.raises(InvalidInputError, match="announce must be an integer"):
        miss_ratio_curve(keys, np.array([0, 4]), [1, 2], "lru", announce=True)




@pytest.mark.parametrize("policy", POLICIES)
def test_a_store_told_batches_counts_the_simulators_hits(tmp_path, policy) -> None:
    """Two cache levels per table; each table is told every batch 3 ahead (empty ones too, so batch numbers
    stay aligned), reads it, advances: per-level hits equal ``replay_trace(..., announce=3)``."""
    tr = tracegen.generate(zipf_alpha=0.9, batches=14, batch_size=120, tables=2, ids=600, seed=5)
    levels = [(policy, 40), ("lfu", 120)]
    ahead = 3
    sim = replay_trace(tr, levels, per_table=True, row_bytes=RB, announce=ahead)
    plain = replay_trace(tr, levels, per_table=True, row_bytes=RB)

    def batch_ids(b: int, t: int) -> np.ndarray:
        lo, hi = tr.batch_offsets[b], tr.batch_offsets[b + 1]
        return tr.ids[lo:hi][tr.table[lo:hi] == t]

    with cached_store(tmp_path / "s", tr.table_names, levels) as store:
        told = 0
        for b in range(tr.num_batches):
            while told <= b + ahead and told < tr.num_batches:
                for t, n in enumerate(tr.table_names):
                    store[n].announce(batch_ids(told, t))
                told += 1
            for t, n in enumerate(tr.table_names):
                if batch_ids(b, t).size:
                    store[n].lookup(batch_ids(b, t))
                assert store[n].advance()
        for n in tr.table_names:
            s = store[n].stats()
            assert [s["dram"]["hits"], s["dram#2"]["hits"]] == [lv.hits for lv in sim[n].levels]
            assert [s["dram"]["misses"], s["dram#2"]["misses"]] == [lv.misses for lv in sim[n].levels]
            assert store[n].announced == 0 and not store[n].advance()
    assert sum(sim[n].levels[0].hits for n in tr.table_names) > sum(plain[n].levels[0].hits for n in tr.table_names)


def test_announcing_never_changes_what_a_table_reads(tmp_path) -> None:
    """Random updates and reads through a small cache over an mmap home, every batch announced 4 ahead
    (some never read), against a dict of the rows written; then flushed, reopened and read again."""
    rng = np.random.default_rng(7)
    cfg = StoreConfig((TableConfig(name="t", num_embeddings=300, dim=DIM,
                                   tiers=(TierConfig("dram", 20 * RB, "lfu+tinylfu"), TierConfig("mmap"))),))
    model: dict[int, np.ndarray] = {}
    batches = [rng.choice(300, rng.integers(1, 40), replace=False) for _ in range(60)]
    with embstore.create(tmp_path / "s", cfg) as store:
        t = store["t"]
        initial = t.lookup(np.arange(300))
        for b in batches[:4]:
            t.announce(b)
        for i, ids in enumerate(batches):
            if i + 4 < len(batches):
                t.announce(batches[i + 4])
            if i % 3 == 0:
                rows = rng.standard_normal((len(ids), DIM)).astype(np.float32)
                t.update(ids, rows)
                model.update(zip(ids.tolist(), rows))
            elif i % 3 == 1:
                want = np.stack([model.get(k, initial[k]) for k in ids.tolist()])
                np.testing.assert_array_equal(t.lookup(ids), want)
            t.advance()
        store.flush()
    with embstore.open(tmp_path / "s") as store:
        keys = np.array(sorted(model), np.int64)
        np.testing.assert_array_equal(store["t"].lookup(keys), np.stack([model[k] for k in keys.tolist()]))


def test_a_table_checks_what_it_is_told(tmp_path) -> None:
    cfg = StoreConfig((TableConfig(name="t", num_embeddings=100, dim=DIM,
                                   tiers=(TierConfig("dram", 10 * RB), TierConfig("mmap"))),
                       TableConfig(name="h", num_embeddings=50, dim=DIM, hash={"kind": "mod"},
                                   tiers=(TierConfig("dram", 10 * RB), TierConfig("mmap")))))
    with embstore.create(tmp_path / "s", cfg) as store:
        t = store["t"]
        with pytest.raises(IdOutOfRangeError):
            t.announce(np.array([5, 100]))
        with pytest.raises(InvalidInputError):
            t.announce(np.array([1.5, 2.0]))
        assert t.announced == 0 and not t.advance()
        store["h"].announce(np.array([10**12, 7, 57]))  # hashed: rows 0 and 7, each once
        assert store["h"].announced == 1
        for _ in range(MAX_ANNOUNCED):
            t.announce(np.array([1, 2, 3]))
        with pytest.raises(InvalidInputError, match="advance"):
            t.announce(np.array([1]))
        assert t.advance() and t.announced == MAX_ANNOUNCED - 1
    with pytest.raises(StoreClosedError):
        t.announce(np.array([1]))


def test_a_whole_table_cache_ignores_announcements(tmp_path) -> None:
    cfg = StoreConfig((TableConfig(name="t", num_embeddings=50, dim=DIM,
                                   tiers=(TierConfig("dram", 50 * RB), TierConfig("mmap"))),))
    with embstore.create(tmp_path / "s", cfg) as store:
        store["t"].announce(np.arange(10))
        np.testing.assert_array_equal(store["t"].lookup(np.arange(10)).shape, (10, DIM))
        assert store["t"].advance()


def test_replay_announce_flag(tmp_path, capsys) -> None:
    tr = tracegen.generate(zipf_alpha=1.0, batches=10, batch_size=200, tables=2, ids=2000, seed=1)
    path = tmp_path / "t.npz"
    save(tr, path)
    assert main(["replay", str(path), "--policy", "lru,lfu+tinylfu", "--capacity", "100", "--announce", "2",
                 "--json"]) == 0
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    keys, off = dedup_batches(dense_keys(tr)[0], tr.batch_offsets)
    for rec in recs:
        want = replay_keys(keys, off, [(rec["policy"], 100)], announce=2, dedup=False).levels[0].hits
        assert rec["hits"] == want and rec["announce"] == 2
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(path), "--capacity", "100", "--announce", "-1"])
    assert exc.value.code == 2 and "--announce: expected an integer >= 0" in capsys.readouterr().err


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 200), st.integers(0, 6), st.integers(1, 40), st.integers(5, 700), st.integers(0, 2**31))
def test_told_bytes_bounds_the_state_a_told_directory_holds(capacity, ahead, batches, width, seed) -> None:
    """``told_bytes(capacity, pending)``, what ``tune --announce`` charges, is at least the look-ahead state a
    directory told ``ahead`` batches ahead holds at any time, ``pending`` being the most distinct ids of
    ``ahead + 1`` consecutive batches; right after the first announcement it is exact."""
    rng = np.random.default_rng(seed)
    bs = [np.unique(rng.integers(0, 3 * width, rng.integers(1, width + 1))) for _ in range(batches)]
    pending = max(sum(len(b) for b in bs[i:i + ahead + 1]) for i in range(batches))
    d = CacheDirectory(capacity, "lfu+tinylfu", key_limit=3 * width)
    told = 0
    most = 0
    for b in range(batches):
        while told <= b + ahead and told < batches:
            d.announce(bs[told])
            if told == 0:
                assert sum(a.nbytes for a in d._ah) == told_bytes(capacity, len(bs[0]))
            told += 1
            most = max(most, sum(a.nbytes for a in d._ah))
        d.access(bs[b])
        d.advance()
    assert most <= told_bytes(capacity, pending)

