"""HTTP lookup server against a bare FastAPI endpoint doing the same numpy gather, in the same run.

    python tools/bench/bench_server.py            # 1M / 2M-row tables, 3 rounds of 5 s per side
    python tools/bench/bench_server.py --quick    # 100k / 400k rows, 3 rounds of 2 s per side

Each server runs under uvicorn in its own process (same uvicorn settings); the
load generator is an asyncio client in this process, on loopback, sending
binary lookups of 64 ids (little-endian int64 in, float32 rows out) over
keep-alive HTTP/1.1 connections. By default it writes the requests itself
(``--client raw``): httpx's async pool tops out near 1,400 requests/s on a
2-core machine, below what the bare baseline serves, which would turn the ratio
into a measure of the client; ``--client httpx`` runs the same load through
``httpx.AsyncClient``. Answers are checked with httpx against the rows written.

Both sides of a comparison run at the same time in two processes and are
measured in alternating windows (A B A B A B); each figure is the median over
the rounds. Ratios are measured in this run; the machine is shared, so never
compare absolute numbers across runs.

Figures:

1. DRAM-resident table (the DRAM tier holds every row, warmed by one pass over
   all rows before measuring) vs a bare FastAPI endpoint returning
   ``weights[ids]`` from a numpy array:
   - requests/s at saturation (closed loop, ``--concurrency`` connections):
     ratio goal >= 0.8x;
   - p50/p99 latency at a fixed 1,000 requests/s (open loop, latency from each
     request's scheduled send time): goal p99 <= 10 ms.
2. SSD-home table whose DRAM cache holds 10% of the rows, Zipf(``--alpha``)
   ids: requests/s and p99 at saturation with micro-batching on and off.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from fastapi import FastAPI, Request, Response  # module level: the bare app's annotations resolve here

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import nonneg_seconds, positive_float, positive_int, zipf_ids  # noqa: E402


BINARY = "application/octet-stream"
IDS_PER_REQUEST = 64


# --- servers (each in its own process: `bench_server.py _serve KIND ...`) -------------------------
def _serve(argv: list[str]) -> None:
    import uvicorn

    kind, source, port = argv[0], argv[1], int(argv[2])
    if kind == "bare":
        app = _bare_app(np.load(source))
    else:
        from embstore.server import ServerSettings, create_app

        wait = {"batch_wait": float(argv[3])} if len(argv) > 3 else {}
        app = create_app(ServerSettings(store=Path(source), batching=kind != "nobatch", freeze_gc=True,
                                        **wait))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, timeout_keep_alive=30)


def _bare_app(weights: np.ndarray):
    """The baseline: one route, the body read as ids, ``weights[ids]`` returned as bytes."""
    app = FastAPI()
    dim = weights.shape[1]

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.post("/v1/tables/{name}/lookup")
    async def lookup(name: str, request: Request) -> Response:
        ids = np.frombuffer(await request.body(), dtype="<i8")
        return Response(weights[ids].tobytes(), media_type=BINARY, headers={"X-Embedding-Shape": f"{len(ids)},{dim}"})

    return app


class Server:
    """A server subprocess on a free port; waits for /healthz."""

    def __init__(self, *args: str) -> None:
        from embstore.server.testing import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "_serve", args[0], args[1],
                                      str(self.port), *args[2:]])

    def __enter__(self) -> "Server":
        from embstore.server.testing import wait_healthy

        wait_healthy(self.url, self.proc)  # kills the server if it never gets healthy
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(60)


# --- load --------------------------------------------------------------------------------------------


def _pct(lat: list[float], q: float) -> float:
    """The q-th percentile of ``lat`` (seconds) in ms. A window that measured no request has none: the
    benchmark failed (it printed 'nan ms' beside 0 req/s), so say so instead of reporting a figure."""
    if not lat:
        raise RuntimeError("no request completed in the measured window: the server answered nothing in time "
                           "(see its log above); no latency to report")
    return float(np.percentile(np.array(lat) * 1e3, q))


class RawHTTP:
    """A pool of keep-alive HTTP/1.1 connections speaking just enough of the protocol for the load."""

    def __init__(self, url: str, size: int) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port, self.size = host, int(port), size
        self._idle: asyncio.Queue = asyncio.Queue()
        self._opened = 0

    async def post(self, path: str, body: bytes) -> int:
        """POST ``body`` (binary ids) and read the whole answer; returns the status."""
        if self._idle.empty() and self._opened < self.size:
            self._opened += 1
            conn = await asyncio.open_connection(self.host, self.port)
        else:
            conn = await self._idle.get()
        reader, writer = conn
        writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: %s\r\nAccept: %s\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (path.encode(), self.host.encode(), BINARY.encode(),
                                                         BINARY.encode(), len(body), body))
        head = await reader.readuntil(b"\r\n\r\n")
        i = head.lower().index(b"content-length:") + 15
        await reader.readexactly(int(head[i:head.index(b"\r\n", i)]))
        self._idle.put_nowait(conn)
        return int(head[9:12])

    async def aclose(self) -> None:
        while not self._idle.empty():
            _, writer = self._idle.get_nowait()
            writer.close()


class HttpxClient:
    def __init__(self, url: str, size: int) -> None:
        import httpx

        self._client = httpx.AsyncClient(base_url=url, timeout=60,
                                         limits=httpx.Limits(max_connections=size, max_keepalive_connections=size))

    async def post(self, path: str, body: bytes) -> int:
        resp = await self._client.post(path, content=body, headers={"Content-Type": BINARY, "Accept": BINARY})
        return resp.status_code

    async def aclose(self) -> None:
        await self._client.aclose()


CLIENTS = {"raw": RawHTTP, "httpx": HttpxClient}
PATH = "/v1/tables/t/lookup"


def _quiet_gc(fn):
    """Run a measurement with this process's long-lived objects frozen (no 60 ms full collections in it)."""
    def run(*args, **kwargs):
        gc.collect()
        gc.freeze()
        try:
            return asyncio.run(fn(*args, **kwargs))
        finally:
            gc.unfreeze()
    return run


async def _closed_loop(client_kind: str, url: str, bodies: list[bytes], seconds: float, warmup: float,
                       concurrency: int) -> dict:
    """Requests/s and latency with ``concurrency`` requests always outstanding."""
    client = CLIENTS[client_kind](url, concurrency)
    lat: list[float] = []
    errors = done = 0
    start = time.perf_counter()
    measure_from, end = start + warmup, start + warmup + seconds

    async def worker(k: int) -> None:
        nonlocal done, errors
        i = k
        while (t0 := time.perf_counter()) < end:
            status = await client.post(PATH, bodies[i % len(bodies)])
            t1 = time.perf_counter()
            errors += status != 200
            if t0 >= measure_from:
                lat.append(t1 - t0)
                done += 1
            i += concurrency

    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    await client.aclose()
    return {"rps": done / seconds if seconds else 0.0, "p50_ms": _pct(lat, 50), "p99_ms": _pct(lat, 99),
            "errors": errors}


async def _fixed_rate(client_kind: str, url: str, bodies: list[bytes], rate: float, seconds: float,
                      warmup: float) -> dict:
    """Latency at ``rate`` requests/s, measured from each request's scheduled time (no coordinated omission)."""
    client = CLIENTS[client_kind](url, 64)
    n_warm, n = int(rate * warmup), int(rate * (warmup + seconds))
    lat = [0.0] * n
    errors = 0

    async def one(i: int, when: float) -> None:
        nonlocal errors
        status = await client.post(PATH, bodies[i % len(bodies)])
        lat[i] = time.perf_counter() - when
        errors += status != 200

    start = time.perf_counter() + 0.05
    tasks = []
    i = 0
    while i < n:
        now = time.perf_counter()
        while i < n and start + i / rate <= now:
            tasks.append(asyncio.create_task(one(i, start + i / rate)))
            i += 1
        await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    await client.aclose()
    measured = lat[n_warm:]
    return {"rate": rate, "achieved_rps": n / elapsed, "p50_ms": _pct(measured, 50), "p99_ms": _pct(measured, 99),
            "errors": errors}


closed_loop = _quiet_gc(_closed_loop)
fixed_rate = _quiet_gc(_fixed_rate)


def _bodies(ids: np.ndarray) -> list[bytes]:
    return [ids[i:i + IDS_PER_REQUEST].astype("<i8").tobytes() for i in range(0, len(ids), IDS_PER_REQUEST)]


# --- stores --------------------------------------------------------------------------------------------
def _write_rows(table, weights: np.ndarray, chunk: int = 1 << 15) -> None:
    for lo in range(0, len(weights), chunk):
        table.write_physical(np.arange(lo, min(lo + chunk, len(weights)), dtype=np.int64), weights[lo:lo + chunk])


def _make_dram_store(path: Path, weights: np.ndarray) -> None:
    import embstore
    from embstore.config import StoreConfig, TableConfig, TierConfig

    rows, dim = weights.shape
    cfg = StoreConfig((TableConfig("t", rows, dim, tiers=(TierConfig("dram", rows * dim * 4), TierConfig("mmap"))),))
    with embstore.create(path, cfg) as store:
        _write_rows(store["t"], weights)


def _make_ssd_store(path: Path, rows: int, dim: int) -> None:
    import embstore
    from embstore.config import StoreConfig, TableConfig, TierConfig

    cache = max(1, rows // 10) * dim * 4  # at least one row: a tier must hold one
    cfg = StoreConfig((TableConfig("t", rows, dim, tiers=(TierConfig("dram", cache, "lru"), TierConfig("ssd"))),))
    with embstore.create(path, cfg) as store:
        rng = np.random.default_rng(1)
        for lo in range(0, rows, 1 << 15):
            n = min(1 << 15, rows - lo)
            store["t"].write_physical(np.arange(lo, lo + n, dtype=np.int64),
                                      rng.standard_normal((n, dim), dtype=np.float32))


# --- main ----------------------------------------------------------------------------------------------
def _median(rounds: list[dict], key: str) -> float:
    return float(np.median([r[key] for r in rounds]))


def _interleaved(sides: dict[str, str], measure, rounds: int) -> dict[str, list[dict]]:
    """``measure(url)`` on every side, round after round (A B A B ...), so that load from other
    processes on a shared machine hits both sides alike."""
    out: dict[str, list[dict]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, url in sides.items():
            out[name].append(measure(url))
    return out


def _warm_dram(url: str, rows: int) -> None:
    """Look every row up once, so the DRAM tier holds the whole table before measuring."""
    import httpx

    for lo in range(0, rows, 1 << 17):
        body = np.arange(lo, min(lo + (1 << 17), rows), dtype="<i8").tobytes()
        assert httpx.post(url + PATH, content=body, headers={"Content-Type": BINARY}, timeout=120).status_code == 200


def _check_rows(url: str, body: bytes, want: np.ndarray) -> None:
    """Correctness guard: the server answers exactly ``want``."""
    import httpx

    resp = httpx.post(url + PATH, content=body, headers={"Content-Type": BINARY, "Accept": BINARY}, timeout=60)
    got = np.frombuffer(resp.content, "<f4").reshape(want.shape)
    assert np.array_equal(got, want), url


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 s windows, smaller tables")
    ap.add_argument("--seconds", type=positive_float, default=None,
                    help="one measurement window (default 5, quick 2)")
    ap.add_argument("--rounds", type=positive_int, default=3,
                    help="windows per side, interleaved; medians are reported")
    ap.add_argument("--warmup", type=nonneg_seconds, default=None,
                    help="unmeasured load per side first (default 3, quick 1.5)")
    ap.add_argument("--dim", type=positive_int, default=64)
    ap.add_argument("--dram-rows", type=positive_int, default=None, help="default 1M, quick 100k")
    ap.add_argument("--ssd-rows", type=positive_int, default=None, help="default 2M, quick 400k")
    ap.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of the SSD-table ids")
    ap.add_argument("--concurrency", type=positive_int, default=32, help="connections of the closed-loop load")
    ap.add_argument("--rate", type=positive_float, default=1000.0, help="fixed request rate for the latency figure")
    ap.add_argument("--client", choices=sorted(CLIENTS), default="raw", help="load generator (see above)")
    ap.add_argument("--dir", type=Path, default=None, help="where the stores go (default: a temp dir)")
    args = ap.parse_args(argv)
    seconds = args.seconds or (2.0 if args.quick else 5.0)
    warmup = args.warmup if args.warmup is not None else (1.5 if args.quick else 3.0)
    dram_rows = args.dram_rows or (100_000 if args.quick else 1_000_000)
    ssd_rows = args.ssd_rows or (400_000 if args.quick else 2_000_000)
    rng = np.random.default_rng(0)
    results: dict = {"window_seconds": seconds, "rounds": args.rounds, "concurrency": args.concurrency,
                     "ids_per_request": IDS_PER_REQUEST, "client": args.client}
    settle = min(0.5, warmup)  # per window: reconnect and refill the pipeline before timing

    def saturated(url: str) -> dict:
        return closed_loop(args.client, url, bodies, seconds, settle, args.concurrency)

    def at_rate(url: str) -> dict:
        return fixed_rate(args.client, url, bodies, args.rate, seconds, settle)

    with tempfile.TemporaryDirectory(prefix="bench_server_", dir=args.dir) as tmp:
        tmp = Path(tmp)
        weights = rng.standard_normal((dram_rows, args.dim), dtype=np.float32)
        np.save(tmp / "weights.npy", weights)
        _make_dram_store(tmp / "dram", weights)
        bodies = _bodies(rng.integers(0, dram_rows, 4096 * IDS_PER_REQUEST))
        with Server("bare", str(tmp / "weights.npy")) as bare, Server("ours", str(tmp / "dram")) as ours:
            sides = {"bare": bare.url, "embstore": ours.url}
            for url in sides.values():
                _check_rows(url, bodies[0], weights[np.frombuffer(bodies[0], "<i8")])
                _warm_dram(url, dram_rows)
                closed_loop(args.client, url, bodies, 0.0, warmup, args.concurrency)
            sat = _interleaved(sides, saturated, args.rounds)
            fixed = _interleaved(sides, at_rate, args.rounds)
        del weights
        dram: dict = {name: {"rps": _median(sat[name], "rps"), "saturated_p99_ms": _median(sat[name], "p99_ms"),
                             "p50_ms_at_rate": _median(fixed[name], "p50_ms"),
                             "p99_ms_at_rate": _median(fixed[name], "p99_ms"),
                             "errors": sum(r["errors"] for r in sat[name] + fixed[name]),
                             "rounds": sat[name] + fixed[name]}
                      for name in sides}
        dram["rps_ratio"] = float(np.median([o["rps"] / b["rps"] for o, b in zip(sat["embstore"], sat["bare"])]))
        results["dram"] = dram
        for name in sides:
            d = dram[name]
            print(f"[dram] {name:8s}: {d['rps']:7.0f} req/s saturated (p99 {d['saturated_p99_ms']:.1f} ms); at "
                  f"{args.rate:.0f} req/s p50 {d['p50_ms_at_rate']:.2f} ms, p99 {d['p99_ms_at_rate']:.2f} ms "
                  f"(errors {d['errors']})")
        print(f"[dram] requests/s ratio embstore / bare FastAPI: {dram['rps_ratio']:.2f}x (goal >= 0.8); "
              f"embstore p99 at {args.rate:.0f} req/s: {dram['embstore']['p99_ms_at_rate']:.2f} ms (goal <= 10)")

        _make_ssd_store(tmp / "ssd_on", ssd_rows, args.dim)
        shutil.copytree(tmp / "ssd_on", tmp / "ssd_off")  # one store directory per server
        bodies = _bodies(zipf_ids(rng, 4096 * IDS_PER_REQUEST, ssd_rows, args.alpha))
        with Server("ours", str(tmp / "ssd_on")) as on, Server("nobatch", str(tmp / "ssd_off")) as off:
            sides = {"batching_on": on.url, "batching_off": off.url}
            for url in sides.values():  # fill the DRAM cache
                closed_loop(args.client, url, bodies, 0.0, warmup, args.concurrency)
            sat = _interleaved(sides, saturated, args.rounds)
        ssd: dict = {name: {"rps": _median(sat[name], "rps"), "p50_ms": _median(sat[name], "p50_ms"),
                            "p99_ms": _median(sat[name], "p99_ms"), "errors": sum(r["errors"] for r in sat[name]),
                            "rounds": sat[name]} for name in sides}
        ssd["rps_ratio_on_off"] = float(np.median([a["rps"] / b["rps"] for a, b in
                                                   zip(sat["batching_on"], sat["batching_off"])]))
        for name in sides:
            d = ssd[name]
            print(f"[ssd, cache 10%, zipf {args.alpha}] {name:12s}: {d['rps']:7.0f} req/s, p50 {d['p50_ms']:.1f} ms, "
                  f"p99 {d['p99_ms']:.1f} ms (errors {d['errors']})")
        print(f"[ssd] requests/s with micro-batching / without: {ssd['rps_ratio_on_off']:.2f}x")
        results["ssd"] = ssd
    return results


if __name__ == "__main__":
    if sys.argv[1:2] == ["_serve"]:
        _serve(sys.argv[2:])
    else:
        main(sys.argv[1:])
