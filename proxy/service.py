"""proxy.v1.ProxyService (the edge's admin API), and the one place proxy errors become statuses."""

from __future__ import annotations

import grpc

from proxy.errors import ProxyError, UnknownApp
from proxy.router import Router
from proxy.routes import UnknownWorker
from proxy.stats import Stats
from proxy.v1 import proxy_pb2 as p
from proxy.v1 import proxy_pb2_grpc
from runtime.errors import InvalidArgument
from runtime.validate import check_name

# Checked in order: the first matching class decides.
_CODES: list[tuple[type[Exception], grpc.StatusCode]] = [
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (UnknownWorker, grpc.StatusCode.NOT_FOUND),
    (UnknownApp, grpc.StatusCode.NOT_FOUND),
    (ProxyError, grpc.StatusCode.UNAVAILABLE),
]


def map_error(err: Exception) -> tuple[grpc.StatusCode, str] | None:
    """The proxy's errors as gRPC statuses; None for anything else (reported as INTERNAL)."""
    for cls, code in _CODES:
        if isinstance(err, cls):
            return code, str(err)
    return None


class ProxyServicer(proxy_pb2_grpc.ProxyServiceServicer):
    """Thin translation between admin requests and the router and stats."""

    def __init__(self, router: Router, stats: Stats) -> None:
        self.router = router
        self.stats = stats

    async def ListRoutes(
        self, request: p.ListRoutesRequest, context: grpc.aio.ServicerContext
    ) -> p.ListRoutesResponse:
        check_name("app", request.app, required=False)
        out = p.ListRoutesResponse()
        for app, infos in self.router.routes(request.app or None):
            route = out.apps.add(app=app)
            for info in infos:
                route.machines.add(
                    machine_id=info.machine_id,
                    worker_id=info.worker_id,
                    region=info.region,
                    state=info.state,
                    address=info.address,
                    in_flight=info.in_flight,
                    healthy=info.healthy,
                    draining=info.draining,
                    generation=info.generation,
                    superseded=info.superseded,
                    fenced=info.fenced,
                )
        return out

    async def GetStats(
        self, request: p.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> p.GetStatsResponse:
        check_name("app", request.app, required=False)
        snap = self.stats.snapshot()
        latency = snap["latency_ms"]
        apps = [request.app] if request.app else sorted(self.stats.by_app)
        return p.GetStatsResponse(
            apps=[self._app_stats(app) for app in apps],
            requests_by_status=snap["by_status"],
            cold_starts=snap["cold_starts"],
            failovers=snap["failovers"],
            requests_total=snap["requests"],
            latency=p.LatencyPercentiles(
                p50_ms=latency["p50"] or 0.0,
                p90_ms=latency["p90"] or 0.0,
                p99_ms=latency["p99"] or 0.0,
            ),
        )

    def _app_stats(self, app: str) -> p.AppStats:
        by_status = self.stats.by_app.get(app, {})
        buckets, seconds = self.stats.histogram(app)
        return p.AppStats(
            app=app,
            requests_by_status={str(code): n for code, n in sorted(by_status.items())},
            requests_total=sum(by_status.values()),
            latency=[p.LatencyBucket(le_ms=bound * 1000, count=n) for bound, n in buckets],
            latency_sum_ms=seconds * 1000,
        )

    async def DrainWorker(
        self, request: p.DrainWorkerRequest, context: grpc.aio.ServicerContext
    ) -> p.DrainWorkerResponse:
        check_name("worker_id", request.worker_id)
        draining = self.router.drain(request.worker_id, not request.undrain)
        return p.DrainWorkerResponse(worker_id=request.worker_id, draining=draining)
