"""`embstore train CONFIG.toml`: train a DLRM out of a tiered store (SPEC section 7)."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "train", help="train a DLRM (data, model, store and schedule in one TOML)",
        description="Train a DLRM whose embedding tables live in an embstore store. Prints progress, and at each "
                    "evaluation AUC, log loss and normalised entropy on the held-out split; writes checkpoints, "
                    "curves.png and metrics.json under --out. For several processes use "
                    "'torchrun --nproc-per-node N -m embstore.training CONFIG.toml'.")
    # no ArgumentDefaultsHelpFormatter: the help texts state their defaults, and it printed
    # '--no-progress ... (default: True)', the store_false dest's value, not what the flag does
    from embstore.training.trainer import add_arguments
    add_arguments(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from embstore.training.distributed import init_from_env
    from embstore.training.trainer import run_from_args
    return run_from_args(args, init_from_env())
