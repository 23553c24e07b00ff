"""The interface every raw-id -> row mapper offers the store, and shared checks.

A mapper turns raw int64 ids into rows of one physical table::

    mapper(ids)                (n,) int64 in [0, num_rows)        rows_per_id == 1
                               (n, 2) int64 in [0, num_rows)      rows_per_id == 2 (QR)
    mapper.physical_dim(dim)   columns of one physical row
    mapper.combine(parts)      (n, rows_per_id, physical_dim) -> (n, dim)

The store gathers ``parts`` for every id's rows and hands them to ``combine``;
``combine`` uses plain arithmetic and indexing only, so it works on numpy
arrays and on torch tensors alike, and autograd flows through it in training.
"""

from __future__ import annotations

import abc
import operator
from typing import Any

import numpy as np

from embstore.arrays import Ids
from embstore.errors import ConfigError, InvalidInputError


class Mapper(abc.ABC):
    """Raw ids -> physical rows. Subclasses set ``num_rows`` and ``rows_per_id``."""

    num_rows: int
    rows_per_id: int = 1

    @abc.abstractmethod
    def __call__(self, ids: Ids) -> np.ndarray:
        """Rows of ``ids``: shape (n,) or (n, rows_per_id), int64 in [0, num_rows)."""

    @property
    def mapping_bytes(self) -> int:
        """Bytes the mapping itself occupies (counted toward the table's memory)."""
        return 0

    def physical_dim(self, dim: int) -> int:
        """Columns of a physical row for a logical embedding of ``dim`` columns."""
        return check_int(dim, "dim", lo=1)

    def combine(self, parts: Any) -> Any:
        """(n, rows_per_id, physical_dim) -> (n, dim); numpy or torch, differentiable."""
        return parts.reshape(parts.shape[0], parts.shape[1] * parts.shape[2])  # no -1: n may be 0


def check_int(value: Any, name: str, lo: int | None = None, hi: int | None = None) -> int:
    """An integer argument (numpy ints accepted, bools refused) within [lo, hi]."""
    if isinstance(value, (bool, np.bool_)):
        raise ConfigError(name, f"must be an integer, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise ConfigError(name, f"must be an integer, got {value!r}") from None
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        lo_s = "-inf" if lo is None else str(lo)
        hi_s = "inf" if hi is None else str(hi)
        raise ConfigError(name, f"must be in [{lo_s}, {hi_s}], got {v}")
    return v


def check_fraction(value: Any, name: str, lo: float = 0.0, hi: float = 1.0) -> float:
    """A float argument within [lo, hi]."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ConfigError(name, f"must be a number in [{lo}, {hi}], got {value!r}")
    v = float(value)
    if not lo <= v <= hi:
        raise ConfigError(name, f"must be in [{lo}, {hi}], got {value!r}")
    return v


def as_id_array(ids: Any) -> Ids:
    """Validate mapper input: a 1-D int64 numpy array (the store converts torch)."""
    if not isinstance(ids, np.ndarray):
        raise InvalidInputError(f"ids must be a numpy.ndarray of int64, got {type(ids).__name__}")
    if ids.ndim != 1:
        raise InvalidInputError(f"ids must be 1-D, got shape {ids.shape}")
    if ids.dtype != np.int64:
        if ids.size == 0 and ids.dtype.kind in "iu":
            return np.empty(0, np.int64)
        raise InvalidInputError(f"ids must have dtype int64, got {ids.dtype}")
    return np.ascontiguousarray(ids)


MAX_ROWS = 2**63 - 1
