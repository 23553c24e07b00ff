"""Checks of input files before a loader trusts them.

* They must be regular files: ``open()`` of a FIFO blocks until some other
  process opens it for writing (a command that hangs forever), and a device
  such as ``/dev/zero`` never ends (a reader that fills memory). A user who
  names one as a trace, config, array, mapping, model or checkpoint gets a
  typed error naming the path instead.
* A torch file (a zip) must pass its CRC-32 checks: ``torch.load`` does not
  check them, so a flipped bit in a tensor's bytes loaded as a different
  tensor (a different trace, model or checkpoint), silently.
"""

from __future__ import annotations

import os
import stat
import struct
import tokenize
import zipfile
import zlib
from collections.abc import Callable

from embstore.errors import InvalidInputError

__all__ = ["NPY_READ_ERRORS", "check_regular_file", "not_a_regular_file", "zip_crc_failure"]

# What numpy and zipfile raise on damaged bytes: a flipped bit in a zip entry's compression method is a
# NotImplementedError, in a .npy header a tokenize.TokenError or SyntaxError, in deflated data a zlib.error.
NPY_READ_ERRORS = (zipfile.BadZipFile, EOFError, OSError, ValueError, KeyError, NotImplementedError,
                   tokenize.TokenError, SyntaxError, zlib.error, struct.error,
                   RuntimeError)  # RuntimeError: the entry's "encrypted" flag bit set

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def not_a_regular_file(path: str | os.PathLike[str]) -> str | None:
    """What ``path`` is (``"a FIFO (named pipe)"``, ``"a directory"``, ..) when it exists but is not a regular
    file (a symlink counts as what it points to); None for a regular file, and for a path that cannot be
    stat'ed (missing, no permission): the loader's own ``open()`` then reports that in its words."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):  # ValueError: a NUL byte in the path
        return None
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def check_regular_file(path: str | os.PathLike[str], what: str,
                       error: Callable[[str], Exception] = InvalidInputError) -> None:
    """Raise ``error("<what> '<path>' is a FIFO (named pipe), not a regular file")`` unless ``path`` is a
    regular file or cannot be stat'ed (see :func:`not_a_regular_file`)."""
    kind = not_a_regular_file(path)
    if kind is not None:
        raise error(f"{what} {str(path)!r} is {kind}, not a regular file")


def zip_crc_failure(path: str | os.PathLike[str]) -> str | None:
    """Why the zip archive ``path`` (torch's format since 1.6) fails its CRC-32 checks, or None when they
    pass or it is no zip (torch's legacy format has none). One read of every member: the price of
    knowing that the tensors loaded are the tensors saved."""
    if not zipfile.is_zipfile(path):
        return None
    with zipfile.ZipFile(path) as z:  # BadZipFile, OSError: damaged beyond the CRCs, for the caller
        bad = z.testzip()
    return None if bad is None else f"member {bad!r} fails its CRC-32 check"
