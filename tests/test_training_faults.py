"""Training over a failing or tight store: typed errors, no lost or stale update, and a retry after the fault
clears trains exactly like plain torch fed the steps that succeeded."""

from __future__ import annotations

import errno
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from faultfs import needs_mount
from hypothesis import example, given, settings, strategies as st

import embstore
from embstore.errors import DiskFullError, TierIOError
from embstore.training import TieredEmbeddingBagCollection, state_dim
from embstore.training.testing import TorchReference, initial_weights, loss_of, make_store, random_batches, rel_err

DIM = 4
HOMES = {"ssd": '{ kind = "ssd" }', "ssd-log": '{ kind = "ssd", layout = "log" }', "rocksdb": '{ kind = "rocksdb" }'}
LR = {"sgd": 0.1, "adagrad": 0.1, "rowwise_adagrad": 0.1, "adam": 0.01}
# Relative tolerance of trained rows against torch. Adam normalises each element's step by that element's own
# gradient history, so a gradient that nearly cancels (its bags summed in another order than torch sums them)
# can move by a visible share of one step: seed 406 of the test below, with no fault at all, is 1.3e-4 off on
# one element, on the resident and the cached path alike. A lost or stale update is a whole step (lr 0.01 on
# rows of ~0.1: ~1e-1), so 1e-3 still catches every fault these tests look for. Element-wise Adagrad divides
# by each element's own accumulated square too: seed 4512 (adagrad, lookahead 1, ratio 10), again without a
# fault, is 1.5e-5 off on every home; 1e-4 is still three orders below a lost step.
TOL = {"sgd": 1e-5, "adagrad": 1e-4, "rowwise_adagrad": 1e-5, "adam": 1e-3}


def tiers(optimizer: str, cache_rows: int, home: str = "ssd") -> str:
    """An LRU DRAM cache of ``cache_rows`` rows (with their optimizer state) over ``home``; 0: a DRAM slab of the
    whole table (trained in place) over ``home``."""
    if cache_rows == 0:
        return f'[{{ kind = "dram", capacity = "1MiB" }}, {HOMES[home]}]'
    row_bytes = 4 * (DIM + state_dim(optimizer, DIM))
    return f'[{{ kind = "dram", capacity = {cache_rows * row_bytes}, policy = "lru" }}, {HOMES[home]}]'


class HomeFaults:
    """Make the home tier under a module's table fail with the store's own typed errors.

    ``fail_calls``: indices (counting every get, put and flush of this home) that fail; ``broken``: fail all.
    """

    def __init__(self, table, fail_calls=(), err: int = errno.EIO) -> None:
        self.home = table.hierarchy.home
        self.fail_calls, self.err, self.broken = set(fail_calls), err, False
        self.calls, self.failed = 0, 0
        self.failing = threading.Event()  # set once a call has failed
        self._lock = threading.Lock()
        for op in ("get", "put", "flush"):
            setattr(self.home, op, self._wrap(op, getattr(self.home, op)))

    def _wrap(self, op, inner):
        def call(*args):
            with self._lock:
                n, self.calls = self.calls, self.calls + 1
                fail = self.broken or n in self.fail_calls
                self.failed += fail
            if fail:
                self.failing.set()
                cls = DiskFullError if self.err == errno.ENOSPC else TierIOError
                raise cls(self.home.kind, op, self.err)
            return inner(*args)
        return call


def stored(store: embstore.Store, name: str) -> np.ndarray:
    t = store[name]
    return t.read_with_state(np.arange(t.num_rows, dtype=np.int64))[0]


def fill_window(ebc, batches, i: int, lookahead: int, queued: int) -> int:
    """Prefetch until batches i+1 .. i+lookahead are queued (``batches[:queued]`` already were); returns the new
    ``queued``."""
    while lookahead and queued < min(len(batches), i + 1 + lookahead):
        ebc.prefetch(*batches[queued][:2])
        queued += 1
    return queued


def train_with_retries(ebc, ref, batches, lookahead: int, max_errors: int = 200) -> int:
    """Forward/backward each batch with ``lookahead`` batches prefetched; a forward that raises a TierIOError is
    retried (its batch had no step). Returns how many errors were seen. ``ref`` steps each batch once."""
    errors, i = 0, 0
    queued = 0  # batches[:queued] were handed to prefetch
    while i < len(batches):
        queued = fill_window(ebc, batches, i, lookahead, queued)
        ids, offs, w = batches[i]
        try:
            out = ebc(ids, offs)
        except TierIOError:
            errors += 1
            assert errors <= max_errors
            continue
        loss_of(out, w).backward()
        assert rel_err(out.detach().numpy(), ref.step(ids, offs, w).numpy()) <= TOL[ref.kind]
        i += 1
    return errors


def flush_with_retries(ebc) -> int:
    for attempt in range(20):
        try:
            ebc.flush()
            return attempt
        except TierIOError:
            pass
    raise AssertionError("flush kept failing")


@pytest.mark.parametrize("cache_rows", [10, 0], ids=["working-set", "resident"])
def test_a_failed_prefetch_leaves_no_unloaded_row_to_the_next_batch(tmp_path, cache_rows) -> None:
    """Batch 1's prefetch fails while batch 2, which shares row 5 with it, is being reserved: batch 2 must read
    row 5 itself, not train on a slot that was never filled (it read zeros, then wrote them back)."""
    store = make_store(tmp_path / "s", [("a", 200, DIM)], tiers("sgd", cache_rows))
    init = initial_weights(store, "a")
    ebc = TieredEmbeddingBagCollection(store, ["a"], optimizer="sgd", lr=0.5)
    home = ebc.tables[0].hierarchy.home
    inner, entered, go = home.get, threading.Event(), threading.Event()

    def get(ids):
        if not go.is_set():  # the first read: wait until batch 2 is reserved, then fail
            entered.set()
            assert go.wait(10)
            raise TierIOError("ssd", "read", errno.EIO)
        return inner(ids)
    home.get = get
    b1 = ([torch.tensor([5, 6])], [torch.tensor([0, 2])])
    b2 = ([torch.tensor([5, 7])], [torch.tensor([0, 2])])
    ebc.prefetch(*b1)
    assert entered.wait(10)
    ebc.prefetch(*b2)
    go.set()
    with pytest.raises(TierIOError):
        ebc(*b1)
    out = ebc(*b2)
    np.testing.assert_allclose(out[0, 0].detach().numpy(), init[[5, 7]].sum(0), rtol=1e-6)
    out.sum().backward()
    ebc.flush()
    want = init.copy()
    want[[5, 7]] -= 0.5
    np.testing.assert_allclose(stored(store, "a"), want, rtol=1e-6)
    ebc.release()
    store.close()


@pytest.mark.parametrize("lookahead", [1, 0], ids=["write-behind", "synchronous"])
def test_a_failed_write_back_loses_no_update(tmp_path, lookahead) -> None:
    """A write-back of evicted rows that fails (on the prefetch thread, or in the step itself without
    look-ahead) is raised by the next forward, not by the backward whose step succeeded; the rows it carried
    stay with the module (written again later) and no prefetch reads their stale store copies."""
    rows = 400
    store = make_store(tmp_path / "s", [("a", rows, DIM)], tiers("adagrad", 10))
    ebc = TieredEmbeddingBagCollection(store, ["a"], optimizer="adagrad", lr=0.1)
    ref = TorchReference([initial_weights(store, "a")], "adagrad", 0.1)
    table, failures = ebc.tables[0], []
    inner = table.write_with_state

    def write(keys, values, state):
        if ebc.steps >= 8 and len(failures) < 2:  # the next two write-backs fail (nothing written)
            failures.append(len(keys))
            raise DiskFullError("ssd", "write", errno.ENOSPC)
        return inner(keys, values, state)
    table.write_with_state = write
    batches = random_batches(3, 24, [rows], batch=8, max_len=4, dim=DIM)
    assert train_with_retries(ebc, ref, batches, lookahead) == 2 and len(failures) == 2
    ebc.flush()
    assert rel_err(stored(store, "a"), ref.weights()[0]) <= 1e-5
    ebc.release()
    store.close()


def test_flush_release_and_other_batches_work_after_a_failed_prefetch(tmp_path) -> None:
    """A prefetch that failed is raised by the forward of its own batch only: once the fault has cleared,
    flush, release and a forward of another batch go through (they kept raising the stale read error)."""
    store = make_store(tmp_path / "s", [("a", 200, DIM)], tiers("sgd", 10))
    init = initial_weights(store, "a")
    ebc = TieredEmbeddingBagCollection(store, ["a"], optimizer="sgd", lr=0.5)
    faults = HomeFaults(ebc.tables[0])
    faults.broken = True
    b1 = ([torch.tensor([5, 6])], [torch.tensor([0, 2])])
    b2 = ([torch.tensor([5, 8])], [torch.tensor([0, 2])])
    ebc.prefetch(*b1)
    assert faults.failing.wait(10)
    faults.broken = False  # flush waits for the prefetch, which has failed (or fails now)
    ebc.flush()
    ebc(*b2).sum().backward()  # shares row 5 with the failed batch: read on demand
    ebc.flush()
    want = init.copy()
    want[[5, 8]] -= 0.5
    np.testing.assert_allclose(stored(store, "a"), want, rtol=1e-6)
    ebc.release()
    assert ebc._pending == {} and ebc.stats()["working_set_rows"] == {"a": 0}
    store.close()


def _reopen_rows(path: Path, name: str) -> np.ndarray:
    with embstore.open(path) as store:
        return stored(store, name)


@pytest.mark.parametrize("home", list(HOMES))
@settings(max_examples=25)
@given(seed=st.integers(0, 2**16), optimizer=st.sampled_from(list(LR)), lookahead=st.integers(1, 4),
       ratio=st.integers(10, 50))
@example(seed=4512, optimizer="adagrad", lookahead=1, ratio=10)  # rounding-order noise 1.5e-5 (see TOL)
def test_tight_cache_training_matches_torch(home, seed, optimizer, lookahead, ratio) -> None:
    """The table 10-50x its DRAM cache, a cache about one batch's distinct rows, hot ids repeated across
    consecutive batches, k batches of look-ahead: every output and, after flush and reopen, every row equals
    plain torch."""
    rows = 400
    batches = random_batches(seed, 12, [rows, rows], batch=8, max_len=4, dim=DIM, zipf=1.3)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "s"
        store = make_store(path, [("a", rows, DIM), ("b", rows, DIM)], tiers(optimizer, rows // ratio, home))
        ref = TorchReference([initial_weights(store, n) for n in ("a", "b")], optimizer, LR[optimizer])
        ebc = TieredEmbeddingBagCollection(store, ["a", "b"], optimizer=optimizer, lr=LR[optimizer])
        for ids, offs, w in ebc.pipeline(batches, lookahead=lookahead, sparse=lambda b: b[:2]):
            out = ebc(ids, offs)
            loss_of(out, w).backward()
            assert rel_err(out.detach().numpy(), ref.step(ids, offs, w).numpy()) <= TOL[ref.kind]
        assert ebc.counters["demand_misses"] == 0
        ebc.flush()
        ebc.release()
        store.close()
        for name, want in zip(("a", "b"), ref.weights()):
            assert rel_err(_reopen_rows(path, name), want) <= TOL[optimizer]


@pytest.mark.parametrize("home", list(HOMES))
@settings(max_examples=25)
@given(seed=st.integers(0, 2**16), optimizer=st.sampled_from(list(LR)), lookahead=st.integers(0, 4),
       ratio=st.just(0) | st.integers(10, 50), fail_calls=st.frozensets(st.integers(0, 30), max_size=8),
       err=st.sampled_from([errno.EIO, errno.ENOSPC]))
def test_faulty_home_training_matches_torch_after_retries(home, seed, optimizer, lookahead, ratio, fail_calls,
                                                          err) -> None:
    """The home fails chosen reads, writes and flushes (demand fetches, prefetches, write-backs, flush): each
    failure is a typed error on the training thread, the step it hit is retried, and the rows end up exactly as
    plain torch trained on every batch once; the flushed store reopens with them. ``ratio`` 0: the table is
    held whole in DRAM and trained in place (its write-backs are the flushes)."""
    rows, names = 400, ("a", "b")
    batches = random_batches(seed, 12, [rows, rows], batch=8, max_len=4, dim=DIM, zipf=1.3)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "s"
        store = make_store(path, [(n, rows, DIM) for n in names], tiers(optimizer, ratio and rows // ratio, home))
        ref = TorchReference([initial_weights(store, n) for n in names], optimizer, LR[optimizer])
        ebc = TieredEmbeddingBagCollection(store, list(names), optimizer=optimizer, lr=LR[optimizer])
        faults = [HomeFaults(t, fail_calls, err) for t in ebc.tables]
        train_with_retries(ebc, ref, batches, lookahead)
        flush_with_retries(ebc)
        for f in faults:
            f.fail_calls.clear()
        for name, want in zip(names, ref.weights()):
            assert rel_err(stored(store, name), want) <= TOL[optimizer]
        ebc.release()
        store.close()
        for name, want in zip(names, ref.weights()):
            assert rel_err(_reopen_rows(path, name), want) <= TOL[optimizer]


@needs_mount
@pytest.mark.parametrize("home,after,lookahead", [("ssd", "resume", 0), ("ssd", "resume", 2), ("ssd-log", "resume", 3),
                                                  ("ssd", "reopen", 2), ("ssd-log", "reopen", 0),
                                                  ("rocksdb", "reopen", 2)])
def test_a_real_full_disk_mid_training(tiny_tmpfs, home, after, lookahead) -> None:
    """A real ENOSPC under training (in a write-back, a prefetch or a flush): a typed DiskFullError on the
    training thread. ``resume``: once space is back, retried steps and flushes give exactly torch's rows, and
    the store reopens with them. ``reopen``: closed while full, the store reopens with every row as of the last
    successful flush or a later step of it, never a torn row or a lost flushed update. (A rocksdb home stays
    failed after ENOSPC until the store is reopened, so it has no ``resume`` case.)"""
    rows, dim = 40_000, 32
    store_path = tiny_tmpfs.path / "s"
    store = make_store(store_path, [("a", rows, dim)],
                       f'[{{ kind = "dram", capacity = {256 * dim * 4}, policy = "lru" }}, {HOMES[home]}]')
    ref = TorchReference([initial_weights(store, "a")], "sgd", 0.1)
    ebc = TieredEmbeddingBagCollection(store, ["a"], optimizer="sgd", lr=0.1)
    rng = np.random.default_rng(0)
    batches = [([torch.from_numpy(rng.integers(0, rows, 256))], [torch.arange(0, 257, 4)], torch.ones(64, 1, dim))
               for _ in range(400)]
    flushed = ref.weights()[0]
    later: dict[int, list[np.ndarray]] = {}  # row -> its versions since the last successful flush
    errors: list[TierIOError] = []
    i = queued = 0
    while i < len(batches) and not (errors and (after == "reopen" or i >= errors_at + 8)):
        queued = fill_window(ebc, batches, i, lookahead, queued)
        ids, offs, w = batches[i]
        try:
            out = ebc(ids, offs)
            loss_of(out, w).backward()
            ref.step(ids, offs, w)
            weights = ref.weights()[0]
            for r in np.unique(ids[0].numpy()).tolist():
                later.setdefault(r, []).append(weights[r])
            i += 1
            if i % 4 == 0:
                ebc.flush()
                flushed, later = ref.weights()[0], {}
        except TierIOError as exc:
            assert isinstance(exc, DiskFullError), exc
            errors.append(exc)
            errors_at = i
            assert len(errors) < 20, "the same fault keeps coming back after the disk got space again"
            if after == "resume":
                tiny_tmpfs.resize(256 << 20)
    assert errors and errors[0].tier == ("rocksdb" if home == "rocksdb" else "ssd")
    if after == "resume":
        flush_with_retries(ebc)
        np.testing.assert_allclose(stored(store, "a"), ref.weights()[0], rtol=1e-5, atol=1e-6)
    for close in (ebc.release, store.close):
        try:
            close()
        except TierIOError:
            assert after == "reopen"  # closing flushes again, into the same full disk
    tiny_tmpfs.resize(256 << 20)
    got = _reopen_rows(store_path, "a")
    if after == "resume":
        np.testing.assert_allclose(got, ref.weights()[0], rtol=1e-5, atol=1e-6)
        return
    same = np.isclose(got, flushed, rtol=1e-5, atol=1e-6).all(axis=1)
    for r in np.flatnonzero(~same).tolist():
        assert r in later and any(np.allclose(got[r], v, rtol=1e-5, atol=1e-6) for v in later[r]), r
