"""A state machine against plain torch: TieredEmbeddingBagCollection over a store whose DRAM cache holds a few rows,
driven through random interleavings of pipelined steps (look-ahead 0, 1, 3), hand-queued prefetches, evaluation
forwards, forwards whose graph is dropped, module and store flushes with reads straight from the store, checkpoints
(the store copied after a flush, as the trainer does) and resumes from them, resumes in place (with and without
closing and reopening the store), and one-shot I/O faults (a prefetch read, a write-back, a home tier's get, put
or flush failing with ``TierIOError`` / ``DiskFullError``).

The model is ``torch.nn.EmbeddingBag(mode="sum")`` per table with torch's optimizer (``SGD``, ``Adagrad``,
``SparseAdam``, which the module's ``adam_step="global"`` matches) or, for fbgemm's exact row-wise Adagrad, the
same two lines written in torch (checked against fbgemm by ``test_the_rowwise_reference_matches_fbgemm``).
Checked, as the README's "Training with tables larger than memory" states the contract:

- every step's pooled output equals the model's (relative to the output's largest value, see ``TOL``);
- after ``ebc.flush()`` (and ``store.flush()``) every row and its optimizer state read from the store equal the
  model's; before a module flush a store read (after ``store.flush()`` only) shows each row, with its state, as
  one whole version it had since the module's last flush: never older, never torn (a row from one step and its
  state from another, or a row half written);
- ``demand_misses`` does not move over a pipeline with look-ahead >= 1, nor for a forward of a queued batch; a
  forward of a batch not queued adds at most its distinct rows, exactly them when the working set was empty;
- ``steps`` counts the batches stepped; a checkpoint resumed reproduces the model's rows and continues exactly;
- an injected fault surfaces at most once, as the typed error, on the training thread (a forward, ``flush``,
  ``release``, or a store read or flush of the test's own); the step it hit is retried and training stays exact.
"""

from __future__ import annotations

import copy
import errno
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test
from torch import nn

import embstore
from embstore.errors import DiskFullError, TierIOError
from embstore.table import Table
from embstore.training import TieredEmbeddingBagCollection, state_dim
from embstore.training.testing import initial_weights, loss_of, make_store, rel_err

ROWS, DIM, NAMES = 48, 4, ("a", "b")
HOT = 6  # ids 0..5 come up often: repeated within a bag, a batch, and across consecutive batches
LR = {"sgd": 0.05, "adagrad": 0.1, "rowwise_adagrad": 0.1, "adam": 0.01}
BETAS, EPS = (0.9, 0.999), {"sgd": 0.0, "adagrad": 1e-10, "rowwise_adagrad": 1e-8, "adam": 1e-8}
# Relative tolerances (of a whole output or table against the model). Adagrad and Adam normalise each element's
# step by that element's own history, so a gradient summed in another order than torch sums it moves by a visible
# share of a step; tests/test_training_faults.py measured 1.5e-5 (adagrad) and 1.3e-4 (adam) with no fault at all.
# A lost or stale update is a whole step (lr 0.01-0.1 on rows of ~0.1), orders of magnitude above these.
TOL = {"sgd": 1e-5, "rowwise_adagrad": 1e-5, "adagrad": 1e-4, "adam": 1e-3}
HOMES = {"ssd": '{ kind = "ssd" }', "ssd-log": '{ kind = "ssd", layout = "log" }',
         "rocksdb": '{ kind = "rocksdb" }', "mmap": '{ kind = "mmap" }'}
FAULT_OPS = ("read_with_state", "write_with_state", "get", "put", "flush")  # table methods, then home tier methods


def compared_state(optimizer: str) -> int:
    """State columns the model has a value for: adam's per-row step count (its last column) is not compared."""
    return 2 * DIM if optimizer == "adam" else state_dim(optimizer, DIM)


def tiers(optimizer: str, cache_rows: int, home: str) -> str:
    row_bytes = 4 * (DIM + state_dim(optimizer, DIM))
    return f'[{{ kind = "dram", capacity = {cache_rows * row_bytes}, policy = "lru" }}, {HOMES[home]}]'


# --------------------------------------------------------------------------- batches
@dataclass(eq=False)
class Batch:
    """One training batch: per table, its bags of ids; ``seed`` draws the loss weights (bags, tables, dim)."""

    bags: tuple[tuple[tuple[int, ...], ...], ...]
    seed: int

    def __post_init__(self) -> None:
        self.ids = [torch.tensor([i for bag in t for i in bag], dtype=torch.int64) for t in self.bags]
        self.offsets = [torch.tensor(np.concatenate([[0], np.cumsum([len(b) for b in t])]), dtype=torch.int64)
                        for t in self.bags]
        nb = len(self.bags[0])
        rng = np.random.default_rng(self.seed)
        self.w = torch.from_numpy((0.5 * rng.standard_normal((nb, len(self.bags), DIM))).astype(np.float32))
        self.key = batch_key(self.ids, self.offsets)
        self.distinct = sum(len(set(i.tolist())) for i in self.ids)

    def sparse(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return self.ids, self.offsets

    def __repr__(self) -> str:  # what a failing sequence prints: pastes back as B(...)
        return f"B({[[list(b) for b in t] for t in self.bags]!r}, seed={self.seed})"


def B(bags: list[list[list[int]]], seed: int = 0) -> Batch:  # noqa: N802 - short, for printed sequences
    return Batch(tuple(tuple(tuple(b) for b in t) for t in bags), seed)


def batch_key(ids: Any, offsets: Any) -> tuple[bytes, ...]:
    """What ``forward`` matches a queued batch by: every table's ids and offsets."""
    return tuple(np.ascontiguousarray(np.asarray(a), np.int64).tobytes() for pair in zip(ids, offsets) for a in pair)


ids_st = st.one_of(st.integers(0, HOT - 1), st.integers(0, ROWS - 1))


@st.composite
def batches(draw: Callable[..., Any]) -> Batch:
    nb = draw(st.integers(1, 4))
    bags = tuple(tuple(tuple(draw(st.lists(ids_st, max_size=4))) for _ in range(nb)) for _ in NAMES)
    return Batch(bags, draw(st.integers(0, 2**16)))


# --------------------------------------------------------------------------- the model
class Reference:
    """Dense ``nn.EmbeddingBag(mode="sum", sparse=True)`` tables with torch's optimizer, fed the same steps."""

    def __init__(self, init: list[np.ndarray], optimizer: str) -> None:
        self.kind, self.lr, self.eps = optimizer, LR[optimizer], EPS[optimizer]
        self.bags = []
        for w in init:
            # offsets without the last entry: include_last_offset=True takes a path ~100x slower here (1-10 ms a
            # call on 2 threads), the same sums
            bag = nn.EmbeddingBag(w.shape[0], w.shape[1], mode="sum", sparse=True)
            with torch.no_grad():
                bag.weight.copy_(torch.from_numpy(w))
            self.bags.append(bag)
        params = [b.weight for b in self.bags]
        self.opt: Any = None
        self.rowwise: list[torch.Tensor] = []
        if optimizer == "sgd":
            self.opt = torch.optim.SGD(params, lr=self.lr)
        elif optimizer == "adagrad":
            self.opt = torch.optim.Adagrad(params, lr=self.lr, eps=self.eps)
        elif optimizer == "adam":
            self.opt = torch.optim.SparseAdam(params, lr=self.lr, betas=BETAS, eps=self.eps)
        else:  # fbgemm's EXACT_ROWWISE_ADAGRAD: one accumulator per row, of the mean squared gradient
            self.rowwise = [torch.zeros(w.shape[0]) for w in init]

    def forward(self, b: Batch) -> torch.Tensor:
        with torch.no_grad():
            return torch.stack([bag(i, o[:-1]) for bag, i, o in zip(self.bags, b.ids, b.offsets)], dim=1)

    def step(self, b: Batch) -> torch.Tensor:
        for bag in self.bags:
            bag.weight.grad = None
        out = torch.stack([bag(i, o[:-1]) for bag, i, o in zip(self.bags, b.ids, b.offsets)], dim=1)
        loss_of(out, b.w).backward()
        if self.opt is not None:
            self.opt.step()
        else:
            with torch.no_grad():
                for bag, acc in zip(self.bags, self.rowwise):
                    g = bag.weight.grad.coalesce()
                    rows, gv = g.indices()[0], g.values()
                    acc[rows] += gv.square().mean(dim=1)
                    bag.weight[rows] -= gv * (self.lr / (acc[rows].sqrt() + self.eps))[:, None]
        return out.detach()

    def state(self, t: int) -> np.ndarray:
        p = self.bags[t].weight
        if self.kind == "sgd":
            return np.zeros((p.shape[0], 0), np.float32)
        if self.kind == "rowwise_adagrad":
            return self.rowwise[t].numpy()[:, None].copy()
        st_ = self.opt.state.get(p, {})
        if self.kind == "adagrad":
            return st_["sum"].numpy().copy()
        if not st_:  # SparseAdam makes its state at the first step
            return np.zeros((p.shape[0], 2 * DIM), np.float32)
        return np.concatenate([st_["exp_avg"].numpy(), st_["exp_avg_sq"].numpy()], axis=1)

    def snapshot(self) -> list[tuple[np.ndarray, np.ndarray]]:
        return [(b.weight.detach().numpy().copy(), self.state(t)) for t, b in enumerate(self.bags)]


# --------------------------------------------------------------------------- faults
class Faults:
    """One-shot faults: the ``countdown``-th next call of ``op`` on table ``t`` (its own ``read_with_state`` /
    ``write_with_state``, or its home tier's ``get`` / ``put`` / ``flush``) raises instead of running."""

    def __init__(self) -> None:
        self.armed: tuple[str, int, int, int] | None = None  # (op, table, countdown, errno)
        self.fired = 0  # faults raised so far
        self.seen = 0  # TierIOErrors the test caught so far
        self.log: list[str] = []
        self._lock = threading.Lock()

    def install(self, tables: list[Table]) -> None:
        for t, table in enumerate(tables):
            if getattr(table, "_model_faults", False):
                continue
            table._model_faults = True
            for op in FAULT_OPS[:2]:
                setattr(table, op, self._wrap(op, t, getattr(table, op), table.hierarchy.home.kind))
            home = table.hierarchy.home
            for op in FAULT_OPS[2:]:
                setattr(home, op, self._wrap(op, t, getattr(home, op), home.kind))

    def _wrap(self, op: str, t: int, inner: Callable[..., Any], kind: str) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            with self._lock:
                a = self.armed
                fire = a is not None and a[:2] == (op, t) and a[2] == 0
                if a is not None and a[:2] == (op, t):
                    self.armed = None if fire else (op, t, a[2] - 1, a[3])
                if fire:
                    self.fired += 1
                    self.log.append(f"{op}[{t}] on {threading.current_thread().name}")
            if fire:
                err = a[3]
                raise (DiskFullError if err == errno.ENOSPC else TierIOError)(kind, f"injected {op}", err)
            return inner(*args)
        return call


# --------------------------------------------------------------------------- the machine
class TrainingModel(RuleBasedStateMachine):
    HOME = "ssd"

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="ebc-model-"))
        self.store: embstore.Store | None = None
        self.ebc: TieredEmbeddingBagCollection | None = None
        self.faults = Faults()
        self.generation = 0
        self.checkpoint: tuple[Path, dict, Reference, int] | None = None
        self.batches: dict[tuple[bytes, ...], Batch] = {}  # every batch queued so far, by key

    # --- set-up and helpers ----------------------------------------------------------
    @initialize(optimizer=st.sampled_from(sorted(LR)), cache_rows=st.integers(2, 6))
    def setup(self, optimizer: str, cache_rows: int) -> None:
        self.optimizer, self.tol = optimizer, TOL[optimizer]
        self.path = self.dir / "store0"
        self.store = make_store(self.path, [(n, ROWS, DIM) for n in NAMES], tiers(optimizer, cache_rows, self.HOME))
        self.ref = Reference([initial_weights(self.store, n) for n in NAMES], optimizer)
        self.steps = 0
        self._new_module()
        self._flushed()

    def _new_module(self, sd: dict | None = None) -> None:
        self.ebc = TieredEmbeddingBagCollection(self.store, list(NAMES), optimizer=self.optimizer,
                                                lr=LR[self.optimizer], eps=EPS[self.optimizer], betas=BETAS,
                                                adam_step="global")
        assert all(type(ws).__name__ == "WorkingSet" for ws in self.ebc.ws)  # a bounded working set, not in place
        if sd is not None:
            self.ebc.load_state_dict(sd)
        self.faults.install(self.ebc.tables)
        self.queue: list[tuple[tuple[bytes, ...], Any]] = []  # the module's queue as the model sees it: (key, tag)
        self.awaiting = False  # a forward whose backward never came (retired by the next forward)

    def _flushed(self) -> None:
        """The module's rows are all in the store now: the versions a store read may show start here."""
        self.history = [self.ref.snapshot()]

    def _caught(self, exc: TierIOError) -> None:
        """A TierIOError reached the test: it must be an injected one, raised once."""
        self.faults.seen += 1
        event(f"fault surfaced: {exc.operation}")
        assert self.faults.seen <= self.faults.fired, (
            f"{exc!r} was not injected, or an injected fault was raised twice (injected: {self.faults.log})")

    def _io(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call ``fn``; an injected fault it raises is caught and the call retried."""
        for _ in range(6):
            try:
                return fn(*args)
            except TierIOError as exc:
                self._caught(exc)
        raise AssertionError(f"{fn} kept failing")

    def _forward(self, fn: Callable[[], Any]) -> Any:
        """A forward (and step) ``fn``, retried after an injected fault with the model's queue taken from the
        module's (see :meth:`_resync_queue`)."""
        for _ in range(6):
            try:
                return fn()
            except TierIOError as exc:
                self._caught(exc)
                self._resync_queue()
        raise AssertionError("a forward kept failing")

    def _resync_queue(self) -> None:
        """After a fault the model cannot tell which queued batches a failing forward dropped (one whose own
        prefetch failed drops the batches before it; one failing on an earlier write-back drops none): take the
        module's queue as it is."""
        self.queue = [(batch_key(b.ids, b.offsets), "?") for b in self.ebc._queue]

    def _queue(self, b: Batch, tag: Any) -> None:
        self.queue.append((b.key, tag))
        self.batches.setdefault(b.key, b)

    def _take(self, key: tuple[bytes, ...]) -> bool:
        """Model of ``forward``'s queue lookup: the first queued batch equal to this one is taken, those before
        it dropped; none equal: fetched on demand, the queue left alone."""
        for i, (k, _) in enumerate(self.queue):
            if k == key:
                del self.queue[:i + 1]
                return True
        return False

    def _store_rows(self) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per table, as the store returns them: every row by ``Table.lookup``, then every row with its compared
        state by ``Table.read_with_state`` (one read: a write-back on the prefetch thread may come between the
        two, so only the second gives a row and its state from the same moment)."""
        out = []
        all_rows = np.arange(ROWS, dtype=np.int64)
        for name in NAMES:
            table = self.store[name]
            looked_up = self._io(table.lookup, all_rows)
            rows, state = self._io(Table.read_with_state, table, all_rows)  # the class's: no table-level fault
            out.append((looked_up, rows, state[:, :compared_state(self.optimizer)]))
        return out

    def _check_store_equals_model(self) -> None:
        for name, (looked_up, rows, state), (want, want_state) in zip(NAMES, self._store_rows(),
                                                                       self.ref.snapshot()):
            assert rel_err(looked_up, want) <= self.tol, (name, rel_err(looked_up, want))
            assert rel_err(rows, want) <= self.tol, (name, rel_err(rows, want))
            if want_state.size and np.abs(want_state).max() > 0:
                assert rel_err(state, want_state) <= self.tol, (name, "state", rel_err(state, want_state))
            else:
                assert not state.any(), (name, "state of rows never stepped")

    def _train(self, b: Batch, k: int | None = None) -> None:
        """Forward + backward of one batch, checked; raises the TierIOError of a forward that failed (no step)."""
        ws_before = self.ebc.stats()["working_set_rows"]
        misses = self.ebc.counters["demand_misses"]
        out = self.ebc(*b.sparse())  # may raise an injected fault: no step
        self.awaiting = False
        served = self._take(b.key)
        delta = self.ebc.counters["demand_misses"] - misses
        assert 0 <= delta <= b.distinct, (delta, b.distinct)
        if k:  # the pipeline queued this batch (at the latest) before yielding it
            assert served, "a pipelined batch was not in the model's queue"
        if served:
            event("forward: a queued batch")
            assert delta == 0, f"a queued batch was fetched on demand ({delta} rows)"
        elif not any(ws_before.values()):
            event("forward: on demand, empty working set")
            assert delta == b.distinct, (delta, b.distinct)
        want = self.ref.forward(b)
        assert rel_err(out.detach().numpy(), want.numpy()) <= self.tol, rel_err(out.detach().numpy(), want.numpy())
        loss_of(out, b.w).backward()
        self.ref.step(b)
        self.steps += 1
        assert self.ebc.steps == self.steps
        self.history.append(self.ref.snapshot())

    def _empty_window_check(self, fired_before: int) -> None:
        """Nothing queued and no batch awaiting its backward: every row has left the working set (unless a
        write-back failed meanwhile: its rows came back, to be written at the next eviction or flush)."""
        if self.queue or self.awaiting:
            return
        resident = self.ebc.stats()["working_set_rows"]
        if self.faults.fired == fired_before:
            assert not any(resident.values()), resident

    # --- rules -------------------------------------------------------------------------
    @rule(todo=st.lists(batches(), min_size=1, max_size=6), k=st.sampled_from([0, 1, 3]))
    def train_pipeline(self, todo: list[Batch], k: int) -> None:
        event("rule: train_pipeline")
        misses, fired = self.ebc.counters["demand_misses"], self.faults.fired
        for _ in range(len(todo) + 6):
            if not todo:
                break
            done, tag, pulled = 0, object(), 0
            it = self.ebc.pipeline(todo, lookahead=k, sparse=Batch.sparse)
            try:
                for i, b in enumerate(it):
                    assert b is todo[i]
                    while k and pulled < min(len(todo), i + k + 1):  # what the pipeline has prefetched by now
                        self._queue(todo[pulled], tag)
                        pulled += 1
                    self._train(b, k)
                    done += 1
            except TierIOError as exc:
                self._caught(exc)
                it.close()  # drops what it queued and never yielded
                self._resync_queue()
                todo = todo[done:]
                continue
            it.close()
            self.queue = [(key, t) for key, t in self.queue if t is not tag]  # equal batches taken before its own
            todo = []
        assert not todo, "a pipeline kept failing"
        if k:
            assert self.ebc.counters["demand_misses"] == misses, "look-ahead left demand misses"
        self._empty_window_check(fired)

    @rule(b=batches())
    def prefetch(self, b: Batch) -> None:
        """Queue a batch by hand (at most 6 queued: a window that never drains only grows)."""
        event("rule: prefetch")
        if len(self.queue) < 6:  # not a precondition: after a fault the queue's length depends on thread timing
            self.ebc.prefetch(*b.sparse())
            self._queue(b, "manual")

    @rule(pick=st.none() | st.integers(0, 5), fresh=batches(), prefetch_next=st.none() | batches())
    def manual_step(self, pick: int | None, fresh: Batch, prefetch_next: Batch | None) -> None:
        """``prefetch(next)`` (optional), then forward/backward of a queued batch (the head, or a later one:
        those before it are dropped) or of a fresh one (fetched on demand)."""
        event("rule: manual_step")
        fired = self.faults.fired
        queued = [self.batches[key] for key, _ in self.queue]
        b = queued[pick % len(queued)] if queued and pick is not None else fresh
        if prefetch_next is not None and len(self.queue) < 6:
            self.ebc.prefetch(*prefetch_next.sparse())
            self._queue(prefetch_next, "manual")
        self._forward(lambda: self._train(b))
        self._empty_window_check(fired)

    @rule(b=batches(), keep_graph=st.booleans())
    def forward_without_step(self, b: Batch, keep_graph: bool) -> None:
        """An evaluation forward (no grad), or a training forward whose graph is dropped: no row changes; the
        batch is retired without an update (the next forward retires a dropped one)."""
        event("rule: forward_without_step")
        with torch.set_grad_enabled(keep_graph):
            out = self._forward(lambda: self.ebc(*b.sparse()))
        self.awaiting = keep_graph
        self._take(b.key)
        assert rel_err(out.detach().numpy(), self.ref.forward(b).numpy()) <= self.tol
        del out
        assert self.ebc.steps == self.steps

    @rule(module_flush=st.booleans())
    def read_back(self, module_flush: bool) -> None:
        """``module_flush``: after ``ebc.flush()`` the store holds exactly the model's rows and state. Without it
        (``store.flush()`` only), each stored row with its state is one whole version it had since the module's
        last flush: a row may still sit in the working set or in a write-back in flight, but is never older
        than that flush, and never torn."""
        event(f"rule: read_back (module flush {module_flush})")
        if module_flush:
            self._io(self.ebc.flush)
        self._io(self.store.flush)
        if module_flush:
            self._flushed()
            self._check_store_equals_model()
            return
        scale = [(np.abs(w).max(), np.abs(s).max() if s.size else 0.0) for w, s in self.ref.snapshot()]
        for t, (looked_up, rows, state) in enumerate(self._store_rows()):
            vw = np.stack([h[t][0] for h in self.history])  # (versions, rows, dim)
            vs = np.stack([h[t][1] for h in self.history])
            seen = np.isclose(vw, looked_up[None], rtol=self.tol, atol=self.tol * scale[t][0]).all(axis=2)
            stale = np.flatnonzero(~seen.any(axis=0))
            assert not len(stale), (f"{self.optimizer}: table {NAMES[t]}: lookup of rows {stale.tolist()} gave no "
                                    "version since the last flush", looked_up[stale], vw[:, stale])
            ok = np.isclose(vw, rows[None], rtol=self.tol, atol=self.tol * scale[t][0]).all(axis=2)
            ok &= np.isclose(vs, state[None], rtol=self.tol, atol=self.tol * scale[t][1] + 1e-12).all(axis=2)
            bad = np.flatnonzero(~ok.any(axis=0))
            assert not len(bad), (f"{self.optimizer}: table {NAMES[t]}: rows {bad.tolist()} are no version since "
                                  "the last flush", rows[bad], state[bad], vw[:, bad], vs[:, bad])

    def _close(self) -> None:
        """Release the module and close the store; a fault raised meanwhile is retried."""
        self._io(self.ebc.release)
        self._io(self.store.flush)
        self.faults.armed = None  # closing flushes again: nothing left to fail there
        self.store.close()

    @rule(action=st.sampled_from(["save", "restore", "resume", "resume-reopened", "release"]))
    def stop_and_go(self, action: str) -> None:
        """``save``: the trainer's checkpoint (module flush, store flush, the module's state_dict, a copy of the
        store). ``restore``: crash and resume from it (the store from the copy, a new module from the state_dict;
        the model goes back there too) and train on exactly. ``resume``: stop (module flush, state_dict, release:
        queued batches get no update) and go on with a new module over the same store (``-reopened``: closed and
        opened again). ``release``: drop the window and go on with the same module."""
        if action == "restore" and self.checkpoint is None:
            action = "save"
        event(f"rule: stop_and_go {action}")
        if action == "save":
            self._io(self.ebc.flush)
            self._io(self.store.flush)
            self._flushed()
            dst = self.dir / "checkpoint"
            if dst.exists():
                shutil.rmtree(dst)
            shutil.copytree(self.path, dst)  # the trainer copies durably; no power cut here
            self.checkpoint = (dst, copy.deepcopy(self.ebc.state_dict()), copy.deepcopy(self.ref), self.steps)
        elif action == "restore":
            src, sd, ref, steps = self.checkpoint
            self._close()
            self.generation += 1
            self.path = self.dir / f"store{self.generation}"
            shutil.copytree(src, self.path)
            self.store = embstore.open(self.path)
            self.ref, self.steps = copy.deepcopy(ref), steps
            self._flushed()
            self._new_module(copy.deepcopy(sd))
            assert self.ebc.counters == sd["_extra_state"]["counters"]  # the checkpoint's, not this run's
            self._check_store_equals_model()
        elif action.startswith("resume"):
            self._io(self.ebc.flush)
            sd = copy.deepcopy(self.ebc.state_dict())
            if action == "resume-reopened":
                self._close()
                self.store = embstore.open(self.path)
            else:
                self._io(self.ebc.release)
            self._flushed()
            self._new_module(sd)
            if action == "resume-reopened":
                self._check_store_equals_model()
        else:
            self._io(self.ebc.release)
            self.queue, self.awaiting = [], False
            assert not any(self.ebc.stats()["working_set_rows"].values())
        assert self.ebc.steps == self.steps

    @rule(op=st.sampled_from(FAULT_OPS), t=st.integers(0, len(NAMES) - 1), countdown=st.integers(0, 3),
          err=st.sampled_from([errno.EIO, errno.ENOSPC]))
    def arm_fault(self, op: str, t: int, countdown: int, err: int) -> None:
        event("rule: arm_fault")
        with self.faults._lock:  # one at a time: a fault armed before and not fired yet is replaced
            self.faults.armed = (op, t, countdown, err)

    @invariant()
    def counts_agree(self) -> None:
        if self.ebc is not None:
            assert self.ebc.steps == self.steps
            assert self.faults.seen <= self.faults.fired

    @invariant()
    def queue_as_modelled(self) -> None:
        """The module's look-ahead queue holds what the model says (its documented matching and dropping)."""
        if self.ebc is not None:
            assert [k for k, _ in self.queue] == [batch_key(b.ids, b.offsets) for b in self.ebc._queue]

    def teardown(self) -> None:
        try:
            if self.ebc is not None:
                self.faults.armed = None
                try:
                    self.ebc.release()
                except Exception:
                    pass
            if self.store is not None:
                try:
                    self.store.close()
                except Exception:
                    pass
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


# --------------------------------------------------------------------------- the tests
def machine(home: str) -> type[TrainingModel]:
    return type(f"TrainingModel_{home.replace('-', '_')}", (TrainingModel,), {"HOME": home})


_HEALTH = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]
FAST = settings(max_examples=9, stateful_step_count=25, deadline=None, suppress_health_check=_HEALTH)
SLOW = settings(max_examples=100, stateful_step_count=40, deadline=None, suppress_health_check=_HEALTH)


@pytest.fixture
def one_torch_thread():
    """The model's tiny torch ops on one intra-op thread: on 2 threads each took ~100x longer here (a 5-id
    ``embedding_bag`` 0.2-4 ms instead of 20 us), which was most of this file's run time. Restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("home", ["ssd", "rocksdb"])
def test_training_matches_torch_through_random_interleavings(home) -> None:
    run_state_machine_as_test(machine(home), settings=FAST)


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("home", list(HOMES))
def test_training_matches_torch_through_random_interleavings_long(home) -> None:
    run_state_machine_as_test(machine(home), settings=SLOW)


def test_the_rowwise_reference_matches_fbgemm() -> None:
    """The model's row-wise Adagrad (torch, two lines) is fbgemm's EXACT_ROWWISE_ADAGRAD."""
    from embstore.training.testing import TorchReference

    rng = np.random.default_rng(5)
    init = [rng.uniform(-0.1, 0.1, (ROWS, DIM)).astype(np.float32) for _ in NAMES]
    ours, fbgemm = Reference(init, "rowwise_adagrad"), TorchReference(init, "rowwise_adagrad", LR["rowwise_adagrad"])
    for seed in range(12):
        r = np.random.default_rng(seed)
        b = B([[list(r.integers(0, HOT if j % 2 else ROWS, r.integers(0, 5))) for j in range(3)] for _ in NAMES], seed)
        assert rel_err(ours.step(b).numpy(), fbgemm.step(b.ids, b.offsets, b.w).numpy()) <= 1e-6
    for (w, _), want in zip(ours.snapshot(), fbgemm.weights()):
        assert rel_err(w, want) <= 1e-6
