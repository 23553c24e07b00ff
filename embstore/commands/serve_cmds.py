"""`embstore serve`: the HTTP lookup server (SPEC section 5) under uvicorn."""

from __future__ import annotations

import argparse
import logging
import signal
import socket
from pathlib import Path
from typing import TYPE_CHECKING

import embstore
from embstore.commands.argtypes import byte_size, nonneg_byte_size, nonneg_seconds, port_number, positive_int
from embstore.errors import ConfigError, InvalidInputError, StoreNotFoundError
from embstore.store import MANIFEST_FILE

if TYPE_CHECKING:
    from embstore.store import Store


KEEP_ALIVE_S = 30  # idle keep-alive connections live this long; clients should drop theirs sooner
MAX_BATCH_WAIT_MS = 100.0  # ServerSettings.batch_wait allows at most 0.1 s
MAX_SECONDS = 86_400  # ServerSettings.request_timeout and flush_interval allow at most a day
_log = logging.getLogger("embstore.server")


def batch_wait_ms(text: str) -> float:
    """``--batch-wait-ms``: refused in the flag's own unit (milliseconds), not as the setting's seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of milliseconds, got {text!r}") from None
    if not 0 <= value <= MAX_BATCH_WAIT_MS:
        raise argparse.ArgumentTypeError(f"expected milliseconds in [0, {MAX_BATCH_WAIT_MS:g}], got {text!r}")
    return value


def seconds(text: str) -> float:
    """``--request-timeout``, ``--flush-interval``: refused as the flag, not as the setting's key, when over a day
    (or infinite)."""
    value = nonneg_seconds(text)
    if value > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"expected seconds in [0, {MAX_SECONDS}], got {text!r}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="serve a store over HTTP (lookups, pooled lookups, updates, metrics)",
        description="Serve STORE over HTTP: GET /healthz, GET /v1/tables[/NAME], POST /v1/tables/NAME/lookup "
                    "and /pooled (JSON or little-endian binary), PUT /v1/tables/NAME/rows, GET /v1/models, "
                    "POST /v1/models/NAME/predict, POST /v1/admin/reload, GET /metrics (Prometheus) and a "
                    "status page at /. A PUT is answered 204 once its rows are durable (appended to the "
                    "write-ahead log; concurrent writes share one fdatasync of it); with "
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
    p.add_argument("--max-body-bytes", type=byte_size, default=64 << 20,
                   help="request body size, in bytes or like 64MiB; more is answered 413 (default 64MiB)")
    p.add_argument("--request-timeout", type=seconds, default=30.0,
                   help="seconds before a request is answered 504; 0 = no limit (default 30, at most 86400)")
    p.add_argument("--no-durable-writes", dest="durable_writes", action="store_false",
                   help="answer a PUT when its rows are applied, before they are durable: faster writes, but a "
                        "crash loses those since the last flush")
    p.add_argument("--flush-interval", type=seconds, default=30.0,
                   help="seconds between flushes of written rows into the tiers (each also empties the write-ahead "
                        "log, and commits the written tables' home indexes); 0 = only on shutdown and reload, the "
                        "log growing until then; with --no-durable-writes, the window a crash can lose (default 30, "
                        "at most 86400)")
    p.add_argument("--batch-wait-ms", type=batch_wait_ms, default=0.0,
                   help="milliseconds an idle table waits for more lookups to read together; 0 = coalesce only "
                        "what queues up while a read runs (default 0, at most 100)")
    p.add_argument("--no-batching", action="store_true", help="read every lookup request on its own")
    p.add_argument("--pooled-cache-bytes", type=nonneg_byte_size, default=32 << 20,
                   help="per-table budget of the pooled-embedding cache, in bytes or like 32MiB; 0 = off "
                        "(default 32MiB)")
    p.add_argument("--access-log", action="store_true", help="log every request")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from embstore.server import ServerSettings, create_app

    store = Path(args.store)
    if not (store / MANIFEST_FILE).exists():
        raise StoreNotFoundError(f"no embstore store at {store} (missing {MANIFEST_FILE})")
    try:
        token = ServerSettings.read_token(args.token_file) if args.token_file else None
    except ConfigError as exc:  # named as the flag the user typed, not as a settings key
        raise InvalidInputError(f"--token-file: {exc.reason}") from None
    try:
        settings = ServerSettings(store=store, token=token, max_ids=args.max_ids, max_body_bytes=args.max_body_bytes,
                                  request_timeout=args.request_timeout, durable_writes=args.durable_writes,
                                  flush_interval=args.flush_interval,
                                  batching=not args.no_batching, batch_wait=args.batch_wait_ms / 1000,
                                  pooled_cache_bytes=args.pooled_cache_bytes, freeze_gc=True)
    except ConfigError as exc:  # the flag the user typed, not the settings key ('a b' in the token file)
        flag = "--token-file" if exc.key == "token" else f"--{exc.key.replace('_', '-')}"
        what = f"the token in {args.token_file} " if exc.key == "token" else ""
        raise InvalidInputError(f"{flag}: {what}{exc.reason}") from None
    with listen(args.host, args.port) as sock:
        opener = _FirstOpen(embstore.open(store))  # a store that cannot be opened: one line, before uvicorn
        try:
            app = create_app(settings, opener=opener)
            _log.info("serving %s (tables %s) on http://%s (Ctrl-C to stop)", store,
                      ", ".join(opener.tables), _address(sock))
            _run_uvicorn(app, sock, args.access_log)
        finally:
            opener.close_unused()
    if app.state.shutdown_error is not None:  # the final flush failed: exit 1, not 0, naming the failure
        raise app.state.shutdown_error
    return 0


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``, bound before the store opens: an address that cannot be used
    (in use, not this machine's, a name that does not resolve) is one line and exit 2, where uvicorn
    logged it after opening the store and exited 3."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:  # socket.gaierror included
        raise InvalidInputError(f"--host {host!r}: {exc.strerror or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise InvalidInputError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def _address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _run_uvicorn(app: object, sock: socket.socket, access_log: bool) -> None:
    """uvicorn on ``sock`` until Ctrl-C or SIGTERM."""
    import uvicorn

    level = logging.getLogger().getEffectiveLevel()
    config = uvicorn.Config(app, access_log=access_log, log_level="info" if level <= logging.INFO else "warning",
                            timeout_keep_alive=KEEP_ALIVE_S)
    server = uvicorn.Server(config)
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again, which would end the process by
    # the signal (status -15) even after a clean shutdown; this handler turns that into a plain return
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        server.run(sockets=[sock])
    except (_Terminated, KeyboardInterrupt):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


class _FirstOpen:
    """The server's opener: the store ``cmd_serve`` opened itself on the first call (the app's startup),
    ``embstore.open`` on later ones (reloads)."""

    def __init__(self, store: Store) -> None:
        self._first: Store | None = store
        self.tables = list(store.tables)

    def __call__(self, path: Path) -> Store:
        store, self._first = self._first, None
        return store if store is not None else embstore.open(path)

    def close_unused(self) -> None:
        """Close the store when the server never took it (it stopped before its startup)."""
        if self._first is not None:
            self._first.close()
            self._first = None


class _Terminated(Exception):
    """SIGTERM outside uvicorn's own handling (re-raised after its shutdown, or before it started)."""


def _terminated(signum: int, frame: object) -> None:
    raise _Terminated()
