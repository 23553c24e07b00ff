"""`embstore` command line: one verb per job, each with its own --help.

Verb groups live in ``embstore/commands/``; each module exposes
``register(subparsers)`` and sets ``func`` on its parsers. User errors
(embstore's typed errors, missing files) print one line and exit with 2;
failures of the machine (a tier's I/O error, a full disk, no memory) one line
and 1.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import sys

from embstore.errors import EmbstoreError, TierIOError

COMMAND_MODULES = (
    "embstore.commands.store_cmds",
    "embstore.commands.trace_cmds",
    "embstore.commands.hash_cmds",
    "embstore.commands.bench_cmds",
    "embstore.commands.demo_cmds",
    "embstore.commands.serve_cmds",
    "embstore.commands.replay_cmds",
    "embstore.commands.train_cmds",
)

# OSErrors that mean a bad path on the command line, not a failing machine (exit 2, not 1)
INPUT_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EEXIST,
                          errno.ENAMETOOLONG, errno.ELOOP})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="embstore",
        description="A tiered embedding store for recommendation models: device, DRAM, mmap, "
                    "SSD (io_uring) and RocksDB tiers with write-back caching.",
        epilog="Run 'embstore VERB --help' for the options of a verb.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # a verb group not built yet
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose + 1, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    verb = " ".join(v for v in (args.verb, getattr(args, f"{args.verb}_verb", None)) if v)  # "trace gen"
    try:
        return int(args.func(args) or 0)
    except TierIOError as exc:  # a tier's storage failed (EIO, a full disk): an EmbstoreError, but no bad input
        return _machine_failure(verb, exc)
    except EmbstoreError as exc:
        print(f"embstore {verb}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.errno in INPUT_ERRNOS:  # a missing file, a directory named as a file, a path too long
            print(f"embstore {verb}: error: {exc}", file=sys.stderr)
            return 2
        return _machine_failure(verb, exc)  # the machine's fault, not the input's: a full disk, an I/O error
    except MemoryError as exc:
        return _machine_failure(verb, f"out of memory{f' ({exc})' if str(exc) else ''}")
    except KeyboardInterrupt:
        print(f"embstore {verb}: interrupted", file=sys.stderr)
        return 130


def _machine_failure(verb: str, exc: BaseException | str) -> int:
    """One line and exit status 1; ``-v`` logs the traceback."""
    logging.getLogger("embstore.cli").debug("%s failed", verb, exc_info=True)
    print(f"embstore {verb}: error: {exc}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
