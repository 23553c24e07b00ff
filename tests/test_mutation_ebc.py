"""TieredEmbeddingBagCollection behaviour no other training test pinned (session 12 mutation audit of
``training/ebc.py``, ``working_set.py``, ``_index.py`` and ``_kernels.py``).

Each test kills mutants that survived the training suites: the accelerator path (``_FusedBag``, the torch
optimizer step, the gather) run on CPU tensors, a prefetched batch matched on its offsets as well as its ids,
the look-ahead bound of ``pipeline``, eval mode and ``no_grad`` forwards (no step, no step count), QR tables
with mean pooling, and the ``late_rows`` counter. References are plain torch (``nn.EmbeddingBag`` with torch's
optimizers) fed the same batches.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import embstore.training.ebc as ebc_module
from embstore.training import TieredEmbeddingBagCollection, state_dim
from embstore.training.testing import (TorchReference, initial_weights, loss_of, make_store, random_batches,
                                       rel_err)
from embstore.training.working_set import WorkingSet

ROWS, DIM = 300, 4
RESIDENT = '[{ kind = "dram", capacity = "1MiB" }, { kind = "mmap" }]'


def cached_tiers(optimizer: str, rows: int = ROWS // 10) -> str:
    """An LRU DRAM cache of ``rows`` rows (with their state) over an ssd home: a bounded working set."""
    row_bytes = 4 * (DIM + state_dim(optimizer, DIM))
    return f'[{{ kind = "dram", capacity = {rows * row_bytes}, policy = "lru" }}, {{ kind = "ssd" }}]'


def stored(store, name: str) -> np.ndarray:
    t = store[name]
    return t.read_with_state(np.arange(t.num_rows, dtype=np.int64))[0]


class _AcceleratorOnCpu(str):
    """A device that torch reads as "cpu" (``tensor.to(dev)``) but whose ``type`` is not "cpu": the module then
    takes its accelerator path (``_FusedBag``, ``apply_update`` on gathered copies) on CPU tensors."""

    type = "accelerator"


@pytest.mark.parametrize("optimizer,lr,adam_step,pooling", [("sgd", 0.1, "row", "sum"), ("adagrad", 0.1, "row", "mean"),
                                                            ("rowwise_adagrad", 0.1, "row", "sum"),
                                                            ("adam", 0.01, "row", "mean"),
                                                            ("adam", 0.01, "global", "sum")])
def test_the_accelerator_path_trains_like_torch(tmp_path, optimizer, lr, adam_step, pooling) -> None:
    """The path tables on a GPU take, never run on a CPU-only machine otherwise: outputs, the rows after
    flush, and eval forwards in between (``_pool`` without a step) equal torch's, look-ahead included."""
    store = make_store(tmp_path / "s", [("a", ROWS, DIM), ("b", ROWS, DIM)], cached_tiers(optimizer))
    ref = TorchReference([initial_weights(store, n) for n in ("a", "b")], optimizer, lr, pooling=pooling,
                         adam_step=adam_step)
    ebc = TieredEmbeddingBagCollection(store, ["a", "b"], optimizer=optimizer, lr=lr, pooling=pooling,
                                       adam_step=adam_step)
    for ws in ebc.ws:
        assert isinstance(ws, WorkingSet)
        ws.device = _AcceleratorOnCpu("cpu")
    batches = random_batches(21, 8, [ROWS, ROWS], batch=8, max_len=5, dim=DIM, zipf=1.3)  # empty bags, repeats
    for i, (ids, offs, w) in enumerate(ebc.pipeline(batches, lookahead=2, sparse=lambda b: b[:2])):
        if i % 3 == 2:  # an eval forward of the same batch first: no step
            with torch.no_grad():
                before = ebc(ids, offs)
        out = ebc(ids, offs)
        if i % 3 == 2:
            assert torch.equal(before, out.detach())
        loss_of(out, w).backward()
        assert rel_err(out.detach().numpy(), ref.step(ids, offs, w).numpy()) <= 1e-5
    ebc.flush()
    tol = 1e-4 if optimizer in ("adam", "adagrad") else 1e-5  # per-element normalised steps (test_training_faults)
    for name, want in zip(("a", "b"), ref.weights()):
        assert rel_err(stored(store, name), want) <= tol
    assert ebc.steps == len(batches)
    store.close()


def test_a_prefetched_batch_with_other_offsets_is_not_taken(tmp_path) -> None:
    """The same ids in other bags are another batch: forward must pool its own offsets, not the queued ones."""
    store = make_store(tmp_path / "s", [("a", ROWS, DIM)], cached_tiers("sgd"))
    ref = TorchReference([initial_weights(store, "a")], "sgd", 0.1)
    ebc = TieredEmbeddingBagCollection(store, ["a"], optimizer="sgd", lr=0.1)
    ids = [torch.tensor([3, 4, 5, 3])]
    queued, given = [torch.tensor([0, 1, 4])], [torch.tensor([0, 3, 4])]
    ebc.prefetch(ids, queued)
    w = torch.ones(2, 1, DIM)
    out = ebc(ids, given)
    loss_of(out, w).backward()
    assert rel_err(out.detach().numpy(), ref.step(ids, given, w).numpy()) <= 1e-6
    ebc.flush()
    assert rel_err(stored(store, "a"), ref.weights()[0]) <= 1e-6
    ebc.release()
    store.close()


def test_counters_count_rows_read_from_the_store_once_per_stay(tmp_path) -> None:
    """``prefetched_rows`` and ``demand_misses`` count the rows a batch brought in from the store, not its
    distinct rows: a row still in the working set for an earlier batch of the window is not fetched again."""
    store = make_store(tmp_path / "s", [("a", ROWS, DIM)], cached_tiers("sgd"))
    ebc = TieredEmbeddingBagCollection(store, ["a"], optimizer="sgd", lr=0.1)
    one = lambda *rows: ([torch.tensor(rows)], [torch.tensor([0, len(rows)])])  # noqa: E731
    ebc.prefetch(*one(1, 2))
    ebc.prefetch(*one(2, 3))  # row 2 is already in the window
    for batch in (one(1, 2), one(2, 3)):
        ebc(*batch).sum().backward()
    assert ebc.counters["prefetched_rows"] == 3 and ebc.counters["demand_misses"] == 0
    ebc.prefetch(*one(3, 4))
    ebc(*one(5, 3)).sum().backward()  # not the queued batch: fetched on demand, row 3 pinned by the queued one
    assert ebc.counters["demand_misses"] == 1  # row 5 (row 3 stayed in the working set for the queued batch)
    ebc.release()
    store.close()


@pytest.mark.parametrize("lookahead", [1, 3])
def test_pipeline_keeps_exactly_lookahead_batches_ahead(tmp_path, lookahead) -> None:
    """While batch i is trained, batches i+1 .. i+k are already in the window (prefetched), and no more."""
    batches = random_batches(4, 7, [ROWS], batch=4, max_len=3, dim=DIM)
    store = make_store(tmp_path / "s", [("a", ROWS, DIM)], cached_tiers("sgd"))
    ebc = TieredEmbeddingBagCollection(store, ["a"], optimizer="sgd", lr=0.1)
    for i, (ids, offs, w) in enumerate(ebc.pipeline(batches, lookahead=lookahead, sparse=lambda b: b[:2])):
        assert len(ebc._queue) == min(lookahead + 1, len(batches) - i)  # this batch and the k after it
        loss_of(ebc(ids, offs), w).backward()
    assert ebc.counters["demand_misses"] == 0
    store.close()


@pytest.mark.parametrize("tiers", ["resident", "cached"])
def test_eval_mode_and_no_grad_forwards_neither_step_nor_count(tmp_path, tiers) -> None:
    """``ebc.eval()`` gives outputs without a gradient (a loss over other parameters cannot step the rows), and
    forwards without a step do not advance ``steps``: global-step Adam after them still equals SparseAdam."""
    store = make_store(tmp_path / "s", [("a", ROWS, DIM)], RESIDENT if tiers == "resident" else cached_tiers("adam"))
    ref = TorchReference([initial_weights(store, "a")], "adam", 0.01, adam_step="global")
    ebc = TieredEmbeddingBagCollection(store, ["a"], optimizer="adam", lr=0.01, adam_step="global")
    for i, (ids, offs, w) in enumerate(random_batches(9, 6, [ROWS], batch=6, max_len=4, dim=DIM)):
        ebc.eval()
        assert not ebc(ids, offs).requires_grad
        ebc.train()
        with torch.no_grad():
            ebc(ids, offs)
        out = ebc(ids, offs)
        loss_of(out, w).backward()
        assert rel_err(out.detach().numpy(), ref.step(ids, offs, w).numpy()) <= 1e-5
        assert ebc.steps == i + 1
    ebc.flush()
    assert rel_err(stored(store, "a"), ref.weights()[0]) <= 1e-5
    store.close()


def test_qr_hashed_table_with_mean_pooling_trains_like_torch(tmp_path) -> None:
    """QR tables pool combined rows through ``_pool``: mean pooling must divide by the bag length there too."""
    store = make_store(tmp_path / "s", [("q", 1000, DIM)], RESIDENT, extra='hash = { kind = "qr", collisions = 8 }\n')
    t = store["q"]
    w0 = torch.from_numpy(initial_weights(store, "q")).requires_grad_()
    opt = torch.optim.SGD([w0], lr=0.5)
    ebc = TieredEmbeddingBagCollection(store, ["q"], optimizer="sgd", lr=0.5, pooling="mean")
    for ids, offs, w in random_batches(5, 4, [10_000], batch=6, max_len=5, dim=DIM):
        out = ebc(ids, offs)
        loss_of(out, w).backward()
        rows = torch.from_numpy(t.mapper(ids[0].numpy()))
        emb = w0[rows[:, 0]] * w0[rows[:, 1]]
        expect = torch.nn.functional.embedding_bag(torch.arange(len(ids[0])), emb, offs[0], mode="mean",
                                                   include_last_offset=True)
        opt.zero_grad()
        loss_of(expect[:, None], w).backward()
        opt.step()
        assert rel_err(out[:, 0].detach().numpy(), expect.detach().numpy()) <= 1e-5
    ebc.flush()
    assert rel_err(stored(store, "q"), w0.detach().numpy()) <= 1e-5
    store.close()


def test_a_forward_that_waits_for_its_prefetch_counts_late_rows(tmp_path, monkeypatch) -> None:
    """``late_rows``: rows of a prefetched batch whose fetch was still running when its forward came."""
    store = make_store(tmp_path / "s", [("a", ROWS, DIM)], cached_tiers("sgd"))
    ebc = TieredEmbeddingBagCollection(store, ["a"], optimizer="sgd", lr=0.1)
    table = ebc.tables[0]
    inner, waiting = table.read_with_state, __import__("threading").Event()

    def slow_read(rows):
        assert waiting.wait(30)  # held until the forward is seen waiting for it
        return inner(rows)
    table.read_with_state = slow_read

    class Clock:  # the forward reads the clock only once it found the fetch unfinished: let the fetch go then
        @staticmethod
        def perf_counter() -> float:
            waiting.set()
            return time.perf_counter()
    monkeypatch.setattr(ebc_module, "time", Clock)
    ids, offs = [torch.tensor([1, 2, 2, 9])], [torch.tensor([0, 2, 4])]
    ebc.prefetch(ids, offs)
    ebc(ids, offs).sum().backward()
    assert ebc.counters["late_rows"] == ebc.counters["prefetched_rows"] == 3
    assert ebc.counters["demand_misses"] == 0
    ebc.release()
    store.close()
