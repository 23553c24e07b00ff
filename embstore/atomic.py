"""Whole-file replacement that a crash cannot tear: the old file or the new one, never a mix.

Every file embstore writes in one piece (manifests, configs, traces, learned
hashes, cost models, model weights, checkpoints) goes through here: a temp file
beside the target, fsync, ``os.replace``, fsync of the directory (without it
the rename itself may not survive a power cut). The tiers keep their own
variants, which report failures as tier I/O errors.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_file", "atomic_write", "copy_tree_durably", "fsync_dir"]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the directory entries of ``path`` (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_tree_durably(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    """``shutil.copytree`` whose result survives a power cut: copytree syncs nothing, so a marker written
    after it (a checkpoint's ``latest``) could name a copy whose files come back empty. Every copied file
    and folder is fsynced, deepest first, then ``target``'s own entry in its parent."""
    shutil.copytree(source, target)
    for folder, _, files in os.walk(target, topdown=False):
        for name in files:
            path = os.path.join(folder, name)
            if os.path.islink(path):
                continue
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(folder)
    fsync_dir(Path(target).parent)


@contextmanager
def atomic_file(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """A binary file to write; on a clean exit it replaces ``path`` durably, on an error it is removed.

    An ``OSError`` without a file name names ``path`` (not the temp file): a missing directory, ``path``
    being a directory, a full disk in the caller's writes or in the final flush and fsync. One that names
    its own file (another file the caller reads) is left as it is. The temp file's name is unique per
    thread, so threads writing the same target never share (and tear) it.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.{threading.get_ident()}")
    with _naming(path, always=True):
        f = open(tmp, "wb")
    try:
        with _naming(path):
            with f:
                yield f
                f.flush()
                os.fsync(f.fileno())
        with _naming(path, always=True):
            os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextmanager
def _naming(path: Path, always: bool = False) -> Iterator[None]:
    """Re-raise an ``OSError`` from the block as one naming ``path``: if it names no file, or ``always``
    (the temp file's name would mislead). Only the built-in kinds are rebuilt: a subclass with its own
    constructor (a ``TierIOError`` from a tier read inside the block) already says where it failed, and
    rebuilding it with OSError's arguments raised a TypeError in its place."""
    try:
        yield
    except OSError as exc:
        if exc.errno is None or (exc.filename is not None and not always) or type(exc).__module__ != "builtins":
            raise
        raise type(exc)(exc.errno, exc.strerror, str(path)) from None


def atomic_write(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` with ``data`` (see :func:`atomic_file`)."""
    with atomic_file(path) as f:
        f.write(data)
