"""Which ``endpoint`` label /metrics gives a refused request, under a real uvicorn server.

A request to a real route keeps that route's template as its label whoever refuses it: the middleware
(a body over the server's limit by its Content-Length), the route itself (a body over the limit sent
chunked, a malformed body, a missing token, an unknown table) or Starlette's router (a method the route
does not take). Only a path that no route matches is ``unmatched``. Each case is checked by the change
it makes to ``embstore_http_requests_total`` in the text of GET /metrics: exactly one series, by one.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import embstore
from embstore.config import StoreConfig, TableConfig, TierConfig
from embstore.server import ServerSettings, create_app
from embstore.server.middleware import METHODS
from embstore.server.testing import ServerThread

TOKEN = "labels-token"
LIMIT = 4096  # the server's body limit in bytes
BINARY = {"Content-Type": "application/octet-stream"}
LOOKUP, ROWS, TABLE = "/v1/tables/{name}/lookup", "/v1/tables/{name}/rows", "/v1/tables/{name}"


def _chunks(total: int) -> Any:
    """A body without Content-Length (httpx sends a generator chunked)."""
    for _ in range(total // 1024):
        yield b"\0" * 1024


# (id, method, path, request keyword arguments, status, endpoint label)
CASES = [
    ("lookup-ok", "POST", "/v1/tables/t/lookup", {"json": {"ids": [1, 2]}}, 200, LOOKUP),
    ("lookup-413-content-length", "POST", "/v1/tables/t/lookup",
     {"content": b"\0" * (LIMIT + 8), "headers": BINARY}, 413, LOOKUP),
    ("lookup-413-chunked", "POST", "/v1/tables/t/lookup", {"content": _chunks, "headers": BINARY}, 413, LOOKUP),
    ("lookup-400-malformed", "POST", "/v1/tables/t/lookup",
     {"content": b"{not json", "headers": {"Content-Type": "application/json"}}, 400, LOOKUP),
    ("lookup-404-unknown-table", "POST", "/v1/tables/nope/lookup", {"json": {"ids": [1]}}, 404, LOOKUP),
    ("lookup-405-method", "GET", "/v1/tables/t/lookup", {}, 405, LOOKUP),
    ("table-404-unknown-table", "GET", "/v1/tables/nope", {}, 404, TABLE),
    ("rows-401-no-token", "PUT", "/v1/tables/t/rows", {"json": {"ids": [1], "embeddings": [[0.0] * 4]}}, 401, ROWS),
    ("rows-413-before-token", "PUT", "/v1/tables/t/rows", {"content": b"\0" * (LIMIT + 1)}, 413, ROWS),
    ("rows-413-with-token", "PUT", "/v1/tables/t/rows",
     {"content": b"\0" * (LIMIT + 1), "headers": {"Authorization": f"Bearer {TOKEN}"}}, 413, ROWS),
    ("reload-413", "POST", "/v1/admin/reload", {"content": b"\0" * (LIMIT + 1)}, 413, "/v1/admin/reload"),
    ("unknown-path-404", "GET", "/v1/nothing/here", {}, 404, "unmatched"),
    ("unknown-path-413", "POST", "/v1/nothing/here", {"content": b"\0" * (LIMIT + 1)}, 413, "unmatched"),
    ("odd-method-unknown-path", "BREW", "/pot", {}, 404, "unmatched"),
]


def _requests(client: httpx.Client) -> Counter:
    """(method, endpoint, status) -> requests answered, from GET /metrics (its own scrapes left out)."""
    text = client.get("/metrics").text
    out: Counter = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "embstore_http_requests_total" and sample.labels["endpoint"] != "/metrics":
                key = (sample.labels["method"], sample.labels["endpoint"], int(sample.labels["status"]))
                out[key] = int(sample.value)
    return out


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path: Path = tmp_path_factory.mktemp("labels") / "store"
    cfg = StoreConfig((TableConfig("t", 64, 4, tiers=(TierConfig("dram", 64 * 16), TierConfig("mmap"))),))
    embstore.create(path, cfg).close()
    settings = ServerSettings(store=path, token=TOKEN, max_body_bytes=LIMIT)
    with ServerThread(create_app(settings)) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        yield c


@pytest.mark.parametrize("method, path, kwargs, status, endpoint", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_refused_request_keeps_its_route_label(client: httpx.Client, method: str, path: str, kwargs: dict,
                                                 status: int, endpoint: str) -> None:
    kwargs = dict(kwargs)
    if callable(kwargs.get("content")):
        kwargs["content"] = kwargs["content"](4 * LIMIT)
    before = _requests(client)
    resp = client.request(method, path, **kwargs)
    assert resp.status_code == status, resp.text
    after = _requests(client)
    changed = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    assert changed == {(method if method in METHODS else "OTHER", endpoint, status): 1}


def test_the_body_limit_still_refuses_before_reading(client: httpx.Client) -> None:
    """The 413 by Content-Length is still the middleware's (its message names the declared size), and a
    lookup after it answers normally: resolving the label changed nothing about the request."""
    resp = client.post("/v1/tables/t/lookup", content=b"\0" * (LIMIT + 8), headers=BINARY)
    assert resp.status_code == 413 and f"{LIMIT + 8} bytes" in resp.json()["detail"]
    ok = client.post("/v1/tables/t/lookup", json={"ids": [5]})
    assert ok.status_code == 200 and np.array(ok.json()["embeddings"]).size == 4
