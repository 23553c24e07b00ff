"""A Python client for the lookup server (SPEC section 5), returning numpy arrays.

::

    from embstore.client import LookupClient, ServerError

    with LookupClient("http://127.0.0.1:8000", token=None) as client:
        rows = client.lookup("user_id", [3, 17, 3])                     # (3, dim) float32
        bags = client.lookup_pooled("user_id", [7, 3, 3, 9, 1], [0, 3, 3, 5], mode="sum")
        client.update("user_id", [3], np.ones((1, dim), np.float32))  # needs the token if the server has one
        scores = client.predict("dlrm", dense,                          # (2, dense_in_features) floats
                                {"c1": [[4, 9], [7]], "c2": [[1], []]})   # per table: one id list per sample
        try:
            client.lookup("nope", [1])
        except ServerError as exc:
            print(exc.status_code, exc.message)                        # 404 no table 'nope'; known tables: ...

``bags(ids, offsets)`` turns a flat id array and its ``num_bags + 1`` offsets
into the per-sample id lists ``predict`` takes.

Lookups use the binary protocol (little-endian int64 ids in, float32 rows
out) unless ``binary=False``, which uses JSON; both give the same bits. Every
answer other than 2xx raises :class:`ServerError` with the HTTP status and the
server's message; network failures raise httpx's own exceptions
(``httpx.ConnectError``, ``httpx.TimeoutException``, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import httpx
import numpy as np

from embstore.errors import EmbstoreError, InvalidInputError, InvalidRowsError

BINARY = "application/octet-stream"
SHAPE_HEADER = "X-Embedding-Shape"
I64_MAX = np.iinfo(np.int64).max


class ServerError(EmbstoreError):
    """The server answered with an error: ``status_code`` (400, 401, 404, 413, 422, 503, 504, ...) and
    ``message`` (what was wrong and what is allowed)."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(f"HTTP {status_code}: {message}")
        self.status_code = status_code
        self.message = message


def _int64(arr: np.ndarray, what: str) -> np.ndarray:
    """An integer array as int64; unsigned values beyond int64 are refused, not wrapped to negatives."""
    if arr.dtype.kind == "u" and arr.size and arr.max() > I64_MAX:
        raise InvalidInputError(f"{what} must be int64 values; {int(arr.max())} is above {I64_MAX}")
    return arr.astype(np.int64, copy=False)


def _ids(ids: Any, what: str = "ids") -> np.ndarray:
    arr = np.asarray(ids)
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InvalidInputError(f"{what} must be a 1-D sequence of integers, got {arr.dtype} of shape {arr.shape}")
    return _int64(arr, what)


def _finite(values: Any, dtype: type, what: str, error: type[InvalidInputError]) -> np.ndarray:
    """``values`` as a ``dtype`` array of finite numbers, else ``error`` (JSON cannot carry NaN or inf,
    and the server refuses them anyway)."""
    try:
        raw = np.asarray(values)
        if raw.dtype.kind == "c":  # numpy would drop the imaginary part with only a warning
            raise TypeError(f"complex values ({raw.dtype}) have no {np.dtype(dtype).name} form")
        with np.errstate(over="ignore"):
            arr = raw.astype(dtype, copy=False)
    except (TypeError, ValueError, OverflowError) as exc:  # OverflowError: a Python int beyond float64
        raise error(f"{what} must be numbers: {exc}") from None
    if arr.size and not np.isfinite(arr).all():
        raise error(f"{what} must be finite {np.dtype(dtype).name} values; NaN, inf or a value beyond "
                    f"{np.dtype(dtype).name}'s range found")
    return arr


def _decode(resp: httpx.Response) -> np.ndarray:
    """Rows of a lookup answer, binary or JSON."""
    if resp.headers.get("content-type", "").startswith(BINARY):
        n, dim = (int(x) for x in resp.headers[SHAPE_HEADER].split(","))
        return np.frombuffer(resp.content, dtype="<f4").astype(np.float32).reshape(n, dim)
    data = resp.json()
    return np.array(data["embeddings"], dtype=np.float32).reshape(-1, data["dim"])


def bags(ids: Any, offsets: Any) -> list[list[int]]:
    """Bags ``ids[offsets[b]:offsets[b+1]]`` as lists (the ``sparse`` form of :meth:`LookupClient.predict`)."""
    arr, offs = _ids(ids), _ids(offsets, "offsets")
    if len(offs) == 0 or offs[0] != 0 or offs[-1] != len(arr) or (np.diff(offs) < 0).any():
        raise InvalidInputError(f"offsets must rise from 0 to len(ids) = {len(arr)} (num_bags + 1 entries)")
    return [arr[a:b].tolist() for a, b in zip(offs[:-1].tolist(), offs[1:].tolist())]  # [0]: no bags


def _bag_lists(table: str, value: Any) -> list[list[int]]:
    out = []
    for i, bag in enumerate(value):
        arr = np.asarray(bag)
        if arr.size and (arr.ndim != 1 or arr.dtype.kind not in "iu"):
            raise InvalidInputError(f"sparse[{table!r}][{i}] must be a list of integer ids, got {arr.dtype} "
                                    f"of shape {arr.shape}")
        out.append(_int64(arr, f"sparse[{table!r}][{i}]").tolist() if arr.size else [])
    return out


class LookupClient:
    """Talks to one ``embstore serve`` server; a context manager (closes its connections)."""

    def __init__(self, base_url: str, token: str | None = None, *, binary: bool = True, timeout: float = 30.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        # UTF-8 bytes: the server reads token files as UTF-8 and compares bytes; httpx would encode a str as ASCII
        headers = {"Authorization": f"Bearer {token}".encode()} if token is not None else {}
        self.binary = binary
        # drop idle connections before the server does (`embstore serve` keeps them 30 s): reusing one the
        # server is closing at that instant fails with a connection reset instead of an answer
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout,
                                  transport=transport, limits=httpx.Limits(keepalive_expiry=20.0))

    # --- plumbing --------------------------------------------------------------------
    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        resp = self._http.request(method, path, **kwargs)
        if resp.status_code >= 400:
            try:
                message = resp.json()["detail"]
            except (ValueError, KeyError, TypeError):
                message = resp.text or resp.reason_phrase
            raise ServerError(resp.status_code, str(message))
        return resp

    @staticmethod
    def _table(name: str, *rest: str) -> str:
        return "/".join(("/v1/tables", quote(name, safe=""), *rest))

    def _rows(self, path: str, json_body: dict[str, Any], binary_body: bytes,
              params: dict[str, Any] | None = None) -> np.ndarray:
        if self.binary:
            resp = self._request("POST", path, content=binary_body, params=params,
                                 headers={"Content-Type": BINARY, "Accept": BINARY})
        else:
            resp = self._request("POST", path, json=json_body, headers={"Accept": "application/json"})
        return _decode(resp)

    # --- API ---------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """``{"status": "ok"}`` when the server has its store open."""
        return self._request("GET", "/healthz").json()

    def tables(self) -> list[dict[str, Any]]:
        """``[{"name", "num_embeddings", "dim", "dtype"}, ...]``."""
        return self._request("GET", "/v1/tables").json()

    def table(self, name: str) -> dict[str, Any]:
        """Metadata, per-tier ``stats`` and ``pooled_cache`` counters of one table."""
        return self._request("GET", self._table(name)).json()

    def lookup(self, table: str, ids: Any) -> np.ndarray:
        """Rows of ``ids``: float32 (len(ids), dim)."""
        arr = _ids(ids)
        return self._rows(self._table(table, "lookup"), {"ids": arr.tolist()}, arr.astype("<i8").tobytes())

    def lookup_pooled(self, table: str, ids: Any, offsets: Any, mode: str = "sum") -> np.ndarray:
        """Bags ``ids[offsets[b]:offsets[b+1]]`` pooled by ``mode``: float32 (len(offsets) - 1, dim)."""
        arr, offs = _ids(ids), _ids(offsets, "offsets")
        if len(offs) == 0:
            raise InvalidInputError("offsets needs num_bags + 1 entries (at least [0])")
        body = np.concatenate([offs, arr]).astype("<i8").tobytes()
        return self._rows(self._table(table, "pooled"), {"ids": arr.tolist(), "offsets": offs.tolist(), "mode": mode},
                          body, params={"num_bags": len(offs) - 1, "mode": mode})

    def update(self, table: str, ids: Any, rows: Any) -> None:
        """Overwrite the rows of ``ids`` (float rows of shape (len(ids), dim)). Returns once the server
        has made them durable (logged and synced), unless it runs with ``--no-durable-writes``."""
        arr = _ids(ids)
        values = _finite(rows, np.float32, "rows", InvalidRowsError)
        self._request("PUT", self._table(table, "rows"), json={"ids": arr.tolist(), "embeddings": values.tolist()})

    def models(self) -> list[dict[str, Any]]:
        """``[{"name", "tables", "embedding_dim", "dense_in_features", "interaction"}, ...]``."""
        return self._request("GET", "/v1/models").json()

    def predict(self, model: str, dense: Any, sparse: Mapping[str, Any]) -> np.ndarray:
        """Click probabilities (float32, one per sample) of ``model`` on ``dense`` (n, features) and
        ``sparse`` {table: [ids of sample 0, ids of sample 1, ...]} (see :func:`bags`)."""
        rows = _finite(dense, np.float64, "dense", InvalidInputError)
        if rows.ndim != 2:
            raise InvalidInputError(f"dense must be 2-D (samples, features), got shape {rows.shape}")
        body = {"dense": rows.tolist(), "sparse": {str(t): _bag_lists(t, v) for t, v in sparse.items()}}
        resp = self._request("POST", "/".join(("/v1/models", quote(model, safe=""), "predict")), json=body)
        return np.array(resp.json()["scores"], dtype=np.float32)

    def reload(self) -> dict[str, Any]:
        """Make the server reopen its store from disk (needs the token if the server has one)."""
        return self._request("POST", "/v1/admin/reload").json()

    def metrics(self) -> str:
        """The Prometheus text of ``/metrics``."""
        return self._request("GET", "/metrics").text

    # --- lifecycle ---------------------------------------------------------------------
    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "LookupClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<LookupClient {str(self._http.base_url)!r} binary={self.binary}>"
