"""DRAM-resident lookups against torch and numpy on the same rows, in the same run.

    python tools/bench/bench_dram.py            # 8 tables x 1M rows x dim 64, batch 4096, pooling 20
    python tools/bench/bench_dram.py --quick    # 8 tables x 100k rows

Figures (each a ratio measured in this run; the two sides of a ratio take turns,
``--repeats`` timed runs each, and the best of each counts):
- pooled: ``Table.lookup_pooled`` vs ``torch.nn.functional.embedding_bag`` (sum) on
  the same float32 rows, ids and offsets; uniform and Zipf(1.05) ids. Goal >= 1.0x.
- raw: ``Table.lookup`` vs numpy fancy indexing ``weights[ids]``. Goal >= 0.8x.
- update: ``Table.update`` of a batch's distinct rows vs numpy's ``weights[ids] = rows``
  (no goal; reported).
"""

from __future__ import annotations

import os
import argparse
import sys
import tempfile

import numpy as np
import torch

import embstore
from embstore.config import StoreConfig, TableConfig, TierConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import add_shape_args, best_rates, positive_int, zipf_ids  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(ap, "lookup")
    ap.add_argument("--repeats", type=positive_int, default=10,
                    help="timed runs of each side, taking turns; the best of each counts (default 10)")
    args = ap.parse_args(argv)
    rows = args.rows or (100_000 if args.quick else 1_000_000)
    nbytes = rows * args.dim * 4
    rng = np.random.default_rng(0)
    results: dict = {"rows": rows, "tables": args.tables, "torch_threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as tmp:
        tcfgs = tuple(TableConfig(f"t{i}", rows, args.dim, tiers=(TierConfig("dram", nbytes), TierConfig("mmap")))
                      for i in range(args.tables))
        store = embstore.create(f"{tmp}/store", StoreConfig(tcfgs))
        weights = []
        for i in range(args.tables):
            w = rng.standard_normal((rows, args.dim), dtype=np.float32)
            store[f"t{i}"].write_physical(np.arange(rows, dtype=np.int64), w)
            weights.append(w)
        store.flush()
        n = args.batch * args.pooling
        offsets = np.arange(0, n + 1, args.pooling, dtype=np.int64)
        for dist in ("uniform", "zipf"):
            ids = [rng.integers(0, rows, n) if dist == "uniform" else zipf_ids(rng, n, rows, 1.05)
                   for _ in range(args.tables)]
            tw = [torch.from_numpy(w).clone() for w in weights]  # torch's own (64-byte aligned) allocation
            tids = [torch.from_numpy(x) for x in ids]
            toffs = torch.from_numpy(offsets[:-1])
            tables = [store[f"t{i}"] for i in range(args.tables)]

            def ours_pooled():
                for t, x in zip(tables, ids):
                    t.lookup_pooled(x, offsets)

            def torch_pooled():
                for w, x in zip(tw, tids):
                    torch.nn.functional.embedding_bag(x, w, toffs, mode="sum")

            def ours_raw():
                for t, x in zip(tables, ids):
                    t.lookup(x)

            def numpy_raw():
                for w, x in zip(weights, ids):
                    w[x]

            # correctness guard: same numbers as torch
            got = tables[0].lookup_pooled(ids[0], offsets)
            want = torch.nn.functional.embedding_bag(tids[0], tw[0], toffs, mode="sum").numpy()
            assert np.allclose(got, want, rtol=1e-4, atol=1e-4)
            items = n * args.tables
            pooled = best_rates({"ours": ours_pooled, "torch": torch_pooled}, items, args.repeats)
            raw = best_rates({"ours": ours_raw, "numpy": numpy_raw}, items, args.repeats)
            r = {"pooled_rows_per_s": pooled["ours"], "torch_pooled_rows_per_s": pooled["torch"],
                 "raw_rows_per_s": raw["ours"], "numpy_raw_rows_per_s": raw["numpy"]}
            r["pooled_ratio"] = r["pooled_rows_per_s"] / r["torch_pooled_rows_per_s"]
            r["raw_ratio"] = r["raw_rows_per_s"] / r["numpy_raw_rows_per_s"]
            results[dist] = r
            print(f"[{dist:7s}] pooled: embstore {r['pooled_rows_per_s'] / 1e6:6.1f} M rows/s, torch "
                  f"{r['torch_pooled_rows_per_s'] / 1e6:6.1f} M rows/s, ratio {r['pooled_ratio']:.2f}x (goal >= 1.0)")
            print(f"[{dist:7s}] raw:    embstore {r['raw_rows_per_s'] / 1e6:6.1f} M rows/s, numpy  "
                  f"{r['numpy_raw_rows_per_s'] / 1e6:6.1f} M rows/s, ratio {r['raw_ratio']:.2f}x (goal >= 0.8)")
        # writes: Table.update of a batch's distinct rows vs numpy's fancy assignment into the same array
        ids = [np.unique(rng.integers(0, rows, n)) for _ in range(args.tables)]
        vals = [rng.standard_normal((len(x), args.dim), dtype=np.float32) for x in ids]

        def ours_update():
            for i, (x, v) in enumerate(zip(ids, vals)):
                tables[i].update(x, v)

        def numpy_update():
            for w, x, v in zip(weights, ids, vals):
                w[x] = v

        items = sum(len(x) for x in ids)
        upd = best_rates({"ours": ours_update, "numpy": numpy_update}, items, args.repeats)
        assert np.array_equal(tables[0].lookup(ids[0]), vals[0])
        results["update"] = {"rows_per_s": upd["ours"], "numpy_rows_per_s": upd["numpy"],
                             "ratio": upd["ours"] / upd["numpy"]}
        print(f"[update ] rows:   embstore {upd['ours'] / 1e6:6.1f} M rows/s, numpy  {upd['numpy'] / 1e6:6.1f} "
              f"M rows/s, ratio {upd['ours'] / upd['numpy']:.2f}x (Table.update of distinct rows; reported)")
        store.close()
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
