"""argparse ``type=`` converters shared by the verbs: a bad value is a one-line usage error."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from embstore.config import parse_bytes
from embstore.errors import ConfigError


def _integer(text: str, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _integer(text, 1, "a positive integer")


def nonneg_int(text: str) -> int:
    return _integer(text, 0, "an integer >= 0")


def port_number(text: str) -> int:
    value = _integer(text, 0, "a TCP port in 0-65535")
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port in 0-65535, got {value}")
    return value


def nonneg_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def share(text: str) -> float:
    """A probability or fraction: a number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def byte_size(text: str) -> int:
    """``2GiB``, ``256MiB``, ``6400``."""
    try:
        return parse_bytes(text, "size")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(exc.reason) from None


_ZERO_SIZE = re.compile(r"\s*0+(\.0*)?\s*([KMGT]i)?B?\s*", re.IGNORECASE)


def nonneg_byte_size(text: str) -> int:
    """A size like :func:`byte_size`, where 0 (none of it, or off) is allowed too: ``parse_bytes``
    refuses sizes that are not positive."""
    if _ZERO_SIZE.fullmatch(text):
        return 0
    return byte_size(text)


def unwritable(path: str | os.PathLike[str]) -> str | None:
    """Why no file can be created at ``path`` although its directory exists (a read-only file system, no
    write permission), or None. The verbs check their outputs with this before work that may take
    minutes, not when they write (and a read-only file system was then exit 1, as if the machine failed)."""
    parent = Path(path).resolve().parent
    if not parent.is_dir() or os.access(parent, os.W_OK | os.X_OK):
        return None  # a missing directory is each verb's own check (and message)
    try:
        if os.statvfs(parent).f_flag & os.ST_RDONLY:
            return f"{parent} is on a read-only file system"
    except OSError:
        pass
    return f"no permission to write in {parent}"
