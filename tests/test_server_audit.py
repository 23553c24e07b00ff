"""Audit of the HTTP server and ``LookupClient`` over real HTTP (SPEC section 5), beside ``test_server_fuzz.py``.

One real uvicorn (``server.testing.ServerThread``) serves, for the whole module, a store the other server
tests do not build: ``f`` (an LRU cache over an SSD home: lookups go through the batcher), ``res``
(memory-resident: answered on the event loop), ``h`` (mod-hashed: any int64 is an id), ``qr`` (QR-hashed:
reads combine two shared rows, writes are refused) and ``f16`` (float16 rows). Every request here is one the
server must refuse or answer exactly; after each, every table must still read back as it did when the
module started (no test here writes a row that stays written), nothing may be logged at ERROR, and
``/metrics`` must count each answer under its route and status. The client half checks that each refusal
becomes a ``ServerError`` carrying the server's own message, that a server that is down is an httpx
connection error, and which numpy inputs the client converts and which it refuses.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import embstore
from embstore.client import LookupClient, ServerError, bags
from embstore.config import HashConfig, StoreConfig, TableConfig, TierConfig
from embstore.server import ServerSettings, create_app
from embstore.server.testing import ServerThread, free_port

TOKEN = "audit-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BINARY = "application/octet-stream"
BIN = {"Content-Type": BINARY}
DIM = 4
MAX_IDS = 16
MAX_BODY = 8192
ROWS = {"f": 64, "res": 32, "h": 16, "qr": 64, "f16": 32}  # ids read back to snapshot each table
I64_MIN, I64_MAX = -(2**63), 2**63 - 1


def make_store(path: Path) -> None:
    row = 4 * DIM
    cfg = StoreConfig((
        TableConfig("f", 64, DIM, tiers=(TierConfig("dram", 8 * row, "lru"), TierConfig("ssd"))),
        TableConfig("res", 32, DIM, tiers=(TierConfig("dram", 32 * row), TierConfig("mmap"))),
        TableConfig("h", 16, DIM, hash=HashConfig("mod", seed=5), tiers=(TierConfig("dram", "4KiB"), TierConfig("mmap"))),
        TableConfig("qr", 64, DIM, hash=HashConfig("qr", collisions=4),
                    tiers=(TierConfig("dram", "4KiB"), TierConfig("mmap"))),
        TableConfig("f16", 32, DIM, dtype="float16", tiers=(TierConfig("mmap"),)),
    ))
    embstore.create(path, cfg).close()


from test_server_fuzz import ErrorRecords  # noqa: E402  (the fuzz suite's recorder)

ERRORS = ErrorRecords()


def i64(*values: int) -> bytes:
    return np.array(values, "<i8").tobytes()


def rows_of(resp: httpx.Response) -> np.ndarray:
    assert resp.status_code == 200, resp.text
    if resp.headers["content-type"] == BINARY:
        n, d = map(int, resp.headers["X-Embedding-Shape"].split(","))
        return np.frombuffer(resp.content, "<f4").reshape(n, d)
    body = resp.json()
    return np.array(body["embeddings"], np.float32).reshape(-1, body["dim"])


def read_all(http: httpx.Client) -> dict[str, np.ndarray]:
    """Rows of ids 0..ROWS[t]-1 of every table, as the server answers them (binary)."""
    out = {}
    for name, n in ROWS.items():
        for lo in range(0, n, MAX_IDS):
            resp = http.post(f"/v1/tables/{name}/lookup", content=np.arange(lo, min(n, lo + MAX_IDS), dtype="<i8")
                             .tobytes(), headers=BIN | {"Accept": BINARY})
            out.setdefault(name, []).append(rows_of(resp))
        out[name] = np.concatenate(out[name])
    return out


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(np.ascontiguousarray(a, np.float32).view(np.uint32),
                                                 np.ascontiguousarray(b, np.float32).view(np.uint32))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(http client, rows every table started with, server thread)."""
    path = tmp_path_factory.mktemp("audit") / "store"
    make_store(path)
    settings = ServerSettings(store=path, token=TOKEN, max_ids=MAX_IDS, max_body_bytes=MAX_BODY,
                              request_timeout=20, flush_interval=0)
    loggers = [logging.getLogger(), logging.getLogger("uvicorn"), logging.getLogger("uvicorn.error")]
    for logger in loggers:
        logger.addHandler(ERRORS)
    try:
        with ServerThread(create_app(settings)) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
            yield http, read_all(http), srv
    finally:
        for logger in loggers:
            logger.removeHandler(ERRORS)


@pytest.fixture(autouse=True)
def _each_test_logs_no_server_error() -> Any:
    ERRORS.records.clear()
    yield
    assert not ERRORS.records, [r.getMessage() for r in ERRORS.records]


def assert_unchanged(http: httpx.Client, start: dict[str, np.ndarray]) -> None:
    now = read_all(http)
    for name in ROWS:
        assert same_bits(now[name], start[name]), name


# --- refusals: status, message, nothing written --------------------------------------------------------------
ROW = [0.5] * DIM
CASES = [  # (id, method, path, request keyword arguments, status, words of the detail)
    # ids that are not int64 values, in JSON
    ("id 1.0", "POST", "/v1/tables/f/lookup", {"content": b'{"ids": [1.0]}'}, 400, "integer"),
    ("id 1.5", "POST", "/v1/tables/h/lookup", {"content": b'{"ids": [1.5]}'}, 400, "integer"),
    ("id true", "POST", "/v1/tables/h/lookup", {"content": b'{"ids": [true]}'}, 400, "integer"),
    ("id string", "POST", "/v1/tables/h/lookup", {"content": b'{"ids": ["3"]}'}, 400, "integer"),
    ("id nested", "POST", "/v1/tables/h/lookup", {"content": b'{"ids": [[3]]}'}, 400, "integer"),
    ("id 2**64", "POST", "/v1/tables/h/lookup", {"json": {"ids": [2**64]}}, 400, "less than or equal"),
    ("id NaN", "POST", "/v1/tables/qr/lookup", {"content": b'{"ids": [NaN]}'}, 400, "ids.0"),
    ("ids null", "POST", "/v1/tables/f/lookup", {"content": b'{"ids": null}'}, 400, "ids: input should be a valid array"),
    ("ids missing", "POST", "/v1/tables/f/lookup", {"content": b"{}"}, 400, "ids: field required"),
    ("extra key", "POST", "/v1/tables/f/lookup", {"json": {"ids": [1], "mode": "sum"}}, 400, "mode: extra"),
    # ids out of range (unhashed tables only)
    ("negative id", "POST", "/v1/tables/f/lookup", {"json": {"ids": [3, -1]}}, 400, "id -1 outside [0, 64)"),
    ("negative id resident", "POST", "/v1/tables/res/lookup", {"json": {"ids": [-5]}}, 400, "outside [0, 32)"),
    ("id = rows", "POST", "/v1/tables/f16/lookup", {"content": i64(32), "headers": BIN}, 400, "id 32 outside"),
    ("JSON sent as binary", "POST", "/v1/tables/f/lookup", {"content": b'{"ids":[1,2]}   ', "headers": BIN}, 400,
     "outside [0, 64)"),
    ("binary sent as JSON", "POST", "/v1/tables/f/lookup", {"content": i64(1, 2)}, 400, "malformed body"),
    ("binary of 12 bytes", "POST", "/v1/tables/h/lookup", {"content": b"\0" * 12, "headers": BIN}, 400,
     "multiple of 8 bytes, got 12"),
    # offsets and modes
    ("offsets from 1", "POST", "/v1/tables/f/pooled", {"json": {"ids": [1, 2], "offsets": [1, 2]}}, 400,
     "offsets[0] must be 0"),
    ("offsets short of len", "POST", "/v1/tables/res/pooled", {"json": {"ids": [1, 2], "offsets": [0, 1]}}, 400,
     "offsets[-1] must equal len(ids) = 2"),
    ("offsets past len", "POST", "/v1/tables/h/pooled", {"json": {"ids": [1, 2], "offsets": [0, 3]}}, 400,
     "offsets[-1] must equal len(ids) = 2"),
    ("offsets falling", "POST", "/v1/tables/qr/pooled", {"json": {"ids": [1, 2, 3], "offsets": [0, 2, 1, 3]}}, 400,
     "non-decreasing"),
    ("offsets empty", "POST", "/v1/tables/f/pooled", {"json": {"ids": [], "offsets": []}}, 400, "num_bags + 1"),
    ("mode max", "POST", "/v1/tables/f/pooled", {"json": {"ids": [1], "offsets": [0, 1], "mode": "max"}}, 400,
     "mode"),
    ("mode max binary", "POST", "/v1/tables/f/pooled",
     {"content": i64(0, 1, 1), "headers": BIN, "params": {"num_bags": 1, "mode": "max"}}, 400, "mode"),
    ("mode twice", "POST", "/v1/tables/f/pooled",
     {"json": {"ids": [1], "offsets": [0, 1], "mode": "sum"}, "params": {"mode": "mean"}}, 400, "mode given twice"),
    ("binary offsets falling", "POST", "/v1/tables/h/pooled",
     {"content": i64(0, 2, 1, 2, 7, 8), "headers": BIN, "params": {"num_bags": 3}}, 400, "non-decreasing"),
    ("binary num_bags -1", "POST", "/v1/tables/h/pooled",
     {"content": i64(0), "headers": BIN, "params": {"num_bags": -1}}, 400, "num_bags"),
    # limits
    ("too many ids", "POST", "/v1/tables/qr/lookup", {"json": {"ids": [0] * (MAX_IDS + 1)}}, 413,
     f"{MAX_IDS + 1} ids in one request; this server allows at most {MAX_IDS}"),
    ("too many binary ids", "POST", "/v1/tables/res/lookup", {"content": b"\0" * 8 * (MAX_IDS + 1), "headers": BIN},
     413, "at most"),
    ("too many bags", "POST", "/v1/tables/f/pooled", {"json": {"ids": [], "offsets": [0] * (MAX_IDS + 2)}}, 413,
     "bags"),
    ("body too large", "POST", "/v1/tables/f/lookup", {"content": b" " * (MAX_BODY + 1)}, 413, "exceeds"),
    ("chunked body too large", "POST", "/v1/tables/f/lookup", {"content": [b" " * 1000] * (MAX_BODY // 1000 + 1)},
     413, "exceeds"),
    # unknown tables, odd names
    ("unknown table", "POST", "/v1/tables/nope/lookup", {"json": {"ids": [1]}}, 404, "no table 'nope'"),
    ("table in other case", "POST", "/v1/tables/F/pooled", {"json": {"ids": [], "offsets": [0]}}, 404, "'F'"),
    ("encoded name", "GET", "/v1/tables/%66%31", {}, 404, "'f1'"),
    ("encoded space", "POST", "/v1/tables/f%20/lookup", {"json": {"ids": [1]}}, 404, "'f '"),
    ("encoded slash", "POST", "/v1/tables/f%2Fx/lookup", {"json": {"ids": [1]}}, 404, "no such path"),
    ("unknown model", "POST", "/v1/models/f/predict", {"json": {"dense": [], "sparse": {}}}, 404, "no model 'f'"),
    # writes: token, shapes, values, tables that take none; each must leave every row as it was
    ("no token", "PUT", "/v1/tables/f/rows", {"json": {"ids": [1], "embeddings": [ROW]}}, 401, "Bearer TOKEN"),
    ("wrong token", "PUT", "/v1/tables/f/rows",
     {"json": {"ids": [1], "embeddings": [ROW]}, "headers": {"Authorization": "Bearer audit-tokenx"}}, 401, "wrong"),
    ("basic scheme", "PUT", "/v1/tables/f/rows",
     {"json": {"ids": [1], "embeddings": [ROW]}, "headers": {"Authorization": f"Basic {TOKEN}"}}, 401, "Bearer"),
    ("token only", "PUT", "/v1/tables/f/rows",
     {"json": {"ids": [1], "embeddings": [ROW]}, "headers": {"Authorization": TOKEN}}, 401, "Bearer"),
    ("fewer rows than ids", "PUT", "/v1/tables/f/rows", {"json": {"ids": [1, 2], "embeddings": [ROW]}, "headers": AUTH},
     422, "2 ids but 1 rows"),
    ("more rows than ids", "PUT", "/v1/tables/res/rows",
     {"json": {"ids": [1], "embeddings": [ROW, ROW]}, "headers": AUTH}, 422, "1 ids but 2 rows"),
    ("rows too narrow", "PUT", "/v1/tables/h/rows",
     {"json": {"ids": [1, 2], "embeddings": [ROW[:-1], ROW[:-1]]}, "headers": AUTH}, 422, "shape (2, 4)"),
    ("rows ragged", "PUT", "/v1/tables/f/rows",
     {"json": {"ids": [1, 2], "embeddings": [ROW, ROW + [1.0]]}, "headers": AUTH}, 422, "differ in length"),
    ("row NaN", "PUT", "/v1/tables/res/rows",
     {"content": b'{"ids": [0, 1], "embeddings": [[0, 0, 0, 0], [0, 0, NaN, 0]]}', "headers": AUTH}, 422, "row 1"),
    ("row -Infinity", "PUT", "/v1/tables/h/rows",
     {"content": b'{"ids": [1], "embeddings": [[-Infinity, 0, 0, 0]]}', "headers": AUTH}, 422, "finite"),
    ("row beyond float32", "PUT", "/v1/tables/f/rows",
     {"content": b'{"ids": [1], "embeddings": [[0, 0, 0, 1%s]]}' % (b"0" * 40), "headers": AUTH}, 422, "finite"),
    ("row beyond float16", "PUT", "/v1/tables/f16/rows",
     {"json": {"ids": [1], "embeddings": [[0, 0, 0, 65520.0]]}, "headers": AUTH}, 422, "float16"),
    ("row of strings", "PUT", "/v1/tables/f/rows",
     {"json": {"ids": [1], "embeddings": [["0", "0", "0", "0"]]}, "headers": AUTH}, 400, "valid number"),
    ("id out of range in a write", "PUT", "/v1/tables/f/rows",
     {"json": {"ids": [1, 64], "embeddings": [ROW, ROW]}, "headers": AUTH}, 400, "id 64 outside"),
    ("negative id in a write", "PUT", "/v1/tables/res/rows",
     {"json": {"ids": [-1], "embeddings": [ROW]}, "headers": AUTH}, 400, "id -1 outside"),
    ("write to a QR table", "PUT", "/v1/tables/qr/rows",
     {"json": {"ids": [1], "embeddings": [ROW]}, "headers": AUTH}, 400, "QR-hashed"),
    ("too many rows", "PUT", "/v1/tables/h/rows",
     {"json": {"ids": list(range(MAX_IDS + 1)), "embeddings": [ROW] * (MAX_IDS + 1)}, "headers": AUTH}, 413,
     "at most 16"),
    ("binary write", "PUT", "/v1/tables/f/rows", {"content": i64(1) + b"\0" * 16, "headers": AUTH | BIN}, 400,
     "takes a JSON body"),
    ("write over the body limit", "PUT", "/v1/tables/f/rows", {"content": b" " * (MAX_BODY + 1), "headers": AUTH},
     413, "exceeds"),
    ("write to an unknown table", "PUT", "/v1/tables/zz/rows",
     {"json": {"ids": [1], "embeddings": [ROW]}, "headers": AUTH}, 404, "no table 'zz'"),
]


@pytest.mark.parametrize("method, path, kw, status, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_refusal_has_the_spec_status_names_the_problem_and_changes_nothing(server, method, path, kw, status, words):
    http, start, _ = server
    resp = http.request(method, path, **kw)
    assert resp.status_code == status, resp.text
    detail = resp.json()["detail"]
    assert words.lower() in detail.lower(), detail
    if status == 401:
        assert resp.headers["WWW-Authenticate"] == "Bearer"
    if method == "PUT":
        assert_unchanged(http, start)
    assert http.get("/healthz").json() == {"status": "ok"}


# --- accepted edge requests: exactly the rows ------------------------------------------------------------
def test_any_int64_is_an_id_of_a_hashed_table_and_repeats_agree(server):
    http, _, _ = server
    ids = [I64_MIN, -1, 0, 1, I64_MAX, -1]
    for name in ("h", "qr"):
        js = rows_of(http.post(f"/v1/tables/{name}/lookup", json={"ids": ids}))
        bn = rows_of(http.post(f"/v1/tables/{name}/lookup", content=i64(*ids), headers=BIN | {"Accept": BINARY}))
        assert same_bits(js, bn) and same_bits(js[1], js[5]) and js.shape == (6, DIM)


@pytest.mark.parametrize("name", list(ROWS))
def test_empty_requests_answer_zero_rows(server, name):
    http, _, _ = server
    for resp in (http.post(f"/v1/tables/{name}/lookup", json={"ids": []}),
                 http.post(f"/v1/tables/{name}/lookup", content=b"", headers=BIN | {"Accept": BINARY}),
                 http.post(f"/v1/tables/{name}/pooled", json={"ids": [], "offsets": [0]}),
                 http.post(f"/v1/tables/{name}/pooled", content=i64(0), headers=BIN | {"Accept": BINARY},
                           params={"num_bags": 0})):
        assert rows_of(resp).shape == (0, DIM)


@pytest.mark.parametrize("name", list(ROWS))
def test_pooled_bags_equal_their_rows_summed_in_both_protocols(server, name):
    """Empty bags, repeats and bags served twice (the second time from the pooled cache) give the sum or
    mean of the rows the lookup answers."""
    http, start, _ = server
    ids, offsets = [3, 3, 1, 0, 2, 3], [0, 0, 3, 3, 6]
    rows = start[name][ids].astype(np.float64)
    for mode in ("sum", "mean"):
        want = np.stack([rows[a:b].sum(0) / (max(b - a, 1) if mode == "mean" else 1)
                         for a, b in zip(offsets[:-1], offsets[1:])])
        for _ in range(2):
            js = rows_of(http.post(f"/v1/tables/{name}/pooled", json={"ids": ids, "offsets": offsets, "mode": mode}))
            bn = rows_of(http.post(f"/v1/tables/{name}/pooled", content=i64(*offsets, *ids),
                                   params={"num_bags": 4, "mode": mode}, headers=BIN | {"Accept": BINARY}))
            assert same_bits(js, bn)
            np.testing.assert_allclose(js, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("ctype", ["application/json; charset=utf-8", "text/plain", "application/x-www-form-urlencoded",
                                   None])
def test_a_json_body_is_read_whatever_its_text_content_type(server, ctype):
    http, start, _ = server
    resp = http.post("/v1/tables/f/lookup", content=b'{"ids": [5, 2]}',
                     headers={"Content-Type": ctype} if ctype else {})
    assert same_bits(rows_of(resp), start["f"][[5, 2]])


@pytest.mark.parametrize("ctype", ["application/octet-stream; charset=binary", "Application/Octet-Stream",
                                   "application/octet-stream ;charset=binary"])
def test_a_binary_content_type_with_parameters_is_binary(server, ctype):
    http, start, _ = server
    resp = http.post("/v1/tables/res/lookup", content=i64(7, 0), headers={"Content-Type": ctype})
    assert same_bits(rows_of(resp), start["res"][[7, 0]])


@pytest.mark.parametrize("accept, binary", [
    ("application/octet-stream;q=0.5, */*;q=0.9", False),  # */* ranks JSON above
    ("application/octet-stream;q=0.5, application/*;q=0.4", True),
    ("APPLICATION/OCTET-STREAM", True),
    ("application/json;q=0, application/octet-stream;q=0.1", True),
    ("application/octet-stream;q=0", False),
    ("application/octet-stream;q=nan", False),
    ("application/octet-stream;q=abc, application/json", False),
    ("application/octet-streamx", False),
    ("text/html, application/octet-stream;level=1", True),
    ("application/json, application/octet-stream", True),  # a tie picks binary
])
def test_accept_variants_choose_the_answer_format_and_the_same_bits(server, accept, binary):
    http, start, _ = server
    resp = http.post("/v1/tables/h/lookup", json={"ids": [1, 2]}, headers={"Accept": accept})
    assert (resp.headers["content-type"] == BINARY) is binary, resp.headers
    assert same_bits(rows_of(resp), start["h"][[1, 2]])


# --- the connection and the counters ------------------------------------------------------------------------
def raw_exchange(srv: ServerThread, data: bytes, answers: int) -> list[bytes]:
    """Send ``data`` on one connection and read ``answers`` HTTP answers (status lines) back."""
    with socket.create_connection((srv.host, srv.port), timeout=10) as s:
        s.sendall(data)
        buf = b""
        deadline = time.monotonic() + 10
        while buf.count(b"HTTP/1.1 ") < answers and time.monotonic() < deadline:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    return [line.split(b"\r\n")[0] for line in buf.split(b"HTTP/1.1 ")[1:]]


def test_a_refused_body_leaves_its_keep_alive_connection_usable(server):
    """A 413 answered from Content-Length (body unread), one found while a chunked body streams in, and a
    400 - each followed on the same connection by a good request, which must be answered 200."""
    _, _, srv = server
    good = b'{"ids": [1]}'
    good_req = b"POST /v1/tables/f/lookup HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(good), good)
    big = b" " * (MAX_BODY + 10)
    declared = b"POST /v1/tables/f/lookup HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(big), big)
    chunked = (b"POST /v1/tables/f/lookup HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
               + b"%x\r\n%s\r\n0\r\n\r\n" % (len(big), big))
    bad = b"POST /v1/tables/f/lookup HTTP/1.1\r\nHost: x\r\nContent-Length: 7\r\n\r\n{\"ids\":"
    for first, status in ((declared, b"413"), (chunked, b"413"), (bad, b"400")):
        lines = raw_exchange(srv, first + good_req, 2)
        assert [line[:3] for line in lines] == [status, b"200"], lines


def test_expect_100_continue_over_the_limit_is_413_without_the_body(server):
    _, _, srv = server
    lines = raw_exchange(srv, b"PUT /v1/tables/f/rows HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                              b"Authorization: Bearer " + TOKEN.encode() + b"\r\nContent-Length: %d\r\n\r\n"
                         % (MAX_BODY + 1), 1)
    assert lines and lines[0].startswith(b"413"), lines


def scrape(http: httpx.Client) -> tuple[dict[tuple[str, str, str], float], float]:
    """({(method, endpoint, status): requests}, requests in flight) of /metrics."""
    counts, in_flight = {}, None
    for fam in text_string_to_metric_families(http.get("/metrics").text):
        for s in fam.samples:
            if s.name == "embstore_http_requests_total":
                counts[(s.labels["method"], s.labels["endpoint"], s.labels["status"])] = s.value
            elif s.name == "embstore_http_requests_in_flight":
                in_flight = s.value
    return counts, in_flight


def test_metrics_count_each_answer_once_under_its_route_and_status(server):
    http, _, _ = server
    sent = [("POST", "/v1/tables/f/lookup", {"json": {"ids": [1]}}),
            ("POST", "/v1/tables/f/lookup", {"json": {"ids": [1.5]}}),
            ("POST", "/v1/tables/nope/lookup", {"json": {"ids": [1]}}),
            ("POST", "/v1/tables/f/lookup", {"content": b" " * (MAX_BODY + 1)}),
            ("POST", "/v1/tables/f/lookup", {"content": [b" " * 1000] * (MAX_BODY // 1000 + 1)}),
            ("POST", "/v1/tables/h/pooled", {"json": {"ids": [1], "offsets": [0, 2]}}),
            ("PUT", "/v1/tables/f/rows", {"json": {"ids": [1], "embeddings": [ROW]}}),
            ("PUT", "/v1/tables/f/rows", {"json": {"ids": [1], "embeddings": [[1.0]]}, "headers": AUTH}),
            ("GET", "/v1/tables/qr", {}),
            ("HEAD", "/healthz", {}),
            ("DELETE", "/v1/tables/f/lookup", {}),
            ("GET", "/no/such/path", {})]
    before, _ = scrape(http)
    want: dict[tuple[str, str, str], int] = {}
    for method, path, kw in sent:
        resp = http.request(method, path, **kw)
        endpoint = "unmatched" if path == "/no/such/path" else \
            path.replace("/f/", "/{name}/").replace("/nope/", "/{name}/").replace("/h/", "/{name}/") \
                .replace("/qr", "/{name}")
        key = (method, endpoint, str(resp.status_code))
        want[key] = want.get(key, 0) + 1
    assert {k[2] for k in want} == {"200", "400", "401", "404", "405", "413", "422"}
    after, in_flight = scrape(http)
    got = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
    got.pop(("GET", "/metrics", "200"), None)  # the first scrape itself
    assert {k: v for k, v in got.items() if v} == want
    assert in_flight == 1  # the scrape being answered


# --- the client ------------------------------------------------------------------------------------------
@pytest.fixture(params=[True, False], ids=["binary", "json"])
def client(server, request):
    with LookupClient(server[2].url, token=TOKEN, binary=request.param) as c:
        yield c


CLIENT_REFUSALS = [  # (id, call, status, words the message holds)
    ("bad id", lambda c: c.lookup("f", [64]), 400, "id 64 outside [0, 64)"),
    ("bad offsets", lambda c: c.lookup_pooled("f", [1, 2], [0, 1]), 400, "offsets[-1] must equal len(ids) = 2"),
    ("bad mode", lambda c: c.lookup_pooled("f", [1], [0, 1], mode="max"), 400, "mode"),
    ("unknown table", lambda c: c.lookup("nope", [1]), 404, "no table 'nope'; known tables:"),
    ("unknown table detail", lambda c: c.table("a b?c#d"), 404, "no table 'a b?c#d'"),  # quoted by the client
    ("unknown model", lambda c: c.predict("m", np.zeros((1, 2)), {"t": [[1]]}), 404, "no model 'm'"),
    ("too many ids", lambda c: c.lookup("h", np.zeros(MAX_IDS + 1, np.int64)), 413, "at most 16"),
    ("too many bags", lambda c: c.lookup_pooled("h", [], np.zeros(MAX_IDS + 2, np.int64)), 413, "bags"),
    ("wrong dim", lambda c: c.update("f", [1], np.zeros((1, DIM + 1), np.float32)), 422, "shape (1, 4)"),
    ("rows per id", lambda c: c.update("f", [1, 2], np.zeros((1, DIM), np.float32)), 422, "2 ids but 1 rows"),
    ("beyond float16", lambda c: c.update("f16", [1], np.full((1, DIM), 1e5, np.float32)), 422, "float16"),
    ("QR write", lambda c: c.update("qr", [1], np.zeros((1, DIM), np.float32)), 400, "QR-hashed"),
]


@pytest.mark.parametrize("call, status, words", [c[1:] for c in CLIENT_REFUSALS], ids=[c[0] for c in CLIENT_REFUSALS])
def test_client_raises_server_error_with_the_servers_status_and_message(server, client, call, status, words):
    with pytest.raises(ServerError) as info:
        call(client)
    assert info.value.status_code == status
    assert words in info.value.message and str(info.value).startswith(f"HTTP {status}: ")
    assert_unchanged(server[0], server[1])


@pytest.mark.parametrize("token", [None, "wrong"])
def test_client_without_the_right_token_gets_401_and_writes_nothing(server, token):
    http, start, srv = server
    with LookupClient(srv.url, token=token) as c, pytest.raises(ServerError) as info:
        c.update("f", [1], np.ones((1, DIM), np.float32))
    assert info.value.status_code == 401 and "Bearer" in info.value.message
    assert_unchanged(http, start)


@pytest.mark.parametrize("binary", [True, False])
@pytest.mark.parametrize("call", [lambda c: c.lookup("f", [1]), lambda c: c.lookup_pooled("f", [1], [0, 1]),
                                  lambda c: c.update("f", [1], np.zeros((1, DIM))), lambda c: c.tables()],
                         ids=["lookup", "pooled", "update", "tables"])
def test_a_down_server_is_an_httpx_connect_error(binary, call):
    with LookupClient(f"http://127.0.0.1:{free_port()}", binary=binary, timeout=5) as c:
        with pytest.raises(httpx.ConnectError):
            call(c)


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.uint8, np.uint32, np.uint64, ">i8"])
def test_client_converts_integer_ids_of_any_width(server, client, dtype):
    _, start, _ = server
    ids = np.array([5, 0, 31], dtype=dtype)
    assert same_bits(client.lookup("res", ids), start["res"][[5, 0, 31]])
    got = client.lookup_pooled("res", ids, np.array([0, 2, 3], dtype=dtype), mode="sum")
    np.testing.assert_allclose(got, np.stack([start["res"][[5, 0]].sum(0), start["res"][31]]), rtol=1e-6)


@pytest.mark.parametrize("ids", [np.array([1.0, 2.0]), np.array([True]), np.array(["1"]), np.array([[1, 2]]),
                                 np.int64(3), [1, 2.5], [2**63]], ids=["float", "bool", "str", "2-D", "scalar",
                                                                      "mixed list", "beyond int64"])
def test_client_refuses_ids_that_are_not_integers(ids):
    with LookupClient("http://127.0.0.1:1") as c:
        for call in (lambda: c.lookup("f", ids), lambda: c.update("f", ids, np.zeros((1, DIM)))):
            with pytest.raises(embstore.InvalidInputError):
                call()


@pytest.mark.parametrize("rows", [np.full((1, DIM), 0.25, np.float16), np.full((1, DIM), 0.25, np.float64),
                                  np.full((1, DIM), 1, np.int32), [[0.25] * DIM]], ids=["f16", "f64", "i32", "list"])
def test_client_converts_real_rows_to_float32(server, rows):
    http, start, srv = server
    with LookupClient(srv.url, token=TOKEN) as c:
        try:
            c.update("h", [3], rows)
            assert same_bits(c.lookup("h", [3]), np.asarray(rows, np.float32))
        finally:
            c.update("h", [3], start["h"][[3]])  # ids 0..15 of "h": put back what id 3 read
    assert_unchanged(http, start)


@pytest.mark.parametrize("rows, words", [
    (np.full((1, DIM), 1 + 2j, np.complex64), "complex"),  # numpy would drop the imaginary part, with a warning
    (np.array([[0.5, 0.5, 0.5, 1j]]), "complex"),
    ([[10**400, 0, 0, 0]], "numbers"),  # a Python int no float holds: OverflowError, not a typed error
    ([[0.5, 0.5, 0.5, 0.5], [0.5]], "numbers"),
])
def test_client_refuses_rows_that_are_not_real_numbers(rows, words):
    with LookupClient("http://127.0.0.1:1") as c, pytest.raises(embstore.InvalidRowsError) as info:
        c.update("f", [1, 2][:len(rows)], rows)
    assert words in str(info.value)


def test_client_refuses_complex_dense_features():
    with LookupClient("http://127.0.0.1:1") as c, pytest.raises(embstore.InvalidInputError, match="complex"):
        c.predict("m", np.zeros((1, 3), np.complex128), {"t": [[1]]})


@pytest.mark.parametrize("ids, offsets, want", [
    ([], [0], []),  # no bags (a batch of no samples): not one empty bag
    ([], [0, 0], [[]]),
    ([7], [0, 1], [[7]]),
    ([7, 3, 3, 9, 1], [0, 3, 3, 5], [[7, 3, 3], [], [9, 1]]),
    (np.array([4, 5], np.int32), np.array([0, 0, 2, 2], np.uint8), [[], [4, 5], []]),
])
def test_bags_gives_one_list_per_bag(ids, offsets, want):
    got = bags(ids, offsets)
    assert got == want and len(got) == len(offsets) - 1
    assert all(type(i) is int for bag in got for i in bag)


def test_the_server_is_healthy_and_every_row_as_it_started(server):
    http, start, _ = server
    assert http.get("/healthz").json() == {"status": "ok"}
    assert_unchanged(http, start)
    assert json.loads(http.get("/v1/tables").text) == [
        {"name": n, "num_embeddings": {"f": 64, "res": 32, "h": 16, "qr": 64, "f16": 32}[n], "dim": DIM,
         "dtype": "float16" if n == "f16" else "float32"} for n in ROWS]
