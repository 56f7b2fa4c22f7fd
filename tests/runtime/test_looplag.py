"""The loop-lag timer: a step that holds the loop shows up as a late wake-up."""

from __future__ import annotations

import asyncio
import time

import pytest

from runtime.looplag import LoopLag, watch_loop


async def test_a_step_that_holds_the_loop_is_seen_late_by_at_least_as_long() -> None:
    lag, shutdown = LoopLag(), asyncio.Event()
    watcher = asyncio.create_task(watch_loop(0.001, shutdown, lag))
    while lag.samples < 3:  # the timer is running
        await asyncio.sleep(0.001)
    time.sleep(0.05)  # a step that holds the loop for 50 ms
    while lag.samples < 6:
        await asyncio.sleep(0.001)
    shutdown.set()
    await watcher
    # It was due at most one interval after the step began, and ran only after it ended.
    assert lag.worst >= 0.05 - 0.001


async def test_an_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval"):
        await watch_loop(0, asyncio.Event())
