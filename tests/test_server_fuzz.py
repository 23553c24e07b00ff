"""Adversarial audit of the HTTP server (SPEC section 5): whatever a client sends, a 4xx that says why.

One real uvicorn (``server.testing.ServerThread``) serves a small store for the whole module: ``f32``
(an LRU cache over an SSD home: lookups go through the batcher), ``res`` (memory-resident: answered on
the event loop), ``i8`` and ``f16`` (quantised rows), ``hashed`` (mod-hashed: any int64 is an id), and an
untrained DLRM ``m`` over tables of its own (``ma``, and ``mb``, mod-hashed). Hypothesis sends every route
malformed requests: JSON of the wrong types (strings, floats, bools, null, nested lists where ints go;
ints beyond int64; NaN / Infinity literals), empty, truncated and non-UTF-8 bodies, wrong top-level
types, extra and missing keys, binary bodies of odd sizes and wrong content types, bad query parameters,
offsets that fall or run out of range, odd names in paths, wrong methods.

Each answer is checked against a reference validator written here from the SPEC: the status it names
(400 malformed / bad ids or offsets, 401 token, 404 unknown table or model, 413 over a limit, 422 wrong
shapes or non-finite values), never a 5xx, always a JSON ``detail``; an accepted read answers the rows of
a numpy model of every table's physical rows (bit for bit; pooled within float32 rounding). After every
write, refused or accepted, every table must read back exactly as the model says: a refused write changes
nothing, an accepted one exactly its rows (rounded as the table stores them). Refused requests are logged
in one line saying what was wrong, never with a traceback.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

import embstore
from embstore.config import HashConfig, StoreConfig, TableConfig, TierConfig
from embstore.hashing import ModHash
from embstore.server import ServerSettings, create_app
from embstore.server.testing import ServerThread
from embstore.training.dlrm import DLRM
from embstore.training.ebc import TieredEmbeddingBagCollection
from embstore.training.registry import ModelSpec, save_model
from test_server import rows_of, same_bits

TOKEN = "fuzz-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BINARY = "application/octet-stream"
DIM = 4
MAX_IDS = 64  # the server's id (and bag, and sample) limit per request
MAX_BODY = 1 << 15  # the server's body limit in bytes
I64_MIN, I64_MAX = -(2**63), 2**63 - 1
NUM_DENSE = 3


@dataclass(frozen=True)
class Tab:
    rows: int
    dtype: str = "float32"
    seed: int | None = None  # mod-hashed with this seed; None: ids are rows


TABLES = {"f32": Tab(64), "res": Tab(32), "i8": Tab(40, "int8"), "f16": Tab(32, "float16"),
          "hashed": Tab(16, seed=3), "ma": Tab(20), "mb": Tab(10, seed=0)}
WRITABLE = ("f32", "res", "f16", "hashed", "ma")  # valid writes go here (the model rounds float16 rows; int8 is
# lossy in a way the model does not mirror, so the int8 table only ever sees refused writes)
MODEL_TABLES = ("ma", "mb")


def make_store(path: Path) -> None:
    row = 4 * DIM
    cfg = StoreConfig((
        TableConfig("f32", 64, DIM, tiers=(TierConfig("dram", 8 * row, "lru"), TierConfig("ssd"))),
        TableConfig("res", 32, DIM, tiers=(TierConfig("dram", 32 * row), TierConfig("mmap"))),
        TableConfig("i8", 40, DIM, dtype="int8", tiers=(TierConfig("dram", "4KiB", "lru"), TierConfig("mmap"))),
        TableConfig("f16", 32, DIM, dtype="float16", tiers=(TierConfig("mmap"),)),
        TableConfig("hashed", 16, DIM, hash=HashConfig("mod", seed=3),
                    tiers=(TierConfig("dram", "4KiB"), TierConfig("mmap"))),
        TableConfig("ma", 20, DIM, tiers=(TierConfig("dram", "64KiB"), TierConfig("mmap"))),
        TableConfig("mb", 10, DIM, hash=HashConfig("mod"), tiers=(TierConfig("dram", "64KiB"), TierConfig("mmap"))),
    ))
    with embstore.create(path, cfg) as store:
        spec = ModelSpec(MODEL_TABLES, DIM, NUM_DENSE, (8, DIM), (8, 1))
        torch.manual_seed(0)
        model = DLRM(TieredEmbeddingBagCollection(store, list(MODEL_TABLES)), 2, DIM, NUM_DENSE, spec.dense_arch,
                     spec.over_arch)
        save_model(store.path, "m", spec, model)


# --- the reference: every table's physical rows --------------------------------------------------------
class Model:
    """Physical rows of every table as the server must answer them, and how ids map to them."""

    def __init__(self, rows: dict[str, np.ndarray]) -> None:
        self.rows = rows
        self.hashes = {n: ModHash(t.rows, t.seed) for n, t in TABLES.items() if t.seed is not None}
        # ids reading every physical row of a table once, in row order (a hashed table: found by search)
        self.cover = {n: self._cover(n) for n in TABLES}

    def _cover(self, name: str) -> np.ndarray:
        if name not in self.hashes:
            return np.arange(TABLES[name].rows, dtype=np.int64)
        cand = np.arange(4096, dtype=np.int64)
        rows = self.hashes[name](cand)
        first = {int(r): int(i) for i, r in reversed(list(zip(cand, rows)))}
        assert len(first) == TABLES[name].rows
        return np.array([first[r] for r in range(TABLES[name].rows)], np.int64)

    def physical(self, name: str, ids: np.ndarray) -> np.ndarray | None:
        """Rows of ``ids``, or None when one is outside an unhashed table."""
        if name in self.hashes:
            return self.hashes[name](ids)
        if len(ids) and (ids.min() < 0 or ids.max() >= TABLES[name].rows):
            return None
        return ids

    def write(self, name: str, ids: np.ndarray, rows: np.ndarray) -> None:
        stored = rows.astype(np.float16).astype(np.float32) if TABLES[name].dtype == "float16" else rows
        self.rows[name][self.physical(name, ids)] = stored


class ErrorRecords(logging.Handler):
    """Every record logged at ERROR or with a traceback while the module's server runs: a client causes none."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR or record.exc_info:
            self.records.append(record)


SERVER_ERRORS = ErrorRecords()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(http client, model) of a server over a fresh store; the model starts as the rows on disk."""
    path = tmp_path_factory.mktemp("fuzz") / "store"
    make_store(path)
    with embstore.open(path) as store:
        rows = {n: store[n].read_physical(np.arange(t.rows, dtype=np.int64)) for n, t in TABLES.items()}
    settings_ = ServerSettings(store=path, token=TOKEN, max_ids=MAX_IDS, max_body_bytes=MAX_BODY,
                               request_timeout=20, flush_interval=0)
    loggers = [logging.getLogger(), logging.getLogger("uvicorn")]  # uvicorn's own do not propagate to the root
    for logger in loggers:
        logger.addHandler(SERVER_ERRORS)
    try:
        with ServerThread(create_app(settings_)) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
            model = Model(rows)
            assert_store_is(http, model)
            yield http, model, srv
    finally:
        for logger in loggers:
            logger.removeHandler(SERVER_ERRORS)


@pytest.fixture(autouse=True)
def _no_server_errors_yet() -> None:
    """Each test answers for the errors its own requests log."""
    SERVER_ERRORS.records.clear()


def assert_store_is(http: httpx.Client, model: Model) -> None:
    """Every physical row of every table reads back bit for bit as the model holds it."""
    for name in TABLES:
        resp = http.post(f"/v1/tables/{name}/lookup", content=model.cover[name].astype("<i8").tobytes(),
                         headers={"Content-Type": BINARY, "Accept": BINARY})
        got = rows_of(resp)
        assert same_bits(got, model.rows[name]), (name, np.argwhere(got != model.rows[name])[:5])


def send(http: httpx.Client, method: str, path: str, **kw: Any) -> httpx.Response:
    """The request; any answer but a 5xx, and a refusal carries a JSON ``detail`` saying why."""
    resp = http.request(method, path, **kw)
    assert resp.status_code < 500, (method, path, kw, resp.status_code, resp.text)
    assert not SERVER_ERRORS.records, [r.getMessage() for r in SERVER_ERRORS.records]  # logged before the answer
    if resp.status_code >= 400 and method != "HEAD":
        detail = resp.json()["detail"]
        assert isinstance(detail, str) and len(detail) > 5, resp.text
    return resp


def expect(resp: httpx.Response, status: int, what: Any) -> None:
    assert resp.status_code == status, (what, status, resp.status_code, resp.text)


# --- what goes into bodies ----------------------------------------------------------------------------------
# JSON values that are not an int64: the type confusions of the brief (NaN/Infinity are text, see below)
NOT_INT = st.one_of(st.floats(allow_nan=False, allow_infinity=False),
                    st.text(max_size=4), st.booleans(), st.none(), st.lists(st.integers(0, 3), max_size=2),
                    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
                    st.sampled_from([2**63, -(2**63) - 1, 2**64, 10**30, -(10**30)]))
# JSON values that are not a number
NOT_NUMBER = st.one_of(st.text(max_size=4), st.booleans(), st.none(), st.lists(st.floats(-1, 1), max_size=2),
                       st.dictionaries(st.text(max_size=2), st.integers(), max_size=1))
JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=5))
ANY_JSON = st.recursive(JSON_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                              st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                        max_leaves=12)
HOLE, HOLE_JSON = "<non-finite>", b'"<non-finite>"'  # a value's place, filled with one of these:
NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e39", "-1e39", "1e400", "-1e400"]  # as JSON text; 1e39: beyond float32
JUNK = [b"", b"null", b"[]", b"{}", b"{", b"\xff\xfe", b"\0" * 8, b'{"ids": [1,]}', b"{'ids': [1]}", b"[" * 300,
        b'{"ids":' + b"[" * 300, b'{"ids": [1] } x', b'\xef\xbb\xbf{"ids": [1]}', b'{"ids": [1], "ids": "x"}',
        b'{"ids": [1]}\0', b'{"ids": [1], "\\ud800": 1}']
RAW_JUNK = st.one_of(st.binary(max_size=24), st.sampled_from(JUNK))


def is_int64(x: Any) -> bool:
    return type(x) is int and I64_MIN <= x <= I64_MAX


def strict_json(raw: bytes) -> tuple[bool, Any]:
    """(parsed, value) of a body as a strict JSON parser reads it (no NaN / Infinity literals)."""
    def no_constant(_: str) -> Any:
        raise ValueError("not JSON")
    try:
        return True, json.loads(raw.decode("utf-8"), parse_constant=no_constant)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False, None


def ids_strategy(name: str, bad: bool = False) -> st.SearchStrategy[int]:
    """In-range ids of table ``name`` (any int64 for a hashed one); with ``bad``, out of range too."""
    t = TABLES[name]
    good = st.integers(I64_MIN, I64_MAX) if t.seed is not None else st.integers(0, t.rows - 1)
    if not bad:
        return good
    return st.one_of(good, st.integers(-3, t.rows + 2), st.sampled_from([I64_MIN, I64_MAX]))


def expected_rows(model: Model, name: str, ids: np.ndarray) -> np.ndarray | None:
    rows = model.physical(name, ids)
    return None if rows is None else model.rows[name][rows]


def pooled_reference(model: Model, name: str, ids: np.ndarray, offsets: np.ndarray, mode: str) -> np.ndarray:
    rows = expected_rows(model, name, ids).astype(np.float64)
    out = np.zeros((len(offsets) - 1, DIM))
    for b in range(len(offsets) - 1):
        bag = rows[offsets[b]:offsets[b + 1]]
        if len(bag):
            out[b] = bag.sum(0) / (len(bag) if mode == "mean" else 1)
    return out


NAMES = st.sampled_from(list(TABLES) * 3 + ["nope", "F32", "f32 ", "res\x00", "%00", "..%2f", "\u2603", "x" * 300])


def quoted(name: str) -> str:
    return quote(name, safe="")


FUZZ = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
FAST = settings(max_examples=60, **FUZZ)


# --- /lookup ------------------------------------------------------------------------------------------------
def lookup_json_status(model: Model, name: str, raw: bytes) -> tuple[int, np.ndarray | None]:
    """(status, ids) the SPEC gives a JSON lookup body; the body is parsed before the table is looked up."""
    ok, body = strict_json(raw)
    if not ok or not isinstance(body, dict) or set(body) != {"ids"} or not isinstance(body["ids"], list) \
            or not all(is_int64(i) for i in body["ids"]):
        return 400, None
    if len(body["ids"]) > MAX_IDS:
        return 413, None
    if name not in TABLES:
        return 404, None
    ids = np.array(body["ids"], np.int64)
    return (200, ids) if model.physical(name, ids) is not None else (400, None)


@st.composite
def lookup_json_bodies(draw: Any, name: str) -> bytes:
    table = name if name in TABLES else "f32"
    ids = draw(st.lists(ids_strategy(table, bad=True), max_size=6))
    kind = draw(st.sampled_from(["valid", "valid", "junk_id", "non_finite", "extra_key", "wrong_key", "top_level",
                                 "any", "raw", "truncated", "too_many"]))
    if kind == "valid":
        return json.dumps({"ids": ids}).encode()
    if kind == "junk_id":
        ids.insert(draw(st.integers(0, len(ids))), draw(NOT_INT))
        return json.dumps({"ids": ids}).encode()
    if kind == "non_finite":
        return ('{"ids": [%s]}' % ", ".join([*map(str, ids), draw(st.sampled_from(NON_FINITE))])).encode()
    if kind == "extra_key":
        return json.dumps({"ids": ids, draw(st.text(max_size=5).filter(lambda k: k != "ids")): draw(ANY_JSON)}).encode()
    if kind == "wrong_key":
        return json.dumps({draw(st.sampled_from(["Ids", "id", "ids ", ""])): ids}).encode()
    if kind == "top_level":
        return json.dumps(draw(st.one_of(st.just(ids), JSON_SCALARS, st.lists(ANY_JSON, max_size=2)))).encode()
    if kind == "any":
        return json.dumps(draw(ANY_JSON)).encode()
    if kind == "raw":
        return draw(RAW_JUNK)
    if kind == "truncated":
        full = json.dumps({"ids": ids}).encode()
        return full[:draw(st.integers(0, len(full) - 1))]
    return json.dumps({"ids": [0] * (MAX_IDS + draw(st.integers(1, 3)))}).encode()


def check_lookup_json(server: Any, data: st.DataObject) -> None:
    http, model, _ = server
    name = data.draw(NAMES)
    raw = data.draw(lookup_json_bodies(name))
    ctype = data.draw(st.sampled_from(["application/json", None, "text/plain", "application/json; charset=utf-8"]))
    headers = {"Content-Type": ctype} if ctype else {}
    resp = send(http, "POST", f"/v1/tables/{quoted(name)}/lookup", content=raw, headers=headers)
    status, ids = lookup_json_status(model, name, raw)
    event(f"status {status}")
    expect(resp, status, raw)
    if status == 200:
        assert same_bits(rows_of(resp), expected_rows(model, name, ids))


@FAST
@given(data=st.data())
def test_json_lookups_are_answered_or_refused_as_the_spec_says(server, data):
    check_lookup_json(server, data)


# Accept headers -> whether the answer is binary (RFC 9110 quality values, ties pick binary)
ACCEPT = {None: False, "": False, BINARY: True, "application/json": False, "*/*": False, "application/*": False,
          f"{BINARY};q=0": False, f"{BINARY};q=0.5, application/json;q=0.4": True,
          f"{BINARY};q=0.5, */*": False, f"{BINARY}, application/json": True, f"{BINARY};q=nan": False,
          f"{BINARY};q=2": False, f"{BINARY};q=": False, "text/html, " + BINARY.upper(): True,
          ",,;;q=,": False, f"application/json;q=0, {BINARY};q=0.001": True}


def lookup_binary_status(model: Model, name: str, raw: bytes) -> tuple[int, np.ndarray | None]:
    if len(raw) // 8 > MAX_IDS:
        return 413, None
    if len(raw) % 8:
        return 400, None
    if name not in TABLES:
        return 404, None
    ids = np.frombuffer(raw, "<i8").astype(np.int64)
    return (200, ids) if model.physical(name, ids) is not None else (400, None)


def check_lookup_binary(server: Any, data: st.DataObject) -> None:
    http, model, _ = server
    name = data.draw(NAMES)
    table = name if name in TABLES else "f32"
    raw = data.draw(st.one_of(
        st.lists(ids_strategy(table, bad=True), max_size=MAX_IDS + 2).map(lambda v: np.array(v, "<i8").tobytes()),
        st.binary(max_size=8 * MAX_IDS + 16),
        st.integers(MAX_IDS + 1, MAX_IDS + 3).map(lambda n: bytes(8 * n)),  # over the id limit
        st.lists(ids_strategy(table), max_size=6).flatmap(  # valid ids, cut or padded by a few bytes
            lambda v: st.integers(-7, 7).map(lambda d: np.array(v, "<i8").tobytes()[:max(0, 8 * len(v) + d)]
                                             + b"\1" * max(0, d)))))
    ctype = data.draw(st.sampled_from([BINARY, BINARY.upper(), f"{BINARY}; charset=binary", f"{BINARY} ;x=y"]))
    accept = data.draw(st.sampled_from(list(ACCEPT)))
    headers = {"Content-Type": ctype} | ({"Accept": accept} if accept is not None else {})
    resp = send(http, "POST", f"/v1/tables/{quoted(name)}/lookup", content=raw, headers=headers)
    status, ids = lookup_binary_status(model, name, raw)
    event(f"status {status}")
    expect(resp, status, (raw, headers))
    if status == 200:
        assert (resp.headers["content-type"] == BINARY) == ACCEPT[accept], (accept, resp.headers)
        assert same_bits(rows_of(resp), expected_rows(model, name, ids))


@FAST
@given(data=st.data())
def test_binary_lookups_are_answered_or_refused_as_the_spec_says(server, data):
    check_lookup_binary(server, data)


# --- /pooled ------------------------------------------------------------------------------------------------
@st.composite
def bags(draw: Any, table: str, bad: bool) -> tuple[list[int], list[int]]:
    """(ids, offsets) of a few bags; with ``bad``, ids out of range and offsets that fall or stray."""
    lens = draw(st.lists(st.integers(0, 4), max_size=5))
    ids = draw(st.lists(ids_strategy(table, bad), min_size=sum(lens), max_size=sum(lens)))
    offsets = [0, *np.cumsum(lens).tolist()]
    if bad and draw(st.booleans()):
        how = draw(st.sampled_from(["swap", "set", "drop", "append", "empty"]))
        if how == "swap" and len(offsets) > 2:
            i = draw(st.integers(0, len(offsets) - 2))
            offsets[i], offsets[i + 1] = offsets[i + 1], offsets[i]
        elif how == "set":
            offsets[draw(st.integers(0, len(offsets) - 1))] = draw(st.one_of(
                st.integers(-3, len(ids) + 3), st.sampled_from([I64_MIN, I64_MAX, 2**62])))
        elif how == "drop":
            offsets.pop(draw(st.integers(0, len(offsets) - 1)))
        elif how == "append":
            offsets.append(draw(st.integers(-2, len(ids) + 2)))
        else:
            offsets = []
    return ids, offsets


def draw_bags(data: st.DataObject) -> tuple[str, list[int], list[int]]:
    """A table name (maybe unknown), and bags of ids for it (maybe bad)."""
    name = data.draw(NAMES)
    ids, offsets = data.draw(bags(name if name in TABLES else "f32", bad=data.draw(st.booleans())))
    return name, ids, offsets


def offsets_ok(ids: list[int], offsets: list[int]) -> bool:
    return bool(offsets) and offsets[0] == 0 and offsets[-1] == len(ids) and \
        all(a <= b for a, b in zip(offsets, offsets[1:]))


def pooled_verdict(model: Model, name: str, ids: list[int], offsets: list[int], mode: str | None
                   ) -> tuple[int, tuple | None]:
    """The status of a well-formed pooled request within the limits: the table's (404, bad ids or offsets 400)."""
    if name not in TABLES:
        return 404, None
    if model.physical(name, np.array(ids, np.int64)) is None or not offsets_ok(ids, offsets):
        return 400, None
    return 200, (ids, offsets, mode or "sum")


def judge_pooled(resp: httpx.Response, model: Model, name: str, verdict: tuple[int, tuple | None], what: Any
                 ) -> None:
    """The answer has the reference's status, and when that is 200, the model's pooled rows."""
    status, parsed = verdict
    event(f"status {status}")
    expect(resp, status, what)
    if status == 200:
        ids, offsets, mode = parsed
        want = pooled_reference(model, name, np.array(ids, np.int64), np.array(offsets, np.int64), mode)
        np.testing.assert_allclose(rows_of(resp), want, rtol=1e-5, atol=1e-6)


def pooled_json_status(model: Model, name: str, raw: bytes, params: dict) -> tuple[int, tuple | None]:
    ok, body = strict_json(raw)
    if "num_bags" in params or params.get("mode") not in (None, "sum", "mean"):
        return 400, None
    if not ok or not isinstance(body, dict) or not {"ids", "offsets"} <= set(body) <= {"ids", "offsets", "mode"} \
            or not all(isinstance(body[k], list) and all(is_int64(i) for i in body[k]) for k in ("ids", "offsets")) \
            or body.get("mode") not in ("sum", "mean", None):
        return 400, None
    ids, offsets, mode = body["ids"], body["offsets"], body.get("mode")
    if len(ids) > MAX_IDS or len(offsets) - 1 > MAX_IDS:
        return 413, None
    if params.get("mode") is not None and params["mode"] != mode:
        return 400, None
    return pooled_verdict(model, name, ids, offsets, mode)


def check_pooled_json(server: Any, data: st.DataObject) -> None:
    http, model, _ = server
    name, ids, offsets = draw_bags(data)
    body: dict[str, Any] = {"ids": ids, "offsets": offsets}
    mode = data.draw(st.sampled_from(["absent", "sum", "mean", None, "max", "SUM", 1, ["sum"]]))
    if mode != "absent":
        body["mode"] = mode
    kind = data.draw(st.sampled_from(["as is"] * 4 + ["junk_id", "junk_offset", "extra", "missing", "any", "raw",
                                                      "too_many_bags", "non_finite"]))
    if kind == "junk_id":
        ids.insert(data.draw(st.integers(0, len(ids))), data.draw(NOT_INT))
    elif kind == "junk_offset":
        offsets.insert(data.draw(st.integers(0, len(offsets))), data.draw(NOT_INT))
    elif kind == "extra":
        body[data.draw(st.sampled_from(["num_bags", "x", "Mode"]))] = data.draw(ANY_JSON)
    elif kind == "missing":
        del body[data.draw(st.sampled_from(["ids", "offsets"]))]
    elif kind == "too_many_bags":
        body = {"ids": [], "offsets": [0] * (MAX_IDS + 2)}
    raw = json.dumps(body).encode()
    if kind == "any":
        raw = json.dumps(data.draw(ANY_JSON)).encode()
    elif kind == "raw":
        raw = data.draw(RAW_JUNK)
    elif kind == "non_finite":
        raw = ('{"ids": [], "offsets": [0, %s]}' % data.draw(st.sampled_from(NON_FINITE))).encode()
    params = data.draw(st.sampled_from([{}, {}, {}, {"mode": "sum"}, {"mode": "mean"}, {"mode": "max"},
                                        {"num_bags": "1"}, {"num_bags": "x"}]))
    resp = send(http, "POST", f"/v1/tables/{quoted(name)}/pooled", content=raw, params=params,
                headers={"Content-Type": "application/json"})
    judge_pooled(resp, model, name, pooled_json_status(model, name, raw, params), (raw, params))


@FAST
@given(data=st.data())
def test_json_pooled_requests_are_answered_or_refused_as_the_spec_says(server, data):
    check_pooled_json(server, data)


NUM_BAGS_JUNK = ["x", "1.5", "", "nan", "-1", "0x10", "one", "1,2", str(2**63), "1e400", "\u0661"]


def pooled_binary_status(model: Model, name: str, raw: bytes, num_bags: str | None, mode: str | None
                         ) -> tuple[int, tuple | None]:
    if (num_bags is not None and not (num_bags.isascii() and num_bags.isdigit() and int(num_bags) <= I64_MAX)) \
            or mode not in (None, "sum", "mean"):
        return 400, None  # a query parameter the route refuses before it reads the body
    if num_bags is None or len(raw) % 8:
        return 400, None
    values = np.frombuffer(raw, "<i8").astype(np.int64)
    n = int(num_bags)
    if len(values) < n + 1:
        return 400, None
    offsets, ids = values[:n + 1].tolist(), values[n + 1:].tolist()
    if len(ids) > MAX_IDS or n > MAX_IDS:
        return 413, None
    return pooled_verdict(model, name, ids, offsets, mode)


def check_pooled_binary(server: Any, data: st.DataObject) -> None:
    http, model, _ = server
    name, ids, offsets = draw_bags(data)
    raw = np.array(offsets + ids, "<i8").tobytes()
    num_bags: str | None = str(len(offsets) - 1)
    how = data.draw(st.sampled_from(["as is"] * 4 + ["off by one", "huge", "junk", "absent", "bytes", "cut",
                                                     "too many bags"]))
    if how == "off by one":
        num_bags = str(max(0, int(num_bags) + data.draw(st.sampled_from([-1, 1]))))
    elif how == "huge":
        num_bags = str(data.draw(st.sampled_from([MAX_IDS + 1, 2**31, I64_MAX])))
    elif how == "junk":
        num_bags = data.draw(st.sampled_from(NUM_BAGS_JUNK))
    elif how == "absent":
        num_bags = None
    elif how == "bytes":
        raw = data.draw(st.binary(max_size=8 * (MAX_IDS + 4)))
    elif how == "cut":
        raw = raw[:data.draw(st.integers(0, max(0, len(raw) - 1)))]
    elif how == "too many bags":  # empty bags: a small body, but an answer row each
        num_bags = str(MAX_IDS + 1)
        raw = bytes(8 * (MAX_IDS + 2))
    mode = data.draw(st.sampled_from([None, None, "sum", "mean", "max", "Sum", ""]))
    params = {k: v for k, v in (("num_bags", num_bags), ("mode", mode)) if v is not None}
    accept = data.draw(st.sampled_from([BINARY, "application/json"]))
    resp = send(http, "POST", f"/v1/tables/{quoted(name)}/pooled", content=raw, params=params,
                headers={"Content-Type": BINARY, "Accept": accept})
    judge_pooled(resp, model, name, pooled_binary_status(model, name, raw, num_bags, mode), (raw, params))


@FAST
@given(data=st.data())
def test_binary_pooled_requests_are_answered_or_refused_as_the_spec_says(server, data):
    check_pooled_binary(server, data)


# --- PUT /rows ----------------------------------------------------------------------------------------------
# one fault each -> (status, tables it applies to or None for all)
ROW_FAULTS: dict[str, tuple[int, tuple[str, ...] | None]] = {
    "no token": (401, None), "wrong token": (401, None), "basic auth": (401, None),
    "unknown table": (404, None),
    "id out of range": (400, ("f32", "res", "i8", "f16", "ma")),
    "id not an int64": (400, None), "ids not a list": (400, None),
    "row too short": (422, None), "row too long": (422, None), "rows fewer than ids": (422, None),
    "rows more than ids": (422, None), "value not finite": (422, None), "value not a number": (400, None),
    "row not a list": (400, None), "beyond float16": (422, ("f16",)),
    "too many ids": (413, None), "body over the limit": (413, None),
    "extra key": (400, None), "missing key": (400, None), "top level": (400, None), "any json": (400, None),
    "truncated": (400, None), "empty": (400, None), "binary body": (400, None),
}
FLOATS = st.floats(-6e4, 6e4, allow_nan=False, width=32)  # within float16 too


@st.composite
def row_writes(draw: Any) -> tuple[str, str | None, dict[str, Any]]:
    """(table, fault or None, request keyword arguments) of a PUT .../rows."""
    fault = draw(st.one_of(st.none(), st.sampled_from(list(ROW_FAULTS))))
    allowed = ROW_FAULTS[fault][1] if fault else None
    name = draw(st.sampled_from(allowed or (list(TABLES) if fault else WRITABLE)))
    t = TABLES[name]
    n = draw(st.integers(1 if fault in ("id out of range", "id not an int64", "value not a number",
                                        "value not finite", "row too short", "row too long", "row not a list",
                                        "beyond float16", "rows fewer than ids") else 0, 5))
    if t.seed is None:
        ids = draw(st.lists(st.integers(0, t.rows - 1), min_size=n, max_size=n, unique=True))
    else:  # distinct physical rows: which of two colliding ids lands last is not the SPEC's business
        ids = draw(st.lists(st.integers(I64_MIN, I64_MAX), min_size=n, max_size=n,
                            unique_by=lambda i: int(ModHash(t.rows, t.seed)(np.array([i]))[0])))
    rows = [draw(st.lists(FLOATS, min_size=DIM, max_size=DIM)) for _ in ids]
    body: Any = {"ids": ids, "embeddings": rows}
    headers = dict(AUTH)
    raw: bytes | None = None
    path_name = name
    i = draw(st.integers(0, max(0, n - 1)))
    if fault == "no token":
        headers = {}
    elif fault == "wrong token":
        headers = {"Authorization": "Bearer " + draw(st.sampled_from([TOKEN + "x", TOKEN[:-1], TOKEN.upper(), "-",
                                                                        f"{TOKEN} {TOKEN}"]))}
    elif fault == "basic auth":
        headers = {"Authorization": draw(st.sampled_from([f"Basic {TOKEN}", TOKEN, f"Bearer:{TOKEN}"]))}
    elif fault == "unknown table":
        path_name = draw(NAMES.filter(lambda s: s not in TABLES))
    elif fault == "id out of range":
        ids[i] = draw(st.one_of(st.integers(-(2**40), -1), st.integers(t.rows, 2**40),
                                st.sampled_from([I64_MIN, I64_MAX, -1, t.rows])))
    elif fault == "id not an int64":
        ids[i] = draw(NOT_INT)
    elif fault == "ids not a list":
        body["ids"] = draw(st.one_of(JSON_SCALARS, st.dictionaries(st.text(max_size=2), st.integers(), max_size=2)))
    elif fault == "row too short":
        rows[i] = rows[i][:draw(st.integers(0, DIM - 1))]
    elif fault == "row too long":
        rows[i] = rows[i] + [0.5] * draw(st.integers(1, 3))
    elif fault == "rows fewer than ids":
        rows.pop(i)
    elif fault == "rows more than ids":
        rows.append([0.25] * DIM)
    elif fault == "value not a number":
        rows[i][draw(st.integers(0, DIM - 1))] = draw(NOT_NUMBER)
    elif fault == "row not a list":
        rows[i] = draw(JSON_SCALARS)
    elif fault == "beyond float16":
        rows[i][draw(st.integers(0, DIM - 1))] = draw(st.sampled_from([65520.0, -1e5, 3e38]))
    elif fault == "too many ids":
        body = {"ids": list(range(MAX_IDS + 1)), "embeddings": [[0.0] * DIM] * (MAX_IDS + 1)}
    elif fault == "body over the limit":
        raw = json.dumps(body).encode() + b" " * MAX_BODY
    elif fault == "extra key":
        body[draw(st.text(max_size=5).filter(lambda k: k not in ("ids", "embeddings")))] = draw(ANY_JSON)
    elif fault == "missing key":
        del body[draw(st.sampled_from(["ids", "embeddings"]))]
    elif fault == "top level":
        body = draw(st.one_of(st.just([ids, rows]), JSON_SCALARS, st.lists(ANY_JSON, max_size=2)))
    elif fault == "any json":  # never a two-key object
        body = draw(st.one_of(JSON_SCALARS, st.lists(ANY_JSON, max_size=3),
                              st.dictionaries(st.text(max_size=3), ANY_JSON, max_size=3).filter(
                                  lambda d: set(d) != {"ids", "embeddings"})))
    elif fault == "truncated":
        full = json.dumps(body).encode()
        raw = full[:draw(st.integers(0, len(full) - 1))]
    elif fault == "empty":
        raw = b""
    elif fault == "binary body":
        raw = np.array(ids, "<i8").tobytes() + np.array(rows, "<f4").tobytes()
        headers["Content-Type"] = BINARY
    elif fault == "value not finite":  # JSON has no NaN / Infinity: such values arrive as text
        rows[i][draw(st.integers(0, DIM - 1))] = HOLE
    if raw is None:
        raw = json.dumps(body).encode().replace(HOLE_JSON, draw(st.sampled_from(NON_FINITE)).encode())
    headers.setdefault("Content-Type", "application/json")
    return name, fault, {"path": f"/v1/tables/{quoted(path_name)}/rows", "content": raw, "headers": headers}


def check_row_write(server: Any, data: st.DataObject) -> None:
    http, model, _ = server
    name, fault, req = data.draw(row_writes())
    resp = send(http, "PUT", req.pop("path"), **req)
    event(f"status {resp.status_code}")
    if fault is None:
        expect(resp, 204, req)
        body = json.loads(req["content"])
        model.write(name, np.array(body["ids"], np.int64), np.array(body["embeddings"], np.float32).reshape(-1, DIM))
    else:
        expect(resp, ROW_FAULTS[fault][0], (fault, req))
    assert_store_is(http, model)  # refused: nothing changed; accepted: exactly its rows


@FAST
@given(data=st.data())
def test_a_refused_write_changes_nothing_and_an_accepted_one_exactly_its_rows(server, data):
    check_row_write(server, data)


# --- predict ------------------------------------------------------------------------------------------------
PREDICT_FAULTS = {
    "unknown model": 404, "missing table": 400, "unknown table": 400, "bags per sample": 400,
    "dense too narrow": 422, "dense too wide": 422, "dense not finite": 422, "dense not a number": 400,
    "id out of range": 400, "id not an int64": 400, "too many samples": 413, "too many ids": 413,
    "extra key": 400, "top level": 400, "truncated": 400, "binary body": 400, "sparse not an object": 400,
}


@st.composite
def predicts(draw: Any) -> tuple[str | None, str, bytes, dict[str, str]]:
    fault = draw(st.one_of(st.none(), st.sampled_from(list(PREDICT_FAULTS))))
    n = draw(st.integers(1, 4))
    dense = [draw(st.lists(st.floats(-10, 10), min_size=NUM_DENSE, max_size=NUM_DENSE)) for _ in range(n)]
    sparse = {t: [draw(st.lists(ids_strategy(t), max_size=3)) for _ in range(n)] for t in MODEL_TABLES}
    body: Any = {"dense": dense, "sparse": sparse}
    name, raw, headers = "m", None, {"Content-Type": "application/json"}
    s = draw(st.integers(0, n - 1))
    if fault == "unknown model":
        name = draw(st.sampled_from(["M", "m ", "nope", "\u2603", "m\x00"]))
    elif fault == "missing table":
        del sparse[draw(st.sampled_from(MODEL_TABLES))]
    elif fault == "unknown table":
        sparse[draw(st.sampled_from(["f32", "", "mc"]))] = [[] for _ in range(n)]
    elif fault == "bags per sample":
        t = draw(st.sampled_from(MODEL_TABLES))
        sparse[t] = sparse[t][:-1] if draw(st.booleans()) else sparse[t] + [[]]
    elif fault == "dense too narrow":
        dense[s] = dense[s][:-1]
    elif fault == "dense too wide":
        dense[s] = dense[s] + [0.0]
    elif fault == "dense not a number":
        dense[s][0] = draw(NOT_NUMBER)
    elif fault == "id out of range":
        sparse["ma"][s].append(draw(st.sampled_from([-1, 20, I64_MAX, I64_MIN])))
    elif fault == "id not an int64":
        sparse[draw(st.sampled_from(MODEL_TABLES))][s].append(draw(NOT_INT))
    elif fault == "too many samples":
        body = {"dense": [[0.0] * NUM_DENSE] * (MAX_IDS + 1), "sparse": {t: [[]] * (MAX_IDS + 1) for t in MODEL_TABLES}}
    elif fault == "too many ids":
        sparse["ma"][s] = [0] * (MAX_IDS + 1)
    elif fault == "extra key":
        body[draw(st.sampled_from(["ids", "x", "Dense"]))] = draw(ANY_JSON)
    elif fault == "top level":
        body = draw(st.one_of(JSON_SCALARS, st.lists(ANY_JSON, max_size=2)))
    elif fault == "sparse not an object":
        body["sparse"] = draw(st.one_of(JSON_SCALARS, st.lists(ANY_JSON, max_size=2)))
    elif fault == "dense not finite":
        dense[s][draw(st.integers(0, NUM_DENSE - 1))] = HOLE
    raw = json.dumps(body).encode().replace(HOLE_JSON, draw(st.sampled_from(NON_FINITE)).encode())
    if fault == "truncated":
        raw = raw[:draw(st.integers(0, len(raw) - 1))]
    elif fault == "binary body":
        raw = np.array(dense, "<f4").tobytes()
        headers = {"Content-Type": BINARY}
    return fault, name, raw, headers | ({"Accept": BINARY} if draw(st.booleans()) else {})


def check_predict(server: Any, data: st.DataObject) -> None:
    http, model, _ = server
    fault, name, raw, headers = data.draw(predicts())
    resp = send(http, "POST", f"/v1/models/{quoted(name)}/predict", content=raw, headers=headers)
    event(f"status {resp.status_code}")
    if fault is None:
        expect(resp, 200, raw)
        scores = resp.json()["scores"]
        assert len(scores) == len(json.loads(raw)["dense"]) and all(0 <= s <= 1 for s in scores)
    else:
        expect(resp, PREDICT_FAULTS[fault], (fault, raw))


@FAST
@given(data=st.data())
def test_predict_requests_are_answered_or_refused_as_the_spec_says(server, data):
    check_predict(server, data)


# --- the limits and literals, each once (a modest fuzz budget may not reach them) ---------------------------
def _i64(*values: int) -> bytes:
    return np.array(values, "<i8").tobytes()


BIN = {"Content-Type": BINARY}
ROW = [0.5] * DIM
EDGES = [  # (method, path, request keyword arguments, status, words of the answer's detail)
    ("POST", "/v1/tables/f32/lookup", {"json": {"ids": [0] * (MAX_IDS + 1)}}, 413, f"{MAX_IDS + 1} ids"),
    ("POST", "/v1/tables/f32/lookup", {"content": b'{"ids": [NaN]}'}, 400, "integer"),
    ("POST", "/v1/tables/f32/lookup", {"content": b'{"ids": [Infinity]}'}, 400, "integer"),
    ("POST", "/v1/tables/f32/lookup", {"json": {"ids": [2**63]}}, 400, "less than or equal"),
    ("POST", "/v1/tables/f32/lookup", {"json": {"ids": [-(2**63) - 1]}}, 400, "greater than or equal"),
    ("POST", "/v1/tables/f32/lookup", {"content": b'{"ids": [1%s]}' % (b"0" * 5000)}, 400, "out of range"),
    ("POST", "/v1/tables/f32/lookup", {"content": b""}, 400, "invalid json"),
    ("POST", "/v1/tables/f32/lookup", {"content": b"[" * 300}, 400, "recursion"),
    ("POST", "/v1/tables/f32/lookup", {"content": b'{"ids": [1]}\0'}, 400, "trailing"),
    ("POST", "/v1/tables/f32/lookup", {"content": b"\xff\xfe"}, 400, "invalid json"),
    ("POST", "/v1/tables/f32/lookup", {"content": b"\0" * 8 * (MAX_IDS + 1), "headers": BIN}, 413, "at most 64"),
    ("POST", "/v1/tables/f32/lookup", {"content": b"\0" * 7, "headers": BIN}, 400, "multiple of 8"),
    ("POST", "/v1/tables/f32/lookup", {"content": _i64(I64_MIN), "headers": BIN}, 400, "outside [0, 64)"),
    ("POST", "/v1/tables/i8/pooled", {"content": _i64(0, 1, 1), "headers": BIN}, 400, "needs the query parameter"),
    ("POST", "/v1/tables/i8/pooled", {"content": _i64(0, 1, 1), "headers": BIN, "params": {"num_bags": I64_MAX}}, 400,
     "needs 9223372036854775808 offsets"),
    ("POST", "/v1/tables/i8/pooled", {"content": _i64(0, 1, 1), "headers": BIN, "params": {"num_bags": 2**63}}, 400,
     "num_bags"),
    ("POST", "/v1/tables/i8/pooled", {"content": _i64(*[0] * (MAX_IDS + 2)), "headers": BIN,
                                      "params": {"num_bags": MAX_IDS + 1}}, 413, f"{MAX_IDS + 1} bags"),
    ("POST", "/v1/tables/i8/pooled", {"content": _i64(0, 2**62, 1, 7), "headers": BIN, "params": {"num_bags": 2}}, 400,
     "non-decreasing"),
    ("POST", "/v1/tables/i8/pooled", {"content": _i64(0, 1, 40), "headers": BIN, "params": {"num_bags": 1}}, 400,
     "outside [0, 40)"),
    ("POST", "/v1/tables/i8/pooled", {"json": {"ids": [], "offsets": [0] * (MAX_IDS + 2)}}, 413, "bags"),
    ("POST", "/v1/tables/i8/pooled", {"json": {"ids": [1], "offsets": [0, 1]}, "params": {"num_bags": 1}}, 400,
     "binary protocol only"),
    ("PUT", "/v1/tables/f32/rows", {"json": {"ids": list(range(MAX_IDS + 1)), "embeddings": [ROW] * (MAX_IDS + 1)},
                                    "headers": AUTH}, 413, "at most 64"),
    ("PUT", "/v1/tables/f32/rows", {"content": b" " * (MAX_BODY + 1), "headers": AUTH}, 413, "exceeds"),
    ("PUT", "/v1/tables/f32/rows", {"content": [b" " * 1024] * (MAX_BODY // 1024 + 1), "headers": AUTH}, 413,
     "exceeds"),  # an iterable goes chunked: no Content-Length to refuse it by
    ("PUT", "/v1/tables/f32/rows", {"content": b'{"ids": [1], "embeddings": [[0, 0, 0, NaN]]}', "headers": AUTH}, 422,
     "finite"),
    ("PUT", "/v1/tables/f32/rows", {"content": b'{"ids": [1], "embeddings": [[0, 0, 0, 1e39]]}', "headers": AUTH}, 422,
     "finite"),
    ("PUT", "/v1/tables/f16/rows", {"json": {"ids": [1], "embeddings": [[0, 0, 0, 70000.0]]}, "headers": AUTH}, 422,
     "float16"),
    ("PUT", "/v1/tables/f32/rows", {"content": _i64(1) + np.zeros(DIM, "<f4").tobytes(), "headers": AUTH | BIN}, 400,
     "takes a json body"),
    ("POST", "/v1/models/m/predict", {"json": {"dense": [[0.0] * NUM_DENSE] * (MAX_IDS + 1),
                                               "sparse": {t: [[]] * (MAX_IDS + 1) for t in MODEL_TABLES}}}, 413,
     f"{MAX_IDS + 1} samples"),
    ("POST", "/v1/models/m/predict", {"json": {"dense": [[0.0] * NUM_DENSE], "sparse": {"ma": [[0] * (MAX_IDS + 1)],
                                                                                       "mb": [[]]}}}, 413, "ids"),
    ("POST", "/v1/models/m/predict", {"content": b'{"dense": [[0, 0, Infinity]], "sparse": {"ma": [[]], "mb": [[]]}}'},
     422, "finite"),
]


@pytest.mark.parametrize("method, path, kw, status, words", EDGES, ids=range(len(EDGES)))
def test_limits_and_literals(server, method, path, kw, status, words):
    http, model, _ = server
    resp = send(http, method, path, **kw)
    expect(resp, status, (path, kw))
    assert words.lower() in resp.json()["detail"].lower(), resp.text
    if method == "PUT":
        assert_store_is(http, model)


def test_a_huge_declared_body_is_refused_at_once(server):
    """A Content-Length far over the limit is answered 413 without waiting for a body that never comes."""
    http, model, _ = server
    with socket.create_connection((http.base_url.host, http.base_url.port), timeout=20) as s:
        s.sendall(b"PUT /v1/tables/f32/rows HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
                  + b"\r\nContent-Length: %d\r\n\r\n{" % 10**18)
        head = s.recv(65536)  # the socket's timeout bounds a hang
    assert head.startswith(b"HTTP/1.1 413 "), head
    assert_store_is(http, model)


@pytest.mark.parametrize("method, path", [("POST", "/v1/tables/f32/lookup"), ("POST", "/v1/tables/f32/pooled"),
                                          ("PUT", "/v1/tables/f32/rows"), ("POST", "/v1/models/m/predict")])
def test_junk_bodies_are_400(server, method, path):
    http, model, _ = server
    for raw in JUNK:
        resp = send(http, method, path, content=raw, headers=AUTH | {"Content-Type": "application/json"})
        expect(resp, 400, raw)
        assert "malformed body" in resp.json()["detail"]
    assert_store_is(http, model)


# --- paths, names and methods -------------------------------------------------------------------------------
GET = {"GET", "HEAD"}  # HEAD wherever GET is
ROUTES = {"/healthz": GET, "/v1/tables": GET, "/v1/tables/f32": GET, "/v1/tables/f32/lookup": {"POST"},
          "/v1/tables/f32/pooled": {"POST"}, "/v1/tables/f32/rows": {"PUT"}, "/v1/models": GET,
          "/v1/models/m/predict": {"POST"}, "/v1/admin/reload": {"POST"}, "/metrics": GET, "/": GET}
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "BREW"]


@settings(max_examples=40, **FUZZ)
@given(path=st.sampled_from(list(ROUTES)), method=st.sampled_from(METHODS))
def test_a_method_a_route_does_not_take_is_405(server, path, method):
    http, _, _ = server
    if method in ROUTES[path]:
        return
    expect(send(http, method, path, content=b'{"ids": [1]}', headers=AUTH), 405, (method, path))


def odd_names() -> st.SearchStrategy[str]:
    """Names no table or model has, sent percent-encoded; a trailing or embedded '/' becomes a path of its own,
    so names hold none (``..`` and ``.`` too are paths, not names)."""
    return st.text(st.characters(exclude_characters="/", exclude_categories=("Cs",)), min_size=1, max_size=12).filter(
        lambda s: s not in TABLES and s not in ("m", ".", ".."))


@settings(max_examples=40, **FUZZ)
@given(name=odd_names(), route=st.sampled_from(["table", "lookup", "pooled", "rows", "predict"]))
def test_an_unknown_name_is_404_naming_it(server, name, route):
    http, _, _ = server
    q = quoted(name)
    method, path, kw = {
        "table": ("GET", f"/v1/tables/{q}", {}),
        "lookup": ("POST", f"/v1/tables/{q}/lookup", {"json": {"ids": [1]}}),
        "pooled": ("POST", f"/v1/tables/{q}/pooled", {"json": {"ids": [1], "offsets": [0, 1]}}),
        "rows": ("PUT", f"/v1/tables/{q}/rows", {"json": {"ids": [1], "embeddings": [[0.0] * DIM]}, "headers": AUTH}),
        "predict": ("POST", f"/v1/models/{q}/predict", {"json": {"dense": [], "sparse": {"ma": [], "mb": []}}}),
    }[route]
    resp = send(http, method, path, **kw)
    expect(resp, 404, (name, route))
    assert ("no model" if route == "predict" else "no table") in resp.json()["detail"]


# --- logs ---------------------------------------------------------------------------------------------------
REFUSALS = [  # (method, path, request keyword arguments, status, words the log line and the answer hold)
    ("POST", "/v1/tables/f32/lookup", {"content": b"{nope"}, 400, "invalid json"),
    ("POST", "/v1/tables/f32/lookup", {"json": {"ids": [64]}}, 400, "outside [0, 64)"),
    ("POST", "/v1/tables/f32/pooled", {"json": {"ids": [1], "offsets": [0, 2]}}, 400, "offsets[-1]"),
    ("PUT", "/v1/tables/f32/rows", {"json": {"ids": [1], "embeddings": [[0.0] * DIM]}}, 401, "token"),
    ("POST", "/v1/tables/nope/lookup", {"json": {"ids": [1]}}, 404, "no table 'nope'"),
    ("POST", "/v1/models/nope/predict", {"json": {"dense": [], "sparse": {}}}, 404, "no model 'nope'"),
    ("GET", "/v1/nothing", {}, 404, "no such path: /v1/nothing"),
    ("DELETE", "/v1/tables/f32", {}, 405, "method delete is not allowed on /v1/tables/f32; allowed: get, head"),
    ("POST", "/v1/tables/f32/lookup", {"content": b"\0" * (MAX_BODY + 8), "headers": {"Content-Type": BINARY}}, 413,
     "exceeds this server's limit"),
    ("PUT", "/v1/tables/f32/rows", {"json": {"ids": [1], "embeddings": [[0.0]]}, "headers": AUTH}, 422,
     "shape (1, 4)"),
]


def test_refused_requests_are_logged_in_one_line_without_a_traceback(server, caplog):
    http, model, _ = server
    caplog.set_level(logging.INFO, logger="embstore.server")
    for method, path, kw, status, words in REFUSALS:
        caplog.clear()
        resp = send(http, method, path, **kw)
        expect(resp, status, path)
        assert words in resp.json()["detail"].lower()
        # the answer is sent after the log call returns, so the record is already there
        lines = [r for r in caplog.records if r.name == "embstore.server" and str(status) in r.getMessage()]
        assert len(lines) == 1 and lines[0].levelno == logging.INFO, (path, caplog.text)
        line = lines[0].getMessage()
        assert words in line.lower() and method in line and "\n" not in line, line
        assert not any(r.exc_info or r.levelno >= logging.ERROR for r in caplog.records), caplog.text
    assert_store_is(http, model)


def test_a_log_line_escapes_what_the_client_sent(server, caplog):
    """A newline in a name or a JSON key cannot forge a second log line."""
    http, _, _ = server
    caplog.set_level(logging.INFO, logger="embstore.server")
    caplog.clear()
    expect(send(http, "POST", "/v1/tables/f32/lookup", json={"ids": [], "x\nERROR forged": 1}), 400, "key")
    expect(send(http, "GET", "/v1/tables/" + quoted("a\nERROR forged")), 404, "name")
    lines = [r.getMessage() for r in caplog.records if r.name == "embstore.server"]
    assert len(lines) == 2 and not any("\n" in line for line in lines), lines


def test_a_timed_out_request_is_logged_in_one_line(tmp_path, caplog):
    """A 504 is the server's doing, not the client's: a WARNING line, still without a traceback."""
    caplog.set_level(logging.INFO, logger="embstore.server")
    cfg = StoreConfig((TableConfig("t", 8, DIM, tiers=(TierConfig("mmap"),)),))
    embstore.create(tmp_path / "s", cfg).close()
    with ServerThread(create_app(ServerSettings(store=tmp_path / "s", request_timeout=1e-6))) as srv:
        resp = httpx.post(srv.url + "/v1/tables/t/lookup", json={"ids": [1]})
    assert resp.status_code == 504 and "timed out" in resp.json()["detail"]
    lines = [r for r in caplog.records if r.name == "embstore.server" and "timed out" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING and not lines[0].exc_info, caplog.text
    assert "POST /v1/tables/t/lookup" in lines[0].getMessage()


# --- a client that goes away mid-body ------------------------------------------------------------------------
def request_counts(http: httpx.Client, endpoint: str) -> dict[str, float]:
    """status -> requests answered on ``endpoint`` so far, from GET /metrics."""
    counts: dict[str, float] = {}
    for fam in text_string_to_metric_families(http.get("/metrics").text):
        for s in fam.samples:
            if s.name == "embstore_http_requests_total" and s.labels["endpoint"] == endpoint:
                counts[s.labels["status"]] = counts.get(s.labels["status"], 0) + s.value
    return counts


HANG_UPS = {  # a body cut short: fewer bytes than Content-Length, or a chunked body broken off
    "short body": b"PUT /v1/tables/f32/rows HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"ids\": [1], \"emb",
    "bad chunk": b"PUT /v1/tables/f32/rows HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
                 + b"\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"ids\r\nzz\r\n",
}


@pytest.mark.parametrize("how", list(HANG_UPS))
def test_a_client_that_hangs_up_mid_body_is_no_server_error(server, caplog, how):
    """The request is dropped quietly: no 500 in /metrics, no traceback in the log, nothing written."""
    http, model, _ = server
    caplog.set_level(logging.INFO)
    endpoint = "/v1/tables/{name}/rows"
    before = request_counts(http, endpoint)
    with socket.create_connection((http.base_url.host, http.base_url.port)) as s:
        s.sendall(HANG_UPS[how])
    deadline = time.monotonic() + 20
    while sum(request_counts(http, endpoint).values()) == sum(before.values()):  # until the server has seen it
        assert time.monotonic() < deadline, "the server never finished the request"
        time.sleep(0.05)
    after = request_counts(http, endpoint)
    grown = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    assert grown == {"400": 1}, grown
    assert not any(r.exc_info or r.levelno >= logging.ERROR for r in caplog.records), caplog.text
    assert_store_is(http, model)


def test_a_reload_keeps_every_acknowledged_row(server):
    """After whatever the module sent, a reload (flush, reopen from disk) reads back exactly the model; a body
    the reload does not take is ignored, and a wrong token is a 401 that reloads nothing."""
    http, model, _ = server
    reloads = send(http, "POST", "/v1/admin/reload", headers=AUTH, content=b"\xff junk").json()["reloads"]
    expect(send(http, "POST", "/v1/admin/reload", headers={"Authorization": "Bearer nope"}), 401, "token")
    assert_store_is(http, model)
    assert send(http, "POST", "/v1/admin/reload", headers=AUTH).json()["reloads"] == reloads + 1


# --- the heavy variant ----------------------------------------------------------------------------------------
CHECKS: list[Callable[[Any, st.DataObject], None]] = [check_lookup_json, check_lookup_binary, check_pooled_json,
                                                      check_pooled_binary, check_row_write, check_predict]


@pytest.mark.slow
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
@settings(max_examples=1500, **FUZZ)
@given(data=st.data())
def test_heavy_fuzz(server, check, data):
    check(server, data)


@pytest.mark.parametrize("method,path", [("PUT", "/v1/tables/f32/rows"), ("POST", "/v1/models/m/predict")])
def test_a_binary_body_on_a_json_only_route_says_so(server, method, path):
    """Rows and predictions have no binary form: the answer names the content type the route takes
    (it said "Invalid JSON"), and nothing is written."""
    http, model, _ = server
    resp = send(http, method, path, content=b"\0" * 16, headers=AUTH | {"Content-Type": BINARY})
    expect(resp, 400, path)
    assert "takes a JSON body" in resp.json()["detail"]
    assert_store_is(http, model)


@pytest.mark.parametrize("path", ["/v1/tables/f32/", "/v1/tables/f32%2F", "/v1/tables/"])
def test_a_trailing_slash_is_no_such_path_not_a_redirect(server, path):
    """Starlette redirected ``/v1/tables/f32/`` to the name without the slash (307), which a client
    following redirects took for that table; a path no route has is a 404."""
    http, _, _ = server
    expect(send(http, "GET", path), 404, path)
