"""Cost of a flush of an ssd home: delta records against rewriting the whole index file.

    python tools/bench/bench_flush.py                      # log layout, 10M-row home, 1,000 rows per flush
    python tools/bench/bench_flush.py --quick              # 1M rows
    python tools/bench/bench_flush.py --layout in_place    # the in-place home's presence bitmap

One home (64-byte rows) takes turns of "write ``--rows-per-flush`` random
rows, flush": one commit as it does by default (a delta record: the moved
rows' slots in ``slots.delta`` for the log layout, the changed bitmap bytes in
``present.delta`` for the in-place one), the next with the whole index file
forced (what every flush did before: 4 bytes per row for the log's slot map,
one bit per row for the in-place bitmap). Figure: milliseconds per
write+flush of each kind, best of ``--repeats``, and the ratio; and the flush
alone (slab fdatasync + commit), where the two kinds differ.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import positive_int  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a 1M-row home instead of 10M")
    ap.add_argument("--layout", choices=["log", "in_place"], default="log",
                    help="the home's layout: 'log' (slot map) or 'in_place' (presence bitmap)")
    ap.add_argument("--rows", type=positive_int, default=None, help="rows of the home (default 10M, quick 1M)")
    ap.add_argument("--rows-per-flush", type=positive_int, default=1_000,
                    help="random rows written before each flush (default 1000)")
    ap.add_argument("--repeats", type=positive_int, default=10,
                    help="timed write+flush turns of each kind; the best counts (default 10)")
    args = ap.parse_args(argv)
    from embstore.tiers.ssd import SSDTier
    from embstore.tiers.ssd_log import LogSSDTier

    rows = args.rows or (1_000_000 if args.quick else 10_000_000)
    rng = np.random.default_rng(0)
    whole = "whole map" if args.layout == "log" else "whole bitmap"
    best = {"delta": float("inf"), whole: float("inf")}
    best_flush = dict(best)
    with tempfile.TemporaryDirectory(dir=os.environ.get("EMBSTORE_BENCH_DIR")) as tmp:
        tier = (LogSSDTier if args.layout == "log" else SSDTier)(f"{tmp}/home", rows, 64)
        payload = np.ones((args.rows_per_flush, 64), np.uint8)
        for r in range(2 * args.repeats + 2):
            kind = ("delta", whole)[r % 2]
            ids = np.unique(rng.integers(0, rows, args.rows_per_flush))
            t0 = time.perf_counter()
            tier.put(ids, payload[:len(ids)])
            if kind == whole:
                tier._base_crc = None  # forces the rewrite, as every commit did before
            t1 = time.perf_counter()
            tier.flush()
            t2 = time.perf_counter()
            if r >= 2:  # the first two pay for creating the files
                best[kind] = min(best[kind], t2 - t0)
                best_flush[kind] = min(best_flush[kind], t2 - t1)
        index_bytes = tier._slot_of.nbytes if args.layout == "log" else tier._bits.nbytes
        tier.close()
    ratio = best[whole] / best["delta"]
    index = "slot map" if args.layout == "log" else "presence bitmap"
    print(f"{args.layout} home of {rows:,} rows ({index} {index_bytes / 2**20:.2f} MiB), "
          f"{args.rows_per_flush:,} rows per flush")
    for kind, t in best.items():
        print(f"  {kind:12s} {t * 1e3:8.2f} ms per write + flush  (flush alone {best_flush[kind] * 1e3:6.2f} ms)")
    flush_ratio = best_flush[whole] / best_flush["delta"]
    print(f"  delta records are {ratio:.1f}x faster (the flush alone {flush_ratio:.1f}x)")
    return {"layout": args.layout, "rows": rows, "rows_per_flush": args.rows_per_flush, "delta_s": best["delta"],
            "whole_s": best[whole], "speedup": ratio, "flush_speedup": flush_ratio}


if __name__ == "__main__":
    main(sys.argv[1:])
