"""Fixtures for end-to-end tests: a real OTLP trace receiver, and a fleet that exports to it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.e2e.otlp import OtlpReceiver
from tests.flaps.conftest import Fleet


@pytest.fixture
def otlp() -> Iterator[OtlpReceiver]:
    """A trace receiver on 127.0.0.1; `otlp.env()` makes a process export to it."""
    receiver = OtlpReceiver().start()
    try:
        yield receiver
    finally:
        receiver.stop()


@pytest.fixture
async def traced_fleet(
    tmp_path: Path, image_source: Path, otlp: OtlpReceiver
) -> AsyncIterator[Fleet]:
    """The flaps tests' Fleet, every process of which exports its spans to `otlp`."""
    fleet = Fleet(tmp_path, image_source, env=otlp.env())
    try:
        yield fleet
    finally:
        await fleet.close()
