"""How late the event loop runs: a timer that asks to wake every `interval` and records by how
much it overslept, which is how long something held the loop.

    nonomad_event_loop_lag_seconds (histogram)
        How late each wake-up was.
    nonomad_event_loop_lag_max_seconds
        The latest wake-up since the process started.
    nonomad_event_loop_held_seconds (histogram), nonomad_event_loop_held_max_seconds
        The part of each late wake-up that the loop's thread spent running: a step holding the
        loop. The rest is time the thread waited for a CPU (a busy host, not this process's
        code), which a shared machine shows plenty of.

Every service runs one when `loop_lag_interval` is set (`Service` starts it). A stall shorter
than the interval is seen only when it overlaps a wake-up, so the benchmarks measure with a
1 ms interval; a service in production can afford a coarser one.
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import Gauge, Histogram

__all__ = ["LoopLag", "watch_loop"]

BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LAG = Histogram(
    "nonomad_event_loop_lag_seconds",
    "How late the event loop woke a timer: how long something held the loop.",
    buckets=BUCKETS,
)
LAG_MAX = Gauge(
    "nonomad_event_loop_lag_max_seconds",
    "The latest the event loop woke a timer since the process started.",
)
HELD = Histogram(
    "nonomad_event_loop_held_seconds",
    "Of each late wake-up, the time the loop's thread spent running (a step holding it).",
    buckets=BUCKETS,
)
HELD_MAX = Gauge(
    "nonomad_event_loop_held_max_seconds",
    "The longest the event loop's thread ran past a timer since the process started.",
)


class LoopLag:
    """The worst lateness seen, for callers in the same process (tests, in-process benches)."""

    def __init__(self) -> None:
        self.worst = 0.0
        self.worst_held = 0.0
        self.samples = 0

    def observe(self, lag: float, held: float | None = None) -> None:
        """A wake-up `lag` seconds late, of which the thread ran `held` (default: all)."""
        held = lag if held is None else min(lag, held)
        self.samples += 1
        LAG.observe(lag)
        HELD.observe(held)
        if lag > self.worst:
            self.worst = lag
            LAG_MAX.set(lag)
        if held > self.worst_held:
            self.worst_held = held
            HELD_MAX.set(held)


async def watch_loop(interval: float, shutdown: asyncio.Event, lag: LoopLag | None = None) -> None:
    """Wake every `interval` seconds until `shutdown`, recording how late each wake-up was."""
    if not interval > 0:
        raise ValueError(f"interval must be > 0 seconds, got {interval!r}")
    lag = lag if lag is not None else LoopLag()
    loop = asyncio.get_running_loop()
    while not shutdown.is_set():
        due, ran = loop.time() + interval, time.thread_time()
        await asyncio.sleep(interval)
        late = max(0.0, loop.time() - due)
        # The thread's CPU time since the timer was set: what ran (interval included) before
        # this wake-up. What it ran beyond the interval is how long a step held the loop.
        lag.observe(late, max(0.0, time.thread_time() - ran - interval))
