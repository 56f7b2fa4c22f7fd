"""The proxy console script: the edge. HTTP for apps, gRPC for its admin API and registry.

Before the runtime's `NONOMAD_READY proxy <grpc address>` line it prints
`NONOMAD_HTTP proxy <host:port>`, the bound HTTP address, so that tests and the CLI can read
both from stdout.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass

import structlog
from opentelemetry import trace

from proxy.access import PROXY_ACCESS
from proxy.control import FlapsClient, NetProbes
from proxy.http import HttpProxy
from proxy.metrics import ProxyCollector
from proxy.pins import Grants, pin_check
from proxy.router import Router
from proxy.service import ProxyServicer, map_error
from proxy.settings import ProxySettings
from proxy.stats import Stats
from proxy.v1 import proxy_pb2, proxy_pb2_grpc
from registry.service import serve_replica
from runtime import (
    Service,
    access,
    configure_logging,
    main_entry,
    settings_or_exit,
    setup_tracing,
    tracing_enabled,
    use_event_loop,
)
from runtime.clock import SYSTEM_CLOCK, Clock
from runtime.entropy import SYSTEM, Entropy
from runtime.heap import no_full_collections
from runtime.validate import parse_host_port

HTTP_PREFIX = "NONOMAD_HTTP"
"""First word of the stdout line with the bound HTTP address: `NONOMAD_HTTP proxy host:port`."""

log = structlog.get_logger("proxy")


def _format(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass
class Parts:
    """What a proxy takes besides its settings: the system's clock and randomness and an HTTP
    edge in production (`build`); a simulated node's clock and seeded draws, and no HTTP
    listener (its control plane only: following the registry, failover, supersedes), in the
    simulator."""

    clock: Clock = SYSTEM_CLOCK
    entropy: Entropy = SYSTEM
    http: bool = True


async def build(argv: list[str]) -> Service:
    settings = settings_or_exit(ProxySettings, argv, "proxy")
    configure_logging("proxy", settings.log_level)
    setup_tracing("proxy", **{"cloud.region": settings.region})
    return await compose(settings, Parts())


async def compose(settings: ProxySettings, parts: Parts) -> Service:
    """The edge and its gRPC services: the one wiring the production proxy and a simulated
    one share."""
    # Spans for every request and failover when tracing is on; none at all when it is off.
    tracer = trace.get_tracer("nonomad.proxy") if tracing_enabled() else None
    replica = settings.replica(parts.clock)
    stats = Stats()
    flaps = (
        FlapsClient(settings.flaps, timeout=settings.flaps_timeout, tls=settings.cluster_tls)
        if settings.flaps is not None
        else None
    )
    if flaps is None:
        log.warning("no_flaps", consequence="no scale from zero, autostop or failover")
    router = Router(
        replica,
        flaps,
        stats,
        config=settings.router_config(),
        tracer=tracer,
        probes=NetProbes(settings.cluster_tls),
        clock=parts.clock,
        rng=parts.entropy.rng(),
    )
    service = Service("proxy", settings)
    # Over TLS, for the cluster's parts whose role may call each RPC (proxy.access).
    access.add(
        service,
        PROXY_ACCESS,
        ProxyServicer(router, stats),
        proxy_pb2_grpc.add_ProxyServiceServicer_to_server,
        proxy_pb2.DESCRIPTOR.services_by_name["ProxyService"],
        map_error,
    )
    # Workers can announce themselves to the proxy, and replicas share members with it.
    serve_replica(service, replica, settings.workers)

    async def close_flaps() -> None:
        if flaps is not None:
            await flaps.close()

    service.spawn("router", router.run)
    service.on_shutdown(close_flaps)
    if not parts.http:
        return service

    # Pins are checked with tokens flaps verifies: the edge holds no root keys (proxy.pins).
    grants = Grants(flaps.verify_token, ttl=settings.token_cache_ttl) if flaps else None
    http = HttpProxy(
        router,
        stats,
        domain=settings.domain,
        region=settings.region,
        limits=settings.limits(),
        pin_check=pin_check(grants),
        tracer=tracer,
        trusted_proxies=settings.trusted_networks(),
    )
    router.on_machines_lost(http.machines_lost)
    if settings.metrics_listen is not None:
        ProxyCollector(stats, router=router, replica=replica, http=http).register()
    host, port = parse_host_port(settings.http_listen)
    try:
        bound = await http.serve(host, port)
    except OSError as err:
        print(f"proxy: cannot listen on {settings.http_listen}: {err}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    address = _format(*bound)
    log.info(
        "http_listening",
        address=address,
        domain=settings.domain,
        event_loop=type(asyncio.get_running_loop()).__module__.split(".")[0],
    )
    print(f"{HTTP_PREFIX} proxy {address}", flush=True)

    async def serve_http(shutdown: asyncio.Event) -> None:
        # Stop taking requests as soon as shutdown begins; those in flight get the grace.
        await service.draining.wait()
        await http.close(settings.grace_period)

    service.spawn("http", serve_http)
    return service


def main() -> None:
    # Process-wide choices, made before the loop runs (build() reads the settings again in
    # it): the event loop, and a cycle collector that never walks the old objects.
    no_full_collections()
    use_event_loop(settings_or_exit(ProxySettings, sys.argv[1:], "proxy").event_loop)
    main_entry(build)


if __name__ == "__main__":
    main()
