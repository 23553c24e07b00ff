"""Audit of ``POST /v1/models/{name}/predict`` under a real uvicorn (complements test_predict.py).

The reference here is independent of the served model's embedding-bag collection: the rows are read
through the *served* table's ``/lookup`` (so rows written by ``PUT`` are included), pooled with numpy
(sum, as ``embstore train`` trains), and fed to the dense layers of the model read from a copy of the
store. Table ``b`` has a full-table DRAM top tier (the resident working set) and ``a``/``c`` a bounded
one, so both read paths of the collection are scored.
"""

from __future__ import annotations

import json
import shutil

import httpx
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import embstore
from embstore.client import LookupClient, ServerError
from embstore.server import ServerSettings, create_app
from embstore.server.testing import ServerThread
from embstore.training.registry import load_model, predict
from embstore.training.trainer import TrainConfig, train
from test_trainer import config_text

TOKEN = "audit-token"
MAX_IDS = 200
TABLES = ("a", "b", "c")
ROWS = {"a": 1000, "b": 500, "c": 300}  # c is mod-hashed
NUM_DENSE = 13
DIM = 8
URL = "/v1/models/dlrm/predict"


def _config(tmp) -> TrainConfig:
    text = config_text(batches=4).replace(
        'name = "b"\nnum_embeddings = 500',
        'name = "b"\nnum_embeddings = 500\n'
        'tiers = [{ kind = "dram", capacity = "1MiB" }, { kind = "mmap" }]')
    assert "1MiB" in text
    (tmp / "cfg.toml").write_text(text)
    return TrainConfig.from_toml(tmp / "cfg.toml")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """(http client, LookupClient, reference model on a copy, a closed copy of the store) of one tiny trained DLRM."""
    tmp = tmp_path_factory.mktemp("predict_audit")
    train(_config(tmp), tmp / "run", progress=False)
    path = tmp / "run" / "store"
    shutil.copytree(path, tmp / "ref")
    shutil.copytree(path, tmp / "pristine")  # closed, for the damaged-model servers
    ref_store = embstore.open(tmp / "ref")
    assert ref_store["b"].full_dram_tier() is not None and ref_store["a"].full_dram_tier() is None
    model = load_model(ref_store, "dlrm")
    srv = ServerThread(create_app(ServerSettings(store=path, token=TOKEN, max_ids=MAX_IDS))).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http, LookupClient(srv.url, token=TOKEN) as client:
            yield http, client, model, tmp / "pristine"
    finally:
        srv.stop()
        model.sparse_arch.ebc.release()
        ref_store.close()


def independent(client: LookupClient, model, dense, sparse) -> np.ndarray:
    """sigmoid(forward) with the bags summed in numpy from the served table's rows."""
    n = len(dense)
    e = np.zeros((n, len(TABLES), DIM), np.float32)
    for t_i, t in enumerate(TABLES):
        flat = [i for bag in sparse[t] for i in bag]
        rows = client.lookup(t, np.array(flat, np.int64)) if flat else np.zeros((0, DIM), np.float32)
        k = 0
        for s, bag in enumerate(sparse[t]):
            e[s, t_i] = rows[k:k + len(bag)].sum(axis=0, dtype=np.float32) if bag else 0
            k += len(bag)
    x = np.asarray(dense, np.float64)
    if model.spec.dense_transform == "log1p":  # a trained model takes raw features: log(1 + max(x, 0)), as training
        x = np.log1p(np.maximum(x, 0.0))
    with torch.no_grad():
        d = model.dense_arch(torch.from_numpy(x.astype(np.float32)))
        return torch.sigmoid(model.over_arch(model.inter_arch(d, torch.from_numpy(e)))).numpy()


def registry_reference(model, dense, sparse) -> np.ndarray:
    ids, offs = [], []
    for t in TABLES:
        ids.append(torch.tensor([i for b in sparse[t] for i in b], dtype=torch.int64))
        offs.append(torch.from_numpy(np.concatenate([[0], np.cumsum([len(b) for b in sparse[t]])]).astype(np.int64)))
    return predict(model, torch.from_numpy(np.asarray(dense, np.float32)), ids, offs).numpy()


def post(http, payload, **kw):
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return http.post(URL, content=content, headers={"Content-Type": "application/json"}, **kw)


def ok_body(n: int = 2) -> dict:
    return {"dense": [[0.25] * NUM_DENSE for _ in range(n)],
            "sparse": {"a": [[1, 2]] * n, "b": [[3]] * n, "c": [[4]] * n}}


# --- scores ----------------------------------------------------------------------------------------
def bag_strategy(t: str):
    ids = st.integers(0, ROWS[t] - 1) if t != "c" else st.one_of(st.integers(0, 299),
                                                                 st.integers(-(2**63), 2**63 - 1))
    small = st.sampled_from([0, 1, 7]) if t != "c" else st.sampled_from([0, 5, 300, 301, -1])
    return st.lists(st.one_of(ids, small), max_size=5)  # small: repeated ids, c: beyond its 300 rows


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_http_scores_equal_the_models_sigmoid_forward(env, data):
    http, client, model, _ = env
    n = data.draw(st.sampled_from([1, 1, 2, 5, 17, 40]))
    dense = np.array(data.draw(st.lists(st.lists(st.floats(-4, 4, width=32), min_size=NUM_DENSE,
                                                 max_size=NUM_DENSE), min_size=n, max_size=n)), np.float32)
    sparse = {t: data.draw(st.lists(bag_strategy(t), min_size=n, max_size=n)) for t in TABLES}
    if sum(len(b) for bags in sparse.values() for b in bags) > MAX_IDS:
        return
    got = client.predict("dlrm", dense, sparse)
    raw = post(http, {"dense": dense.astype(np.float64).tolist(), "sparse": sparse})
    assert raw.status_code == 200, raw.text
    scores = np.array(raw.json()["scores"])
    assert got.shape == (n,) and scores.shape == (n,)
    assert np.isfinite(got).all() and ((got >= 0) & (got <= 1)).all()
    np.testing.assert_array_equal(scores.astype(np.float32), got)
    np.testing.assert_allclose(got, registry_reference(model, dense, sparse), rtol=0, atol=2e-6)
    np.testing.assert_allclose(got, independent(client, model, dense, sparse), rtol=0, atol=2e-6)


def test_pooling_is_the_trained_sum_not_the_mean(env):
    """A bag of one id repeated k times pools to k * row under sum (what the trainer uses), row under mean."""
    _, client, model, _ = env
    dense = np.zeros((2, NUM_DENSE), np.float32)
    sparse = {"a": [[5], [5, 5, 5]], "b": [[9], [9, 9, 9]], "c": [[2], [2, 302, -298 + 600]]}
    got = client.predict("dlrm", dense, sparse)
    assert got[0] != got[1]
    np.testing.assert_allclose(got, independent(client, model, dense, sparse), atol=2e-6)


@pytest.mark.parametrize("table", ["a", "b"])
def test_rows_written_by_put_are_what_the_next_score_reads(env, table):
    """Both the bounded and the full-DRAM (resident) working sets see each PUT, the second included."""
    http, client, model, _ = env
    dense = np.full((3, NUM_DENSE), 0.5, np.float32)
    sparse = {"a": [[11], [12, 13], []], "b": [[21], [], [22, 21]], "c": [[31], [32], [33]]}
    target = np.array([11, 12, 13] if table == "a" else [21, 22], np.int64)
    before = client.predict("dlrm", dense, sparse)
    for value in (0.75, -0.5):
        client.update(table, target, np.full((len(target), DIM), value, np.float32))
        got = client.predict("dlrm", dense, sparse)
        assert not np.allclose(got, before, atol=1e-5)
        np.testing.assert_array_equal(client.lookup(table, target), np.full((len(target), DIM), value, np.float32))
        np.testing.assert_allclose(got, independent(client, model, dense, sparse), atol=2e-6)
        before = got


# --- errors ----------------------------------------------------------------------------------------
def _set(b, key, value):
    return {**b, key: value}


def _sparse(b, t, value):
    return {**b, "sparse": {**b["sparse"], t: value}}


BAD = [
    ("sparse feature missing", lambda b: _set(b, "sparse", {"a": b["sparse"]["a"], "c": b["sparse"]["c"]}),
     400, "missing table(s) 'b'"),
    ("extra sparse feature", lambda b: _sparse(b, "d", b["sparse"]["a"]), 400, "'d' not used by this model"),
    ("dense too wide", lambda b: _set(b, "dense", [r + [0.0] for r in b["dense"]]), 422,
     "dense rows must have 13 values"),
    ("ragged dense", lambda b: _set(b, "dense", [b["dense"][0], b["dense"][1][:4]]), 422, "row 1 has 4"),
    ("dense rows not lists", lambda b: _set(b, "dense", [0.5] * 2), 400, "dense.0"),
    ("null dense value", lambda b: _set(b, "dense", [[None] * NUM_DENSE, b["dense"][1]]), 400, "dense.0.0"),
    ("negative id, unhashed a", lambda b: _sparse(b, "a", [[-5], [1]]), 400, "id -5 outside [0, 1000)"),
    ("negative id, unhashed b", lambda b: _sparse(b, "b", [[3], [-1]]), 400, "id -1 outside [0, 500)"),
    ("id beyond unhashed b", lambda b: _sparse(b, "b", [[500], [1]]), 400, "id 500 outside [0, 500)"),
    ("more bag lists than samples", lambda b: _sparse(b, "c", [[1], [2], [3]]), 400,
     "sparse['c'] holds 3 bag lists but dense holds 2 samples"),
    ("bag lists but no samples", lambda b: _set(b, "dense", []), 400, "holds 2 bag lists but dense holds 0"),
    ("empty batch, no tables", lambda b: {"dense": [], "sparse": {}}, 400, "missing table(s) 'a', 'b', 'c'"),
    ("too many ids", lambda b: _sparse(b, "a", [[1] * MAX_IDS, [2]]), 413, f"at most {MAX_IDS}"),
    ("sparse null", lambda b: _set(b, "sparse", None), 400, "sparse"),
    ("body is a list", lambda b: [b], 400, "malformed body"),
]


@pytest.mark.parametrize("what,mutate,status,words", BAD, ids=[w[0] for w in BAD])
def test_bad_requests_get_the_documented_4xx_and_the_server_stays_healthy(env, what, mutate, status, words):
    http, client, model, _ = env
    resp = post(http, mutate(ok_body()))
    assert resp.status_code == status, resp.text
    assert words in resp.json()["detail"], resp.text
    assert http.get("/healthz").json() == {"status": "ok"}
    good = ok_body()
    ok = post(http, good)
    assert ok.status_code == 200, ok.text
    np.testing.assert_allclose(ok.json()["scores"], independent(client, model, good["dense"], good["sparse"]),
                               atol=2e-6)


def test_nan_dense_is_422_naming_the_row(env):
    http, _, _, _ = env
    b = ok_body()
    b["dense"][1][7] = 0.125
    text = json.dumps(b).replace("0.125", "NaN")
    resp = post(http, text.encode())
    assert resp.status_code == 422 and "row 1 holds NaN" in resp.json()["detail"], resp.text


def test_an_empty_batch_scores_nothing(env):
    http, client, _, _ = env
    resp = post(http, {"dense": [], "sparse": {t: [] for t in TABLES}})
    assert resp.status_code == 200 and resp.json() == {"scores": []}
    assert client.predict("dlrm", np.zeros((0, NUM_DENSE)), {t: [] for t in TABLES}).shape == (0,)


def test_a_refused_id_leaves_the_collection_usable(env):
    """A batch refused half way (a bad id in the last table) must not leave rows reserved or a batch pending."""
    http, client, model, _ = env
    for _ in range(3):
        b = _sparse(ok_body(), "b", [[3], [10**6]])
        assert post(http, b).status_code == 400
    good = ok_body(3)
    got = client.predict("dlrm", np.array(good["dense"]), good["sparse"])
    np.testing.assert_allclose(got, independent(client, model, good["dense"], good["sparse"]), atol=2e-6)


# --- damaged model directories ------------------------------------------------------------------------
def _damage(folder, how: str) -> None:
    dense, spec = folder / "dense.pt", folder / "model.json"
    if how == "truncated dense.pt":
        dense.write_bytes(dense.read_bytes()[: dense.stat().st_size // 2])
    elif how == "missing dense.pt":
        dense.unlink()
    elif how == "truncated model.json":
        spec.write_bytes(spec.read_bytes()[:20])
    elif how == "empty model.json":
        spec.write_bytes(b"")
    elif how == "dense.pt of another shape":
        data = json.loads(spec.read_text())
        data["over_arch"] = [16, 1]
        spec.write_text(json.dumps(data))
    elif how == "flipped byte in dense.pt":
        raw = bytearray(dense.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        dense.write_bytes(bytes(raw))
    else:
        raise AssertionError(how)


DAMAGE = ["truncated dense.pt", "missing dense.pt", "truncated model.json", "empty model.json",
          "dense.pt of another shape", "flipped byte in dense.pt"]


def test_damaged_model_directories_are_refused_at_start_and_on_reload(env, tmp_path):
    """Copies of the trained model, each damaged another way, are 503 naming the file at start-up; damage made
    while serving is refused the same way by the next reload, and the good model keeps scoring."""
    path = tmp_path / "store"
    shutil.copytree(env[3], path)
    names = [f"m{i}" for i in range(len(DAMAGE))]
    for name, how in zip(names[:3], DAMAGE[:3]):
        shutil.copytree(path / "models" / "dlrm", path / "models" / name)
        _damage(path / "models" / name, how)
    body = ok_body()
    with ServerThread(create_app(ServerSettings(store=path, token=TOKEN))) as srv, \
            LookupClient(srv.url, token=TOKEN) as client:
        assert [m["name"] for m in client.models()] == ["dlrm"]
        good = client.predict("dlrm", np.array(body["dense"]), body["sparse"])
        for name, how in zip(names[3:], DAMAGE[3:]):
            shutil.copytree(path / "models" / "dlrm", path / "models" / name)
            _damage(path / "models" / name, how)
        assert client.reload()["models"] == ["dlrm"]
        for name, how in zip(names, DAMAGE):
            with pytest.raises(ServerError) as err:
                client.predict(name, np.array(body["dense"]), body["sparse"])
            file = "model.json" if "model.json" in how or "another shape" in how else "dense.pt"
            assert err.value.status_code == 503, (how, err.value.message)
            assert "could not be loaded" in err.value.message and file in err.value.message, (how, err.value.message)
        np.testing.assert_array_equal(client.predict("dlrm", np.array(body["dense"]), body["sparse"]), good)


# --- a model whose bags come out on an accelerator ----------------------------------------------------
def test_a_loaded_model_runs_its_dense_layers_where_its_bags_come_out(env, tmp_path, monkeypatch):
    """A table with a device tier on a GPU pools its bags there (``TieredEmbeddingBagCollection.device``);
    the trainer moves the DLRM there (``build_model``), and so must ``load_model``: dense layers left on the
    CPU meet cuda bags in the interaction and every served score is a 500. Stood in for here, on a machine
    without a GPU, by a collection that reports the ``meta`` device."""
    import embstore.training.registry as registry

    class OnAnotherDevice(registry.TieredEmbeddingBagCollection):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            self.device = torch.device("meta")

    monkeypatch.setattr(registry, "TieredEmbeddingBagCollection", OnAnotherDevice)
    shutil.copytree(env[3], tmp_path / "store")
    with embstore.open(tmp_path / "store") as store:
        model = registry.load_model(store, "dlrm")
        try:
            devices = {p.device.type for name, p in model.named_parameters()}
            assert devices == {"meta"}, devices
        finally:
            model.sparse_arch.ebc.release()


def test_a_store_trained_in_a_device_tier_is_served(tmp_path):
    """Every table in a device tier (cuda on a GPU machine, host memory without one): served scores equal
    the model's own, read from a copy of the store."""
    text = config_text(batches=4).replace(
        'tiers = [{ kind = "dram", capacity = "8KiB", policy = "lru" }, { kind = "mmap" }]',
        'tiers = [{ kind = "device", capacity = "1MiB" }, { kind = "mmap" }]')
    assert '"device"' in text
    (tmp_path / "cfg.toml").write_text(text)
    train(TrainConfig.from_toml(tmp_path / "cfg.toml"), tmp_path / "run", progress=False)
    path = tmp_path / "run" / "store"
    shutil.copytree(path, tmp_path / "ref")
    body = ok_body(3)
    with embstore.open(tmp_path / "ref") as ref:
        model = load_model(ref, "dlrm")
        want = registry_reference(model, body["dense"], body["sparse"])
        model.sparse_arch.ebc.release()
    with ServerThread(create_app(ServerSettings(store=path))) as srv, LookupClient(srv.url) as client:
        got = client.predict("dlrm", np.array(body["dense"]), body["sparse"])
    np.testing.assert_allclose(got, want, atol=2e-6)
