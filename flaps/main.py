"""The flaps console script: one stateless exchange instance."""

from __future__ import annotations

import asyncio
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass

import structlog
from google.protobuf.descriptor import ServiceDescriptor

from flaps import auth, placement
from flaps.auth import Authorizer, KeySource, RevocationList, TokenVerifier
from flaps.errors import map_error
from flaps.images import ImageOwners
from flaps.service import LIMITS, Exchange, MachinesServicer, PlatformServicer, Workers
from flaps.settings import FlapsSettings
from flaps.v1 import (
    machines_pb2,
    machines_pb2_grpc,
    platform_pb2,
    platform_pb2_grpc,
    tokens_pb2,
    tokens_pb2_grpc,
)
from flaps.verify import TOKEN_ACCESS, TokenServicer
from model.images.source import ImageSource
from registry.service import serve_replica
from runtime import (
    Service,
    access,
    configure_logging,
    main_entry,
    settings_or_exit,
    setup_tracing,
)
from runtime.clock import SYSTEM_CLOCK, Clock
from runtime.entropy import SYSTEM, Entropy
from runtime.heap import no_full_collections
from runtime.pki import ClusterMembers
from runtime.server import use_event_loop

log = structlog.get_logger("flaps")


@dataclass(frozen=True)
class Parts:
    """What a flaps takes besides its settings: the system's clock and randomness in
    production (`build`); a simulated node's clock and seeded draws (sim)."""

    clock: Clock = SYSTEM_CLOCK
    entropy: Entropy = SYSTEM


async def build(argv: list[str]) -> Service:
    """The flaps of this process: its settings, logging and tracing."""
    settings = settings_or_exit(FlapsSettings, argv, "flaps")
    configure_logging("flaps", settings.log_level)
    setup_tracing("flaps")
    return compose(settings, Parts())


def compose(settings: FlapsSettings, parts: Parts) -> Service:
    """The exchange and its gRPC services: the one wiring the production flaps and a simulated
    one share."""
    replica = settings.replica(parts.clock)
    workers = Workers(replica, tls=settings.cluster_tls)
    pipeline = placement.Pipeline(
        curve=placement.Curve(tuple(settings.curve)),
        weights=placement.Weights(**settings.weights.model_dump()),
        sample_size=settings.sample_size,
        rng=parts.entropy.rng(),
    )
    images = ImageOwners(ImageSource(settings.image_source)) if settings.image_source else None
    exchange = Exchange(
        replica,
        workers,
        pipeline,
        images,
        clock=parts.clock,
        entropy=parts.entropy,
        key_doubt=settings.key_doubt,
        vouch_margin=settings.key_vouch_margin,
    )
    service = Service("flaps", settings)
    guard: Callable[[object, ServiceDescriptor], None] | None = None
    tokens: TokenVerifier | None = None
    if settings.token_keys is not None:
        keys = KeySource(settings.token_keys)
        assert settings.revocation_list is not None
        revoked = RevocationList(settings.revocation_list)
        tokens = TokenVerifier(lambda: keys.keyring, lambda: revoked.revoked)
        members = ClusterMembers(settings.cluster_ca) if settings.cluster_ca else None
        authorizer = Authorizer(tokens, exchange.app_of, members)
        guard = functools.partial(auth.guard, authorizer=authorizer)
        service.spawn("token-keys", keys.watch)
        service.spawn("revoked-tokens", revoked.watch)
    else:
        log.warning("no_token_keys", consequence="every caller may do anything")
    machines = MachinesServicer(exchange, streams_per_caller=settings.streams_per_caller)
    platform = PlatformServicer(exchange)
    machines_service = machines_pb2.DESCRIPTOR.services_by_name["MachinesService"]
    platform_service = platform_pb2.DESCRIPTOR.services_by_name["PlatformService"]
    if guard is not None:
        guard(machines, machines_service)
        guard(platform, platform_service)
    service.add(
        machines,
        machines_pb2_grpc.add_MachinesServiceServicer_to_server,
        machines_service,
        map_error,
        LIMITS,
    )
    service.add(
        platform,
        platform_pb2_grpc.add_PlatformServiceServicer_to_server,
        platform_service,
        map_error,
        LIMITS,
    )
    if tokens is not None:
        # The edge's tokens, verified here: it holds no root keys (flaps.verify).
        access.add(
            service,
            TOKEN_ACCESS,
            TokenServicer(tokens),
            tokens_pb2_grpc.add_TokenServiceServicer_to_server,
            tokens_pb2.DESCRIPTOR.services_by_name["TokenService"],
            map_error,
        )
    # Workers can announce themselves to any flaps, and replicas share members with it (on
    # its cluster port, when it checks tokens on the other).
    serve_replica(service, replica, settings.workers)
    service.on_shutdown(workers.close)

    async def end_watches(shutdown: asyncio.Event) -> None:
        # Draining is set as shutdown begins: watch streams end then, not after the grace.
        await service.draining.wait()
        exchange.watchers.close()

    service.spawn("placement-watches", end_watches)
    return service


def main() -> None:
    # Process-wide choices, made before the loop runs (build() reads the settings again in
    # it): the event loop, and a cycle collector that never walks the old objects.
    no_full_collections()
    use_event_loop(settings_or_exit(FlapsSettings, sys.argv[1:], "flaps").event_loop)
    main_entry(build)


if __name__ == "__main__":
    main()
