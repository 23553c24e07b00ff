"""Look-ahead prefetch: the working set keeps the window's rows, so forwards never miss and never read stale rows."""

from __future__ import annotations

import collections
import contextlib

import numpy as np
import pytest
import torch
from faultfs import needs_mount

from embstore.errors import InvalidInputError
from embstore.training import TieredEmbeddingBagCollection, state_dim
from embstore.training.testing import TorchReference, initial_weights, loss_of, make_store, random_batches, rel_err

ROWS, DIM = 2000, 8


def cold_store(path, optimizer="rowwise_adagrad"):
    row_bytes = 4 * (DIM + state_dim(optimizer, DIM))
    tiers = f'[{{ kind = "dram", capacity = {ROWS // 10 * row_bytes} }}, {{ kind = "ssd" }}]'
    return make_store(path, [("a", ROWS, DIM), ("b", ROWS, DIM)], tiers)


def run(ebc, batches, lookahead):
    for ids, offs, w in ebc.pipeline(batches, lookahead=lookahead, sparse=lambda b: b[:2]):
        loss_of(ebc(ids, offs), w).backward()


def test_demand_misses_zero_with_lookahead_and_positive_without(tmp_path) -> None:
    batches = random_batches(2, 12, [ROWS, ROWS], batch=32, max_len=8, dim=DIM, zipf=1.2)
    cold = cold_store(tmp_path / "cold")
    ebc = TieredEmbeddingBagCollection(cold, ["a", "b"], optimizer="rowwise_adagrad")
    run(ebc, batches, 0)
    assert ebc.counters["demand_misses"] > 0
    assert ebc.counters["prefetched_rows"] == 0

    warm = cold_store(tmp_path / "ahead")
    ebc2 = TieredEmbeddingBagCollection(warm, ["a", "b"], optimizer="rowwise_adagrad")
    run(ebc2, batches, 3)
    assert ebc2.counters["demand_misses"] == 0
    # every row a batch needed came through prefetch; rows shared by consecutive batches are fetched once
    assert 0 < ebc2.counters["prefetched_rows"] <= ebc.counters["demand_misses"]
    ebc.flush()
    ebc2.flush()
    for n in ("a", "b"):
        rows = np.arange(ROWS, dtype=np.int64)
        np.testing.assert_array_equal(cold[n].read_with_state(rows)[0], warm[n].read_with_state(rows)[0])
    cold.close()
    warm.close()


def test_window_pins_rows_and_releases_them(tmp_path) -> None:
    """A row used by batches i and i+1 stays in the working set across i's step, then leaves."""
    store = cold_store(tmp_path / "s", "sgd")
    ebc = TieredEmbeddingBagCollection(store, ["a", "b"], optimizer="sgd", lr=0.5)
    same = ([torch.tensor([5, 6]), torch.tensor([7])], [torch.tensor([0, 2]), torch.tensor([0, 1])])
    other = ([torch.tensor([9]), torch.tensor([9])], [torch.tensor([0, 1]), torch.tensor([0, 1])])
    ebc.prefetch(*same)
    ebc.prefetch(*same)
    ebc.prefetch(*other)
    ebc(*same).sum().backward()  # step 1 updates rows 5, 6 / 7 in the working set only
    assert ebc.stats()["working_set_rows"] == {"a": 3, "b": 2}
    before = store["a"].read_with_state(np.array([5]))[0]
    out = ebc(*same)  # must see step 1's update, from the working set
    assert ebc.counters["demand_misses"] == 0
    ref = initial_weights(store, "a")[[5, 6]].sum(0) - 2 * 0.5  # d(sum)/d(row) = 1 for each row
    np.testing.assert_allclose(out[0, 0].detach().numpy(), ref, rtol=1e-6)
    np.testing.assert_array_equal(before, initial_weights(store, "a")[[5]])  # store not written yet
    out.sum().backward()
    assert ebc.stats()["working_set_rows"] == {"a": 1, "b": 1}  # only batch 3's row 9 left
    with torch.no_grad():
        ebc(*other)
    assert ebc.stats()["working_set_rows"] == {"a": 0, "b": 0}
    ebc.flush()  # row 5 left the window; its write-back may still be in flight on the prefetch thread
    np.testing.assert_allclose(store["a"].read_with_state(np.array([5]))[0][0],
                               initial_weights(store, "a")[5] - 1.0, rtol=1e-6)
    store.close()


def test_unprefetched_batch_is_fetched_on_demand_and_stays_correct(tmp_path) -> None:
    batches = random_batches(4, 6, [ROWS, ROWS], batch=16, max_len=6, dim=DIM)
    store = cold_store(tmp_path / "s", "adagrad")
    init = [initial_weights(store, n) for n in ("a", "b")]
    ebc = TieredEmbeddingBagCollection(store, ["a", "b"], optimizer="adagrad", lr=0.1)
    ref = TorchReference(init, "adagrad", 0.1)
    ebc.prefetch(*batches[1][:2])  # out of order: batch 0 arrives first and must not use batch 1's slot
    for i, (ids, offs, w) in enumerate(batches):
        out = ebc(ids, offs)
        loss_of(out, w).backward()
        assert rel_err(out.detach().numpy(), ref.step(ids, offs, w).numpy()) <= 1e-5
        if i + 2 < len(batches):
            ebc.prefetch(*batches[i + 2][:2])
    ebc.flush()
    for n, want in zip(("a", "b"), ref.weights()):
        assert rel_err(store[n].read_with_state(np.arange(ROWS))[0], want) <= 1e-5
    store.close()


def test_a_forward_that_skips_prefetched_batches_drops_them(tmp_path, caplog) -> None:
    """Batches 0-3 prefetched by hand, then batches 1-3 forwarded: batch 0 was skipped, so it is dropped
    (its rows unpinned) and 1-3 still come from the look-ahead. Left at the head of the queue, it kept every
    later batch from matching (all demand fetches) and its rows pinned."""
    batches = random_batches(9, 4, [ROWS, ROWS], batch=16, max_len=6, dim=DIM)
    store = cold_store(tmp_path / "s", "adagrad")
    ebc = TieredEmbeddingBagCollection(store, ["a", "b"], optimizer="adagrad", lr=0.1)
    ref = TorchReference([initial_weights(store, n) for n in ("a", "b")], "adagrad", 0.1)
    for ids, offs, _ in batches:
        ebc.prefetch(ids, offs)
    for ids, offs, w in batches[1:]:
        out = ebc(ids, offs)
        loss_of(out, w).backward()
        assert rel_err(out.detach().numpy(), ref.step(ids, offs, w).numpy()) <= 1e-5
    assert "skipped 1 prefetched batch" in caplog.text
    assert ebc.counters["demand_misses"] == 0
    with torch.no_grad():
        ebc(*batches[0][:2])  # a batch that matches nothing queued: fetched on demand, the queue untouched
    assert ebc.counters["demand_misses"] > 0
    assert ebc._queue == collections.deque()
    assert ebc.stats()["working_set_rows"] == {"a": 0, "b": 0}
    ebc.flush()
    for n, want in zip(("a", "b"), ref.weights()):
        assert rel_err(store[n].read_with_state(np.arange(ROWS))[0], want) <= 1e-5
    store.close()


def test_keyed_batches_through_pipeline(tmp_path) -> None:
    from embstore.training import KeyedJaggedBatch

    batches = random_batches(6, 4, [ROWS, ROWS], batch=8, max_len=4, dim=DIM)
    kjbs = [KeyedJaggedBatch(["a", "b"], torch.cat(ids), torch.cat([o.diff() for o in offs]))
            for ids, offs, _ in batches]
    store = cold_store(tmp_path / "s", "sgd")
    ebc = TieredEmbeddingBagCollection(store, ["a", "b"], lookahead=2)
    seen = 0
    for kjb in ebc.pipeline(kjbs):
        ebc(kjb).sum().backward()
        seen += 1
    assert seen == 4 and ebc.counters["demand_misses"] == 0 and ebc.steps == 4
    store.close()


def test_write_backs_run_on_the_prefetch_thread_and_stay_exact(tmp_path) -> None:
    """With look-ahead, evicted rows are written behind on the prefetch thread; the result equals the
    same training without look-ahead (whose write-backs are synchronous) bit for bit."""
    import threading

    batches = random_batches(5, 14, [ROWS, ROWS], batch=32, max_len=8, dim=DIM, zipf=1.2)
    plain = cold_store(tmp_path / "plain")
    run(TieredEmbeddingBagCollection(plain, ["a", "b"], optimizer="rowwise_adagrad"), batches, 0)

    ahead = cold_store(tmp_path / "ahead")
    ebc = TieredEmbeddingBagCollection(ahead, ["a", "b"], optimizer="rowwise_adagrad")
    writers: list[str] = []
    for table in ebc.tables:  # the tables as the module holds them (with their optimizer state)
        inner = table.write_with_state

        def recording(rows, values, state, _inner=inner):
            writers.append(threading.current_thread().name)
            return _inner(rows, values, state)
        table.write_with_state = recording
    run(ebc, batches, 2)
    assert writers and all(w.startswith("embstore-prefetch") for w in writers)
    ebc.flush()
    rows = np.arange(ROWS, dtype=np.int64)
    for n in ("a", "b"):
        got, got_state = ahead[n].read_with_state(rows)
        want, want_state = plain[n].read_with_state(rows)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got_state, want_state)
    plain.close()
    ahead.close()


@needs_mount
def test_a_failed_write_behind_surfaces_as_disk_full(tiny_tmpfs) -> None:
    """A real ENOSPC hit by a write-back on the prefetch thread is raised to the training loop, typed."""
    import embstore
    from embstore.config import StoreConfig, TableConfig, TierConfig

    rows, dim = 400_000, 8
    row_bytes = 4 * (dim + state_dim("sgd", dim))
    cfg = TableConfig("t", rows, dim, tiers=(TierConfig("dram", 512 * row_bytes, "lru"), TierConfig("ssd")))
    store = embstore.create(tiny_tmpfs.path / "s", StoreConfig((cfg,)))
    ebc = TieredEmbeddingBagCollection(store, ["t"], optimizer="sgd", lr=0.1)
    rng = np.random.default_rng(0)
    batches = [([rng.integers(0, rows, 512)], [np.arange(0, 513, 4)]) for _ in range(400)]
    with pytest.raises(embstore.DiskFullError):
        for ids, offs in ebc.pipeline(batches, lookahead=2, sparse=lambda b: b):
            ebc(ids, offs).sum().backward()
        ebc.flush()
    try:
        store.close()
    except embstore.TierIOError:
        pass  # closing flushes again, into the same full disk


@pytest.mark.parametrize("leave", ["break", "iterator_raises", "step_raises"])
def test_a_pipeline_left_early_drops_its_look_ahead(tmp_path, caplog, leave) -> None:
    """Leaving a pipeline loop early unqueues the batches it prefetched but never yielded: the next pipeline's
    prefetches match again (no demand fetches), the window empties, and training stays exact."""
    batches = random_batches(7, 12, [ROWS, ROWS], batch=16, max_len=6, dim=DIM)
    store = cold_store(tmp_path / "s")
    init = [initial_weights(store, n) for n in ("a", "b")]
    ebc = TieredEmbeddingBagCollection(store, ["a", "b"], optimizer="rowwise_adagrad", lr=0.1)
    ref = TorchReference(init, "rowwise_adagrad", 0.1)

    def first_part():
        for i, b in enumerate(batches[:6]):
            if i == 3 and leave == "iterator_raises":
                raise OSError("reader failed")
            yield b

    with pytest.raises(OSError) if leave != "break" else contextlib.nullcontext():
        for i, (ids, offs, w) in enumerate(ebc.pipeline(first_part(), lookahead=3, sparse=lambda b: b[:2])):
            if i == 2 and leave == "step_raises":
                raise OSError("step failed")
            loss_of(ebc(ids, offs), w).backward()
            ref.step(ids, offs, w)
            if i == 1 and leave == "break":
                break
    assert ebc._queue == collections.deque()
    misses = ebc.counters["demand_misses"]
    caplog.clear()
    for ids, offs, w in ebc.pipeline(batches[6:], lookahead=3, sparse=lambda b: b[:2]):
        loss_of(ebc(ids, offs), w).backward()
        ref.step(ids, offs, w)
    assert "not prefetched" not in caplog.text and "skipped" not in caplog.text
    assert ebc.counters["demand_misses"] == misses
    assert ebc.stats()["working_set_rows"] == {"a": 0, "b": 0}
    ebc.flush()
    for n, want in zip(("a", "b"), ref.weights()):
        assert rel_err(store[n].read_with_state(np.arange(ROWS))[0], want) <= 1e-5
    store.close()


def test_a_failed_prefetch_raises_and_unpins_its_batch(tmp_path) -> None:
    import embstore

    batches = random_batches(8, 6, [ROWS, ROWS], batch=16, max_len=6, dim=DIM)
    store = cold_store(tmp_path / "s")
    ebc = TieredEmbeddingBagCollection(store, ["a", "b"], optimizer="rowwise_adagrad", lr=0.1)
    table = ebc.tables[0]
    inner, calls = table.read_with_state, []

    def failing(rows):
        calls.append(len(rows))
        if len(calls) == 3:
            raise embstore.InvalidInputError("simulated read failure")
        return inner(rows)
    table.read_with_state = failing
    with pytest.raises(embstore.InvalidInputError, match="simulated"):
        for ids, offs, w in ebc.pipeline(batches, lookahead=2, sparse=lambda b: b[:2]):
            loss_of(ebc(ids, offs), w).backward()
    for ids, offs, w in ebc.pipeline(batches, lookahead=2, sparse=lambda b: b[:2]):
        loss_of(ebc(ids, offs), w).backward()
    assert ebc._pending == {} and ebc.stats()["working_set_rows"] == {"a": 0, "b": 0}
    ebc.release()
    store.close()


@pytest.mark.parametrize("lookahead", [0, 2])
def test_announced_batches_change_what_the_store_caches_not_what_is_trained(tmp_path, lookahead) -> None:
    """pipeline(announce=4) tells each table what each fetch reads, 4 batches ahead of the fetch: the trained
    rows are bit for bit those of a run told nothing, the caches' hits differ, and every announcement is
    advanced past by the end; inside the loop each table holds the told batches as pending announcements."""
    batches = random_batches(3, 16, [ROWS, ROWS], batch=32, max_len=8, dim=DIM, zipf=1.2)
    stores, hits = [], []
    for announce in (0, 4):
        store = cold_store(tmp_path / f"s{announce}")
        ebc = TieredEmbeddingBagCollection(store, ["a", "b"], optimizer="rowwise_adagrad")
        for i, (ids, offs, w) in enumerate(ebc.pipeline(batches, lookahead=lookahead, sparse=lambda b: b[:2],
                                                        announce=announce)):
            # pending: the batch the latest fetch read and the announce after it (fewer at the end); with a
            # lookahead, fetches i .. i + lookahead may have run by now, on the prefetch thread
            n = len(batches)
            if announce and not lookahead:
                assert store["a"].announced == min(n - i, 1 + announce)
            elif announce:
                assert (min(n - i - lookahead, 1 + announce) if i else 0) <= store["a"].announced
                assert store["a"].announced <= min(n - i + 1, 1 + announce)
            loss_of(ebc(ids, offs), w).backward()
        ebc.flush()
        assert store["a"].announced == store["b"].announced == 0
        hits.append(sum(store[n].stats()["dram"]["hits"] for n in ("a", "b")))
        stores.append(store)
    rows = np.arange(ROWS, dtype=np.int64)
    for n in ("a", "b"):
        np.testing.assert_array_equal(stores[0][n].read_with_state(rows)[0], stores[1][n].read_with_state(rows)[0])
        np.testing.assert_array_equal(stores[0][n].read_with_state(rows)[1], stores[1][n].read_with_state(rows)[1])
    assert hits[0] != hits[1]
    for s in stores:
        s.close()


def test_a_pipeline_left_early_advances_past_what_it_announced(tmp_path) -> None:
    store = cold_store(tmp_path / "s", "sgd")
    ebc = TieredEmbeddingBagCollection(store, ["a", "b"], optimizer="sgd")
    batches = random_batches(4, 10, [ROWS, ROWS], batch=16, max_len=4, dim=DIM)
    for i, (ids, offs, w) in enumerate(ebc.pipeline(batches, lookahead=1, sparse=lambda b: b[:2], announce=3)):
        loss_of(ebc(ids, offs), w).backward()
        if i == 2:
            break
    assert store["a"].announced == store["b"].announced == 0
    with pytest.raises(InvalidInputError, match="announce must be an integer >= 0"):
        next(ebc.pipeline(batches, announce=-1))
    bad = [batches[0], ("not", "a batch", "pair")]
    with pytest.raises(InvalidInputError, match="sparse part"):
        for _ in ebc.pipeline(bad, announce=2):
            pass
    assert store["a"].announced == 0
    store.close()
