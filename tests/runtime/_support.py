"""Helpers shared by the runtime tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from runtime import Service

START_TIMEOUT = 5.0
STOP_TIMEOUT = 10.0


@contextlib.asynccontextmanager
async def running(service: Service) -> AsyncIterator[asyncio.Task[int]]:
    """Run `service` in this event loop until the block ends; yield the task of `run()`.

    The block may stop the service itself and await the task; otherwise it is stopped here.
    """
    task = asyncio.create_task(service.run(handle_signals=False))
    try:
        async with asyncio.timeout(START_TIMEOUT):
            await service.wait_ready()
        yield task
    finally:
        if not task.done():
            service.request_shutdown()
        async with asyncio.timeout(STOP_TIMEOUT):
            await asyncio.gather(task, return_exceptions=True)
