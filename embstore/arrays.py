"""Array type aliases and the validation every public entry point shares.

A jagged batch of bags, as ``lookup_pooled`` takes it::

    ids     = [ 7, 3, 3,  9, 1 ]       (int64, every bag's ids back to back)
    offsets = [ 0,       3, 3,    5 ]  (int64, num_bags + 1 entries)
               bag 0: [7, 3, 3]  bag 1: []  bag 2: [9, 1]
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import numpy.typing as npt

from embstore.errors import IdOutOfRangeError, InvalidInputError, InvalidOffsetsError, InvalidRowsError

Ids = npt.NDArray[np.int64]  # (n,) row or raw ids
Mask = npt.NDArray[np.bool_]  # (n,) found / present
RowBytes = npt.NDArray[np.uint8]  # (n, row_bytes) encoded rows as a tier stores them
Rows = npt.NDArray[np.float32]  # (n, dim) decoded rows
Offsets = npt.NDArray[np.int64]  # (num_bags + 1,)

HUGE_PAGE = 2 << 20


def aligned_zeros(shape: tuple[int, ...], dtype: Any, align: int | None = None) -> np.ndarray:
    """Zeroed array whose first byte sits on an ``align`` boundary (default: 2 MiB for arrays of
    at least that size, else a cache line).

    numpy's own buffers start 16 bytes past a page, so a 256-byte row straddles
    five cache lines instead of four and a gather of random rows moves 25% more
    memory (twice the time in torch's embedding_bag here, see BENCHMARKS.md).
    Aligning to 2 MiB also lets the kernel back the slab with whole huge pages.
    The pages stay untouched (calloc) until written.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if align is None:
        align = HUGE_PAGE if nbytes >= HUGE_PAGE else 64
    raw = np.zeros(nbytes + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _to_numpy(x: Any, what: str) -> tuple[np.ndarray, bool]:
    """(array, was_torch). Accepts numpy arrays and torch tensors only."""
    if isinstance(x, np.ndarray):
        return x, False
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        torch = None
    if torch is not None and isinstance(x, torch.Tensor):
        if x.dtype == torch.bfloat16:  # numpy has no bfloat16: widen it (exactly) rather than fail in torch
            x = x.float()
        try:
            return x.detach().cpu().numpy(), True
        except TypeError as exc:  # e.g. float8, complex32: dtypes numpy cannot hold
            raise InvalidInputError(f"{what} has torch dtype {x.dtype}, which this API does not take") from exc
    raise InvalidInputError(f"{what} must be a numpy.ndarray or torch.Tensor, got {type(x).__name__}")


def as_ids(ids: Any, what: str = "ids") -> tuple[Ids, bool]:
    """Validate a 1-D int64 id array; returns (contiguous int64 numpy array, was_torch)."""
    arr, was_torch = _to_numpy(ids, what)
    if arr.ndim != 1:
        raise InvalidInputError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.dtype != np.int64:
        if arr.dtype.kind in "iu" and arr.size == 0:
            arr = arr.astype(np.int64)
        else:
            raise InvalidInputError(f"{what} must have dtype int64, got {arr.dtype}")
    return _forward(np.ascontiguousarray(arr)), was_torch


def _forward(arr: np.ndarray) -> np.ndarray:
    """``arr`` (C-contiguous) with no negative stride. numpy calls a view with a negative stride along a
    dimension of length 1 (``ids[::-1]`` of one id, ``rows[::-1]`` of one row) contiguous and
    ``ascontiguousarray`` keeps it, but ``torch.from_numpy`` refuses it: lookups on a resident table and
    writes into a device tier raised torch's ValueError, the latter after the cache had already given
    the row a slot (that row then read another row's bytes)."""
    return arr.copy() if arr.ndim and min(arr.strides) < 0 else arr


def check_id_range(ids: Ids, limit: int | None, what: str, hint: str = "") -> None:
    """IdOutOfRangeError naming ``what`` unless every id lies in ``[0, limit)`` (``limit`` None: any id >= 0)."""
    if not len(ids):
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or (limit is not None and hi >= limit):
        bad = lo if lo < 0 else hi
        raise IdOutOfRangeError(f"{what}: id {bad} outside [0, {limit if limit is not None else '2**63'}){hint}")


def as_offsets(offsets: Any, num_ids: int) -> Offsets:
    """Validate bag offsets against ``num_ids`` (see the drawing above)."""
    arr, _ = _to_numpy(offsets, "offsets")
    if arr.ndim != 1 or arr.dtype != np.int64:
        raise InvalidOffsetsError(f"offsets must be a 1-D int64 array, got {arr.dtype} of shape {arr.shape}")
    if len(arr) < 1:
        raise InvalidOffsetsError("offsets needs num_bags + 1 entries (at least [0])")
    if arr[0] != 0:
        raise InvalidOffsetsError(f"offsets[0] must be 0, got {int(arr[0])}")
    if arr[-1] != num_ids:
        raise InvalidOffsetsError(f"offsets[-1] must equal len(ids) = {num_ids}, got {int(arr[-1])}")
    i = _first_decrease(arr)
    if i >= 0:
        raise InvalidOffsetsError(f"offsets must be non-decreasing; offsets[{i}] = {int(arr[i])} > "
                                  f"offsets[{i + 1}] = {int(arr[i + 1])}")
    return _forward(np.ascontiguousarray(arr))


@numba.njit(cache=True, nogil=True)
def _first_decrease(offsets: Offsets) -> int:
    """Index i of the first ``offsets[i] > offsets[i + 1]``, or -1 (one pass, no temporaries: this
    check ran on every pooled lookup and cost as much as the rest of its validation)."""
    for i in range(offsets.shape[0] - 1):
        if offsets[i + 1] < offsets[i]:
            return i
    return -1


def as_rows(rows: Any, n: int, dim: int) -> tuple[Rows, bool]:
    """Validate float rows of shape (n, dim): float32 (float16/float64 accepted), all finite."""
    arr, was_torch = _to_numpy(rows, "rows")
    if arr.ndim != 2 or arr.shape != (n, dim):
        raise InvalidRowsError(f"rows must have shape ({n}, {dim}), got {tuple(arr.shape)}")
    if arr.dtype.kind != "f":
        raise InvalidRowsError(f"rows must be floating point (float32), got {arr.dtype}")
    with np.errstate(over="ignore"):  # a value beyond float32 becomes inf and is refused just below
        arr = _forward(np.ascontiguousarray(arr, dtype=np.float32))
    if arr.size and not np.isfinite(arr).all():
        bad = int(np.argwhere(~np.isfinite(arr))[0][0])
        raise InvalidRowsError(f"rows must be finite; row {bad} holds NaN or inf")
    return arr, was_torch
