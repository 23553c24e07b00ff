"""TieredEmbeddingBagCollection against plain torch (and fbgemm) training on the same batches."""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import embstore
from kernel_threads import kernel_path
from embstore.training import KeyedJaggedBatch, TieredEmbeddingBagCollection, state_dim
from embstore.training.testing import (TorchReference, initial_weights, loss_of, make_store, random_batches,
                                       rel_err)

ROWS, DIM = 400, 8
RESIDENT = '[{ kind = "dram", capacity = "1MiB" }, { kind = "mmap" }]'
CASES = [("sgd", 0.1, "row"), ("adagrad", 0.1, "row"), ("rowwise_adagrad", 0.1, "row"), ("adam", 0.01, "row"),
         ("adam", 0.01, "global")]


def oversized_tiers(optimizer: str) -> str:
    """A DRAM cache of 10% of the rows (row + state bytes) over an ssd home."""
    row_bytes = 4 * (DIM + state_dim(optimizer, DIM))
    return f'[{{ kind = "dram", capacity = {ROWS // 10 * row_bytes}, policy = "lru" }}, {{ kind = "ssd" }}]'


def train(store: embstore.Store, optimizer: str, lr: float, adam_step: str, batches, lookahead: int | None,
          pooling: str = "sum") -> tuple[TieredEmbeddingBagCollection, list[torch.Tensor]]:
    ebc = TieredEmbeddingBagCollection(store, ["a", "b"], optimizer=optimizer, lr=lr, pooling=pooling,
                                       adam_step=adam_step)
    outs = []
    it = batches if lookahead is None else ebc.pipeline(batches, lookahead=lookahead, sparse=lambda b: b[:2])
    for ids, offs, w in it:
        out = ebc(ids, offs)
        loss_of(out, w).backward()
        outs.append(out.detach())
    ebc.flush()
    return ebc, outs


def stored_rows(store: embstore.Store, name: str) -> np.ndarray:
    t = store[name]
    return t.read_with_state(np.arange(t.num_rows, dtype=np.int64))[0]


def check_equivalent(tmp_path, optimizer: str, lr: float, adam_step: str, tiers: str,
                     lookahead: int | None, steps: int = 20, pooling: str = "sum") -> TieredEmbeddingBagCollection:
    store = make_store(tmp_path / "s", [("a", ROWS, DIM), ("b", ROWS, DIM)], tiers)
    init = [initial_weights(store, n) for n in ("a", "b")]
    batches = random_batches(1, steps, [ROWS, ROWS], batch=16, max_len=6, dim=DIM)
    ebc, outs = train(store, optimizer, lr, adam_step, batches, lookahead, pooling)
    ref = TorchReference(init, optimizer, lr, pooling=pooling, adam_step=adam_step)
    for (ids, offs, w), out in zip(batches, outs):
        expect = ref.step(ids, offs, w)
        assert rel_err(out.numpy(), expect.numpy()) <= 1e-5
    for name, want in zip(("a", "b"), ref.weights()):
        got = stored_rows(store, name)
        assert rel_err(got, want) <= 1e-5, (name, rel_err(got, want))
        assert not np.array_equal(got, initial_weights(store, name))  # training moved the rows
    store.close()
    return ebc


@pytest.mark.parametrize("parallel", [False, True], ids=["one-thread", "parallel"])
@pytest.mark.parametrize("optimizer,lr,adam_step", CASES)
def test_resident_training_matches_torch(tmp_path, optimizer, lr, adam_step, parallel) -> None:
    with kernel_path(parallel):
        ebc = check_equivalent(tmp_path, optimizer, lr, adam_step, RESIDENT, None)
    assert ebc.steps == 20


def test_mean_pooling_matches_torch(tmp_path) -> None:
    check_equivalent(tmp_path, "adagrad", 0.1, "row", RESIDENT, None, steps=8, pooling="mean")


@pytest.mark.parametrize("lookahead", [None, 1, 3])
@pytest.mark.parametrize("optimizer,lr,adam_step", CASES[:4] + [("adam", 0.01, "row")][:0])
def test_oversized_training_matches_torch(tmp_path, optimizer, lr, adam_step, lookahead) -> None:
    """Table 10x its DRAM cache over an ssd home, with and without look-ahead."""
    ebc = check_equivalent(tmp_path, optimizer, lr, adam_step, oversized_tiers(optimizer), lookahead)
    if lookahead:
        assert ebc.counters["demand_misses"] == 0


@pytest.mark.parametrize("optimizer,lr,adam_step", CASES[:2])
def test_oversized_training_on_parallel_kernels(tmp_path, optimizer, lr, adam_step) -> None:
    with kernel_path(parallel=True):
        check_equivalent(tmp_path, optimizer, lr, adam_step, oversized_tiers(optimizer), 3)


def test_oversized_adam_with_lookahead(tmp_path) -> None:
    check_equivalent(tmp_path, "adam", 0.01, "row", oversized_tiers("adam"), 3)


@settings(max_examples=25)
@given(data=st.data(), mode=st.sampled_from(["sum", "mean"]))
def test_forward_and_gradients_match_embedding_bag(data, mode) -> None:
    """Random bags (empty, repeated ids) over rows spread across cache, home and never-written."""
    n, dim = 64, 4
    num_bags = data.draw(st.integers(1, 6))
    lens = data.draw(st.lists(st.integers(0, 5), min_size=num_bags, max_size=num_bags))
    ids = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=sum(lens), max_size=sum(lens))), np.int64)
    offs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    written = np.array(sorted(data.draw(st.sets(st.integers(0, n - 1), max_size=40))), np.int64)
    with tempfile.TemporaryDirectory() as d:
        store = make_store(d + "/s", [("a", n, dim)], '[{ kind = "dram", capacity = 160 }, { kind = "mmap" }]')
        t = store["a"]
        weights = initial_weights(store, "a")
        if len(written):  # some end up in the 10-row cache, the rest in the home
            vals = np.random.default_rng(len(written)).standard_normal((len(written), dim)).astype(np.float32)
            t.update(written, vals)
            weights[written] = vals
        ebc = TieredEmbeddingBagCollection(store, ["a"], optimizer="sgd", lr=1.0, pooling=mode)
        w = torch.from_numpy(np.random.default_rng(7).standard_normal((num_bags, 1, dim)).astype(np.float32))
        out = ebc([torch.from_numpy(ids)], [torch.from_numpy(offs)])
        loss_of(out, w).backward()
        ebc.flush()
        ref = torch.nn.EmbeddingBag(n, dim, mode=mode, sparse=True, include_last_offset=True)
        with torch.no_grad():
            ref.weight.copy_(torch.from_numpy(weights))
        expect = ref(torch.from_numpy(ids), torch.from_numpy(offs))
        assert torch.equal(out[:, 0].detach(), expect.detach())
        loss_of(expect[:, None], w).backward()
        grad = ref.weight.grad.to_dense().numpy()
        after = t.read_with_state(np.arange(n, dtype=np.int64))[0]
        np.testing.assert_allclose(weights - after, grad, rtol=1e-5, atol=1e-6)
        store.close()


def test_keyed_jagged_batch_equals_lists(tmp_path) -> None:
    store = make_store(tmp_path / "s", [("a", ROWS, DIM), ("b", ROWS, DIM)], RESIDENT)
    ebc = TieredEmbeddingBagCollection(store, ["a", "b"])
    (ids, offs, _), = random_batches(3, 1, [ROWS, ROWS], batch=5, max_len=4, dim=DIM)
    lengths = torch.cat([o.diff() for o in offs[::-1]])
    kjb = KeyedJaggedBatch(["b", "a"], torch.cat(ids[::-1]), lengths)  # key order need not match
    with torch.no_grad():
        assert torch.equal(ebc(kjb), ebc(ids, offs))
    store.close()


def test_qr_hashed_table_trains_like_torch(tmp_path) -> None:
    """QR: two physical rows per id combined by product; gradients flow through the combine."""
    store = make_store(tmp_path / "s", [("q", 1000, DIM)], RESIDENT,
                       extra='hash = { kind = "qr", collisions = 8 }\n')
    t = store["q"]
    w0 = torch.from_numpy(initial_weights(store, "q")).requires_grad_()
    ref_opt = torch.optim.SGD([w0], lr=0.5)
    ebc = TieredEmbeddingBagCollection(store, ["q"], optimizer="sgd", lr=0.5)
    for ids, offs, w in random_batches(5, 5, [10_000], batch=8, max_len=5, dim=DIM):
        out = ebc(ids, offs)
        loss_of(out, w).backward()
        rows = torch.from_numpy(t.mapper(ids[0].numpy()))
        emb = w0[rows[:, 0]] * w0[rows[:, 1]]
        expect = torch.nn.functional.embedding_bag(torch.arange(len(ids[0])), emb, offs[0], mode="sum",
                                                       include_last_offset=True)
        ref_opt.zero_grad()
        loss_of(expect[:, None], w).backward()
        ref_opt.step()
        assert rel_err(out[:, 0].detach().numpy(), expect.detach().numpy()) <= 1e-5
    ebc.flush()
    assert rel_err(stored_rows(store, "q"), w0.detach().numpy()) <= 1e-5
    store.close()


def test_qr_hashed_table_trains_on_a_batch_without_ids(tmp_path) -> None:
    """Every bag empty: zeros out, a step that changes no row (the combine's reshape must size n = 0)."""
    store = make_store(tmp_path / "s", [("q", 1000, DIM)], RESIDENT,
                       extra='hash = { kind = "qr", collisions = 8 }\n')
    before = stored_rows(store, "q")
    ebc = TieredEmbeddingBagCollection(store, ["q"], optimizer="sgd", lr=0.5)
    out = ebc([torch.zeros(0, dtype=torch.int64)], [torch.zeros(3, dtype=torch.int64)])
    assert out.shape == (2, 1, DIM) and not out.any()
    out.sum().backward()
    ebc.flush()
    assert np.array_equal(stored_rows(store, "q"), before)
    store.close()


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_checkpoint_resume_is_bit_identical(tmp_path, optimizer) -> None:
    batches = random_batches(11, 10, [ROWS, ROWS], batch=16, max_len=6, dim=DIM)
    tiers = oversized_tiers(optimizer)

    def run(path, parts):
        store = make_store(path, [("a", ROWS, DIM), ("b", ROWS, DIM)], tiers)
        outs, sd = [], None
        for part in parts:
            ebc = TieredEmbeddingBagCollection(store, ["a", "b"], optimizer=optimizer, lr=0.05, lookahead=2)
            if sd is not None:
                ebc.load_state_dict(sd)
            for ids, offs, w in ebc.pipeline(part, sparse=lambda b: b[:2]):
                out = ebc(ids, offs)
                loss_of(out, w).backward()
                outs.append(out.detach())
            ebc.flush()
            sd = ebc.state_dict()
            ebc.release()
            store.close()
            store = embstore.open(path)
        rows = [stored_rows(store, n) for n in ("a", "b")]
        store.close()
        return outs, rows, sd

    outs1, rows1, sd1 = run(tmp_path / "one", [batches])
    outs2, rows2, sd2 = run(tmp_path / "two", [batches[:4], batches[4:]])
    assert all(torch.equal(a, b) for a, b in zip(outs1, outs2))
    assert all(np.array_equal(a, b) for a, b in zip(rows1, rows2))
    assert sd2["_extra_state"]["steps"] == sd1["_extra_state"]["steps"] == 10


def test_state_dict_carries_hyper_parameters(tmp_path) -> None:
    store = make_store(tmp_path / "s", [("a", ROWS, DIM)], RESIDENT)
    ebc = TieredEmbeddingBagCollection(store, ["a"], optimizer="adam", lr=0.03, betas=(0.8, 0.99))
    sd = ebc.state_dict()
    other = TieredEmbeddingBagCollection(store, ["a"], optimizer="adam", lr=1.0)
    other.load_state_dict(sd)
    assert (other.optim.lr, other.optim.beta1, other.optim.beta2) == (0.03, 0.8, 0.99)
    with pytest.raises(embstore.InvalidInputError, match="trained with 'sgd'"):
        sd["_extra_state"]["optimizer"]["name"] = "sgd"
        other.load_state_dict(sd)
    store.close()


def test_bad_inputs_raise_typed_errors(tmp_path) -> None:
    store = make_store(tmp_path / "s", [("a", ROWS, DIM), ("b", ROWS, DIM)], RESIDENT)
    with pytest.raises(embstore.InvalidInputError, match="optimizer"):
        TieredEmbeddingBagCollection(store, ["a"], optimizer="lamb")
    with pytest.raises(embstore.UnknownTableError):
        TieredEmbeddingBagCollection(store, ["zz"])
    ebc = TieredEmbeddingBagCollection(store, ["a", "b"])
    ok = torch.tensor([0, 2], dtype=torch.int64)
    with pytest.raises(embstore.IdOutOfRangeError):
        ebc([torch.tensor([1, ROWS]), ok], [ok, ok])
    with pytest.raises(embstore.InvalidOffsetsError):
        ebc([ok, ok], [torch.tensor([0, 1]), ok])
    with pytest.raises(embstore.InvalidInputError, match="same number of bags"):
        ebc([ok, ok], [ok, torch.tensor([0, 1, 2])])
    with pytest.raises(embstore.InvalidInputError, match="expected 2"):
        ebc([ok], [ok])
    store.close()


@pytest.mark.parametrize("kwargs", [dict(lr=-0.1), dict(lr=float("nan")), dict(lr=float("inf")), dict(eps=-1.0),
                                    dict(betas=(1.0, 0.9)), dict(betas=(0.9,)), dict(weight_decay=float("nan")),
                                    dict(lr="fast"), dict(lr=1e300), dict(weight_decay=1e39)])  # inf in float32
def test_bad_hyper_parameters_are_refused(tmp_path, kwargs) -> None:
    store = make_store(tmp_path / "s", [("a", ROWS, DIM)], RESIDENT)
    with pytest.raises(embstore.InvalidInputError, match="lr|eps|betas|weight_decay"):
        TieredEmbeddingBagCollection(store, ["a"], optimizer="adam", **kwargs)
    store.close()


@pytest.mark.parametrize("tiers", ["resident", "oversized"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("bad", [0, 1])
def test_a_nan_gradient_is_refused_and_its_table_is_unchanged(tmp_path, tiers: str, optimizer: str, bad: int) -> None:
    """Tables stepped earlier in the same backward (autograd's order) keep their update; the table
    whose gradient is not finite, and any after it, keep their rows."""
    names = ["a", "b"]
    store = make_store(tmp_path / "s", [("a", ROWS, DIM), ("b", ROWS, DIM)],
                       RESIDENT if tiers == "resident" else oversized_tiers(optimizer))
    ebc = TieredEmbeddingBagCollection(store, names, optimizer=optimizer, lr=0.1)
    ids, offs = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])], [torch.tensor([0, 1, 3]), torch.tensor([0, 0, 2])]
    every = np.arange(ROWS, dtype=np.int64)
    before = store[names[bad]].lookup(every)
    out = ebc(ids, offs)
    weights = torch.ones_like(out)
    weights[1, bad, 0] = float("inf")
    with pytest.raises(embstore.InvalidRowsError, match=f"table '{names[bad]}'.*NaN or inf"):
        (out * weights).sum().backward()
    ebc.flush()
    np.testing.assert_array_equal(store[names[bad]].lookup(every), before)
    ebc(ids, offs).sum().backward()  # training goes on
    ebc.flush()
    after = store[names[bad]].lookup(every)
    assert not np.array_equal(after, before) and np.isfinite(after).all()
    store.close()


def test_backward_after_next_forward_raises(tmp_path) -> None:
    store = make_store(tmp_path / "s", [("a", ROWS, DIM)], RESIDENT)
    ebc = TieredEmbeddingBagCollection(store, ["a"])
    ids, offs = [torch.tensor([1, 2])], [torch.tensor([0, 2])]
    first = ebc(ids, offs)
    ebc(ids, offs).sum().backward()
    with pytest.raises(RuntimeError, match="next forward"):
        first.sum().backward()
    store.close()


def test_ensure_state_dim_refuses_trained_table_with_other_optimizer(tmp_path) -> None:
    store = make_store(tmp_path / "s", [("a", ROWS, DIM)], RESIDENT)
    ebc = TieredEmbeddingBagCollection(store, ["a"], optimizer="sgd")
    ebc([torch.tensor([1])], [torch.tensor([0, 1])]).sum().backward()
    ebc.flush()
    with pytest.raises(embstore.TableExistsError):
        TieredEmbeddingBagCollection(store, ["a"], optimizer="adagrad")
    store.close()


def test_rejected_batch_leaves_nothing_pinned(tmp_path) -> None:
    store = make_store(tmp_path / "s", [("a", ROWS, DIM), ("b", ROWS, DIM)], RESIDENT)
    ebc = TieredEmbeddingBagCollection(store, ["a", "b"], lookahead=1)
    ok = torch.tensor([0, 2], dtype=torch.int64)
    with pytest.raises(embstore.IdOutOfRangeError):
        ebc.prefetch([ok, torch.tensor([1, ROWS])], [ok, ok])
    with pytest.raises(embstore.IdOutOfRangeError):
        ebc([ok, torch.tensor([1, -1])], [ok, ok])
    ebc([ok, ok], [ok, ok]).sum().backward()
    assert ebc.stats()["working_set_rows"] == {"a": 0, "b": 0} and ebc.steps == 1
    store.close()


@pytest.mark.parametrize("corrupt", [
    lambda e: e["optimizer"].update(lr=float("nan")),
    lambda e: e["optimizer"].update(adam_step="zz"),
    lambda e: e["optimizer"].update(beta1=1.5),
    lambda e: e["optimizer"].update(bogus=1),
    lambda e: e.update(pooling="max"),
    lambda e: e.update(lookahead=-3),
    lambda e: e.update(steps=-1),
    lambda e: e.pop("steps"),
], ids=["lr-nan", "adam-step", "beta1", "unknown-key", "pooling", "lookahead", "steps", "missing-key"])
def test_a_corrupt_checkpoint_state_is_refused_and_changes_nothing(tmp_path, corrupt) -> None:
    """load_state_dict checks a checkpoint's settings as the constructor checks its arguments: a NaN lr or a
    pooling mode the kernels do not know would otherwise train (or pool) silently wrong."""
    import copy

    store = make_store(tmp_path / "s", [("a", ROWS, DIM)], RESIDENT)
    ebc = TieredEmbeddingBagCollection(store, ["a"], optimizer="adam", lr=0.03)
    sd = copy.deepcopy(ebc.state_dict())
    corrupt(sd["_extra_state"])
    before = (ebc.optim, ebc.pooling, ebc.lookahead, ebc.steps)
    with pytest.raises(embstore.InvalidInputError):
        ebc.load_state_dict(sd)
    assert (ebc.optim, ebc.pooling, ebc.lookahead, ebc.steps) == before
    store.close()


def test_malformed_settings_and_batches_raise_typed_errors(tmp_path) -> None:
    store = make_store(tmp_path / "s", [("a", ROWS, DIM), ("b", ROWS, DIM)], RESIDENT)
    for kwargs in (dict(lookahead="2"), dict(lookahead=1.5), dict(betas=None)):
        with pytest.raises(embstore.InvalidInputError, match="lookahead|betas"):
            TieredEmbeddingBagCollection(store, ["a"], optimizer="adam", **kwargs)
    ebc = TieredEmbeddingBagCollection(store, ["a", "b"])
    with pytest.raises(embstore.InvalidInputError, match="lookahead"):
        next(ebc.pipeline([], lookahead="x"))
    with pytest.raises(embstore.InvalidInputError, match="sparse"):
        next(ebc.pipeline([1, 2], lookahead=1))  # a batch that is no (ids, offsets) pair
    one, ones = torch.tensor([1, 2]), torch.tensor([1, 1])
    for keys in ("ab", None, [0, 1]):  # a string would split into one-letter keys
        with pytest.raises(embstore.InvalidInputError, match="keys"):
            ebc(KeyedJaggedBatch(keys, one, ones))
    assert ebc.stats()["working_set_rows"] == {"a": 0, "b": 0}
    store.close()
