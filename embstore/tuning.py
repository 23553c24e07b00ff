"""Recommend tiers, cache sizes and policies for a trace under a memory budget.

Following MTrainS (papers.md): what a byte of fast memory is worth depends on
the table. Each table's cache is sized on its *own* miss-ratio curve, and the
byte budget goes, step by step, to the table whose next step on its curve
buys the most hits per byte (greedy marginal gain; a table's "next step" is its
best hits-per-byte jump to any larger grid point, so dents in a curve do not
stop it). Hits per byte is bandwidth per byte: a table with many accesses on
few rows wins its bytes first.

Per table the curve is the upper envelope over the candidate policies (the
store's kernel, one simulate per capacity; LRU by one stack pass); the policy
winning at the chosen size is the one configured. The tiers are inclusive (a
row read from below lands in every level it passes), so a DRAM cache over a
device cache only adds hits when it is larger: sizes are allocated separately
for each budget on the same curves, and a DRAM cache not larger than the
device cache is dropped.

Home: ``rocksdb`` when the id space is sparse (largest id >= 2**32, or fewer
than 1 in 1000 of the ids up to the largest are used), else ``ssd``, in its
``log`` layout when the caches hold only part of the table (evictions then
append instead of rewriting their blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from embstore.belady import dedup_batches
from embstore.config import StoreConfig, TableConfig, TierConfig
from embstore.costmodel import CostModel
from embstore.errors import InvalidInputError
from embstore.simulator import ReplayResult, miss_ratio_curve, replay_keys, table_keys
from embstore.traces import Trace

__all__ = ["POLICIES", "TablePlan", "TuneResult", "allocate", "tune"]

POLICIES = ("lru", "lfu", "clock", "lru+tinylfu")
SPARSE_MAX_ID = 1 << 32
SPARSE_DENSITY = 1e-3


@dataclass(frozen=True)
class TablePlan:
    name: str
    accesses: int  # deduplicated
    unique_rows: int
    max_id: int
    bandwidth_per_byte: float  # accesses per byte of the table's rows
    home: str
    device_rows: int
    device_policy: str
    dram_rows: int
    dram_policy: str
    result: ReplayResult | None = None


@dataclass
class TuneResult:
    tables: list[TablePlan]
    row_bytes: int
    dim: int
    dtype: str
    dram_bytes: int
    device_bytes: int
    batches: int
    cost: CostModel
    extra: dict[str, Any] = field(default_factory=dict)

    def config(self) -> StoreConfig:
        out = []
        for p in self.tables:
            tiers = []
            if p.device_rows:
                tiers.append(TierConfig("device", p.device_rows * self.row_bytes, p.device_policy))
            if p.dram_rows:
                tiers.append(TierConfig("dram", p.dram_rows * self.row_bytes, p.dram_policy))
            tiers.append(TierConfig(p.home, layout=self.ssd_layout(p)) if p.home == "ssd" else TierConfig(p.home))
            out.append(TableConfig(name=p.name, num_embeddings=max(1, p.max_id + 1), dim=self.dim,
                                   dtype=self.dtype, tiers=tuple(tiers)))
        return StoreConfig(tuple(out))

    def ssd_layout(self, p: TablePlan) -> str:
        """``log`` where the caches hold part of the table and several rows share a 4 KiB block: there
        every eviction writes a small row back, which in place is a read-modify-write of its block."""
        partial = max(p.device_rows, p.dram_rows) < p.max_id + 1
        return "log" if partial and self.row_bytes <= 2048 else "in_place"

    def used_bytes(self) -> tuple[int, int]:
        """(device bytes, DRAM bytes) of the caches chosen."""
        return (sum(p.device_rows for p in self.tables) * self.row_bytes,
                sum(p.dram_rows for p in self.tables) * self.row_bytes)

    def totals(self) -> dict[str, float]:
        """Hit ratios over all tables and modelled seconds per batch, tiered and all-DRAM."""
        acc = sum(p.accesses for p in self.tables)
        dev = sum(_level(p, "device") for p in self.tables)
        dram = sum(_level(p, "dram") for p in self.tables)
        tiered = 0.0
        for p in self.tables:
            r = p.result
            if r is None:
                continue
            tiered += self.cost.batch_seconds([("device", _level(p, "device")), ("dram", _level(p, "dram")),
                                               (p.home, r.home_reads)])
        nb = max(1, self.batches)
        return {"accesses": acc, "device_hit_ratio": dev / acc if acc else 0.0,
                "dram_hit_ratio": dram / acc if acc else 0.0,
                "cache_hit_ratio": (dev + dram) / acc if acc else 0.0,
                "seconds_per_batch": tiered / nb,
                "all_dram_seconds_per_batch": self.cost.batch_seconds({"dram": acc}) / nb}


def _level(p: TablePlan, kind: str) -> int:
    if p.result is None:
        return 0
    idx = 0 if kind == "device" or not p.device_rows else 1
    if kind == "dram" and not p.dram_rows:
        return 0
    if kind == "device" and not p.device_rows:
        return 0
    return p.result.levels[idx].hits


def _grid(unique: int, points: int) -> np.ndarray:
    """0, then geometric row counts up to ``unique`` (where every re-access hits)."""
    if unique <= 0:
        return np.zeros(1, np.int64)
    g = np.unique(np.geomspace(1, unique, num=max(2, points)).astype(np.int64))
    return np.concatenate([[0], g]).astype(np.int64)


def allocate(curves: Sequence[tuple[np.ndarray, np.ndarray]], budget_bytes: int, row_bytes: int) -> list[int]:
    """Greedy marginal-gain allocation: ``curves[t] = (capacities_rows, hits)``; returns
    each table's grid index. Each step buys the jump (any table, any larger grid
    point that fits) with the most hits per byte."""
    pos = [0] * len(curves)
    left = int(budget_bytes)
    while True:
        best, pick = 0.0, None
        for t, (caps, hits) in enumerate(curves):
            i = pos[t]
            dbytes = (caps[i + 1:] - caps[i]) * row_bytes
            if dbytes.size == 0:
                continue
            gain = (hits[i + 1:] - hits[i]).astype(np.float64)
            ok = dbytes <= left
            if not ok.any():
                continue
            rate = np.where(ok & (gain > 0), gain / np.maximum(dbytes, 1), -1.0)
            j = int(np.argmax(rate))
            if rate[j] > best:
                best, pick = float(rate[j]), (t, i + 1 + j)
        if pick is None:
            return pos
        t, j = pick
        left -= int((curves[t][0][j] - curves[t][0][pos[t]]) * row_bytes)
        pos[t] = j


def tune(trace: Trace, dram_bytes: int, device_bytes: int = 0, *, row_bytes: int = 256, dim: int | None = None,
         dtype: str = "float32", policies: Sequence[str] = POLICIES, grid_points: int = 16,
         cost: CostModel | None = None, progress: Callable[[int], object] | None = None) -> TuneResult:
    """Plan per-table tiers for ``trace`` within ``dram_bytes`` (+ ``device_bytes``); see module doc."""
    if dram_bytes < 0 or device_bytes < 0:
        raise InvalidInputError("budgets must be >= 0 bytes")
    if row_bytes < 1:
        raise InvalidInputError(f"row_bytes must be >= 1, got {row_bytes}")
    if dim is None:
        if row_bytes % 4:
            raise InvalidInputError(f"row_bytes {row_bytes} is not a whole number of float32 values; give dim")
        dim = row_bytes // 4
    if not policies:
        raise InvalidInputError("give at least one policy")
    cost = cost or CostModel()
    data = []
    curves = []
    for t, name in enumerate(trace.table_names):
        ids, off = table_keys(trace, t)
        if ids.size and ids.min() < 0:
            raise InvalidInputError(f"table {name!r} has negative ids; the store cannot look them up")
        k, o = dedup_batches(ids, off)
        uniq = int(np.unique(k).size) if k.size else 0
        caps = _grid(uniq, grid_points)
        per = np.stack([miss_ratio_curve(k, o, caps, p, dedup=False) for p in policies])
        if progress is not None:
            progress(1)
        data.append((name, k, o, uniq, int(ids.max()) if ids.size else 0, per, caps))
        curves.append((caps, per.max(axis=0)))
    dram_pos = allocate(curves, dram_bytes, row_bytes)
    dev_pos = allocate(curves, device_bytes, row_bytes) if device_bytes else [0] * len(curves)
    plans = []
    for (name, k, o, uniq, max_id, per, caps), di, vi in zip(data, dram_pos, dev_pos):
        dram_rows, dev_rows = int(caps[di]), int(caps[vi])
        if dram_rows <= dev_rows:
            dram_rows = 0
        dram_pol = policies[int(np.argmax(per[:, di]))]
        dev_pol = policies[int(np.argmax(per[:, vi]))]
        sparse = max_id >= SPARSE_MAX_ID or (uniq / (max_id + 1) < SPARSE_DENSITY if max_id >= 0 else False)
        levels = ([(dev_pol, dev_rows)] if dev_rows else []) + ([(dram_pol, dram_rows)] if dram_rows else [])
        res = replay_keys(k, o, levels, row_bytes=row_bytes, belady=False, dedup=False)
        acc = int(k.size)
        plans.append(TablePlan(name, acc, uniq, max_id, acc / max(1, uniq * row_bytes),
                               "rocksdb" if sparse else "ssd", dev_rows, dev_pol, dram_rows, dram_pol, res))
    return TuneResult(plans, row_bytes, dim, dtype, int(dram_bytes), int(device_bytes), trace.num_batches, cost)
