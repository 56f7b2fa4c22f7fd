"""Counters for the proxy's admin API and its Prometheus metrics (proxy.metrics): requests by
app and status, latency, cold starts, failovers.

Recording is O(1) and allocation-free on the request path (the data plane calls `record` once
per request); the work of sorting and summing happens in `snapshot` and in the metrics
collector, which run rarely. Memory is bounded: latencies live in a fixed-size ring of the most
recent requests (for percentiles) and in a fixed set of cumulative histogram buckets.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left
from typing import Any, Final

DEFAULT_WINDOW = 4096
# Upper bounds (seconds) of the latency histogram's buckets; +Inf is implied.
LATENCY_BUCKETS: Final = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
NO_APP: Final = ""
"""The app of a request that named none the proxy knows (a bad Host, a malformed request)."""


class Stats:
    """What the edge has done since it started, plus latency over the recent `window` requests."""

    __slots__ = (
        "_buckets",
        "_cold_starts",
        "_failovers",
        "_latencies",
        "_mask",
        "_next",
        "_standby_failures",
        "_sum",
        "_workers_dead",
        "by_app",
        "latency_by_app",
    )

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError("window must be at least 1")
        size = 1 << (window - 1).bit_length()  # a power of two, so the ring index is a mask
        self._latencies = array("d", bytes(8 * size))
        self._mask = size - 1
        self._next = 0
        self._buckets = [0] * (len(LATENCY_BUCKETS) + 1)  # the last one is +Inf
        self._sum = 0.0
        self._cold_starts = 0
        self._failovers = 0
        self._standby_failures = 0
        self._workers_dead = 0
        self.by_app: dict[str, dict[int, int]] = {}
        """Requests answered, by app (NO_APP for none) and status."""
        self.latency_by_app: dict[str, list[float]] = {}
        """Per app, the latency histogram's counts by bucket (as `_buckets`), then their sum
        in seconds, as the last item."""

    def record(self, app: str | None, status: int, seconds: float) -> None:
        """One request for `app` answered with `status` after `seconds` (head received to
        response head sent)."""
        try:
            by_status = self.by_app[app or NO_APP]
        except KeyError:
            by_status = self.by_app[app or NO_APP] = {}
        by_status[status] = by_status.get(status, 0) + 1
        i = self._next
        self._latencies[i & self._mask] = seconds
        self._next = i + 1
        bucket = bisect_left(LATENCY_BUCKETS, seconds)
        self._buckets[bucket] += 1
        self._sum += seconds
        try:
            latency = self.latency_by_app[app or NO_APP]
        except KeyError:
            latency = self.latency_by_app[app or NO_APP] = [0] * (len(LATENCY_BUCKETS) + 2)
        latency[bucket] += 1
        latency[-1] += seconds

    def cold_start(self) -> None:
        """The router started a stopped machine to serve a request."""
        self._cold_starts += 1

    def failover(self) -> None:
        """The router moved traffic off a dead worker: a standby was started."""
        self._failovers += 1

    def standby_failed(self) -> None:
        """A try to start a standby for a lost machine failed."""
        self._standby_failures += 1

    def worker_dead(self) -> None:
        """This proxy declared a worker dead (heartbeats stopped and the probe failed)."""
        self._workers_dead += 1

    @property
    def requests(self) -> int:
        return self._next

    @property
    def cold_starts(self) -> int:
        return self._cold_starts

    @property
    def failovers(self) -> int:
        return self._failovers

    @property
    def standby_failures(self) -> int:
        return self._standby_failures

    @property
    def workers_dead(self) -> int:
        return self._workers_dead

    @property
    def by_status(self) -> dict[int, int]:
        """Requests answered by status, over every app."""
        out: dict[int, int] = {}
        for by_status in list(self.by_app.values()):
            for status, n in list(by_status.items()):
                out[status] = out.get(status, 0) + n
        return out

    def histogram(self, app: str | None = None) -> tuple[list[tuple[float, int]], float]:
        """The latency histogram: (upper bound, cumulative count) per bucket, the last with
        bound +Inf, and the sum of every latency recorded (seconds); with `app`, of that app's
        requests alone."""
        if app is None:
            counts, total_seconds = list(self._buckets), self._sum
        else:
            kept = self.latency_by_app.get(app) or [0] * (len(LATENCY_BUCKETS) + 2)
            counts, total_seconds = [int(n) for n in kept[:-1]], kept[-1]
        out = []
        total = 0
        for bound, n in zip((*LATENCY_BUCKETS, math.inf), counts, strict=True):
            total += n
            out.append((bound, total))
        return out, total_seconds

    def percentiles_ms(self, *pcts: float) -> dict[str, float | None]:
        """Nearest-rank percentiles of the recent window, in ms (None when nothing recorded)."""
        filled = min(self._next, self._mask + 1)
        window = sorted(self._latencies[:filled])
        out: dict[str, float | None] = {}
        for pct in pcts:
            key = f"p{pct:g}"
            if not window:
                out[key] = None
                continue
            rank = max(1, math.ceil(pct / 100 * len(window)))
            out[key] = round(window[rank - 1] * 1000, 3)
        return out

    def snapshot(self) -> dict[str, Any]:
        """A JSON-ready view: totals, statuses, and p50/p90/p99 latency over the recent window."""
        return {
            "requests": self._next,
            "by_status": {str(code): n for code, n in sorted(self.by_status.items())},
            "cold_starts": self._cold_starts,
            "failovers": self._failovers,
            "latency_ms": self.percentiles_ms(50, 90, 99),
            "latency_window": min(self._next, self._mask + 1),
        }
