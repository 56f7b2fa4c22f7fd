"""Helpers shared by the runtime tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from runtime import Service, ServiceSettings
from tests.runtime import _echo

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


SERVING = health_pb2.HealthCheckResponse.SERVING


def echo_service(name: str = "test", **settings: Any) -> tuple[Service, _echo.EchoServicer]:
    service = Service(name, ServiceSettings(**settings))
    servicer = _echo.EchoServicer()
    service.add(
        servicer, _echo.add_EchoServiceServicer_to_server, _echo.DESCRIPTOR, _echo.map_error
    )
    return service, servicer


async def health_status(channel: grpc.aio.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return int(response.status)
