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
    add_arguments(p)
    p.set_defaults(func=_run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``embstore train`` and ``python -m embstore.training`` (here, not in the trainer, so that
    ``embstore --help`` does not import torch: 1.4 s of its 2.9 s)."""
    p.add_argument("config", help="TOML with [data], [model], [store] and [schedule]")
    p.add_argument("--out", default="train_out", help="directory for the store, checkpoints, curves.png "
                                                      "and metrics.json (default: train_out)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def _run(args: argparse.Namespace) -> int:
    from embstore.training.distributed import init_from_env
    from embstore.training.trainer import run_from_args
    return run_from_args(args, init_from_env())
