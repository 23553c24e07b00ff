"""What a server is started with: one frozen, validated settings object.

The ``embstore serve`` flags map one to one onto these fields; tests and
benchmarks build it directly.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from embstore.errors import ConfigError


@dataclass(frozen=True)
class ServerSettings:
    """Settings of one lookup server.

    - ``store``: the store directory to serve (opened in the app's lifespan).
    - ``token``: when set, ``PUT .../rows`` and ``POST /v1/admin/reload`` need
      ``Authorization: Bearer TOKEN``.
    - ``max_ids``: ids per request (lookup, pooled, rows, predict), and also bags
      of a pooled request and samples of a predict request (each is a row of the
      answer); more is ``413``.
    - ``max_body_bytes``: request body size; more is ``413``.
    - ``request_timeout``: seconds before a request is answered ``504`` (0 = none).
    - ``durable_writes``: ``PUT .../rows`` answers ``204`` only once the rows are
      durable: each write is appended to the store's write-ahead log, and
      concurrent writers share one ``fdatasync`` of it (group commit), so an
      acknowledged write survives a crash of the server or the machine (the
      next open replays the log). Off: the answer comes when the rows are
      applied, and a crash loses what the next periodic flush would have saved.
    - ``flush_interval``: seconds between flushes of written rows into the tiers
      (0 = only on shutdown and reload). With durable writes the log already
      keeps them safe, and a flush rewrites each written table's home index
      (4 bytes per row for a ``log`` home), so the default is a rare 30 s; it
      bounds the log's size and the replay on the next open. Without durable
      writes it is the window of writes a crash can lose: choose ~1 s.
    - ``batching``: coalesce concurrent lookups of a table into one tier read.
    - ``batch_wait``: seconds an idle table waits for more lookups before
      reading (at most 0.1). The default 0 coalesces what queues up while a
      read is running, which under load is everything; a wait only adds
      latency at low load (``tools/bench/bench_server.py`` measured no
      throughput gain from 0.5 ms on a Zipf SSD workload).
    - ``batch_max_ids``: ids per coalesced read.
    - ``pooled_cache_bytes``: per-table budget of the pooled-embedding cache (0 = off).
    - ``freeze_gc``: after the store is open, collect and ``gc.freeze()`` what
      exists, so later full collections skip the ~150k long-lived objects of
      numpy/numba/FastAPI (a 60-80 ms pause each on a small machine, a p99
      spike). Process-wide, so ``embstore serve`` sets it and library users opt in.
    """

    store: Path
    token: str | None = None
    max_ids: int = 1_000_000
    max_body_bytes: int = 64 << 20
    request_timeout: float = 30.0
    durable_writes: bool = True
    flush_interval: float = 30.0
    batching: bool = True
    batch_wait: float = 0.0
    batch_max_ids: int = 1 << 16
    pooled_cache_bytes: int = 32 << 20
    freeze_gc: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "store", Path(self.store))
        if self.token is not None and (not self.token or any(c.isspace() for c in self.token)):
            raise ConfigError("token", "must be a non-empty string without whitespace")
        for key in ("max_ids", "max_body_bytes", "batch_max_ids"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(key, f"must be a positive integer, got {value!r}")
        if self.pooled_cache_bytes < 0:
            raise ConfigError("pooled_cache_bytes", f"must be >= 0, got {self.pooled_cache_bytes}")
        for key, upper in (("request_timeout", 86_400.0), ("flush_interval", 86_400.0), ("batch_wait", 0.1)):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 <= value <= upper:
                raise ConfigError(key, f"must be a number of seconds in [0, {upper:g}], got {value!r}")

    @staticmethod
    def read_token(path: str | os.PathLike[str]) -> str:
        """The token in ``path`` (surrounding whitespace dropped); an empty file is an error."""
        try:
            token = Path(path).read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            raise ConfigError("token_file", f"{path} does not exist") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError("token_file", f"{path} cannot be read as a text token: {exc}") from None
        if not token:
            raise ConfigError("token_file", f"{path} is empty")
        return token
