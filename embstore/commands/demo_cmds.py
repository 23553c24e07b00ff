"""`embstore demo`: the main job end to end on a synthetic click set (see ``embstore/demo.py``)."""

from __future__ import annotations

import argparse

from embstore.commands.argtypes import positive_int


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="trace, tune, train, serve and score end to end on synthetic clicks",
        description="On a synthetic click set: record an access trace of a short run and tune tiers and "
                    "policies for a small DRAM budget; train a DLRM out of a store whose largest table is "
                    "several times that budget (DRAM cache over an io_uring SSD home, look-ahead prefetch), "
                    "printing AUC, log loss and NE; serve the trained store on a loopback port, check that "
                    "lookups and pooled bags through the client equal direct reads, and score held-out "
                    "samples with the served model. Needs nothing external; about 80 s on two cores.")
    p.add_argument("--out", default=None, help="folder for the store, trace, tuned TOML, curves and metrics "
                                               "(default: a new temp folder)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (about ten seconds)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="training steps (default 1200, or 60 with --quick)")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    """0 when every served answer matched the store, else 1: the demo is also an end-to-end check."""
    import sys

    from embstore.demo import run

    served = run(args.out, quick=args.quick, steps=args.steps)["served"]
    failed = [k for k in ("rows_equal", "pooled_equal", "scores_equal") if not served[k]]
    if failed:
        print(f"embstore demo: error: served answers differ from the store ({', '.join(failed)} is false)",
              file=sys.stderr)
        return 1
    return 0
