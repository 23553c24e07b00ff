"""Session 15 mutation audit of announced batches (``embstore.lookahead``, the look-ahead branches of
``embstore.policies``, ``Table``/``Hierarchy.announce``/``advance``, ``simulate``/``replay``/``miss_ratio_curve``
``announce=``, ``replay --announce``, ``pipeline(announce=)``, ``schedule.announce``).

67 mutants; 46 killed by the existing tests (P25, no ``with_room``, by a hang: the full map probes forever;
several by a segfault of the numba kernels). Survivors:

  mutant                                                      verdict
  L1  with_room does not copy the heap                        gap -> test_the_ring_grows_while_rows_wait_for_their_uses
  L4  with_room grows at live + more == ring (< for <=)       equivalent: grows one announcement sooner, same ranks
  L5  with_room sizes the new ring for live + more (not 2x)   equivalent: _pow2 still fits them; grows more often
  L7  _map_delete wrap case h >= i (for h > i)                gap -> test_the_occurrence_map_is_a_dict
  L14 rank_push rebuild keeps slot s's older entries          equivalent: a duplicate of a live (slot, use) pair
                                                              ranks it where it belongs; stale ones are skipped
  L16 rank_top drops the ``nuse[s] == o`` check               gap -> test_rows_removed_while_waiting_leave_no_rank_
                                                              behind (explicit example), ring-grow test
  L17 rank_top drops the ``slot_key[s] != EMPTY`` check       equivalent: an empty slot's NUSE is INF, never == o
  P2  _announce_row does not save the LFU frequency           gap -> test_a_waiting_row_keeps_the_frequency_...
  P7  _halve_saved never called when the sketch ages          gap -> test_a_waiting_row_keeps_the_frequency_...
  P8  _halve_saved halves every slot's saved frequency        equivalent: SFREQ of a slot not waiting is dead
                                                              (written before every read)
  P10 CLOCK: no reference bit when a hit spends the last use  gap -> test_clock_told_batches_matches_a_clock_reference
  P12 bypass when nu > nuse[v] (for >=)                       equivalent: occurrence ids are per key, and a live
                                                              rank is < INF, so nu == nuse[v] never happens
  P13 no rank_pop after a MIN eviction                        equivalent: the entry left is stale (skipped), or a
                                                              duplicate of the same live pair when the row returns
  P17 a row inserted with an announced use saves no frequency gap -> test_a_waiting_row_keeps_the_frequency_...
  P22 _advance_kernel never moves A_FIRST                     gap (ring grows without bound, advance re-walks every
                                                              old use) -> test_the_ring_stays_its_size_when_...
  P29 simulate's key_limit from the accessed keys only        equivalent: announced keys above it were never
                                                              accessed, so never resident (fidx_get says absent)
  S2  miss_ratio_curve: plain lru ignores announce            gap -> test_a_miss_ratio_curve_told_batches_counts_...
  S3  miss_ratio_curve does not pass announce on              gap -> test_a_miss_ratio_curve_told_batches_counts_...
  S4  replay_trace (one cache over all tables) drops announce gap -> test_a_whole_trace_replay_tells_the_one_cache_...
  E2  pipeline never decrements ``unadvanced``                gap (extra advances would pop others' announcements)
                                                              -> test_a_pipeline_advances_each_table_once_per_batch_...
  TR1 train() does not pass schedule.announce to pipeline     gap -> test_training_tells_the_tables_every_batch

Real bug (found while auditing pipeline exits, not by a mutant; xfail, strict):
test_a_batch_one_table_refuses_leaves_no_announcement_pending_in_the_others.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from embstore import tracegen
from embstore.belady import dedup_batches
from embstore.errors import IdOutOfRangeError
from embstore.hash_index import EMPTY
from embstore.lookahead import AMETA, A_ON, INF, K_KEY, NUSE, SFREQ, _home, _map_delete, map_find
from embstore.policies import M_SKSAMPLE, CacheDirectory, simulate
from embstore.simulator import miss_ratio_curve, pipeline_accesses, replay_keys, replay_trace
from embstore.table import Table
from embstore.traces import dense_keys
from embstore.training import TieredEmbeddingBagCollection
from embstore.training.testing import loss_of, random_batches
from embstore.training.trainer import TrainConfig, train

from cache_refs import KEYS, OPS, AnnouncedReference, run_side_by_side
from test_trainer import config_text
from test_training_prefetch import DIM as TP_DIM
from test_training_prefetch import ROWS, cold_store

class ClockAnnouncedReference(AnnouncedReference):
    """``AnnouncedReference`` with CLOCK as the base policy: a reference bit per slot, set by a hit on a row
    the base policy ranks (or a hit that spends a row's last announced use), cleared when a row enters or
    leaves the base policy; the hand sweeps the slots in order, clearing set bits, and stops at the first
    row without a set bit *and without an announced use* (rows waiting for one are passed over)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity, "lru")
        self.ref = [0] * capacity
        self.hand = 0

    def _to_base(self, k: int, freq: int) -> None:
        super()._to_base(k, freq)
        self.ref[self.slot[k]] = 0

    def _wait(self, k: int, nu: int, freq: int) -> None:
        if k in self.base:
            self.ref[self.slot[k]] = 0
        super()._wait(k, nu, freq)

    def _base_victim(self) -> int:
        key_at = {s: k for k, s in self.slot.items()}
        while True:
            s = self.hand
            self.hand = (s + 1) % self.capacity
            if self.ref[s]:
                self.ref[s] = 0
            elif key_at[s] in self.base:
                return key_at[s]

    def _hit(self, k: int, nu: int) -> None:
        if k in self.nuse:
            self._rerank(k, nu, 0)
        if k in self.base:
            self.ref[self.slot[k]] = 1

    def _freed(self, s: int) -> None:
        self.ref[s] = 0


@settings(max_examples=300, deadline=None)
@given(OPS, st.integers(1, 8))
@example([("access", [0, 1]), ("announce", [0]), ("access", [2])], 2)  # the hand passes over waiting row 0
@example([("access", [0, 1]), ("announce", [0]), ("access", [0]), ("access", [2])], 2)  # 0's hit sets its bit
def test_clock_told_batches_matches_a_clock_reference(ops, capacity) -> None:
    """CLOCK's hand passes over rows waiting for an announced use, and a hit that spends a row's last
    announced use sets its reference bit, slot for slot as a plain-Python CLOCK does."""
    run_side_by_side(CacheDirectory(capacity, "clock", key_limit=16), ClockAnnouncedReference(capacity), ops)


def _lfu_freq(d: CacheDirectory) -> dict[int, int]:
    """Each resident key's LFU frequency: its bucket's, or the one saved while it waits for an announced use."""
    out = {}
    on = d._ah[AMETA][A_ON]
    for s in np.flatnonzero(d.slot_key != EMPTY).tolist():
        waiting = on and d._ah[NUSE][s] != INF
        out[int(d.slot_key[s])] = int(d._ah[SFREQ][s] if waiting else d._bfreq[d._sbucket[s]])
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.tuples(st.just("announce"), KEYS), st.tuples(st.just("access"), KEYS),
                          st.tuples(st.just("advance"), st.just([])), st.tuples(st.just("remove"), KEYS)),
                max_size=60),
       st.sampled_from(["lfu", "lfu+tinylfu"]), st.integers(2, 9))
@example([("access", [0]), ("access", [0]), ("announce", [0]), ("access", [1]), ("access", [1]), ("access", [1]),
          ("announce", [5]), ("announce", [2]), ("access", [2]), ("advance", []), ("advance", []), ("advance", [])],
         "lfu+tinylfu", 2)  # 0 waits at frequency 2 while the sketch ages; 2 is inserted waiting for batch 2
@example([("announce", [5]), ("announce", [2]), ("access", [2]), ("advance", []), ("advance", [])], "lfu", 9)
def test_a_waiting_row_keeps_the_frequency_it_would_have_had(ops, policy, sample) -> None:
    """With room for every key (no eviction, no admission), announcing changes no row's LFU frequency: a row
    waiting for an announced use counts its hits and halves with the sketch's ageing (made frequent here)
    as a twin directory told nothing counts and halves it, and comes back to the LFU lists at that count."""
    told = CacheDirectory(16, policy, key_limit=16)
    plain = CacheDirectory(16, policy, key_limit=16)
    for d in (told, plain):
        d._meta[M_SKSAMPLE] = sample
    for op, keys in ops:
        arr = np.array(keys, np.int64)
        if op == "announce":
            told.announce(arr)
        elif op == "advance":
            told.advance()
        elif op == "remove":
            assert told.remove(arr).tolist() == plain.remove(arr).tolist()
        else:
            a, b = told.access(arr), plain.access(arr)
            assert a.slots.tolist() == b.slots.tolist() and a.hit.tolist() == b.hit.tolist()
        assert _lfu_freq(told) == _lfu_freq(plain)
    while told.advance():
        pass
    assert _lfu_freq(told) == _lfu_freq(plain)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(2, 12), st.sampled_from(["lru", "lfu"]))
def test_the_ring_grows_while_rows_wait_for_their_uses(seed, capacity, policy) -> None:
    """Rows are resident and ranked (the look-ahead heap holds them) when an announcement outgrows the ring
    and map: the grown state still ranks them, slot for slot as the reference."""
    rng = np.random.default_rng(seed)
    d = CacheDirectory(capacity, policy, key_limit=3000)
    ref = AnnouncedReference(capacity, policy)
    hot = rng.choice(3000, 2 * capacity, replace=False)
    ops = [("announce", hot[:capacity].tolist()), ("access", hot[:capacity].tolist()), ("advance", []),
           ("announce", hot.tolist())]
    for _ in range(int(rng.integers(3, 7))):  # > 1,024 pending uses: the ring grows with the hot rows ranked
        ops.append(("announce", rng.choice(3000, 400, replace=False).tolist()))
    ops += [("announce", rng.permutation(hot).tolist())]
    n_told = sum(op == "announce" for op, _ in ops) - 1
    for _ in range(n_told):
        ops += [("access", rng.permutation(hot)[: capacity + 2].tolist()), ("advance", [])]
    run_side_by_side(d, ref, ops)


# keys whose home in an 8-entry map is one of its last two entries or its first: their probe runs wrap
_WRAPPING = [k for k in range(200) if int(_home(np.zeros((8, 3), np.int64), k)) in (6, 7, 0)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.one_of(st.sampled_from(_WRAPPING), st.integers(0, 199))), max_size=80),
       st.sampled_from([8, 16]))
def test_the_occurrence_map_is_a_dict(ops, size) -> None:
    """The key -> occurrence map (linear probing, backward-shift deletion) in a small table (up to 3/4 full:
    long probe runs that wrap around the table's end) against a dict: every key stored is found with its
    values, every key deleted is gone."""
    amap = np.full((size, 3), EMPTY, np.int64)
    model: dict[int, int] = {}
    for put, key in ops:
        i = map_find(amap, key)
        assert (amap[i, K_KEY] == key) == (key in model)
        if put and key not in model and len(model) < size * 3 // 4:
            amap[i] = (key, 3 * key, 3 * key + 1)
            model[key] = 3 * key
        elif not put and key in model:
            _map_delete(amap, i)
            del model[key]
        for k in {key, *model}:
            j = map_find(amap, k)
            if k in model:
                assert amap[j].tolist() == [k, 3 * k, 3 * k + 1]
            else:
                assert amap[j, K_KEY] == EMPTY
    assert sorted(amap[amap[:, K_KEY] != EMPTY, K_KEY].tolist()) == sorted(model)


_small = st.lists(st.integers(0, 5), min_size=1, max_size=4, unique=True)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(st.tuples(st.just("announce"), _small), st.tuples(st.just("access"), _small),
                          st.tuples(st.just("advance"), st.just([])), st.tuples(st.just("remove"), _small)),
                max_size=40), st.integers(1, 3), st.sampled_from(["lru", "lfu"]))
@example([("announce", [0, 1]), ("announce", [2, 3]), ("announce", [2, 3, 1]), ("announce", [0]),
          ("access", [0, 1]), ("advance", []), ("remove", [0]), ("access", [2, 3]), ("advance", []),
          ("access", [2, 3, 1])], 2, "lru")  # 0's rank (its use in the last batch) outlives it in 2's slot
def test_rows_removed_while_waiting_leave_no_rank_behind(ops, capacity, policy) -> None:
    """A hierarchy removes rows a failed lower level could not take (``remove``), announced ones too; their
    slots are reused while their announced uses are still pending. The victim is still the resident needed
    last (never the slot's new row because of the removed row's rank), slot for slot as the reference."""
    run_side_by_side(CacheDirectory(capacity, policy, key_limit=6), AnnouncedReference(capacity, policy), ops)


def test_the_ring_stays_its_size_when_batches_are_advanced_past() -> None:
    """300 batches of 50 uses, never more than three pending: the occurrences advanced past free their room,
    so the ring and map sized by the first announcement (1,024 uses) never grow."""
    rng = np.random.default_rng(3)
    d = CacheDirectory(40, "lru", key_limit=500)
    batches = [rng.choice(500, 50, replace=False) for _ in range(300)]
    for b in batches[:2]:
        d.announce(b)
    sizes = set()
    for i, b in enumerate(batches):
        if i + 2 < len(batches):
            d.announce(batches[i + 2])
        d.access(b)
        assert d.advance()
        sizes.add(d.nbytes)
    assert len(sizes) == 1 and d.announced == 0


def _announced_log(monkeypatch) -> list[tuple]:
    """Every ``Table.announce`` (table, ids) and ``Table.advance`` (table, what it returned), in order."""
    log: list[tuple] = []
    announce, announce_rows, advance = Table.announce, Table.announce_rows, Table.advance

    def logged_announce(self, ids):
        announce(self, ids)
        log.append(("announce", self.name, np.unique(np.asarray(ids)).tolist()))

    def logged_announce_rows(self, rows):  # the pipeline tells rows (those its fetch reads), in read order
        announce_rows(self, rows)
        log.append(("announce", self.name, np.asarray(rows).tolist()))

    def logged_advance(self):
        told = advance(self)
        log.append(("advance", self.name, told))
        return told
    monkeypatch.setattr(Table, "announce", logged_announce)
    monkeypatch.setattr(Table, "announce_rows", logged_announce_rows)
    monkeypatch.setattr(Table, "advance", logged_advance)
    return log


@pytest.mark.parametrize("leave", ["end", "break", "raise"])
@pytest.mark.parametrize("lookahead, announce", [(0, 1), (2, 3)])
def test_a_pipeline_advances_each_table_once_per_batch_it_announced(tmp_path, monkeypatch, leave, lookahead,
                                                                     announce) -> None:
    """pipeline(announce=A) tells each table every batch it reads, in order, once (the rows its fetch reads:
    ``pipeline_accesses``); a table advances past one right before the next one's fetch (with lookahead 0:
    once the loop body that got it returned; else on the prefetch thread, so before body i's forward at
    least i - 1 and at most i + lookahead times), exactly once per batch announced (never an advance with
    nothing pending, which would drop someone else's announcement), however the loop is left."""
    store = cold_store(tmp_path / "s", "sgd")
    ebc = TieredEmbeddingBagCollection(store, ["a", "b"], optimizer="sgd")
    batches = random_batches(5, 8, [ROWS, ROWS], batch=8, max_len=3, dim=TP_DIM)
    log = _announced_log(monkeypatch)
    with contextlib.suppress(RuntimeError):
        for i, (ids, offs, w) in enumerate(ebc.pipeline(batches, lookahead=lookahead, sparse=lambda b: b[:2],
                                                        announce=announce)):
            for name in ("a", "b"):
                done = [e for e in log if e[0] == "advance" and e[1] == name]
                assert done == [("advance", name, True)] * len(done)
                # batch j's fetch advances past j - 1 before it reads; here fetch i - 1 is done, i + k at most
                assert len(done) == i if not lookahead else i - 1 <= len(done) <= i + lookahead
            loss_of(ebc(ids, offs), w).backward()
            if i == 3 and leave == "break":
                break
            if i == 3 and leave == "raise":
                raise RuntimeError("body failed")
    for t, name in enumerate(("a", "b")):
        told = [e[2] for e in log if e[0] == "announce" and e[1] == name]
        read = pipeline_accesses(np.concatenate([b[0][t].numpy() for b in batches]),
                                 np.cumsum([0] + [len(b[0][t]) for b in batches]), lookahead)
        assert told == [r.tolist() for r, _, _ in read[:len(told)]]
        assert len(told) == (len(batches) if leave == "end" else min(len(batches), 4 + lookahead + announce))
        assert [e for e in log if e[0] == "advance" and e[1] == name] == [("advance", name, True)] * len(told)
        assert store[name].announced == 0
    store.close()


def test_training_tells_the_tables_every_batch(tmp_path, monkeypatch) -> None:
    """schedule.announce reaches the pipeline: every table is told each training batch once, in the order
    trained, and advanced past each (the numbers trained are checked equal in test_trainer)."""
    log = _announced_log(monkeypatch)
    p = tmp_path / "cfg.toml"
    p.write_text(config_text(batches=6).replace("lookahead = 2", "lookahead = 1\nannounce = 2"))
    res = train(TrainConfig.from_toml(p), tmp_path / "run", progress=False)
    for name in ("a", "b", "c"):
        told = [e for e in log if e[0] == "announce" and e[1] == name]
        assert len(told) == len(res.losses) == 6
        assert [e for e in log if e[0] == "advance" and e[1] == name] == [("advance", name, True)] * 6


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=80), st.lists(st.integers(0, 80), max_size=10),
       st.integers(0, 3), st.sampled_from(["lru", "lfu", "clock+tinylfu"]))
def test_a_miss_ratio_curve_told_batches_counts_simulates_hits(keys, cuts, ahead, policy) -> None:
    """miss_ratio_curve(announce=K) at each capacity is the hits of simulate(announce=K) at that capacity
    (plain LRU's one-pass stack-distance curve cannot know announcements)."""
    raw = np.array(keys, np.int64)
    k, off = dedup_batches(raw, np.unique(np.array([0, *[c % (len(raw) + 1) for c in cuts], len(raw)], np.int64)))
    caps = np.arange(1, 8)
    curve = miss_ratio_curve(k, off, caps, policy, dedup=False, announce=ahead)
    assert curve.tolist() == [int(simulate(k, off, int(c), policy, announce=ahead).sum()) if c <= len(k)
                              else int(simulate(k, off, len(np.unique(k)), policy, announce=ahead).sum())
                              for c in caps]


def test_a_whole_trace_replay_tells_the_one_cache_every_batch() -> None:
    """replay_trace(announce=K) over all tables at once is replay_keys(announce=K) of the trace's dense keys;
    on this trace announcing changes the hits (so a replay that dropped it would be seen)."""
    tr = tracegen.generate(zipf_alpha=0.9, batches=12, batch_size=100, tables=2, ids=400, seed=2)
    keys, _ = dense_keys(tr)
    for ahead in (0, 3):
        got = replay_trace(tr, [("lru", 60), ("lfu", 150)], announce=ahead)["all"]
        want = replay_keys(keys, tr.batch_offsets, [("lru", 60), ("lfu", 150)], announce=ahead)
        assert [lv.hits for lv in got.levels] == [lv.hits for lv in want.levels]
    plain = replay_trace(tr, [("lru", 60), ("lfu", 150)])["all"]
    assert [lv.hits for lv in got.levels] != [lv.hits for lv in plain.levels]


def test_a_batch_one_table_refuses_leaves_no_announcement_pending_in_the_others(tmp_path) -> None:
    """Batch 3 has an id out of table b's range: reading it ahead raises (IdOutOfRangeError, from b's
    announce) and the loop is left; every table must be left with nothing pending, as after any early exit.
    Table a was told batch 3 before b refused it, and nothing advances a past it: a stays one batch behind
    b for as long as the tables live (a later pipeline's advances pop a's stale batch first)."""
    store = cold_store(tmp_path / "s", "sgd")
    ebc = TieredEmbeddingBagCollection(store, ["a", "b"], optimizer="sgd")
    batches = random_batches(4, 6, [ROWS, ROWS], batch=8, max_len=3, dim=TP_DIM)
    (ids_a, ids_b), offs, w = batches[3]
    ids_b = ids_b.clone()
    ids_b[0] = ROWS + 5
    batches[3] = ([ids_a, ids_b], offs, w)
    with pytest.raises(IdOutOfRangeError):
        for ids, offs, w in ebc.pipeline(batches, lookahead=0, sparse=lambda b: b[:2], announce=2):
            loss_of(ebc(ids, offs), w).backward()
    assert store["b"].announced == 0
    try:
        assert store["a"].announced == 0
    finally:
        store.close()
