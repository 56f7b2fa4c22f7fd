"""The loop-lag timer: a step that holds the loop shows up as a late wake-up."""

from __future__ import annotations

import asyncio
import time

import pytest

from runtime.looplag import LoopLag, watch_loop


class Counted(LoopLag):
    """LoopLag that tells when it has seen `n` wake-ups."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[int, asyncio.Event] = {}

    def observe(self, lag: float, held: float | None = None) -> None:
        super().observe(lag, held)
        if self.samples in self.seen:
            self.seen[self.samples].set()

    async def until(self, n: int) -> None:
        await asyncio.wait_for(self.seen.setdefault(n, asyncio.Event()).wait(), 10)


async def test_a_step_that_holds_the_loop_is_seen_late_by_at_least_as_long() -> None:
    lag, shutdown = Counted(), asyncio.Event()
    watcher = asyncio.create_task(watch_loop(0.001, shutdown, lag))
    await lag.until(3)  # the timer is running
    time.sleep(0.05)  # noqa: ASYNC251 - a step that holds the loop for 50 ms, on purpose
    await lag.until(6)
    shutdown.set()
    await watcher
    # It was due at most one interval after the step began, and ran only after it ended; the
    # thread was busy all along (a sleep is not CPU time: it held the loop without running).
    assert lag.worst >= 0.05 - 0.001
    assert lag.worst_held < lag.worst


async def test_a_step_that_runs_is_counted_as_held() -> None:
    lag, shutdown = Counted(), asyncio.Event()
    watcher = asyncio.create_task(watch_loop(0.001, shutdown, lag))
    await lag.until(3)
    end = time.thread_time() + 0.03
    while time.thread_time() < end:  # 30 ms of CPU on the loop's thread
        pass
    await lag.until(6)
    shutdown.set()
    await watcher
    assert lag.worst_held >= 0.03 - 0.002


async def test_an_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval"):
        await watch_loop(0, asyncio.Event())
