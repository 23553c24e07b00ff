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
    anything else              -> 500   logged with its traceback; never caused by input
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

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

    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.headers)

    async def embstore_error(_: Request, exc: EmbstoreError) -> JSONResponse:
        status = status_of(exc)
        if status >= 500:
            log.error("request failed: %s", exc, exc_info=exc)
        return error_response(status, str(exc))

    async def body_error(_: Request, exc: ValidationError) -> JSONResponse:
        return error_response(400, describe_validation(exc.errors(include_url=False)))

    async def param_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, describe_validation(list(exc.errors()), "request"))

    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.error("internal error: %s", exc, exc_info=exc)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(EmbstoreError, embstore_error)
    app.add_exception_handler(ValidationError, body_error)
    app.add_exception_handler(RequestValidationError, param_error)
    app.add_exception_handler(Exception, unexpected)
