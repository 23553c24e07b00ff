"""Row formats: how a table's float32 rows become the bytes tiers store.

Tiers store opaque fixed-width byte rows; a :class:`RowFormat` converts at the
table boundary, so every tier of a table holds the same encoding and lookups
always return float32::

    float32: [ dim x f32 ]                         4*dim bytes
    float16: [ dim x f16 ]                         2*dim bytes
    int8:    [ dim x u8 | scale f32 | bias f32 ]   dim + 8 bytes   (x = q * scale + bias)

Optimizer state (training) is appended as ``state_dim`` float32 columns so one
tier read or write moves a row and its state together.

Never-written rows read as :func:`initial_rows`: a counter-based hash of
(seed, row, column), so a fresh table is repeatable without storing anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from embstore.arrays import Ids, RowBytes, Rows
from embstore.config import InitConfig, InitKind, RowDType
from embstore.errors import InvalidRowsError
from embstore.kernels import kernel_threads

_F32_MAX = float(np.finfo(np.float32).max)
_MIN_F32_SPREAD = 255.0 * 2.0**-125  # below this, 1 / (spread / 255) is no finite float32 (subnormal rows)
_MIN_SUBNORMAL = np.float32(2.0**-149)  # the smallest positive float32; as a scale it stores such rows exactly
_SAFE_SCALE, _SAFE_BIAS = 1e36, 1e37  # int8 rows within these decode in float32: 255 * 1e36 + 1e37 < 3.4e38
FLOAT16_LIMIT = 65520.0  # the smallest magnitude that float16 rounds to inf (its largest finite value is 65504)


@dataclass(frozen=True)
class RowFormat:
    """Encoding of one table's rows (plus optional float32 optimizer state)."""

    dim: int
    dtype: RowDType = RowDType.FLOAT32
    state_dim: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", RowDType(self.dtype))

    @property
    def embedding_bytes(self) -> int:
        if self.dtype is RowDType.FLOAT32:
            return 4 * self.dim
        if self.dtype is RowDType.FLOAT16:
            return 2 * self.dim
        return self.dim + 8

    @property
    def row_bytes(self) -> int:
        return self.embedding_bytes + 4 * self.state_dim

    def check(self, rows: Rows) -> None:
        """InvalidRowsError unless every value of finite float32 ``rows`` fits this format: a float16
        table would otherwise store a value beyond +-65504 as inf (int8 takes any finite row)."""
        if self.dtype is RowDType.FLOAT16 and rows.size:
            if float(np.abs(rows).max()) >= FLOAT16_LIMIT:
                row, col = np.argwhere(np.abs(rows) >= FLOAT16_LIMIT)[0]
                raise InvalidRowsError(f"rows must fit float16 (|x| < 65520, which rounds to its largest value, "
                                       f"65504) in this float16 table; "
                                       f"row {row} holds {float(rows[row, col]):g}")

    def encode(self, rows: Rows, state: np.ndarray | None = None) -> RowBytes:
        """float32 (n, dim) [+ float32 (n, state_dim)] -> uint8 (n, row_bytes)."""
        n = rows.shape[0]
        e = self.embedding_bytes
        if self.dtype is RowDType.FLOAT32 and not self.state_dim and rows.dtype == np.float32 \
                and rows.flags.c_contiguous:
            return rows.view(np.uint8).reshape(n, e)  # the bytes as they are: no copy (callers only read it)
        out = np.empty((n, self.row_bytes), dtype=np.uint8)
        if self.dtype is RowDType.FLOAT32:
            out[:, :e] = np.ascontiguousarray(rows, dtype=np.float32).view(np.uint8).reshape(n, e)
        elif self.dtype is RowDType.FLOAT16:
            out[:, :e] = np.ascontiguousarray(rows, dtype=np.float16).view(np.uint8).reshape(n, e)
        else:
            _encode_int8(np.ascontiguousarray(rows, dtype=np.float32), out)
        if self.state_dim:
            st = np.zeros((n, self.state_dim), np.float32) if state is None else state
            out[:, e:] = np.ascontiguousarray(st, dtype=np.float32).view(np.uint8).reshape(n, 4 * self.state_dim)
        return out

    def decode(self, data: RowBytes) -> Rows:
        """uint8 (n, row_bytes) -> float32 (n, dim)."""
        n = data.shape[0]
        e = self.embedding_bytes
        if self.dtype is RowDType.FLOAT32:
            if data.flags.c_contiguous and self.state_dim == 0:
                return data.view(np.float32).reshape(n, self.dim)
            return np.ascontiguousarray(data[:, :e]).view(np.float32).reshape(n, self.dim)
        if self.dtype is RowDType.FLOAT16:
            return np.ascontiguousarray(data[:, :e]).view(np.float16).reshape(n, self.dim).astype(np.float32)
        out = np.empty((n, self.dim), np.float32)
        _decode_int8(np.ascontiguousarray(data), out, self.dim)
        return out

    def decode_state(self, data: RowBytes) -> np.ndarray:
        """uint8 (n, row_bytes) -> float32 optimizer state (n, state_dim)."""
        e = self.embedding_bytes
        return np.ascontiguousarray(data[:, e:]).view(np.float32).reshape(data.shape[0], self.state_dim)


@numba.njit(cache=True, nogil=True)
def _encode_int8(rows: np.ndarray, out: np.ndarray) -> None:
    n, dim = rows.shape
    for i in range(n):
        lo = rows[i, 0]
        hi = rows[i, 0]
        for j in range(dim):
            v = rows[i, j]
            lo = min(lo, v)
            hi = max(hi, v)
        spread = hi - lo
        if spread < _F32_MAX and (spread == 0 or spread >= _MIN_F32_SPREAD):  # the common case, in float32
            scale = np.float32(spread / 255.0)
            inv = np.float32(1.0 / scale) if scale > 0 else np.float32(0.0)
            for j in range(dim):
                q = np.float32(np.round((rows[i, j] - lo) * inv))
                out[i, j] = np.uint8(min(max(q, 0.0), 255.0))
        else:  # a spread that overflows float32 (inf), or so small that 1 / scale does: quantize in float64
            scale = np.float32((np.float64(hi) - np.float64(lo)) / 255.0)
            if scale == 0:  # spread / 255 below float32's smallest step: the row is a few of those steps apart
                scale = _MIN_SUBNORMAL
            if np.float64(scale) * 255.0 < np.float64(hi) - np.float64(lo):
                # rounded down (a subnormal scale is a whole number of 2**-149 steps: 300 steps / 255 -> 1):
                # the top values would need q > 255 and be clamped, far outside the bound; one step up
                # keeps q <= 255 and the error within spread / 510 plus half a step
                scale = np.nextafter(scale, np.float32(np.inf))
            inv64 = 1.0 / np.float64(scale)
            for j in range(dim):
                q64 = np.round((np.float64(rows[i, j]) - np.float64(lo)) * inv64)
                out[i, j] = np.uint8(min(max(q64, 0.0), 255.0))
        hdr = np.empty(2, np.float32)
        hdr[0] = scale
        hdr[1] = lo
        b = hdr.view(np.uint8)
        for j in range(8):
            out[i, dim + j] = b[j]


@numba.njit(cache=True, nogil=True)
def _decode_int8(data: np.ndarray, out: np.ndarray, dim: int) -> None:
    hdr = np.empty(8, np.uint8)
    for i in range(data.shape[0]):
        for j in range(8):
            hdr[j] = data[i, dim + j]
        f = hdr.view(np.float32)
        scale = f[0]
        bias = f[1]
        if scale < _SAFE_SCALE and abs(bias) < _SAFE_BIAS:  # q * scale + bias cannot overflow float32
            for j in range(dim):
                out[i, j] = np.float32(data[i, j]) * scale + bias
        else:  # rows near float32's limits: in float64, clamped, or the rounded scale could carry them to inf
            for j in range(dim):
                v = np.float64(data[i, j]) * np.float64(scale) + np.float64(bias)
                out[i, j] = np.float32(min(max(v, -_F32_MAX), _F32_MAX))


@numba.njit(cache=True, inline="always")
def _mix64(x: np.uint64) -> np.uint64:
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@numba.njit(cache=True, nogil=True, parallel=True)
def _init_kernel(ids: np.ndarray, seed: np.uint64, dim: int, kind: int, scale: np.float32, out: np.ndarray) -> None:
    golden = np.uint64(0x9E3779B97F4A7C15)
    for i in numba.prange(ids.shape[0]):
        base = _mix64(np.uint64(ids[i]) * golden + seed)
        for j in range(dim):
            h = _mix64(base + np.uint64(j) * golden)
            u1 = (np.float64(h >> np.uint64(11)) + 0.5) * (1.0 / 9007199254740992.0)  # (0, 1)
            if kind == 0:  # uniform(-scale, scale)
                out[i, j] = np.float32((2.0 * u1 - 1.0) * scale)
            else:  # normal(0, scale) by Box-Muller on a second draw
                h2 = _mix64(h ^ golden)
                u2 = (np.float64(h2 >> np.uint64(11)) + 0.5) * (1.0 / 9007199254740992.0)
                out[i, j] = np.float32(np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2) * scale)


def initial_rows(init: InitConfig, ids: Ids, dim: int) -> Rows:
    """The value rows ``ids`` have before anyone writes them (deterministic)."""
    out = np.zeros((len(ids), dim), dtype=np.float32)
    if init.kind is InitKind.ZEROS or len(ids) == 0:
        return out
    kind = 0 if init.kind is InitKind.UNIFORM else 1
    with kernel_threads(len(ids)):
        _init_kernel(np.ascontiguousarray(ids, dtype=np.int64), np.uint64(init.seed), dim, kind,
                     np.float32(init.scale), out)
    return out
