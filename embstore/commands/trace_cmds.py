"""`embstore trace gen` and `embstore trace stats`: make and inspect lookup traces."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path


from embstore.progress import progress_bar
from embstore.commands.argtypes import nonneg_int, positive_int, share, unwritable
from embstore import strict_json, tracegen, traces
from embstore.errors import InvalidInputError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "trace", help="generate or inspect embedding-lookup traces",
        description="Traces are every embedding lookup of a workload, in order, cut into batches "
                    "(.npz with ids, table, batch_offsets, table_names). 'gen' writes a synthetic one, "
                    "'stats' summarises any trace: .npz, Meta's dlrm_datasets torch files (.pt, .pt.gz) "
                    "or CSV with a 'table,id' header.")
    verbs = p.add_subparsers(dest="trace_verb", metavar="SUBVERB", required=True)

    g = verbs.add_parser(
        "gen", help="write a synthetic trace",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write a synthetic trace of BATCHES batches of BATCH_SIZE samples, each sample looking "
                    "up POOLING ids in each of TABLES tables.\n\n"
                    "--like dlrm2021|dlrm2022 reproduces the per-batch statistics published for Meta's\n"
                    "  dlrm_datasets traces (unique ratio and reuse histogram, averaged over batches, within\n"
                    "  a point) at the batch size you ask for; needs BATCH_SIZE x POOLING > 1024.\n"
                    "  --zipf then sets how skewed long-run id popularity is (cross-batch reuse, default 1.0).\n"
                    "--zipf ALPHA alone draws every lookup from Zipf(ALPHA) over each table's ids.\n"
                    "--drift R (either mode) moves popularity: each batch, every rank of a table's popularity\n"
                    "  ranking passes to a newcomer id with probability R (hot rows live ~1/R batches); the\n"
                    "  per-batch statistics stay the same. Default 0: a fixed ranking.",
        epilog="example: embstore trace gen --like dlrm2022 --batches 50 --batch-size 16384 --tables 8 "
               "--out t.npz")
    g.add_argument("--like", choices=sorted(tracegen.PROFILES), help="published statistics to reproduce")
    g.add_argument("--zipf", type=float, metavar="ALPHA", help="Zipf exponent of id popularity, in [0, 10]")
    g.add_argument("--drift", type=share, default=0.0, metavar="R",
                   help="share of each table's popularity ranking replaced per batch, in [0, 1] (default 0)")
    g.add_argument("--batches", type=positive_int, default=10, help="number of batches (default 10)")
    g.add_argument("--batch-size", type=positive_int, default=4096, help="samples per batch (default 4096)")
    g.add_argument("--tables", type=positive_int, default=8, help="number of tables (default 8)")
    g.add_argument("--pooling", type=positive_int, default=1, help="lookups per sample per table (default 1)")
    g.add_argument("--ids", type=positive_int, default=1_000_000, help="id space per table: ids lie in [0, IDS) "
                                                              "(default 1000000)")
    g.add_argument("--seed", type=nonneg_int, default=0, help="random seed; same arguments, same trace (default 0)")
    g.add_argument("--out", required=True, metavar="F.npz", help="output trace file")
    g.set_defaults(func=cmd_gen)

    s = verbs.add_parser(
        "stats", help="print a trace's statistics",
        description="Print accesses, batches, unique rows ((table, id) pairs), the per-batch unique ratio "
                    "and dedup factor, the reuse histogram (share of a batch's unique rows looked up more "
                    "than k times and the share of lookups they take, lookup-weighted over batches) and "
                    "reuse distances (distinct other rows between successive accesses of a row, on the "
                    "per-batch deduplicated sequence: an LRU cache of C rows hits when the distance < C).")
    s.add_argument("trace", help="trace file: .npz, Meta's .pt / .pt.gz, or .csv")
    s.add_argument("--batch-size", type=positive_int, default=None,
                   help="for Meta's torch format: samples per batch (default: the whole file is one batch)")
    s.add_argument("--no-reuse-distance", action="store_true",
                   help="skip the reuse-distance pass (O(n log n)) on very large traces")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    s.set_defaults(func=cmd_stats)


def cmd_gen(args: argparse.Namespace) -> int:
    if args.like is None and args.zipf is None:
        raise InvalidInputError("give --like dlrm2021|dlrm2022 or --zipf ALPHA")
    out = Path(args.out)  # checked before the work, which may take minutes
    if out.is_dir() or not out.parent.is_dir():
        raise InvalidInputError(f"--out: cannot write {args.out}: "
                                + ("it is a directory" if out.is_dir() else f"{out.parent} is not a directory"))
    if (why := unwritable(out)) is not None:
        raise InvalidInputError(f"--out: cannot write {args.out}: {why}")
    with progress_bar(total=args.batches, desc="trace gen", unit="batch") as bar:
        trace = tracegen.generate(args.like, zipf_alpha=args.zipf, batches=args.batches,
                                  batch_size=args.batch_size, tables=args.tables, ids=args.ids,
                                  pooling=args.pooling, seed=args.seed, drift=args.drift,
                                  progress=bar.update)
    traces.save(trace, args.out)
    print(f"wrote {args.out}: {len(trace):,} accesses, {trace.num_batches} batches, {trace.num_tables} tables")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    trace = traces.load(args.trace, batch_size=args.batch_size)
    with progress_bar(total=len(trace), desc="reuse distances", unit="access", unit_scale=True,
                      enabled=not args.no_reuse_distance, leave=False) as bar:
        st = traces.trace_stats(trace, reuse_distances=not args.no_reuse_distance, progress=bar.update)
    if args.json:
        # an empty trace's ratios and a trace without re-accesses' distances are undefined: null, not NaN
        print(strict_json.dumps({"trace": args.trace, **st.to_dict()}))
    else:
        sys.stdout.write(format_stats(st, args.trace))
    return 0


def format_stats(st: traces.TraceStats, name: str) -> str:
    """The readable table ``trace stats`` prints; an undefined figure (no accesses, no re-access) reads
    'undefined' (it printed as 0, which reads as measured)."""
    def pct(x: float, width: int) -> str:
        return f"{x:{width}.2f}" if math.isfinite(x) else f"{'undefined':>{width}}"

    per_batch = (f"unique {100 * st.unique_ratio:.1f}% of lookups, dedup {st.dedup_factor:.2f}x"
                 if math.isfinite(st.unique_ratio) else "undefined (no lookups)")
    lines = [
        f"trace        {name}",
        f"accesses     {st.accesses:,}",
        f"batches      {st.batches:,}",
        f"tables       {st.tables:,}",
        f"unique rows  {st.unique_rows:,}  ((table, id) pairs in the whole trace)",
        f"per batch    {per_batch}",
        "",
        "reuse within a batch (lookup-weighted over batches)",
        "  reused > k   % of unique rows   % of lookups",
    ]
    lines += [f"  {b.threshold:>10,}   {pct(b.rows_pct, 16)}   {pct(b.lookups_pct, 12)}" for b in st.reuse]
    rd = st.reuse_distance
    if rd is not None:
        lines += [
            "",
            "reuse distance (distinct other rows between reuses, per-batch deduplicated accesses)",
            (f"  re-accesses  {rd.reaccess_pct:.1f}% of deduplicated accesses" if math.isfinite(rd.reaccess_pct)
             else "  re-accesses  undefined (no accesses)"),
            (f"  p50 {rd.p50:,.0f}   p90 {rd.p90:,.0f}   p99 {rd.p99:,.0f}   max {rd.max:,}" if rd.max is not None
             else "  p50, p90, p99, max: undefined (no row is accessed twice)"),
        ]
    return "\n".join(lines) + "\n"
