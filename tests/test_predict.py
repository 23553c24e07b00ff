"""`POST /v1/models/{name}/predict` and `LookupClient.predict` under a real uvicorn.

The reference is ``training.registry.predict`` run in this process on a *copy*
of the served store (a store directory is open in one place at a time; the
copy holds the same rows, and scoring writes nothing), so every served score
is checked against the model read directly from disk.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading

import httpx
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import embstore
from embstore.client import LookupClient, ServerError, bags
from embstore.server import ServerSettings, create_app
from embstore.server.testing import ServerThread
from embstore.training.registry import list_models, load_model, predict
from embstore.training.trainer import Batches, train
from test_trainer import load

TOKEN = "predict-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_IDS = 3000
TABLES = ("a", "b", "c")  # test_trainer's config: a (1000 rows), b (500), c (300 rows, mod-hashed)
NUM_DENSE = 13


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(store path served, reference store open on a copy, reference model, config) of a tiny trained DLRM."""
    tmp = tmp_path_factory.mktemp("predict")
    cfg = load(tmp, batches=20)
    train(cfg, tmp / "run", progress=False)
    path = tmp / "run" / "store"
    shutil.copytree(path, tmp / "ref_store")
    ref_store = embstore.open(tmp / "ref_store")
    model = load_model(ref_store, "dlrm")
    yield path, ref_store, model, cfg
    model.sparse_arch.ebc.release()
    ref_store.close()


@pytest.fixture(scope="module")
def server(trained):
    path = trained[0]
    srv = ServerThread(create_app(ServerSettings(store=path, token=TOKEN, max_ids=MAX_IDS))).start()
    with httpx.Client(base_url=srv.url, timeout=60) as http, LookupClient(srv.url, token=TOKEN) as client:
        yield http, client
    srv.stop()


def reference(model, dense: np.ndarray, sparse: dict[str, list[list[int]]]) -> np.ndarray:
    ids, offsets = [], []
    for t in TABLES:
        lens = [len(b) for b in sparse[t]]
        ids.append(torch.tensor([i for b in sparse[t] for i in b], dtype=torch.int64))
        offsets.append(torch.from_numpy(np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)))
    return predict(model, torch.from_numpy(np.asarray(dense, np.float32)), ids, offsets).numpy()


def holdout_request(cfg, index: int = 0, n: int | None = None) -> tuple[np.ndarray, dict[str, list[list[int]]]]:
    batch = list(Batches(cfg, 1).holdout())[index]
    n = n or batch.size
    sparse = {t: bags(i.numpy(), o.numpy())[:n] for t, i, o in zip(TABLES, batch.ids, batch.offsets)}
    return batch.dense.numpy()[:n], sparse


def body(dense, sparse) -> dict:
    return {"dense": np.asarray(dense, np.float64).tolist(), "sparse": sparse}


# --- scores --------------------------------------------------------------------------------------
def test_models_are_listed(server, trained):
    http, client = server
    assert client.models() == [{"name": "dlrm", "tables": list(TABLES), "embedding_dim": 8,
                                "dense_in_features": NUM_DENSE, "interaction": "dot"}]
    assert list_models(trained[0]) == ["dlrm"]


def test_scores_equal_the_model_read_directly(server, trained):
    http, client = server
    _, _, model, cfg = trained
    for index in (0, 3):
        dense, sparse = holdout_request(cfg, index)
        want = reference(model, dense, sparse)
        got = client.predict("dlrm", dense, sparse)
        assert got.dtype == np.float32 and got.shape == (len(dense),)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
        raw = http.post("/v1/models/dlrm/predict", json=body(dense, sparse))
        assert raw.status_code == 200, raw.text
        np.testing.assert_allclose(np.array(raw.json()["scores"]), want, rtol=0, atol=1e-6)
        assert ((got > 0) & (got < 1)).all()


def test_empty_bags_hashed_ids_and_an_empty_batch(server, trained):
    _, client = server
    model = trained[2]
    dense = np.random.default_rng(1).standard_normal((3, NUM_DENSE)).astype(np.float32)
    sparse = {"a": [[], [3, 3, 999], [0]], "b": [[1], [], [499, 2]],
              "c": [[-(2**63), 2**63 - 1], [123_456_789], []]}  # c is mod-hashed: any int64 is a valid id
    np.testing.assert_allclose(client.predict("dlrm", dense, sparse), reference(model, dense, sparse), atol=1e-6)
    empty = client.predict("dlrm", np.zeros((0, NUM_DENSE)), {t: [] for t in TABLES})
    assert empty.shape == (0,)


def test_concurrent_requests_each_get_their_own_scores(server, trained):
    """The per-model lock: eight threads scoring different batches at once get exactly their batch's scores."""
    _, client = server
    _, _, model, cfg = trained
    requests = [holdout_request(cfg, i % 4, 64 + 8 * i) for i in range(8)]
    wants = [reference(model, d, s) for d, s in requests]
    got: dict[int, np.ndarray] = {}

    def worker(i: int) -> None:
        for _ in range(3):
            got[i] = client.predict("dlrm", *requests[i])
            np.testing.assert_allclose(got[i], wants[i], atol=1e-6)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(8))
    for i in range(8):
        np.testing.assert_allclose(got[i], wants[i], atol=1e-6)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_random_valid_requests_match_the_reference(server, trained, data):
    _, client = server
    model = trained[2]
    n = data.draw(st.integers(1, 12))
    dense = np.array(data.draw(st.lists(st.lists(st.floats(-5, 5, width=32), min_size=NUM_DENSE,
                                                 max_size=NUM_DENSE), min_size=n, max_size=n)), np.float32)
    rows = {"a": 1000, "b": 500, "c": 2**40}
    sparse = {t: data.draw(st.lists(st.lists(st.integers(0, rows[t] - 1), max_size=4), min_size=n, max_size=n))
              for t in TABLES}
    np.testing.assert_allclose(client.predict("dlrm", dense, sparse), reference(model, dense, sparse), atol=1e-6)


# --- errors --------------------------------------------------------------------------------------
def _ok_body(cfg, n: int = 4) -> dict:
    return body(*holdout_request(cfg, 0, n))


ERRORS = [
    # (what, mutate(body) -> body or raw bytes, status, words in the message)
    ("not json", lambda b: b"{not json", 400, "malformed body"),
    ("dense missing", lambda b: {"sparse": b["sparse"]}, 400, "dense"),
    ("extra key", lambda b: {**b, "labels": [1]}, 400, "labels"),
    ("table missing", lambda b: {**b, "sparse": {"a": b["sparse"]["a"], "b": b["sparse"]["b"]}}, 400,
     "missing table(s) 'c'"),
    ("unknown table", lambda b: {**b, "sparse": {**b["sparse"], "zz": b["sparse"]["a"]}}, 400,
     "'zz' not used by this model"),
    ("fewer bag lists", lambda b: {**b, "sparse": {**b["sparse"], "b": b["sparse"]["b"][:-1]}}, 400,
     "sparse['b'] holds 3 bag lists but dense holds 4 samples"),
    ("float id", lambda b: {**b, "sparse": {**b["sparse"], "a": [[1.5]] + b["sparse"]["a"][1:]}}, 400,
     "sparse.a.0.0"),
    ("string id", lambda b: {**b, "sparse": {**b["sparse"], "a": [["7"]] + b["sparse"]["a"][1:]}}, 400,
     "sparse.a.0.0"),
    ("bool id", lambda b: {**b, "sparse": {**b["sparse"], "a": [[True]] + b["sparse"]["a"][1:]}}, 400,
     "sparse.a.0.0"),
    ("id beyond int64", lambda b: {**b, "sparse": {**b["sparse"], "a": [[2**63]] + b["sparse"]["a"][1:]}}, 400,
     "sparse.a.0.0"),
    ("id out of the table", lambda b: {**b, "sparse": {**b["sparse"], "a": [[1000]] + b["sparse"]["a"][1:]}},
     400, "id 1000 outside [0, 1000)"),
    ("negative id", lambda b: {**b, "sparse": {**b["sparse"], "b": [[-1]] + b["sparse"]["b"][1:]}},
     400, "id -1 outside [0, 500)"),
    ("bag not a list", lambda b: {**b, "sparse": {**b["sparse"], "a": [3] + b["sparse"]["a"][1:]}}, 400,
     "sparse.a.0"),
    ("dense too narrow", lambda b: {**b, "dense": [r[:5] for r in b["dense"]]}, 422,
     "dense rows must have 13 values"),
    ("jagged dense", lambda b: {**b, "dense": b["dense"][:3] + [b["dense"][3] + [0.0]]}, 422,
     "row 3 has 14"),
    ("dense beyond float32", lambda b: {**b, "dense": [[1e39] * NUM_DENSE] + b["dense"][1:]}, 422,
     "must be finite"),
    ("dense string", lambda b: {**b, "dense": [["1"] * NUM_DENSE] + b["dense"][1:]}, 400, "dense.0.0"),
]


@pytest.mark.parametrize("what,mutate,status,words", ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_requests_get_a_precise_4xx(server, trained, what, mutate, status, words):
    http, _ = server
    b = mutate(_ok_body(trained[3]))
    content = b if isinstance(b, bytes) else json.dumps(b).encode()
    resp = http.post("/v1/models/dlrm/predict", content=content, headers={"Content-Type": "application/json"})
    assert resp.status_code == status, resp.text
    assert words in resp.json()["detail"]


def test_nan_and_infinity_literals_are_422(server, trained):
    http, _ = server
    b = _ok_body(trained[3])
    for literal in ("NaN", "Infinity", "-Infinity"):
        text = json.dumps(b).replace(str(b["dense"][1][2]), literal, 1)
        resp = http.post("/v1/models/dlrm/predict", content=text, headers={"Content-Type": "application/json"})
        assert resp.status_code == 422, resp.text  # the JSON parser reads them; the finite check refuses them
        assert "row 1 holds NaN" in resp.json()["detail"]


def test_dense_features_that_overflow_the_model_are_422_not_invalid_json(server, trained, tmp_path):
    """Finite but huge dense values (3e38) fed to the bottom MLP as they are overflow it to NaN scores; JSON
    cannot carry NaN, so the answer is a 422 naming the cause, parsed here by a strict parser. A trained
    model takes log(1 + x) of them (89 at most), so the model here is one that takes features as sent
    (a model.json without dense_transform)."""
    shutil.copytree(trained[0], tmp_path / "s")
    spec_file = tmp_path / "s" / "models" / "dlrm" / "model.json"
    spec_file.write_text(json.dumps({**json.loads(spec_file.read_text()), "dense_transform": "none"}))
    b = _ok_body(trained[3])
    b["dense"] = [[3e38] * len(row) for row in b["dense"]]
    assert server[0].post("/v1/models/dlrm/predict", json=b).status_code == 200  # log1p: finite scores
    srv = ServerThread(create_app(ServerSettings(store=tmp_path / "s", token=TOKEN, max_ids=MAX_IDS))).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            resp = http.post("/v1/models/dlrm/predict", json=b)
    finally:
        srv.stop()
    assert resp.status_code == 422, resp.text
    detail = json.loads(resp.text, parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))["detail"]
    assert "not finite" in detail and "dense features" in detail


def test_unknown_model_404_lists_the_known_ones(server, trained):
    _, client = server
    with pytest.raises(ServerError) as err:
        client.predict("nope", *holdout_request(trained[3], 0, 2))
    assert err.value.status_code == 404 and "no model 'nope'; known models: dlrm" in err.value.message


def test_more_ids_than_the_limit_is_413(server, trained):
    _, client = server
    n = MAX_IDS // 3 + 1
    sparse = {t: [[0]] * n for t in TABLES}
    with pytest.raises(ServerError) as err:
        client.predict("dlrm", np.zeros((n, NUM_DENSE)), sparse)
    assert err.value.status_code == 413 and f"at most {MAX_IDS}" in err.value.message


def test_more_samples_than_the_limit_is_413(server, trained):
    """Samples with empty bags carry no ids, yet each costs a forward pass and a score: held to the limit."""
    http, client = server
    n = MAX_IDS + 1
    with pytest.raises(ServerError) as err:
        client.predict("dlrm", np.zeros((n, NUM_DENSE)), {t: [[]] * n for t in TABLES})
    assert err.value.status_code == 413 and f"{n} samples" in err.value.message
    scores = client.predict("dlrm", np.zeros((MAX_IDS, NUM_DENSE)), {t: [[]] * MAX_IDS for t in TABLES})
    assert scores.shape == (MAX_IDS,) and np.isfinite(scores).all()


def test_client_checks_its_own_arguments(server):
    _, client = server
    with pytest.raises(embstore.InvalidInputError, match="dense must be 2-D"):
        client.predict("dlrm", np.zeros(NUM_DENSE), {t: [[1]] for t in TABLES})
    with pytest.raises(embstore.InvalidInputError, match=r"sparse\['a'\]\[0\] must be a list of integer ids"):
        client.predict("dlrm", np.zeros((1, NUM_DENSE)), {"a": [[1.5]], "b": [[1]], "c": [[1]]})
    assert bags([7, 3, 3, 9, 1], [0, 3, 3, 5]) == [[7, 3, 3], [], [9, 1]]
    with pytest.raises(embstore.InvalidInputError, match="offsets must rise"):
        bags([1, 2], [0, 3])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_predict_bodies_never_get_a_5xx(server, data):
    http, _ = server
    scalar = st.one_of(st.integers(-(2**64), 2**64), st.floats(allow_nan=False), st.text(max_size=3),
                       st.booleans(), st.none())
    ids = st.lists(st.one_of(st.integers(-2, 1200), scalar), max_size=4)
    n = data.draw(st.integers(0, 5))
    dense = st.lists(st.lists(st.one_of(st.floats(-1e40, 1e40, allow_nan=False), scalar),
                              min_size=NUM_DENSE - 1, max_size=NUM_DENSE + 1), min_size=n, max_size=n + 1)
    keys = st.sampled_from(list(TABLES) * 3 + ["zz", ""])
    sparse = st.dictionaries(keys, st.one_of(st.lists(ids, min_size=n, max_size=n + 1), scalar), max_size=4)
    payload = data.draw(st.one_of(st.fixed_dictionaries({"dense": dense, "sparse": sparse}),
                                  st.dictionaries(st.text(max_size=6), scalar, max_size=3), scalar))
    name = data.draw(st.sampled_from(["dlrm"] * 8 + ["nope", "%2E%2E"]))
    resp = http.post(f"/v1/models/{name}/predict", content=json.dumps(payload).encode(),
                     headers={"Content-Type": "application/json"})
    assert resp.status_code in (200, 400, 404, 413, 422), (payload, resp.status_code, resp.text)
    if resp.status_code == 200:
        assert len(resp.json()["scores"]) == len(payload["dense"])


# --- reload ---------------------------------------------------------------------------------------
def test_reload_picks_up_a_newly_trained_model(tmp_path):
    """A second model saved into the served store appears on reload and scores like the model read from disk."""
    cfg = load(tmp_path, batches=8)
    train(cfg, tmp_path / "run", progress=False)
    path = tmp_path / "run" / "store"
    cfg2 = dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, seed=11))
    train(cfg2, tmp_path / "run2", progress=False)  # another run: its dense weights become model "v2"
    dense, sparse = holdout_request(cfg, 1, 32)
    srv = ServerThread(create_app(ServerSettings(store=path, token=TOKEN))).start()
    try:
        with LookupClient(srv.url, token=TOKEN) as client:
            before = client.predict("dlrm", dense, sparse)
            with pytest.raises(ServerError) as err:
                client.predict("v2", dense, sparse)
            assert err.value.status_code == 404
            shutil.copytree(tmp_path / "run2" / "store" / "models" / "dlrm", path / "models" / "v2")
            answer = client.reload()
            assert answer["models"] == ["dlrm", "v2"]
            assert [m["name"] for m in client.models()] == ["dlrm", "v2"]
            served_v2 = client.predict("v2", dense, sparse)
            np.testing.assert_allclose(client.predict("dlrm", dense, sparse), before, atol=1e-6)
            # rows written through the server are what the next score reads (no stale working set)
            written = np.unique([i for b in sparse["a"] for i in b])
            client.update("a", written, np.full((len(written), 8), 0.5, np.float32))
            after_update = client.predict("dlrm", dense, sparse)
            v2_after_update = client.predict("v2", dense, sparse)
    finally:
        srv.stop()
    assert before.shape == (32,) and not np.allclose(before, served_v2, atol=1e-4)  # v2 really is another model
    assert not np.allclose(before, after_update, atol=1e-4)
    with embstore.open(path) as store:  # holds the written rows now
        np.testing.assert_array_equal(store["a"].lookup(written), np.full((len(written), 8), 0.5, np.float32))
        for name, got in (("dlrm", after_update), ("v2", v2_after_update)):
            model = load_model(store, name)
            np.testing.assert_allclose(got, reference(model, dense, sparse), atol=1e-6)
            model.sparse_arch.ebc.release()


def test_a_broken_model_is_503_and_the_rest_is_served(tmp_path):
    cfg = load(tmp_path, batches=4)
    train(cfg, tmp_path / "run", progress=False)
    path = tmp_path / "run" / "store"
    shutil.copytree(path / "models" / "dlrm", path / "models" / "broken")
    (path / "models" / "broken" / "dense.pt").write_bytes(b"not a torch file")
    dense, sparse = holdout_request(cfg, 0, 4)
    with ServerThread(create_app(ServerSettings(store=path))) as srv, LookupClient(srv.url) as client:
        assert [m["name"] for m in client.models()] == ["dlrm"]
        assert client.predict("dlrm", dense, sparse).shape == (4,)
        with pytest.raises(ServerError) as err:
            client.predict("broken", dense, sparse)
        assert err.value.status_code == 503 and "could not be loaded" in err.value.message
        assert client.lookup("a", [1, 2]).shape == (2, 8)
