"""The flaps console script: one stateless exchange instance."""

from __future__ import annotations

from flaps import placement
from flaps.errors import map_error
from flaps.service import LIMITS, Exchange, MachinesServicer, PlatformServicer, Workers
from flaps.settings import FlapsSettings
from flaps.v1 import machines_pb2, machines_pb2_grpc, platform_pb2, platform_pb2_grpc
from registry.service import serve_replica
from runtime import Service, configure_logging, main_entry, settings_or_exit, setup_tracing


async def build(argv: list[str]) -> Service:
    settings = settings_or_exit(FlapsSettings, argv, "flaps")
    configure_logging("flaps", settings.log_level)
    setup_tracing("flaps")
    replica = settings.replica()
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
        LIMITS,
    )
    service.add(
        PlatformServicer(exchange),
        platform_pb2_grpc.add_PlatformServiceServicer_to_server,
        platform_pb2.DESCRIPTOR.services_by_name["PlatformService"],
        map_error,
        LIMITS,
    )
    # Workers can announce themselves to any flaps, and replicas share members with it.
    serve_replica(service, replica, settings.workers)
    service.on_shutdown(workers.close)
    return service


def main() -> None:
    main_entry(build)
