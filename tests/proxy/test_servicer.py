"""proxy.v1.ProxyService in-process (pytest-grpc-aio), on a Router over a fake registry.

The servicer is wrapped with proxy.service.map_error as proxy.main registers it, so the codes
seen here are the ones a caller of the real edge sees.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from proxy.service import ProxyServicer, map_error
from proxy.v1 import proxy_pb2 as p
from proxy.v1 import proxy_pb2_grpc
from tests.proxy.support import STARTED, STOPPED, World, fleet, machine, world
from tests.servicers import INVALID, NOT_FOUND, T, answer, refused, registered

Stub = proxy_pb2_grpc.ProxyServiceStub


@pytest.fixture
def grpc_add_to_server() -> Callable[[Any, Any], None]:
    return registered(
        proxy_pb2_grpc.add_ProxyServiceServicer_to_server,
        p.DESCRIPTOR.services_by_name["ProxyService"],
        map_error,
    )


@pytest.fixture
def grpc_stub_cls() -> type[Stub]:
    return Stub


@pytest.fixture
async def edge() -> AsyncIterator[World]:
    """Workers w1, w2 (ams) and s1 (syd); app web on w1 and s1, app api stopped on w2."""
    rows = fleet(
        machine("web-a", worker="w1"),
        machine("web-b", worker="s1", region="syd"),
        machine("api-a", app="api", worker="w2", state=STOPPED),
    )
    async with world(rows) as w:
        yield w


@pytest.fixture
def grpc_servicer(edge: World) -> ProxyServicer:
    return ProxyServicer(edge.router, edge.stats)


def routed(resp: p.ListRoutesResponse) -> dict[str, list[tuple[str, str, str, int, bool]]]:
    """Each app's machines as (id, worker, region, state, draining)."""
    return {
        app.app: [(m.machine_id, m.worker_id, m.region, m.state, m.draining) for m in app.machines]
        for app in resp.apps
    }


async def test_list_routes_shows_every_app_as_the_edge_routes_it(servicer_stub: Stub) -> None:
    resp = await servicer_stub.ListRoutes(p.ListRoutesRequest(), timeout=T)
    assert routed(resp) == {
        "api": [("api-a", "w2", "ams", STOPPED, False)],
        "web": [
            ("web-a", "w1", "ams", STARTED, False),
            ("web-b", "s1", "syd", STARTED, False),
        ],
    }
    addresses = [m.address for app in resp.apps for m in app.machines]
    assert all(a.startswith("127.0.0.1:") for a in addresses), addresses


@pytest.mark.parametrize(
    ("app", "machines"),
    [
        ("web", ["web-a", "web-b"]),
        ("api", ["api-a"]),
        ("nope", None),  # an app the edge does not know: no route, and no error
    ],
)
async def test_list_routes_of_one_app(
    servicer_stub: Stub, app: str, machines: list[str] | None
) -> None:
    resp = await servicer_stub.ListRoutes(p.ListRoutesRequest(app=app), timeout=T)
    assert {a.app: [m.machine_id for m in a.machines] for a in resp.apps} == (
        {app: machines} if machines is not None else {}
    )


async def test_get_stats_reports_what_the_edge_did(servicer_stub: Stub, edge: World) -> None:
    empty = await servicer_stub.GetStats(p.GetStatsRequest(), timeout=T)
    assert (empty.requests_total, dict(empty.requests_by_status)) == (0, {})
    for status, seconds in [(200, 0.010), (200, 0.020), (200, 0.030), (503, 2.0)]:
        edge.stats.record("web", status, seconds)
    edge.stats.cold_start()
    edge.stats.failover()
    edge.stats.failover()
    resp = await servicer_stub.GetStats(p.GetStatsRequest(), timeout=T)
    assert resp.requests_total == 4
    assert dict(resp.requests_by_status) == {"200": 3, "503": 1}
    assert (resp.cold_starts, resp.failovers) == (1, 2)
    assert 10.0 <= resp.latency.p50_ms <= resp.latency.p90_ms <= resp.latency.p99_ms <= 2000.0
    # Per app: its counts and a cumulative latency histogram (two snapshots give a rate).
    edge.stats.record("api", 200, 0.001)
    resp = await servicer_stub.GetStats(p.GetStatsRequest(app="web"), timeout=T)
    [web] = resp.apps
    assert (web.app, web.requests_total, dict(web.requests_by_status)) == (
        "web",
        4,
        {"200": 3, "503": 1},
    )
    by_bound = {b.le_ms: b.count for b in web.latency}
    assert (by_bound[10.0], by_bound[25.0], by_bound[50.0], by_bound[2500.0]) == (1, 2, 3, 4)
    assert web.latency[-1].le_ms == float("inf")
    assert web.latency_sum_ms == pytest.approx(2060.0)
    every = await servicer_stub.GetStats(p.GetStatsRequest(), timeout=T)
    assert [(a.app, a.requests_total) for a in every.apps] == [("api", 1), ("web", 4)]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await servicer_stub.GetStats(p.GetStatsRequest(app="Not An App"), timeout=T)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_drain_worker_stops_and_resumes_routing_to_it(servicer_stub: Stub) -> None:
    drained = await servicer_stub.DrainWorker(p.DrainWorkerRequest(worker_id="w1"), timeout=T)
    assert (drained.worker_id, drained.draining) == ("w1", True)
    routes = await servicer_stub.ListRoutes(p.ListRoutesRequest(app="web"), timeout=T)
    assert [(m.machine_id, m.draining) for m in routes.apps[0].machines] == [
        ("web-a", True),
        ("web-b", False),
    ]
    again = await servicer_stub.DrainWorker(p.DrainWorkerRequest(worker_id="w1"), timeout=T)
    assert again.draining  # idempotent
    resumed = await servicer_stub.DrainWorker(
        p.DrainWorkerRequest(worker_id="w1", undrain=True), timeout=T
    )
    assert (resumed.worker_id, resumed.draining) == ("w1", False)
    routes = await servicer_stub.ListRoutes(p.ListRoutesRequest(app="web"), timeout=T)
    assert not any(m.draining for m in routes.apps[0].machines)


@pytest.mark.parametrize(
    ("rpc", "request_", "field"),
    [
        ("ListRoutes", p.ListRoutesRequest(app="Web"), "app"),
        ("ListRoutes", p.ListRoutesRequest(app="web\n"), "app"),
        ("ListRoutes", p.ListRoutesRequest(app="x" * 64), "app"),
        ("DrainWorker", p.DrainWorkerRequest(), "worker_id"),
        ("DrainWorker", p.DrainWorkerRequest(worker_id="w_1"), "worker_id"),
        ("DrainWorker", p.DrainWorkerRequest(worker_id="-w1", undrain=True), "worker_id"),
    ],
)
async def test_bad_input_is_refused_naming_the_field(
    servicer_stub: Stub, edge: World, rpc: str, request_: Any, field: str
) -> None:
    await refused(answer(servicer_stub, rpc, request_), INVALID, field)
    assert not any(m.draining for _, ms in edge.router.routes() for m in ms)  # nothing changed


@pytest.mark.parametrize("undrain", [False, True])
async def test_draining_an_unknown_worker_is_not_found(
    servicer_stub: Stub, edge: World, undrain: bool
) -> None:
    err = await refused(
        servicer_stub.DrainWorker(p.DrainWorkerRequest(worker_id="w9", undrain=undrain), timeout=T),
        NOT_FOUND,
    )
    assert err.details() == "worker w9 not found"
    assert edge.router.registry.worker("w9") is None
