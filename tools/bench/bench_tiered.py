"""A table 10x its DRAM budget with Zipf ids: lookups/s and hit ratio per tier, beside all-DRAM.

    python tools/bench/bench_tiered.py            # 2M rows x dim 64 (512 MiB), DRAM cache 10% of rows
    python tools/bench/bench_tiered.py --quick    # 200k rows

Both stores hold the same rows; the baseline keeps every row in a DRAM tier
over the same home, so the ratio shows what the SSD home costs under Zipf(1.05)
traffic. Batches of 4096 bags x 20 ids, pooled (sum).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import numpy as np

import embstore
from embstore.config import StoreConfig, TableConfig, TierConfig

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _common import positive_int, zipf_ids  # noqa: E402


def run(table, batches: list[np.ndarray], offsets: np.ndarray) -> float:
    t0 = time.perf_counter()
    for ids in batches:
        table.lookup_pooled(ids, offsets)
    return sum(len(b) for b in batches) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="200k rows instead of 2M")
    ap.add_argument("--rows", type=positive_int, default=None, help="table rows (default 2M, quick 200k)")
    ap.add_argument("--dim", type=positive_int, default=64)
    ap.add_argument("--batches", type=positive_int, default=30, help="warm-up batches, then as many timed ones")
    ap.add_argument("--policy", default="lru+tinylfu", help="the DRAM cache's policy")
    ap.add_argument("--home", default="ssd", choices=["ssd", "rocksdb", "mmap"], help="the home tier")
    args = ap.parse_args(argv)
    rows = args.rows or (200_000 if args.quick else 2_000_000)
    row_bytes = args.dim * 4
    rng = np.random.default_rng(0)
    n = 4096 * 20
    offsets = np.arange(0, n + 1, 20, dtype=np.int64)
    warm = [zipf_ids(rng, n, rows, 1.05) for _ in range(args.batches)]
    timed = [zipf_ids(rng, n, rows, 1.05) for _ in range(args.batches)]
    out: dict = {"rows": rows, "dram_fraction": 0.1, "policy": args.policy, "home": args.home}
    with tempfile.TemporaryDirectory() as tmp:
        configs = {
            "all_dram": TableConfig("t", rows, args.dim, tiers=(TierConfig("dram", rows * row_bytes),
                                                                 TierConfig(args.home))),
            "tiered": TableConfig("t", rows, args.dim, tiers=(TierConfig("dram", max(1, rows // 10) * row_bytes,
                                                                          args.policy),
                                                               TierConfig(args.home))),
        }
        weights = rng.standard_normal((rows, args.dim), dtype=np.float32)
        for name, cfg in configs.items():
            with embstore.create(f"{tmp}/{name}", StoreConfig((cfg,))) as store:
                t = store["t"]
                for lo in range(0, rows, 1 << 16):
                    ids = np.arange(lo, min(rows, lo + (1 << 16)), dtype=np.int64)
                    t.write_physical(ids, weights[ids])
                store.flush()
            with embstore.open(f"{tmp}/{name}") as store:  # cold caches, home on disk
                t = store["t"]
                if name == "all_dram":  # the baseline holds every row in DRAM
                    for lo in range(0, rows, 1 << 16):
                        t.read_physical(np.arange(lo, min(rows, lo + (1 << 16)), dtype=np.int64))
                run(t, warm, offsets)
                before = t.stats()
                rate = run(t, timed, offsets)
                after = t.stats()
                hit = {k: (after[k]["hits"] - before[k]["hits"]) /
                       max(1, after[k]["hits"] - before[k]["hits"] + after[k]["misses"] - before[k]["misses"])
                       for k in after}
                out[name] = {"ids_per_s": rate, "hit_ratio": hit}
                print(f"{name:9s} {rate / 1e6:6.2f} M ids/s  hit ratio per tier: "
                      + ", ".join(f"{k} {v:.3f}" for k, v in hit.items()))
    out["ratio"] = out["tiered"]["ids_per_s"] / out["all_dram"]["ids_per_s"]
    print(f"tiered (DRAM = 10% of rows) / all-DRAM: {out['ratio']:.2f}x")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
