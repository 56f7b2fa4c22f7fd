"""Time, injected: restart backoff and other timers take a clock so tests can advance it."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since the epoch."""
        ...

    async def sleep_until(self, when: float) -> None:
        """Return once now() >= when."""
        ...


class SystemClock:
    """The real clock."""

    def now(self) -> float:
        return time.time()

    async def sleep_until(self, when: float) -> None:
        # Again for what is left: a loop's timer may fire early by a fraction of a millisecond
        # (uvloop's count whole milliseconds and round the delay down as often as up), and a
        # caller that checks now() >= when (fsm's TimerFired) would then see its timer never fire.
        while (delay := when - time.time()) > 0:  # noqa: ASYNC110 - time is what it waits for
            await asyncio.sleep(delay)


SYSTEM_CLOCK: Clock = SystemClock()
"""The real clock, for a default argument."""


class ManualClock:
    """A clock that moves only when a test calls advance()."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._now = start
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._ids = itertools.count()

    def now(self) -> float:
        return self._now

    async def sleep_until(self, when: float) -> None:
        if when <= self._now:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (when, next(self._ids), fut))
        await fut

    @property
    def sleepers(self) -> int:
        return sum(1 for _, _, f in self._sleepers if not f.done())

    def advance(self, seconds: float) -> None:
        self._now += seconds
        while self._sleepers and self._sleepers[0][0] <= self._now:
            _, _, fut = heapq.heappop(self._sleepers)
            if not fut.done():
                fut.set_result(None)
