"""TinyLFU's count-min sketch counter by counter against the reference sketch of ``test_policies`` (session 10
mutation audit: a sketch that raised every counter of a key, not only those at its minimum, changed
no hit sequence the existing tests replay; the estimates it feeds admission were still wrong)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from embstore.policies import CacheDirectory
from test_policies import RefSketch


@settings(max_examples=25, deadline=None)
@given(capacity=st.sampled_from([1, 2, 5]),
       keys=st.lists(st.integers(0, 60), min_size=1, max_size=1200),
       policy=st.sampled_from(["lru+tinylfu", "lfu+tinylfu", "clock+tinylfu"]))
def test_sketch_counters_match_the_conservative_reference(capacity: int, keys: list[int], policy: str) -> None:
    """Narrow sketches (8 counters a row per slot) over many keys collide often, which is where
    conservative update (and aging) show: every counter must equal the reference's after each access."""
    d = CacheDirectory(capacity, policy)
    ref = RefSketch(capacity)
    for k in keys:
        d.access(np.array([k], np.int64))
        ref.add(k)
        assert d._sk.tolist() == ref.rows
