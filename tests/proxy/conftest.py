"""Fixtures of the proxy's data-plane tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.proxy.http_support import FakeRouter, Handler, Start, TestBackend, echo


@pytest.fixture(params=["task", "fast"])
def router_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A test that uses it runs twice: with a router that answers only through `acquire` (each
    request goes through the connection's task) and with one that also offers `try_acquire`
    (requests start from the parser callback when a pooled connection is idle)."""
    monkeypatch.setattr(FakeRouter, "fast_default", request.param == "fast")
    return str(request.param)


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
