"""The HTTP server (SPEC section 5) under a real uvicorn on a loopback port.

Reference values come from the store itself, read directly before the server
opens it (a store directory is open in one place at a time), so "bit for bit"
means the same float32 bits as ``Table.lookup`` / ``Table.lookup_pooled``.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import quote

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import embstore
from embstore.config import HashConfig, StoreConfig, TableConfig, TierConfig
from embstore.hashing import ModHash
from embstore.server import ServerSettings, create_app
from embstore.server.batching import LookupBatcher
from embstore.server.pooled_cache import PooledCache
from embstore.server.state import TableService
from embstore.server.testing import ServerThread

TOKEN = "s3cret-token"
BINARY = "application/octet-stream"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
N, DIM = 1000, 8
ALL = np.arange(N, dtype=np.int64)


def make_store(path: Path) -> dict[str, np.ndarray]:
    """Tables ``t`` (DRAM cache over an SSD home, half its rows written), ``item.ctr`` (mod-hashed,
    mmap home) and ``res`` (memory-resident: its DRAM tier holds every row, so small lookups run on the
    event loop); returns every row of ``t`` and the 64 physical rows of ``item.ctr`` as the store reads them."""
    cfg = StoreConfig((
        TableConfig("t", N, DIM, tiers=(TierConfig("dram", 4096, "lru"), TierConfig("ssd"))),
        TableConfig("item.ctr", 64, 4, hash=HashConfig("mod"), tiers=(TierConfig("dram", "64KiB"), TierConfig("mmap"))),
        TableConfig("res", 256, DIM, tiers=(TierConfig("dram", 256 * DIM * 4), TierConfig("mmap"))),
    ))
    with embstore.create(path, cfg) as store:
        rng = np.random.default_rng(0)
        ids = np.arange(0, N, 2, dtype=np.int64)
        store["t"].update(ids, rng.standard_normal((len(ids), DIM)).astype(np.float32))
        return {"t": store["t"].lookup(ALL), "item.ctr": store["item.ctr"].read_physical(np.arange(64, dtype=np.int64))}


def start(path: Path, **kw) -> ServerThread:
    kw.setdefault("token", TOKEN)
    return ServerThread(create_app(ServerSettings(store=path, **kw))).start()


def post_bin(client: httpx.Client, path: str, values: np.ndarray, accept: str = BINARY, **params) -> httpx.Response:
    return client.post(path, content=np.asarray(values, "<i8").tobytes(), params=params or None,
                       headers={"Content-Type": BINARY, "Accept": accept})


def rows_of(resp: httpx.Response) -> np.ndarray:
    assert resp.status_code == 200, resp.text
    if resp.headers["content-type"] == BINARY:
        n, d = map(int, resp.headers["X-Embedding-Shape"].split(","))
        return np.frombuffer(resp.content, "<f4").reshape(n, d)
    body = resp.json()
    return np.array(body["embeddings"], np.float32).reshape(-1, body["dim"])


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), np.ascontiguousarray(b, np.float32).view(np.uint32))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A read-only server (tests using it must not write) and the store's rows."""
    path = tmp_path_factory.mktemp("served") / "store"
    expected = make_store(path)
    srv = start(path, max_ids=5000, max_body_bytes=1 << 20)
    with httpx.Client(base_url=srv.url, timeout=30) as client:
        yield client, expected, srv
    srv.stop()


# --- reads ------------------------------------------------------------------------------------------
def test_health_tables_and_detail(served):
    client, _, _ = served
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/v1/tables").json() == [
        {"name": "t", "num_embeddings": N, "dim": DIM, "dtype": "float32"},
        {"name": "item.ctr", "num_embeddings": 64, "dim": 4, "dtype": "float32"},
        {"name": "res", "num_embeddings": 256, "dim": DIM, "dtype": "float32"}]
    detail = client.get("/v1/tables/t").json()
    assert detail["name"] == "t" and detail["dim"] == DIM and detail["tiers"] == ["dram", "ssd"]
    assert set(detail["stats"]) == {"dram", "ssd"}
    assert detail["stats"]["dram"]["capacity_rows"] == 4096 // (4 * DIM)
    assert set(detail["pooled_cache"]) >= {"hits", "misses", "hit_ratio", "entries", "bytes"}
    assert set(detail["batching"]) == {"requests", "batches"}


@pytest.mark.parametrize("path", ["/healthz", "/v1/tables", "/v1/tables/t", "/v1/models", "/metrics", "/"])
def test_head_answers_every_get_route_with_its_headers_and_no_body(served, path):
    """Probes and health checks send HEAD: it answers as GET does (status, content type), without a body."""
    client, _, _ = served
    got, head = client.get(path), client.head(path)
    assert got.status_code == head.status_code == 200
    assert head.headers["content-type"] == got.headers["content-type"] and head.content == b""
    assert int(head.headers["content-length"]) > 0


def test_head_is_refused_where_get_is(served):
    client, _, _ = served
    resp = client.head("/v1/tables/nope")
    assert resp.status_code == 404 and resp.content == b""
    resp = client.head("/v1/tables/t/lookup")
    assert resp.status_code == 405 and resp.headers["allow"] == "POST"


def test_the_schema_documents_each_operation_once(served):
    """HEAD is answered but not documented: a HEAD operation would repeat each GET's operationId, which
    OpenAPI requires to be unique (client generators reject the schema; FastAPI warned on every build)."""
    client, _, _ = served
    paths = client.get("/openapi.json").json()["paths"]
    ops = [(path, method, op["operationId"]) for path, item in paths.items() for method, op in item.items()]
    ids = [op_id for _, _, op_id in ops]
    assert len(ids) == len(set(ids)), sorted(ids)
    assert not [(path, method) for path, method, _ in ops if method == "head"]
    assert "get" in paths["/healthz"] and "post" in paths["/v1/tables/{name}/lookup"]


@pytest.mark.parametrize("request_binary", [False, True])
@pytest.mark.parametrize("answer_binary", [False, True])
def test_lookup_matches_store_bit_for_bit(served, request_binary, answer_binary):
    client, expected, _ = served
    rng = np.random.default_rng(int(request_binary) * 2 + int(answer_binary))
    for ids in (rng.integers(0, N, 300), np.array([5, 5, 999, 0, 5]), np.zeros(0, np.int64)):
        accept = BINARY if answer_binary else "application/json"
        if request_binary:
            resp = post_bin(client, "/v1/tables/t/lookup", ids, accept=accept)
        else:
            resp = client.post("/v1/tables/t/lookup", json={"ids": ids.tolist()}, headers={"Accept": accept})
        assert resp.headers["content-type"].startswith(BINARY if answer_binary else "application/json")
        assert same_bits(rows_of(resp), expected["t"][ids])


def test_hashed_table_takes_any_int64(served):
    client, expected, _ = served
    ids = np.array([-(2**63), 2**63 - 1, 3, -1], np.int64)
    got = rows_of(post_bin(client, "/v1/tables/item.ctr/lookup", ids))
    assert same_bits(got, expected["item.ctr"][ModHash(64, 0)(ids)])


def test_pooled_matches_store(served):
    client, expected, _ = served
    ids = np.array([7, 3, 3, 9, 1, 500, 500, 2], np.int64)
    offsets = np.array([0, 3, 3, 5, 8], np.int64)
    for mode in ("sum", "mean"):
        ref = np.stack([getattr(expected["t"][ids[a:b]], mode)(axis=0) if b > a else np.zeros(DIM, np.float32)
                        for a, b in zip(offsets[:-1], offsets[1:])])
        as_json = rows_of(client.post("/v1/tables/t/pooled",
                                      json={"ids": ids.tolist(), "offsets": offsets.tolist(), "mode": mode}))
        as_bin = rows_of(post_bin(client, "/v1/tables/t/pooled", np.concatenate([offsets, ids]),
                                  num_bags=4, mode=mode))
        again = rows_of(post_bin(client, "/v1/tables/t/pooled", np.concatenate([offsets, ids]),
                                 num_bags=4, mode=mode))  # from the pooled cache now
        assert same_bits(as_json, as_bin) and same_bits(as_bin, again)
        np.testing.assert_allclose(as_bin, ref, rtol=1e-6, atol=1e-6)
        assert not as_bin[1].any()  # the empty bag pools to zeros


# --- errors ---------------------------------------------------------------------------------------
ERROR_CASES = [
    # (method, path, request kwargs, status, words in the message)
    ("post", "/v1/tables/t/lookup", {"content": b"{not json"}, 400, "invalid json"),
    ("post", "/v1/tables/t/lookup", {"json": [1, 2]}, 400, "object"),
    ("post", "/v1/tables/t/lookup", {"json": {"ids": [1, "2"]}}, 400, "ids.1"),
    ("post", "/v1/tables/t/lookup", {"json": {"ids": [1.5]}}, 400, "integer"),
    ("post", "/v1/tables/t/lookup", {"json": {"ids": [True]}}, 400, "integer"),
    ("post", "/v1/tables/t/lookup", {"json": {"ids": [2**64]}}, 400, "less than or equal"),
    ("post", "/v1/tables/t/lookup", {"json": {"idz": [1]}}, 400, "ids"),
    ("post", "/v1/tables/t/lookup", {"json": {"ids": [N]}}, 400, "outside [0, 1000)"),
    ("post", "/v1/tables/t/lookup", {"json": {"ids": [-1]}}, 400, "outside [0, 1000)"),
    ("post", "/v1/tables/t/lookup", {"content": b"\0" * 12, "headers": {"Content-Type": BINARY}}, 400,
     "multiple of 8"),
    ("post", "/v1/tables/t/lookup", {"json": {"ids": list(range(5001))}}, 413, "at most 5000"),
    ("post", "/v1/tables/t/lookup", {"content": b"\0" * 8 * 5001, "headers": {"Content-Type": BINARY}}, 413,
     "at most 5000"),
    ("post", "/v1/tables/t/lookup", {"content": b"\0" * ((1 << 20) + 8), "headers": {"Content-Type": BINARY}}, 413,
     "limit of 1048576 bytes"),
    ("post", "/v1/tables/nope/lookup", {"json": {"ids": [1]}}, 404, "no table 'nope'; known tables: item.ctr, res, t"),
    ("get", "/v1/tables/nope", {}, 404, "no table 'nope'"),
    ("post", "/v1/tables/nope/pooled", {"json": {"ids": [1], "offsets": [0, 1]}}, 404, "no table"),
    ("post", "/v1/tables/t/pooled", {"json": {"ids": [1, 2], "offsets": [0, 3]}}, 400, "offsets[-1]"),
    ("post", "/v1/tables/t/pooled", {"json": {"ids": [1, 2], "offsets": [1, 2]}}, 400, "offsets[0]"),
    ("post", "/v1/tables/t/pooled", {"json": {"ids": [1, 2], "offsets": [0, 2, 1, 2]}}, 400, "non-decreasing"),
    ("post", "/v1/tables/t/pooled", {"json": {"ids": [1], "offsets": []}}, 400, "at least [0]"),
    ("post", "/v1/tables/t/pooled", {"json": {"ids": [1], "offsets": [0, 1], "mode": "max"}}, 400, "mode"),
    ("post", "/v1/tables/t/pooled", {"json": {"ids": [1], "offsets": [0, 1]}, "params": {"mode": "mean"}}, 400,
     "query parameter of the binary protocol only"),
    ("post", "/v1/tables/t/pooled", {"json": {"ids": [1], "offsets": [0, 1], "mode": "sum"},
                                     "params": {"mode": "mean"}}, 400, "mode given twice"),
    ("post", "/v1/tables/t/pooled", {"content": b"\0" * 16, "headers": {"Content-Type": BINARY}}, 400, "num_bags"),
    ("post", "/v1/tables/t/pooled", {"content": b"\0" * 16, "headers": {"Content-Type": BINARY},
                                     "params": {"num_bags": 5}}, 400, "needs 6 offsets"),
    ("post", "/v1/tables/t/pooled", {"content": b"\0" * 16, "headers": {"Content-Type": BINARY},
                                     "params": {"num_bags": -1}}, 400, "num_bags"),
    ("post", "/v1/tables/t/pooled", {"content": b"\0" * 16, "headers": {"Content-Type": BINARY},
                                     "params": {"num_bags": 1, "mode": "max"}}, 400, "mode"),
    # every bag is an answer row, like every id of a lookup: a body of empty bags is held to the id limit
    ("post", "/v1/tables/t/pooled", {"json": {"ids": [], "offsets": [0] * 5002}}, 413, "5001 bags"),
    ("post", "/v1/tables/t/pooled", {"content": b"\0" * 8 * 5002, "headers": {"Content-Type": BINARY},
                                     "params": {"num_bags": 5001}}, 413, "at most 5000"),
    ("put", "/v1/tables/t/rows", {"json": {"ids": [1]}}, 401, "bearer token"),
    ("put", "/v1/tables/nope/rows", {"json": {"ids": [1], "embeddings": [[0.0] * DIM]}, "headers": AUTH}, 404,
     "no table"),
    ("put", "/v1/tables/t/rows", {"content": b"[", "headers": AUTH}, 400, "invalid json"),
    ("put", "/v1/tables/t/rows", {"json": {"ids": [1], "embeddings": [["x"] * DIM]}, "headers": AUTH}, 400, "number"),
    ("put", "/v1/tables/t/rows", {"json": {"ids": [1, 2], "embeddings": [[0.0] * DIM]}, "headers": AUTH}, 422,
     "one row per id"),
    ("put", "/v1/tables/t/rows", {"json": {"ids": [1], "embeddings": [[0.0] * (DIM + 1)]}, "headers": AUTH}, 422,
     "shape (1, 8)"),
    ("put", "/v1/tables/t/rows", {"json": {"ids": [1, 2], "embeddings": [[0.0] * DIM, [0.0]]}, "headers": AUTH},
     422, "dim = 8"),
    ("put", "/v1/tables/t/rows", {"content": b'{"ids": [1], "embeddings": [[NaN, 0, 0, 0, 0, 0, 0, 0]]}',
                                  "headers": AUTH}, 422, "finite"),
    ("put", "/v1/tables/t/rows", {"json": {"ids": [1], "embeddings": [[1e39] + [0.0] * (DIM - 1)]},
                                  "headers": AUTH}, 422, "finite"),
    ("put", "/v1/tables/t/rows", {"json": {"ids": [N], "embeddings": [[0.0] * DIM]}, "headers": AUTH}, 400,
     "outside"),
    ("put", "/v1/tables/t/rows", {"json": {"ids": list(range(5001)), "embeddings": []}, "headers": AUTH}, 413,
     "at most 5000"),
    ("post", "/v1/admin/reload", {}, 401, "bearer token"),
    ("post", "/v1/admin/reload", {"headers": {"Authorization": "Bearer wrong"}}, 401, "bearer token"),
]


@pytest.mark.parametrize("method,path,kwargs,status,words", ERROR_CASES,
                         ids=[f"{c[3]}-{c[0]}-{i}" for i, c in enumerate(ERROR_CASES)])
def test_error_status_and_message(served, method, path, kwargs, status, words):
    client, expected, _ = served
    resp = client.request(method.upper(), path, **kwargs)
    assert resp.status_code == status, resp.text
    assert words.lower() in resp.json()["detail"].lower()
    if status == 401:
        assert resp.headers["WWW-Authenticate"] == "Bearer"
    # nothing was written by a rejected request
    assert same_bits(rows_of(post_bin(client, "/v1/tables/t/lookup", ALL)), expected["t"])


def test_as_many_bags_as_the_id_limit_are_answered(served):
    client, _, _ = served
    got = rows_of(client.post("/v1/tables/t/pooled", json={"ids": [], "offsets": [0] * 5001}))
    assert got.shape == (5000, DIM) and not got.any()
    got = rows_of(post_bin(client, "/v1/tables/t/pooled", np.zeros(5001, np.int64), num_bags=5000))
    assert got.shape == (5000, DIM) and not got.any()


@pytest.mark.parametrize("accept,binary", [
    (BINARY, True), ("application/json", False), ("*/*", False), ("", False),
    (f"application/json, {BINARY}", True), (f"{BINARY};q=0.9, application/json;q=0.8", True),
    (f"{BINARY};q=0, application/json", False), (f"{BINARY}; q=0.0", False),
    (f"application/json;q=1, {BINARY};q=0.5", False), ("Application/Octet-Stream", True),
])
def test_accept_header_chooses_the_answer_format(served, accept, binary):
    """``Accept`` with quality values (RFC 9110): ``q=0`` refuses a format, the higher q wins."""
    client, expected, _ = served
    resp = client.post("/v1/tables/t/lookup", json={"ids": [3, 4]}, headers={"Accept": accept})
    assert resp.headers["content-type"].startswith(BINARY if binary else "application/json")
    assert same_bits(rows_of(resp), expected["t"][[3, 4]])


def test_chunked_body_over_the_limit_is_413(served):
    client, _, _ = served

    def chunks():
        for _ in range(20):
            yield b"\0" * (64 << 10)

    resp = client.post("/v1/tables/t/lookup", content=chunks(), headers={"Content-Type": BINARY})
    assert resp.status_code == 413 and "1048576" in resp.json()["detail"]


def test_writes_need_the_token_and_change_nothing_without_it(tmp_path):
    expected = make_store(tmp_path / "s")
    row = {"ids": [4], "embeddings": [[1.0] * DIM]}
    with ServerThread(create_app(ServerSettings(store=tmp_path / "s", token=TOKEN))) as srv, \
            httpx.Client(base_url=srv.url) as client:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": TOKEN},
                        {"Authorization": f"Basic {TOKEN}"}, {"Authorization": f"Bearer {TOKEN}x"}):
            resp = client.put("/v1/tables/t/rows", json=row, headers=headers)
            assert resp.status_code == 401 and "token" in resp.json()["detail"]
            assert resp.headers["WWW-Authenticate"] == "Bearer"
            assert same_bits(rows_of(post_bin(client, "/v1/tables/t/lookup", ALL)), expected["t"])
        assert client.put("/v1/tables/t/rows", json=row, headers=AUTH).status_code == 204
        got = rows_of(post_bin(client, "/v1/tables/t/lookup", ALL))
    want = expected["t"].copy()
    want[4] = 1.0
    assert same_bits(got, want)


def test_without_a_token_writes_are_open(tmp_path):
    make_store(tmp_path / "s")
    with ServerThread(create_app(ServerSettings(store=tmp_path / "s"))) as srv, \
            httpx.Client(base_url=srv.url) as client:
        assert client.put("/v1/tables/t/rows", json={"ids": [], "embeddings": []}).status_code == 204
        assert client.put("/v1/tables/t/rows", json={"ids": [9], "embeddings": [[2.5] * DIM]}).status_code == 204
        assert (rows_of(client.post("/v1/tables/t/lookup", json={"ids": [9]})) == 2.5).all()


def test_request_timeout_is_504(tmp_path):
    make_store(tmp_path / "s")
    with ServerThread(create_app(ServerSettings(store=tmp_path / "s", request_timeout=1e-6))) as srv, \
            httpx.Client(base_url=srv.url) as client:
        resp = post_bin(client, "/v1/tables/t/lookup", ALL)
        assert resp.status_code == 504 and "timed out" in resp.json()["detail"]


def test_a_json_answer_never_carries_infinity(tmp_path):
    """Finite rows can pool to inf (two rows of 3e38). JSON has no Infinity: the JSON answer is a 422
    that says so and names the binary protocol, which carries the float32 inf as it is."""
    cfg = StoreConfig((TableConfig("big", 4, 2, tiers=(TierConfig("dram", 4 * 2 * 4), TierConfig("mmap"))),))
    with embstore.create(tmp_path / "s", cfg) as store:
        store["big"].update(np.arange(2), np.full((2, 2), 3e38, np.float32))
    with ServerThread(create_app(ServerSettings(store=tmp_path / "s"))) as srv, \
            httpx.Client(base_url=srv.url) as client:
        assert (rows_of(client.post("/v1/tables/big/lookup", json={"ids": [0, 1]})) == np.float32(3e38)).all()
        resp = client.post("/v1/tables/big/pooled", json={"ids": [0, 1], "offsets": [0, 2]})
        assert resp.status_code == 422, resp.text
        detail = json.loads(resp.text, parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))["detail"]
        assert "not finite" in detail and "octet-stream" in detail
        assert np.isposinf(rows_of(post_bin(client, "/v1/tables/big/pooled", np.array([0, 2, 0, 1]), num_bags=1))).all()


# --- pooled cache ---------------------------------------------------------------------------------
def test_pooled_cache_serves_repeats_and_sees_updates(tmp_path):
    expected = make_store(tmp_path / "s")
    bags = {"ids": [1, 2, 3, 4, 5], "offsets": [0, 2, 5], "mode": "sum"}
    with ServerThread(create_app(ServerSettings(store=tmp_path / "s", token=TOKEN))) as srv, \
            httpx.Client(base_url=srv.url) as client:
        first = rows_of(client.post("/v1/tables/t/pooled", json=bags))
        assert client.get("/v1/tables/t").json()["pooled_cache"]["misses"] == 2
        for _ in range(3):
            assert same_bits(rows_of(client.post("/v1/tables/t/pooled", json=bags)), first)
        pc = client.get("/v1/tables/t").json()["pooled_cache"]
        assert (pc["hits"], pc["misses"], pc["entries"]) == (6, 2, 2) and pc["hit_ratio"] == 0.75
        assert 'embstore_pooled_cache_hits_total{table="t"} 6.0' in client.get("/metrics").text
        # a write to row 4 (second bag) invalidates that bag only
        assert client.put("/v1/tables/t/rows", json={"ids": [4], "embeddings": [[10.0] * DIM]},
                          headers=AUTH).status_code == 204
        after = rows_of(client.post("/v1/tables/t/pooled", json=bags))
        pc = client.get("/v1/tables/t").json()["pooled_cache"]
        assert (pc["hits"], pc["misses"]) == (7, 3)
    assert same_bits(after[0], first[0])
    want = expected["t"][[3, 5]].sum(axis=0) + np.float32(10.0)
    np.testing.assert_allclose(after[1], want, rtol=1e-6)


def _pool_ref(w: np.ndarray, ids: np.ndarray, offsets: np.ndarray, mode: str) -> np.ndarray:
    out = np.zeros((len(offsets) - 1, w.shape[1]), np.float32)
    for b in range(len(offsets) - 1):
        rows = w[ids[offsets[b]:offsets[b + 1]]]
        if len(rows):
            out[b] = rows.sum(axis=0) if mode == "sum" else rows.mean(axis=0)
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(
    st.tuples(st.just("pool"), st.lists(st.lists(st.integers(0, 15), max_size=4), max_size=4),
              st.sampled_from(["sum", "mean"])),
    st.tuples(st.just("write"), st.lists(st.integers(0, 15), min_size=1, max_size=3), st.integers(-3, 3))),
    max_size=25), st.sampled_from([1 << 10, 1 << 16]), st.sampled_from([2, 1 << 16]))
def test_pooled_cache_never_serves_stale_bags(ops, capacity, slots):
    """Against a numpy model: every answer equals pooling the current rows (tiny budgets evict,
    two slots make every row share an epoch slot with others)."""
    w = np.random.default_rng(0).standard_normal((16, 3)).astype(np.float32)
    cache = PooledCache(lambda i, o, m: _pool_ref(w, i, o, m), lambda ids: ids, 3, capacity, slots=slots)
    for op in ops:
        if op[0] == "pool":
            ids = np.array([i for bag in op[1] for i in bag], np.int64)
            offsets = np.cumsum([0] + [len(b) for b in op[1]]).astype(np.int64)
            assert same_bits(cache.lookup_pooled(ids, offsets, op[2]), _pool_ref(w, ids, offsets, op[2]))
        else:
            ids = np.array(op[1], np.int64)
            w[ids] = op[2]
            cache.note_write(ids)
    assert cache.stats()["bytes"] <= capacity


def test_pooled_cache_on_a_hashed_table_invalidates_colliding_ids(tmp_path):
    make_store(tmp_path / "s")
    with ServerThread(create_app(ServerSettings(store=tmp_path / "s", token=TOKEN))) as srv, \
            httpx.Client(base_url=srv.url) as client:
        ids = np.arange(1000, dtype=np.int64)  # 1000 raw ids on 64 rows: collisions for sure
        bag = {"ids": [int(ids[0])], "offsets": [0, 1], "mode": "sum"}
        before = rows_of(client.post("/v1/tables/item.ctr/pooled", json=bag))
        row0 = rows_of(client.post("/v1/tables/item.ctr/lookup", json={"ids": [0]}))
        hashed = rows_of(post_bin(client, "/v1/tables/item.ctr/lookup", ids))
        other = int(next(i for i in ids[1:] if same_bits(hashed[i:i + 1], row0)))  # shares id 0's row
        assert client.put("/v1/tables/item.ctr/rows", json={"ids": [other], "embeddings": [[7.0] * 4]},
                          headers=AUTH).status_code == 204
        after = rows_of(client.post("/v1/tables/item.ctr/pooled", json=bag))
    assert not same_bits(before, after) and (after == 7.0).all()


# --- batching -------------------------------------------------------------------------------------
def test_batcher_coalesces_concurrent_lookups_and_splits_results():
    w = np.random.default_rng(1).standard_normal((100, 4)).astype(np.float32)
    calls: list[int] = []

    def lookup(ids):
        calls.append(len(ids))
        return w[ids]

    async def offload(fn, *args):
        return fn(*args)

    async def main():
        batcher = LookupBatcher(lookup, offload, wait=0.001)
        reqs = [np.random.default_rng(i).integers(0, 100, i) for i in range(20)]
        outs = await asyncio.gather(*(batcher.lookup(r) for r in reqs))
        for r, o in zip(reqs, outs):
            assert same_bits(o, w[r])
        assert calls == [sum(map(len, reqs))] and batcher.stats.batches == 1 and batcher.stats.requests == 20
        # requests arriving while a read runs go together as the next read
        first = asyncio.ensure_future(batcher.lookup(np.array([1])))
        await asyncio.sleep(0.01)
        outs = await asyncio.gather(first, *(batcher.lookup(np.array([i])) for i in range(5)))
        assert all(same_bits(o, w[[i]]) for o, i in zip(outs[1:], range(5)))

    asyncio.run(main())


def test_batcher_delivers_a_failed_read_to_its_callers_and_skips_cancelled_ones():
    calls = []

    def lookup(ids):
        calls.append(ids.tolist())
        if 13 in ids:
            raise OSError("disk on fire")
        return np.zeros((len(ids), 2), np.float32)

    async def offload(fn, *args):
        await asyncio.sleep(0)
        return fn(*args)

    async def main():
        batcher = LookupBatcher(lookup, offload, wait=0.001)
        doomed = asyncio.ensure_future(batcher.lookup(np.array([99])))
        results = asyncio.gather(batcher.lookup(np.array([1])), batcher.lookup(np.array([13])),
                                 return_exceptions=True)
        await asyncio.sleep(0)
        doomed.cancel()
        out = await results
        assert all(isinstance(r, OSError) for r in out)
        assert calls == [[1, 13]]  # the cancelled request was not read
        assert (await batcher.lookup(np.array([2]))).shape == (1, 2)  # the batcher goes on

    asyncio.run(main())


def test_batching_off_and_on_give_the_same_rows(tmp_path):
    expected = make_store(tmp_path / "s")
    ids = [np.random.default_rng(i).integers(0, N, 64) for i in range(40)]
    for batching in (False, True):
        app = create_app(ServerSettings(store=tmp_path / "s", batching=batching, batch_wait=0.001))
        with ServerThread(app) as srv:
            async def burst():
                async with httpx.AsyncClient(base_url=srv.url) as client:
                    return await asyncio.gather(*(client.post("/v1/tables/t/lookup", content=x.tobytes(),
                                                              headers={"Content-Type": BINARY, "Accept": BINARY})
                                                  for x in ids))
            resps = asyncio.run(burst())
            for x, r in zip(ids, resps):
                assert same_bits(rows_of(r), expected["t"][x])
            batcher = app.state.gate.current.services["t"].batcher
            assert (batcher is None) == (not batching)
            if batching:  # every request went through the batcher, in at most as many reads
                assert batcher.stats.requests == len(ids) and 1 <= batcher.stats.batches <= len(ids)


def test_resident_tables_answer_inline_but_never_block_the_loop_on_a_busy_table(tmp_path):
    make_store(tmp_path / "s")
    with embstore.open(tmp_path / "s") as store:
        want = store["res"].lookup(np.arange(10, dtype=np.int64))
        settings_ = ServerSettings(store=tmp_path / "s")
        svc = TableService(store["res"], settings_)
        assert svc._inline_ok and not TableService(store["t"], settings_)._inline_ok
        held, release = threading.Event(), threading.Event()

        def writer():  # holds the table's lock as a long write or flush would
            with store["res"].try_locked() as got:
                assert got
                held.set()
                release.wait(10)

        async def main():
            assert same_bits(await svc.lookup(np.arange(10)), want)  # inline
            threading.Thread(target=writer).start()
            held.wait(10)
            task = asyncio.ensure_future(svc.lookup(np.arange(10)))
            await asyncio.sleep(0.05)  # the loop runs on while the lookup waits in a worker thread
            assert not task.done()
            release.set()
            assert same_bits(await task, want)

        asyncio.run(main())


# --- concurrency, durability, reload --------------------------------------------------------------
@pytest.mark.parametrize("table", ["t", "res"])
def test_concurrent_readers_and_writers_leave_no_torn_rows(tmp_path, table):
    make_store(tmp_path / "s")
    writers, per_writer, rounds = 3, 16, 30
    owned = [np.arange(w, writers * per_writer, writers, dtype=np.int64) for w in range(writers)]
    final = {}
    errors: list[str] = []
    srv = start(tmp_path / "s", flush_interval=0.05)
    with httpx.Client(base_url=srv.url) as client:  # every row a reader can see starts uniform
        seed = np.arange(writers * per_writer, dtype=np.int64)
        assert client.put(f"/v1/tables/{table}/rows", headers=AUTH, json={
            "ids": seed.tolist(), "embeddings": np.repeat(-1.0 - seed[:, None], DIM, 1).tolist()}).status_code == 204

    def writer(w: int) -> None:
        rng = np.random.default_rng(w)
        with httpx.Client(base_url=srv.url, headers=AUTH) as c:
            for r in range(rounds):
                ids = rng.choice(owned[w], size=4, replace=False)
                vals = np.float32(1000 * w + r) + np.arange(4, dtype=np.float32) / 8
                resp = c.put(f"/v1/tables/{table}/rows", json={"ids": ids.tolist(),
                                                         "embeddings": np.repeat(vals[:, None], DIM, 1).tolist()})
                if resp.status_code != 204:
                    errors.append(resp.text)
                final.update(zip(ids.tolist(), vals.tolist()))

    def reader(k: int) -> None:
        rng = np.random.default_rng(100 + k)
        with httpx.Client(base_url=srv.url) as c:
            for _ in range(rounds):
                ids = rng.integers(0, writers * per_writer, 32)
                if k % 2:
                    got = rows_of(post_bin(c, f"/v1/tables/{table}/lookup", ids))
                else:
                    offsets = np.arange(33, dtype=np.int64)  # one id per bag: pooled == the row
                    got = rows_of(post_bin(c, f"/v1/tables/{table}/pooled", np.concatenate([offsets, ids]),
                                           num_bags=32))
                if not (got == got[:, :1]).all():
                    errors.append(f"torn row in {got}")

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
    threads += [threading.Thread(target=reader, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors, errors[:3]
        with httpx.Client(base_url=srv.url) as client:
            ids = np.array(sorted(final), np.int64)
            got = rows_of(post_bin(client, f"/v1/tables/{table}/lookup", ids))
        assert same_bits(got, np.repeat(np.array([final[i] for i in ids], np.float32)[:, None], DIM, 1))
    finally:
        srv.stop()
    with embstore.open(tmp_path / "s") as store:  # the shutdown flushed everything
        assert same_bits(store[table].lookup(ids), got)


def test_flush_interval_and_shutdown_flush(tmp_path):
    make_store(tmp_path / "s")
    srv = start(tmp_path / "s", flush_interval=0.05)
    with httpx.Client(base_url=srv.url) as client:
        before = client.get("/v1/tables/t").json()["stats"]["ssd"]["bytes_written"]
        assert client.put("/v1/tables/t/rows", json={"ids": [1], "embeddings": [[3.0] * DIM]},
                          headers=AUTH).status_code == 204
        for _ in range(200):  # the periodic flush writes the dirty row down to the home tier
            if client.get("/v1/tables/t").json()["stats"]["ssd"]["bytes_written"] > before:
                break
            time.sleep(0.025)
        assert client.get("/v1/tables/t").json()["stats"]["ssd"]["bytes_written"] > before
    srv.stop()
    srv = start(tmp_path / "s", flush_interval=0)  # never periodically: only the shutdown flushes
    with httpx.Client(base_url=srv.url) as client:
        assert client.put("/v1/tables/t/rows", json={"ids": [2], "embeddings": [[4.0] * DIM]},
                          headers=AUTH).status_code == 204
    srv.stop()
    with embstore.open(tmp_path / "s") as store:
        assert (store["t"].lookup(np.array([1, 2]))[:, 0] == [3.0, 4.0]).all()


def test_reload_waits_for_requests_in_flight_and_fails_none(tmp_path):
    expected = make_store(tmp_path / "s")
    entered, release = threading.Event(), threading.Event()
    opened: list[embstore.Store] = []

    def opener(path):
        store = embstore.open(path)
        table, real = store["t"], store["t"].lookup

        def slow_lookup(ids):
            if len(ids) == 3:  # the one request the test holds up
                entered.set()
                release.wait(10)
            return real(ids)

        table.lookup = slow_lookup
        opened.append(store)
        return store

    app = create_app(ServerSettings(store=tmp_path / "s", token=TOKEN, batching=False), opener=opener)
    results: dict[str, httpx.Response] = {}
    with ServerThread(app) as srv:
        def call(key, method, path, **kw):
            with httpx.Client(base_url=srv.url, timeout=30) as c:
                results[key] = c.request(method, path, **kw)

        slow = threading.Thread(target=call, args=("slow", "POST", "/v1/tables/t/lookup"),
                                kwargs={"json": {"ids": [1, 2, 3]}})
        slow.start()
        assert entered.wait(10)
        reload = threading.Thread(target=call, args=("reload", "POST", "/v1/admin/reload"), kwargs={"headers": AUTH})
        reload.start()
        reload.join(0.3)
        assert reload.is_alive() and len(opened) == 1  # waiting for the request in flight
        late = threading.Thread(target=call, args=("late", "POST", "/v1/tables/t/lookup"),
                                kwargs={"json": {"ids": [5]}})
        late.start()
        release.set()
        for t in (slow, reload, late):
            t.join(20)
        assert len(opened) == 2
        with pytest.raises(embstore.StoreClosedError):
            opened[0]["t"]  # the old store was closed after the request in flight finished
        assert results["reload"].status_code == 200 and results["reload"].json()["reloads"] == 1
        assert same_bits(rows_of(results["slow"]), expected["t"][[1, 2, 3]])
        assert same_bits(rows_of(results["late"]), expected["t"][[5]])


def test_reload_sees_rows_written_before_and_keeps_readers_going(tmp_path):
    expected = make_store(tmp_path / "s")
    stop = threading.Event()
    failures: list[str] = []
    with ServerThread(create_app(ServerSettings(store=tmp_path / "s", token=TOKEN, flush_interval=0))) as srv:
        def reader(k):
            rng = np.random.default_rng(k)
            with httpx.Client(base_url=srv.url, timeout=30) as c:
                while not stop.is_set():
                    ids = rng.integers(500, N, 16)  # rows nobody writes
                    resp = post_bin(c, "/v1/tables/t/lookup", ids)
                    if resp.status_code != 200 or not same_bits(rows_of(resp), expected["t"][ids]):
                        failures.append(resp.text)

        readers = [threading.Thread(target=reader, args=(k,)) for k in range(3)]
        for t in readers:
            t.start()
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=30) as client:
            for i in range(4):
                assert client.put("/v1/tables/t/rows", json={"ids": [i], "embeddings": [[float(i)] * DIM]}
                                  ).status_code == 204
                assert client.post("/v1/admin/reload").status_code == 200
                assert (rows_of(client.post("/v1/tables/t/lookup", json={"ids": [i]})) == i).all()
        stop.set()
        for t in readers:
            t.join()
    assert not failures, failures[:3]


def test_reload_of_a_broken_store_is_refused_and_serving_goes_on(tmp_path):
    expected = make_store(tmp_path / "s")
    with ServerThread(create_app(ServerSettings(store=tmp_path / "s", token=TOKEN))) as srv, \
            httpx.Client(base_url=srv.url, headers=AUTH) as client:
        config = (tmp_path / "s" / "config.toml").read_text()
        (tmp_path / "s" / "config.toml").write_text("[[table]]\nname = 3\n")
        resp = client.post("/v1/admin/reload")
        assert resp.status_code == 409 and "still serving" in resp.json()["detail"]
        assert same_bits(rows_of(client.post("/v1/tables/t/lookup", json={"ids": [7]})), expected["t"][[7]])
        (tmp_path / "s" / "config.toml").write_text(config)
        assert client.post("/v1/admin/reload").status_code == 200


def test_a_failed_reopen_answers_503_until_a_reload_succeeds(tmp_path):
    expected = make_store(tmp_path / "s")
    calls = []

    def opener(path):
        calls.append(path)
        if len(calls) == 2:
            raise embstore.CorruptStoreError("simulated: the slab went missing")
        return embstore.open(path)

    app = create_app(ServerSettings(store=tmp_path / "s", token=TOKEN, flush_interval=0.05), opener=opener)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, headers=AUTH) as client:
        resp = client.post("/v1/admin/reload")
        assert resp.status_code == 503 and "simulated" in resp.json()["detail"]
        for method, path, kw in (("GET", "/healthz", {}), ("POST", "/v1/tables/t/lookup", {"json": {"ids": [1]}}),
                                 ("GET", "/v1/tables", {})):
            resp = client.request(method, path, **kw)
            assert resp.status_code == 503 and "POST /v1/admin/reload" in resp.json()["detail"]
        assert client.get("/metrics").status_code == 200 and client.get("/").status_code == 200
        time.sleep(0.1)  # the periodic flush skips while nothing is open
        assert client.post("/v1/admin/reload").status_code == 200
        assert same_bits(rows_of(client.post("/v1/tables/t/lookup", json={"ids": [1]})), expected["t"][[1]])


# --- metrics, status page, fuzzing ----------------------------------------------------------------
def test_metrics_count_requests_latency_and_tiers(served):
    client, _, _ = served
    post_bin(client, "/v1/tables/t/lookup", np.arange(10))
    client.post("/v1/tables/nope/lookup", json={"ids": [1]})
    text = client.get("/metrics").text
    assert 'embstore_http_requests_total{endpoint="/v1/tables/{name}/lookup",method="POST",status="200"}' in text
    assert 'embstore_http_requests_total{endpoint="/v1/tables/{name}/lookup",method="POST",status="404"}' in text
    assert 'embstore_http_request_duration_seconds_bucket{endpoint="/v1/tables/{name}/lookup",le="0.005",' \
           'method="POST"}' in text
    for name in ("hits", "misses"):
        for tier in ("dram", "ssd"):
            assert f'embstore_tier_{name}_total{{table="t",tier="{tier}"}}' in text
    assert 'embstore_pooled_cache_hits_total{table="t"}' in text
    assert 'embstore_tier_resident_rows{table="t",tier="dram"}' in text


def test_metrics_labels_stay_bounded_whatever_the_method(served):
    """A made-up HTTP method must not create a new series per request (label sets grow forever)."""
    client, _, _ = served
    for i in range(3):
        assert client.request(f"BREW{i}", "/healthz").status_code == 405
    text = client.get("/metrics").text
    assert "BREW" not in text
    assert 'embstore_http_requests_total{endpoint="/healthz",method="OTHER",status="405"} 3.0' in text
    assert "BREW" not in client.get("/").text


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    return None


@pytest.mark.skipif(_chromium() is None, reason="chromium is not installed (apt-get install -y chromium); "
                                                "the status page is rendered in headless Chromium")
def test_status_page_renders_in_headless_chromium(served):
    client, _, srv = served
    post_bin(client, "/v1/tables/t/lookup", np.arange(10))
    with tempfile.TemporaryDirectory() as profile:
        out = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                              "--no-first-run", "--disable-background-networking", "--disable-component-update",
                              "--disable-sync", f"--user-data-dir={profile}", "--dump-dom", srv.url + "/"],
                             capture_output=True, text=True, timeout=90)
    dom = out.stdout
    assert "<title>embstore server</title>" in dom, out.stderr[-2000:]
    for name in ("t", "item.ctr"):
        assert f'<h3 class="table-name">{name}</h3>' in dom
    assert "POST /v1/tables/{name}/lookup" in dom and "occupancy" in dom


ANY_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                   max_size=3), max_leaves=8)


def _strategy(schema: dict, components: dict, top: bool = True) -> st.SearchStrategy:
    """Values valid for a JSON schema; at the top level, now and then any JSON instead."""
    if "$ref" in schema:
        return _strategy(components[schema["$ref"].rsplit("/", 1)[1]], components, top)
    kind = schema.get("type")
    if "anyOf" in schema:
        valid = st.one_of([_strategy(s, components, False) for s in schema["anyOf"]])
    elif "enum" in schema:
        valid = st.sampled_from(schema["enum"])
    elif kind == "integer":
        small = st.integers(0, 999)
        valid = st.one_of(small, small, small, st.integers(-3, 1100),
                          st.integers(schema.get("minimum", -2**70), schema.get("maximum", 2**70)))
    elif kind == "number":
        valid = st.floats(width=32) | st.integers(-5, 5)
    elif kind == "string":
        valid = st.text(max_size=10)
    elif kind == "null":
        valid = st.none()
    elif kind == "array":
        valid = st.lists(_strategy(schema.get("items", {}), components, False), max_size=12)
    elif kind == "object":
        props, required = schema.get("properties", {}), set(schema.get("required", ()))
        valid = st.fixed_dictionaries(
            {k: _strategy(v, components, False) for k, v in props.items() if k in required},
            optional={k: _strategy(v, components, False) for k, v in props.items() if k not in required})
    else:
        return ANY_JSON
    return st.one_of(valid, valid, valid, ANY_JSON) if top else valid


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "store"
    make_store(path)
    srv = start(path, max_ids=2000, max_body_bytes=1 << 16)
    with httpx.Client(base_url=srv.url, timeout=30) as client:
        schema = client.get("/openapi.json").json()
        yield client, schema
    srv.stop()


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(data=st.data())
def test_openapi_fuzz_never_gets_a_5xx(fuzz_server, data):
    """Requests drawn from the app's own OpenAPI schema (and mutations of it) never get a 5xx."""
    client, schema = fuzz_server
    components = schema.get("components", {}).get("schemas", {})
    ops = sorted((p, m) for p, item in schema["paths"].items() for m in item)
    path, method = data.draw(st.sampled_from(ops))
    op = schema["paths"][path][method]
    url, params = path, {}
    for param in op.get("parameters", []):
        if param["in"] == "path":
            known = st.sampled_from(["t"] * 6 + ["item.ctr"] * 3 + ["nope"])
            value = data.draw(st.one_of(known, known, known, st.text(min_size=1)))
            url = url.replace("{" + param["name"] + "}", quote(value, safe=""))
        elif param["in"] == "query" and data.draw(st.booleans()):
            params[param["name"]] = data.draw(_strategy(param.get("schema", {}), components)
                                              | st.text(max_size=4))
    headers = {"Accept": data.draw(st.sampled_from(["application/json", BINARY, "*/*"])),
               "Authorization": data.draw(st.sampled_from([f"Bearer {TOKEN}"] * 4 + ["", "Bearer x", "Basic abc"]))}
    content = None
    if "requestBody" in op:
        kinds = sorted(op["requestBody"]["content"])
        kind = data.draw(st.sampled_from(kinds + ["text/plain"]))
        headers["Content-Type"] = kind
        if kind == BINARY:
            content = data.draw(st.binary(max_size=200) | st.lists(st.integers(-3, 1100), max_size=40).map(
                lambda xs: np.array(xs, "<i8").tobytes()))
        else:
            body_schema = op["requestBody"]["content"].get(kind, {}).get("schema", {})
            content = json.dumps(data.draw(_strategy(body_schema, components))).encode()
    params = {k: (json.dumps(v) if not isinstance(v, str) else v) for k, v in params.items()}
    resp = client.request(method.upper(), url, params=params, content=content, headers=headers)
    assert resp.status_code < 500, (method, url, params, content, resp.status_code, resp.text)
