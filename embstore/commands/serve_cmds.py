"""`embstore serve`: the HTTP lookup server (SPEC section 5) under uvicorn."""

from __future__ import annotations

import argparse
import logging
import signal
from pathlib import Path

from embstore.commands.argtypes import nonneg_seconds, port_number, positive_int
from embstore.errors import StoreNotFoundError
from embstore.store import MANIFEST_FILE


KEEP_ALIVE_S = 30  # idle keep-alive connections live this long; clients should drop theirs sooner
MAX_BATCH_WAIT_MS = 100.0  # ServerSettings.batch_wait allows at most 0.1 s


def batch_wait_ms(text: str) -> float:
    """``--batch-wait-ms``: refused in the flag's own unit (milliseconds), not as the setting's seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of milliseconds, got {text!r}") from None
    if not 0 <= value <= MAX_BATCH_WAIT_MS:
        raise argparse.ArgumentTypeError(f"expected milliseconds in [0, {MAX_BATCH_WAIT_MS:g}], got {text!r}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="serve a store over HTTP (lookups, pooled lookups, updates, metrics)",
        description="Serve STORE over HTTP: GET /healthz, GET /v1/tables[/NAME], POST /v1/tables/NAME/lookup "
                    "and /pooled (JSON or little-endian binary), PUT /v1/tables/NAME/rows, POST "
                    "/v1/admin/reload, GET /metrics (Prometheus) and a status page at /. A PUT is answered "
                    "204 once its rows are durable (concurrent writes share one flush); with "
                    "--no-durable-writes as soon as they are applied, and written rows are flushed every "
                    "--flush-interval seconds and on shutdown (Ctrl-C).")
    p.add_argument("store", help="store directory (made with 'embstore create')")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8000,
                   help="TCP port, 0-65535; 0 picks a free one (default 8000)")
    p.add_argument("--token-file", default=None,
                   help="file holding a bearer token; when given, writes and reloads need "
                        "'Authorization: Bearer TOKEN'")
    p.add_argument("--max-ids", type=positive_int, default=1_000_000,
                   help="ids per request (also bags per pooled request and samples per predict request); "
                        "more is answered 413 (default 1000000)")
    p.add_argument("--max-body-bytes", type=positive_int, default=64 << 20,
                   help="request body bytes; more is answered 413 (default 64 MiB)")
    p.add_argument("--request-timeout", type=nonneg_seconds, default=30.0,
                   help="seconds before a request is answered 504; 0 = no limit (default 30)")
    p.add_argument("--no-durable-writes", dest="durable_writes", action="store_false",
                   help="answer a PUT when its rows are applied, before they are durable: faster writes, but a "
                        "crash loses those since the last flush")
    p.add_argument("--flush-interval", type=nonneg_seconds, default=30.0,
                   help="seconds between flushes of written rows into the tiers (each also empties the write-ahead "
                        "log, and commits the written tables' home indexes); 0 = only on shutdown and reload, the "
                        "log growing until then; with --no-durable-writes, the window a crash can lose (default 30)")
    p.add_argument("--batch-wait-ms", type=batch_wait_ms, default=0.0,
                   help="milliseconds an idle table waits for more lookups to read together; 0 = coalesce only "
                        "what queues up while a read runs (default 0, at most 100)")
    p.add_argument("--no-batching", action="store_true", help="read every lookup request on its own")
    p.add_argument("--pooled-cache-bytes", type=int, default=32 << 20,
                   help="per-table budget of the pooled-embedding cache; 0 = off (default 32 MiB)")
    p.add_argument("--access-log", action="store_true", help="log every request")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from embstore.server import ServerSettings, create_app

    store = Path(args.store)
    if not (store / MANIFEST_FILE).exists():
        raise StoreNotFoundError(f"no embstore store at {store} (missing {MANIFEST_FILE})")
    token = ServerSettings.read_token(args.token_file) if args.token_file else None
    settings = ServerSettings(store=store, token=token, max_ids=args.max_ids, max_body_bytes=args.max_body_bytes,
                              request_timeout=args.request_timeout, durable_writes=args.durable_writes,
                              flush_interval=args.flush_interval,
                              batching=not args.no_batching, batch_wait=args.batch_wait_ms / 1000,
                              pooled_cache_bytes=args.pooled_cache_bytes, freeze_gc=True)
    level = logging.getLogger().getEffectiveLevel()
    app = create_app(settings)
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again, which would end the process by
    # the signal (status -15) even after a clean shutdown; this handler turns that into a plain return
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        uvicorn.run(app, host=args.host, port=args.port, access_log=args.access_log,
                    log_level="info" if level <= logging.INFO else "warning",
                    timeout_keep_alive=KEEP_ALIVE_S)
    except _Terminated:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    if app.state.shutdown_error is not None:  # the final flush failed: exit 1, not 0, naming the failure
        raise app.state.shutdown_error
    return 0


class _Terminated(Exception):
    """SIGTERM outside uvicorn's own handling (re-raised after its shutdown, or before it started)."""


def _terminated(signum: int, frame: object) -> None:
    raise _Terminated()
