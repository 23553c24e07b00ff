"""Online cache policies against Belady's MIN on dlrm2021-like traces.

    python -m tools.bench.bench_policies [--quick]

For one cache over all tables (rows are (table, id) pairs, per-batch
deduplicated accesses), at 1%, 5% and 10% of the unique rows, prints each
policy's hit ratio and its share of MIN's hit ratio (the baseline, measured in
the same run). Goal: the best policy >= 95% of MIN.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from embstore import tracegen
from embstore.belady import belady_hits, dedup_batches
from embstore.simulator import miss_ratio_curve
from embstore.traces import dense_keys

POLICIES = ("lru", "lfu", "clock", "lru+tinylfu", "lfu+tinylfu", "clock+tinylfu")
FRACTIONS = (0.01, 0.05, 0.10)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small trace")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    size = dict(batches=20, batch_size=2048, tables=4, ids=200_000) if args.quick else \
        dict(batches=100, batch_size=8192, tables=8, ids=2_000_000)
    tr = tracegen.generate("dlrm2021", seed=0, **size)
    keys, off = dedup_batches(dense_keys(tr)[0], tr.batch_offsets)
    uniq = int(np.unique(keys).size)
    caps = np.array([max(1, int(f * uniq)) for f in FRACTIONS], np.int64)
    out: dict = {"accesses": int(keys.size), "unique_rows": uniq, "fractions": list(FRACTIONS),
                 "capacities": caps.tolist(), "belady_hit_ratio": [], "policies": {}}
    n = keys.size
    mins = np.array([belady_hits(keys, int(c)) for c in caps])
    out["belady_hit_ratio"] = (mins / n).tolist()
    print(f"{n:,} deduplicated accesses, {uniq:,} unique rows; hit ratio (share of MIN)")
    print(f"{'policy':<12}" + "".join(f"{f'{100 * f:.0f}% ({c:,})':>22}" for f, c in zip(FRACTIONS, caps)))
    print(f"{'belady':<12}" + "".join(f"{100 * m / n:21.2f}%" for m in mins))
    for pol in POLICIES:
        hits = miss_ratio_curve(keys, off, caps, pol, dedup=False)
        share = np.where(mins > 0, hits / np.maximum(mins, 1), 1.0)
        out["policies"][pol] = {"hit_ratio": (hits / n).tolist(), "share_of_belady": share.tolist()}
        print(f"{pol:<12}" + "".join(f"{100 * h / n:12.2f}% ({100 * s:5.1f}%)" for h, s in zip(hits, share)))
    best = [max(out["policies"][p]["share_of_belady"][i] for p in POLICIES) for i in range(len(caps))]
    out["best_share_of_belady"] = best
    print("best share of MIN: " + ", ".join(f"{100 * b:.1f}%" for b in best) + "  (goal >= 95%)")
    if args.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
