"""The registry console script: a replica on its own, for others to announce to and follow."""

from __future__ import annotations

from registry.service import serve_replica
from registry.settings import RegistrySettings
from runtime import Service, configure_logging, main_entry, settings_or_exit, setup_tracing


def build(argv: list[str]) -> Service:
    """Load settings and wire the replica and its gRPC service."""
    settings = settings_or_exit(RegistrySettings, argv, "registry")
    configure_logging("registry", settings.log_level)
    setup_tracing("registry")
    service = Service("registry", settings)
    serve_replica(service, settings.replica(), settings.workers)
    return service


def main() -> None:
    main_entry(build)
