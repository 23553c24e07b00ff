"""A learned hash after "Learning to Collide" (Ghaemmaghami et al., 2022).

The hashing trick makes ids collide at random; a learned mapping makes ids
that behave alike share rows instead, and gives the hottest ids rows of their
own. ``LearnedHash.fit`` splits the ``buckets`` physical rows into::

    [0, D)                     dedicated: the D most accessed ids, one row each,
                               hottest first (row 0 is the hottest id)
    [D, D + C)                 clustered: every other seen id, grouped by a
                               low-dimensional vector with frequency-balanced
                               bisecting k-means (see _cluster.py)
    [D + C, buckets)           reserved: ids never seen in fitting, by
                               ModHash(reserved_rows, seed) (at least one row,
                               and every row the other regions leave unused)

``D = min(dedicated_fraction * buckets, ...)``; when all seen ids fit in the
non-reserved rows every one of them is dedicated. The vectors are given by the
caller (``vectors``), or learned from the trace by factorising the id-context
co-occurrence matrix (see _embed.py), or, for bare ``(ids, counts)``, are the
log access count (ids of similar popularity share rows).

The fitted mapping is two flat arrays, an open-addressing table id -> row (see
_table.py), saved in a single file (see _format.py) that ``load`` maps with
mmap. Fitting is deterministic for a seed on one machine; the saved file is
the contract, and lookups from it are exact everywhere.

The file also says what it was fitted for: ``num_rows`` (the bucket count, a
table's ``num_embeddings``), ``table`` (the trace's table it was fitted on, or
null) and ``id_range`` (the smallest and largest id seen, or null). The last
two are optional keys of version 1, not a new version: files written before
them load (as fitted for no named table), and so do newer files in older
readers, which ignore them. ``build_hash`` refuses a mapping attached to a
table of another bucket count, or fitted on another table of the same store.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from embstore.arrays import Ids
from embstore.errors import ConfigError, CorruptStoreError
from embstore.hashing._cluster import balanced_bisect
from embstore.hashing._embed import contexts, cooccurrence_vectors
from embstore.hashing._format import read_arrays, write_arrays
from embstore.hashing._mix import seed_key
from embstore.hashing._table import build_table, lookup_kernel
from embstore.hashing.base import MAX_ROWS, Mapper, as_id_array, check_fraction, check_int

FORMAT = "embstore-learned-hash"
VERSION = 1
_TABLE_SALT = 0x7AB1E5EED  # the slot hash of the id table is independent of the user's seed
_MAX_TOTAL = 2.0**63  # accesses (sum of counts) the fit accepts
_MAX_VECTOR = 1e100  # |vector entry|: weight (< 2**63) * entry**2 stays far from float64's limit


def _int_ids(a: Any, name: str) -> np.ndarray:
    if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype.kind not in "iu":
        got = f"{a.dtype} of shape {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        raise ConfigError(name, f"must be a 1-D integer numpy array, got {got}")
    if a.dtype.kind == "u" and a.size and int(a.max()) > 2**63 - 1:
        raise ConfigError(name, "holds ids above 2**63 - 1; ids are int64")
    return np.ascontiguousarray(a, np.int64)


class LearnedHash(Mapper):
    """Dedicated rows for hot ids, learned clusters for the rest, hashed unseen ids."""

    rows_per_id = 1

    def __init__(self, meta: dict[str, Any], tkeys: np.ndarray, trows: np.ndarray) -> None:
        """Use :meth:`fit` or :meth:`load`; this takes their validated parts."""
        self.meta = meta
        self.num_rows = int(meta["num_rows"])
        self.dedicated = int(meta["dedicated"])
        self.cluster_rows = int(meta["cluster_rows"])
        self.reserved_start = int(meta["reserved_start"])
        self.reserved_rows = self.num_rows - self.reserved_start
        self.seed = int(meta["seed"])
        self.known = int(meta["known_ids"])
        self.table: str | None = meta.get("table")  # the trace's table it was fitted on (None: not recorded)
        rng = meta.get("id_range")
        self.id_range: tuple[int, int] | None = (int(rng[0]), int(rng[1])) if rng is not None else None
        self._table_key = np.uint64(int(meta["table_key"]))
        self._seed_key = np.uint64(seed_key(self.seed))
        self._tkeys = tkeys
        self._trows = trows

    # -- lookup ---------------------------------------------------------------------

    def __call__(self, ids: Ids) -> np.ndarray:
        arr = as_id_array(ids)
        out = np.empty(arr.shape[0], np.int64)
        if arr.shape[0]:
            lookup_kernel(arr, self._tkeys, self._trows, self._table_key, np.int64(self.reserved_start),
                          np.int64(self.reserved_rows), self._seed_key, out)
        return out

    @property
    def mapping_bytes(self) -> int:
        return int(self._tkeys.nbytes + self._trows.nbytes)

    def known_ids(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, rows) of every id seen in fitting, sorted by id."""
        full = self._trows != -1
        keys = np.asarray(self._tkeys[full])
        order = np.argsort(keys, kind="stable")
        return keys[order], np.asarray(self._trows[full], np.int64)[order]

    def __repr__(self) -> str:
        return (f"LearnedHash(num_rows={self.num_rows}, dedicated={self.dedicated}, "
                f"cluster_rows={self.cluster_rows}, reserved_rows={self.reserved_rows}, known_ids={self.known}, "
                f"table={self.table!r})")

    # -- persistence ----------------------------------------------------------------

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the mapping to one file, atomically (see _format.py)."""
        write_arrays(path, self.meta, {"keys": self._tkeys, "rows": self._trows})

    @classmethod
    def load(cls, path: str | os.PathLike[str], verify: bool = True) -> "LearnedHash":
        """Open a saved mapping with its arrays mmapped read-only. ``verify`` checks
        CRCs and ranges (one pass over the file). Missing file -> ConfigError('mapping'),
        unreadable content -> CorruptStoreError; both name the path."""
        path = Path(path)
        try:
            meta, arrays = read_arrays(path, verify=verify)
        except FileNotFoundError:
            raise ConfigError("mapping", f"file {str(path)!r} does not exist; "
                              "fit one with `embstore hash fit`") from None
        except IsADirectoryError:
            raise ConfigError("mapping", f"{str(path)!r} is a directory, not a mapping file") from None
        except PermissionError as exc:
            raise ConfigError("mapping", f"cannot read {str(path)!r}: {exc.strerror}") from None

        def bad(why: str) -> CorruptStoreError:
            return CorruptStoreError(f"{path}: not a valid embstore hash mapping ({why})")

        version = meta.get("version")
        if meta.get("format") != FORMAT or type(version) is not int or version != VERSION:
            raise bad(f"format {meta.get('format')!r} version {version!r}; "
                      f"expected {FORMAT!r} version {VERSION}")
        fields = ("num_rows", "dedicated", "cluster_rows", "reserved_start", "seed", "known_ids", "table_key")
        missing = [k for k in fields if k not in meta]
        if missing:
            raise bad(f"header field {missing[0]!r} is missing")
        # exact ints only: int() would truncate a damaged 99.5 to 99 rows, or overflow on 1e300
        wrong = [k for k in fields if type(meta[k]) is not int]
        if wrong:
            raise bad(f"header field {wrong[0]!r} = {meta[wrong[0]]!r} is not an integer")
        num_rows, ded, clu, rs, seed, known, tk = (meta[k] for k in fields)
        if not (1 <= num_rows <= MAX_ROWS and 0 <= ded and 0 <= clu and rs == ded + clu and rs < num_rows
                and 0 <= seed < 2**63 and 0 <= tk < 2**64 and known >= 0):
            raise bad("inconsistent row layout in the header")
        why = _fitted_for_error(meta)
        if why is not None:
            raise bad(why)
        keys, rows = arrays.get("keys"), arrays.get("rows")
        if (keys is None or rows is None or keys.dtype != np.int64 or rows.dtype not in (np.int32, np.int64)
                or keys.ndim != 1 or keys.shape != rows.shape or keys.shape[0] < known + 1):
            raise bad("arrays 'keys' (int64) and 'rows' (int32/int64) of one length > known_ids are needed")
        if verify:
            used = rows != -1
            if int(used.sum()) != known or (known and (int(rows[used].min()) < 0 or int(rows.max()) >= rs)):
                raise bad("rows outside the dedicated and clustered regions")
        return cls(meta, keys, rows)

    # -- fitting --------------------------------------------------------------------

    @classmethod
    def fit(cls, trace_or_counts: np.ndarray | tuple[np.ndarray, np.ndarray], buckets: int, *,
            vectors: np.ndarray | None = None, dim: int = 8, dedicated_fraction: float = 0.5,
            reserved_fraction: float = 0.05, seed: int = 0, batch_offsets: np.ndarray | None = None,
            context_size: int | None = None, iterations: int = 10, refine: int = 2,
            load_factor: float = 0.6, log: Callable[[str], None] | None = None,
            table: str | None = None) -> "LearnedHash":
        """Fit a mapping of ``buckets`` rows.

        ``trace_or_counts``: a 1-D int array of accessed ids (a trace), or a pair
        ``(ids, counts)`` of unique ids and their access counts. ``vectors``:
        optional (number of unique ids, d) float array, row i for the i-th id of
        ``np.unique(trace)`` or for ``ids[i]``; without it vectors of ``dim``
        columns are learned from the trace's co-occurrences within contexts:
        the batches ``batch_offsets`` gives (cut into ``context_size`` pieces),
        else windows of ``context_size`` (1024) accesses, refined by
        ``iterations`` rounds of subspace iteration. ``refine``: 2-means rounds
        per bisection. ``load_factor``: fill of the id table (memory vs probes).
        ``log``: called with progress lines. ``table``: the name of the trace's
        table the ids come from, recorded so that a store refuses the mapping
        on another of its tables (None: not recorded).
        """
        say = log or (lambda _msg: None)
        t0 = time.perf_counter()
        buckets = check_int(buckets, "buckets", lo=2, hi=MAX_ROWS)
        dim = check_int(dim, "dim", lo=1, hi=1024)
        dedicated_fraction = check_fraction(dedicated_fraction, "dedicated_fraction")
        reserved_fraction = check_fraction(reserved_fraction, "reserved_fraction", hi=0.999)
        seed = check_int(seed, "seed", lo=0, hi=2**63 - 1)
        iterations = check_int(iterations, "iterations", lo=1, hi=1000)
        refine = check_int(refine, "refine", lo=0, hi=100)
        load_factor = check_fraction(load_factor, "load_factor", lo=0.05, hi=0.95)
        if context_size is not None:
            context_size = check_int(context_size, "context_size", lo=1)
        if table is not None and (not isinstance(table, str) or not table):
            raise ConfigError("table", f"must be a non-empty table name or None, got {table!r}")

        uniq, counts, trace, inverse, vectors, batch_offsets = _parse_input(trace_or_counts, vectors, batch_offsets)
        n = int(uniq.shape[0])
        say(f"{int(counts.sum())} accesses to {n} unique ids, {buckets} rows")

        ded, clu = _layout(n, buckets, dedicated_fraction, reserved_fraction)
        reserved_start = ded + clu

        rank = np.lexsort((uniq, -counts))  # most accessed first, ties by id
        rows = np.empty(n, np.int64)
        rows[rank[:ded]] = np.arange(ded, dtype=np.int64)
        source = "dedicated"
        if clu:
            tail = rank[ded:]
            if vectors is not None:
                x, source = vectors[tail], "vectors"
            elif trace is not None:
                say(f"learning {dim}-dimensional vectors from co-occurrences ({trace.shape[0]} accesses)")
                ctx = contexts(trace.shape[0], batch_offsets, context_size)
                x = cooccurrence_vectors(inverse, n, ctx, dim, seed, iterations=iterations, log=say)[tail]
                source = "cooccurrence"
            else:
                x, source = np.log1p(counts[tail])[:, None], "frequency"
            say(f"clustering {tail.shape[0]} ids into {clu} rows (balanced bisecting k-means)")
            labels = balanced_bisect(np.ascontiguousarray(x, np.float64), np.ascontiguousarray(counts[tail]),
                                     clu, refine)
            rows[tail] = ded + labels
        table_key = seed_key(_TABLE_SALT + seed)
        tkeys, trows = build_table(uniq, rows, buckets, table_key, load_factor)
        total = float(counts.sum())
        meta = {
            "format": FORMAT, "version": VERSION, "num_rows": buckets, "dedicated": ded, "cluster_rows": clu,
            "reserved_start": reserved_start, "seed": seed, "table_key": table_key, "known_ids": n,
            "table": table, "id_range": [int(uniq[0]), int(uniq[-1])] if n else None,
            "fit": {"accesses": total, "dim": dim, "vectors": source, "dedicated_fraction": dedicated_fraction,
                    "reserved_fraction": reserved_fraction, "load_factor": load_factor,
                    "dedicated_access_share": float(counts[rank[:ded]].sum() / total) if total else 0.0},
        }
        say(f"fitted in {time.perf_counter() - t0:.1f}s: {ded} dedicated rows, {clu} clustered rows, "
            f"{buckets - reserved_start} reserved rows; mapping {tkeys.nbytes + trows.nbytes} bytes")
        return cls(meta, tkeys, trows)


def _fitted_for_error(meta: dict[str, Any]) -> str | None:
    """Why the optional ``table`` / ``id_range`` header fields are damaged, or None (absent is fine:
    files written before they existed)."""
    table, rng = meta.get("table"), meta.get("id_range")
    if table is not None and (not isinstance(table, str) or not table):
        return f"header field 'table' = {table!r} is not a table name"
    if rng is not None and not (isinstance(rng, list) and len(rng) == 2 and all(type(x) is int for x in rng)
                                and -2**63 <= rng[0] <= rng[1] < 2**63):
        return f"header field 'id_range' = {rng!r} is not [smallest id, largest id]"
    return None


def _parse_input(trace_or_counts: Any, vectors: Any, batch_offsets: Any) -> tuple[
        np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """(unique ids sorted, float counts, trace or None, trace -> unique index or None,
    vectors aligned with the unique ids or None, batch offsets or None), all validated."""
    trace = inverse = None
    if isinstance(trace_or_counts, tuple) and len(trace_or_counts) == 2:
        ids = _int_ids(trace_or_counts[0], "ids")
        counts = trace_or_counts[1]
        if (not isinstance(counts, np.ndarray) or counts.shape != ids.shape or counts.dtype.kind not in "iuf"
                or (counts.size and (not np.isfinite(counts).all() or counts.min() < 0))):
            raise ConfigError("counts", f"must be a numpy array of {ids.shape[0]} finite counts >= 0")
        # access counts: their total must be a number of accesses, not inf (the weighted sums of the fit
        # and its log line would overflow: a raw OverflowError)
        with np.errstate(over="ignore"):
            total = float(np.sum(counts, dtype=np.float64)) if counts.size else 0.0
        if not total < _MAX_TOTAL:
            raise ConfigError("counts", f"must add up to fewer than 2**63 accesses, got {total:g}")
        if batch_offsets is not None:
            raise ConfigError("batch_offsets", "only applies to a trace, not to (ids, counts)")
        order = np.argsort(ids, kind="stable")
        uniq, counts = ids[order], counts[order].astype(np.float64)
        if uniq.size > 1 and not (np.diff(uniq) > 0).all():
            raise ConfigError("ids", "must be unique when given with counts")
        if isinstance(vectors, np.ndarray) and vectors.ndim == 2 and vectors.shape[0] == uniq.shape[0]:
            vectors = vectors[order]  # row i belongs to ids[i] as given
    elif isinstance(trace_or_counts, np.ndarray):
        trace = _int_ids(trace_or_counts, "trace_or_counts")
        uniq, inverse, counts_i = np.unique(trace, return_inverse=True, return_counts=True)
        inverse = inverse.reshape(-1)
        counts = counts_i.astype(np.float64)
        if batch_offsets is not None:
            batch_offsets = _int_ids(batch_offsets, "batch_offsets")
            if (batch_offsets.size < 1 or batch_offsets[0] != 0 or batch_offsets[-1] != trace.shape[0]
                    or (np.diff(batch_offsets) < 0).any()):
                raise ConfigError("batch_offsets", "must start at 0, not decrease and end at len(trace) = "
                                  f"{trace.shape[0]}")
    else:
        raise ConfigError("trace_or_counts", "expected a 1-D int64 array of ids or a tuple (ids, counts), "
                          f"got {type(trace_or_counts).__name__}")
    n = int(uniq.shape[0])
    if vectors is not None:
        if (not isinstance(vectors, np.ndarray) or vectors.ndim != 2 or vectors.shape[0] != n
                or vectors.shape[1] < 1 or vectors.dtype.kind not in "iuf"):
            got = vectors.shape if isinstance(vectors, np.ndarray) else type(vectors).__name__
            raise ConfigError("vectors", f"must be a numeric array of shape ({n}, d), one row per unique id; "
                              f"got {got}")
        vectors = np.ascontiguousarray(vectors, np.float64)
        if not np.isfinite(vectors).all():
            raise ConfigError("vectors", "must be finite")
        if vectors.size and float(np.abs(vectors).max()) > _MAX_VECTOR:  # the clustering's covariance overflows
            raise ConfigError("vectors", f"entries must lie within +-{_MAX_VECTOR:g}, got {np.abs(vectors).max():g}")
    return uniq, counts, trace, inverse, vectors, batch_offsets


def _layout(n: int, buckets: int, dedicated_fraction: float, reserved_fraction: float) -> tuple[int, int]:
    """(dedicated rows, clustered rows) for n seen ids; the reserved region is the rest."""
    reserved_min = max(1, math.ceil(reserved_fraction * buckets))
    avail = buckets - reserved_min
    if avail < 1:
        raise ConfigError("reserved_fraction", f"{reserved_fraction} reserves all {buckets} rows; "
                          "leave at least one")
    if n <= avail:  # every seen id gets its own row
        return n, 0
    ded = min(int(dedicated_fraction * buckets), avail - 1)  # keep >= 1 row for the clustered ids
    return ded, avail - ded
