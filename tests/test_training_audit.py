"""Audit of TieredEmbeddingBagCollection's corners against a plain torch reference.

The reference is ``nn.EmbeddingBag(mode=..., sparse=True)`` per table; its sparse gradient (duplicates summed
by ``coalesce``) is stepped with ``torch.optim.SGD`` / ``Adagrad`` / ``SparseAdam`` where those implement the
documented rule, else with the rule written out in torch (rowwise Adagrad, Adam with per-row step counts, and
any optimizer with weight decay: L2 added to the gradient of the batch's rows only). Corners: empty bags under
"mean", batches whose every bag is empty, keyed batches with keys out of order, extra keys or a table with zero
lengths, ids repeated within and across bags, exactly-zero gradients, consecutive steps on overlapping rows,
hyper-parameters (weight decay, eps, betas), float16 / int8 tables beside float32 ones, a flush and reopen in
the middle of training, non-contiguous ids, and bad inputs (which must raise typed errors and change nothing).
"""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

import embstore
from embstore.training import KeyedJaggedBatch, TieredEmbeddingBagCollection
from embstore.training.testing import initial_weights, loss_of
from embstore.training.working_set import WorkingSet

ROWS, DIM = 24, 4
TIERS = {
    "resident": '[{ kind = "dram", capacity = "1MiB" }, { kind = "mmap" }]',  # trained in the DRAM slab
    "device-cpu": '[{ kind = "device", capacity = "1MiB" }, { kind = "mmap" }]',  # a device tier on the host
    "oversized": '[{ kind = "dram", capacity = 240, policy = "lru" }, { kind = "ssd" }]',  # a few rows cached
}
OPTS = [("sgd", "row"), ("rowwise_adagrad", "row"), ("adagrad", "row"), ("adam", "row"), ("adam", "global")]
SETTINGS = dict(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])


def make_store(path, tables, tiers: str) -> embstore.Store:
    """tables: (name, dtype) pairs, ROWS x DIM each."""
    text = "".join(f'[[table]]\nname = "{n}"\nnum_embeddings = {ROWS}\ndim = {DIM}\ndtype = "{dt}"\n'
                   f'init = {{ kind = "uniform", scale = 0.1, seed = {i} }}\ntiers = {tiers}\n'
                   for i, (n, dt) in enumerate(tables))
    return embstore.create(path, embstore.StoreConfig.from_toml(text))


def read_all(store, name):
    t = store[name]
    return t.read_with_state(np.arange(t.num_rows, dtype=np.int64))


class Reference:
    """Dense torch tables stepped by the documented rule (torch's own optimizer where it is that rule)."""

    def __init__(self, weights, opt, adam_step, lr, eps, betas, wd, pooling):
        self.opt, self.adam_step, self.lr, self.eps, self.betas, self.wd = opt, adam_step, lr, eps, betas, wd
        self.bags = []
        for w in weights:
            bag = nn.EmbeddingBag(w.shape[0], w.shape[1], mode=pooling, sparse=True, include_last_offset=True)
            with torch.no_grad():
                bag.weight.copy_(torch.from_numpy(w))
            self.bags.append(bag)
        params = [b.weight for b in self.bags]
        self.torch_opt = None
        if wd == 0 and opt == "sgd":
            self.torch_opt = torch.optim.SGD(params, lr=lr)
        elif wd == 0 and opt == "adagrad":
            self.torch_opt = torch.optim.Adagrad(params, lr=lr, eps=eps)
        elif wd == 0 and opt == "adam" and adam_step == "global":
            self.torch_opt = torch.optim.SparseAdam(params, lr=lr, betas=betas, eps=eps)
        d = weights[0].shape[1]
        width = {"sgd": 0, "rowwise_adagrad": 1, "adagrad": d, "adam": 2 * d + 1}[opt]
        self.state = [torch.zeros((w.shape[0], width), dtype=torch.float32) for w in weights]
        self.global_step = 0

    def step(self, ids, offs, weights):
        for b in self.bags:
            b.weight.grad = None
        out = torch.stack([bag(i, o) for bag, i, o in zip(self.bags, ids, offs)], dim=1)
        loss_of(out, weights).backward()
        self.global_step += 1
        with torch.no_grad():
            if self.torch_opt is not None:
                self.torch_opt.step()
            else:
                for bag, st in zip(self.bags, self.state):
                    self._manual(bag.weight, st, bag.weight.grad.coalesce())
        return out.detach()

    def _manual(self, weight, st, grad):
        rows, g = grad.indices()[0], grad.values()
        w = weight[rows]
        if self.wd:
            g = g + self.wd * w
        s = st[rows]
        lr, eps = self.lr, self.eps
        if self.opt == "sgd":
            w = w - lr * g
        elif self.opt == "rowwise_adagrad":
            s[:, 0] += g.square().mean(dim=1)
            w = w - lr * g / (s[:, :1].sqrt() + eps)
        elif self.opt == "adagrad":
            s += g * g
            w = w - lr * g / (s.sqrt() + eps)
        else:
            b1, b2 = self.betas
            d = w.shape[1]
            s[:, 2 * d] += 1
            s[:, :d] = b1 * s[:, :d] + (1 - b1) * g
            s[:, d:2 * d] = b2 * s[:, d:2 * d] + (1 - b2) * g * g
            t = (s[:, 2 * d:].double() if self.adam_step == "row"
                 else torch.full((len(rows), 1), float(self.global_step), dtype=torch.float64))
            step = (lr * torch.sqrt(1 - b2 ** t) / (1 - b1 ** t)).float()
            w = w - step * s[:, :d] / (s[:, d:2 * d].sqrt() + eps)
        weight[rows] = w
        st[rows] = s

    def tables(self):
        return [b.weight.detach().numpy().copy() for b in self.bags]

    def states(self):
        """The per-row optimizer state in the store's layout (torch's own optimizer state when it ran)."""
        if self.torch_opt is None:
            return [s.numpy() for s in self.state]
        out = []
        for b, s in zip(self.bags, self.state):
            ts = self.torch_opt.state.get(b.weight, {})
            if self.opt == "sgd":
                out.append(s.numpy())
            elif self.opt == "adagrad":
                out.append(ts["sum"].numpy() if ts else s.numpy())
            else:  # SparseAdam: m, v; no per-row count to compare
                out.append(None)
        return out


@st.composite
def bags(draw, n_tables, max_bags=4, max_len=5, hot=6):
    """Per-table ids (a few hot ids, so repeats within and across bags) and offsets; same bag count."""
    b = draw(st.integers(0, max_bags))
    ids, offs = [], []
    every_empty = draw(st.booleans()) and draw(st.booleans())
    for _ in range(n_tables):
        lens = [0] * b if every_empty else draw(st.lists(st.integers(0, max_len), min_size=b, max_size=b))
        pool = st.integers(0, hot - 1) | st.integers(0, ROWS - 1)
        x = draw(st.lists(pool, min_size=sum(lens), max_size=sum(lens)))
        ids.append(torch.tensor(x, dtype=torch.int64))
        offs.append(torch.from_numpy(np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)))
    return ids, offs


def loss_weights(draw, b, n_tables):
    kind = draw(st.sampled_from(["normal", "zero", "some-zero"]))
    seed = draw(st.integers(0, 2 ** 16))
    w = torch.from_numpy(np.random.default_rng(seed).standard_normal((b, n_tables, DIM)).astype(np.float32))
    if kind == "zero":
        w.zero_()  # every gradient exactly zero: the batch's rows still take a (zero-gradient) step
    elif kind == "some-zero" and b:
        w[0] = 0
    return w


def as_keyed(draw, names, ids, offs):
    """The same batch as a KeyedJaggedBatch, keys shuffled, maybe with an extra key the module ignores."""
    order = draw(st.permutations(list(range(len(names)))))
    keys = [names[k] for k in order]
    values = [ids[k] for k in order]
    lengths = [offs[k].diff() for k in order]
    if draw(st.booleans()):
        keys.append("zz_unused")
        values.append(torch.zeros(int(lengths[0].sum()) if lengths else 0, dtype=torch.int64))
        lengths.append(lengths[0].clone())
    return KeyedJaggedBatch(keys, torch.cat(values), torch.cat(lengths))


class _AcceleratorOnCpu(str):
    """A device torch reads as "cpu" but whose ``type`` is not: the module takes its accelerator path
    (``_FusedBag``, ``apply_update`` on gathered copies) on CPU tensors (as tests/test_mutation_ebc.py does)."""

    type = "accelerator"


TOL = {"sgd": 1e-5, "rowwise_adagrad": 1e-5, "adagrad": 1e-4, "adam": 1e-3}


def close(got, want, opt, what):
    scale = max(float(np.abs(want).max()) if want.size else 0.0, 1e-3)
    err = float(np.abs(got - want).max()) if want.size else 0.0
    assert err <= TOL[opt] * scale, (what, err, scale)


@settings(**SETTINGS)
@given(data=st.data(), case=st.sampled_from(OPTS), pooling=st.sampled_from(["sum", "mean"]),
       tiers=st.sampled_from(sorted(TIERS) + ["oversized-accelerator-path"]), wd=st.sampled_from([0.0, 0.0, 0.05]),
       lookahead=st.sampled_from([0, 0, 2]))
def test_steps_match_torch(data, case, pooling, tiers, wd, lookahead) -> None:
    opt, adam_step = case
    lr = {"sgd": 0.1, "rowwise_adagrad": 0.1, "adagrad": 0.1, "adam": 0.02}[opt]
    eps = data.draw(st.sampled_from({"sgd": [0.0], "rowwise_adagrad": [1e-8, 0.1], "adagrad": [1e-10, 0.05],
                                     "adam": [1e-8, 0.01]}[opt]))
    betas = data.draw(st.sampled_from([(0.9, 0.999), (0.5, 0.9), (0.0, 0.5)])) if opt == "adam" else (0.9, 0.999)
    names = ["a", "b"]
    n_steps = data.draw(st.integers(1, 3))
    batches = []
    for _ in range(n_steps):
        ids, offs = data.draw(bags(2))
        w = loss_weights(data.draw, len(offs[0]) - 1, 2)
        keyed = as_keyed(data.draw, names, ids, offs) if data.draw(st.booleans()) else None
        form = data.draw(st.sampled_from(["contiguous", "strided", "numpy"]))
        if form == "strided":  # non-contiguous views of the same ids
            ids = [i.repeat_interleave(2)[::2] for i in ids]
            assert all(not i.is_contiguous() for i in ids if len(i) > 1)
        elif form == "numpy":
            ids, offs = [i.numpy() for i in ids], [o.numpy() for o in offs]
        batches.append((ids, offs, w, keyed))
    with tempfile.TemporaryDirectory() as d:
        store = make_store(d + "/s", [(n, "float32") for n in names], TIERS[tiers.removesuffix("-accelerator-path")])
        ref = Reference([initial_weights(store, n) for n in names], opt, adam_step, lr, eps, betas, wd, pooling)
        ebc = TieredEmbeddingBagCollection(store, names, optimizer=opt, lr=lr, eps=eps, betas=betas,
                                           weight_decay=wd, pooling=pooling, adam_step=adam_step)
        if tiers.endswith("accelerator-path"):
            for ws in ebc.ws:
                assert isinstance(ws, WorkingSet)
                ws.device = _AcceleratorOnCpu("cpu")

        def sparse(b):
            return b[3] if b[3] is not None else (b[0], b[1])
        it = ebc.pipeline(batches, lookahead=lookahead, sparse=sparse) if lookahead else batches
        for b in it:
            ids, offs, w, keyed = b
            out = ebc(keyed) if keyed is not None else ebc(ids, offs)
            expect = ref.step([torch.as_tensor(i) for i in ids], [torch.as_tensor(o) for o in offs], w)
            assert out.shape == expect.shape
            close(out.detach().numpy(), expect.numpy(), opt, "pooled")
            loss_of(out, w).backward()
        ebc.flush()
        assert ebc.steps == n_steps
        for name, want, want_state in zip(names, ref.tables(), ref.states()):
            got, got_state = read_all(store, name)
            close(got, want, opt, name)
            if want_state is not None:
                close(got_state, want_state, opt, name + " state")
        store.close()


def rounded(fmt, rows: np.ndarray) -> np.ndarray:
    """``rows`` as the table's format stores them (float16 or int8 with a per-row scale and bias)."""
    return fmt.decode(fmt.encode(np.ascontiguousarray(rows, dtype=np.float32)))


@settings(**SETTINGS)
@given(data=st.data(), case=st.sampled_from(OPTS), pooling=st.sampled_from(["sum", "mean"]),
       tiers=st.sampled_from(sorted(TIERS)), wd=st.sampled_from([0.0, 0.05]), lookahead=st.sampled_from([0, 2]))
def test_float16_and_int8_tables_beside_a_float32_one(data, case, pooling, tiers, wd, lookahead) -> None:
    """One module over a float32, a float16 and an int8 table. A step reads each row as its table stores it
    (rounded to float16, or to int8 with the row's scale and bias), look-ahead or not: the reference rounds
    the batch's rows the same way after each step. Compared within one quantum of the format (a sum taken in
    another order may round to the neighbouring value)."""
    from embstore.rows import RowFormat
    from embstore.config import RowDType

    opt, adam_step = case
    lr = {"sgd": 0.1, "rowwise_adagrad": 0.1, "adagrad": 0.1, "adam": 0.02}[opt]
    eps = {"sgd": 0.0, "rowwise_adagrad": 1e-8, "adagrad": 1e-10, "adam": 1e-8}[opt]
    names, dtypes = ["f32", "f16", "i8"], ["float32", "float16", "int8"]
    fmts = [RowFormat(DIM, RowDType(dt)) for dt in dtypes]
    n_steps = data.draw(st.integers(1, 3))
    batches = []
    for _ in range(n_steps):
        ids, offs = data.draw(bags(3))
        batches.append((ids, offs, loss_weights(data.draw, len(offs[0]) - 1, 3)))
    with tempfile.TemporaryDirectory() as d:
        store = make_store(d + "/s", list(zip(names, dtypes)), TIERS[tiers])
        init = [rounded(f, initial_weights(store, n)) for f, n in zip(fmts, names)]  # a fresh row, as read
        ref = Reference(init, opt, adam_step, lr, eps, (0.9, 0.999), wd, pooling)
        ebc = TieredEmbeddingBagCollection(store, names, optimizer=opt, lr=lr, eps=eps, weight_decay=wd,
                                           pooling=pooling, adam_step=adam_step)
        for ids, offs, w in ebc.pipeline(batches, lookahead=lookahead, sparse=lambda b: b[:2]):
            out = ebc(ids, offs)
            expect = ref.step(ids, offs, w)
            loss_of(out, w).backward()
            with torch.no_grad():
                for bag, fmt, i in zip(ref.bags, fmts, ids):
                    rows = torch.unique(i)
                    bag.weight[rows] = torch.from_numpy(rounded(fmt, bag.weight[rows].numpy()))
            np.testing.assert_allclose(out.detach().numpy(), expect.numpy(), rtol=1e-3, atol=1e-4)
        ebc.flush()
        for name, fmt, want, want_state in zip(names, fmts, ref.tables(), ref.states()):
            got, got_state = read_all(store, name)
            if fmt.dtype is RowDType.FLOAT32:
                close(got, want, opt, name)
            else:
                quantum = (np.abs(want).max(axis=1, keepdims=True) * 2.0 ** -10 if fmt.dtype is RowDType.FLOAT16
                           else (want.max(axis=1, keepdims=True) - want.min(axis=1, keepdims=True)) / 255)
                assert (np.abs(got - want) <= 1.01 * quantum + TOL[opt] * 0.1).all(), (name, np.abs(got - want).max())
            if want_state is not None:
                close(got_state, want_state, opt, name + " state")
        store.close()


def _run_cut(path, names, dtypes, tiers, opt, adam_step, lookahead, batches, cuts):
    """Train ``batches`` through one pipeline per part (``cuts``: where a part ends), with a flush, a
    state_dict, a release and a close and reopen of the store between parts; outputs and the stored tables."""
    store = make_store(path, list(zip(names, dtypes)), TIERS[tiers])
    outs, sd = [], None
    bounds = [0, *cuts, len(batches)]
    for lo, hi in zip(bounds, bounds[1:]):
        ebc = TieredEmbeddingBagCollection(store, names, optimizer=opt, lr=0.05, adam_step=adam_step,
                                           weight_decay=0.01, lookahead=lookahead)
        if sd is not None:
            ebc.load_state_dict(sd)
        for ids, offs, w in ebc.pipeline(batches[lo:hi], sparse=lambda b: b[:2]):
            out = ebc(ids, offs)
            loss_of(out, w).backward()
            outs.append(out.detach())
        ebc.flush()
        sd = ebc.state_dict()
        ebc.release()
        store.close()
        store = embstore.open(path)
    tables = [read_all(store, n) for n in names]
    store.close()
    return outs, tables


@settings(**SETTINGS)
@given(data=st.data(), case=st.sampled_from(OPTS), tiers=st.sampled_from(sorted(TIERS)),
       lookahead=st.sampled_from([1, 2]))
def test_a_cut_and_reopened_run_and_any_lookahead_train_bit_for_bit_alike(data, case, tiers, lookahead) -> None:
    """Cutting training into pipelines with a flush, a close and a reopen between them, or changing the
    look-ahead depth, changes no trained number: not for float32 tables, nor for float16 / int8 ones, whose
    rows the working set holds in float32 (they used to round only when a row left the working set, so a row
    kept there across steps by a deeper look-ahead trained on values the store never held)."""
    opt, adam_step = case
    names, dtypes = ["f32", "f16", "i8"], ["float32", "float16", "int8"]
    n = data.draw(st.integers(2, 5))
    batches = []
    for _ in range(n):
        ids, offs = data.draw(bags(3, hot=3))
        batches.append((ids, offs, loss_weights(data.draw, len(offs[0]) - 1, 3)))
    cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), min_size=1, max_size=2)))
    with tempfile.TemporaryDirectory() as d:
        base = _run_cut(d + "/base", names, dtypes, tiers, opt, adam_step, 0, batches, [])
        whole = _run_cut(d + "/whole", names, dtypes, tiers, opt, adam_step, lookahead, batches, [])
        cut = _run_cut(d + "/cut", names, dtypes, tiers, opt, adam_step, lookahead, batches, cuts)
    for other in (whole, cut):
        assert all(torch.equal(a, b) for a, b in zip(base[0], other[0]))
        for name, (rows_a, state_a), (rows_b, state_b) in zip(names, base[1], other[1]):
            assert np.array_equal(rows_a, rows_b), name
            assert np.array_equal(state_a, state_b), name


def _i(*x):
    return torch.tensor(x, dtype=torch.int64)


BAD_BATCHES = {  # name -> (batch as forward's arguments, the typed error it must raise)
    "lengths-sum": ((KeyedJaggedBatch(["a", "b"], _i(1, 2, 3), _i(1, 1, 1, 1)),), embstore.InvalidInputError),
    "lengths-negative": ((KeyedJaggedBatch(["a", "b"], _i(1, 2, 3), _i(-1, 2, 1, 1)),), embstore.InvalidInputError),
    "lengths-not-per-key": ((KeyedJaggedBatch(["a", "b"], _i(1, 2, 3), _i(1, 1, 1)),), embstore.InvalidInputError),
    "lengths-2d": ((KeyedJaggedBatch(["a", "b"], _i(1, 2), _i(1, 0, 0, 1).view(2, 2)),), embstore.InvalidInputError),
    "lengths-int32": ((KeyedJaggedBatch(["a", "b"], _i(1, 2), torch.tensor([1, 1], dtype=torch.int32)),),
                      embstore.InvalidInputError),
    "key-missing": ((KeyedJaggedBatch(["a"], _i(1, 2), _i(1, 1)),), embstore.InvalidInputError),
    "key-twice": ((KeyedJaggedBatch(["a", "a"], _i(1, 2), _i(1, 1)),), embstore.InvalidInputError),
    "no-keys": ((KeyedJaggedBatch([], _i(), _i()),), embstore.InvalidInputError),
    "keyed-id-range": ((KeyedJaggedBatch(["b", "a"], _i(1, ROWS), _i(1, 1)),), embstore.IdOutOfRangeError),
    "keyed-float-values": ((KeyedJaggedBatch(["a", "b"], torch.tensor([1.0, 2.0]), _i(1, 1)),),
                           embstore.InvalidInputError),
    "keyed-with-offsets": ((KeyedJaggedBatch(["a", "b"], _i(1, 2), _i(1, 1)), [_i(0, 1)]), embstore.InvalidInputError),
    "int32-ids": (([torch.tensor([1], dtype=torch.int32), _i(1)], [_i(0, 1), _i(0, 1)]), embstore.InvalidInputError),
    "float-ids": (([torch.tensor([1.0]), _i(1)], [_i(0, 1), _i(0, 1)]), embstore.InvalidInputError),
    "2d-ids": (([_i(1, 2).view(1, 2), _i(1)], [_i(0, 2), _i(0, 1)]), embstore.InvalidInputError),
    "negative-id": (([_i(1), _i(-1)], [_i(0, 1), _i(0, 1)]), embstore.IdOutOfRangeError),
    "id-past-end": (([_i(ROWS), _i(1)], [_i(0, 1), _i(0, 1)]), embstore.IdOutOfRangeError),
    "offsets-end": (([_i(1, 2), _i(1)], [_i(0, 1), _i(0, 1)]), embstore.InvalidOffsetsError),
    "offsets-start": (([_i(1, 2), _i(1)], [_i(1, 2), _i(0, 1)]), embstore.InvalidOffsetsError),
    "offsets-decreasing": (([_i(1, 2), _i(1, 2)], [_i(0, 2, 1, 2), _i(0, 1, 1, 2)]), embstore.InvalidOffsetsError),
    "offsets-int32": (([_i(1), _i(1)], [torch.tensor([0, 1], dtype=torch.int32), _i(0, 1)]),
                      embstore.InvalidOffsetsError),
    "offsets-empty": (([_i(), _i()], [_i(), _i()]), embstore.InvalidOffsetsError),
    "bag-counts": (([_i(1), _i(1)], [_i(0, 1), _i(0, 0, 1)]), embstore.InvalidInputError),
    "table-count": (([_i(1)], [_i(0, 1)]), embstore.InvalidInputError),
    "not-lists": ((_i(1), _i(0, 1)), embstore.InvalidInputError),
}


@settings(**SETTINGS)
@given(bad=st.lists(st.sampled_from(sorted(BAD_BATCHES)), min_size=1, max_size=4),
       tiers=st.sampled_from(sorted(TIERS)), how=st.sampled_from(["forward", "no_grad", "prefetch", "pipeline"]))
def test_bad_batches_raise_typed_errors_and_change_nothing(bad, tiers, how) -> None:
    """A malformed batch raises its typed error (an InvalidInputError, a ValueError) from forward, prefetch or a
    pipeline, before any row, state, counter or pin changes; the store reads back as before and the next good
    step trains exactly like torch."""
    with tempfile.TemporaryDirectory() as d:
        store = make_store(d + "/s", [("a", "float32"), ("b", "float32")], TIERS[tiers])
        ebc = TieredEmbeddingBagCollection(store, ["a", "b"], optimizer="adagrad", lr=0.1, lookahead=1)
        good = ([_i(1, 2, 2), _i(3)], [_i(0, 3, 3), _i(0, 0, 1)])
        loss_of(ebc(*good), torch.ones(2, 2, DIM)).backward()  # rows and state that the bad batches must keep
        ebc.flush()
        before = [read_all(store, n) for n in ("a", "b")]
        stats = ebc.stats()
        ref = Reference([b[0] for b in before], "adagrad", "row", 0.1, 1e-10, (0.9, 0.999), 0.0, "sum")
        ref.torch_opt.state[ref.bags[0].weight]["sum"] = torch.from_numpy(before[0][1].copy())
        ref.torch_opt.state[ref.bags[0].weight]["step"] = torch.tensor(0.0)
        ref.torch_opt.state[ref.bags[1].weight]["sum"] = torch.from_numpy(before[1][1].copy())
        ref.torch_opt.state[ref.bags[1].weight]["step"] = torch.tensor(0.0)
        for name in bad:
            args, error = BAD_BATCHES[name]
            with pytest.raises(error) as info:
                if how == "forward":
                    ebc(*args)
                elif how == "no_grad":
                    with torch.no_grad():
                        ebc(*args)
                elif how == "prefetch":
                    ebc.prefetch(*args)
                else:
                    for _ in ebc.pipeline([good, args, good], lookahead=2, sparse=lambda b: b[0] if len(b) == 1 else b):
                        pass
            assert str(info.value)
        assert ebc.stats()["working_set_rows"] == {"a": 0, "b": 0}
        assert ebc.steps == stats["steps"] == 1
        ebc.flush()
        for (r0, s0), (r1, s1) in zip(before, (read_all(store, n) for n in ("a", "b"))):
            assert np.array_equal(r0, r1) and np.array_equal(s0, s1)
        ids, offs = [_i(2, 5, 2), _i(3, 3)], [_i(0, 2, 3), _i(0, 1, 2)]
        w = torch.linspace(-1, 1, 2 * 2 * DIM).view(2, 2, DIM)
        out = ebc(ids, offs)
        expect = ref.step(ids, offs, w)
        close(out.detach().numpy(), expect.numpy(), "adagrad", "pooled")
        loss_of(out, w).backward()
        ebc.flush()
        for n, want in zip(("a", "b"), ref.tables()):
            close(read_all(store, n)[0], want, "adagrad", n)
        store.close()


@pytest.mark.parametrize("tiers", sorted(TIERS))
def test_a_second_backward_is_refused_as_such_and_steps_nothing(tiers) -> None:
    """backward through the same forward twice (retain_graph) raises, naming a second backward (not "the
    next forward", which never ran), and the rows keep the first step only; a forward left without
    backward steps nothing; the next forward and backward step as usual."""
    with tempfile.TemporaryDirectory() as d:
        store = make_store(d + "/s", [("a", "float32"), ("b", "float32")], TIERS[tiers])
        init = [initial_weights(store, n) for n in ("a", "b")]
        ebc = TieredEmbeddingBagCollection(store, ["a", "b"], optimizer="sgd", lr=0.1)
        ids, offs = [_i(1, 2, 1), _i(4)], [_i(0, 2, 3), _i(0, 0, 1)]
        loss = ebc(ids, offs).sum()
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="second backward") as info:
            loss.backward()
        assert "next forward" not in str(info.value)
        ebc(ids, offs)  # a forward whose graph is dropped: no step
        ebc.flush()
        a, b = read_all(store, "a")[0], read_all(store, "b")[0]
        want_a, want_b = init[0].copy(), init[1].copy()
        want_a[1] -= 0.1 * 2  # id 1 twice (bags 0 and 1), each bag's gradient 1
        want_a[2] -= 0.1
        want_b[4] -= 0.1
        np.testing.assert_allclose(a, want_a, rtol=0, atol=1e-7)
        np.testing.assert_allclose(b, want_b, rtol=0, atol=1e-7)
        assert ebc.steps == 1
        ebc(ids, offs).sum().backward()
        assert ebc.steps == 2
        store.close()


def test_a_refused_module_leaves_its_tables_layout_alone(tmp_path) -> None:
    """Tables of different dims (or a name the store lacks) are refused before any table is given optimizer
    state columns: the refused constructor used to re-lay out every table first (persisted in the manifest),
    so rows written later could only ever be trained with that optimizer."""
    text = "".join(f'[[table]]\nname = "{n}"\nnum_embeddings = {ROWS}\ndim = {dim}\ntiers = {TIERS["resident"]}\n'
                   for n, dim in (("a", 4), ("b", 8)))
    store = embstore.create(tmp_path / "s", embstore.StoreConfig.from_toml(text))
    with pytest.raises(embstore.InvalidInputError, match="same dim"):
        TieredEmbeddingBagCollection(store, ["a", "b"], optimizer="adam")
    with pytest.raises(embstore.UnknownTableError):
        TieredEmbeddingBagCollection(store, ["a", "zz"], optimizer="adagrad")
    assert store["a"].format.state_dim == store["b"].format.state_dim == 0
    store.close()
    store = embstore.open(tmp_path / "s")
    assert store["a"].format.state_dim == store["b"].format.state_dim == 0
    store["a"].update(_i(3), np.ones((1, 4), np.float32))  # a row written: the layout is now fixed
    ebc = TieredEmbeddingBagCollection(store, ["a"], optimizer="sgd", lr=0.5)
    ebc([_i(3)], [_i(0, 1)]).sum().backward()
    ebc.flush()
    np.testing.assert_array_equal(store["a"].lookup(_i(3)).numpy(), np.full((1, 4), 0.5, np.float32))
    store.close()
