"""Key densifying (the numbering every simulator and Belady's MIN index by) on inputs large enough to
make its hash table grow (session 10 mutation audit: a rehash that put keys in the wrong slots once the
table grew passed every existing test)."""

from __future__ import annotations

import numpy as np

from embstore.belady import densify


def test_densify_numbers_many_scattered_keys_by_first_appearance() -> None:
    """Over 32,768 distinct keys far apart: the hash table doubles (twice), and every key keeps one number."""
    rng = np.random.default_rng(1)
    distinct = rng.choice(2**62, size=150_000, replace=False).astype(np.int64) - 2**61
    keys = distinct[rng.integers(0, len(distinct), size=400_000)]
    dense, k = densify(keys, compact=True)
    uniq, first, inv = np.unique(keys, return_index=True, return_inverse=True)
    rank = np.empty(len(uniq), np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(uniq))
    assert k == len(uniq)
    assert np.array_equal(dense, rank[inv.reshape(-1)])
