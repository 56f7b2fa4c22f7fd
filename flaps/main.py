"""The flaps console script: one stateless exchange instance."""

from __future__ import annotations

from flaps import placement
from flaps.errors import map_error
from flaps.service import Exchange, MachinesServicer, PlatformServicer, Workers
from flaps.settings import FlapsSettings
from flaps.v1 import machines_pb2, machines_pb2_grpc, platform_pb2, platform_pb2_grpc
from nonomad.runtime import Service, configure_logging, main_entry, settings_or_exit, setup_tracing
from registry.replica import Replica
from registry.service import RegistryServicer
from registry.service import map_error as registry_map_error
from registry.v1 import registry_pb2, registry_pb2_grpc


async def build(argv: list[str]) -> Service:
    settings = settings_or_exit(FlapsSettings, argv, "flaps")
    configure_logging("flaps", settings.log_level)
    setup_tracing("flaps")
    replica = Replica(
        suspect_after=settings.suspect_after,
        dead_after=settings.dead_after,
        upstream=settings.upstream,
        peers=settings.peers,
    )
    workers = Workers(replica)
    pipeline = placement.Pipeline(
        curve=placement.Curve(tuple(settings.curve)),
        weights=placement.Weights(**settings.weights.model_dump()),
        sample_size=settings.sample_size,
    )
    exchange = Exchange(replica, workers, pipeline)
    service = Service("flaps", settings)
    service.add(
        MachinesServicer(exchange),
        machines_pb2_grpc.add_MachinesServiceServicer_to_server,
        machines_pb2.DESCRIPTOR.services_by_name["MachinesService"],
        map_error,
    )
    service.add(
        PlatformServicer(exchange),
        platform_pb2_grpc.add_PlatformServiceServicer_to_server,
        platform_pb2.DESCRIPTOR.services_by_name["PlatformService"],
        map_error,
    )
    # Workers can announce themselves to any flaps, and replicas share members with it.
    service.add(
        RegistryServicer(replica, draining=service.draining),
        registry_pb2_grpc.add_RegistryServiceServicer_to_server,
        registry_pb2.DESCRIPTOR.services_by_name["RegistryService"],
        registry_map_error,
    )
    for address in settings.workers:
        replica.add_address(address)
    service.spawn("replica", replica.run)
    service.on_shutdown(workers.close)
    return service


def main() -> None:
    main_entry(build)
