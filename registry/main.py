"""The registry console script: a replica on its own, for others to announce to and follow."""

from __future__ import annotations

import sys

from registry.service import serve_replica
from registry.settings import RegistrySettings
from runtime import Service, configure_logging, main_entry, settings_or_exit, setup_tracing
from runtime.heap import no_full_collections
from runtime.server import use_event_loop


def build(argv: list[str]) -> Service:
    """Load settings and wire the replica and its gRPC service."""
    settings = settings_or_exit(RegistrySettings, argv, "registry")
    configure_logging("registry", settings.log_level)
    setup_tracing("registry")
    service = Service("registry", settings)
    serve_replica(service, settings.replica(), settings.workers)
    return service


def main() -> None:
    # Process-wide choices, made before the loop runs (build() reads the settings again in
    # it): the event loop, and a cycle collector that never walks the old objects.
    no_full_collections()
    use_event_loop(settings_or_exit(RegistrySettings, sys.argv[1:], "registry").event_loop)
    main_entry(build)


if __name__ == "__main__":
    main()
