"""Counters for the proxy's admin API: requests by status, cold starts, failovers, latency.

Recording is O(1) and allocation-free on the request path (the data plane calls `record` once
per request); the work of sorting happens in `snapshot`, which the admin API calls rarely.
Memory is bounded: latencies live in a fixed-size ring of the most recent requests.
"""

from __future__ import annotations

import math
from array import array
from typing import Any

DEFAULT_WINDOW = 4096


class Stats:
    """What the edge has done since it started, plus latency over the recent `window` requests."""

    __slots__ = ("_cold_starts", "_failovers", "_latencies", "_mask", "_next", "by_status")

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError("window must be at least 1")
        size = 1 << (window - 1).bit_length()  # a power of two, so the ring index is a mask
        self._latencies = array("d", bytes(8 * size))
        self._mask = size - 1
        self._next = 0
        self._cold_starts = 0
        self._failovers = 0
        self.by_status: dict[int, int] = {}

    def record(self, status: int, seconds: float) -> None:
        """One request answered with `status` after `seconds` (head received to response sent)."""
        by_status = self.by_status
        by_status[status] = by_status.get(status, 0) + 1
        i = self._next
        self._latencies[i & self._mask] = seconds
        self._next = i + 1

    def cold_start(self) -> None:
        """The router started a stopped machine to serve a request."""
        self._cold_starts += 1

    def failover(self) -> None:
        """The router moved traffic off a dead worker (started standbys)."""
        self._failovers += 1

    @property
    def requests(self) -> int:
        return self._next

    @property
    def cold_starts(self) -> int:
        return self._cold_starts

    @property
    def failovers(self) -> int:
        return self._failovers

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
