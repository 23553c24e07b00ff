"""Shared pieces of the benchmark scripts: skewed ids, best-of-N timing, filling tables."""

from __future__ import annotations

import argparse
import time
from typing import Callable

import numpy as np

from embstore.commands.argtypes import nonneg_int, nonneg_seconds, positive_int  # noqa: F401 - for the scripts


def positive_float(text: str) -> float:
    """argparse ``type=`` for a rate or duration that a script divides by: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def add_shape_args(ap: argparse.ArgumentParser, bag_word: str) -> None:
    """The table and batch shape options that bench_dram and bench_train_step share (1M x 64, 4096 x 20)."""
    ap.add_argument("--quick", action="store_true", help="100k rows per table instead of 1M")
    ap.add_argument("--tables", type=positive_int, default=8)
    ap.add_argument("--rows", type=positive_int, default=None, help="rows per table (default 1M, quick 100k)")
    ap.add_argument("--dim", type=positive_int, default=64)
    ap.add_argument("--batch", type=positive_int, default=4096, help=f"bags per {bag_word}")
    ap.add_argument("--pooling", type=positive_int, default=20, help="ids per bag")


def zipf_ids(rng: np.random.Generator, n: int, rows: int, alpha: float) -> np.ndarray:
    """Zipf(alpha) ranks over ``rows`` ids, popularity scattered by a fixed permutation."""
    ranks = np.arange(1, rows + 1, dtype=np.float64)
    cdf = np.cumsum(ranks ** -alpha)
    cdf /= cdf[-1]
    perm = np.random.default_rng(7).permutation(rows)
    return perm[np.minimum(np.searchsorted(cdf, rng.random(n)), rows - 1)].astype(np.int64)


def best_rates(fns: dict[str, Callable[[], object]], items: int, repeats: int) -> dict[str, float]:
    """Items per second of each function's fastest of ``repeats`` runs (after one warm-up each).

    The functions take turns, in an order that rotates every repeat, so a slow
    spell of this noisy machine lands on all of them rather than on whichever
    happened to run its repeats then.
    """
    names = list(fns)
    for name in names:
        fns[name]()
    best = dict.fromkeys(names, float("inf"))
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            fns[name]()
            best[name] = min(best[name], time.perf_counter() - t0)
    return {name: items / t for name, t in best.items()}


def import_rows(tables, seed: int = 1, chunk: int = 1 << 20) -> None:
    """Write every physical row of ``tables`` (small random values, zero optimizer state), as after
    ``embstore import``: a later cache miss then reads a real row from the home instead of an
    initial value that costs no I/O."""
    rng = np.random.default_rng(seed)
    for table in tables:
        n, dim, sdim = table.num_rows, table.format.dim, table.format.state_dim
        for lo in range(0, n, chunk):
            ids = np.arange(lo, min(n, lo + chunk), dtype=np.int64)
            table.write_with_state(ids, rng.standard_normal((len(ids), dim), dtype=np.float32) * 0.01,
                                   np.zeros((len(ids), sdim), np.float32))
