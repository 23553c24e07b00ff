"""Mapping throughput of ModHash, QRHash and LearnedHash on one core.

Run::

    python tools/bench/bench_hashing.py            # 10M ids
    python tools/bench/bench_hashing.py --quick    # 1M ids

Baseline, measured in the same run on the same arrays: numpy's ``ids % buckets``
(the cheapest possible mapping; no mixing, no bounds, one pass). Each mapper and
the baseline are timed in alternating order over several rounds and the best
round counts (the CPU is shared and noisy). ``ratio`` = baseline time / mapper
time, so above 1 means faster than ``ids % buckets``. Goals: mod and QR >= 100 M
ids/s, learned >= 20 M ids/s.

Inputs: mod and QR map uniform random int64 ids (the whole range, negatives
included). The learned hash is fitted from access counts (Zipf, exponent 1.0)
of a universe of known ids (1M, quick 100k) onto a table of a tenth as many
rows; it is then queried with (a) ids drawn from the same Zipf over the known
ids plus 20% extra never-seen ids, and (b) known ids drawn uniformly (every
lookup a likely cache miss in its id table, the worst case).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable

import numba
import numpy as np

from embstore.hashing import LearnedHash, ModHash, QRHash

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import positive_int  # noqa: E402


def _best_pair(fn: Callable[[], object], base: Callable[[], object], rounds: int) -> tuple[float, float]:
    """Best-of-rounds seconds of fn and base, alternating which goes first."""
    fn(), base()  # warm: JIT, page faults
    best_fn = best_base = float("inf")
    for i in range(rounds):
        for which in ((0, 1) if i % 2 else (1, 0)):
            start = time.perf_counter()
            (fn if which == 0 else base)()
            elapsed = time.perf_counter() - start
            if which == 0:
                best_fn = min(best_fn, elapsed)
            else:
                best_base = min(best_base, elapsed)
    return best_fn, best_base


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1M ids, 100k known ids, fewer rounds")
    ap.add_argument("--ids", type=positive_int, default=None, help="ids per mapping call (default 10M, quick 1M)")
    ap.add_argument("--known", type=positive_int, default=None,
                    help="known ids of the learned hash (default 1M, quick 100k)")
    ap.add_argument("--buckets", type=positive_int, default=1_000_003, help="rows of the mod and QR tables")
    ap.add_argument("--rounds", type=positive_int, default=None, help="timed rounds (default 7, quick 3)")
    args = ap.parse_args(argv)
    if args.buckets < 5:
        ap.error(f"--buckets must be >= 5 (the QR table takes 4 collisions), got {args.buckets}")
    n = args.ids or (1_000_000 if args.quick else 10_000_000)
    known = args.known or (100_000 if args.quick else 1_000_000)
    rounds = args.rounds or (3 if args.quick else 7)
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        return _measure(n, known, rounds, args.buckets)
    finally:
        numba.set_num_threads(threads)  # `embstore bench` runs the next benchmarks in this process


def _measure(n: int, known: int, rounds: int, buckets: int) -> dict:
    """The figures (on one numba thread): ``n`` ids per call, ``known`` ids for the learned hash."""
    rng = np.random.default_rng(0)
    ids = rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64, endpoint=True)
    base = lambda: ids % buckets  # noqa: E731 - the baseline, on the same array

    results: dict = {"ids": n, "buckets": buckets, "known_ids": known}

    def report(name: str, fn: Callable[[], object], baseline: Callable[[], object], goal: float) -> None:
        t, tb = _best_pair(fn, baseline, rounds)
        results[name] = {"mids_per_s": n / t / 1e6, "baseline_mids_per_s": n / tb / 1e6, "ratio": tb / t,
                         "goal_mids_per_s": goal}
        r = results[name]
        print(f"{name:<22} {r['mids_per_s']:8.1f} M ids/s   numpy ids % buckets {r['baseline_mids_per_s']:7.1f} "
              f"M ids/s   ratio {r['ratio']:5.2f}   goal {goal:.0f} M ids/s "
              f"{'ok' if r['mids_per_s'] >= goal else 'MISSED'}", flush=True)

    mod = ModHash(buckets, seed=1)
    qr = QRHash(buckets, collisions=4)
    report("mod", lambda: mod(ids), base, 100)
    report("qr", lambda: qr(ids), base, 100)

    universe = rng.choice(2**62, known + known // 5, replace=False).astype(np.int64) - 2**61
    weights = 1.0 / np.arange(1, known + 1)
    counts = np.maximum(1, np.round(weights / weights.sum() * 50 * known)).astype(np.int64)
    t0 = time.perf_counter()
    learned = LearnedHash.fit((universe[:known], counts), max(known // 10, 2))
    results["learned_fit_s"] = time.perf_counter() - t0
    results["learned_mapping_bytes"] = learned.mapping_bytes
    print(f"learned hash fitted on {known} known ids in {results['learned_fit_s']:.1f}s; "
          f"mapping {learned.mapping_bytes / 2**20:.1f} MiB", flush=True)
    unseen = known // 5  # none for fewer than 5 known ids: the known ones then take every query
    p = np.concatenate([weights / weights.sum() * (0.8 if unseen else 1.0), np.full(unseen, 0.2 / max(unseen, 1))])
    zipf_q = universe[rng.choice(universe.size, n, p=p)]
    uniform_q = universe[rng.integers(0, known, n)]
    del ids  # each baseline below runs on the same array as its mapper
    report("learned (zipf+unseen)", lambda: learned(zipf_q), lambda: zipf_q % buckets, 20)
    report("learned (uniform)", lambda: learned(uniform_q), lambda: uniform_q % buckets, 20)
    return results


if __name__ == "__main__":
    main()
