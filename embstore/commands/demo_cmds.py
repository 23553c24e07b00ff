"""`embstore demo`: the main job end to end on embedded defaults."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the store end to end on embedded defaults",
                       description="Create a store from an embedded config (device and DRAM caches over an "
                                   "io_uring SSD home, and a sparse RocksDB table), import rows, look them "
                                   "up, update, reopen and print per-tier statistics. Needs nothing external.")
    p.add_argument("--out", default=None, help="folder for the store and files (default: a new temp folder)")
    p.add_argument("--rows", type=int, default=200_000, help="rows of the demo table (default 200000)")
    p.add_argument("--batches", type=int, default=50, help="lookup batches to run (default 50)")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from embstore.demo import run

    run(args.out, rows=args.rows, batches=args.batches)
    return 0
