"""``embstore hash fit``: fit a learned hash function from a trace.

    embstore hash fit TRACE --buckets N --out F [--table NAME_OR_INDEX] [--dim 8]
                      [--dedicated-fraction 0.5] [--reserved-fraction 0.05] [--seed 0]

TRACE is any format ``embstore.traces.load`` reads, or a plain ``.npy`` array
of int64 ids. Progress goes to stderr, the summary to stdout; errors are one
line on stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from embstore.commands.argtypes import nonneg_int, positive_int, share, unwritable
from embstore.errors import ConfigError, EmbstoreError

_FIT_HELP = """\
Fit a learned hash ("Learning to Collide"): the most accessed ids of one table
get rows of their own, the other ids seen in TRACE share rows with ids that
co-occur with them in the same batches (frequency-balanced clusters of learned
low-dimensional vectors), and ids never seen are hashed into a reserved region.
The mapping is written to one file; point a table at it with
  hash = { kind = "learned", mapping = "F" }
and num_embeddings = N (the same --buckets). The file records the table it
was fitted on (--table); a store refuses it on another of its tables.

TRACE: a trace file embstore.traces.load reads (.npz, Meta's dlrm_datasets
format, CSV table,id), or a .npy array of int64 ids (one table, no batches).
"""


class _UsageError(Exception):
    """A problem with the command's input, reported as one line."""


def register(subparsers: Any) -> None:
    """Add ``hash`` (with sub-verb ``fit``) to the top-level CLI's subparsers."""
    p = subparsers.add_parser("hash", help="fit learned hash functions (hash fit)",
                              description="Hash functions mapping raw ids to rows. Sub-verbs: fit.")
    sub = p.add_subparsers(dest="hash_verb", metavar="SUBVERB", required=True)
    f = sub.add_parser("fit", help="fit a learned hash from a trace", description=_FIT_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    f.add_argument("trace", metavar="TRACE", help="trace file (.npz/.pt/.csv via embstore.traces, or .npy ids)")
    f.add_argument("--buckets", type=int, required=True, metavar="N",
                   help="physical rows of the table (its num_embeddings)")
    f.add_argument("--out", required=True, metavar="F", help="mapping file to write (replaced atomically)")
    f.add_argument("--table", default=None, metavar="NAME_OR_INDEX",
                   help="which table of the trace to fit (default: table 0)")
    f.add_argument("--batch-size", type=positive_int, default=None, metavar="B",
                   help="samples per batch when TRACE is in Meta's dlrm_datasets format (default: the whole "
                        "file is one batch)")
    f.add_argument("--dim", type=positive_int, default=8, help="dimension of the learned id vectors (default 8)")
    f.add_argument("--dedicated-fraction", type=share, default=0.5, metavar="F",
                   help="fraction of the rows given to the most accessed ids, one each (default 0.5)")
    f.add_argument("--reserved-fraction", type=share, default=0.05, metavar="F",
                   help="fraction of the rows kept for ids never seen in TRACE (default 0.05, at least one row)")
    f.add_argument("--context-size", type=positive_int, default=None, metavar="K",
                   help="cut batches into pieces of at most K accesses when learning co-occurrence "
                        "(default: whole batches; 1024-access windows for .npy ids)")
    f.add_argument("--iterations", type=positive_int, default=10,
                   help="subspace iterations of the factorisation (default 10)")
    f.add_argument("--seed", type=nonneg_int, default=0,
                   help="seed of the factorisation and of the unseen-id hash (default 0)")
    f.add_argument("--quiet", action="store_true", help="no progress lines")
    f.set_defaults(func=run_fit)


def select_table(trace: Any, table: str | None) -> tuple[np.ndarray, np.ndarray, str]:
    """(ids, batch_offsets, table label) of one table of a Trace; batches keep their boundaries."""
    raw_names = getattr(trace, "table_names", None)
    names = [str(n) for n in raw_names] if raw_names is not None else []
    tables = np.asarray(trace.table)
    if table is None:
        index = 0
    elif table in names:
        index = names.index(table)
    else:
        try:
            index = int(table)
        except ValueError:
            raise _UsageError(f"no table {table!r} in the trace; tables: {', '.join(names) or '(unnamed)'}") from None
    mask = tables == index
    if not mask.any():
        raise _UsageError(f"table {table if table is not None else index!r} has no accesses in the trace "
                          f"(table indices present: {', '.join(map(str, np.unique(tables)[:20]))})")
    label = names[index] if 0 <= index < len(names) else str(index)
    cum = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
    offsets = cum[np.asarray(trace.batch_offsets, np.int64)]
    return np.ascontiguousarray(np.asarray(trace.ids)[mask], np.int64), offsets, label


def load_ids(path: Path, table: str | None, batch_size: int | None = None) -> tuple[np.ndarray, np.ndarray | None, str]:
    """(ids, batch_offsets or None, label) from a .npy of ids or any trace format."""
    if not path.exists():
        raise _UsageError(f"trace {str(path)!r} does not exist")
    if path.suffix == ".npy":
        from embstore.bulk import open_npy

        arr = open_npy(path)  # memory-mapped: a damaged header's huge shape is refused, not allocated
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise _UsageError(f"{str(path)!r} must hold a 1-D integer array of ids, got {arr.dtype} {arr.shape}")
        if arr.dtype.kind == "u" and arr.size and int(arr.max()) > 2**63 - 1:  # would wrap to negative ids
            raise _UsageError(f"{str(path)!r} holds ids above 2**63 - 1; ids are int64")
        if table not in (None, "0") or batch_size is not None:
            raise _UsageError("a .npy trace holds one table and no batches; drop --table and --batch-size")
        return np.ascontiguousarray(arr, np.int64), None, "0"
    try:
        from embstore import traces
    except ImportError:
        raise _UsageError("reading trace files needs embstore.traces, which this install lacks; "
                          "pass a .npy array of ids instead") from None
    kwargs = {} if batch_size is None else {"batch_size": batch_size}
    return select_table(traces.load(path, **kwargs), table)


def run_fit(args: argparse.Namespace) -> int:
    """Run ``hash fit``; returns the exit status."""
    from embstore.hashing import LearnedHash

    t0 = time.perf_counter()

    def log(msg: str) -> None:
        if not args.quiet:
            print(f"[hash fit {time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    try:
        trace_path, out = Path(args.trace), Path(args.out)
        if args.buckets < 2:  # checked before the trace is read, which may take minutes (the fit checks the rest)
            raise _UsageError(f"--buckets: expected an integer >= 2, got {args.buckets}")
        if not out.parent.is_dir():
            raise _UsageError(f"--out: directory {str(out.parent)!r} does not exist")
        if out.is_dir():  # checked before the fit, which may take minutes
            raise _UsageError(f"--out: {str(out)!r} is a directory; name the mapping file to write")
        if (why := unwritable(out)) is not None:
            raise _UsageError(f"--out: cannot write {str(out)!r}: {why}")
        log(f"reading {trace_path}")
        ids, offsets, label = load_ids(trace_path, args.table, args.batch_size)
        if ids.size == 0:
            raise _UsageError(f"table {label} of {str(trace_path)!r} has no accesses")
        log(f"table {label}: {ids.size} accesses")
        mapper = LearnedHash.fit(ids, args.buckets, dim=args.dim, dedicated_fraction=args.dedicated_fraction,
                                 reserved_fraction=args.reserved_fraction, seed=args.seed, batch_offsets=offsets,
                                 context_size=args.context_size, iterations=args.iterations, log=log,
                                 table=None if trace_path.suffix == ".npy" else label)  # a .npy names no table
        mapper.save(out)
    except (_UsageError, EmbstoreError, OSError, ValueError) as exc:
        msg = str(exc)
        if isinstance(exc, ConfigError) and hasattr(args, exc.key):  # a fit parameter: name its flag
            msg = f"--{exc.key.replace('_', '-')}: {exc.reason}"
        if isinstance(exc, OSError) and not isinstance(exc, EmbstoreError) and exc.strerror:
            msg = f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
        print(f"embstore hash fit: error: {msg}", file=sys.stderr)
        return 2
    share = mapper.meta["fit"]["dedicated_access_share"]
    print(f"wrote {out}: {mapper.num_rows} rows = {mapper.dedicated} dedicated ({share:.1%} of accesses) + "
          f"{mapper.cluster_rows} clustered + {mapper.reserved_rows} reserved; {mapper.known} known ids; "
          f"mapping {mapper.mapping_bytes} bytes")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m embstore.commands.hash_cmds hash fit ...``)."""
    parser = argparse.ArgumentParser(prog="embstore")
    register(parser.add_subparsers(dest="verb", metavar="VERB", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
