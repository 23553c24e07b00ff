"""Trace-simulator throughput on one core: ``policies.simulate`` for LRU and LFU.

    python tools/bench/bench_sim.py            # dlrm2021-like trace: 40 batches x 16384 samples x 8 tables
    python tools/bench/bench_sim.py --quick    # 8 batches x 4096 samples x 8 tables

The trace is generated (``embstore.tracegen``), keyed by (table, id) and
deduplicated per batch, exactly as ``replay`` feeds it; the cache holds 20% of
its distinct rows (``--capacity`` to change). The process is pinned to one CPU.

Figures (each a ratio measured in this run; absolute rates are printed for
this run only):
- ``lru_vs_python``: ``simulate(.., "lru")`` accesses/s over an OrderedDict LRU
  in Python on a prefix of the same accesses (the ten-line reference cache).
- ``lfu_vs_python``: ``simulate(.., "lfu")`` over an O(1) LFU in Python
  (frequency buckets of recency lists; the same victim rule).
- ``stackdist_vs_lru``: one stack-distance pass (LRU hits at *every* capacity)
  over one LRU simulation (one capacity).
- ``belady_vs_lru``: one Belady MIN pass over one LRU simulation.
Hit counts are cross-checked: simulated LRU against the stack-distance curve,
simulated LFU against the Python LFU on the prefix.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable

import numpy as np

from embstore.belady import belady_hits, dedup_batches
from embstore.policies import simulate
from embstore.stackdist import lru_mrc, stack_distances
from embstore.traces import dense_keys
from embstore.tracegen import generate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import positive_float, positive_int  # noqa: E402


def python_lru(keys: list[int], capacity: int) -> int:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for k in keys:
        if k in cache:
            hits += 1
            cache.move_to_end(k)
        else:
            cache[k] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits


def python_lfu(keys: list[int], capacity: int) -> int:
    """O(1) LFU: evict the least recently used row among the least frequently used."""
    freq: dict[int, int] = {}
    buckets: defaultdict[int, OrderedDict[int, None]] = defaultdict(OrderedDict)
    low = 0
    hits = 0
    for k in keys:
        f = freq.get(k)
        if f is not None:
            hits += 1
            del buckets[f][k]
            if not buckets[f]:
                del buckets[f]
                if low == f:
                    low = f + 1
            freq[k] = f + 1
            buckets[f + 1][k] = None
            continue
        if len(freq) >= capacity:
            victim, _ = buckets[low].popitem(last=False)
            if not buckets[low]:
                del buckets[low]
            del freq[victim]
        freq[k] = 1
        buckets[1][k] = None
        low = 1
    return hits


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` runs, after one warm-up (numba compiles)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 batches of 4096 samples instead of 40 of 16384")
    ap.add_argument("--batches", type=positive_int, default=None, help="trace batches (default 40, quick 8)")
    ap.add_argument("--batch-size", type=positive_int, default=None,
                    help="samples per batch (default 16384, quick 4096)")
    ap.add_argument("--tables", type=positive_int, default=8)
    ap.add_argument("--capacity", type=positive_float, default=0.2, help="cache rows: a count, or a fraction of "
                                                                         "the distinct rows when < 1 (default 0.2)")
    ap.add_argument("--python-prefix", type=positive_int, default=200_000,
                    help="accesses the Python caches replay")
    ap.add_argument("--repeats", type=positive_int, default=3, help="timed runs of each; the fastest counts")
    args = ap.parse_args(argv)
    batches = args.batches or (8 if args.quick else 40)
    batch_size = args.batch_size or (4096 if args.quick else 16384)

    trace = generate("dlrm2021", batches=batches, batch_size=batch_size, tables=args.tables, seed=0)
    keys, num_rows = dense_keys(trace)
    keys, offsets = dedup_batches(keys, trace.batch_offsets)
    n = int(keys.size)
    cap = int(args.capacity * num_rows) if args.capacity < 1 else int(args.capacity)
    cap = max(cap, 1)
    prefix = keys[: min(n, args.python_prefix)].tolist()

    pinned = None
    if hasattr(os, "sched_setaffinity"):
        pinned = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {min(pinned)})
    try:
        t_lru = best_time(lambda: simulate(keys, offsets, cap, "lru"), args.repeats)
        t_lfu = best_time(lambda: simulate(keys, offsets, cap, "lfu"), args.repeats)
        t_sd = best_time(lambda: stack_distances(keys), args.repeats)
        t_min = best_time(lambda: belady_hits(keys, cap), args.repeats)
        t_py_lru = best_time(lambda: python_lru(prefix, cap), 1)
        t_py_lfu = best_time(lambda: python_lfu(prefix, cap), 1)
    finally:
        if pinned is not None:
            os.sched_setaffinity(0, pinned)

    lru_hits = int(simulate(keys, offsets, cap, "lru").sum())
    lfu_hits = int(simulate(keys, offsets, cap, "lfu").sum())
    lfu_prefix = int(simulate(np.array(prefix, dtype=np.int64), np.array([0, len(prefix)]), cap, "lfu").sum())
    rate = {
        "lru": n / t_lru, "lfu": n / t_lfu, "stackdist": n / t_sd, "belady": n / t_min,
        "python_lru": len(prefix) / t_py_lru, "python_lfu": len(prefix) / t_py_lfu,
    }
    results = {
        "accesses": n,
        "distinct_rows": num_rows,
        "capacity_rows": cap,
        "accesses_per_s": rate,
        "lru_vs_python": rate["lru"] / rate["python_lru"],
        "lfu_vs_python": rate["lfu"] / rate["python_lfu"],
        "stackdist_vs_lru": rate["stackdist"] / rate["lru"],
        "belady_vs_lru": rate["belady"] / rate["lru"],
        "hit_ratio": {"lru": lru_hits / n, "lfu": lfu_hits / n, "belady": belady_hits(keys, cap) / n},
        "lru_matches_stackdist": lru_hits == int(lru_mrc(keys, [cap])[0]),
        "lfu_matches_python": lfu_prefix == python_lfu(prefix, cap),
    }
    print(f"trace: {n:,} deduplicated accesses over {num_rows:,} rows; cache {cap:,} rows; one core")
    for name in ("lru", "lfu", "stackdist", "belady", "python_lru", "python_lfu"):
        print(f"  {name:<11} {rate[name] / 1e6:8.2f} M accesses/s")
    print(f"simulate lru vs Python OrderedDict LRU : {results['lru_vs_python']:6.1f}x")
    print(f"simulate lfu vs Python O(1) LFU        : {results['lfu_vs_python']:6.1f}x")
    print(f"stack distances (all capacities) vs lru: {results['stackdist_vs_lru']:6.2f}x")
    print(f"Belady MIN vs lru                      : {results['belady_vs_lru']:6.2f}x")
    hr = results["hit_ratio"]
    print(f"hit ratios: lru {hr['lru']:.3f}  lfu {hr['lfu']:.3f}  belady {hr['belady']:.3f}; "
          f"lru == stack-distance curve: {results['lru_matches_stackdist']}; "
          f"lfu == Python LFU: {results['lfu_matches_python']}")
    return results


if __name__ == "__main__":
    main()
