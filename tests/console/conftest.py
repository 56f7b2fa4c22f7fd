"""The `console` fixture: the console's app in process over fakes (tests.console.support),
its live hub running."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from nonomad.console import streams
from tests.console.support import Console, T


@pytest.fixture
async def console(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Console]:
    monkeypatch.setattr(streams, "COALESCE", 0.0)  # no wait for the rest of a burst
    c = Console()
    shutdown = asyncio.Event()
    running = asyncio.create_task(c.live.run(shutdown))
    async with asyncio.timeout(T):
        await c.replica.following.wait()
        await c.live.placements_watched.wait()
    try:
        yield c
    finally:
        c.closing.set()
        shutdown.set()
        await asyncio.wait_for(running, T)
        await c.http.aclose()
