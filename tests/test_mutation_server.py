"""The server and its client: behaviours a mutation audit found unpinned (session 11).

Everything runs against real stores and a real uvicorn on a loopback port, except the pure
pieces (``PooledCache`` over a numpy reference, ``LookupBatcher`` over a numpy table,
``RateMeter`` with explicit clocks, ``status_of``), which are tested directly.
"""

from __future__ import annotations

import asyncio
import re
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import embstore
from embstore.client import LookupClient, bags
from embstore.errors import StoreClosedError
from embstore.server import ServerSettings, create_app
from embstore.server.batching import LookupBatcher
from embstore.server.errors import status_of
from embstore.server.metrics import RateMeter
from embstore.server.pooled_cache import ENTRY_OVERHEAD, PooledCache
from embstore.server.state import GroupCommit, TableService
from embstore.server.testing import ServerThread
from test_server import AUTH, BINARY, DIM, TOKEN, make_store, post_bin, rows_of, same_bits, start

JSON = "application/json"


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A read-only server with room for answers beyond the 1 MiB offload threshold, and the store's rows."""
    path = tmp_path_factory.mktemp("mutserver") / "store"
    expected = make_store(path)
    srv = start(path, max_ids=100_000)
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        yield client, expected
    srv.stop()


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of a Prometheus text exposition."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    m = re.search(rf"^{re.escape(name)}{{{re.escape(want)}}} (\S+)$", text, re.M)
    assert m, f"{name}{{{want}}} not in /metrics"
    return float(m.group(1))


# --- protocol: content negotiation and defaults ----------------------------------------------------
@pytest.mark.parametrize("accept,binary", [
    (f"{BINARY};q=0.5, */*", False), (f"{BINARY};q=0.5, application/*", False),
    (f"{BINARY};q=0.5, */*;q=0.1", True), (f"{BINARY}, */*", True),
    (f"{BINARY};q=0.5, application/json;q=0.2, */*", True),  # */* does not lift a json listed lower
    (f"{BINARY};q=1.5", False), (f"{BINARY};q=0.5", True),
])
def test_accept_wildcards_give_json_their_quality(big, accept, binary):
    """RFC 9110: ``*/*`` and ``application/*`` rank JSON too, so a lower binary q loses to them; a q above 1 is
    unreadable (refused)."""
    client, expected = big
    resp = client.post("/v1/tables/t/lookup", json={"ids": [3, 4]}, headers={"Accept": accept})
    assert resp.headers["content-type"].startswith(BINARY if binary else JSON)
    assert same_bits(rows_of(resp), expected["t"][[3, 4]])


def test_binary_content_type_is_case_insensitive(big):
    """Media types are case-insensitive: ``Application/Octet-Stream`` bodies are binary ids."""
    client, expected = big
    resp = client.post("/v1/tables/t/lookup", content=np.array([5, 6], "<i8").tobytes(),
                       headers={"Content-Type": "Application/Octet-Stream; charset=binary", "Accept": BINARY})
    assert same_bits(rows_of(resp), expected["t"][[5, 6]])


def test_pooled_mode_defaults_to_sum_in_both_protocols(big):
    """An omitted mode pools by sum (JSON body without "mode"; binary body without ?mode=)."""
    client, expected = big
    ids, offsets = np.array([1, 2, 3, 7], np.int64), np.array([0, 3, 4], np.int64)
    want = np.stack([expected["t"][[1, 2, 3]].sum(0), expected["t"][7]])
    as_json = rows_of(client.post("/v1/tables/t/pooled", json={"ids": ids.tolist(), "offsets": offsets.tolist()}))
    as_bin = rows_of(post_bin(client, "/v1/tables/t/pooled", np.concatenate([offsets, ids]), num_bags=2))
    np.testing.assert_allclose(as_json, want, rtol=1e-6)
    assert same_bits(as_json, as_bin)


@pytest.mark.parametrize("accept", [BINARY, JSON])
def test_answers_beyond_the_offload_threshold_follow_accept(big, accept):
    """A pooled answer over 1 MiB (encoded in a worker thread) still takes its format from ``Accept``, not from
    the request's ``Content-Type``."""
    client, _ = big
    bags_ = 40_000  # 40k bags * 8 floats * 4 bytes > 1 MiB
    if accept == BINARY:  # a JSON request asking for binary rows
        resp = client.post("/v1/tables/t/pooled", json={"ids": [], "offsets": [0] * (bags_ + 1)},
                           headers={"Accept": accept})
    else:  # a binary request asking for JSON rows
        resp = post_bin(client, "/v1/tables/t/pooled", np.zeros(bags_ + 1, np.int64), accept=accept, num_bags=bags_)
    assert resp.headers["content-type"].startswith(accept)
    got = rows_of(resp)
    assert got.shape == (bags_, DIM) and not got.any()


# --- middleware: limits and timeout --------------------------------------------------------------
@pytest.fixture
def small_body(tmp_path):
    """A server whose body limit is 4096 bytes (512 int64 ids)."""
    expected = make_store(tmp_path / "s")
    with ServerThread(create_app(ServerSettings(store=tmp_path / "s", max_body_bytes=4096))) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as client:
        yield client, expected


def test_a_body_of_exactly_the_limit_is_accepted_declared_or_chunked(small_body):
    """The body limit is inclusive, both for a declared Content-Length and for a chunked body."""
    client, expected = small_body
    ids = np.arange(512, dtype=np.int64)  # 4096 bytes
    assert same_bits(rows_of(post_bin(client, "/v1/tables/t/lookup", ids)), expected["t"][ids])

    def chunks(values):
        raw = values.astype("<i8").tobytes()
        for i in range(0, len(raw), 1000):
            yield raw[i:i + 1000]

    headers = {"Content-Type": BINARY, "Accept": BINARY}
    assert same_bits(rows_of(client.post("/v1/tables/t/lookup", content=chunks(ids), headers=headers)),
                     expected["t"][ids])
    for body in (np.arange(513, dtype=np.int64), None):
        resp = (post_bin(client, "/v1/tables/t/lookup", np.arange(513)) if body is None else
                client.post("/v1/tables/t/lookup", content=chunks(body), headers=headers))
        assert resp.status_code == 413 and "4096" in resp.json()["detail"]


def test_request_timeout_zero_means_no_timeout(tmp_path):
    """``request_timeout=0`` turns the timeout off (it does not time every request out at once)."""
    expected = make_store(tmp_path / "s")
    with ServerThread(create_app(ServerSettings(store=tmp_path / "s", request_timeout=0))) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as client:
        assert same_bits(rows_of(post_bin(client, "/v1/tables/t/lookup", np.arange(100))), expected["t"][:100])


# --- metrics --------------------------------------------------------------------------------------
def test_metrics_values_equal_the_table_detail(tmp_path):
    """/metrics reports the same per-tier counters and gauges, pooled-cache and batching counts as
    ``GET /v1/tables/{name}``, and the in-flight gauge counts only the scrape itself once requests are done."""
    make_store(tmp_path / "s")
    with ServerThread(create_app(ServerSettings(store=tmp_path / "s"))) as srv:
        async def burst():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
                await asyncio.gather(*(c.post("/v1/tables/t/lookup", content=np.arange(i, i + 9).tobytes(),
                                              headers={"Content-Type": BINARY}) for i in range(0, 600, 20)))

        asyncio.run(burst())
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            bag = {"ids": [1, 2, 3, 4], "offsets": [0, 2, 4, 4]}
            for _ in range(3):
                client.post("/v1/tables/t/pooled", json=bag)
            client.post("/v1/tables/t/pooled", json={"ids": [9], "offsets": [0, 1]})
            detail = client.get("/v1/tables/t").json()
            text = client.get("/metrics").text
    b, pc = detail["batching"], detail["pooled_cache"]
    assert b["requests"] == 30 and 1 <= b["batches"] <= 30
    assert metric(text, "embstore_lookup_batched_requests_total", table="t") == 30
    assert metric(text, "embstore_lookup_batches_total", table="t") == b["batches"]
    assert (pc["hits"], pc["misses"]) == (4, 3)
    assert metric(text, "embstore_pooled_cache_hits_total", table="t") == 4
    assert metric(text, "embstore_pooled_cache_misses_total", table="t") == 3
    assert metric(text, "embstore_pooled_cache_bytes", table="t") == pc["bytes"] > 0
    for tier, counters in detail["stats"].items():
        for k in ("hits", "misses", "evictions", "bytes_read", "bytes_written"):
            assert metric(text, f"embstore_tier_{k}_total", table="t", tier=tier) == counters[k], (tier, k)
        for k in ("resident_rows", "capacity_rows"):
            assert metric(text, f"embstore_tier_{k}", table="t", tier=tier) == counters[k], (tier, k)
    assert metric(text, "embstore_table_lookups_total", table="t") == detail["lookups"]
    assert float(re.search(r"^embstore_http_requests_in_flight (\S+)$", text, re.M).group(1)) == 1.0


def test_rate_meter_counts_whole_past_seconds_only():
    """Rates average the last ``window`` whole seconds (not the one in progress), and a bucket reused after the
    window wrapped around starts from zero."""
    meter = RateMeter(window=4)
    for now, n in ((100.2, 3), (101.5, 5), (103.9, 2), (104.1, 7)):
        for _ in range(n):
            meter.add("GET /x", now=now)
    assert meter.rates(now=104.5) == {"GET /x": (3 + 5 + 2) / 4}  # 104 is in progress
    assert meter.rates(now=105.0) == {"GET /x": (5 + 2 + 7) / 4}  # 100 has left the window
    for _ in range(4):
        meter.add("GET /x", now=105.3)  # second 105 reuses second 100's bucket
    assert meter.rates(now=106.0) == {"GET /x": (2 + 7 + 4) / 4}  # 101 has left the window too
    assert meter.rates(now=200.0) == {"GET /x": 0.0}


# --- errors ---------------------------------------------------------------------------------------
def test_store_closed_under_a_request_is_503_not_500():
    """A store that went away under a request (a failed reload) is the server's state: ``503``."""
    assert status_of(StoreClosedError("closed")) == 503


def test_a_lowercase_bearer_scheme_is_accepted(tmp_path):
    """The auth scheme is case-insensitive (RFC 9110): ``bearer TOKEN`` writes, a wrong token still does not."""
    make_store(tmp_path / "s")
    with ServerThread(create_app(ServerSettings(store=tmp_path / "s", token=TOKEN))) as srv, \
            httpx.Client(base_url=srv.url) as client:
        row = {"ids": [4], "embeddings": [[1.5] * DIM]}
        assert client.put("/v1/tables/t/rows", json=row, headers={"Authorization": f"bearer {TOKEN}"}).status_code == 204
        assert client.put("/v1/tables/t/rows", json=row, headers={"Authorization": "bearer x"}).status_code == 401
        assert (rows_of(client.post("/v1/tables/t/lookup", json={"ids": [4]})) == 1.5).all()


# --- batching -------------------------------------------------------------------------------------
def _run_in_thread(coro_fn, timeout: float = 20.0):
    """Run ``asyncio.run(coro_fn())`` in a thread and fail (not hang) if it does not finish in ``timeout``."""
    box: dict = {}

    def target():
        try:
            box["value"] = asyncio.run(coro_fn())
        except BaseException as exc:  # re-raised below
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the event loop did not finish (a batcher spinning or waiting forever)"
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_batcher_fills_a_read_up_to_max_ids_and_takes_an_oversized_request_alone():
    """A read holds requests up to ``max_ids`` ids inclusive; a single request larger than that still gets read."""
    w = np.random.default_rng(2).standard_normal((50, 3)).astype(np.float32)
    calls: list[int] = []

    def lookup(ids):
        calls.append(len(ids))
        return w[ids]

    async def offload(fn, *args):
        return fn(*args)

    async def main():
        batcher = LookupBatcher(lookup, offload, wait=0.001, max_ids=4)
        reqs = [np.array([1, 2]), np.array([3, 4]), np.array([5]), np.arange(10, 17), np.array([6])]
        outs = await asyncio.gather(*(batcher.lookup(r) for r in reqs))
        for r, o in zip(reqs, outs):
            assert same_bits(o, w[r])
        return batcher.stats.batches

    batches = _run_in_thread(main)
    assert calls == [4, 1, 7, 1] and batches == 4


def test_a_bad_request_never_fails_the_batch_it_would_join(tmp_path):
    """Lookups coalesced into one read: the one with an out-of-range id gets its 400 error, the others their rows."""
    expected = make_store(tmp_path / "s")
    with embstore.open(tmp_path / "s") as store:
        svc = TableService(store["t"], ServerSettings(store=tmp_path / "s", batch_wait=0.02))
        assert svc.batcher is not None and not svc._inline_ok

        async def main():
            return await asyncio.gather(svc.lookup(np.array([1, 2])), svc.lookup(np.array([3, 1000])),
                                        svc.lookup(np.array([999])), return_exceptions=True)

        good1, bad, good2 = _run_in_thread(main)
    assert isinstance(bad, embstore.IdOutOfRangeError)
    assert same_bits(good1, expected["t"][[1, 2]]) and same_bits(good2, expected["t"][[999]])


def test_batching_counts_requests_and_reads_in_the_detail_and_metrics(tmp_path):
    """Three lookups coalesced into one read count as 3 requests and 1 batch, in the table detail and /metrics."""
    from prometheus_client import CollectorRegistry, generate_latest

    from embstore.server.app import table_snapshot
    from embstore.server.metrics import StoreCollector

    make_store(tmp_path / "s")
    with embstore.open(tmp_path / "s") as store:
        svc = TableService(store["t"], ServerSettings(store=tmp_path / "s", batch_wait=0.02))

        async def main():
            return await asyncio.gather(*(svc.lookup(np.array([i, i + 1])) for i in range(3)))

        _run_in_thread(main)
        snap = table_snapshot(svc)
        registry = CollectorRegistry()
        registry.register(StoreCollector(lambda: {"t": snap}))
        text = generate_latest(registry).decode()
    assert snap["batching"] == {"requests": 3, "batches": 1}
    assert metric(text, "embstore_lookup_batched_requests_total", table="t") == 3
    assert metric(text, "embstore_lookup_batches_total", table="t") == 1


# --- group commit ---------------------------------------------------------------------------------
def test_one_log_sync_covers_every_write_applied_before_it(tmp_path):
    """Writes applied before a sync starts are all made durable by it: waiting on each ticket afterwards
    costs no further syncs; a write applied later needs a new one."""
    make_store(tmp_path / "s")
    with embstore.open(tmp_path / "s") as store:
        syncs: list[int] = []

        def sync():
            syncs.append(1)
            store.sync_log()

        commit = GroupCommit(sync, store.flush)

        async def main():
            tickets = []
            for i in range(3):
                store.update_logged("t", np.array([i]), np.full((1, DIM), float(i), np.float32))
                tickets.append(commit.note_write())
            for t in tickets:
                await commit.wait_durable(t)
            first = len(syncs)
            store.update_logged("t", np.array([7]), np.ones((1, DIM), np.float32))
            await commit.wait_durable(commit.note_write())
            return first

        assert _run_in_thread(main) == 1
        assert len(syncs) == commit.syncs == 2


# --- pooled cache ---------------------------------------------------------------------------------
def _pool_ref(w: np.ndarray, ids: np.ndarray, offsets: np.ndarray, mode: str) -> np.ndarray:
    out = np.zeros((len(offsets) - 1, w.shape[1]), np.float32)
    for b in range(len(offsets) - 1):
        rows = w[ids[offsets[b]:offsets[b + 1]]]
        if len(rows):
            out[b] = rows.sum(axis=0) if mode == "sum" else rows.mean(axis=0)
    return out


def _cache(w: np.ndarray, capacity: int) -> PooledCache:
    return PooledCache(lambda i, o, m: _pool_ref(w, i, o, m), lambda ids: ids, w.shape[1], capacity)


def _one(cache: PooledCache, bag: list[int], mode: str = "sum") -> np.ndarray:
    return cache.lookup_pooled(np.array(bag, np.int64), np.array([0, len(bag)], np.int64), mode)


def test_pooled_cache_evicts_the_least_recently_used_bag():
    """Room for two one-id bags: a hit refreshes a bag, so the third bag evicts the other one."""
    w = np.arange(30, dtype=np.float32).reshape(10, 3)
    entry = 8 + 4 * 3 + ENTRY_OVERHEAD
    cache = _cache(w, 2 * entry)
    _one(cache, [1]), _one(cache, [2]), _one(cache, [1])  # 1 is now the most recent
    _one(cache, [3])  # evicts 2
    before = cache.stats()
    _one(cache, [1])
    _one(cache, [3])
    after = cache.stats()
    assert after["hits"] - before["hits"] == 2 and after["entries"] == 2 and after["bytes"] == 2 * entry
    _one(cache, [2])
    assert cache.stats()["misses"] - after["misses"] == 1


def test_pooled_cache_bytes_and_counts_stay_exact():
    """Recomputing an invalidated bag replaces its entry (bytes unchanged); empty bags are neither hits nor
    misses; a bag larger than the whole budget is not cached and evicts nothing."""
    w = np.arange(30, dtype=np.float32).reshape(10, 3)
    entry = 8 + 4 * 3 + ENTRY_OVERHEAD
    cache = _cache(w, 3 * entry)
    ids, offsets = np.array([1, 2], np.int64), np.array([0, 1, 1, 2, 2], np.int64)  # bags [1] [] [2] []
    cache.lookup_pooled(ids, offsets, "sum")
    for _ in range(5):
        w[1] += 1
        cache.note_write(np.array([1]))
        assert same_bits(cache.lookup_pooled(ids, offsets, "sum"), _pool_ref(w, ids, offsets, "sum"))
    s = cache.stats()
    assert (s["hits"], s["misses"], s["entries"], s["bytes"]) == (5, 7, 2, 2 * entry)
    huge = list(range(10)) * 5  # 50 ids: 400 bytes of key, beyond the 3-entry budget
    assert same_bits(_one(cache, huge), _pool_ref(w, np.array(huge), np.array([0, 50]), "sum"))
    assert cache.stats()["entries"] == 2 and cache.stats()["bytes"] == 2 * entry
    _one(cache, [2])
    assert cache.stats()["hits"] == 6  # bag [2] survived the oversized one


def test_a_write_landing_while_a_bag_is_pooled_is_never_hidden_by_the_cache():
    """A bag read before a concurrent write finished is cached with the epoch seen before the read, so the
    write invalidates it (a deterministic interleaving: the write lands inside the read)."""
    w = np.arange(30, dtype=np.float32).reshape(10, 3)
    cache: PooledCache

    def pool_then_write(ids, offsets, mode):
        out = _pool_ref(w, ids, offsets, mode)  # the read sees the old row 1 ...
        if not getattr(pool_then_write, "done", False):
            pool_then_write.done = True
            w[1] = -1.0  # ... then a writer changes it and announces it
            cache.note_write(np.array([1]))
        return out

    cache = PooledCache(pool_then_write, lambda ids: ids, 3, 1 << 16)
    _one(cache, [1, 2])
    assert same_bits(_one(cache, [1, 2]), _pool_ref(w, np.array([1, 2]), np.array([0, 2]), "sum"))


# --- client -------------------------------------------------------------------------------------
def test_client_sends_the_largest_int64_id(big):
    """``2**63 - 1`` is a valid id of a hashed table: the client sends it (only values above it are refused)."""
    client, expected = big
    base = str(client.base_url)
    ids = np.array([2**63 - 1, 5], np.uint64)
    want = rows_of(post_bin(client, "/v1/tables/item.ctr/lookup", ids.astype(np.int64)))
    for binary in (True, False):
        with LookupClient(base, binary=binary) as c:
            assert same_bits(c.lookup("item.ctr", ids), want)
            assert same_bits(c.lookup("item.ctr", [2**63 - 1, 5]), want)


@given(st.lists(st.integers(0, 5), min_size=1, max_size=6))
@settings(max_examples=50, deadline=None)
def test_bags_refuses_decreasing_offsets(cuts):
    """``bags`` splits like ``ids[offsets[b]:offsets[b+1]]``; offsets that decrease are refused, not split
    into overlapping or reordered bags."""
    ids = list(range(10, 15))
    offsets = [0, *cuts, 5]
    if all(a <= b for a, b in zip(offsets, offsets[1:])):
        assert bags(ids, offsets) == [ids[a:b] for a, b in zip(offsets, offsets[1:])]
    else:
        with pytest.raises(embstore.InvalidInputError, match="offsets must rise"):
            bags(ids, offsets)
