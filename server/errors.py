"""One place that turns errors into HTTP answers ``{"detail": "what was wrong and what is allowed"}``.

::

    ApiError(status)              raised by the server's own checks (401, 413, 422, 503, 504)
    UnknownTableError          -> 404
    InvalidRowsError           -> 422   rows of the wrong shape, or NaN/inf
    InvalidInputError          -> 400   ids out of range, bad offsets, bad mode
    pydantic ValidationError   -> 400   a body that is not the documented JSON
    RequestValidationError     -> 400   a bad query or path parameter
    StoreClosedError           -> 503   the store went away under a request (reload failed)
    DiskFullError              -> 507   the machine's disk is full (the request changed nothing durable)
    TierIOError                -> 503   the machine's storage failed (EIO, ...); the message names the tier
    HTTPException (Starlette)  -> 404 / 405   no such path, or a method the path does not take
    ClientDisconnect           -> 400   the client hung up before its whole body arrived (no one reads it)
    anything else              -> 500   logged with its traceback; never caused by input

Every refusal (4xx) is logged as one INFO line - method, path, status and the message the client got -
and never with a traceback: it is the client's mistake, not the server's. What the client sent (a
table name, a JSON key) is escaped, so it cannot forge log lines.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from embstore.errors import (DiskFullError, EmbstoreError, InvalidInputError, InvalidRowsError, StoreClosedError,
                             TierIOError, UnknownTableError)

log = logging.getLogger("embstore.server")


class ApiError(Exception):
    """An answer other than 2xx decided by the server itself."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status, headers=headers)


def one_line(text: str, limit: int = 1000) -> str:
    """``text`` shortened and on one line, control characters escaped (a newline as ``\\n``): for logging
    what a client sent."""
    if len(text) > limit:
        text = text[:limit] + "..."
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def log_refused(method: str, path: str, status: int, message: str) -> None:
    """One INFO line saying which request was refused and why (the message its client got)."""
    log.info("%s %s refused %d: %s", one_line(method, 20), one_line(path, 200), status, one_line(message))


def describe_validation(errors: list[dict[str, Any]], what: str = "body") -> str:
    """A one-line summary of pydantic errors: where and what."""
    parts = []
    for err in errors[:3]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {err.get('msg', 'invalid')}" if loc else str(err.get("msg", "invalid")))
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return f"malformed {what}: " + "; ".join(parts) + more


def status_of(exc: BaseException) -> int:
    if isinstance(exc, ApiError):
        return exc.status
    if isinstance(exc, UnknownTableError):
        return 404
    if isinstance(exc, InvalidRowsError):
        return 422
    if isinstance(exc, (InvalidInputError, ValidationError, RequestValidationError)):
        return 400
    if isinstance(exc, StoreClosedError):
        return 503
    if isinstance(exc, DiskFullError):  # a machine failure, not the client's: say which, never a bare 500
        return 507
    if isinstance(exc, TierIOError):
        return 503
    return 500


def install_handlers(app: FastAPI) -> None:
    """Register the mapping above on ``app``."""

    def refused(request: Request, status: int, message: str, headers: dict[str, str] | None = None
                ) -> JSONResponse:
        log_refused(request.method, request.url.path, status, message)
        return error_response(status, message, headers)

    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        if exc.status >= 500:  # the store, not the client: state.py logs why once, not per request
            return error_response(exc.status, exc.message, exc.headers)
        return refused(request, exc.status, exc.message, exc.headers)

    async def embstore_error(request: Request, exc: EmbstoreError) -> JSONResponse:
        status = status_of(exc)
        if status >= 500:
            log.error("request failed: %s", exc, exc_info=exc)
            return error_response(status, str(exc))
        return refused(request, status, str(exc))

    async def body_error(request: Request, exc: ValidationError) -> JSONResponse:
        return refused(request, 400, describe_validation(exc.errors(include_url=False)))

    async def param_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return refused(request, 400, describe_validation(list(exc.errors()), "request"))

    async def http_error(request: Request, exc: HTTPException) -> Response:
        """The router's own refusals: a path no route has (404), a method its route does not take (405)."""
        detail, path = str(exc.detail), request.url.path
        if exc.status_code == 404 and detail == "Not Found":
            detail = f"no such path: {path} (the API is listed at /docs)"
        elif exc.status_code == 405 and detail == "Method Not Allowed":
            allowed = (exc.headers or {}).get("Allow")
            if allowed:  # a route's methods are a set: the same answer every time, in one order
                allowed = ", ".join(sorted(m.strip() for m in allowed.split(",")))
                exc.headers = {**exc.headers, "Allow": allowed}
            detail = f"method {request.method} is not allowed on {path}" + (f"; allowed: {allowed}" if allowed else "")
        log_refused(request.method, path, exc.status_code, detail)
        return await http_exception_handler(request, HTTPException(exc.status_code, detail, exc.headers))

    async def client_gone(request: Request, _: ClientDisconnect) -> JSONResponse:
        """The client hung up before its whole body arrived: its mistake, and nobody reads the answer, so no
        500 and no traceback (it counts as a 400 in the metrics)."""
        return refused(request, 400, "the client closed the connection before its whole body arrived")

    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.error("internal error: %s", exc, exc_info=exc)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(EmbstoreError, embstore_error)
    app.add_exception_handler(ValidationError, body_error)
    app.add_exception_handler(RequestValidationError, param_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(ClientDisconnect, client_gone)
    app.add_exception_handler(Exception, unexpected)
