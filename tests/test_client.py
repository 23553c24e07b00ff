"""embstore.client.LookupClient against a real server on a loopback port.

Expected values are read from the store directly before the server opens it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import embstore
from embstore.client import LookupClient, ServerError
from embstore.config import StoreConfig, TableConfig, TierConfig
from embstore.server import ServerSettings, create_app
from embstore.server.testing import ServerThread, free_port, wait_healthy

TOKEN = "client-test-token"
N, DIM = 500, 6
IDS = np.array([7, 3, 3, 9, 1, 499, 0], np.int64)
OFFSETS = np.array([0, 3, 3, 5, 7], np.int64)  # bags [7 3 3] [] [9 1] [499 0]


def make_store(path: Path) -> dict[str, np.ndarray]:
    cfg = StoreConfig((TableConfig("user_id", N, DIM, tiers=(TierConfig("dram", 2048), TierConfig("ssd"))),))
    with embstore.create(path, cfg) as store:
        t = store["user_id"]
        t.update(np.arange(0, N, 3, dtype=np.int64),
                 np.random.default_rng(3).standard_normal((len(range(0, N, 3)), DIM)).astype(np.float32))
        return {"rows": t.lookup(np.arange(N, dtype=np.int64)),
                "sum": t.lookup_pooled(IDS, OFFSETS, "sum"), "mean": t.lookup_pooled(IDS, OFFSETS, "mean")}


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == np.float32 and a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("client") / "store"
    expected = make_store(path)
    srv = ServerThread(create_app(ServerSettings(store=path, token=TOKEN, max_ids=1000))).start()
    yield srv, expected
    srv.stop()


@pytest.fixture(params=[True, False], ids=["binary", "json"])
def client(server, request):
    with LookupClient(server[0].url, binary=request.param) as c:
        yield c


@settings(max_examples=20, deadline=None)
@given(ids=st.lists(st.integers(0, N - 1), max_size=50))
def test_lookup_matches_the_store_bit_for_bit(server, ids):
    _, expected = server
    for binary in (True, False):
        with LookupClient(server[0].url, binary=binary) as c:
            got = c.lookup("user_id", ids)
            assert same_bits(got, expected["rows"][np.array(ids, np.int64)].reshape(-1, DIM))
            assert got.flags.writeable


def test_lookup_takes_numpy_and_returns_float32(client, server):
    got = client.lookup("user_id", np.array([4, 4, 2], np.int32))
    assert same_bits(got, server[1]["rows"][[4, 4, 2]])
    assert client.lookup("user_id", []).shape == (0, DIM)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_lookup_pooled_matches_the_store(client, server, mode):
    for _ in range(2):  # the second answer comes from the pooled cache
        assert same_bits(client.lookup_pooled("user_id", IDS, OFFSETS, mode=mode), server[1][mode])


def test_tables_table_health(client):
    assert client.health() == {"status": "ok"}
    assert client.tables() == [{"name": "user_id", "num_embeddings": N, "dim": DIM, "dtype": "float32"}]
    detail = client.table("user_id")
    assert detail["tiers"] == ["dram", "ssd"] and set(detail["stats"]) == {"dram", "ssd"}
    assert "embstore_http_requests_total" in client.metrics()


@pytest.mark.parametrize("call,status,words", [
    (lambda c: c.lookup("nope", [1]), 404, "no table 'nope'; known tables: user_id"),
    (lambda c: c.table("nope"), 404, "no table 'nope'"),
    (lambda c: c.lookup("user_id", [N]), 400, "outside [0, 500)"),
    (lambda c: c.lookup("user_id", np.arange(1001)), 413, "at most 1000"),
    (lambda c: c.lookup_pooled("user_id", [1, 2], [0, 1]), 400, "offsets[-1]"),
    (lambda c: c.lookup_pooled("user_id", [1, 2], [0, 2], mode="max"), 400, "mode"),
    (lambda c: c.update("user_id", [1], np.zeros((1, DIM))), 401, "token"),
    (lambda c: c.reload(), 401, "token"),
])
def test_server_errors_raise_server_error(client, call, status, words):
    with pytest.raises(ServerError) as info:
        call(client)
    assert info.value.status_code == status
    assert words in info.value.message and str(status) in str(info.value)


def test_client_side_validation():
    with LookupClient("http://127.0.0.1:1") as c:
        with pytest.raises(embstore.InvalidInputError, match="integers"):
            c.lookup("t", [1.5])
        with pytest.raises(embstore.InvalidInputError, match="offsets"):
            c.lookup_pooled("t", [1], [])


@pytest.mark.parametrize("call,error,words", [
    # unsigned ids beyond int64 would wrap to negative ids (another row of a hashed table)
    (lambda c: c.lookup("t", np.array([2**64 - 1], np.uint64)), embstore.InvalidInputError, "above"),
    (lambda c: c.lookup("t", [2**63]), embstore.InvalidInputError, "above"),
    (lambda c: c.lookup_pooled("t", [1], np.array([0, 2**63], np.uint64)), embstore.InvalidInputError, "offsets"),
    (lambda c: c.update("t", np.array([2**63], np.uint64), np.zeros((1, DIM))), embstore.InvalidInputError,
     "above"),
    (lambda c: c.predict("m", np.zeros((1, 2)), {"a": [np.array([2**63], np.uint64)]}),
     embstore.InvalidInputError, "sparse['a'][0]"),
    # rows and dense features JSON cannot carry: typed errors, not json's or numpy's ValueError
    (lambda c: c.update("t", [1], np.full((1, DIM), np.nan)), embstore.InvalidRowsError, "finite"),
    (lambda c: c.update("t", [1], np.full((1, DIM), np.inf)), embstore.InvalidRowsError, "finite"),
    (lambda c: c.update("t", [1], np.full((1, DIM), 1e300)), embstore.InvalidRowsError, "finite"),
    (lambda c: c.update("t", [1], [["a"] * DIM]), embstore.InvalidRowsError, "numbers"),
    (lambda c: c.predict("m", [[float("nan"), 0.0]], {"a": [[1]]}), embstore.InvalidInputError, "finite"),
    (lambda c: c.predict("m", [["x", 0.0]], {"a": [[1]]}), embstore.InvalidInputError, "numbers"),
])
def test_client_refuses_what_it_cannot_send_faithfully(call, error, words):
    with LookupClient("http://127.0.0.1:1") as c, pytest.raises(error) as info:
        call(c)
    assert words in str(info.value)


def test_a_non_ascii_token_read_from_a_file_works(tmp_path):
    """The server takes any non-blank UTF-8 token file; the client sends the same bytes."""
    expected = make_store(tmp_path / "s")
    (tmp_path / "token").write_text("jeton-d\u00e9j\u00e0-\u2713\n", encoding="utf-8")
    token = ServerSettings.read_token(tmp_path / "token")
    with ServerThread(create_app(ServerSettings(store=tmp_path / "s", token=token))) as srv:
        with LookupClient(srv.url, token=token) as c:
            c.update("user_id", [4], np.full((1, DIM), 2.0))
            assert (c.lookup("user_id", [4]) == 2.0).all()
        with LookupClient(srv.url, token="jeton-deja") as c, pytest.raises(ServerError) as info:
            c.update("user_id", [4], np.zeros((1, DIM)))
        assert info.value.status_code == 401
        with LookupClient(srv.url) as c:
            assert same_bits(c.lookup("user_id", [5]), expected["rows"][[5]])


def test_connection_errors_are_httpx_errors():
    with LookupClient(f"http://127.0.0.1:{free_port()}", timeout=5) as c, pytest.raises(httpx.ConnectError):
        c.health()


def test_update_with_token_then_reload(tmp_path):
    expected = make_store(tmp_path / "s")
    with ServerThread(create_app(ServerSettings(store=tmp_path / "s", token=TOKEN, flush_interval=0))) as srv:
        with LookupClient(srv.url, token="wrong") as bad, pytest.raises(ServerError) as info:
            bad.update("user_id", [1], np.zeros((1, DIM), np.float32))
        assert info.value.status_code == 401
        with LookupClient(srv.url, token=TOKEN) as c, LookupClient(srv.url, token=TOKEN, binary=False) as cj:
            rows = np.arange(2 * DIM, dtype=np.float32).reshape(2, DIM) / 7
            c.update("user_id", [1, 2], rows)
            with pytest.raises(ServerError) as info:
                cj.update("user_id", [3], np.zeros((1, DIM + 1), np.float32))
            assert info.value.status_code == 422 and "shape (1, 6)" in info.value.message
            assert c.reload()["status"] == "reloaded"
            want = expected["rows"].copy()
            want[[1, 2]] = rows
            assert same_bits(c.lookup("user_id", np.arange(N)), want)
            assert same_bits(cj.lookup("user_id", np.arange(N)), want)
    with embstore.open(tmp_path / "s") as store:
        assert same_bits(store["user_id"].lookup(np.array([1, 2], np.int64)), rows)


def _serve(store: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """``embstore serve`` in a child process, once it answers /healthz."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "embstore.cli", "serve", str(store), "--port", str(port), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    return proc, url


@pytest.mark.parametrize("durable", [True, False])
def test_an_acknowledged_write_survives_sigkill_of_the_server(tmp_path, durable):
    """No periodic flush and rows that stay dirty in the DRAM cache: only the durable acknowledgement
    saves them. The run without it is the control: the same kill loses them."""
    expected = make_store(tmp_path / "s")
    flags = ["--flush-interval", "0"] + ([] if durable else ["--no-durable-writes"])
    proc, url = _serve(tmp_path / "s", *flags)
    written = {i: np.full((1, DIM), 0.25 * (i + 1), np.float32) for i in (1, 4, 7)}
    try:
        with LookupClient(url) as c:
            for i, row in written.items():
                c.update("user_id", [i], row)
    finally:
        proc.kill()  # SIGKILL right after the last 204: no shutdown flush
        proc.wait(60)
    with embstore.open(tmp_path / "s") as store:
        got = store["user_id"].lookup(np.array(list(written), np.int64))
    if durable:
        assert same_bits(got, np.vstack(list(written.values())))
    else:
        assert same_bits(got, expected["rows"][list(written)])


def test_concurrent_writes_share_log_syncs(tmp_path):
    make_store(tmp_path / "s")
    app = create_app(ServerSettings(store=tmp_path / "s", flush_interval=0))
    with ServerThread(app) as srv:
        import concurrent.futures as cf

        def put(i: int) -> None:
            with LookupClient(srv.url) as c:
                c.update("user_id", [i % N], np.full((1, DIM), float(i), np.float32))

        with cf.ThreadPoolExecutor(16) as pool:
            list(pool.map(put, range(64)))
        commit = app.state.gate.current.commit
        assert 1 <= commit.syncs < 64
    with embstore.open(tmp_path / "s") as store:
        assert (store["user_id"].lookup(np.arange(64, dtype=np.int64)) == np.arange(64)[:, None]).all()


@pytest.mark.parametrize("value", ["200", "-1", "nan", "1ms"])
def test_serve_refuses_a_batch_wait_outside_its_range_in_milliseconds(tmp_path, capsys, value):
    from embstore.cli import main

    make_store(tmp_path / "s")
    with pytest.raises(SystemExit) as e:
        main(["serve", str(tmp_path / "s"), "--port", "0", "--batch-wait-ms", value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--batch-wait-ms" in err and "milliseconds" in err and "number of seconds" not in err


def test_embstore_serve_command_end_to_end(tmp_path):
    """`embstore serve` with a token file: writes need the token; Ctrl-C flushes them."""
    expected = make_store(tmp_path / "s")
    (tmp_path / "token").write_text(TOKEN + "\n")
    proc, url = _serve(tmp_path / "s", "--token-file", str(tmp_path / "token"), "--flush-interval", "0",
                       "--max-ids", "10")
    try:
        with LookupClient(url) as anonymous, LookupClient(url, token=TOKEN) as c:
            with pytest.raises(ServerError) as info:
                anonymous.update("user_id", [1], np.ones((1, DIM)))
            assert info.value.status_code == 401
            with pytest.raises(ServerError) as info:
                c.lookup("user_id", np.arange(11))
            assert info.value.status_code == 413 and "at most 10" in info.value.message
            c.update("user_id", [1], np.full((1, DIM), 0.5, np.float32))
            want = np.vstack([expected["rows"][0], np.full(DIM, 0.5, np.float32)])
            assert same_bits(c.lookup("user_id", [0, 1]), want)
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    with embstore.open(tmp_path / "s") as store:
        assert (store["user_id"].lookup(np.array([1], np.int64)) == 0.5).all()
