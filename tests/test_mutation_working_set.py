"""The working set's fault and concurrency paths no other training test pinned (session 12 mutation audit of
``training/working_set.py``, ``training/ebc.py``, ``training/_index.py`` and ``training/_kernels.py``, second part;
the first part is ``test_mutation_ebc.py``).

Each test kills mutants that survived the training suites: a failed demand fetch left pinned, ``release``
leaving prefetched batches queued or returning before a failed write-back was readmitted, a pipeline closed
between a forward and its backward, a demand fetch or a dropped batch racing a running prefetch, retired
forwards kept alive, the slot index's count and load factor, and rowwise Adagrad storing an overflowed state.
Races are made deterministic by holding a read or write on the prefetch thread until the module waits for
it. References are plain torch (``TorchReference``), a dict, or the rows' initial values minus SGD's exact
steps.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import threading
import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import embstore
import embstore.training.ebc as ebc_module
from embstore.errors import DiskFullError, TierIOError
from embstore.training import TieredEmbeddingBagCollection, state_dim
from embstore.training._index import SlotIndex
from embstore.training._kernels import fused_bag_step, step_rows
from embstore.training.testing import TorchReference, initial_weights, loss_of, make_store, random_batches, rel_err

ROWS, DIM, LR = 300, 4, 0.5


def cached_tiers(optimizer: str = "sgd", rows: int = ROWS // 10) -> str:
    """An LRU DRAM cache of ``rows`` rows (with their state) over an ssd home: a bounded working set."""
    row_bytes = 4 * (DIM + state_dim(optimizer, DIM))
    return f'[{{ kind = "dram", capacity = {rows * row_bytes}, policy = "lru" }}, {{ kind = "ssd" }}]'


def stored(store, name: str = "a") -> np.ndarray:
    t = store[name]
    return t.read_with_state(np.arange(t.num_rows, dtype=np.int64))[0]


def bag(*rows: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One table, one bag of ``rows``."""
    return [torch.tensor(rows, dtype=torch.int64)], [torch.tensor([0, len(rows)])]


def sgd_rows(init: np.ndarray, *batches: tuple[int, ...]) -> np.ndarray:
    """The rows after SGD (lr ``LR``) on ``out.sum()`` of each one-bag batch: each id takes one step of -LR."""
    want = init.copy()
    for rows in batches:
        for r in rows:
            want[r] -= LR
    return want


class HeldRead:
    """Holds the prefetch thread's first read of ``row`` until the module waits for ``batch``'s fetch
    (through ``concurrent.futures.wait`` in ``ebc.py``), or the test lets it go: a race, made deterministic."""

    def __init__(self, ebc: TieredEmbeddingBagCollection, monkeypatch: pytest.MonkeyPatch, row: int) -> None:
        self.batch = None  # the batch whose fetch is held (set once prefetched)
        self.go = threading.Event()
        table = ebc.tables[0]
        inner = table.read_with_state

        def read(rows: np.ndarray):
            if row in rows and threading.current_thread().name.startswith("embstore-prefetch"):
                self.go.wait(30)
            return inner(rows)
        table.read_with_state = read

        def wait(fs, *args, **kwargs):
            if self.batch is not None and any(f is self.batch.future for f in fs):
                self.go.set()
            return cf.wait(fs, *args, **kwargs)
        monkeypatch.setattr(ebc_module, "cf", types.SimpleNamespace(wait=wait, Future=cf.Future,
                                                                  ThreadPoolExecutor=cf.ThreadPoolExecutor))


def test_a_demand_fetch_waits_for_a_running_prefetch_of_its_rows(tmp_path, monkeypatch) -> None:
    """A forward that matches no queued batch is fetched on demand, but a row it shares with a queued batch
    is that batch's to load: the forward must wait for that prefetch, or it pools the slot before it is filled."""
    store = make_store(tmp_path / "s", [("a", ROWS, DIM)], cached_tiers())
    init = initial_weights(store, "a")
    ebc = TieredEmbeddingBagCollection(store, ["a"], optimizer="sgd", lr=LR)
    held = HeldRead(ebc, monkeypatch, row=10)
    ebc.prefetch(*bag(10, 11))
    held.batch = ebc._queue[0]
    try:
        out = ebc(*bag(10, 20))
    finally:
        held.go.set()
    np.testing.assert_allclose(out[0, 0].detach().numpy(), init[[10, 20]].sum(0), rtol=1e-6)
    out.sum().backward()
    ebc(*bag(10, 11)).sum().backward()
    ebc.flush()
    np.testing.assert_allclose(stored(store), sgd_rows(init, (10, 20), (10, 11)), rtol=1e-6)
    ebc.release()
    store.close()


def test_a_dropped_batch_s_fetch_lands_before_its_slots_are_reused(tmp_path, monkeypatch) -> None:
    """A pipeline closed early drops the batches it prefetched, whose fetches may still be running. Their
    slots go to the next batch only once those fetches have landed, or a late fetch overwrites that batch's
    rows with the dropped batch's (then trained and written home under the wrong ids)."""
    store = make_store(tmp_path / "s", [("a", ROWS, DIM)], cached_tiers())
    init = initial_weights(store, "a")
    ebc = TieredEmbeddingBagCollection(store, ["a"], optimizer="sgd", lr=LR)
    held = HeldRead(ebc, monkeypatch, row=10)
    it = ebc.pipeline([bag(1, 2), bag(10, 11)], lookahead=1)
    next(it)
    held.batch = ebc._queue[1]
    it.close()  # drops both batches, the read of the second one still held
    try:
        out = ebc(*bag(20, 21))  # fetched on demand into the freed slots
    finally:
        held.go.set()
    held.batch.future.result(timeout=30)  # the dropped batch's fetch has landed
    np.testing.assert_allclose(out[0, 0].detach().numpy(), init[[20, 21]].sum(0), rtol=1e-6)
    out.sum().backward()
    ebc.flush()
    np.testing.assert_allclose(stored(store), sgd_rows(init, (20, 21)), rtol=1e-6)
    ebc.release()
    store.close()


def test_a_release_that_returns_has_written_every_row(tmp_path, monkeypatch) -> None:
    """``release`` waits for the write-behind in flight: one that fails puts its rows back and is raised, and
    a release that returns has written them. Returning first, it left the failed rows in the working set
    (readmitted once it had already written the others), where closing the store lost them."""
    path = tmp_path / "s"
    store = make_store(path, [("a", ROWS, DIM)], cached_tiers())
    init = initial_weights(store, "a")
    ebc = TieredEmbeddingBagCollection(store, ["a"], optimizer="sgd", lr=LR)
    table, go = ebc.tables[0], threading.Event()
    inner, calls = table.write_with_state, []

    def write(keys, rows, state):  # the first write-back fails once the module waits for the prefetch thread
        calls.append(keys.tolist())
        if len(calls) == 1:
            go.wait(10)
            raise DiskFullError("ssd", "write", errno.ENOSPC)
        return inner(keys, rows, state)
    table.write_with_state = write

    def wait(fs, *args, **kwargs):
        go.set()
        return cf.wait(fs, *args, **kwargs)
    ebc.prefetch(*bag(5))
    ebc.prefetch(*bag(6))
    ebc(*bag(5)).sum().backward()  # row 5 leaves the window: its write-behind is held, then fails
    monkeypatch.setattr(ebc_module, "cf", types.SimpleNamespace(wait=wait, Future=cf.Future,
                                                              ThreadPoolExecutor=cf.ThreadPoolExecutor))
    try:
        ebc.release()
    except TierIOError:
        ebc.release()
    store.close()
    assert calls[0] == [5]
    with embstore.open(path) as again:
        np.testing.assert_allclose(stored(again), sgd_rows(init, (5,)), rtol=1e-6)


def test_a_failed_demand_fetch_leaves_nothing_pinned(tmp_path) -> None:
    """A forward whose demand fetch fails takes its batch out of the window: later batches' rows leave the
    working set once trained, and training stays exact. Left pending, the failed batch held the eviction
    horizon at its sequence number, so no later row ever left (nor was written back)."""
    batches = random_batches(11, 6, [ROWS], batch=6, max_len=4, dim=DIM)
    store = make_store(tmp_path / "s", [("a", ROWS, DIM)], cached_tiers())
    ref = TorchReference([initial_weights(store, "a")], "sgd", LR)
    ebc = TieredEmbeddingBagCollection(store, ["a"], optimizer="sgd", lr=LR)
    table = ebc.tables[0]
    inner, reads = table.read_with_state, []

    def read(rows):
        reads.append(len(rows))
        if len(reads) == 3:
            raise TierIOError("ssd", "read", errno.EIO)
        return inner(rows)
    table.read_with_state = read
    errors = 0
    for ids, offs, w in batches:
        while True:
            try:
                out = ebc(ids, offs)
                break
            except TierIOError:
                errors += 1
        loss_of(out, w).backward()
        ref.step(ids, offs, w)
        assert ebc.stats()["working_set_rows"] == {"a": 0} and ebc._pending == {}
    assert errors == 1
    assert rel_err(stored(store), ref.weights()[0]) <= 1e-5
    store.close()


def test_release_forgets_prefetched_batches(tmp_path) -> None:
    """``release`` drops the look-ahead: the same batch forwarded afterwards is fetched and trained anew
    (taking the released, retired batch from the queue made its backward raise)."""
    store = make_store(tmp_path / "s", [("a", ROWS, DIM)], cached_tiers())
    init = initial_weights(store, "a")
    ebc = TieredEmbeddingBagCollection(store, ["a"], optimizer="sgd", lr=LR)
    ebc.prefetch(*bag(3, 4))
    ebc.release()
    ebc(*bag(3, 4)).sum().backward()
    assert ebc.counters["demand_misses"] == 2 and ebc.steps == 1
    ebc.flush()
    np.testing.assert_allclose(stored(store), sgd_rows(init, (3, 4)), rtol=1e-6)
    ebc.release()
    store.close()


def test_a_pipeline_closed_between_forward_and_backward_keeps_that_step(tmp_path) -> None:
    """Closing a pipeline drops the batches it prefetched and never yielded, not the one it yielded whose
    backward is still to come: that backward must step (it raised, the batch having been retired)."""
    store = make_store(tmp_path / "s", [("a", ROWS, DIM)], cached_tiers())
    init = initial_weights(store, "a")
    ebc = TieredEmbeddingBagCollection(store, ["a"], optimizer="sgd", lr=LR)
    it = ebc.pipeline([bag(1, 2), bag(2, 3), bag(4)], lookahead=2)
    ids, offs = next(it)
    out = ebc(ids, offs)
    it.close()
    out.sum().backward()
    assert ebc.steps == 1 and ebc._pending == {}
    ebc.flush()
    np.testing.assert_allclose(stored(store), sgd_rows(init, (1, 2)), rtol=1e-6)
    store.close()


def test_forwards_without_a_backward_are_not_kept(tmp_path) -> None:
    """A grad-enabled forward whose backward never comes (a validation pass left in train mode) is retired by
    the next forward and forgotten: the module held every such batch (ids, slots, offsets) for good."""
    store = make_store(tmp_path / "s", [("a", ROWS, DIM)], cached_tiers())
    ebc = TieredEmbeddingBagCollection(store, ["a"], optimizer="sgd", lr=LR)
    for i in range(5):
        out = ebc(*bag(i, i + 1))
        assert out.requires_grad
    del out
    assert len(ebc._awaiting) == 1 and len(ebc._pending) == 1 and ebc.steps == 0
    ebc(*bag(7)).sum().backward()
    assert ebc._awaiting == [] and ebc._pending == {} and ebc.steps == 1
    ebc.release()
    store.close()


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "delete"]),
                              st.lists(st.integers(0, 40) | st.sampled_from([2**62, 2**62 - 1, 2**40]),
                                       max_size=12)), max_size=20))
def test_slot_index_equals_a_dict_and_keeps_its_load_factor(ops) -> None:
    """``SlotIndex`` (row id -> slot) against a dict through puts that grow it and deletes, row 0 and ids
    near 2**62 included; it stays at most half full, so a probe for an absent id always meets an empty cell."""
    index, model, slot = SlotIndex(4), {}, 0
    for op, keys in ops:
        if op == "put":
            new = np.array(list(dict.fromkeys(k for k in keys if k not in model)), np.int64)
            index.put(new, np.arange(slot, slot + len(new), dtype=np.int64))
            model.update({int(k): slot + i for i, k in enumerate(new)})
            slot += len(new)
        else:
            gone = np.array(list(dict.fromkeys(k for k in keys if k in model)), np.int64)
            index.delete(gone)
            for k in gone:
                del model[int(k)]
        assert index.count == len(model) and 2 * len(model) <= len(index._tk)
        probe = np.array(sorted(set(model) | {0, 1, 7, 41, 2**62, 2**40 + 1}), np.int64)
        np.testing.assert_array_equal(index.find(probe), [model.get(int(k), -1) for k in probe])


def test_rowwise_adagrad_keeps_a_row_whose_state_would_overflow(tmp_path) -> None:
    """Rowwise Adagrad with a finite gradient whose mean square, added to a state already near FLT_MAX,
    overflows the state: the row and its state stay as they were and the step counts as skipped. The
    one-pass path (lr / sqrt(inf) is 0, so the row "moves" by 0) stored the inf state."""
    rows = np.full((3, DIM), 0.5, np.float32)
    state = np.array([[3.0e38], [1.0], [2.0]], np.float32)
    g = np.array([[7e18] * DIM, [1.0] * DIM, [1.0] * DIM], np.float32)  # row 0: mean square 4.9e37
    old_rows, old_state = rows.copy(), state.copy()
    assert step_rows(1, rows, state, np.arange(3), g, 0.1, 1e-8, 0.9, 0.999, 0.0, 0, 1) == 1
    np.testing.assert_array_equal(rows[0], old_rows[0])
    np.testing.assert_array_equal(state[0], old_state[0])
    assert np.isfinite(state).all() and np.isfinite(rows).all()
    assert (rows[1:] < old_rows[1:]).all() and (state[1:] > old_state[1:]).all()
    bag_rows, bag_state = old_rows.copy(), old_state.copy()
    offsets, inv = np.array([0, 1, 2, 3], np.int64), np.arange(3, dtype=np.int64)
    assert fused_bag_step(1, bag_rows, bag_state, np.arange(3), inv, offsets, g, False, 0.1, 1e-8, 0.9, 0.999,
                          0.0, 0, 1) == 1
    np.testing.assert_array_equal(bag_rows, rows)
    np.testing.assert_array_equal(bag_state, state)
