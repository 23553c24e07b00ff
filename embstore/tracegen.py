"""Synthetic traces: calibrated to Meta's published batch statistics, or plain Zipf.

Why a model of the *batch*: the published dlrm_datasets numbers (papers.md)
are per-batch statistics: the unique ratio (unique rows / lookups) and, for k
in 1, 8, 32, 64, 256, 1024, the share of a batch's unique rows looked up more
than k times and the share of lookups they take. Sampling lookups i.i.d. from
one popularity law reproduces those numbers at one batch size at best (they
shift as the batch grows), so the generator builds each batch's *count profile*
(how many times each unique row occurs in it) directly from the targets, at
whatever batch size is asked for.

The count model (``like=...``), for a batch of ``N = tables * batch_size * pooling``
lookups, ``U = unique_ratio * N`` unique rows:

1. The thresholds cut counts into bins ``{1}, (1, 8], (8, 32], ..., (1024, cap]``
   where ``cap = batch_size * pooling`` (a row fills at most every lookup slot of
   its table). The targets give each bin's rows and lookups; inside a bin the
   counts follow a truncated power law ``c**-beta`` whose exponent is solved
   (bisection) so the bin's mean count is its lookups / rows. Counts are drawn
   at stratified quantiles, then nudged by one so the bin's sum is exact.
2. Bins are filled top-down against *cumulative* targets (lookups and rows on
   rows reused more than k). What a batch cannot realise (a fraction of a
   1000-lookup row) is carried to the next batch (error diffusion), so small
   batches still match on average over batches; every batch has exactly ``N``
   lookups, the rest being rows seen once.
3. Rows are dealt to tables largest first, each to the table with the most
   lookup slots left (LPT), so every table gets about ``batch_size * pooling``
   lookups and a mix of hot and cold rows.
4. Which ids fill the profile gives the cross-batch reuse that caches feed on
   (no published number calibrates it): each table has a fixed popularity
   ranking of its ``ids`` (a seeded affine permutation of ``[0, ids)``). A
   batch's rows of a table take ranks drawn from Zipf(``zipf_alpha``, default
   1.0) over that ranking, made distinct by pushing collisions to the next free
   rank; the lowest ranks (with log-normal jitter) get the highest counts, so
   hot rows recur from batch to batch and cold ones come from a long tail.
5. A batch lists table 0's lookups, then table 1's, ... (table-major, as
   ``embstore.traces`` reads Meta's files), shuffled within each table.

Temporal locality (``drift=R``, default 0: the fixed ranking above, an
independent-reference model whose only cross-batch signal is each row's
count). Real popularity moves: new items arrive, old ones fade (MTrainS:
tables "show high temporal locality"), and no published number calibrates
how fast. With ``R > 0`` every rank's occupant lives a geometric number of
batches (mean ``1/R``): each batch it is replaced with probability ``R`` by a
newcomer, an id drawn uniformly from the table's id space (in a large space,
one never seen hot), which takes over its rank; the old occupant drops to the
newcomer's old rank, deep in the tail. The ranking stays a permutation, so the
popularity law at any moment is unchanged and a batch's ids stay distinct;
only which id holds which rank moves. That is a shot-noise model with
box-shaped lifetimes (Traverso et al., 2013): a fraction ``R`` of every
top-k set turns over per batch, and the top-k of batches ``B`` apart share
about ``(1 - R) ** B`` of their ids, at every k. The per-batch statistics do
not depend on ``R`` (the count profile and the ranks drawn are the same for a
seed whatever ``R``). Replacements are drawn lazily, when a rank is next
drawn (survival ``(1 - R) ** batches since it was last drawn``), so the cost
grows with the ranks a trace draws, not with the id space. In an id space a
batch nearly fills, a rank may keep its occupant when 32 tries find no
newcomer that the batch has not already used.

Limits: a profile whose lookups reach counts above k needs ``batch_size *
pooling > k`` (1024 for both dlrm presets), else :class:`InvalidInputError`.
With fewer than ~5,000 lookups per batch the top bin (>1024) exists only in
some batches, so the statistics match over several batches rather than in each.

Plain Zipf (``like=None, zipf_alpha=a``): every lookup of table t draws a rank
from Zipf(a) over ``[0, ids)``, mapped through the table's permutation (which
``drift`` moves the same way); popular ids recur across batches.

Everything is vectorised numpy plus small numba kernels, seeded and
deterministic: the same arguments give the same trace.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache, partial

import numpy as np
import numpy.typing as npt
from numba import njit, typed, types

from embstore.errors import InvalidInputError
from embstore.modmath import addmod, affine_mod, mulmod
from embstore.traces import MAX_DEFAULT_TABLES, REUSE_THRESHOLDS, Trace, TraceStats, default_table_names

__all__ = ["PROFILES", "ReuseProfile", "generate"]

_PAIRING_NOISE = 1.0  # std of the log-rank jitter when pairing ranks with counts
_GRID = 1024  # quantile grid for solving a bin's power-law exponent
MAX_ACCESSES = 1 << 40  # lookups in one generated trace (12 bytes each in memory)


@dataclass(frozen=True)
class ReuseProfile:
    """Per-batch reuse targets: ``rows_pct[i]`` / ``lookups_pct[i]`` are the % of a
    batch's unique rows reused more than ``thresholds[i]`` times and the % of its
    lookups they take; ``unique_ratio`` is unique rows / lookups."""

    name: str
    unique_ratio: float
    rows_pct: tuple[float, ...]
    lookups_pct: tuple[float, ...]
    thresholds: tuple[int, ...] = REUSE_THRESHOLDS

    def __post_init__(self) -> None:
        k, p, q = self.thresholds, self.rows_pct, self.lookups_pct
        if not (len(k) == len(p) == len(q)) or not k:
            raise InvalidInputError(f"profile {self.name!r}: thresholds, rows_pct and lookups_pct must have the "
                                    f"same non-zero length, got {len(k)}, {len(p)}, {len(q)}")
        if k[0] != 1 or any(b <= a for a, b in zip(k, k[1:])):
            raise InvalidInputError(f"profile {self.name!r}: thresholds must start at 1 and increase, got {k}")
        if not 0.0 < self.unique_ratio <= 1.0:
            raise InvalidInputError(f"profile {self.name!r}: unique_ratio must be in (0, 1], got {self.unique_ratio}")
        for what, v in (("rows_pct", p), ("lookups_pct", q)):
            if any(not 0.0 <= x <= 100.0 for x in v) or any(b > a for a, b in zip(v, v[1:])):
                raise InvalidInputError(f"profile {self.name!r}: {what} must be percentages that never "
                                        f"increase, got {v}")

    @classmethod
    def from_stats(cls, stats: TraceStats, name: str = "measured") -> ReuseProfile:
        """The profile of a measured trace, to generate more traces like it."""
        return cls(name, stats.unique_ratio, tuple(b.rows_pct for b in stats.reuse),
                   tuple(b.lookups_pct for b in stats.reuse), tuple(b.threshold for b in stats.reuse))


PROFILES: dict[str, ReuseProfile] = {
    # 856 tables, batch 65,536 ("<0.05%" of rows above 1024 taken as 0.025%)
    "dlrm2021": ReuseProfile("dlrm2021", 0.145, (52.7, 12.4, 2.0, 0.8, 0.2, 0.025),
                             (93.1, 71.9, 49.4, 42.0, 31.1, 21.3)),
    # 788 tables, batch 131,072
    "dlrm2022": ReuseProfile("dlrm2022", 0.078, (65.8, 22.7, 4.7, 1.8, 0.4, 0.1),
                             (97.3, 84.3, 61.8, 51.9, 39.0, 29.6)),
}


# --------------------------------------------------------------------------- count profile


def _quantiles(p: np.ndarray, lam: float, a: float, length: float) -> np.ndarray:
    """Quantiles of log-count y on [a, a + length) with density ~ exp(-lam * (y - a)),
    i.e. counts x = e^y with density ~ x**-(1 + lam)."""
    if abs(lam * length) < 1e-9:
        return a + p * length
    return a - np.log1p(p * np.expm1(-lam * length)) / lam


@lru_cache(maxsize=4096)
def _solve_lambda(lo: int, hi: int, mean: float) -> float:
    """Exponent such that counts on [lo, hi] have the given mean (bisection)."""
    a, length = math.log(lo), math.log(hi + 1) - math.log(lo)
    p = (np.arange(_GRID) + 0.5) / _GRID
    target = mean + 0.5  # floor() takes half a count off on average
    left, right = -40.0 / length, 40.0 / length
    for _ in range(60):
        mid = 0.5 * (left + right)
        if np.exp(_quantiles(p, mid, a, length)).mean() > target:
            left = mid
        else:
            right = mid
    return 0.5 * (left + right)


def _spread(u: int, total: int, lo: int, hi: int, rng: np.random.Generator) -> npt.NDArray[np.int64]:
    """``u`` integer counts in ``[lo, hi]`` summing to ``total`` (needs u*lo <= total <= u*hi)."""
    if u == 1:
        return np.array([total], dtype=np.int64)
    if lo == hi:
        return np.full(u, lo, dtype=np.int64)
    lam = _solve_lambda(lo, hi, round(total / u, 2))
    a, length = math.log(lo), math.log(hi + 1) - math.log(lo)
    p = (np.arange(u) + rng.random(u)) / u  # stratified: one draw per 1/u of probability
    c = np.clip(np.floor(np.exp(_quantiles(p, lam, a, length))), lo, hi).astype(np.int64)
    d = total - int(c.sum())
    while d != 0:  # water-fill the remainder; each round fills rows or uses up d
        room = (hi - c) if d > 0 else (c - lo)
        idx = np.flatnonzero(room > 0)
        if idx.size == 0:  # unreachable when u * lo <= total <= u * hi
            raise ValueError(f"cannot spread {total} over {u} counts in [{lo}, {hi}]")
        step = 1 if d > 0 else -1
        if abs(d) >= idx.size:
            add = np.minimum(room[idx], abs(d) // idx.size)
            c[idx] += step * add
            d -= step * int(add.sum())
        else:
            c[rng.choice(idx, abs(d), replace=False)] += step
            d = 0
    return c


def _batch_counts(prof: ReuseProfile, n: int, cap: int, rng: np.random.Generator,
                  debt_l: np.ndarray, debt_r: np.ndarray) -> npt.NDArray[np.int64]:
    """Counts of every unique row of one batch of ``n`` lookups (see module doc, 1-2).

    ``debt_l`` / ``debt_r`` carry, per threshold, the lookups / rows above it
    that earlier batches owe the targets; they are updated in place.
    """
    k = prof.thresholds
    m = len(k)
    tl = np.asarray(prof.lookups_pct) / 100.0 * n
    tr = np.asarray(prof.rows_pct) / 100.0 * prof.unique_ratio * n
    done_l = 0  # lookups placed on rows above the current threshold
    done_r = 0
    parts = []
    for i in range(m - 1, -1, -1):
        lo = k[i] + 1
        hi = cap if i == m - 1 else min(k[i + 1], cap)
        want = min(tl[i] + debt_l[i] - done_l, n - done_l)
        u = total = 0
        if hi >= lo and want >= lo / 2 and n - done_l >= lo:
            total = min(max(int(round(want)), lo), n - done_l)
            u_min, u_max = -(-total // hi), total // lo
            u = u_max if u_min > u_max else int(min(max(round(tr[i] + debt_r[i] - done_r), u_min), u_max))
            total = min(max(total, u * lo), u * hi)
            parts.append(_spread(u, total, lo, hi, rng))
        done_l += total
        done_r += u
        debt_l[i] += tl[i] - done_l
        debt_r[i] += tr[i] - done_r
    parts.append(np.ones(n - done_l, dtype=np.int64))
    return np.concatenate(parts)


# --------------------------------------------------------------------------- identities


@njit(cache=True)
def _lpt_tables(counts, room, heap):  # pragma: no cover - numba
    """Deal rows (counts in decreasing order) to the table with the most room left.
    ``heap`` holds table indices as a max-heap on ``room`` (all equal at the start)."""
    t_n = heap.shape[0]
    out = np.empty(counts.shape[0], dtype=np.int32)
    for j in range(counts.shape[0]):
        t = heap[0]
        out[j] = t
        room[t] -= counts[j]
        i = 0
        while True:
            c = 2 * i + 1
            if c >= t_n:
                break
            if c + 1 < t_n and room[heap[c + 1]] > room[heap[c]]:
                c += 1
            if room[heap[c]] <= room[heap[i]]:
                break
            tmp = heap[i]
            heap[i] = heap[c]
            heap[c] = tmp
            i = c
    return out


@njit(cache=True)
def _make_distinct(r, seg, m):  # pragma: no cover - numba
    """Sorted ranks per table segment -> strictly increasing ranks in [0, m):
    collisions move to the next free rank, overflow folds back below m."""
    for t in range(seg.shape[0] - 1):
        s = seg[t]
        e = seg[t + 1]
        prev = -1
        for j in range(s, e):
            if r[j] <= prev:
                r[j] = prev + 1
            prev = r[j]
        top = m - 1
        for j in range(e - 1, s - 1, -1):
            if r[j] > top:
                r[j] = top
            top = r[j] - 1


@njit(cache=True)
def _shuffle_segments(x, seg, seed):  # pragma: no cover - numba
    """Fisher-Yates inside each segment ``x[seg[t]:seg[t+1]]`` (O(n), seeded)."""
    np.random.seed(seed)
    for t in range(seg.shape[0] - 1):
        s = seg[t]
        for i in range(seg[t + 1] - 1, s, -1):
            j = s + np.random.randint(0, i - s + 1)
            tmp = x[i]
            x[i] = x[j]
            x[j] = tmp


def _zipf_ranks(n: int, m: int, s: float, rng: np.random.Generator) -> npt.NDArray[np.int64]:
    """``n`` ranks in ``[0, m)`` with P(rank r) ~ integral of x**-s over [r+1, r+2)
    (continuous inverse CDF: O(1) memory for any id space)."""
    u = rng.random(n)
    if s == 0.0:
        x = 1.0 + u * m
    elif abs(s - 1.0) < 1e-9:
        x = np.exp(u * math.log1p(m))
    else:
        g = 1.0 - s
        x = np.exp(np.log1p(u * math.expm1(g * math.log1p(m))) / g)
    return np.clip(np.floor(x).astype(np.int64) - 1, 0, m - 1)


_SMALL_SPACE = 1 << 50  # up to here the draw below is the original one (its traces are recorded)


@dataclass(frozen=True)
class _Permutation:
    """Rank -> id of each table: ``(a * rank + b[t]) mod m`` with gcd(a, m) = 1, exact for any m < 2**63."""

    a: int
    b: npt.NDArray[np.int64]
    m: int

    @classmethod
    def draw(cls, m: int, tables: int, rng: np.random.Generator) -> _Permutation:
        """Up to :data:`_SMALL_SPACE` ids, a < 2**62 / m as always (a * rank fits in int64; the same draws
        keep recorded traces). Above it that bound leaves fewer than 4096 multipliers, and above 2**62 / 3
        only a = 1, a rotation that keeps hot ranks on adjacent ids, so a is any unit in [2, m - 1) instead
        (never 1 or -1), made exact by ``mulmod``."""
        if m > _SMALL_SPACE:
            while True:  # a unit in at least ~1 of 7 draws for any m < 2**63
                a = int(rng.integers(2, m - 1))
                if math.gcd(a, m) == 1:
                    break
        else:
            top = max(2, min(m, (1 << 62) // m))
            a = 1
            for _ in range(64):
                cand = int(rng.integers(1, top))
                if math.gcd(cand, m) == 1:
                    a = cand
                    break
        return cls(a, rng.integers(0, m, size=tables, dtype=np.int64), m)

    def __call__(self, ranks: np.ndarray, tab: np.ndarray) -> npt.NDArray[np.int64]:
        return affine_mod(self.a, ranks, self.b[tab], self.m)


@njit(cache=True)
def _affine(a, r, b, m):  # pragma: no cover - numba
    """One rank of :class:`_Permutation`: ``(a * r + b) mod m`` without the int64 overflow of ``a * r + b``
    (for m > 2**62 that sum wraps, and two ranks would share an id; ``a * r`` passes 2**63 above 2**62 / 3)."""
    return addmod(mulmod(a, r, m), b, m)


_NEWCOMER_TRIES = 32  # draws for a newcomer the batch has not used, before a rank keeps its occupant


@njit(cache=True)
def _drifted_ids(ranks, tab, batch, keep, a, b, m, moved, checked, seed):  # pragma: no cover - numba
    """Ids at ``batch`` of the (table, rank) pairs, replacing occupants lazily (see module doc).

    ``moved[(t, r)]`` is the id at rank r where a swap changed it from the affine
    base ``(a * r + b[t]) % m``; ``checked[(t, r)]`` is the last batch rank r was
    drawn (absent: 0, the unmoved ranking). A newcomer may not come from a rank
    drawn earlier in this batch: that id is already out, and would repeat.
    """
    np.random.seed(seed)
    out = np.empty(ranks.shape[0], dtype=np.int64)
    for i in range(ranks.shape[0]):
        t = np.int64(tab[i])
        r = np.int64(ranks[i])
        key = (t, r)
        last = checked.get(key, 0)
        if last < batch:
            checked[key] = batch
            if np.random.random() >= keep ** (batch - last):
                for _ in range(_NEWCOMER_TRIES):
                    j = np.int64(np.random.randint(0, m))
                    if j != r and checked.get((t, j), -1) != batch:
                        new = moved.get((t, j), _affine(a, j, b[t], m))
                        moved[(t, j)] = moved.get(key, _affine(a, r, b[t], m))
                        moved[key] = new
                        break
        out[i] = moved.get(key, _affine(a, r, b[t], m))
    return out


class _DriftingRanking:
    """A table ranking whose occupants are replaced at rate ``drift`` per batch (module doc).

    Its own random stream (seeded from the trace's seed) keeps the trace's other
    draws, hence its per-batch statistics, the same as without drift.
    """

    def __init__(self, perm: _Permutation, drift: float, seed: int) -> None:
        self.perm = perm
        self.keep = 1.0 - drift
        self.rng = np.random.default_rng([seed, 0xD21F7])
        pair = types.UniTuple(types.int64, 2)
        self.moved = typed.Dict.empty(key_type=pair, value_type=types.int64)
        self.checked = typed.Dict.empty(key_type=pair, value_type=types.int64)

    def ids(self, ranks: np.ndarray, tab: np.ndarray, batch: int) -> npt.NDArray[np.int64]:
        p = self.perm
        return _drifted_ids(ranks.astype(np.int64, copy=False), tab, np.int64(batch), self.keep, np.int64(p.a),
                            p.b, np.int64(p.m), self.moved, self.checked, int(self.rng.integers(0, 2**31 - 1)))


_IdsOf = Callable[[np.ndarray, np.ndarray], npt.NDArray[np.int64]]  # (ranks, tables) -> ids


def _calibrated_batch(counts: np.ndarray, n_t: int, tables: int, id_space: int, alpha: float,
                      ids_of: _IdsOf, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    counts = np.ascontiguousarray(np.sort(counts)[::-1])
    heap = rng.permutation(tables).astype(np.int64)
    tab = _lpt_tables(counts, np.full(tables, n_t, dtype=np.int64), heap)
    order = np.lexsort((-counts, tab))  # by table, hottest first
    c, t = counts[order], tab[order]
    per_table = np.bincount(t, minlength=tables)
    if per_table.max() > id_space:
        raise InvalidInputError(f"a table needs {int(per_table.max())} distinct ids in one batch but its id space "
                                f"has {id_space}; raise ids (--ids) to at least that")
    seg = np.zeros(tables + 1, dtype=np.int64)
    np.cumsum(per_table, out=seg[1:])
    r = _zipf_ranks(c.size, id_space, alpha, rng)
    r = r[np.lexsort((r, t))]  # t is sorted: this sorts ranks within each table
    _make_distinct(r, seg, id_space)
    key = np.log1p(r) + _PAIRING_NOISE * rng.standard_normal(r.size)
    r = r[np.lexsort((key, t))]  # popular ranks (plus jitter) meet the hottest rows
    ids = np.repeat(ids_of(r, t), c)
    acc_seg = np.zeros(tables + 1, dtype=np.int64)
    np.cumsum(np.bincount(t, weights=c, minlength=tables).astype(np.int64), out=acc_seg[1:])
    _shuffle_segments(ids, acc_seg, int(rng.integers(0, 2**31 - 1)))  # stays table-major
    return ids, np.repeat(t, c)


# --------------------------------------------------------------------------- API


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise InvalidInputError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _drift_rate(value: object) -> float:
    """``drift`` as a float in [0, 1]: a per-batch replacement probability."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not 0.0 <= float(value) <= 1.0:
        raise InvalidInputError(f"drift must be a number in [0, 1] (the share of each table's popularity "
                                f"ranking replaced per batch), got {value!r}")
    return float(value)


def generate(like: str | ReuseProfile | None = None, *, zipf_alpha: float | None = None, batches: int = 10,
             batch_size: int = 4096, tables: int = 8, ids: int = 1_000_000, pooling: int = 1, seed: int = 0,
             drift: float = 0.0, progress: Callable[[int], object] | None = None) -> Trace:
    """A synthetic trace of ``batches`` batches of ``batch_size`` samples.

    Each sample looks up ``pooling`` ids in each of ``tables`` tables, whose ids
    lie in ``[0, ids)``. ``like`` ("dlrm2021", "dlrm2022" or a
    :class:`ReuseProfile`) reproduces that profile's per-batch statistics;
    ``zipf_alpha`` then sets the long-run popularity skew of ids (default 1.0).
    Without ``like``, ``zipf_alpha`` alone gives i.i.d. Zipf lookups.
    ``drift`` (in [0, 1], default 0: a fixed ranking) is the share of each
    table's popularity ranking replaced by newcomers per batch; it moves which
    ids are hot, not the per-batch statistics.
    ``progress(1)`` is called after each batch. See the module doc for the model.
    """
    batches = _positive_int("batches", batches)
    batch_size = _positive_int("batch_size", batch_size)
    tables = _positive_int("tables", tables)
    id_space = _positive_int("ids", ids)
    pooling = _positive_int("pooling", pooling)
    if tables > MAX_DEFAULT_TABLES:
        raise InvalidInputError(f"tables must be at most {MAX_DEFAULT_TABLES:,}, got {tables}")
    if id_space > np.iinfo(np.int64).max:  # ids are int64
        raise InvalidInputError(f"ids must be at most 2**63 - 1, got {id_space}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise InvalidInputError(f"seed must be a non-negative integer, got {seed!r}")
    drift = _drift_rate(drift)
    if like is None and zipf_alpha is None:
        raise InvalidInputError(f"give like (one of {', '.join(PROFILES)}) or zipf_alpha")
    alpha = 1.0 if zipf_alpha is None else float(zipf_alpha)
    if not 0.0 <= alpha <= 10.0 or math.isnan(alpha):
        raise InvalidInputError(f"zipf_alpha must be in [0, 10], got {zipf_alpha!r}")
    prof: ReuseProfile | None
    if like is None:
        prof = None
    elif isinstance(like, ReuseProfile):
        prof = like
    elif like in PROFILES:
        prof = PROFILES[like]
    else:
        raise InvalidInputError(f"unknown profile {like!r}; known: {', '.join(PROFILES)}")

    n_t = batch_size * pooling  # lookups per table per batch, and the most one row can take
    n = n_t * tables
    if n * batches > MAX_ACCESSES:  # refused here, not by numpy's allocator with a traceback
        raise InvalidInputError(f"batches * batch_size * pooling * tables = {n * batches:,} lookups; at most "
                                f"{MAX_ACCESSES:,} fit one trace")
    if prof is not None:
        reach = [(k, q) for k, q in zip(prof.thresholds, prof.lookups_pct) if q > 0]
        if reach and n_t <= reach[-1][0]:
            k, q = reach[-1]
            raise InvalidInputError(
                f"profile {prof.name!r} puts {q}% of lookups on rows looked up more than {k} times per batch, "
                f"but a row can be looked up at most batch_size * pooling = {n_t} times per batch (once per "
                f"lookup slot of its table); use batch_size * pooling > {k}")

    rng = np.random.default_rng(seed)
    perm = _Permutation.draw(id_space, tables, rng)
    ranking = _DriftingRanking(perm, drift, seed) if drift > 0 else None
    out_ids = np.empty(n * batches, dtype=np.int64)
    out_tab = np.empty(n * batches, dtype=np.int32)
    debt_l = np.zeros(len(prof.thresholds) if prof else 0)
    debt_r = np.zeros_like(debt_l)
    flat_tab = np.repeat(np.arange(tables, dtype=np.int32), n_t)
    for b in range(batches):
        sl = slice(b * n, (b + 1) * n)
        ids_of: _IdsOf = perm if ranking is None else partial(ranking.ids, batch=b)
        if prof is None:
            out_ids[sl] = ids_of(_zipf_ranks(n, id_space, alpha, rng), flat_tab)
            out_tab[sl] = flat_tab
        else:
            counts = _batch_counts(prof, n, n_t, rng, debt_l, debt_r)
            out_ids[sl], out_tab[sl] = _calibrated_batch(counts, n_t, tables, id_space, alpha, ids_of, rng)
        if progress is not None:
            progress(1)
    offsets = np.arange(batches + 1, dtype=np.int64) * n
    return Trace(out_ids, out_tab, offsets, default_table_names(tables))
