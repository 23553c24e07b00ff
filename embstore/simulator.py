"""Replay a trace through cache tiers with the store's own policy kernel.

What the store does on a read, per table and per call (``embstore.hierarchy``):
the ids are deduplicated (first-occurrence order), level 0's directory sees
them in order, and the misses of level ``i`` -- in order, as one batch -- are
what level ``i + 1`` sees; the home serves the misses of the last cache. The
simulator does exactly that with :func:`embstore.policies.simulate` (the numba
kernel the cache tiers run), so its hit counts are the store's hit counts.

An *access* here is a deduplicated one: a row looked up several times in one
batch is one access (the store reads it once).

Look-ahead prefetch model (``lookahead=k``): while batch ``j - k`` runs, the
rows of batch ``j`` are known and fetched ahead into level 0. That works only
while the cache holds the look-ahead window ``W_j`` = the distinct rows of
batches ``j-k .. j``. So batch ``j``'s demand misses (the ones a lookup waits
for) are ``min(misses_j, max(0, |W_j| - C))`` for ``j >= k`` (rows of the window
that do not fit cannot be staged), and all its misses for ``j < k`` (nothing was
known ahead). ``k = 0`` gives demand misses = misses. Bytes fetched from below
are the same with or without prefetch; only the waiting changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from embstore.arrays import Ids
from embstore.belady import _as_keys, belady_hits, belady_mrc, dedup_batches, densify
from embstore.config import PolicySpec
from embstore.errors import InvalidInputError
from embstore.policies import CacheDirectory, simulate
from embstore.hierarchy import Hierarchy
from embstore.stackdist import lru_mrc
from embstore.tiers.base import Tier
from embstore.tiers.cache import DRAMTier
from embstore.traces import Trace, dense_keys

__all__ = ["LevelResult", "ReplayResult", "demand_misses", "miss_ratio_curve", "pipeline_accesses",
           "pipeline_min_keys", "pipeline_mrc", "replay", "replay_keys", "replay_pipeline", "replay_trace",
           "simulate_pipeline", "table_keys", "window_unique"]

Offsets = npt.NDArray[np.int64]


@dataclass(frozen=True)
class LevelResult:
    """One cache level's outcome. ``bytes_read``: bytes served from this level
    (hits); ``bytes_in``: bytes fetched into it from below (misses)."""

    policy: str
    capacity_rows: int
    accesses: int
    hits: int
    misses: int
    hit_ratio: float
    bytes_read: int
    bytes_in: int
    belady_hits: int  # MIN with this capacity alone over the level-0 access sequence
    belady_hit_ratio: float


@dataclass(frozen=True)
class ReplayResult:
    """A whole hierarchy's outcome over one key sequence."""

    accesses: int  # deduplicated accesses seen by level 0
    batches: int
    levels: tuple[LevelResult, ...]
    home_reads: int  # misses of the last cache (= accesses when there is no cache)
    demand_misses: int  # misses of level 0 left after look-ahead prefetch (see module doc)
    lookahead: int
    row_bytes: int
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _levels(levels: Sequence[tuple[PolicySpec | str, int]]) -> list[tuple[PolicySpec, int]]:
    out = []
    for i, lv in enumerate(levels):
        if not isinstance(lv, (tuple, list)) or len(lv) != 2:
            raise InvalidInputError(f"level {i} must be a (policy, capacity_rows) pair, got {lv!r}")
        pol, cap = lv
        spec = PolicySpec.parse(pol, f"levels[{i}].policy")
        if isinstance(cap, bool) or not isinstance(cap, (int, np.integer)) or cap < 0:
            raise InvalidInputError(f"level {i}: capacity_rows must be an integer >= 0, got {cap!r}")
        out.append((spec, int(cap)))
    return out


def simulate_level(keys: Ids, offsets: Offsets, policy: PolicySpec, capacity: int, announce: int | None = None,
                   announced: tuple[Ids, Offsets] | None = None) -> npt.NDArray[np.bool_]:
    """Per-access hit mask of one cache level (capacity 0: no cache, every access misses); ``announce`` and
    ``announced`` as in ``embstore.policies.simulate``."""
    if capacity == 0 or keys.size == 0:
        return np.zeros(keys.size, np.bool_)
    if capacity > keys.size:
        # more slots than accesses: the cache never fills, so it behaves as one sized to the distinct keys
        # (no eviction, no admission test, no bypass), and simulating that size does not allocate the slots
        capacity = int(np.unique(keys).size)
    return simulate(keys, offsets, capacity, policy, announce=announce, announced=announced)


def _next_offsets(mask: npt.NDArray[np.bool_], offsets: Offsets) -> Offsets:
    """Batch offsets of the subsequence ``keys[mask]`` (each batch stays one batch)."""
    cum = np.zeros(mask.size + 1, np.int64)
    np.cumsum(mask, out=cum[1:])
    return cum[offsets]


def window_unique(keys: Ids, offsets: Offsets, k: int) -> npt.NDArray[np.int64]:
    """Per batch ``j``: distinct keys of batches ``max(0, j-k) .. j`` (keys unique within a batch).

    An access in batch ``b`` whose key was last seen in batch ``p`` is new to
    the windows ending at ``j`` in ``[max(b, p + k + 1), b + k]``; a difference
    array over ``j`` sums those (vectorised, O(n log n) for the sort).
    """
    nb = offsets.size - 1
    out = np.zeros(nb + 1, np.int64)
    if keys.size == 0 or nb == 0:
        return out[:nb]
    batch = np.repeat(np.arange(nb, dtype=np.int64), np.diff(offsets))
    order = np.argsort(keys, kind="stable")
    prev_b = np.full(keys.size, -k - 1, np.int64)
    same = keys[order[1:]] == keys[order[:-1]]
    prev_b[order[1:][same]] = batch[order[:-1][same]]
    lo = np.maximum(batch, prev_b + k + 1)
    hi = np.minimum(batch + k, nb - 1)
    ok = lo <= hi
    np.add.at(out, lo[ok], 1)
    np.add.at(out, hi[ok] + 1, -1)
    return np.cumsum(out)[:nb]


def demand_misses(keys: Ids, offsets: Offsets, miss: npt.NDArray[np.bool_], capacity: int, k: int) -> int:
    """Level-0 misses a lookup still waits for under k-batch look-ahead prefetch (module doc)."""
    cum = np.zeros(miss.size + 1, np.int64)
    np.cumsum(miss, out=cum[1:])
    per_batch = np.diff(cum[offsets])
    if k <= 0:
        return int(per_batch.sum())
    # a window never holds more rows than there are keys, nor looks back past the first batch: clamping
    # changes nothing and keeps huge values (2**70) out of int64 arithmetic
    capacity, k = min(capacity, keys.size), min(k, per_batch.size)
    w = window_unique(keys, offsets, k)
    staged_short = np.maximum(0, w - capacity)
    demand = np.minimum(per_batch, staged_short)
    demand[:k] = per_batch[:k]
    return int(demand.sum())


def check_batches(value: Any, name: str, allow_none: bool = False) -> None:
    """InvalidInputError unless ``value`` is a whole number of batches >= 0 (or None, where allowed)."""
    if value is None and allow_none:
        return
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 0:
        raise InvalidInputError(f"{name} must be an integer >= 0 batches, got {value!r}")


def replay_keys(keys: Ids, batch_offsets: Offsets, levels: Sequence[tuple[PolicySpec | str, int]], *,
                row_bytes: int = 0, lookahead: int = 0, belady: bool = True, dedup: bool = True,
                announce: int | None = None) -> ReplayResult:
    """Replay a key sequence (any int64 keys >= 0) through cache ``levels`` (fastest first) over a home.

    ``announce=K``: every level is told each batch and the K after it before
    the batch is read (``Table.announce``, as the store's training pipeline
    does with ``announce=K``); a lower level is told whole batches but sees
    only the misses above it, as in the store.
    """
    lv = _levels(levels)
    check_batches(lookahead, "lookahead")
    check_batches(announce, "announce", allow_none=True)
    keys = _as_keys(keys)  # integers only: float keys would be truncated into other rows
    off = np.ascontiguousarray(batch_offsets, np.int64)
    if dedup:
        keys, off = dedup_batches(keys, off)
    k0, off0 = keys, off
    results = []
    miss0 = np.ones(keys.size, np.bool_)
    for i, (spec, cap) in enumerate(lv):
        hit = simulate_level(keys, off, spec, cap, announce, None if i == 0 else (k0, off0))
        if i == 0:
            miss0 = ~hit
        n, h = int(keys.size), int(hit.sum())
        bh = belady_hits(k0, cap) if belady and cap > 0 and k0.size else 0
        results.append(LevelResult(str(spec), cap, n, h, n - h, h / n if n else 0.0, h * row_bytes,
                                   (n - h) * row_bytes, bh, bh / k0.size if k0.size else 0.0))
        off = _next_offsets(~hit, off)
        keys = keys[~hit]
    cap0 = lv[0][1] if lv else 0
    dm = demand_misses(k0, off0, miss0, cap0, lookahead) if lv else int(k0.size)
    return ReplayResult(int(k0.size), int(off0.size - 1), tuple(results), int(keys.size), dm, lookahead, row_bytes,
                        {"announce": announce} if announce is not None else {})


def pipeline_accesses(keys: Ids, batch_offsets: Offsets, lookahead: int,
                      trained: bool = True) -> list[tuple[Ids, Ids, Ids]]:
    """What a training pipeline with ``lookahead=k`` has one table's store do, per batch of its trace.

    ``TieredEmbeddingBagCollection.pipeline`` keeps every row of the batches
    in its window in a working set, so the store does not see the trace: batch
    ``j``'s fetch reads only its rows none of batches ``j-k .. j-1`` uses
    (first-occurrence order), and once batch ``b`` is trained its rows no
    batch ``b+1 .. b+k`` uses are written back (in key order; with
    ``trained=False`` nothing is dirty, nothing written). The store sees them
    in the order of the pipeline's prefetch thread: fetch ``j``, then the
    write-back of batch ``j-k``, then fetch ``j+1``. Per batch ``j``:
    ``(told, read, written)``; ``told`` is what ``pipeline(announce=A)`` tells
    the tables for batch ``j`` (the rows read). Write-backs after the last
    fetch are left out: they change no read's hit.
    """
    check_batches(lookahead, "lookahead")
    keys, off = dedup_batches(keys, batch_offsets)
    dense, num = densify(keys)
    k = int(lookahead)
    # last[r]: the latest batch so far that uses row r (-1: none); one pass instead of set tests per window
    last = np.full(num, -1, np.int64)
    out = []
    for j in range(off.size - 1):
        b, d = keys[off[j]:off[j + 1]], dense[off[j]:off[j + 1]]
        read = b[last[d] < max(0, j - k)]  # no batch j-k .. j-1 uses it
        last[d] = j
        written = np.empty(0, np.int64)
        if trained and j >= k:
            g = slice(off[j - k], off[j - k + 1])
            written = np.sort(keys[g][last[dense[g]] == j - k])  # no batch j-k+1 .. j uses it
        out.append((read, read, written))
    return out


def simulate_pipeline(keys: Ids, batch_offsets: Offsets, capacity: int, policy: PolicySpec | str, *,
                      lookahead: int, announce: int | None = None, trained: bool = True) -> npt.NDArray[np.bool_]:
    """Hit mask of the reads (``pipeline_accesses``, concatenated) of a table's top cache level under a
    training pipeline with ``lookahead=k`` and ``announce=A`` (``None`` or 0: told nothing, as the pipeline).

    What ``pipeline(batches, lookahead=k, announce=A)`` counts in that level's ``stats()`` hits, exactly
    (``tests/test_lookahead_clock_audit.py``); ``replay --announce`` models a store whose every batch is
    read whole, as lookups do. Lower levels also take the dirty rows the top one evicts: not modelled.
    One directory call per read and per write-back, as the store makes (not a numba pass over the trace).
    """
    spec = PolicySpec.parse(policy)
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 0:
        raise InvalidInputError(f"capacity must be an integer >= 0 rows, got {capacity!r}")
    check_batches(announce, "announce", allow_none=True)
    steps = pipeline_accesses(keys, batch_offsets, lookahead, trained)
    reads = [r for _, r, _ in steps]
    if capacity == 0 or not steps:
        return np.zeros(sum(r.size for r in reads), np.bool_)
    every = np.concatenate([np.concatenate([r, w]) for _, r, w in steps])
    limit = int(every.max()) + 1 if every.size else 1
    d = CacheDirectory(min(int(capacity), max(1, np.unique(every).size)), spec, key_limit=limit)
    hits: list[npt.NDArray[np.bool_]] = []
    _drive_pipeline(steps, announce, d,
                    lambda ids: hits.append(d.access(ids).hit if ids.size else np.zeros(0, np.bool_)), d.access)
    return np.concatenate(hits)


def _drive_pipeline(steps: list[tuple[Ids, Ids, Ids]], announce: int | None, clock: Any,
                    read: Any, write: Any) -> None:
    """Make the calls a pipeline's prefetch thread makes on a table, in its order: advance past the last
    batch, tell ``clock`` (a directory or a hierarchy) every fetch up to ``announce`` ahead, read the rows
    entering the working set, write back those leaving it."""
    ahead = announce or 0  # the pipeline tells nothing with announce=0
    told = 0
    for j, (_, rows_in, rows_out) in enumerate(steps):
        if ahead and j:
            clock.advance()
        while ahead and told <= j + ahead and told < len(steps):
            clock.announce(steps[told][0])
            told += 1
        read(rows_in)
        if rows_out.size:
            write(rows_out)


def pipeline_min_keys(steps: Sequence[tuple[Ids, Ids, Ids]]) -> Ids:
    """The pipeline's reads and write-backs (``pipeline_accesses``) as one key sequence whose Belady MIN hits
    are the most reads any cache (no bypass) can serve under them.

    A write-back puts a row into the cache without a read, and a row read into the working set needs no
    cache copy until it is written back: only the holding from a row's last event (read or write-back) to
    its next read can give a hit. So every event gets a key of its own, and a read first repeats the key of
    its row's previous event (the only access that can hit), then takes its own (always a miss, as the
    fetched row lands). MIN over the reads alone would miss that write-backs fill the cache for free (LRU
    beat it)."""
    parts = [a for _, r, w in steps for a in (r, w)]
    rows = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    is_read = np.concatenate([np.full(a.size, i % 2 == 0) for i, a in enumerate(parts)]) if parts else \
        np.zeros(0, np.bool_)
    prev = np.full(rows.size, -1, np.int64)
    order = np.argsort(rows, kind="stable")
    same = rows[order[1:]] == rows[order[:-1]]
    prev[order[1:][same]] = order[:-1][same]
    two = is_read & (prev >= 0)
    start = np.cumsum(1 + two) - (1 + two)
    out = np.empty(rows.size + int(two.sum()), np.int64)
    out[start + two] = np.arange(rows.size)
    out[start[two]] = prev[two]
    return out


class _CountingHome(Tier):
    """A home that holds no bytes and counts the rows read from and written to it: the I/O a store's home
    would do under the simulated caches."""

    kind = "home"
    persistent = True

    def __init__(self) -> None:
        super().__init__(1)
        self.reads = 0
        self.writes = 0

    def get(self, ids: Ids) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.bool_]]:
        self.reads += len(ids)
        return np.zeros((len(ids), 1), np.uint8), np.ones(len(ids), np.bool_)

    def put(self, ids: Ids, rows: npt.NDArray[np.uint8]) -> None:
        self.writes += len(ids)

    def contains(self, ids: Ids) -> npt.NDArray[np.bool_]:
        return np.ones(len(ids), np.bool_)


def _thin_row(n: int) -> npt.NDArray[np.uint8]:
    return np.zeros((n, 1), np.uint8)


def replay_pipeline(keys: Ids, batch_offsets: Offsets, levels: Sequence[tuple[PolicySpec | str, int]], *,
                    lookahead: int, announce: int | None = None, trained: bool = True, row_bytes: int = 0,
                    belady: bool = True) -> ReplayResult:
    """One table's cache ``levels`` (fastest first) under ``pipeline(batches, lookahead=k, announce=A)``.

    The store's own ``Hierarchy`` runs over one-byte cache tiers and a home that counts its I/O, fed
    ``pipeline_accesses`` in the order the pipeline's prefetch thread makes its calls: each fetch reads the
    rows entering the working set, each write-back writes rows leaving it (dirty rows a level evicts go one
    level down, as in the store). So every level counts what the store's ``stats()`` would, lower levels
    included (``simulate_pipeline`` is the top level's hit mask alone). ``accesses`` are the reads;
    ``home_reads`` / ``extra["home_writes"]``: rows the home serves / takes (the pipeline's last write-back
    and flush are left out); ``demand_misses``: what the forward waits for, all of the top level's misses
    with ``lookahead=0`` and none with prefetch running ahead. Belady's MIN beside each level: the most reads
    a cache of that size alone could serve under the same reads and write-backs (``pipeline_min_keys``).
    """
    lv = _levels(levels)
    check_batches(announce, "announce", allow_none=True)
    steps = pipeline_accesses(keys, batch_offsets, lookahead, trained)
    return _replay_steps(steps, _distinct_reads(steps), lv, int(lookahead), announce, trained, row_bytes, belady)


def _distinct_reads(steps: list[tuple[Ids, Ids, Ids]]) -> int:
    """Distinct rows the pipeline reads (at least 1): every written row was read first, so no cache needs
    more slots than this. Once per curve: numpy's unique took 55 ms a call on 1.5M reads."""
    reads = [r for _, r, _ in steps]
    return max(1, int(np.unique(np.concatenate(reads)).size)) if reads else 1


def _replay_steps(steps: list[tuple[Ids, Ids, Ids]], distinct: int, lv: list[tuple[PolicySpec, int]],
                  lookahead: int, announce: int | None, trained: bool, row_bytes: int,
                  belady: bool) -> ReplayResult:
    """``replay_pipeline`` over its ``pipeline_accesses`` (checked settings; ``distinct``: their
    ``_distinct_reads``)."""
    reads = [r for _, r, _ in steps]
    k0 = np.concatenate(reads) if reads else np.zeros(0, np.int64)
    written = sum(int(w.size) for _, _, w in steps)
    caches = [DRAMTier(1, min(cap, distinct), spec) for spec, cap in lv if cap > 0]
    home = _CountingHome()
    h = Hierarchy(caches, home, _thin_row)
    _drive_pipeline(steps, announce, h, h.read, lambda ids: h.write(ids, _thin_row(ids.size)))
    results = []
    min_keys = pipeline_min_keys(steps) if belady else k0
    reaching = int(k0.size)
    tiers = iter(caches)
    for spec, cap in lv:
        c = next(tiers).counters if cap > 0 else None
        hits = c.hits if c is not None else 0
        bh = belady_hits(min_keys, cap) if belady and cap > 0 and k0.size else 0
        results.append(LevelResult(str(spec), cap, reaching, hits, reaching - hits,
                                   hits / reaching if reaching else 0.0, hits * row_bytes,
                                   (reaching - hits) * row_bytes, bh, bh / k0.size if k0.size else 0.0))
        reaching -= hits
    demand = (int(k0.size) - (results[0].hits if results else 0)) if lookahead == 0 else 0
    return ReplayResult(int(k0.size), len(steps), tuple(results), home.reads, demand, lookahead, row_bytes,
                        {"pipeline": True, "trained": bool(trained), "announce": announce,
                         "written_back": written, "home_writes": home.writes})


def pipeline_mrc(keys: Ids, batch_offsets: Offsets, capacities: npt.ArrayLike, policy: PolicySpec | str, *,
                 lookahead: int, announce: int | None = None, trained: bool = True) -> npt.NDArray[np.int64]:
    """Hits of one cache level at each capacity under ``pipeline(lookahead=k, announce=A)`` (the reads
    ``pipeline_accesses`` gives); ``policy`` "belady" gives MIN's (``pipeline_min_keys``)."""
    caps = _capacities(capacities)
    if isinstance(policy, str) and policy.strip().lower() == "belady":
        return belady_mrc(pipeline_min_keys(pipeline_accesses(keys, batch_offsets, lookahead, trained)), caps)
    check_batches(announce, "announce", allow_none=True)
    spec = PolicySpec.parse(policy)
    steps = pipeline_accesses(keys, batch_offsets, lookahead, trained)  # once for every capacity
    distinct = _distinct_reads(steps)
    return np.array([_replay_steps(steps, distinct, [(spec, int(c))], int(lookahead), announce, trained, 0, False)
                     .levels[0].hits for c in caps.tolist()], np.int64)


def table_keys(trace: Trace, table: int) -> tuple[Ids, Offsets]:
    """One table's accesses (ids) and batch offsets: what that table's own hierarchy sees, one batch per
    trace batch holding its accesses. A recorded trace has one batch per table call, so the other tables'
    calls would be empty batches here; they are no steps of this table's store, and a look-ahead window
    (``announce``, a pipeline's ``lookahead``) counts the table's own batches."""
    sel = trace.table == table
    return trace.ids[sel], np.unique(_next_offsets(sel, trace.batch_offsets))


def replay_trace(trace: Trace, levels: Sequence[tuple[PolicySpec | str, int]], *, per_table: bool = False,
                 row_bytes: int = 0, lookahead: int = 0, belady: bool = True,
                 announce: int | None = None) -> dict[str, ReplayResult]:
    """Replay a trace: ``{"all": result}`` for one cache over every table (rows are
    ``(table, id)`` pairs), or ``{table_name: result}`` with ``per_table`` (each
    table its own hierarchy of the given sizes, as in the store)."""
    if not per_table:
        keys, _ = dense_keys(trace)
        return {"all": replay_keys(keys, trace.batch_offsets, levels, row_bytes=row_bytes,
                                   lookahead=lookahead, belady=belady, announce=announce)}
    out = {}
    for t, name in enumerate(trace.table_names):
        ids, off = table_keys(trace, t)
        if ids.size and ids.min() < 0:
            raise InvalidInputError(f"table {name!r} has negative ids; the store cannot look them up")
        out[name] = replay_keys(ids, off, levels, row_bytes=row_bytes, lookahead=lookahead, belady=belady,
                                announce=announce)
    return out


replay = replay_trace


def _capacities(capacities: npt.ArrayLike) -> npt.NDArray[np.int64]:
    caps = np.asarray(capacities)
    if caps.ndim != 1 or (caps.size and (caps.dtype.kind not in "iu" or caps.min() < 0)):
        raise InvalidInputError("capacities must be a 1-D array of row counts >= 0")
    return np.minimum(caps, np.iinfo(np.int64).max).astype(np.int64)  # uint64 beyond int64: never evicts either


def miss_ratio_curve(keys: Ids, batch_offsets: Offsets, capacities: npt.ArrayLike, policy: PolicySpec | str,
                     *, dedup: bool = True, progress: Any = None, announce: int | None = None) -> npt.NDArray[np.int64]:
    """Hits of a single cache at each capacity (rows). ``policy`` "belady" gives MIN;
    plain LRU takes one stack-distance pass; the others (and any policy told ``announce``
    batches ahead) one simulate per capacity."""
    check_batches(announce, "announce", allow_none=True)
    caps = _capacities(capacities)
    keys = _as_keys(keys)
    off = np.ascontiguousarray(batch_offsets, np.int64)
    if dedup:
        keys, off = dedup_batches(keys, off)
    if isinstance(policy, str) and policy.strip().lower() == "belady":
        out = belady_mrc(keys, caps)
        if progress is not None:
            progress(caps.size)
        return out
    spec = PolicySpec.parse(policy)
    if str(spec) == "lru" and announce is None:
        out = lru_mrc(keys, caps)
        if progress is not None:
            progress(caps.size)
        return out
    out = np.zeros(caps.size, np.int64)
    for j, c in enumerate(caps.tolist()):
        out[j] = int(simulate_level(keys, off, spec, int(c), announce).sum())
        if progress is not None:
            progress(1)
    return out
