"""Fixtures of the proxy's data-plane tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.proxy.http_support import Handler, Start, TestBackend, echo


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    """Start real backends; all are stopped after the test."""
    started: list[TestBackend] = []

    async def _start(machine_id: str, handler: Handler = echo) -> TestBackend:
        backend = await TestBackend(machine_id, handler).start()
        started.append(backend)
        return backend

    yield _start
    for backend in started:
        await backend.stop()
