"""A real uvicorn server in a background thread on a free loopback port (tests, benchmarks).

::

    with ServerThread(create_app(settings)) as srv:
        httpx.get(srv.url + "/healthz")
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn


def wait_healthy(url: str, proc: Any = None, timeout: float = 120.0) -> None:
    """Poll ``url``/healthz until it answers 200; fail early when ``proc`` (a server subprocess) exits.
    On any failure ``proc`` is killed: a server that never got healthy must not outlive its caller."""
    try:
        _poll_healthy(url, proc, timeout)
    except BaseException:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        raise


def _poll_healthy(url: str, proc: Any, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} during startup")
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer /healthz within {timeout} s")
        time.sleep(0.1)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServerThread:
    """Runs ``app`` under uvicorn until :meth:`stop` (lifespan startup and shutdown included)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int | None = None, **config: Any) -> None:
        self.host = host
        self.port = port or free_port(host)
        config.setdefault("log_level", "warning")
        config.setdefault("access_log", False)
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=self.port, lifespan="on", **config))
        self._thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server stopped during startup (see its log)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not start within {timeout} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Graceful shutdown: requests in flight finish, then the lifespan flushes and closes the store."""
        self.server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the server did not stop within {timeout} s")

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
