"""The `console` fixture: the console's app in process over fakes (tests.console.support),
its live hub running, its client logged in with the admin token. `cluster`: a real cluster and
console process for a module (tests.console.cluster), made only for a module that asks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from nonomad.console import streams
from tests.console.cluster import ConsoleProcess, console_cluster
from tests.console.support import Console, T
from tests.proxy.support import ProxyFleet


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
        await c.login()
        yield c
    finally:
        c.closing.set()
        c.sessions.close()
        shutdown.set()
        await asyncio.wait_for(running, T)
        await c.http.aclose()


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, image_source: Path
) -> Iterator[tuple[ProxyFleet, ConsoleProcess]]:
    yield from console_cluster(tmp_path_factory.mktemp("console"), image_source)
