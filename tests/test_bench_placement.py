"""The DLRM benchmark's tuned placement stays inside its DRAM budget and holds small tables whole."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "bench"))

import bench_dlrm  # noqa: E402


def test_tuned_placement_fits_the_budget_and_holds_small_tables_whole() -> None:
    sizes = [50, 3, 20_000, 400, 60_000, 7]
    budget = sum(sizes) * bench_dlrm.ROW_BYTES // 10
    rows, policies, layouts = bench_dlrm.tuned_dram_rows(sizes, batch=64, budget_bytes=budget, batches=8)
    assert len(rows) == len(policies) == len(sizes) and layouts == [""] * len(sizes)  # the bench's --layout
    assert sum(rows) * bench_dlrm.ROW_BYTES <= budget
    assert all(0 <= r <= n for r, n in zip(rows, sizes))
    assert rows[1] == 3 and rows[5] == 7  # tiny, hot tables are cheapest per hit: whole in DRAM
    assert rows[2] < 20_000 and rows[4] < 60_000  # the big ones are cached, not held
    assert sum(rows) * bench_dlrm.ROW_BYTES > budget // 2  # the budget is actually used


def test_all_in_budget_placement_pays_for_directories_and_indexes() -> None:
    """``--all-in-budget``: cache rows, their directories and dirty bytes and the homes' indexes fit the
    budget together, and the layouts are tune's."""
    from embstore.tiers.cache import cache_metadata_bytes
    from embstore.tiers.ssd import SSDTier
    from embstore.tiers.ssd_log import LogSSDTier

    sizes = [1000, 3, 20_000, 500, 60_000, 7]
    budget = 40_000 * bench_dlrm.ROW_BYTES // 10
    rows, policies, layouts = bench_dlrm.tuned_dram_rows(sizes, batch=64, budget_bytes=budget, batches=8,
                                                         all_in_budget=True)
    assert set(layouts) <= {"log", "in_place"} and len(layouts) == len(sizes)
    meta = sum(cache_metadata_bytes(r, n, p) for r, n, p in zip(rows, sizes, policies) if r)
    homes = sum((LogSSDTier if lay == "log" else SSDTier).index_bytes(n, bench_dlrm.ROW_BYTES)
                for n, lay in zip(sizes, layouts))
    assert sum(rows) * bench_dlrm.ROW_BYTES + meta + homes <= budget
    assert sum(rows) * bench_dlrm.ROW_BYTES > budget // 4  # most of what is left goes to rows
