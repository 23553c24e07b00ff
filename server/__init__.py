"""FastAPI lookup server (SPEC section 5): ``create_app(ServerSettings(store=PATH))``.

Modules: ``settings`` (what a server is started with), ``app`` (routes),
``state`` (leases, flush, hot reload), ``batching`` (micro-batched lookups),
``pooled_cache`` (SDM's pooled-embedding cache), ``protocol`` (JSON schemas and
the binary protocol), ``middleware`` (metrics, body size, timeout), ``metrics``
(Prometheus), ``status_page`` (HTML at ``/``), ``errors`` (errors -> status
codes), ``testing`` (a real uvicorn in a thread, for tests and benchmarks).
"""

from __future__ import annotations

from typing import Any

from embstore.server.settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]


def __getattr__(name: str) -> Any:  # FastAPI is imported only when an app is built
    if name == "create_app":
        from embstore.server.app import create_app

        return create_app
    raise AttributeError(f"module 'embstore.server' has no attribute {name!r}")
