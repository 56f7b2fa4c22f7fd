"""The proxy's Prometheus metrics, read at scrape time from what the proxy counts anyway.

The data plane pays nothing per request for them: `ProxyCollector` turns proxy.stats.Stats'
counters, the router's table and the registry replica's view into metric families when the
runtime's /metrics endpoint (`--metrics-listen`) is scraped. That endpoint serves from its own
thread, while everything read here belongs to the event loop, so the reading is done on the
loop (one hop per scrape, bounded by `READ_TIMEOUT`). What is read there costs the apps and
a handful of workers, never a pass over the fleet: the replica's age per worker is given for the
`OLDEST_WORKERS` workers heard from longest ago (the registry's own metrics count workers by
region and status).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import structlog
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import REGISTRY, CollectorRegistry

from proxy.stats import Stats
from runtime.clock import Clock

log = structlog.get_logger("proxy.metrics")

READ_TIMEOUT = 2.0
"""Longest a scrape waits for the event loop to read the numbers."""
OLDEST_WORKERS = 10
"""Workers (not dead) whose news age a scrape reports: those heard from longest ago."""


class Routes(Protocol):
    """What the collector reads of the router (proxy.router.Router)."""

    def in_flight_by_app(self) -> dict[str, int]: ...


class Workers(Protocol):
    """What the collector reads of the registry replica (registry.replica.Replica)."""

    clock: Clock

    def oldest_news(self, limit: int) -> list[tuple[str, float]]: ...


class Connections(Protocol):
    """What the collector reads of the data plane (proxy.http.HttpProxy)."""

    @property
    def connections(self) -> int: ...

    @property
    def idle_upstream_connections(self) -> int: ...


@dataclass
class _Reading:
    by_app: dict[str, dict[int, int]]
    buckets: list[tuple[float, int]]
    latency_sum: float
    cold_starts: int
    failovers: int
    standby_failures: int
    workers_dead: int
    in_flight: dict[str, int]
    heartbeat_age: dict[str, float]
    connections: int
    idle_upstream: int


class ProxyCollector:
    """A prometheus_client collector over one proxy's counters; see the module docstring.

    Create it on the event loop; `register` adds it to a registry (the default one, which the
    runtime's endpoint serves)."""

    def __init__(
        self,
        stats: Stats,
        *,
        router: Routes | None = None,
        replica: Workers | None = None,
        http: Connections | None = None,
    ) -> None:
        self.stats = stats
        self.router = router
        self.replica = replica
        self.http = http
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()

    def register(self, registry: CollectorRegistry = REGISTRY) -> ProxyCollector:
        registry.register(self)
        return self

    def unregister(self, registry: CollectorRegistry = REGISTRY) -> None:
        registry.unregister(self)

    def _read(self) -> _Reading:
        stats = self.stats
        buckets, latency_sum = stats.histogram()
        replica = self.replica
        ages: dict[str, float] = {}
        if replica is not None:
            now = replica.clock.now()
            for worker_id, heard in replica.oldest_news(OLDEST_WORKERS):
                ages[worker_id] = max(0.0, now - heard)
        return _Reading(
            by_app={app: dict(by_status) for app, by_status in stats.by_app.items()},
            buckets=buckets,
            latency_sum=latency_sum,
            cold_starts=stats.cold_starts,
            failovers=stats.failovers,
            standby_failures=stats.standby_failures,
            workers_dead=stats.workers_dead,
            in_flight=self.router.in_flight_by_app() if self.router is not None else {},
            heartbeat_age=ages,
            connections=self.http.connections if self.http is not None else 0,
            idle_upstream=self.http.idle_upstream_connections if self.http is not None else 0,
        )

    def _on_loop(self, read: Callable[[], _Reading]) -> _Reading | None:
        if threading.get_ident() == self._loop_thread:
            return read()
        if self._loop.is_closed():
            return None
        done: concurrent.futures.Future[_Reading] = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(read())
            except Exception as err:  # reported to the scraping thread
                done.set_exception(err)

        try:
            self._loop.call_soon_threadsafe(run)
            return done.result(timeout=READ_TIMEOUT)
        except (RuntimeError, concurrent.futures.TimeoutError):
            log.warning("metrics_read_failed", reason="the event loop did not answer in time")
            return None

    def collect(self) -> Iterator[Metric]:
        r = self._on_loop(self._read)
        if r is None:
            return
        requests = CounterMetricFamily(
            "nonomad_proxy_requests",
            "HTTP requests the proxy answered, by app (empty: none named) and status.",
            labels=["app", "status"],
        )
        for app, by_status in sorted(r.by_app.items()):
            for status, n in sorted(by_status.items()):
                requests.add_metric([app, str(status)], n)
        yield requests
        yield HistogramMetricFamily(
            "nonomad_proxy_request_duration_seconds",
            "From a request's head received to its response head sent, seconds.",
            buckets=[("+Inf" if b == float("inf") else repr(b), n) for b, n in r.buckets],
            sum_value=r.latency_sum,
        )
        yield CounterMetricFamily(
            "nonomad_proxy_cold_starts",
            "Stopped machines started to serve a request (scale from zero).",
            value=r.cold_starts,
        )
        yield CounterMetricFamily(
            "nonomad_proxy_failovers",
            "Standbys started in place of machines lost with a dead worker.",
            value=r.failovers,
        )
        yield CounterMetricFamily(
            "nonomad_proxy_standby_start_failures",
            "Tries to start a standby for a lost machine that failed.",
            value=r.standby_failures,
        )
        yield CounterMetricFamily(
            "nonomad_proxy_workers_declared_dead",
            "Workers this proxy declared dead (heartbeats stopped and the probe failed).",
            value=r.workers_dead,
        )
        in_flight = GaugeMetricFamily(
            "nonomad_proxy_requests_in_flight",
            "Requests sent to a machine and not answered yet, by app.",
            labels=["app"],
        )
        for app, n in sorted(r.in_flight.items()):
            in_flight.add_metric([app], n)
        yield in_flight
        age = GaugeMetricFamily(
            "nonomad_proxy_registry_heartbeat_age_seconds",
            "How old the replica's latest news of a worker is (its lag behind the worker), "
            f"for the {OLDEST_WORKERS} workers not judged dead heard from longest ago.",
            labels=["worker"],
        )
        for worker, seconds in sorted(r.heartbeat_age.items()):
            age.add_metric([worker], seconds)
        yield age
        yield GaugeMetricFamily(
            "nonomad_proxy_client_connections", "Client connections open.", value=r.connections
        )
        yield GaugeMetricFamily(
            "nonomad_proxy_upstream_idle_connections",
            "Idle pooled connections to machines.",
            value=r.idle_upstream,
        )
