"""The registry replica's Prometheus metrics (default registry; served with `--metrics-listen`
by the registry, and by flaps and proxy, which embed a replica).

    nonomad_registry_events_applied_total{kind}
        Worker stream items applied to the view: `snapshot`, `change`, `heartbeat` (repeats
        and items from stale sources, which change nothing, are not counted).
    nonomad_registry_replication_lag_seconds (histogram)
        From a machine change's time on its worker (`MachineEvent.time`) to this replica
        applying it, on the replica's clock. Through an upstream replica it is the whole way
        from the worker. Clock skew between hosts shows up here; negative values count as 0.
    nonomad_registry_replication_lag_last_seconds{worker}
        The same, for the last change applied from each worker.
    nonomad_registry_workers_forgotten_total
        Workers dropped with their rows after being dead longer than `forget_after`.
    nonomad_registry_log_restarts_total
        Workers whose log started over (a wiped data dir): their rows were replaced.
    nonomad_registry_workers{region, status}
        Workers known, by liveness (`alive`, `suspect`, `dead`, `unknown`: not heard from yet),
        read from the running replicas at scrape time (one per process outside tests; several
        are summed).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from flyd.v1 import worker_pb2
from registry.view import View, status_name

__all__ = ["FORGOTTEN", "LOG_RESTARTS", "applied", "track", "untrack"]

EVENTS_APPLIED = Counter(
    "nonomad_registry_events_applied",
    "Worker stream items applied to the replica's view, by kind (snapshot, change, heartbeat).",
    ["kind"],
)
_APPLIED = {kind: EVENTS_APPLIED.labels(kind) for kind in ("snapshot", "change", "heartbeat")}
REPLICATION_LAG = Histogram(
    "nonomad_registry_replication_lag_seconds",
    "From a machine change's time on its worker to this replica applying it.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
FORGOTTEN = Counter(
    "nonomad_registry_workers_forgotten",
    "Workers dropped with their rows after being dead longer than forget_after.",
)
LOG_RESTARTS = Counter(
    "nonomad_registry_log_restarts",
    "Workers whose log started over (a wiped data dir): their rows were replaced.",
)
LAST_LAG = Gauge(
    "nonomad_registry_replication_lag_last_seconds",
    "Replication lag of the last change applied from each worker.",
    ["worker"],
)


# The per-worker gauge children, so applying a change skips the labels() lookup and its lock.
_last_lag: dict[str, Gauge] = {}


def applied(worker_id: str, item: worker_pb2.WatchEventsResponse, now: float) -> None:
    """Count an item the view applied; `now` is the replica's clock (seconds since the epoch)."""
    kind = item.WhichOneof("item")
    counter = _APPLIED.get(kind or "")
    if counter is None:
        return
    counter.inc()
    if kind == "change":
        stamp = item.change.event.time
        if stamp.seconds or stamp.nanos:
            lag = max(0.0, now - (stamp.seconds + stamp.nanos * 1e-9))
            REPLICATION_LAG.observe(lag)
            gauge = _last_lag.get(worker_id)
            if gauge is None:
                gauge = _last_lag[worker_id] = LAST_LAG.labels(worker_id)
            gauge.set(lag)


class _WorkersByStatus(Collector):
    """`nonomad_registry_workers`, counted from the tracked views when scraped."""

    def __init__(self) -> None:
        self.views: weakref.WeakSet[View] = weakref.WeakSet()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "nonomad_registry_workers",
            "Workers known to this process's replicas, by region and liveness.",
            labels=["region", "status"],
        )
        counts: dict[tuple[str, str], int] = {}
        # Scrapes run on the metrics thread: copy the set and each view's rows before reading.
        for view in list(self.views):
            for region, status, n in view.liveness():
                named = (region, status_name(status))
                counts[named] = counts.get(named, 0) + n
        for labels, n in sorted(counts.items()):
            family.add_metric(list(labels), n)
        yield family


_WORKERS = _WorkersByStatus()
REGISTRY.register(_WORKERS)


def track(view: View) -> None:
    """Count this view's workers in `nonomad_registry_workers` (while it is alive)."""
    _WORKERS.views.add(view)


def untrack(view: View) -> None:
    _WORKERS.views.discard(view)
