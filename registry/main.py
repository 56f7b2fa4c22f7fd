"""The registry console script: a replica on its own, for others to announce to and follow."""

from __future__ import annotations

from nonomad.runtime import Service, configure_logging, main_entry, settings_or_exit, setup_tracing
from registry.replica import Replica
from registry.service import RegistryServicer, map_error
from registry.settings import RegistrySettings
from registry.v1 import registry_pb2, registry_pb2_grpc


def build(argv: list[str]) -> Service:
    """Load settings and wire the replica and its gRPC service."""
    settings = settings_or_exit(RegistrySettings, argv, "registry")
    configure_logging("registry", settings.log_level)
    setup_tracing("registry")
    replica = Replica(
        suspect_after=settings.suspect_after,
        dead_after=settings.dead_after,
        upstream=settings.upstream,
        peers=settings.peers,
        retry_max=settings.retry_max,
    )
    for address in settings.workers:
        replica.add_address(address)
    service = Service("registry", settings)
    service.add(
        RegistryServicer(replica, draining=service.draining),
        registry_pb2_grpc.add_RegistryServiceServicer_to_server,
        registry_pb2.DESCRIPTOR.services_by_name["RegistryService"],
        map_error,
    )
    service.spawn("replica", replica.run)
    return service


def main() -> None:
    main_entry(build)
