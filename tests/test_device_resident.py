"""Tables held whole in a device tier: lookups gather and pool on the device, training steps the rows in place.

A ``device`` tier is a torch tensor on the accelerator (``cuda`` when torch sees one, else host memory), so
every test here runs on whatever device the machine has: the CPU in CI, the GPU on a machine with one (see
BENCHMARKS.md for the GPU runs). References are numpy, ``torch.nn.functional.embedding_bag`` and torch's own
optimizers (``TorchReference``).
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import embstore
from embstore.errors import IdOutOfRangeError, InvalidInputError, InvalidOffsetsError
from embstore.training import TieredEmbeddingBagCollection, state_dim
from embstore.training.testing import (TorchReference, initial_weights, loss_of, make_store, random_batches,
                                       rel_err)
from embstore.training.trainer import TrainConfig, train
from embstore.training.working_set import ResidentWorkingSet, WorkingSet

ROWS, DIM = 400, 8
DEVICE_HOME = '[{ kind = "device", capacity = "1MiB" }, { kind = "ssd" }]'
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def filled(tmp_path, tiers: str = DEVICE_HOME, seed: int = 0):
    """A store whose table ``t`` has every row written (so resident on the device) and those rows."""
    store = make_store(tmp_path / "s", [("t", ROWS, DIM)], tiers)
    w = np.random.default_rng(seed).standard_normal((ROWS, DIM)).astype(np.float32)
    store["t"].update(np.arange(ROWS, dtype=np.int64), w)
    return store, w


def host(x) -> np.ndarray:
    return x.cpu().numpy() if isinstance(x, torch.Tensor) else x


def test_a_whole_table_device_tier_is_the_device_path(tmp_path) -> None:
    store, _ = filled(tmp_path)
    t = store["t"]
    assert t.device_tier() is not None and t.device_tier().device == DEVICE
    assert t.full_dram_tier() is None
    partial = make_store(tmp_path / "p", [("t", ROWS, DIM)], '[{ kind = "device", capacity = 320 }, { kind = "ssd" }]')
    assert partial["t"].device_tier() is None  # 10 rows of 400: a cache, not the table
    store.close()
    partial.close()


@pytest.fixture(params=["host count", "device count"])
def count_on(request, monkeypatch):
    """Ids are counted by the host's numba pass by default; "device count" makes ids already on the table's
    device take the on-device check and count (``COUNT_DEVICE_IDS_ON_DEVICE``), so CI runs that path too."""
    monkeypatch.setattr(embstore.table, "COUNT_DEVICE_IDS_ON_DEVICE", request.param == "device count")
    return request.param


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_device_lookups_equal_numpy_and_torch(tmp_path_factory, count_on, data) -> None:
    """Raw rows and pooled bags (sum, mean; empty bags, repeats) from the device slab equal numpy fancy
    indexing and torch's embedding_bag on the same rows, for ids given as numpy, host tensors or tensors
    already on the device; numpy in gives numpy out, torch in gives a tensor on the table's device."""
    store, w = filled(tmp_path_factory.mktemp("d"))
    t = store["t"]
    lens = data.draw(st.lists(st.integers(0, 6), min_size=1, max_size=12))
    ids = np.array(data.draw(st.lists(st.integers(0, ROWS - 1), min_size=sum(lens), max_size=sum(lens))), np.int64)
    offs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    mode = data.draw(st.sampled_from(["sum", "mean"]))
    kind = data.draw(st.sampled_from(["numpy", "host", "device"]))
    given_ids = {"numpy": ids, "host": torch.from_numpy(ids), "device": torch.from_numpy(ids).to(DEVICE)}[kind]
    given_offs = offs if kind == "numpy" else torch.from_numpy(offs)
    raw = t.lookup(given_ids)
    bags = t.lookup_pooled(given_ids, given_offs, mode)
    for out in (raw, bags):
        if kind == "numpy":
            assert isinstance(out, np.ndarray) and out.dtype == np.float32
        else:
            assert isinstance(out, torch.Tensor) and out.device.type == DEVICE and out.dtype == torch.float32
    np.testing.assert_array_equal(host(raw), w[ids])
    want = torch.nn.functional.embedding_bag(torch.from_numpy(ids), torch.from_numpy(w), torch.from_numpy(offs[:-1]),
                                             mode=mode).numpy()
    np.testing.assert_allclose(host(bags), want, rtol=1e-6, atol=1e-6)
    store.close()


def test_device_lookups_count_distinct_rows_as_device_hits(tmp_path, count_on) -> None:
    """Statistics as on every path: a hit per distinct row of a call, ``lookups`` per id."""
    store, _ = filled(tmp_path)
    t = store["t"]
    before = t.stats()["device"]["hits"]
    ids = torch.tensor([3, 3, 7, 399, 7, 0])
    t.lookup(ids.to(DEVICE))
    t.lookup(ids.numpy())
    t.lookup_pooled(ids.to(DEVICE), torch.tensor([0, 2, 6]))
    s = t.stats()["device"]
    assert s["hits"] - before == 3 * 4
    assert s["misses"] == 0 and s["resident_rows"] == ROWS  # written by update, never missed
    assert t.lookups == 18
    store.close()


@pytest.mark.parametrize("where", ["numpy", "device"])
def test_bad_ids_on_the_device_path_raise_and_count_nothing(tmp_path, where, count_on) -> None:
    store, w = filled(tmp_path)
    t = store["t"]
    before, lookups = t.stats(), t.lookups
    conv = (lambda a: a) if where == "numpy" else (lambda a: torch.from_numpy(a).to(DEVICE))  # noqa: E731
    with pytest.raises(IdOutOfRangeError, match="400"):
        t.lookup(conv(np.array([1, 400], np.int64)))
    with pytest.raises(IdOutOfRangeError, match="-1"):
        t.lookup_pooled(conv(np.array([-1, 2], np.int64)), np.array([0, 2], np.int64))
    with pytest.raises(InvalidInputError, match="int64"):
        t.lookup(conv(np.array([1, 2], np.int32)))
    with pytest.raises(InvalidOffsetsError):
        t.lookup_pooled(conv(np.array([1, 2], np.int64)), np.array([0, 3], np.int64))
    assert t.stats() == before and t.lookups == lookups
    np.testing.assert_array_equal(host(t.lookup(conv(np.array([399], np.int64)))), w[[399]])
    store.close()


def test_rows_not_yet_on_the_device_are_read_through_and_stay(tmp_path) -> None:
    """A device tier filled lazily: a lookup naming a row it lacks goes down to the home (a miss), and
    the next lookup of it is served on the device."""
    store = make_store(tmp_path / "s", [("t", ROWS, DIM)], DEVICE_HOME)
    t = store["t"]
    want = initial_weights(store, "t")
    ids = np.array([5, 9, 5], np.int64)
    np.testing.assert_array_equal(t.lookup(ids), want[ids])
    assert t.stats()["device"]["misses"] == 2
    out = t.lookup_pooled(torch.from_numpy(ids).to(DEVICE), torch.tensor([0, 1, 3]))
    np.testing.assert_allclose(host(out), [want[5], want[9] + want[5]], rtol=1e-6)
    assert t.stats()["device"]["hits"] == 2 and t.stats()["device"]["misses"] == 2
    store.close()


def test_updates_flush_and_reopen_through_a_device_tier(tmp_path) -> None:
    store, w = filled(tmp_path)
    w2 = w.copy()
    w2[[4, 8]] = 1.5
    store["t"].update(np.array([4, 8], np.int64), w2[[4, 8]])
    np.testing.assert_array_equal(host(store["t"].lookup(torch.arange(ROWS).to(DEVICE))), w2)
    store.close()
    with embstore.open(tmp_path / "s") as again:
        np.testing.assert_array_equal(again["t"].lookup(np.arange(ROWS, dtype=np.int64)), w2)


OPTIMIZERS = [("sgd", 0.1, "sum"), ("rowwise_adagrad", 0.1, "sum"), ("adagrad", 0.1, "mean"), ("adam", 0.01, "sum")]


@pytest.mark.parametrize("optimizer,lr,pooling", OPTIMIZERS)
@pytest.mark.parametrize("lookahead", [0, 2])
def test_training_in_place_on_the_device_equals_torch(tmp_path, optimizer, lr, pooling, lookahead) -> None:
    """Tables held whole in a device tier train in the tier's own slab (no working-set copy): outputs, the
    rows after flush and after reopening equal torch's (``nn.EmbeddingBag`` and its optimizer) over 20 steps;
    pooled lookups of the trained table (rows followed by optimizer state in the slab) still see the rows."""
    store = make_store(tmp_path / "s", [("a", ROWS, DIM), ("b", ROWS // 2, DIM)], DEVICE_HOME)
    ref = TorchReference([initial_weights(store, n) for n in ("a", "b")], optimizer, lr, pooling=pooling)
    ebc = TieredEmbeddingBagCollection(store, ["a", "b"], optimizer=optimizer, lr=lr, pooling=pooling,
                                       lookahead=lookahead)
    assert all(isinstance(ws, ResidentWorkingSet) and ws.device.type == DEVICE for ws in ebc.ws)
    assert ebc.device.type == DEVICE
    batches = random_batches(7, 20, [ROWS, ROWS // 2], batch=16, max_len=5, dim=DIM, zipf=1.2)
    for ids, offs, w in ebc.pipeline(batches, sparse=lambda b: b[:2]):
        out = ebc(ids, offs)
        assert out.device.type == DEVICE
        loss_of(out, w.to(DEVICE)).backward()
        assert rel_err(host(out.detach()), ref.step(ids, offs, w).numpy()) <= 1e-5
    assert ebc.counters["demand_misses"] == (sum(len(np.unique(np.concatenate([b[0][t].numpy() for b in batches])))
                                                 for t in range(2)) if lookahead == 0 else 0)
    ebc.flush()
    tol = 1e-4 if optimizer in ("adam", "adagrad") else 1e-5
    for name, want in zip(("a", "b"), ref.weights()):
        t = store[name]
        assert rel_err(t.read_physical(np.arange(t.num_rows, dtype=np.int64)), want) <= tol
        ids = np.arange(t.num_rows, dtype=np.int64)
        bags = t.lookup_pooled(torch.from_numpy(ids).to(DEVICE), torch.tensor([0, 3, t.num_rows]))
        assert rel_err(host(bags), np.stack([want[:3].sum(0), want[3:].sum(0)])) <= tol
    ebc.release()
    store.close()
    with embstore.open(tmp_path / "s") as again:
        for name, want in zip(("a", "b"), ref.weights()):
            t = again[name]
            assert rel_err(t.read_physical(np.arange(t.num_rows, dtype=np.int64)), want) <= tol


class _AcceleratorOnCpu(str):
    """A device torch reads as "cpu" whose ``type`` is not "cpu": the module then steps with torch operations
    on the slab's views, the path an accelerator takes (``tests/test_mutation_ebc.py`` does the same)."""

    type = "accelerator"


def on_fake_accelerator(ebc: TieredEmbeddingBagCollection) -> None:
    """Make the module see its resident tables as on an accelerator (CPU-only machines only)."""
    if DEVICE != "cpu":
        pytest.skip("the GPU runs this path for real in test_training_in_place_on_the_device_equals_torch")
    for ws in ebc.ws:
        assert isinstance(ws, ResidentWorkingSet)
        ws.device, ws.flat = _AcceleratorOnCpu("cpu"), None


def import_all(store, names, optimizer: str) -> None:
    """Write every row (initial values, zero state), so each whole-table device tier holds all of them."""
    for name in names:
        t = store[name]
        ids = np.arange(t.num_rows, dtype=np.int64)
        t.write_with_state(ids, initial_weights(store, name), np.zeros((t.num_rows, state_dim(optimizer, DIM)),
                                                                       np.float32))


@pytest.mark.parametrize("optimizer,lr,pooling", OPTIMIZERS)
@pytest.mark.parametrize("rows", ["loaded on first use", "all present"])
def test_the_accelerator_step_writes_through_the_slab_views(tmp_path, optimizer, lr, pooling, rows) -> None:
    """On an accelerator a resident table is stepped by indexed assignment into strided views of the device
    slab: through the general path while rows are still loaded on first use, and through the all-device path
    (dedup, gather, pool and step on the device) once every row is present. On a CPU-only machine both are
    forced here, so CI proves the writes land in the tier and match torch."""
    store = make_store(tmp_path / "s", [("a", ROWS, DIM), ("b", ROWS // 2, DIM)], DEVICE_HOME)
    ref = TorchReference([initial_weights(store, n) for n in ("a", "b")], optimizer, lr, pooling=pooling)
    ebc = TieredEmbeddingBagCollection(store, ["a", "b"], optimizer=optimizer, lr=lr, pooling=pooling, lookahead=1)
    on_fake_accelerator(ebc)
    if rows == "all present":
        import_all(store, ["a", "b"], optimizer)
    assert ebc._all_rows_on_accelerator() == (rows == "all present")
    for ids, offs, w in ebc.pipeline(random_batches(3, 12, [ROWS, ROWS // 2], batch=8, max_len=4, dim=DIM,
                                                    zipf=1.2), sparse=lambda b: b[:2]):
        assert (len(ebc._queue) == 0) == (rows == "all present")  # nothing to prefetch when all present
        out = ebc(ids, offs)
        loss_of(out, w).backward()
        assert rel_err(out.detach().numpy(), ref.step(ids, offs, w).numpy()) <= 1e-5
        with torch.no_grad():  # an eval forward: no step
            assert rel_err(ebc(ids, offs).numpy(), ref.pooled(ids, offs).numpy()) <= 1e-5
    assert ebc.steps == 12
    ebc.flush()
    tol = 1e-4 if optimizer in ("adam", "adagrad") else 1e-5
    for name, want in zip(("a", "b"), ref.weights()):
        t = store[name]
        assert rel_err(t.read_physical(np.arange(t.num_rows, dtype=np.int64)), want) <= tol
    store.close()


def test_the_all_device_step_refuses_bad_gradients_and_keeps_overflowing_rows(tmp_path) -> None:
    """As on every path: a NaN gradient raises before any row changes; a step that would overflow float32
    leaves those rows (and their state) as they were, updates the rest, then raises; the protocol (one
    backward per forward, before the next) holds."""
    store = make_store(tmp_path / "s", [("a", ROWS, DIM)], DEVICE_HOME)
    ebc = TieredEmbeddingBagCollection(store, ["a"], optimizer="sgd", lr=10.0)
    if DEVICE == "cpu":
        on_fake_accelerator(ebc)
    import_all(store, ["a"], "sgd")
    assert ebc._all_rows_on_accelerator()
    t = store["a"]
    before = t.read_physical(np.arange(ROWS, dtype=np.int64))
    ids, offs = [torch.tensor([1, 2, 2])], [torch.tensor([0, 1, 3])]
    out = ebc(ids, offs)
    with pytest.raises(embstore.InvalidRowsError, match="NaN or inf"):
        (out * torch.tensor(float("nan"))).sum().backward()
    np.testing.assert_array_equal(t.read_physical(np.arange(ROWS, dtype=np.int64)), before)
    out = ebc(ids, offs)
    with pytest.raises(embstore.InvalidRowsError, match="into 1 of its 2 rows"):
        (out * torch.tensor([[[3e38] * DIM], [[1.0] * DIM]], device=out.device)).sum().backward()
    after = t.read_physical(np.arange(ROWS, dtype=np.int64))
    np.testing.assert_array_equal(after[1], before[1])  # row - 10 * 3e38 overflows: kept
    np.testing.assert_allclose(after[2], before[2] - 20.0, rtol=1e-6)  # two uses of row 2, gradient 1 each
    loss = ebc(ids, offs).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="call backward once per forward"):
        loss.backward()
    ebc.release()
    store.close()


def test_a_host_table_beside_a_device_table_comes_out_on_the_device(tmp_path) -> None:
    """Tables of one module may live apart (a big one in DRAM over SSD, small ones in HBM): the module's
    output is on the accelerator, the host table's bags copied over; both train like torch."""
    store = make_store(tmp_path / "s", [("dev", ROWS, DIM)], DEVICE_HOME)
    store.create_table(embstore.TableConfig.from_dict({
        "name": "host", "num_embeddings": ROWS, "dim": DIM, "init": {"kind": "uniform", "scale": 0.1, "seed": 1},
        "tiers": [{"kind": "dram", "capacity": 40 * 4 * (DIM + state_dim("sgd", DIM)), "policy": "lru"},
                  {"kind": "ssd"}]}))
    ref = TorchReference([initial_weights(store, n) for n in ("dev", "host")], "sgd", 0.1)
    ebc = TieredEmbeddingBagCollection(store, ["dev", "host"], optimizer="sgd", lr=0.1, lookahead=1)
    assert isinstance(ebc.ws[1], WorkingSet) and ebc.ws[1].device.type == "cpu"
    assert ebc.device.type == DEVICE
    for ids, offs, w in ebc.pipeline(random_batches(5, 10, [ROWS, ROWS], batch=8, max_len=4, dim=DIM),
                                     sparse=lambda b: b[:2]):
        out = ebc(ids, offs)
        assert out.device.type == DEVICE
        loss_of(out, w.to(DEVICE)).backward()
        assert rel_err(host(out.detach()), ref.step(ids, offs, w).numpy()) <= 1e-5
    ebc.flush()
    for name, want in zip(("dev", "host"), ref.weights()):
        assert rel_err(store[name].read_physical(np.arange(ROWS, dtype=np.int64)), want) <= 1e-5
    ebc.release()
    store.close()


def test_embstore_train_runs_the_dense_model_where_the_tables_are(tmp_path) -> None:
    """``embstore train`` with device tiers: the dense layers move to the tables' device, the planted signal is
    learned (held-out AUC), and the trained model is saved for serving."""
    text = textwrap.dedent(f"""
        [data]
        kind = "synthetic"
        batch_size = 256
        train_batches = 80
        eval_batches = 8
        bag_max = 2
        [model]
        dense_arch = [16, 8]
        over_arch = [32, 1]
        sparse_optimizer = "rowwise_adagrad"
        [store]
        defaults = {{ dim = 8, init = {{ kind = "uniform", scale = 0.05 }}, tiers = {DEVICE_HOME} }}
        [[store.table]]
        name = "a"
        num_embeddings = 1000
        [[store.table]]
        name = "b"
        num_embeddings = 500
        [schedule]
        lookahead = 2
        dense_lr = 0.05
        sparse_lr = 0.1
        seed = 3
        """)
    (tmp_path / "cfg.toml").write_text(text)
    res = train(TrainConfig.from_toml(tmp_path / "cfg.toml"), tmp_path / "run", progress=False)
    assert res.evals[-1][1].auc > 0.7
    with embstore.open(tmp_path / "run" / "store") as store:
        assert store["a"].device_tier() is not None
        ids = np.arange(1000, dtype=np.int64)
        assert np.abs(store["a"].lookup(ids) - initial_weights(store, "a")).max() > 1e-3  # trained rows


def test_the_torch_rowwise_adagrad_reference_equals_fbgemm() -> None:
    """``TorchReference`` steps rowwise Adagrad in torch where fbgemm is not installed (the GPU machines'
    torch): on the CPU, where fbgemm is, both give the same rows."""
    import embstore.training.testing as testing

    if not testing._has_fbgemm():
        pytest.skip("fbgemm is not installed here; CI installs it and runs this comparison")
    w = np.random.default_rng(1).standard_normal((50, DIM)).astype(np.float32)
    fb = TorchReference([w], "rowwise_adagrad", 0.1)
    real = testing._has_fbgemm
    testing._has_fbgemm = lambda: False
    try:
        mine = TorchReference([w], "rowwise_adagrad", 0.1)
    finally:
        testing._has_fbgemm = real
    assert fb.tbe and not mine.tbe
    for ids, offs, g in random_batches(2, 10, [50], batch=6, max_len=4, dim=DIM, zipf=1.2):
        np.testing.assert_allclose(mine.step(ids, offs, g).numpy(), fb.step(ids, offs, g).numpy(), rtol=1e-5,
                                   atol=1e-6)
    assert rel_err(mine.weights()[0], fb.weights()[0]) <= 1e-5


def test_a_model_holding_the_module_moves_with_to() -> None:
    """``model.to(device)`` walks every submodule's ``_apply``: the module must not shadow that name (it did,
    with its optimizer step, so moving a DLRM to a GPU raised TypeError)."""
    from embstore.training.ebc import TieredEmbeddingBagCollection as Module

    assert Module._apply is torch.nn.Module._apply
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model.add_module("bags", Module.__new__(Module))
    torch.nn.Module.__init__(model.bags)
    model.to(DEVICE)
    assert model[0].weight.device.type == DEVICE


def test_strided_and_empty_tensor_ids_on_the_device_path(tmp_path) -> None:
    """Ids given as a strided view or an empty int32 tensor (accepted when empty, as everywhere) read the
    same rows as their numpy copies."""
    store, w = filled(tmp_path)
    t = store["t"]
    strided = torch.arange(0, 2 * ROWS, 2).remainder(ROWS).to(DEVICE)[::3]
    assert not strided.is_contiguous() or strided.numel() < 2
    np.testing.assert_array_equal(host(t.lookup(strided)), w[strided.cpu().numpy()])
    offs = torch.tensor([0, 2, strided.numel()])
    want = torch.nn.functional.embedding_bag(strided.cpu(), torch.from_numpy(w), offs[:-1], mode="sum").numpy()
    np.testing.assert_allclose(host(t.lookup_pooled(strided, offs)), want, rtol=1e-6, atol=1e-6)
    empty = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    assert host(t.lookup(empty)).shape == (0, DIM)
    assert host(t.lookup_pooled(empty, torch.tensor([0, 0]))).shape == (1, DIM)
    store.close()


def test_a_device_tier_can_name_its_device(tmp_path) -> None:
    """``device = "cpu"`` keeps a device tier in host memory even beside a GPU, the setting survives a
    reopen, and a GPU that is not there is a ConfigError naming the key (never a quiet move to the CPU)."""
    store = make_store(tmp_path / "s", [("t", ROWS, DIM)],
                       '[{ kind = "device", capacity = "1MiB", device = "cpu" }, { kind = "ssd" }]')
    assert store["t"].device_tier().device == "cpu" and store["t"].device_tier().slab.device.type == "cpu"
    store.close()
    with embstore.open(tmp_path / "s") as again:
        assert again["t"].config.tiers[0].device == "cpu"
        assert again["t"].device_tier().device == "cpu"
    with pytest.raises(embstore.ConfigError, match="tiers.device.*'cuda:999' asked for"):
        make_store(tmp_path / "g", [("t", ROWS, DIM)],
                   '[{ kind = "device", capacity = "1MiB", device = "cuda:999" }, { kind = "ssd" }]')
    for bad, why in (('"gpu"', "is not 'auto'"), ("0", "is not 'auto'")):
        with pytest.raises(embstore.ConfigError, match=why):
            make_store(tmp_path / "b", [("t", ROWS, DIM)], f'[{{ kind = "device", capacity = "1MiB", device = {bad} }}, '
                                                           '{ kind = "ssd" }]')
    with pytest.raises(embstore.ConfigError, match="only a device tier has a device"):
        make_store(tmp_path / "d", [("t", ROWS, DIM)], '[{ kind = "dram", capacity = "1MiB", device = "cpu" }, '
                                                       '{ kind = "ssd" }]')
