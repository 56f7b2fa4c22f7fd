"""The proxy as a real process in front of real flyd workers and flaps: scale from zero,
autostop, failover when a worker is killed or frozen, two proxies racing, the admin API. (A
partition, and every fault's return: tests/e2e/test_fencing.py.)

Waits are on conditions with deadlines (the assertion is that it happens, not when)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from flyd.v1 import machine_pb2 as pb
from proxy.v1 import proxy_pb2 as p
from tests.conftest import DEMO_APP
from tests.proxy.support import (
    DEADLINE,
    ProxyFleet,
    Reply,
    T,
    eventually,
    get,
    proxy_fleet,
)

S = pb.MachineState


async def serves(fleet: ProxyFleet, app: str, machine_id: str, i: int = 0) -> list[Reply]:
    """Send requests one after another until `machine_id` answers one; every reply."""
    replies: list[Reply] = []
    loop = asyncio.get_running_loop()
    end = loop.time() + DEADLINE
    while loop.time() < end:
        reply = await get(fleet.proxies[i].http, app)
        replies.append(reply)
        if reply.headers.get("nonomad-machine-id") == machine_id:
            return replies
        await asyncio.sleep(0.02)
    raise AssertionError(f"{machine_id} never answered: {[(r.status, r.body) for r in replies]}")


async def stats(fleet: ProxyFleet, i: int = 0) -> p.GetStatsResponse:
    return await fleet.admin(i).GetStats(p.GetStatsRequest(), timeout=T)


async def primary_with_standbys(
    fleet: ProxyFleet, workers: int, standbys: int
) -> tuple[pb.Machine, list[pb.Machine]]:
    await fleet.add_workers(*(f"w{i}" for i in range(1, workers + 1)))
    fleet.start_flaps()
    await fleet.until_alive()
    primary = await fleet.create("db")
    spares = [await fleet.create("db", standby_for=[primary.id]) for _ in range(standbys)]
    assert all(s.worker_id != primary.worker_id for s in spares)
    assert all(s.state == S.MACHINE_STATE_CREATED for s in spares)
    return primary, spares


async def test_cold_requests_start_the_stopped_machine_once_and_the_admin_api(
    tmp_path: Path, image_source: Path
) -> None:
    async with proxy_fleet(tmp_path, image_source) as fleet:
        fleet.add_worker("w1")
        fleet.start_flaps()
        await fleet.until_alive()
        cold = await fleet.create("cold", skip_launch=True)
        proxy = fleet.add_proxy()
        await fleet.until_routed("cold", 1)

        # Several requests arrive while the app is scaled to zero: one start serves them all.
        replies = await asyncio.gather(*(get(proxy.http, "cold") for _ in range(5)))
        assert [r.status for r in replies] == [200] * 5
        assert {r.body for r in replies} == {f"hello from {cold.id}\n".encode()}
        assert await fleet.starts(cold.id) == 1
        got = await stats(fleet)
        assert got.cold_starts == 1
        assert got.requests_by_status["200"] == 5
        assert got.requests_total == 5
        assert got.latency.p50_ms > 0

        [route] = await fleet.routes("cold")
        assert route.machine_id == cold.id
        assert route.state == S.MACHINE_STATE_STARTED
        assert route.healthy
        assert not route.draining
        assert route.address.startswith("127.0.0.1:")

        # Draining the worker leaves nothing to serve: 503 with the reason; undrain restores.
        admin = fleet.admin()
        drained = await admin.DrainWorker(p.DrainWorkerRequest(worker_id="w1"), timeout=T)
        assert drained.draining
        reply = await get(proxy.http, "cold")
        assert reply.status == 503
        assert b"1 on a draining worker" in reply.body
        await admin.DrainWorker(p.DrainWorkerRequest(worker_id="w1", undrain=True), timeout=T)
        assert (await get(proxy.http, "cold")).status == 200

        assert (await get(proxy.http, "nope")).status == 404
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await admin.DrainWorker(p.DrainWorkerRequest(worker_id="w9"), timeout=T)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await admin.ListRoutes(p.ListRoutesRequest(app="Not_An_App"), timeout=T)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "app" in (err.value.details() or "")


async def test_an_idle_machine_is_stopped_and_started_again_on_demand(
    tmp_path: Path, image_source: Path
) -> None:
    async with proxy_fleet(tmp_path, image_source) as fleet:
        fleet.add_worker("w1")
        fleet.start_flaps()
        await fleet.until_alive()
        idle = await fleet.create(
            "idle",
            service=pb.ServiceConfig(internal_port=8080, autostart=True, autostop=True),
        )
        proxy = fleet.add_proxy("--idle-timeout", "1", "--autostop-interval", "0.2")
        await fleet.until_routed("idle", 1)
        assert (await get(proxy.http, "idle")).status == 200

        async def stopped() -> bool:
            return (await fleet.machine(idle.id)).state == S.MACHINE_STATE_STOPPED

        await eventually(stopped, "the idle machine to be stopped")
        # Scale from zero brings it back.
        assert (await get(proxy.http, "idle")).status == 200
        assert (await stats(fleet)).cold_starts == 1


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
async def test_a_lost_worker_fails_over_to_its_standby(
    tmp_path: Path, image_source: Path, how: str
) -> None:
    async with proxy_fleet(tmp_path, image_source) as fleet:
        primary, [standby] = await primary_with_standbys(fleet, workers=2, standbys=1)
        proxy = fleet.add_proxy()
        await fleet.until_routed("db", 2)
        reply = await get(proxy.http, "db")
        assert reply.headers["nonomad-machine-id"] == primary.id

        # The primary's flyd is lost (its machine keeps running, but the edge cannot know).
        if how == "SIGKILL":
            fleet.workers[primary.worker_id].kill()
        else:
            fleet.freeze(primary.worker_id)  # its connections stay open; probes time out

        replies = await serves(fleet, "db", standby.id)
        assert {r.status for r in replies} == {200}  # nothing dropped on the way
        assert (await fleet.machine(standby.id)).state == S.MACHINE_STATE_STARTED
        assert (await stats(fleet)).failovers == 1
        routes = {r.machine_id: r for r in await fleet.routes("db")}
        assert not routes[primary.id].healthy
        assert routes[standby.id].healthy
        # From now on only the standby serves.
        for _ in range(3):
            assert (await get(proxy.http, "db")).headers["nonomad-machine-id"] == standby.id


# The demo app, but a request for /hang (and any POST) never gets an answer.
HANGING_APP = DEMO_APP.replace("import http.server, os, sys", "import http.server, os, sys, time")
HANGING_APP = HANGING_APP.replace(
    "    def do_GET(self):\n",
    "    def do_POST(self):\n"
    "        time.sleep(3600)\n\n"
    "    def do_GET(self):\n"
    "        if self.path == '/hang':\n"
    "            time.sleep(3600)\n",
)


async def test_requests_in_flight_on_a_lost_worker_end_when_it_is_declared_dead(
    tmp_path: Path, image_source: Path
) -> None:
    async with proxy_fleet(tmp_path, image_source) as fleet:
        await fleet.add_workers("w1", "w2")
        fleet.start_flaps()
        await fleet.until_alive()
        primary = await fleet.create("db", entrypoint=["python3", "-u", "-c", HANGING_APP])
        standby = await fleet.create("db", standby_for=[primary.id])
        assert standby.worker_id != primary.worker_id
        # The proxy's own timeout would not end them within the test's deadline.
        proxy = fleet.add_proxy("--upstream-response-timeout", "3600")
        await fleet.until_routed("db", 2)
        await serves(fleet, "db", primary.id)

        hung_get = asyncio.create_task(get(proxy.http, "db", "/hang"))
        hung_post = asyncio.create_task(get(proxy.http, "db", "/hang", method="POST"))

        async def both_in_flight() -> bool:
            routes = {r.machine_id: r for r in await fleet.routes("db")}
            return routes[primary.id].in_flight == 2

        await eventually(both_in_flight, "both requests in flight on the primary")
        # Its worker stops answering (the machine, still hanging, cannot be reached through it).
        fleet.freeze(primary.worker_id)

        moved = await hung_get  # a GET that had no answer is sent to the standby
        assert (moved.status, moved.headers["nonomad-machine-id"]) == (200, standby.id)
        assert moved.body == f"hello from {standby.id}\n".encode()
        refused = await hung_post  # a POST is not sent twice: 502 with the reason
        assert refused.status == 502
        assert f"machine {primary.id} was lost".encode() in refused.body
        assert (await stats(fleet)).failovers == 1


async def test_two_proxies_noticing_one_death_start_exactly_one_standby(
    tmp_path: Path, image_source: Path
) -> None:
    async with proxy_fleet(tmp_path, image_source) as fleet:
        primary, spares = await primary_with_standbys(fleet, workers=3, standbys=2)
        fleet.add_proxy()
        fleet.add_proxy()
        for i in (0, 1):
            await fleet.until_routed("db", 3, i)
        fleet.workers[primary.worker_id].kill()

        chosen = min(s.id for s in spares)  # every proxy picks the lowest id
        for i in (0, 1):
            await serves(fleet, "db", chosen, i)
        states = {s.id: (await fleet.machine(s.id)).state for s in spares}
        assert states == {
            s.id: S.MACHINE_STATE_STARTED if s.id == chosen else S.MACHINE_STATE_CREATED
            for s in spares
        }
        for s in spares:
            assert await fleet.starts(s.id) == (1 if s.id == chosen else 0)
        assert (await stats(fleet, 0)).failovers + (await stats(fleet, 1)).failovers >= 1
