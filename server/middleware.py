"""The one ASGI middleware every request passes: metrics, body-size limit (413), timeout (504).

One layer instead of three keeps the per-request overhead small (each ASGI
layer costs a few microseconds of wrappers; a 64-id lookup is ~100 us of
Python in all).

- Metrics: every request is counted and timed by route template
  (``/v1/tables/{name}/lookup``), never by raw path, so unknown paths cannot
  grow the label set; requests that match no route count as ``unmatched``, and
  methods other than the standard ones as ``OTHER`` (HTTP allows any token).
  A request this layer refuses itself (413 by ``Content-Length``) never reaches
  the router, so its route is looked up here: it counts under its route too.
- Body size: refused from ``Content-Length`` before it is read; a body without
  one (chunked) is counted while it streams in, and the overflow raises
  :class:`ApiError` inside the route, which the exception handlers turn into
  a ``413``.
- Timeout: the request's coroutine is cancelled; blocking store work it
  started in a thread is abandoned, not killed, so it finishes on its own (a
  timed-out write may or may not have been applied, as with any HTTP timeout).
  A timeout is logged as one WARNING line, a refusal made here (413) as one
  INFO line like every other refusal (``errors.log_refused``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from starlette.routing import Match

from embstore.server.errors import ApiError, log_refused, one_line
from embstore.server.metrics import Metrics

log = logging.getLogger("embstore.server")

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT"})


class RequestMiddleware:
    def __init__(self, app: Any, metrics: Metrics, max_body_bytes: int, timeout: float) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.timeout = timeout or None

    def _too_large(self, size: int) -> str:
        return (f"request body of {size} bytes or more exceeds this server's limit of {self.max_body_bytes} bytes "
                "(split the request)")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500
        started = False

        async def tracked_send(message: dict) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status = message["status"]
                started = True
            await send(message)

        length = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = int(value) if value.isdigit() else None
                break
        self.metrics.in_flight.inc()
        try:
            if length is not None and length > self.max_body_bytes:
                scope.setdefault("route", _route_of(scope))  # refused before routing: label it by its route
                log_refused(scope["method"], scope["path"], 413, self._too_large(length))
                await self._error(tracked_send, 413, self._too_large(length))
                return
            if length is None:  # no declared length (chunked): count the body as it arrives
                receive = self._counting(receive)
            try:
                async with asyncio.timeout(self.timeout):
                    await self.app(scope, receive, tracked_send)
            except TimeoutError:
                if started:  # the answer is half sent: nothing sensible left to say
                    log.warning("%s %s timed out while its answer was being sent", scope["method"],
                                one_line(scope["path"], 200))
                    return
                log.warning("%s %s timed out after %g s: answered 504", scope["method"], one_line(scope["path"], 200),
                            self.timeout)
                await self._error(tracked_send, 504, f"request timed out after {self.timeout:g} s (the server's "
                                                     "request timeout); a write may or may not have been applied")
        finally:
            self.metrics.in_flight.dec()
            route = scope.get("route")
            method = scope["method"] if scope["method"] in METHODS else "OTHER"
            self.metrics.observe(method, getattr(route, "path", None) or "unmatched", status,
                                 time.perf_counter() - start)

    def _counting(self, receive: Any) -> Any:
        received = 0

        async def counting_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise ApiError(413, self._too_large(received))
            return message

        return counting_receive

    @staticmethod
    async def _error(send: Any, status: int, message: str) -> None:
        body = json.dumps({"detail": message}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _route_of(scope: dict) -> Any:
    """The route the app's router would give ``scope`` (a full match first, then one that only the method
    misses, as Starlette's router picks), or None; for requests refused before they reach the router."""
    partial = None
    for route in getattr(getattr(scope.get("app"), "router", None), "routes", ()):
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return route
        if match is Match.PARTIAL and partial is None:
            partial = route
    return partial
