"""Wire formats: pydantic schemas for JSON, raw little-endian arrays for the binary protocol.

Binary protocol (``Content-Type`` / ``Accept: application/octet-stream``):

- ``/lookup`` request body: ``n`` little-endian int64 ids (8 * n bytes).
- ``/pooled`` request body: ``num_bags + 1`` int64 offsets, then the int64 ids
  (``offsets[-1]`` of them); ``num_bags`` and ``mode`` are query parameters::

      POST /v1/tables/t/pooled?num_bags=3&mode=sum
      body (int64 LE): 0 3 3 5 | 7 3 3 9 1        bags [7 3 3] [] [9 1]

- answers: ``n * dim`` little-endian float32 values, row after row, with the
  header ``X-Embedding-Shape: n,dim``.

``/v1/models/{name}/predict`` is JSON only: ``{"dense": [[...] per sample],
"sparse": {"table": [[ids of sample 0], [ids of sample 1], ...], ...}}``, one
bag list per table of the model, answered ``{"scores": [...]}`` (click
probabilities, float32 values written exactly).

JSON answers are ``{"dim": D, "embeddings": [[...], ...]}``; every float32 is
written as the shortest decimal of its exact double value, so JSON and binary
answers decode to the same bits.
"""

from __future__ import annotations

import itertools
import json
from typing import Annotated, Literal

import numpy as np
from fastapi import Request, Response
from pydantic import BaseModel, ConfigDict, Field

from embstore.errors import InvalidInputError, InvalidRowsError
from embstore.server.errors import ApiError

BINARY = "application/octet-stream"
SHAPE_HEADER = "X-Embedding-Shape"
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1

Int64 = Annotated[int, Field(strict=True, ge=I64_MIN, le=I64_MAX)]
Float = Annotated[float, Field(strict=True)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LookupRequest(_Body):
    """Rows of ``ids`` (raw feature values)."""

    ids: list[Int64]


class PooledRequest(_Body):
    """Bags ``ids[offsets[b]:offsets[b+1]]`` pooled by ``mode``."""

    ids: list[Int64]
    offsets: list[Int64]
    mode: Literal["sum", "mean"] | None = None  # None: "sum" (None tells an omitted mode from a given one)


class RowsRequest(_Body):
    """Overwrite the rows of ``ids`` with ``embeddings`` (one row of ``dim`` floats per id)."""

    ids: list[Int64]
    embeddings: list[list[Float]]


class EmbeddingsResponse(BaseModel):
    dim: int
    embeddings: list[list[float]]


class PredictRequest(_Body):
    """Score samples: ``dense`` rows of the model's dense width, and per table one id list per sample."""

    dense: list[list[Float]]
    sparse: dict[str, list[list[Int64]]]


class PredictResponse(BaseModel):
    scores: list[float]


class ModelInfo(BaseModel):
    name: str
    tables: list[str]
    embedding_dim: int
    dense_in_features: int
    interaction: str


class Health(BaseModel):
    status: str


class TableInfo(BaseModel):
    name: str
    num_embeddings: int
    dim: int
    dtype: str


class PooledCacheStats(BaseModel):
    hits: int
    misses: int
    hit_ratio: float
    entries: int
    bytes: int
    capacity_bytes: int


class BatchingStats(BaseModel):
    requests: int
    batches: int


class TableDetail(TableInfo):
    """Metadata, per-tier statistics (as ``Table.stats()``), the pooled-embedding cache and batching."""

    tiers: list[str]
    stats: dict[str, dict[str, int]]
    pooled_cache: PooledCacheStats
    batching: BatchingStats
    lookups: int


# --- request bodies -------------------------------------------------------------------
def is_binary(request: Request) -> bool:
    return request.headers.get("content-type", "").split(";")[0].strip().lower() == BINARY


def _quality(params: list[str]) -> float:
    """The ``q`` of one ``Accept`` media range (1 when absent, 0 when unreadable)."""
    for p in params:
        key, _, value = p.partition("=")
        if key.strip() == "q":
            try:
                q = float(value)
            except ValueError:
                return 0.0
            return q if 0.0 <= q <= 1.0 else 0.0
    return 1.0


def _quality_of(ranges: dict[str, float], media: str) -> float:
    """The ``q`` of ``media``: that of its most specific listed range (RFC 9110: ``type/sub``, then
    ``type/*``, then ``*/*``), 0 when none matches."""
    for key in (media, media.split("/")[0] + "/*", "*/*"):
        if key in ranges:
            return ranges[key]
    return 0.0


def wants_binary(request: Request) -> bool:
    """Whether ``Accept`` asks for binary rows: ``application/octet-stream`` listed with ``q > 0`` and
    not below ``application/json`` (RFC 9110 quality values, where ``*/*`` and ``application/*`` rank
    JSON too; a tie picks binary; wildcards alone and no ``Accept`` give JSON)."""
    accept = request.headers.get("accept", "").lower()
    if BINARY not in accept:  # the common cases cost one substring test
        return False
    ranges: dict[str, float] = {}
    for item in accept.split(","):
        media, *params = item.split(";")
        media = media.strip()
        ranges[media] = max(ranges.get(media, 0.0), _quality(params))
    q_bin = _quality_of(ranges, BINARY)
    return q_bin > 0 and q_bin >= _quality_of(ranges, "application/json")


def _check_count(n: int, max_ids: int, what: str = "ids") -> None:
    """413 beyond ``max_ids``. Bags and samples are held to it too: each is a row of the answer (an
    empty bag costs two bytes of JSON but ``4 * dim`` of answer), so unbounded they let a small body
    ask for gigabytes."""
    if n > max_ids:
        raise ApiError(413, f"{n} {what} in one request; this server allows at most {max_ids} "
                            "(split the request)")


def int64_array(body: bytes, what: str) -> np.ndarray:
    """A binary body as int64 values; its length must be a multiple of 8."""
    if len(body) % 8:
        raise ApiError(400, f"malformed binary body: {what} are little-endian int64, so the body length "
                            f"must be a multiple of 8 bytes, got {len(body)}")
    return np.frombuffer(body, dtype="<i8").astype(np.int64, copy=False)


def parse_lookup(body: bytes, binary: bool, max_ids: int) -> np.ndarray:
    """int64 ids of a ``/lookup`` body."""
    if binary:
        _check_count(len(body) // 8, max_ids)
        return int64_array(body, "ids")
    req = LookupRequest.model_validate_json(body)
    _check_count(len(req.ids), max_ids)
    return np.array(req.ids, dtype=np.int64)


def parse_pooled(body: bytes, binary: bool, max_ids: int, num_bags: int | None,
                 mode: str | None) -> tuple[np.ndarray, np.ndarray, str]:
    """(ids, offsets, mode) of a ``/pooled`` body (offsets are checked by the table)."""
    if binary:
        if num_bags is None:
            raise ApiError(400, "a binary /pooled body needs the query parameter num_bags "
                                "(the body is num_bags + 1 int64 offsets, then the int64 ids)")
        values = int64_array(body, "offsets and ids")
        if len(values) < num_bags + 1:
            raise ApiError(400, f"malformed binary body: num_bags={num_bags} needs {num_bags + 1} offsets, "
                                f"but the body holds only {len(values)} int64 values")
        _check_count(len(values) - num_bags - 1, max_ids)
        _check_count(num_bags, max_ids, "bags")
        return values[num_bags + 1:], values[:num_bags + 1], mode or "sum"
    if num_bags is not None:
        raise ApiError(400, "num_bags is a query parameter of the binary protocol only; "
                            "JSON bodies carry their offsets")
    req = PooledRequest.model_validate_json(body)
    _check_count(len(req.ids), max_ids)
    _check_count(len(req.offsets) - 1, max_ids, "bags")
    if mode is not None and req.mode is None:
        raise ApiError(400, f"mode={mode!r} is a query parameter of the binary protocol only; a JSON body "
                            'carries its own ("mode": "sum" | "mean", default "sum")')
    if mode is not None and mode != req.mode:
        raise ApiError(400, f"mode given twice: {mode!r} in the query and {req.mode!r} in the body")
    return np.array(req.ids, dtype=np.int64), np.array(req.offsets, dtype=np.int64), req.mode or "sum"


def parse_rows(body: bytes, max_ids: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, float32 rows) of a ``PUT .../rows`` body; shapes are checked here (422)."""
    req = RowsRequest.model_validate_json(body)
    _check_count(len(req.ids), max_ids)
    n = len(req.ids)
    if len(req.embeddings) != n:
        raise InvalidRowsError(f"embeddings must hold one row per id: {n} ids but {len(req.embeddings)} rows")
    try:
        with np.errstate(over="ignore"):
            rows = np.array(req.embeddings, dtype=np.float32).reshape(n, -1) if n else \
                np.zeros((0, dim), np.float32)
    except ValueError:
        raise InvalidRowsError(f"every embedding row must have dim = {dim} values; rows differ in length") \
            from None
    if rows.shape != (n, dim):
        raise InvalidRowsError(f"embeddings must have shape ({n}, {dim}) (one row of dim = {dim} per id), "
                               f"got ({n}, {rows.shape[1]})")
    if rows.size and not np.isfinite(rows).all():
        bad = int(np.argwhere(~np.isfinite(rows))[0][0])
        raise InvalidRowsError(f"embeddings must be finite float32 values; row {bad} holds NaN, inf or a "
                               "value beyond float32's range")
    return np.array(req.ids, dtype=np.int64), rows


def parse_predict(body: bytes, max_ids: int, tables: tuple[str, ...], width: int
                  ) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """(dense float32 (B, width), per-table ids, per-table offsets of B + 1 entries) of a predict body.

    Tables come back in the model's order ``tables``. Structure errors (a table
    missing or unknown, bag lists whose sample count differs from ``dense``) are
    400; dense rows of the wrong width or non-finite values are 422; more ids
    than ``max_ids`` (over all tables), or more samples, is 413.
    """
    req = PredictRequest.model_validate_json(body)
    total = sum(len(bag) for bags in req.sparse.values() for bag in bags)
    _check_count(total, max_ids)
    _check_count(len(req.dense), max_ids, "samples")
    missing = [t for t in tables if t not in req.sparse]
    unknown = sorted(set(req.sparse) - set(tables))
    if missing or unknown:
        what = (f"missing table(s) {', '.join(map(repr, missing))}" if missing else "") + \
               ("; " if missing and unknown else "") + \
               (f"table(s) {', '.join(map(repr, unknown))} not used by this model" if unknown else "")
        raise ApiError(400, f"malformed body: sparse must hold exactly the model's tables "
                            f"({', '.join(tables)}); {what}")
    n = len(req.dense)
    for t in tables:
        if len(req.sparse[t]) != n:
            raise ApiError(400, f"malformed body: sparse[{t!r}] holds {len(req.sparse[t])} bag lists but dense "
                                f"holds {n} samples; give one id list per sample")
    bad = next((i for i, row in enumerate(req.dense) if len(row) != width), None)
    if bad is not None:
        raise ApiError(422, f"dense rows must have {width} values (the model's dense features); "
                            f"row {bad} has {len(req.dense[bad])}")
    with np.errstate(over="ignore"):
        dense = np.array(req.dense, dtype=np.float32).reshape(n, width)
    if dense.size and not np.isfinite(dense).all():
        row = int(np.argwhere(~np.isfinite(dense))[0][0])
        raise ApiError(422, f"dense features must be finite float32 values; row {row} holds NaN, inf or a "
                            "value beyond float32's range")
    ids, offsets = [], []
    for t in tables:
        bags = req.sparse[t]
        lens = np.fromiter(map(len, bags), dtype=np.int64, count=n)
        offs = np.zeros(n + 1, np.int64)
        np.cumsum(lens, out=offs[1:])
        ids.append(np.fromiter(itertools.chain.from_iterable(bags), dtype=np.int64, count=int(offs[-1])))
        offsets.append(offs)
    return dense, ids, offsets


def check_mode(mode: str) -> str:
    if mode not in ("sum", "mean"):
        raise InvalidInputError(f"mode must be 'sum' or 'mean', got {mode!r}")
    return mode


# --- answers ----------------------------------------------------------------------------
def json_text(body: dict, values: np.ndarray, problem: str) -> str:
    """``body`` as strict JSON, which has no Infinity or NaN: ``values`` (the numbers in it) holding one
    is a 422 naming ``problem``, not an answer that strict parsers (JavaScript's ``JSON.parse``) reject."""
    if not np.isfinite(values).all():
        raise ApiError(422, f"the answer holds values that are not finite, which JSON cannot carry: {problem}")
    return json.dumps(body, separators=(",", ":"), allow_nan=False)


def rows_response(rows: np.ndarray, binary: bool) -> Response:
    """``rows`` (n, dim) float32 as a binary or JSON answer."""
    n, dim = rows.shape
    if binary:
        return Response(np.ascontiguousarray(rows, dtype="<f4").tobytes(), media_type=BINARY,
                        headers={SHAPE_HEADER: f"{n},{dim}"})
    text = json_text({"dim": dim, "embeddings": rows.tolist()}, rows,
                     "a pooled sum overflowed float32; ask for Accept: application/octet-stream (raw float32)")
    return Response(text, media_type="application/json")


def binary_body_schema(description: str) -> dict:
    return {"schema": {"type": "string", "format": "binary"}, "description": description}
