"""Soak: the lookup server under steady mixed load for minutes; no errors, bounded memory.

    python tools/bench/bench_soak.py                  # 5 minutes (not run in CI)
    python tools/bench/bench_soak.py --quick          # 30 seconds

An `embstore serve`-equivalent subprocess over an SSD-home table (DRAM cache of
10% of rows) takes, at a fixed rate, binary 64-id lookups (Zipf ids), pooled
lookups and a trickle of authenticated row writes, while the server's RSS is
sampled from /proc. Reports requests, errors (any non-2xx) and the RSS growth
from the end of the warm-up to the end of the run (goal: 0 errors, < 5%).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import positive_float, positive_int, zipf_ids  # noqa: E402
from bench_server import Server, _make_ssd_store  # noqa: E402


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def drive(url: str, rows: int, dim: int, seconds: float, rate: float, warmup: float, pid: int) -> dict:
    rng = np.random.default_rng(0)
    pool = zipf_ids(rng, 64 * 4096, rows, 1.05).reshape(4096, 64)  # drawn once: the loop must keep the rate
    updates = rng.standard_normal((64, 4, dim)).round(4).tolist()
    errors: dict[int | str, int] = {}
    counts = {"lookup": 0, "pooled": 0, "write": 0}
    samples: list[tuple[float, int]] = []
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=32, keepalive_expiry=20.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as client:
        slots = asyncio.Semaphore(32)  # bounded in flight: a slow server slows the load, never piles it up

        async def one(i: int) -> None:
            async with slots:
                try:
                    await send(i)
                except httpx.TransportError as exc:  # counted as errors, like any non-2xx answer
                    key = type(exc).__name__
                    errors[key] = errors.get(key, 0) + 1

        async def send(i: int) -> None:
            kind = "write" if i % 50 == 0 else ("pooled" if i % 5 == 0 else "lookup")
            ids = pool[i % len(pool)]
            if kind == "lookup":
                r = await client.post("/v1/tables/t/lookup", content=ids.astype("<i8").tobytes(),
                                      headers={"Content-Type": "application/octet-stream",
                                               "Accept": "application/octet-stream"})
            elif kind == "pooled":
                r = await client.post("/v1/tables/t/pooled",
                                      json={"ids": ids.tolist(), "offsets": [0, 16, 32, 48, 64], "mode": "sum"})
            else:
                r = await client.put("/v1/tables/t/rows", json={"ids": ids[:4].tolist(),
                                                                "embeddings": updates[i % len(updates)]},
                                     )
            counts[kind] += 1
            if r.status_code >= 300:
                errors[r.status_code] = errors.get(r.status_code, 0) + 1

        start = time.perf_counter()
        tasks: set[asyncio.Task] = set()
        i = 0
        next_sample = start
        while (now := time.perf_counter()) < start + warmup + seconds:
            while start + i / rate <= now and len(tasks) < 64:
                t = asyncio.create_task(one(i))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                i += 1
            if now >= next_sample:
                samples.append((now - start, rss_bytes(pid)))
                next_sample += 1.0
            await asyncio.sleep(max(0.0, min(start + i / rate, next_sample) - time.perf_counter()))
        await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    samples.append((elapsed, rss_bytes(pid)))  # the end, and a sample after the warm-up however short the run
    base = next(r for t, r in samples if t >= warmup)
    end = samples[-1][1]
    return {"requests": counts, "achieved_rps": sum(counts.values()) / elapsed, "errors": errors, "rss_after_warmup_mib": base / 2**20, "rss_end_mib": end / 2**20,
            "rss_growth": end / base - 1.0, "rss_max_mib": max(r for _, r in samples) / 2**20}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="30 s instead of 5 minutes")
    ap.add_argument("--seconds", type=positive_float, default=None,
                    help="length of the run, its first fifth (at most 30 s) the warm-up (default 300, quick 30)")
    ap.add_argument("--rate", type=positive_float, default=200.0, help="requests per second (default 200)")
    ap.add_argument("--rows", type=positive_int, default=200_000, help="table rows (default 200k)")
    args = ap.parse_args(argv)
    seconds = args.seconds or (30.0 if args.quick else 300.0)
    warmup = min(30.0, seconds / 5)
    dim = 32
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        _make_ssd_store(store, args.rows, dim)
        with Server("embstore", str(store)) as srv:
            out = asyncio.run(drive(srv.url, args.rows, dim, seconds, args.rate, warmup, srv.proc.pid))
    total = sum(out["requests"].values())
    print(f"soak {seconds:g} s at {args.rate:g} req/s (achieved {out['achieved_rps']:.0f}): {total} requests "
          f"{out['requests']}, "
          f"errors {out['errors'] or 0}")
    print(f"server RSS {out['rss_after_warmup_mib']:.1f} MiB after warm-up -> {out['rss_end_mib']:.1f} MiB at the "
          f"end ({out['rss_growth'] * 100:+.2f}%, goal < 5%); max {out['rss_max_mib']:.1f} MiB")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
