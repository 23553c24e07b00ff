"""Every exception embstore raises on purpose.

Backend failures (RocksDB, io_uring errno, file system) are translated at the
tier boundary with ``raise ... from exc`` so callers only ever catch these::

    EmbstoreError
    ├── ConfigError (ValueError)            bad or unknown config key; names the key
    ├── InvalidInputError (ValueError)      caller-supplied arrays are wrong
    │   ├── IdOutOfRangeError               an id outside [0, num_embeddings)
    │   ├── InvalidRowsError                wrong shape, dtype or non-finite rows
    │   └── InvalidOffsetsError             offsets that do not describe bags
    ├── UnknownTableError (KeyError)        names the known tables
    ├── TableExistsError                    create_table with a taken name
    ├── StoreError                          the store directory itself
    │   ├── StoreNotFoundError (FileNotFoundError)
    │   ├── StoreExistsError (FileExistsError)
    │   ├── CorruptStoreError               manifest/config/tier files unreadable
    │   ├── StoreClosedError                use after close()
    │   └── StoreInUseError                 open elsewhere (another process or Store)
    └── TierIOError (OSError)               a tier's read or write failed (EIO, ...)
        └── DiskFullError                   ENOSPC / EDQUOT
"""

from __future__ import annotations

import errno as _errno


class EmbstoreError(Exception):
    """Base of every error embstore raises deliberately."""


class ConfigError(EmbstoreError, ValueError):
    """A configuration value is unknown, missing or impossible."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        self.reason = message  # without the key: a command-line flag's error names the flag instead
        # key "config" is the whole file (missing, unreadable, not TOML): the message names the file
        super().__init__(message if key == "config" else f"config key {key!r}: {message}")


class InvalidInputError(EmbstoreError, ValueError):
    """Arrays handed to the API are malformed."""


class IdOutOfRangeError(InvalidInputError):
    """An id lies outside ``[0, num_embeddings)`` of an unhashed table."""


class InvalidRowsError(InvalidInputError):
    """Rows of the wrong shape or dtype, or containing NaN/inf."""


class InvalidOffsetsError(InvalidInputError):
    """Offsets that do not start at 0, decrease, or do not end at len(ids)."""


class UnknownTableError(EmbstoreError, KeyError):
    """A table name that the store does not have."""

    def __init__(self, name: str, known: list[str]) -> None:
        self.name = name
        self.known = sorted(known)
        super().__init__(f"no table {name!r}; known tables: {', '.join(self.known) or '(none)'}")

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.args[0]


class TableExistsError(EmbstoreError, ValueError):
    """create_table with a name the store already has."""


class StoreError(EmbstoreError):
    """Problems with the store directory as a whole."""


class StoreNotFoundError(StoreError, FileNotFoundError):
    """open() of a path that holds no store."""


class StoreExistsError(StoreError, FileExistsError):
    """create() over an existing store."""


class CorruptStoreError(StoreError):
    """A manifest, config or tier file that cannot be read back."""


class StoreClosedError(StoreError):
    """An operation on a store or table after close()."""


class StoreInUseError(StoreError):
    """open() or create() of a store that another open Store holds (in this process or another)."""


class TierIOError(EmbstoreError, OSError):
    """A tier could not read or write its backing storage.

    ``final`` is True when no retry in this process can succeed: a data sync of the tier failed, and
    Linux forgets such a failure once reported (``tiers/base.py``'s ``SyncGuard``). Only closing the
    store and reopening it (its write-ahead log replaying acknowledged writes) recovers.
    """

    final = False

    def __init__(self, tier: str, operation: str, err: int | None, detail: str = "") -> None:
        name = _errno.errorcode.get(err, "?") if err else "?"
        msg = f"{tier} tier: {operation} failed ({name}: {detail or _strerror(err)})"
        super().__init__(err or 0, msg)
        self.tier = tier
        self.operation = operation

    def __str__(self) -> str:
        return self.args[1]


class DiskFullError(TierIOError):
    """No space left on the device holding a tier."""


def _strerror(err: int | None) -> str:
    import os

    return os.strerror(err) if err else "unknown error"


def tier_io_error(tier: str, operation: str, exc: BaseException) -> TierIOError:
    """Translate a backend exception into the typed error (ENOSPC -> DiskFullError)."""
    err = getattr(exc, "errno", None)
    if err is None:
        text = str(exc)
        if "No space left" in text or "ENOSPC" in text:
            err = _errno.ENOSPC
        elif "Input/output error" in text or "EIO" in text:
            err = _errno.EIO
    cls = DiskFullError if err in (_errno.ENOSPC, _errno.EDQUOT) else TierIOError
    return cls(tier, operation, err, str(exc))
