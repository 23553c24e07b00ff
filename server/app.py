"""The FastAPI app: thin routes over :mod:`embstore.server.state` (SPEC section 5).

``create_app(settings)`` builds an app that opens the store in its lifespan,
flushes written rows every ``flush_interval`` seconds and on shutdown, and
answers:

=================================  ==================================================
``GET /healthz``                   ``{"status": "ok"}``
``GET /v1/tables``                 ``[{"name", "num_embeddings", "dim", "dtype"}]``
``GET /v1/tables/{name}``          metadata, ``stats`` (per tier), ``pooled_cache``
``POST /v1/tables/{name}/lookup``  rows of ids (JSON or binary, see ``protocol``)
``POST /v1/tables/{name}/pooled``  pooled bags (JSON or binary)
``PUT /v1/tables/{name}/rows``     overwrite rows; ``204`` once durable; token when one is set
``GET /v1/models``                 ``[{"name", "tables", "embedding_dim", "dense_in_features", ...}]``
``POST /v1/models/{name}/predict``  click probabilities of samples (JSON, see ``protocol``)
``POST /v1/admin/reload``          flush, then reopen the store (and its models) from disk; token when one
                                   is set; ``503`` and the old store kept while its flush fails
``GET /metrics``                   Prometheus text
``GET /``                          HTML status page
=================================  ==================================================
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import FastAPI, Query, Request, Response
from fastapi.responses import HTMLResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from embstore.server import protocol, status_page
from embstore.server.errors import ApiError, install_handlers
from embstore.server.metrics import Metrics, StoreCollector
from embstore.server.middleware import RequestMiddleware
from embstore.server.protocol import (BINARY, EmbeddingsResponse, Health, LookupRequest, ModelInfo, PooledRequest,
                                      PredictRequest, PredictResponse, RowsRequest, TableDetail, TableInfo)
from embstore.server.settings import ServerSettings
from embstore.server.state import Served, StoreGate, TableService, offload
from embstore.store import Store

OFFLOAD_BYTES = 1 << 20  # bodies and answers beyond this are parsed / encoded in a worker thread

_ERRORS = {400: "malformed body, invalid ids or offsets", 404: "unknown table or model",
           413: "more ids than the server's limit, or body too large", 422: "wrong shapes or non-finite values",
           503: "store or model unavailable (a reload failed), or the machine's storage failed (EIO)",
           504: "request timed out", 507: "the machine's disk is full"}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {c: {"description": _ERRORS[c]} for c in codes}


def _rows_answer() -> dict[int | str, dict[str, Any]]:
    return {200: {"description": "one float32 row per id (or per bag)",
                  "content": {"application/json": {"schema": EmbeddingsResponse.model_json_schema()},
                              BINARY: protocol.binary_body_schema(
                                  "little-endian float32 rows; header X-Embedding-Shape: n,dim")}},
            **_errors(400, 404, 413, 503, 504, 507)}


def _body(model: type, binary: str | None) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": model.model_json_schema()}}
    if binary:
        content[BINARY] = protocol.binary_body_schema(binary)
    return {"requestBody": {"required": True, "content": content}}


def table_info(table: Any) -> dict[str, Any]:
    cfg = table.config
    return {"name": cfg.name, "num_embeddings": cfg.num_embeddings, "dim": cfg.dim, "dtype": cfg.dtype.value}


def table_snapshot(svc: TableService) -> dict[str, Any]:
    """Blocking: a table's metadata and every counter the server reports about it."""
    b = svc.batcher.stats if svc.batcher is not None else None
    return {**table_info(svc.table),
            "tiers": [t.kind.value for t in svc.table.config.tiers],
            "stats": svc.table.stats(),
            "pooled_cache": svc.cache.stats(),
            "lookups": svc.table.lookups,
            "batching": {"requests": b.requests if b else 0, "batches": b.batches if b else 0}}


def snapshot(served: Served | None) -> dict[str, dict[str, Any]]:
    """Blocking: :func:`table_snapshot` of every table (empty when no store is open)."""
    if served is None:
        return {}
    return {name: table_snapshot(svc) for name, svc in served.services.items()}


def create_app(settings: ServerSettings, *, opener: Callable[[Path], Store] | None = None) -> FastAPI:
    """An app serving ``settings.store``; ``opener`` replaces ``embstore.open`` (tests)."""
    gate = StoreGate(settings, opener) if opener is not None else StoreGate(settings)
    metrics = Metrics()
    metrics.registry.register(StoreCollector(lambda: snapshot(gate.current)))
    token = settings.token.encode() if settings.token is not None else None

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gate.open()
        if settings.freeze_gc:
            gc.collect()
            gc.freeze()
        flusher = asyncio.create_task(gate.run_flusher()) if settings.flush_interval > 0 else None
        try:
            yield
        finally:
            if flusher is not None:
                flusher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await flusher
            try:
                await gate.close()
            except Exception as exc:  # the final flush failed: `embstore serve` exits 1 with it, not 0
                app.state.shutdown_error = exc
                raise

    app = FastAPI(title="embstore", version="1", lifespan=lifespan, redirect_slashes=False,  # a 404, not a 307
                  description="Lookups of a tiered embedding store (embstore SPEC section 5).")
    app.state.gate = gate
    app.state.metrics = metrics
    app.state.settings = settings
    app.state.shutdown_error = None
    install_handlers(app)
    app.add_middleware(RequestMiddleware, metrics=metrics, max_body_bytes=settings.max_body_bytes,
                       timeout=settings.request_timeout)

    def require_token(request: Request) -> None:
        if token is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode("latin-1"), token):
            raise ApiError(401, "missing or wrong token: this server needs 'Authorization: Bearer TOKEN' "
                                "for writes and admin calls", {"WWW-Authenticate": "Bearer"})

    async def rows_answer(rows: Any, request: Request) -> Response:
        binary = protocol.wants_binary(request)
        if rows.nbytes > OFFLOAD_BYTES:
            return await offload(protocol.rows_response, rows, binary)
        return protocol.rows_response(rows, binary)

    def json_only(request: Request) -> None:
        """Rows and predictions have no binary form: say so, rather than report the body as bad JSON."""
        if protocol.is_binary(request):
            raise ApiError(400, f"{request.method} {request.url.path} takes a JSON body (Content-Type "
                                f"application/json), not {protocol.BINARY}")

    async def parse(fn: Callable[..., Any], body: bytes, *args: Any) -> Any:
        """``fn(body, *args)``; large bodies are parsed in a worker thread."""
        if len(body) > OFFLOAD_BYTES:
            return await offload(fn, body, *args)
        return fn(body, *args)

    @app.get("/healthz", response_model=Health, responses=_errors(503))
    async def healthz() -> dict[str, str]:
        async with gate.lease():
            return {"status": "ok"}

    @app.get("/v1/tables", response_model=list[TableInfo], responses=_errors(503))
    async def list_tables() -> list[dict[str, Any]]:
        async with gate.lease() as served:
            return [table_info(t) for t in served.store.tables.values()]

    @app.get("/v1/tables/{name}", response_model=TableDetail, responses=_errors(404, 503))
    async def get_table(name: str) -> dict[str, Any]:
        async with gate.lease() as served:
            return await offload(table_snapshot, served.service(name))

    @app.post("/v1/tables/{name}/lookup", response_class=Response, responses=_rows_answer(),
              openapi_extra=_body(LookupRequest, "little-endian int64 ids"))
    async def lookup(name: str, request: Request) -> Response:
        body = await request.body()
        if len(body) > OFFLOAD_BYTES:
            ids = await offload(protocol.parse_lookup, body, protocol.is_binary(request), settings.max_ids)
        else:  # the hot path: a small binary lookup of a memory-resident table runs without a thread hop
            ids = protocol.parse_lookup(body, protocol.is_binary(request), settings.max_ids)
        async with gate.lease() as served:
            rows = await served.service(name).lookup(ids)
        if rows.nbytes > OFFLOAD_BYTES:
            return await rows_answer(rows, request)
        return protocol.rows_response(rows, protocol.wants_binary(request))

    @app.post("/v1/tables/{name}/pooled", response_class=Response, responses=_rows_answer(),
              openapi_extra=_body(PooledRequest, "num_bags + 1 little-endian int64 offsets, then the int64 ids "
                                                 "(query parameters num_bags and mode)"))
    async def pooled(name: str, request: Request,
                     num_bags: Annotated[int | None, Query(ge=0, le=protocol.I64_MAX,
                                                           description="bags in a binary body")] = None,
                     mode: Annotated[Literal["sum", "mean"] | None,
                                     Query(description="binary bodies: pooling mode (default sum)")] = None
                     ) -> Response:
        ids, offsets, how = await parse(protocol.parse_pooled, await request.body(), protocol.is_binary(request),
                                        settings.max_ids, num_bags, mode)
        async with gate.lease() as served:
            rows = await served.service(name).lookup_pooled(ids, offsets, how)
        return await rows_answer(rows, request)

    @app.put("/v1/tables/{name}/rows", status_code=204, response_class=Response,
             responses={401: {"description": "missing or wrong token"}, **_errors(400, 404, 413, 422, 503, 504, 507)},
             openapi_extra=_body(RowsRequest, None))
    async def put_rows(name: str, request: Request) -> Response:
        require_token(request)
        json_only(request)
        body = await request.body()
        async with gate.lease() as served:
            dim = served.service(name).table.dim
            ids, rows = await parse(protocol.parse_rows, body, settings.max_ids, dim)
            await offload(served.update, name, ids, rows)
            if settings.durable_writes:  # logged: one shared fdatasync of the store's write-ahead log
                await served.commit.wait_durable(served.commit.note_write())
        return Response(status_code=204)

    @app.get("/v1/models", response_model=list[ModelInfo], responses=_errors(503))
    async def list_models() -> list[dict[str, Any]]:
        async with gate.lease() as served:
            return [m.info() for _, m in sorted(served.models.items())]

    @app.post("/v1/models/{name}/predict", response_model=PredictResponse,
              responses=_errors(400, 404, 413, 422, 503, 504), openapi_extra=_body(PredictRequest, None))
    async def predict(name: str, request: Request) -> Response:
        json_only(request)
        body = await request.body()
        async with gate.lease() as served:
            model = served.model(name)
            spec = model.spec
            dense, ids, offsets = await parse(protocol.parse_predict, body, settings.max_ids, spec.tables,
                                              spec.dense_in_features)
            scores = await model.predict(dense, ids, offsets)
        text = protocol.json_text({"scores": scores.astype(np.float64).tolist()}, scores,
                                  "the model's scores overflowed; check the scale of the dense features")
        return Response(text, media_type="application/json")

    @app.post("/v1/admin/reload", responses={401: {"description": "missing or wrong token"},
                                             409: {"description": "the store on disk cannot be read"},
                                             503: {"description": "the open store cannot be flushed (full disk, "
                                                                  "EIO): refused, the old store keeps serving; or "
                                                                  "the new one could not be opened"}})
    async def reload(request: Request) -> dict[str, Any]:
        require_token(request)
        served = await gate.reload()
        return {"status": "reloaded", "reloads": gate.reloads, "tables": list(served.services),
                "models": sorted(served.models)}

    async def current_snapshot() -> dict[str, dict[str, Any]]:
        try:
            async with gate.lease() as served:
                return await offload(snapshot, served)
        except ApiError:  # no store open: report the requests only
            return {}

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"}})
    async def prometheus() -> Response:
        try:
            async with gate.lease():
                text = await offload(generate_latest, metrics.registry)
        except ApiError:
            text = await offload(generate_latest, metrics.registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    async def status() -> HTMLResponse:
        snap = await current_snapshot()
        state = "serving" if gate.current is not None else "no store open"
        return HTMLResponse(status_page.render(str(settings.store), snap, metrics.rates.rates(),
                                               dict(metrics.totals), gate.reloads, state))

    # HEAD wherever GET is (health checks and probes send it; FastAPI adds it to none), answered by the GET
    # handler; the server sends the headers without the body. The schema is built (and cached) first: it
    # documents the GETs only, since a HEAD operation would repeat each GET's operationId.
    app.openapi()
    for route in app.router.routes:
        if isinstance(route, APIRoute) and "GET" in route.methods:
            route.methods.add("HEAD")
    # Starlette tries routes in order: put the hot ones before FastAPI's docs routes and the rest.
    hot = ("/v1/tables/{name}/lookup", "/v1/tables/{name}/pooled")
    app.router.routes.sort(key=lambda r: hot.index(r.path) if getattr(r, "path", None) in hot else len(hot))
    return app
