"""Prometheus metrics in a per-app registry (``embstore.server.middleware`` feeds the request ones).

Request metrics are labelled by route template (``/v1/tables/{name}/lookup``).
Store metrics (per-tier hits and misses, pooled-cache hits, batching) are read
from the store's own counters when ``/metrics`` is scraped: statistics are
returned values, this module only formats them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TIER_COUNTERS = ("hits", "misses", "evictions", "bytes_read", "bytes_written")
TIER_GAUGES = ("resident_rows", "capacity_rows")


class RateMeter:
    """Requests per second per endpoint over a sliding window of whole seconds (for the status page)."""

    def __init__(self, window: int = 10) -> None:
        self.window = window
        self._buckets: dict[str, list[int]] = {}  # endpoint -> [count] * (window + 1)
        self._stamp: dict[str, list[int]] = {}  # endpoint -> the second each bucket counts

    def add(self, endpoint: str, now: float | None = None) -> None:
        sec = int(time.monotonic() if now is None else now)
        size = self.window + 1
        counts = self._buckets.setdefault(endpoint, [0] * size)
        stamps = self._stamp.setdefault(endpoint, [-1] * size)
        i = sec % size
        if stamps[i] != sec:
            stamps[i], counts[i] = sec, 0
        counts[i] += 1

    def rates(self, now: float | None = None) -> dict[str, float]:
        """endpoint -> requests per second over the last ``window`` whole seconds."""
        sec = int(time.monotonic() if now is None else now)
        out = {}
        for endpoint, counts in self._buckets.items():
            stamps = self._stamp[endpoint]
            out[endpoint] = sum(c for c, s in zip(counts, stamps) if sec - self.window <= s < sec) / self.window
        return out


class Metrics:
    """The registry of one app and its request instruments."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("embstore_http_requests", "HTTP requests answered, by endpoint and status",
                                ["method", "endpoint", "status"], registry=self.registry)
        self.latency = Histogram("embstore_http_request_duration_seconds",
                                 "Time from request to the end of the answer, by endpoint",
                                 ["method", "endpoint"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.in_flight = Gauge("embstore_http_requests_in_flight", "Requests being answered",
                               registry=self.registry)
        self.rates = RateMeter()
        self.totals: dict[str, int] = {}
        self._children: dict[tuple[str, str, int], tuple[Any, Any]] = {}  # labels() is slow; resolve once

    def observe(self, method: str, endpoint: str, status: int, seconds: float) -> None:
        key = (method, endpoint, status)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = (self.requests.labels(method, endpoint, str(status)),
                                           self.latency.labels(method, endpoint))
        child[0].inc()
        child[1].observe(seconds)
        name = f"{method} {endpoint}"
        self.rates.add(name)
        self.totals[name] = self.totals.get(name, 0) + 1


class StoreCollector(Collector):
    """Reads the served store's statistics at scrape time (``snapshot()`` -> per-table dicts)."""

    def __init__(self, snapshot: Callable[[], dict[str, dict[str, Any]]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        snap = self._snapshot()
        tier_c = {k: CounterMetricFamily(f"embstore_tier_{k}", f"Rows ({k}) counted by each tier",
                                         labels=["table", "tier"]) for k in TIER_COUNTERS}
        tier_g = {k: GaugeMetricFamily(f"embstore_tier_{k}", f"Rows ({k}) of each tier", labels=["table", "tier"])
                  for k in TIER_GAUGES}
        pc_hits = CounterMetricFamily("embstore_pooled_cache_hits", "Bags answered from the pooled cache",
                                      labels=["table"])
        pc_miss = CounterMetricFamily("embstore_pooled_cache_misses", "Bags pooled from the tiers",
                                      labels=["table"])
        pc_ratio = GaugeMetricFamily("embstore_pooled_cache_hit_ratio", "hits / (hits + misses)", labels=["table"])
        pc_bytes = GaugeMetricFamily("embstore_pooled_cache_bytes", "Bytes held by the pooled cache",
                                     labels=["table"])
        batches = CounterMetricFamily("embstore_lookup_batches", "Tier reads made for lookup requests",
                                      labels=["table"])
        batched = CounterMetricFamily("embstore_lookup_batched_requests", "Lookup requests served by those reads",
                                      labels=["table"])
        lookups = CounterMetricFamily("embstore_table_lookups", "Ids looked up (before dedup)", labels=["table"])
        for table, s in snap.items():
            for tier, counters in s["stats"].items():
                for k, fam in tier_c.items():
                    fam.add_metric([table, tier], counters.get(k, 0))
                for k, fam in tier_g.items():
                    fam.add_metric([table, tier], counters.get(k, 0))
            pc = s["pooled_cache"]
            pc_hits.add_metric([table], pc["hits"])
            pc_miss.add_metric([table], pc["misses"])
            pc_ratio.add_metric([table], pc["hit_ratio"])
            pc_bytes.add_metric([table], pc["bytes"])
            batches.add_metric([table], s["batching"]["batches"])
            batched.add_metric([table], s["batching"]["requests"])
            lookups.add_metric([table], s["lookups"])
        yield from tier_c.values()
        yield from tier_g.values()
        yield from (pc_hits, pc_miss, pc_ratio, pc_bytes, batches, batched, lookups)
