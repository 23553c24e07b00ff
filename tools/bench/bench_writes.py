"""PUT throughput and latency of the HTTP server: durable acknowledgements against acknowledgements on apply.

    python tools/bench/bench_writes.py            # 1M-row table, 3 rounds of 4 s per side
    python tools/bench/bench_writes.py --quick    # 100k rows, 3 rounds of 2 s

Two ``embstore serve`` processes over two copies of one store (a table whose
DRAM cache holds 10% of its rows above an ssd home, ``--layout`` in_place or
log) run at once: one answers a PUT once its rows are durable (the defaults:
logged, concurrent writers share one sync, a flush every 30 s), the other
with ``--no-durable-writes --flush-interval 1`` (answer on apply; a crash
loses up to a second of writes). ``--concurrency`` clients each keep
one PUT of ``--rows-per-put`` random rows in flight; the sides take turns in
windows (A B A B ...), medians over the rounds. Figure: requests/s and
p50/p99 of each side, and the ratio durable / on-apply.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import positive_float, positive_int  # noqa: E402
from bench_server import _interleaved, _median, _pct, _quiet_gc  # noqa: E402


class ServeProcess:
    """``embstore serve STORE FLAGS`` on a free port, until the context exits."""

    def __init__(self, store: Path, *flags: str) -> None:
        from embstore.server.testing import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "embstore.cli", "serve", str(store), "--port",
                                      str(self.port), *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def __enter__(self) -> "ServeProcess":
        from embstore.server.testing import wait_healthy

        wait_healthy(self.url, self.proc)  # kills the server if it never gets healthy
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(120)


async def _put_load(url: str, bodies: list[bytes], seconds: float, warmup: float, concurrency: int) -> dict:
    """PUTs/s and latency with ``concurrency`` PUTs always outstanding."""
    import httpx

    lat: list[float] = []
    errors = done = 0
    start = time.perf_counter()
    measure_from, end = start + warmup, start + warmup + seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        async def worker(k: int) -> None:
            nonlocal done, errors
            i = k
            while (t0 := time.perf_counter()) < end:
                r = await client.put("/v1/tables/t/rows", content=bodies[i % len(bodies)],
                                     headers={"Content-Type": "application/json"})
                t1 = time.perf_counter()
                errors += r.status_code != 204
                if t0 >= measure_from:
                    lat.append(t1 - t0)
                    done += 1
                i += concurrency

        await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return {"rps": done / seconds, "p50_ms": _pct(lat, 50), "p99_ms": _pct(lat, 99), "errors": errors}


put_load = _quiet_gc(_put_load)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="100k rows, 2 s windows")
    ap.add_argument("--rows", type=positive_int, default=None, help="table rows (default 1M, quick 100k)")
    ap.add_argument("--dim", type=positive_int, default=64)
    ap.add_argument("--layout", choices=["in_place", "log"], default="in_place", help="the ssd home's layout")
    ap.add_argument("--rows-per-put", type=positive_int, default=4, help="random rows per PUT (default 4)")
    ap.add_argument("--concurrency", type=positive_int, default=16, help="PUTs in flight (default 16)")
    ap.add_argument("--rounds", type=positive_int, default=3, help="windows per side, alternating (default 3)")
    ap.add_argument("--seconds", type=positive_float, default=None, help="per window (default 4, quick 2)")
    args = ap.parse_args(argv)
    rows = args.rows or (100_000 if args.quick else 1_000_000)
    seconds = args.seconds or (2.0 if args.quick else 4.0)
    import json

    import embstore
    from embstore.config import StoreConfig, TableConfig, TierConfig

    rng = np.random.default_rng(0)
    bodies = [json.dumps({"ids": rng.integers(0, rows, args.rows_per_put).tolist(),
                          "embeddings": rng.standard_normal((args.rows_per_put, args.dim)).round(4).tolist()}).encode()
              for _ in range(256)]
    results: dict = {"rows": rows, "dim": args.dim, "layout": args.layout, "rows_per_put": args.rows_per_put,
                     "concurrency": args.concurrency}
    with tempfile.TemporaryDirectory(dir=os.environ.get("EMBSTORE_BENCH_DIR")) as tmp:
        cache = max(1, rows // 10) * args.dim * 4  # at least one row: a tier must hold one
        cfg = StoreConfig((TableConfig("t", rows, args.dim, tiers=(
            TierConfig("dram", cache, "lru"), TierConfig("ssd", layout=args.layout))),))
        embstore.create(f"{tmp}/a", cfg).close()
        shutil.copytree(f"{tmp}/a", f"{tmp}/b")
        with ServeProcess(Path(f"{tmp}/a")) as durable, \
                ServeProcess(Path(f"{tmp}/b"), "--no-durable-writes", "--flush-interval", "1") as on_apply:
            sides = {"durable": durable.url, "on_apply": on_apply.url}
            for url in sides.values():  # warm-up
                put_load(url, bodies, 0.5, 0.0, args.concurrency)
            rounds = _interleaved(sides, lambda url: put_load(url, bodies, seconds, 0.3, args.concurrency),
                                  args.rounds)
    for name, rs in rounds.items():
        results[name] = {k: _median(rs, k) for k in ("rps", "p50_ms", "p99_ms")}
        results[name]["errors"] = sum(r["errors"] for r in rs)
    results["ratio"] = results["durable"]["rps"] / results["on_apply"]["rps"]
    print(f"PUT of {args.rows_per_put} rows, {rows:,}-row table (10% DRAM cache, ssd {args.layout}), "
          f"{args.concurrency} writers")
    for name in ("durable", "on_apply"):
        r = results[name]
        print(f"  {name:9s} {r['rps']:8.0f} PUT/s  p50 {r['p50_ms']:6.2f} ms  p99 {r['p99_ms']:7.2f} ms  "
              f"errors {r['errors']}")
    print(f"  durable / on apply: {results['ratio']:.2f}x")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
