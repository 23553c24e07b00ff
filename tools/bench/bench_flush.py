"""Cost of a flush of a log-layout ssd home: delta records against rewriting the whole slot map.

    python tools/bench/bench_flush.py            # 10M-row home, 1,000 rows written per flush
    python tools/bench/bench_flush.py --quick    # 1M rows

One ``LogSSDTier`` (64-byte rows) takes turns of "write ``--rows-per-flush``
random rows, flush": one commit as it does by default (a delta record of the
moved rows' slots), the next with the whole map forced (what every flush did
before session 7: 4 bytes per row of the table). Figure: milliseconds per
write+flush of each kind, best of ``--repeats``, and the ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", type=int, default=None, help="rows of the home (default 10M, quick 1M)")
    ap.add_argument("--rows-per-flush", type=int, default=1_000)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)
    from embstore.tiers.ssd_log import LogSSDTier

    rows = args.rows or (1_000_000 if args.quick else 10_000_000)
    rng = np.random.default_rng(0)
    best = {"delta": float("inf"), "whole map": float("inf")}
    with tempfile.TemporaryDirectory(dir=os.environ.get("EMBSTORE_BENCH_DIR")) as tmp:
        tier = LogSSDTier(f"{tmp}/home", rows, 64)
        payload = np.ones((args.rows_per_flush, 64), np.uint8)
        for r in range(2 * args.repeats + 2):
            kind = ("delta", "whole map")[r % 2]
            ids = np.unique(rng.integers(0, rows, args.rows_per_flush))
            t0 = time.perf_counter()
            tier.put(ids, payload[:len(ids)])
            if kind == "whole map":
                tier._base_crc = None  # forces the rewrite, as every commit did before
            tier.flush()
            if r >= 2:  # the first two pay for creating the files
                best[kind] = min(best[kind], time.perf_counter() - t0)
        map_bytes = tier._slot_of.nbytes
        tier.close()
    ratio = best["whole map"] / best["delta"]
    print(f"log home of {rows:,} rows (slot map {map_bytes / 2**20:.0f} MiB), {args.rows_per_flush:,} rows per flush")
    for kind, t in best.items():
        print(f"  {kind:9s} {t * 1e3:8.2f} ms per write + flush")
    print(f"  delta records are {ratio:.1f}x faster")
    return {"rows": rows, "rows_per_flush": args.rows_per_flush, "delta_s": best["delta"],
            "whole_map_s": best["whole map"], "speedup": ratio}


if __name__ == "__main__":
    main(sys.argv[1:])
