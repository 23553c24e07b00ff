"""DLRM training throughput: tables in DRAM vs tables 10x the DRAM budget on an ssd home with look-ahead.

    python tools/bench/bench_dlrm.py --quick        # tables capped at 100k rows, few steps
    python tools/bench/bench_dlrm.py                # the Kaggle table sizes (33.8M rows, 2.3 GB with state)

Criteo Kaggle shape: 26 tables of dim 16 (the Kaggle cardinalities; ``--cap``
bounds them), bottom MLP 13-512-256-64-16, top MLP 512-256-1, batch 2048,
rowwise Adagrad, synthetic Zipf(1.05) ids. Baseline: every table fully cached
in a DRAM tier over an mmap home. Tiered: DRAM caches holding 1/10 of all the
rows' bytes (row + optimizer state) in total, over ``ssd`` (io_uring) homes,
look-ahead ``--lookahead`` batches. The ssd homes of the tables cached in
part use the log layout (``--layout``): written-back rows are appended to free
blocks, so an eviction costs no read-modify-write; its slot map (4 bytes per
row) is DRAM beyond the cache budget, and the output reports it. Every row is
written first, as after
``embstore import`` (``--cold`` starts from fresh tables instead, whose misses
cost no I/O until rows are written back). ``--placement tuned`` (default)
splits the budget between the tables as ``embstore tune`` does, on a trace of
the same click distribution drawn with another seed (tables it gives every row
they use are held whole, so they train in place); ``uniform`` gives each table
1/10 of its own rows. Timing starts after ``--warmup`` steps (default 250),
when the big tables' DRAM caches are full and every miss also evicts a row
back to the ssd home, as in a long run (the output gives the least full
cache's occupancy then); with the log layout the tiered run warms up longer,
until every log home's cleaner has run (``--max-warmup``; the output gives
the steps), since cleaning is part of a log's steady state. Both runs then
stay alive and alternate ``--windows`` timed windows of ``--steps`` steps
(each after a few untimed steps that refill the look-ahead queue), swapping
which side goes first: the machine's speed drifts within a minute, so two
long runs one after the other compare the drift as much as the stores. The
headline ratio is total samples over total time of each side; every window's
samples/s and the sorted window ratios are printed beside it (goal >= 0.7).
``--all-in-budget`` makes the 10% pay for every DRAM byte of the tiered
store, as ``embstore tune`` plans by default (cache rows, their directories
and dirty bytes, every home's index; ``tune`` then picks each home's layout:
``log`` only while the slot maps fit a quarter of the budget); the recorded
default counts cache rows only. ``--precision`` also trains a small synthetic model with float32, float16 and
int8 rows and prints the held-out AUC of each (the precision's AUC cost).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import embstore
from embstore.config import StoreConfig, TableConfig
from embstore.tiers.cache import cache_metadata_bytes
from embstore.training import TieredEmbeddingBagCollection
from embstore.training.data import ClickBatch, SyntheticClicks
from embstore.training.dlrm import DLRM, dense_optimizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import import_rows, nonneg_int, positive_int  # noqa: E402

KAGGLE = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992, 5461306,
          10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]
DIM, ROW_BYTES = 16, (16 + 1) * 4  # float32 row + rowwise-adagrad state


class Run:
    """One live DLRM training run over its own store: built once, then stepped window by window.

    Both sides stay alive for the whole benchmark so their timed windows can
    alternate many times: this machine's speed drifts by tens of percent
    within a minute, and a pair of single long runs read the drift as a
    difference between the configurations.
    """

    def __init__(self, path: Path, sizes: list[int], tiers: Any, batch: int, lookahead: int, imported: bool,
                 num_batches: int) -> None:
        """``tiers(i, rows)`` gives table i's tiers; ``imported``: every row is written first (as after
        ``embstore import``), so misses read real rows from the ssd home."""
        tables = tuple(TableConfig.from_dict({"name": f"c{i}", "num_embeddings": n, "dim": DIM,
                                              "tiers": tiers(i, n)}) for i, n in enumerate(sizes))
        self.store = embstore.create(path, StoreConfig(tables))
        self.ebc = TieredEmbeddingBagCollection(self.store, [t.name for t in tables], optimizer="rowwise_adagrad",
                                                lr=0.05, lookahead=lookahead)
        if imported:
            import_rows(self.ebc.tables)
            self.store.flush()
        torch.manual_seed(0)
        self.model = DLRM(self.ebc, len(tables), DIM, 13, [512, 256, 64, 16], [512, 256, 1])
        self.opt = dense_optimizer("adagrad", self.model.dense_parameters(), 0.01)
        data = SyntheticClicks(tuple(sizes), batch, num_batches, zipf_alpha=1.05, seed=1)
        self.batches = self.ebc.pipeline(data, sparse=ClickBatch.sparse)
        self.done = 0

    def step(self, n: int) -> float:
        """Train ``n`` steps; returns their wall seconds."""
        t0 = time.perf_counter()
        for _ in range(n):
            b = next(self.batches)
            loss = F.binary_cross_entropy_with_logits(self.model(b.dense, b.ids, b.offsets), b.labels)
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
        self.done += n
        return time.perf_counter() - t0

    def warm(self, steps: int, max_steps: int = 0) -> int:
        """Untimed steps: ``steps``, then more, up to ``max_steps``, until every log-layout home has run its
        cleaner (a log's steady state includes cleaning, which starts once its spare blocks are used up)."""
        self.step(steps)
        while self.done < max_steps and not logs_cleaned(self.ebc.tables):
            self.step(10)
        return self.done

    def close(self) -> None:
        self.batches.close()
        self.ebc.release()
        self.store.close()


def logs_cleaned(tables: list[Any]) -> bool:
    """Whether every log-layout ssd home has run its cleaner at least once."""
    from embstore.tiers.ssd_log import LogSSDTier

    homes = [t.hierarchy.home for t in tables]
    return all(h.cleaned_blocks > 0 for h in homes if isinstance(h, LogSSDTier))


def cache_fill(tables: list[Any]) -> float:
    """Occupancy of the least full DRAM cache that holds only part of its table (1.0 when there is none)."""
    fills = [s["resident_rows"] / s["capacity_rows"] for t in tables
             for kind, s in t.stats().items() if kind == "dram" and s["capacity_rows"] < t.num_rows]
    return min(fills, default=1.0)


def tuned_dram_rows(sizes: list[int], batch: int, budget_bytes: int, batches: int = 40,
                    all_in_budget: bool = False) -> tuple[list[int], list[str], list[str]]:
    """Per-table DRAM cache rows from ``embstore.tuning.tune`` on a trace of the same click distribution.

    The trace is drawn with another seed than the training data (which rows
    are hot differs; how skewed each table is does not). A table the plan
    gives every row the trace used is held whole when the budget still allows,
    so its DRAM tier is direct-mapped and it trains in place; budget the plan
    leaves over (it never sizes a cache beyond the rows its trace saw) is
    shared by the other tables in proportion to their uncached rows.

    With ``all_in_budget`` the budget pays for everything the store holds in
    DRAM, as ``embstore tune`` plans by default: cache rows, their directories
    and dirty bytes, and every home's index (log slot maps only while they fit
    a quarter of the budget, else ``in_place`` homes); the left-over budget is
    shared at the price of a row plus its directory share. Returns rows,
    policies and each table's home layout (``tune``'s; "" where the caller
    decides).
    """
    import numpy as np

    from embstore.traces import Trace
    from embstore.tuning import tune

    clicks = SyntheticClicks(tuple(sizes), batch, batches, zipf_alpha=1.05, seed=7)
    ids, table, offs = [], [], [0]
    for i in range(batches):
        b = clicks.batch(i)
        for t, x in enumerate(b.ids):
            ids.append(x.numpy())
            table.append(np.full(len(x), t, np.int32))
        offs.append(offs[-1] + sum(len(x) for x in b.ids))
    trace = Trace(np.concatenate(ids), np.concatenate(table), np.array(offs, np.int64),
                  tuple(f"c{i}" for i in range(len(sizes))))
    if all_in_budget:
        return _refill_with_metadata(tune(trace, budget_bytes, row_bytes=ROW_BYTES, dim=DIM), sizes, budget_bytes)
    # rows only: the bench places the slot maps itself (--maps-in-budget), as in every recorded run
    plan = tune(trace, budget_bytes, row_bytes=ROW_BYTES, dim=DIM, metadata_in_budget=False)
    rows = [min(p.dram_rows, n) for p, n in zip(plan.tables, sizes)]
    spare = budget_bytes - sum(rows) * ROW_BYTES
    for i in sorted(range(len(sizes)), key=lambda i: sizes[i]):
        p, n = plan.tables[i], sizes[i]
        if rows[i] and rows[i] >= p.unique_rows and rows[i] < n and (n - rows[i]) * ROW_BYTES <= spare:
            spare -= (n - rows[i]) * ROW_BYTES
            rows[i] = n
    part = [i for i in range(len(sizes)) if rows[i] < sizes[i]]  # a short trace caps a plan at the rows it saw:
    room = sum(sizes[i] - rows[i] for i in part)                 # what is left goes to the cached tables
    for i in part:
        rows[i] += min(sizes[i] - rows[i], spare // ROW_BYTES * (sizes[i] - rows[i]) // max(room, 1))
    return rows, [p.dram_policy for p in plan.tables], [""] * len(sizes)


def _refill_with_metadata(plan: Any, sizes: list[int], budget_bytes: int) -> tuple[list[int], list[str], list[str]]:
    """``tune``'s plan with every DRAM byte counted, its unspent budget (a short trace caps each cache at
    the rows it saw) shared by the tables cached in part at a row's full price: bytes, directory share and
    dirty byte."""
    rows = [min(p.dram_rows, n) for p, n in zip(plan.tables, sizes)]
    policies = [p.dram_policy for p in plan.tables]
    spare = budget_bytes - plan.used_bytes()[1]
    part = [i for i in range(len(sizes)) if 0 < rows[i] < sizes[i]]
    room = sum(sizes[i] - rows[i] for i in part)
    for i in part:
        per_row = ROW_BYTES + cache_metadata_bytes(rows[i], sizes[i], policies[i]) / rows[i]
        rows[i] += min(sizes[i] - rows[i] - 1, int(spare * (sizes[i] - rows[i]) / max(room, 1) / per_row))
    return rows, policies, [p.layout for p in plan.tables]


def precision_auc(root: Path) -> dict[str, float]:
    """Held-out AUC after one synthetic epoch with each row precision."""
    from embstore.training.trainer import TrainConfig, train
    out = {}
    for dtype in ("float32", "float16", "int8"):
        text = textwrap.dedent(f"""
            [data]
            batch_size = 256
            train_batches = 120
            eval_batches = 20
            bag_max = 2
            [model]
            dense_arch = [16, 8]
            over_arch = [32, 1]
            [store]
            defaults = {{ dim = 8, dtype = "{dtype}", init = {{ kind = "uniform", scale = 0.05 }}, tiers = [{{ kind = "dram", capacity = "16KiB" }}, {{ kind = "mmap" }}] }}
            [[store.table]]
            name = "a"
            num_embeddings = 2000
            [[store.table]]
            name = "b"
            num_embeddings = 1000
            [[store.table]]
            name = "c"
            num_embeddings = 500
            [schedule]
            dense_lr = 0.05
            sparse_lr = 0.1
            seed = 3
            """)
        res = train(TrainConfig.from_dict(__import__("tomllib").loads(text)), root / dtype, progress=False)
        out[dtype] = res.evals[-1][1].auc
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tables capped at 100k rows and fewer steps")
    p.add_argument("--cap", type=positive_int, default=None,
                   help="rows per table at most (default: the Kaggle sizes; quick 100k)")
    p.add_argument("--batch", type=positive_int, default=2048)
    p.add_argument("--steps", type=positive_int, default=None, help="timed steps per window (default 60, quick 10)")
    p.add_argument("--warmup", type=nonneg_int, default=None,
                   help="untimed steps first (default 250: the big tables' DRAM caches are full by then, so "
                        "timed steps pay the eviction write-backs of a long run; quick 4)")
    p.add_argument("--lookahead", type=nonneg_int, default=4)
    p.add_argument("--max-warmup", type=nonneg_int, default=None,
                   help="with --layout log, the tiered run warms up beyond --warmup until every log home has "
                        "run its cleaner, up to this many steps (default 6000, quick 0)")
    p.add_argument("--windows", "--rounds", type=positive_int, default=None,
                   help="timed windows per side; the two live runs alternate window by window (default 8, quick 2). "
                        "--rounds, the older name that BENCHMARKS.md's earlier commands use, alternated whole runs")
    p.add_argument("--cold", action="store_true",
                   help="start from fresh tables (rows at their initial values, nothing on disk yet) instead of "
                        "tables whose every row was written first, as after `embstore import`")
    p.add_argument("--placement", choices=("tuned", "uniform"), default="tuned",
                   help="split the DRAM budget as `embstore tune` would, or 1/10 of every table")
    p.add_argument("--layout", choices=("log", "in_place"), default="log",
                   help="ssd home layout of the tables cached in part: 'log' appends written-back rows to free "
                        "blocks (no read-modify-write; a 4-byte-per-row slot map in DRAM, reported), 'in_place' "
                        "rewrites each row's block")
    p.add_argument("--maps-in-budget", action="store_true",
                   help="count the log homes' slot maps in the 10%% DRAM budget (the caches get the rest)")
    p.add_argument("--all-in-budget", action="store_true",
                   help="the 10%% DRAM budget pays for everything, as `embstore tune` plans by default: cache "
                        "rows, cache directories, home indexes; tune picks each home's layout (overrides "
                        "--layout and --maps-in-budget; --placement tuned only)")
    p.add_argument("--precision", action="store_true", help="also compare float32/float16/int8 rows' AUC")
    p.add_argument("--dir", default=None, help="where the stores go (default: a temp dir; ssd needs O_DIRECT)")
    args = p.parse_args(argv)
    cap = args.cap or (100_000 if args.quick else max(KAGGLE))
    steps = args.steps or (10 if args.quick else 60)
    args.windows = args.windows or (2 if args.quick else 8)
    warmup = args.warmup if args.warmup is not None else (4 if args.quick else 250)
    sizes = [min(n, cap) for n in KAGGLE]
    if args.max_warmup is None:
        args.max_warmup = 0 if args.quick or args.layout != "log" else 6000
    total_bytes = sum(sizes) * ROW_BYTES
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        root = Path(d)
        def all_dram(i: int, n: int) -> list[dict[str, Any]]:  # the cache holds the whole table
            return [{"kind": "dram", "capacity": n * ROW_BYTES + (1 << 16)}, {"kind": "mmap"}]

        def place(budget: int) -> tuple[list[int], list[str], list[str]]:
            if args.placement == "tuned":
                return tuned_dram_rows(sizes, args.batch, budget, all_in_budget=args.all_in_budget)
            return ([max(n * budget // total_bytes, 64) for n in sizes], ["lru"] * len(sizes),  # 1/10 of each
                    [""] * len(sizes))

        def layout_of(i: int) -> str:
            return layouts[i] or args.layout

        def slot_maps(rows: list[int]) -> int:  # DRAM of the log homes' slot maps (4 bytes per row)
            return sum(4 * n for i, (r, n) in enumerate(zip(rows, sizes)) if r < n and layout_of(i) == "log")

        cache_rows, policies, layouts = place(total_bytes // 10)
        maps = 0
        while args.maps_in_budget and not args.all_in_budget and \
                sum(cache_rows) * ROW_BYTES + slot_maps(cache_rows) > total_bytes // 10:
            # the caches get what the slot maps leave of the budget; a smaller budget can leave one more
            # table cached in part, whose map then counts too: repeat until caches + maps fit
            maps = max(maps + (1 << 20), slot_maps(cache_rows))
            cache_rows, policies, layouts = place(total_bytes // 10 - maps)

        def tiered(i: int, n: int) -> list[dict[str, Any]]:
            rows = cache_rows[i]
            layout = layout_of(i) if rows < n else "in_place"  # a table held whole never writes back
            return ([{"kind": "dram", "capacity": rows * ROW_BYTES, "policy": policies[i]}] if rows else []) + \
                [{"kind": "ssd", "layout": layout}]
        dram_bytes = sum(cache_rows) * ROW_BYTES
        map_bytes = slot_maps(cache_rows)
        settle = args.lookahead + 2  # untimed steps before each window: the look-ahead queue refills
        num_batches = max(warmup, args.max_warmup) + 10 + args.windows * (steps + settle) + args.lookahead + 1
        runs = {"dram": Run(root / "dram", sizes, all_dram, args.batch, args.lookahead, not args.cold, num_batches),
                "ssd": Run(root / "ssd", sizes, tiered, args.batch, args.lookahead, not args.cold, num_batches)}
        try:
            runs["dram"].warm(warmup)
            ssd_warm = runs["ssd"].warm(warmup, args.max_warmup)
            fill = cache_fill(runs["ssd"].ebc.tables)
            secs: dict[str, list[float]] = {"dram": [], "ssd": []}
            for w in range(args.windows):  # alternate, and swap who goes first, so drift hits both sides
                for name in (("dram", "ssd") if w % 2 == 0 else ("ssd", "dram")):
                    runs[name].step(settle)
                    secs[name].append(runs[name].step(steps))
            io = runs["ssd"].ebc.stats()
        finally:
            for run in runs.values():
                run.close()
        rate = {k: [steps * args.batch / t for t in v] for k, v in secs.items()}
        total = {k: steps * args.batch * len(v) / sum(v) for k, v in secs.items()}
        window_ratios = sorted(s / d for s, d in zip(rate["ssd"], rate["dram"]))
        result: dict[str, Any] = {
            "rows": sum(sizes), "table_bytes": total_bytes, "placement": args.placement,
            "start": "cold" if args.cold else "imported",
            "dram_cache_bytes": dram_bytes, "dram_cache_share": round(dram_bytes / total_bytes, 4),
            "ssd_layout": args.layout if not args.all_in_budget else sorted(set(map(layout_of, range(len(sizes))))),
            "ssd_slot_map_bytes": map_bytes, "all_in_budget": args.all_in_budget,
            "dram_directory_bytes": sum(cache_metadata_bytes(r, n, pol) for r, n, pol in zip(cache_rows, sizes, policies)
                                        if r),
            "dram_cache_plus_maps_share": round((dram_bytes + map_bytes) / total_bytes, 4),
            "tables_whole_in_dram": sum(r >= n for r, n in zip(cache_rows, sizes)), "batch": args.batch,
            "steps_per_window": steps, "windows": args.windows, "ssd_warmup_steps": ssd_warm,
            "dram_cache_fill_at_timing": round(fill, 3),
            "dram_window_samples_per_s": [round(x) for x in rate["dram"]],
            "ssd_window_samples_per_s": [round(x) for x in rate["ssd"]],
            "window_ratios_sorted": [round(x, 3) for x in window_ratios],
            "median_window_ratio": round(float(statistics.median(window_ratios)), 3),
            "ssd_stall_s": round(io["stall_s"], 2), "ssd_demand_misses": io["demand_misses"],
            "dram_samples_per_s": round(total["dram"]), "ssd_samples_per_s": round(total["ssd"]),
            "ratio_ssd_over_dram": round(total["ssd"] / total["dram"], 3), "goal": 0.7}
        if args.precision:
            result["auc_by_row_dtype"] = {k: round(v, 4) for k, v in precision_auc(root / "prec").items()}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
