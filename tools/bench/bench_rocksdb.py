"""RocksDBTier.get against raw rocksdict multi-get on the same database.

Run::

    python tools/bench/bench_rocksdb.py            # 1M rows of 256 bytes
    python tools/bench/bench_rocksdb.py --quick    # 200k rows

Fills a fresh RocksDB tier with random rows, then for each round draws 4096
random unique ids and times (a) ``RocksDBTier.get(ids)`` (key packing, multi-get,
found mask, row assembly) and (b) ``Rdict.get(keys)`` on the tier's own handle
with keys packed beforehand (the floor any wrapper can reach). The two are
interleaved, alternating which goes first, so the noisy shared CPU and the
block cache affect both alike. ``ratio`` = raw time / tier time; the goal is >= 0.9.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from embstore.tiers.rocksdb import RocksDBTier, pack_keys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import positive_int  # noqa: E402


def _fill(tier: RocksDBTier, num_rows: int, row_bytes: int, rng: np.random.Generator) -> float:
    start = time.perf_counter()
    chunk = 65536
    for lo in range(0, num_rows, chunk):
        ids = np.arange(lo, min(lo + chunk, num_rows), dtype=np.int64)
        tier.put(ids, rng.integers(0, 256, size=(len(ids), row_bytes), dtype=np.uint8))
    tier.flush()
    tier.raw.flush(True)  # memtable -> SST, so reads measure the table files, not the memtable
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="200k rows and fewer rounds")
    ap.add_argument("--rows", type=positive_int, default=None, help="rows in the database (default 1M, quick 200k)")
    ap.add_argument("--row-bytes", type=positive_int, default=256)
    ap.add_argument("--batch", type=positive_int, default=4096, help="unique ids per get (at most --rows)")
    ap.add_argument("--rounds", type=positive_int, default=None, help="timed batches (default 200, quick 60)")
    ap.add_argument("--dir", type=Path, default=None, help="where to build the database (default a temp dir)")
    args = ap.parse_args(argv)
    num_rows = args.rows or (200_000 if args.quick else 1_000_000)
    if args.batch > num_rows:
        ap.error(f"--batch ({args.batch}) must not exceed the rows ({num_rows}): a batch holds unique ids")
    rounds = args.rounds or (60 if args.quick else 200)

    rng = np.random.default_rng(0)
    workdir = Path(tempfile.mkdtemp(prefix="bench_rocksdb_", dir=args.dir))
    try:
        tier = RocksDBTier(workdir / "db", args.row_bytes)
        fill_s = _fill(tier, num_rows, args.row_bytes, rng)
        db = tier.raw
        batches = [rng.choice(num_rows, size=args.batch, replace=False).astype(np.int64)
                   for _ in range(rounds + 5)]
        for ids in batches[:5]:  # warm both paths
            tier.get(ids)
            db.get(pack_keys(ids))
        t_tier = t_raw = 0.0
        for i, ids in enumerate(batches[5:]):
            keys = pack_keys(ids)  # raw gets its keys for free
            for which in ((0, 1) if i % 2 else (1, 0)):
                start = time.perf_counter()
                if which == 0:
                    rows, found = tier.get(ids)
                else:
                    values = db.get(keys)
                elapsed = time.perf_counter() - start
                if which == 0:
                    t_tier += elapsed
                else:
                    t_raw += elapsed
            if not found.all() or len(values) != len(ids):
                raise RuntimeError("benchmark rows went missing")
        tier.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    per = 1e3 / rounds
    result = {
        "rows": num_rows,
        "row_bytes": args.row_bytes,
        "batch": args.batch,
        "rounds": rounds,
        "fill_s": round(fill_s, 3),
        "tier_ms_per_batch": round(t_tier * per, 4),
        "raw_ms_per_batch": round(t_raw * per, 4),
        "tier_rows_per_s": round(rounds * args.batch / t_tier),
        "raw_rows_per_s": round(rounds * args.batch / t_raw),
        "ratio": round(t_raw / t_tier, 4),
    }
    print(f"rocksdb get, {num_rows:,} rows x {args.row_bytes} B, batches of {args.batch} unique ids, "
          f"{rounds} rounds (fill {fill_s:.1f} s)")
    print(f"  RocksDBTier.get      {result['tier_ms_per_batch']:8.3f} ms/batch  "
          f"{result['tier_rows_per_s']:>12,} rows/s")
    print(f"  raw Rdict multi-get  {result['raw_ms_per_batch']:8.3f} ms/batch  "
          f"{result['raw_rows_per_s']:>12,} rows/s")
    print(f"  ratio (raw time / tier time) {result['ratio']:.3f}   goal >= 0.9")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
