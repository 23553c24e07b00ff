"""Invariants of ``training/working_set.py`` against a dict model of the rows (session 10 mutation audit: pinning
by the latest batch, readmitted rows going home, and flush leaving rows clean survived every training test)."""

from __future__ import annotations

import numpy as np
import torch

import embstore
from embstore.training import TieredEmbeddingBagCollection, state_dim
from embstore.training.testing import TorchReference, initial_weights, loss_of, make_store, random_batches, rel_err
from embstore.training.working_set import WorkingSet

DIM, ROWS = 4, 64
OPT = "adagrad"
SDIM = state_dim(OPT, DIM)
CACHED = f'[{{ kind = "dram", capacity = {8 * 4 * (DIM + SDIM)}, policy = "lru" }}, {{ kind = "ssd" }}]'


def open_table(tmp_path) -> tuple[embstore.Store, embstore.Table]:
    """A real store (small LRU DRAM cache over an ssd home) and its table with adagrad state columns."""
    store = make_store(tmp_path / "s", [("a", ROWS, DIM)], CACHED)
    return store, store.ensure_state_dim("a", SDIM)


def resident_keys(ws: WorkingSet) -> set[int]:
    return {int(k) for k in ws.key if k >= 0}


def load(ws: WorkingSet, uniq: np.ndarray, seq: int) -> np.ndarray:
    """Reserve ``uniq`` for batch ``seq`` and fill the new slots from the table, as a fetch does."""
    slots, missing = ws.reserve(uniq, seq)
    rows, st = ws.table.read_with_state(uniq[missing])
    ws.fill(slots[missing], rows, st)
    return slots


def test_a_row_stays_pinned_until_its_latest_batch_leaves_whatever_order_batches_reserve_it(tmp_path) -> None:
    """Batches can reserve out of sequence order (two threads prefetching); a row must stay until the window
    moves past the LATEST batch using it, not the last one to reserve it (its slot would be reused under it)."""
    store, table = open_table(tmp_path)
    rng = np.random.default_rng(3)
    ws = WorkingSet(table, capacity=4)  # small: reserving grows it too
    latest: dict[int, int] = {}  # the model: row -> highest batch sequence using it
    seqs = rng.permutation(12)
    for seq in seqs:
        uniq = np.unique(rng.integers(0, 20, size=5)).astype(np.int64)
        load(ws, uniq, int(seq))
        for k in uniq:
            latest[int(k)] = max(latest.get(int(k), -1), int(seq))
    for horizon in (3, 6, 9, 12):
        ws.evict_before(horizon)
        assert resident_keys(ws) == {k for k, s in latest.items() if s >= horizon}
    store.close()


def test_readmitted_rows_go_home_on_the_next_eviction(tmp_path) -> None:
    """Rows whose write-back failed come back dirty, both those no batch holds and one a later batch reserved
    meanwhile (its fetch not run yet): the next eviction must write them, or the trained update is lost."""
    store, table = open_table(tmp_path)
    ws = WorkingSet(table)
    model = {int(k): v for k, v in enumerate(table.read_with_state(np.arange(ROWS, dtype=np.int64))[0])}
    ws.reserve(np.array([7], np.int64), seq=5)  # reserved by a later batch, its fetch still queued
    keys = np.array([3, 7, 11], np.int64)
    rows = np.arange(len(keys) * DIM, dtype=np.float32).reshape(len(keys), DIM) + 100
    state = np.full((len(keys), SDIM), 2.0, np.float32)
    ws.readmit(keys, rows, state)
    for k, r in zip(keys, rows):
        model[int(k)] = r
    np.testing.assert_array_equal(ws.unloaded(np.array([7], np.int64), ws.index.find(np.array([7], np.int64))),
                                  [False])  # the later batch's fetch skips it, reading no stale copy
    assert ws.evict_before(float("inf")) == len(keys)
    got, got_state = table.read_with_state(np.arange(ROWS, dtype=np.int64))
    np.testing.assert_array_equal(got, np.stack([model[k] for k in range(ROWS)]))
    np.testing.assert_array_equal(got_state[keys], state)
    store.close()


def test_flush_leaves_rows_clean_so_nothing_is_written_twice(tmp_path) -> None:
    """``flush`` mid-pipeline writes the stepped rows still pinned by look-ahead batches; they now equal their
    store copies, so dropping the window right after must write nothing more (it wrote them all again)."""
    store = make_store(tmp_path / "s", [("a", ROWS, DIM)], CACHED)
    ebc = TieredEmbeddingBagCollection(store, ["a"], optimizer=OPT, lr=0.1, lookahead=2)
    assert isinstance(ebc.ws[0], WorkingSet)  # a bounded working set, not a table trained in place
    ref = TorchReference([initial_weights(store, "a")], OPT, 0.1)
    table = ebc.tables[0]
    written: list[int] = []
    inner = table.write_with_state

    def recording(rows, values, state):
        written.extend(int(r) for r in rows)
        return inner(rows, values, state)
    table.write_with_state = recording
    batches = random_batches(4, 6, [ROWS], batch=6, max_len=3, dim=DIM, zipf=1.3)  # hot rows shared by batches
    it = ebc.pipeline(batches, sparse=lambda b: b[:2])
    for i, (ids, offs, w) in enumerate(it):
        loss_of(ebc(ids, offs), w).backward()
        ref.step(ids, offs, w)
        if i == 2:
            before = len(written)
            ebc.flush()
            at_flush = len(written)
            assert at_flush > before  # stepped rows were still in the window
            break
    it.close()  # drops the two look-ahead batches: their rows leave the working set
    ebc.release()
    assert len(written) == at_flush  # nothing was stepped since the flush
    assert ebc.stats()["written_back_rows"] == len(written)
    assert rel_err(table.read_with_state(np.arange(ROWS, dtype=np.int64))[0], ref.weights()[0]) <= 1e-5
    store.close()


def test_write_back_all_then_evict_writes_nothing(tmp_path) -> None:
    """The working set on its own: rows stepped (marked dirty), written back by ``write_back_all``, are clean."""
    store, table = open_table(tmp_path)
    ws = WorkingSet(table)
    uniq = np.array([1, 4, 9], np.int64)
    slots = load(ws, uniq, seq=0)
    ws.rows[torch.from_numpy(slots)] += 1.0
    ws.dirty[slots] = True
    assert ws.write_back_all() == len(uniq)
    again: list[int] = []
    assert ws.evict_before(float("inf"), lambda w, k, r, s: again.extend(k.tolist())) == 0
    assert again == []
    want = initial_weights(store, "a")[uniq] + 1.0
    np.testing.assert_allclose(table.read_with_state(uniq)[0], want, rtol=1e-6)
    store.close()
