"""The DLRM benchmark's tuned placement stays inside its DRAM budget and holds small tables whole."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "bench"))

import bench_dlrm  # noqa: E402


def test_tuned_placement_fits_the_budget_and_holds_small_tables_whole() -> None:
    sizes = [50, 3, 20_000, 400, 60_000, 7]
    budget = sum(sizes) * bench_dlrm.ROW_BYTES // 10
    rows, policies = bench_dlrm.tuned_dram_rows(sizes, batch=64, budget_bytes=budget, batches=8)
    assert len(rows) == len(policies) == len(sizes)
    assert sum(rows) * bench_dlrm.ROW_BYTES <= budget
    assert all(0 <= r <= n for r, n in zip(rows, sizes))
    assert rows[1] == 3 and rows[5] == 7  # tiny, hot tables are cheapest per hit: whole in DRAM
    assert rows[2] < 20_000 and rows[4] < 60_000  # the big ones are cached, not held
    assert sum(rows) * bench_dlrm.ROW_BYTES > budget // 2  # the budget is actually used
