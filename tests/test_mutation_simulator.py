"""``replay``'s Belady column against ``belady_hits`` itself (session 10 mutation audit: computing a lower
level's optimum over that level's own input, the misses of the level above, instead of over the level-0
sequence its documentation names, passed every existing test, which check one level or level 0 only)."""

from __future__ import annotations

import numpy as np

from embstore.belady import belady_hits, dedup_batches
from embstore.simulator import replay_keys


def test_every_level_reports_min_over_the_level_zero_sequence() -> None:
    rng = np.random.default_rng(4)
    keys = (rng.zipf(1.2, size=6000) % 400).astype(np.int64)
    offsets = np.arange(0, 6001, 50, dtype=np.int64)
    res = replay_keys(keys, offsets, [("lru", 8), ("lfu", 40), ("clock", 120)])
    deduped, _ = dedup_batches(keys, offsets)
    assert res.accesses == len(deduped)
    for level in res.levels:
        want = belady_hits(deduped, level.capacity_rows)
        assert level.belady_hits == want, level
        assert level.belady_hit_ratio == want / len(deduped)
