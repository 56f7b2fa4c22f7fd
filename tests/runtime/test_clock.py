"""The clocks keep their promise: sleep_until returns only once now() >= when."""

from __future__ import annotations

import asyncio

import pytest

from runtime import clock
from runtime.clock import ManualClock, SystemClock

EARLY = 0.0004


class EarlyTimers:
    """Wall time and a loop whose first timer wakes EARLY seconds before it was asked to, as
    uvloop's do at times (they count whole milliseconds and round the delay down as often as
    up): stands in for `time` and `asyncio` in runtime.clock."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0
        self.sleeps: list[float] = []

    def time(self) -> float:
        return self.now

    async def sleep(self, delay: float) -> None:
        self.sleeps.append(delay)
        self.now += delay - (EARLY if len(self.sleeps) == 1 else 0.0)


async def test_the_system_clock_does_not_return_before_when_when_the_loop_wakes_early(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = EarlyTimers()
    monkeypatch.setattr(clock, "time", fake)
    monkeypatch.setattr(clock, "asyncio", fake)
    when = fake.now + 0.5
    await SystemClock().sleep_until(when)
    # A restart backoff's TimerFired checks exactly this; early, the machine never restarted.
    assert fake.now >= when
    assert fake.sleeps == [pytest.approx(0.5), pytest.approx(EARLY, abs=1e-6)]
    # A time already past: no sleep at all.
    await SystemClock().sleep_until(when - 1)
    assert len(fake.sleeps) == 2


async def test_the_manual_clock_returns_once_advanced_to_when() -> None:
    manual = ManualClock()
    when = manual.now() + 5.0
    sleeper = asyncio.ensure_future(manual.sleep_until(when))
    await asyncio.sleep(0)
    manual.advance(4.999)
    await asyncio.sleep(0)
    assert not sleeper.done()
    manual.advance(0.001)
    await asyncio.wait_for(sleeper, 1.0)
    assert manual.now() >= when
