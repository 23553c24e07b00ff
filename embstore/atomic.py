"""Whole-file replacement that a crash cannot tear: the old file or the new one, never a mix.

Every file embstore writes in one piece (manifests, configs, traces, learned
hashes, cost models, model weights, checkpoints) goes through here: a temp file
beside the target, fsync, ``os.replace``, fsync of the directory (without it
the rename itself may not survive a power cut). The tiers keep their own
variants, which report failures as tier I/O errors.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_file", "atomic_write", "fsync_dir"]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the directory entries of ``path`` (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """A binary file to write; on a clean exit it replaces ``path`` durably, on an error it is removed.

    An ``OSError`` names ``path`` (not the temp file), e.g. when its directory
    does not exist or ``path`` is a directory. The temp file's name is unique
    per thread, so threads writing the same target never share (and tear) it.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.{threading.get_ident()}")
    try:
        f = open(tmp, "wb")
    except OSError as exc:
        raise type(exc)(exc.errno, exc.strerror, str(path)) from None
    try:
        with f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        try:
            os.replace(tmp, path)
        except OSError as exc:
            raise type(exc)(exc.errno, exc.strerror, str(path)) from None
        fsync_dir(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` with ``data`` (see :func:`atomic_file`). Any ``OSError`` names ``path``: here every
    write is to it (a full disk's one line then says which file could not be written)."""
    try:
        with atomic_file(path) as f:
            f.write(data)
    except OSError as exc:
        if exc.filename is not None or exc.errno is None:
            raise
        raise type(exc)(exc.errno, exc.strerror, str(path)) from None
