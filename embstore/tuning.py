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
winning at the chosen size is the one configured. With the directories in the
budget, a DRAM cache's policies compete at equal *bytes*, not rows: every
policy's (bytes, hits) points go on one frontier (``cost_frontier``), so a
lean ``lru`` directory (40 bytes a slot) that holds more rows for the same
bytes wins where a fat ``lfu+tinylfu`` one (104) hits more per row but less per
byte (a test trace at 96 KiB: 0.340 of accesses from DRAM against 0.290). The tiers are inclusive (a
row read from below lands in every level it passes), so a DRAM cache over a
device cache only adds hits when it is larger: sizes are allocated separately
for each budget on the same curves, and a DRAM cache not larger than the
device cache is dropped.

The budgets are whole: the DRAM budget pays for the DRAM caches' rows *and*
what sits beside them (a partial cache's directory, 33-104 bytes per slot by
policy; a whole-table cache's presence flags), for every table's home index
(the ``log`` layout's 4-byte slot per row, ``in_place``'s presence bit) and
every RocksDB home's block cache and memtable, set aside first, and for the
directories of device caches, which live in host memory (so a device cache
grows only while its directory fits in the DRAM the homes leave, however large
the device budget). On DLRM-sized rows
(68 bytes) the metadata is as large as the rows, so a budget counted in row
bytes alone would be overrun up to 2x (``metadata_in_budget=False`` counts
rows only, as the recorded DLRM benchmark did). The ``log`` layout's slot maps
are taken only while they fit in a quarter of the DRAM budget (and beside the RocksDB homes' floors); otherwise every
ssd home is ``in_place`` (a bit per row instead of 4 bytes). A store that will
only serve lookups (``read_only``) writes nothing back: its homes stay
``in_place`` and the caches get those bytes.

Home: ``rocksdb`` when the id space is sparse (largest id >= 2**32, or fewer
than 1 in 1000 of the ids up to the largest are used), else ``ssd``, in its
``log`` layout when the caches hold only part of the table (evictions then
append instead of rewriting their blocks).

A ``rocksdb`` home's block cache and memtable are sized from the budget, not
left at RocksDB's 64 MiB + 2 x 64 MiB (which alone overran small budgets: eight
sparse tables took 1.5 GiB before any row was cached). A home holds its block
cache (which also holds the SST index and filter blocks) and up to
``MEMTABLES`` memtables (``RocksDBTier.dram_bytes``). Each home first gets a
floor: 4 MiB memtables (RocksDB's old default; rocksdict accepts 64 KiB, but
a tiny memtable flushes a small SST file every few writes and piles up
compactions) and a 1 MiB block cache. Of the DRAM left after the floors, the
indexes and the device caches' directories, a quarter is split among the
tables by their share of the accesses, and a rocksdb home adds its table's
slice, half to the block cache and half to the memtables, up to the
defaults; the block cache also at most the
table's data (its distinct rows at ``row_bytes`` + 16 bytes of key and block
overhead: a larger cache would hold nothing more). The block cache is only
another cache level under the table's row caches, and a byte-poor one: it
holds 4 KiB blocks of rows that are neighbours by id, for a sparse table
about one hot row per block, so the row caches (sized by the greedy above)
get the rest. A large budget (a slice of >= 126 MiB per table) leaves the
defaults; where even the floors do not fit, the plan exceeds the budget and
the CLI warns.

Told caches (``announce=K``): a training pipeline run with
``pipeline(..., announce=K)`` tells every table's caches each batch and the K
after it before the batch is read (``Table.announce``), and they keep the rows
needed soonest (``embstore.lookahead``). The curves are then those of the
told policies (one simulate per capacity, LRU's included), so the sizes and
policies are chosen for the hits such a pipeline gets: on the dlrm2021-like
traces a told ``lfu+tinylfu`` (K = 16) gets 4.3-7.2 points more of Belady's
hits at 1-10% of the rows than the best online policy (BENCHMARKS.md).
A told partial cache also holds look-ahead state (``lookahead.told_bytes``: 32
bytes a slot, and 80 bytes per entry of a ring of the next power of two, at
least 256, of the most distinct ids any K + 1 consecutive batches of its table
hold), which the budget pays beside the directory (``look_ahead`` in
``dram_breakdown``). It can cost more than the rows it replaces: on the
dlrm2021-like trace no told plan beat the one told nothing at equal bytes
(BENCHMARKS.md), which is why the CLI prints both. A store that only serves
lookups is told nothing: tune it without ``announce``.

A training pipeline (``pipeline=K``, its ``lookahead=K``): the store does not
see the trace. The pipeline's working set holds every row of the K + 1 batches
in its window, so a table's caches see only the rows entering it (reads) and
the rows leaving it (write-backs, through the caches, dirty rows evicted down
a level as in the store). The curves are then hits of those reads, one
``replay_pipeline`` per capacity (the store's own ``Hierarchy`` over
byte-less tiers), and accesses, hit ratios and modelled time are of the reads.

Where the device tier lives (``device_in_host``): on a machine where torch
sees no GPU, a ``device`` tier is a torch tensor in host memory, so its rows
take DRAM like a ``dram`` cache's. ``device_in_host=True`` (what ``embstore
tune`` passes there) plans them inside the DRAM budget as well: a device cache
grows only while its rows *and* directory fit in the DRAM the homes leave,
the DRAM caches get what is left after them, and ``dram_breakdown`` counts
them (a ``device_rows`` entry, there only then). ``device_bytes`` still caps
them. Without it (the default, a planned GPU) the device budget is memory of
its own.
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
from embstore.lookahead import told_bytes
from embstore.simulator import (ReplayResult, check_batches, miss_ratio_curve, pipeline_accesses, pipeline_mrc,
                                replay_keys, replay_pipeline, table_keys)
from embstore.tiers.cache import cache_metadata_bytes
from embstore.tiers.rocksdb import MEMTABLES, RocksDBTier
from embstore.tiers.ssd import SSDTier
from embstore.tiers.ssd_log import LogSSDTier
from embstore.traces import Trace

__all__ = ["POLICIES", "TablePlan", "TuneResult", "allocate", "cost_frontier", "home_index_bytes", "rocksdb_sizes",
           "tune"]

POLICIES = ("lru", "lfu", "clock", "lru+tinylfu")
SPARSE_MAX_ID = 1 << 32
SPARSE_DENSITY = 1e-3
ROCKSDB_DEFAULT = TierConfig("rocksdb")  # block cache and memtable 64 MiB each
ROCKSDB_BLOCK_CACHE_FLOOR = 1 << 20
ROCKSDB_WRITE_BUFFER_FLOOR = 4 << 20
ROCKSDB_BUDGET_SHARE = 0.25  # of the DRAM left after floors and indexes, spread over rocksdb homes by accesses
_ROCKSDB_ENTRY_OVERHEAD = 16  # bytes a row costs in a data block beyond its value: 8-byte key, lengths, restarts
_ROCKSDB_GRAIN = 64 << 10  # sizes are whole multiples of this (readable TOML)
MAX_TABLE_ROWS = 2**62  # TableConfig's bound on num_embeddings


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
    layout: str = "in_place"  # of an ssd home
    block_cache: int = ROCKSDB_DEFAULT.block_cache  # of a rocksdb home
    write_buffer: int = ROCKSDB_DEFAULT.write_buffer  # of a rocksdb home
    told_occurrences: int | None = None  # told caches: most occurrences pending at once (None: told nothing)

    @property
    def num_rows(self) -> int:
        return max(1, self.max_id + 1)


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
    announce: int | None = None  # batches the caches are told ahead (a training pipeline's announce=K)
    device_in_host: bool = False  # the device caches' rows are host memory (no GPU): paid from the DRAM budget
    pipeline: int | None = None  # sized for a training pipeline's reads and write-backs (its lookahead=K)

    def config(self) -> StoreConfig:
        out = []
        for p in self.tables:
            tiers = []
            if p.device_rows:
                tiers.append(TierConfig("device", p.device_rows * self.row_bytes, p.device_policy))
            if p.dram_rows:
                tiers.append(TierConfig("dram", p.dram_rows * self.row_bytes, p.dram_policy))
            if p.home == "ssd":
                tiers.append(TierConfig(p.home, layout=p.layout))
            elif p.home == "rocksdb":
                tiers.append(TierConfig(p.home, block_cache=p.block_cache, write_buffer=p.write_buffer))
            else:
                tiers.append(TierConfig(p.home))
            out.append(TableConfig(name=p.name, num_embeddings=max(1, p.max_id + 1), dim=self.dim,
                                   dtype=self.dtype, tiers=tuple(tiers)))
        return StoreConfig(tuple(out))

    def used_bytes(self) -> tuple[int, int]:
        """(device bytes, DRAM bytes) the configuration holds: device cache rows; DRAM cache rows plus
        every cache directory and home index (``dram_breakdown``)."""
        return (sum(p.device_rows for p in self.tables) * self.row_bytes, sum(self.dram_breakdown().values()))

    def dram_breakdown(self) -> dict[str, int]:
        """DRAM by use: cache rows, cache directories (device caches' too), told caches' look-ahead state
        (``look_ahead``, 0 when told nothing), ssd home indexes, RocksDB homes' block caches +
        memtables (``rocksdb_buffers``: caches and buffers, not indexes), and, only where
        ``device_in_host`` (a device tier is then a tensor in host memory), the device caches' rows
        (``device_rows``)."""
        rows = meta = told = home = rocks = 0
        for p in self.tables:
            rows += p.dram_rows * self.row_bytes
            for n, pol in ((p.dram_rows, p.dram_policy), (p.device_rows, p.device_policy)):
                if n:
                    meta += cache_metadata_bytes(n, p.num_rows, pol)
                    told += _look_ahead_bytes(n, p.num_rows, p.told_occurrences)
            if p.home == "rocksdb":
                rocks += RocksDBTier.dram_bytes(p.block_cache, p.write_buffer)
            else:
                home += home_index_bytes(p.home, p.layout, p.num_rows, self.row_bytes)
        out = {"cache_rows": rows, "cache_directories": meta, "look_ahead": told, "home_indexes": home,
               "rocksdb_buffers": rocks}
        if self.device_in_host:
            out["device_rows"] = sum(p.device_rows for p in self.tables) * self.row_bytes
        return out

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


def home_index_bytes(kind: str, layout: str, num_rows: int, row_bytes: int,
                     block_cache: int = ROCKSDB_DEFAULT.block_cache,
                     write_buffer: int = ROCKSDB_DEFAULT.write_buffer) -> int:
    """DRAM a home keeps per table: ``in_place`` a presence bit per row, ``log`` a slot per row plus
    block counters, RocksDB its block cache and memtables (its defaults unless given)."""
    if kind == "rocksdb":
        return RocksDBTier.dram_bytes(block_cache, write_buffer)
    return (LogSSDTier if layout == "log" else SSDTier).index_bytes(num_rows, row_bytes)


def rocksdb_sizes(spare: int, share: float, unique_rows: int, row_bytes: int) -> tuple[int, int]:
    """(block cache, write buffer) bytes of a rocksdb home (module doc): each its floor plus a part of
    ``ROCKSDB_BUDGET_SHARE x share x spare`` (``spare``: DRAM left after every floor and index;
    ``share``: the table's fraction of all accesses), half of it to the block cache and half to the
    ``MEMTABLES`` memtables, each at most RocksDB's default; the block cache at most the table's data.
    ``spare=0`` gives the floors."""
    extra = int(max(0, spare) * max(0.0, share) * ROCKSDB_BUDGET_SHARE / 2)
    data = -(-max(1, unique_rows) * (row_bytes + _ROCKSDB_ENTRY_OVERHEAD) // _ROCKSDB_GRAIN) * _ROCKSDB_GRAIN

    def size(floor: int, default: int, part: int) -> int:
        return min(default, (floor + part) // _ROCKSDB_GRAIN * _ROCKSDB_GRAIN)

    return (min(data, size(ROCKSDB_BLOCK_CACHE_FLOOR, ROCKSDB_DEFAULT.block_cache, extra)),
            size(ROCKSDB_WRITE_BUFFER_FLOOR, ROCKSDB_DEFAULT.write_buffer, extra // MEMTABLES))


def _look_ahead_bytes(rows: int, num_rows: int, told: int | None) -> int:
    """The look-ahead state of a partial cache told ``told`` occurrences at a time (None: told nothing);
    a whole-table cache never evicts and is told nothing."""
    return told_bytes(rows, told) if told is not None and rows < num_rows else 0


def _directory_bytes(rows: int, num_rows: int, policy: str, told: int | None) -> int:
    """DRAM beside a cache's rows: its directory and its look-ahead state."""
    return cache_metadata_bytes(rows, num_rows, policy) + _look_ahead_bytes(rows, num_rows, told)


def _cache_costs(caps: np.ndarray, best: np.ndarray, policies: Sequence[str], num_rows: int,
                 row_bytes: int, told: int | None = None) -> np.ndarray:
    """Bytes of a cache of ``caps[i]`` rows with the policy winning there: rows + metadata."""
    return np.array([0 if c == 0 else c * row_bytes + _directory_bytes(int(c), num_rows, policies[b], told)
                     for c, b in zip(caps, best)], np.int64)


def pending_occurrences(batch_offsets: np.ndarray, announce: int) -> int:
    """Most occurrences a table told ``announce`` batches ahead holds pending at once: the largest sum
    of K + 1 consecutive batches' distinct ids (``batch_offsets`` of per-batch deduplicated keys), since
    a pipeline announces batch b + K after advancing past b - 1."""
    sizes = np.diff(np.asarray(batch_offsets, np.int64))
    if sizes.size == 0:
        return 0
    sums = np.convolve(sizes, np.ones(min(announce + 1, sizes.size), np.int64), mode="valid")
    return int(sums.max())


def cost_frontier(caps: np.ndarray, hits: np.ndarray, costs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (policy, grid point) pairs worth buying, cheapest first: ``hits[p, i]`` and ``costs[p, i]`` of
    policy p's cache of ``caps[i]`` rows. A pair stays when no pair at most as dear has at least as many
    hits (at equal bytes a leaner directory holds more rows). Returns (policy index, grid index) arrays,
    starting at the empty cache."""
    order = np.lexsort((-hits.ravel(), costs.ravel()))  # by bytes, then most hits first
    keep, best = [], -1
    for flat in order:
        h = int(hits.ravel()[flat])
        if h > best:
            keep.append(flat)
            best = h
    pol, idx = np.divmod(np.array(keep, np.int64), len(caps))
    return pol, idx


def _grid(unique: int, points: int) -> np.ndarray:
    """0, then geometric row counts up to ``unique`` (where every re-access hits)."""
    if unique <= 0:
        return np.zeros(1, np.int64)
    g = np.unique(np.geomspace(1, unique, num=max(2, points)).astype(np.int64))
    return np.concatenate([[0], g]).astype(np.int64)


def allocate(curves: Sequence[tuple[np.ndarray, np.ndarray]], budget_bytes: int, row_bytes: int,
             costs: Sequence[np.ndarray] | None = None, side_costs: Sequence[np.ndarray] | None = None,
             side_budget: int = 0) -> list[int]:
    """Greedy marginal-gain allocation: ``curves[t] = (capacities_rows, hits)``; returns
    each table's grid index. Each step buys the jump (any table, any larger grid
    point that fits) with the most hits per byte. ``costs[t][i]``: bytes of grid
    point i (default: its rows x ``row_bytes``). ``side_costs[t][i]``: bytes the same
    point takes from a second budget ``side_budget`` (a device cache's directory lives
    in DRAM), which every jump must fit as well."""
    if costs is None:
        costs = [caps * row_bytes for caps, _ in curves]
    pos = [0] * len(curves)
    left = int(budget_bytes)
    side_left = int(side_budget)
    while True:
        best, pick = 0.0, None
        for t, (caps, hits) in enumerate(curves):
            i = pos[t]
            dbytes = costs[t][i + 1:] - costs[t][i]
            if dbytes.size == 0:
                continue
            gain = (hits[i + 1:] - hits[i]).astype(np.float64)
            ok = dbytes <= left
            if side_costs is not None:
                ok &= side_costs[t][i + 1:] - side_costs[t][i] <= side_left
            if not ok.any():
                continue
            rate = np.where(ok & (gain > 0), gain / np.maximum(dbytes, 1), -1.0)
            j = int(np.argmax(rate))
            if rate[j] > best:
                best, pick = float(rate[j]), (t, i + 1 + j)
        if pick is None:
            return pos
        t, j = pick
        left -= int(costs[t][j] - costs[t][pos[t]])
        if side_costs is not None:
            side_left -= int(side_costs[t][j] - side_costs[t][pos[t]])
        pos[t] = j


def tune(trace: Trace, dram_bytes: int, device_bytes: int = 0, *, row_bytes: int = 256, dim: int | None = None,
         dtype: str = "float32", policies: Sequence[str] = POLICIES, grid_points: int = 16,
         cost: CostModel | None = None, progress: Callable[[int], object] | None = None,
         metadata_in_budget: bool = True, read_only: bool = False, announce: int | None = None,
         device_in_host: bool = False, pipeline: int | None = None) -> TuneResult:
    """Plan per-table tiers for ``trace`` within ``dram_bytes`` (+ ``device_bytes``); see module doc.
    ``read_only``: the store will only serve lookups, so no home needs a log slot map. ``announce=K``:
    size for caches told each batch and the K after it (a training pipeline's ``announce=K``).
    ``device_in_host``: the device tier will be host memory (no GPU), so its rows count in ``dram_bytes``
    too. ``pipeline=K``: the store will train through ``pipeline(..., lookahead=K)``, so each table's caches
    see the rows entering and leaving its working set (``embstore.simulator.replay_pipeline``), not whole
    batches; accesses and hit ratios are then of those reads."""
    check_batches(announce, "announce", allow_none=True)
    check_batches(pipeline, "pipeline", allow_none=True)
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
    costs: list[np.ndarray] = []  # per table: bytes of each grid point's cache, rows + metadata
    dram_choices = []  # per table: a DRAM cache's candidate (rows, hits, bytes, policy index), cheapest first
    for t, name in enumerate(trace.table_names):
        ids, off = table_keys(trace, t)
        if ids.size and ids.min() < 0:
            raise InvalidInputError(f"table {name!r} has negative ids; the store cannot look them up")
        if ids.size and ids.max() >= MAX_TABLE_ROWS:  # checked before the curves, which take the time
            raise InvalidInputError(f"table {name!r} has ids up to {int(ids.max())}, but a table holds at most "
                                    f"2**62 rows; give it a hash (hash = {{ kind = 'mod' }}) and tune a trace "
                                    "of its hashed rows (embstore.recorder records those)")
        k, o = dedup_batches(ids, off)
        reads_off = o if pipeline is None else \
            np.cumsum([0] + [r.size for _, r, _ in pipeline_accesses(k, o, pipeline)]).astype(np.int64)
        told = pending_occurrences(reads_off, announce) if announce is not None else None
        uniq = int(np.unique(k).size) if k.size else 0
        caps = _grid(uniq, grid_points)
        per = np.stack([miss_ratio_curve(k, o, caps, p, dedup=False, announce=announce) if pipeline is None else
                        pipeline_mrc(k, o, caps, p, lookahead=pipeline, announce=announce) for p in policies])
        if progress is not None:
            progress(1)
        max_id = int(ids.max()) if ids.size else 0
        # a table without accesses shows no sparse id space (and would pay rocksdb's floors for nothing)
        home = "rocksdb" if uniq and (max_id >= SPARSE_MAX_ID or uniq / (max_id + 1) < SPARSE_DENSITY) else "ssd"
        data.append((name, k, o, uniq, max_id, per, caps, home, told, int(reads_off[-1])))
        curves.append((caps, per.max(axis=0)))
        costs.append(_cache_costs(caps, per.argmax(axis=0), policies, max_id + 1, row_bytes, told)
                     if metadata_in_budget else caps * row_bytes)
        # DRAM caches: with metadata in the budget a policy competes at equal bytes (lru's directory is
        # 40 bytes a slot, lfu+tinylfu's 104), so the candidates are every policy's points on the frontier
        by_policy = np.stack([_cache_costs(caps, np.full(len(caps), j), policies, max_id + 1, row_bytes, told)
                              for j in range(len(policies))]) if metadata_in_budget else \
            np.broadcast_to(caps * row_bytes, per.shape)
        pol, idx = cost_frontier(caps, per, by_policy)
        dram_choices.append((caps[idx], per[pol, idx], by_policy[pol, idx], pol))
    all_acc = max(1, sum(d[9] for d in data))
    # slot maps for every ssd home, or for none (per table, most write-backs per map byte first, measured
    # no better on the DLRM shape: BENCHMARKS, session 8)
    maps = sum(home_index_bytes("ssd", "log", d[4] + 1, row_bytes) for d in data if d[7] == "ssd")
    # rocksdb homes: their floors, then their tables' slices of what is left (module doc)
    floors = sum(RocksDBTier.dram_bytes(*rocksdb_sizes(0, 0.0, d[3], row_bytes)) for d in data if d[7] == "rocksdb")
    # the maps must fit beside the rocksdb floors too: else a budget in_place homes fit was overrun
    use_log = row_bytes <= 2048 and not read_only and (
        not metadata_in_budget or (maps <= dram_bytes // 4 and maps + floors <= dram_bytes))
    homes = sum(home_index_bytes(d[7], "log" if use_log else "in_place", d[4] + 1, row_bytes)
                for d in data if d[7] != "rocksdb")

    # device caches next: their rows go to the device budget, their directories to the DRAM left after
    # the homes (a device budget far above the DRAM one must not buy directories DRAM cannot hold)
    directories = [costs[t] - curves[t][0] * row_bytes for t in range(len(curves))]
    # host memory a device cache takes: its directory, and its rows too where the device tier is a host tensor
    host = costs if device_in_host else directories if metadata_in_budget else None
    dev_pos = allocate(curves, device_bytes, row_bytes, side_costs=host,
                       side_budget=dram_bytes - homes - floors if metadata_in_budget else dram_bytes
                       ) if device_bytes else [0] * len(curves)
    dev_meta = sum(int(host[t][i]) for t, i in enumerate(dev_pos)) if host is not None else 0
    spare = dram_bytes - homes - dev_meta - floors
    rocks = [rocksdb_sizes(spare, d[9] / all_acc, d[3], row_bytes) if d[7] == "rocksdb" else
             (ROCKSDB_DEFAULT.block_cache, ROCKSDB_DEFAULT.write_buffer) for d in data]
    homes += sum(RocksDBTier.dram_bytes(bc, wb) for (bc, wb), d in zip(rocks, data) if d[7] == "rocksdb")
    left = dram_bytes - homes - dev_meta if metadata_in_budget else dram_bytes - dev_meta
    dram_pos = allocate([(c[0], c[1]) for c in dram_choices], max(0, left), row_bytes, [c[2] for c in dram_choices])
    plans = []
    for (name, k, o, uniq, max_id, per, caps, home, told, acc), di, vi, (bc, wb), choice in zip(
            data, dram_pos, dev_pos, rocks, dram_choices):
        dram_rows, dev_rows = int(choice[0][di]), int(caps[vi])
        if dram_rows <= dev_rows:
            dram_rows = 0
        dram_pol = policies[int(choice[3][di])]
        dev_pol = policies[int(np.argmax(per[:, vi]))]
        levels = ([(dev_pol, dev_rows)] if dev_rows else []) + ([(dram_pol, dram_rows)] if dram_rows else [])
        res = replay_keys(k, o, levels, row_bytes=row_bytes, belady=False, dedup=False, announce=announce) \
            if pipeline is None else replay_pipeline(k, o, levels, lookahead=pipeline, announce=announce,
                                                     row_bytes=row_bytes, belady=False)
        # log where the caches hold part of the table: every eviction writes a small row back, which in
        # place is a read-modify-write of its 4 KiB block
        partial = max(dev_rows, dram_rows) < max_id + 1
        plans.append(TablePlan(name, acc, uniq, max_id, acc / max(1, uniq * row_bytes), home, dev_rows, dev_pol,
                               dram_rows, dram_pol, res, "log" if use_log and partial else "in_place", bc, wb,
                               told))
    return TuneResult(plans, row_bytes, dim, dtype, int(dram_bytes), int(device_bytes), trace.num_batches, cost,
                      announce=announce, device_in_host=device_in_host, pipeline=pipeline)

