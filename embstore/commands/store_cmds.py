"""Verbs that manage a store: create, import, export, stats."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import embstore
from embstore.commands.argtypes import nonneg_int, unwritable
from embstore.progress import progress_bar
from embstore.bulk import export_rows, import_rows, npy_rows
from embstore.errors import InvalidInputError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("create", help="create a store from a TOML config",
                       description="Create a new store directory from a TOML config ([[table]] sections; "
                                   "see the README's configuration reference).")
    p.add_argument("store", help="directory to create (must not exist, or be empty)")
    p.add_argument("--config", required=True, help="TOML file with the tables and their tiers")
    p.set_defaults(func=cmd_create)

    p = sub.add_parser("import", help="bulk-load rows of a table from a .npy file",
                       description="Write physical rows START.. of TABLE (after hashing, as export writes "
                                   "them) from FILE.npy, a float array of shape (n, dim). The whole file is "
                                   "checked (shape, dtype, NaN/inf) before any row is written; the store is "
                                   "flushed at the end.")
    p.add_argument("store", help="store directory (made with 'embstore create')")
    p.add_argument("table", help="name of the table to write")
    p.add_argument("file", help=".npy file of float rows, shape (n, dim)")
    p.add_argument("--start", type=nonneg_int, default=0, help="first physical row to write (default 0)")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("export", help="dump the rows of a table to a .npy file",
                       description="Write rows 0..N-1 of TABLE (physical rows, after hashing) to FILE.npy as "
                                   "float32, including never-written rows at their initial values.")
    p.add_argument("store", help="store directory (made with 'embstore create')")
    p.add_argument("table", help="name of the table to dump")
    p.add_argument("file", help="output .npy file (replaced only once complete)")
    p.add_argument("--rows", type=nonneg_int, default=None, metavar="N",
                   help="export only the first N rows (default: all)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("stats", help="print a store's tables and per-tier statistics",
                       description="Open the store and print each table's shape and, per tier, its resident "
                                   "and capacity rows. The hit, miss, eviction and byte counters count this "
                                   "process's own work since the open (0 unless the open replayed a write-ahead "
                                   "log); a running server's are at GET /v1/tables/NAME and /metrics (and it "
                                   "holds the store open: stop it before running this).")
    p.add_argument("store", help="store directory (made with 'embstore create')")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_stats)


def cmd_create(args: argparse.Namespace) -> int:
    with embstore.create(args.store, args.config) as store:
        for t in store.tables.values():
            print(f"created {t!r}")
    print(f"store ready at {args.store}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    with embstore.open(args.store) as store:
        table = store[args.table]
        with progress_bar(total=npy_rows(args.file), desc=f"import {table.name}", unit="row",
                          unit_scale=True) as bar:
            n = import_rows(table, args.file, start=args.start, progress=bar.update)
    print(f"imported {n} rows into {args.table}")
    return 0


def check_export_target(store: str, file: str) -> None:
    """Refuse, before any row is read, a target that cannot be written or that is one of the store's own
    files (replacing its manifest or a tier file would destroy the store)."""
    out = Path(file)
    if out.is_dir():
        raise InvalidInputError(f"{file} is a directory; name the .npy file to write")
    if not out.parent.is_dir():
        raise InvalidInputError(f"cannot write {file}: {out.parent} is not a directory")
    if (why := unwritable(out)) is not None:
        raise InvalidInputError(f"cannot write {file}: {why}")
    if out.resolve().is_relative_to(Path(store).resolve()):
        raise InvalidInputError(f"{file} is inside the store {store}; export to a file outside it")


def cmd_export(args: argparse.Namespace) -> int:
    with embstore.open(args.store) as store:
        check_export_target(args.store, args.file)
        table = store[args.table]
        total = table.num_rows if args.rows is None else args.rows
        with progress_bar(total=total, desc=f"export {table.name}", unit="row", unit_scale=True) as bar:
            n = export_rows(table, args.file, rows=args.rows, progress=bar.update)
    print(f"exported {n} rows of {args.table} to {args.file}")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    with embstore.open(args.store) as store:
        out = {name: {"num_embeddings": t.config.num_embeddings, "dim": t.dim, "dtype": t.config.dtype.value,
                      "tiers": t.stats()} for name, t in store.tables.items()}
    if args.json:
        print(json.dumps(out))
    else:
        for name, info in out.items():
            print(f"{name}: {info['num_embeddings']} x {info['dim']} {info['dtype']}")
            print(format_tier_stats(info["tiers"]))
    return 0


def format_tier_stats(stats: dict[str, dict[str, int]]) -> str:
    """A small aligned table of per-tier counters."""
    cols = ["hits", "misses", "evictions", "bytes_read", "bytes_written", "resident_rows", "capacity_rows"]
    lines = ["  " + "tier".ljust(10) + "".join(c.rjust(15) for c in cols)]
    for tier, s in stats.items():
        lines.append("  " + tier.ljust(10) + "".join(str(s[c]).rjust(15) for c in cols))
    return "\n".join(lines)
