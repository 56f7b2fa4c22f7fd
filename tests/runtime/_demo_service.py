"""A minimal service built on runtime, run as a real process by test_process.py.

python -m tests.runtime._demo_service --listen 127.0.0.1:0
"""

from __future__ import annotations

import asyncio

import structlog
from pydantic_settings import SettingsConfigDict

from runtime import (
    Service,
    ServiceSettings,
    configure_logging,
    main_entry,
    settings_or_exit,
    setup_tracing,
)
from tests.runtime import _echo

log = structlog.get_logger(__name__)


class DemoSettings(ServiceSettings):
    """The demo's settings: the common ones plus a region."""

    model_config = SettingsConfigDict(env_prefix="DEMO_")

    region: str = "local"


async def heartbeat(shutdown: asyncio.Event) -> None:
    """A background loop that exits when the service shuts down."""
    await shutdown.wait()
    log.info("heartbeat_stopped")


async def close_store() -> None:
    """Stands in for closing a database on shutdown."""
    log.info("store_closed")


def make_service(argv: list[str]) -> Service:
    settings = settings_or_exit(DemoSettings, argv, "demo")
    configure_logging("demo", settings.log_level, region=settings.region)
    setup_tracing("demo", **{"cloud.region": settings.region})
    service = Service("demo", settings)
    service.add(
        _echo.EchoServicer(),
        _echo.add_EchoServiceServicer_to_server,
        _echo.DESCRIPTOR,
        _echo.map_error,
    )
    service.spawn("heartbeat", heartbeat)
    service.on_shutdown(close_store)
    return service


if __name__ == "__main__":
    main_entry(make_service)
