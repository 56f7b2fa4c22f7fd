"""Issue 27, attack 1, with real processes: a tenant names another app's machine as the one
its machine stands by for, and promotes its machine far above it.

Before: a token for app `evil` created a machine whose `config.standbys` named a demo primary,
started it at generation 1000000, and the proxies saw one slot, with evil's machine on top:
they stopped the demo's primary and made it a standby of evil's machine (the demo answered
503 until an operator restarted it). Now every way in is refused, or keeps evil's machine in
a slot of its own app's: the token may not read the demo's machine (PERMISSION_DENIED), an
admin token is told the machine is of another app (INVALID_ARGUMENT naming the field), the
worker that holds the demo's machine refuses it too, and a worker that cannot tell makes a
machine that the proxy and every worker count in (evil, slot), not in the demo's slot. The
demo serves throughout, and nothing about its machines changes.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from flaps.v1 import machines_pb2 as m
from flaps.v1 import machines_pb2_grpc
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from flyd.v1 import worker_pb2_grpc
from tests.harness import channel
from tests.proxy.support import ProxyFleet, T, eventually, get, proxy_fleet

STARTED = pb.MACHINE_STATE_STARTED
HIGH = 1_000_000


def attack_config(target: str) -> pb.MachineConfig:
    return pb.MachineConfig(
        image="demo:v1",
        guest=pb.GuestConfig(cpu_millicores=100, memory_mib=64),
        services=[pb.ServiceConfig(internal_port=8080, autostart=True)],
        standbys=[target],
    )


async def refused(call: object, code: grpc.StatusCode, needle: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call  # type: ignore[misc]
    err = raised.value
    assert err.code() == code, (err.code(), err.details())
    assert needle in (err.details() or ""), err.details()


async def demo_rows(fleet: ProxyFleet, ids: list[str]) -> dict[str, tuple[object, ...]]:
    """What the demo's workers hold of its machines: state, slot, instance, last event."""
    out: dict[str, tuple[object, ...]] = {}
    for mid in ids:
        stub = fleet.worker(mid.rpartition("-")[0])
        row = (await stub.GetMachine(w.GetMachineRequest(machine_id=mid), timeout=T)).machine
        events = await stub.ListMachineEvents(w.ListMachineEventsRequest(machine_id=mid), timeout=T)
        out[mid] = (
            row.state,
            row.slot.SerializeToString(),
            row.instance_id,
            events.events[-1].seq,
        )
    return out


async def demo_serves(fleet: ProxyFleet, primary: str, times: int = 10) -> None:
    for _ in range(times):
        reply = await get(fleet.proxies[0].http, "demo")
        assert (reply.status, reply.headers.get("nonomad-machine-id")) == (200, primary)


async def test_a_tenant_cannot_stand_its_machine_by_for_another_apps(
    tmp_path: Path, image_source: Path
) -> None:
    async with proxy_fleet(tmp_path, image_source) as fleet:
        await fleet.add_workers("w1", "w2")
        fleet.start_flaps()
        await fleet.until_alive()
        fleet.add_proxy()
        primary = await fleet.create("demo")
        standby = await fleet.create("demo", standby_for=[primary.id])
        assert standby.worker_id != primary.worker_id
        await fleet.until_routed("demo", 2)
        waited = m.WaitMachineRequest(machine_id=primary.id, state=STARTED, ready=True)
        await fleet.machines().WaitMachine(waited, timeout=T + 30)
        await demo_serves(fleet, primary.id)
        demo = [primary.id, standby.id]
        before = await demo_rows(fleet, demo)

        security = fleet.security
        assert security is not None
        assert fleet.flaps is not None
        attack = m.CreateMachineRequest(app="evil", region="ams", config=attack_config(primary.id))
        # The tenant's own token (the issue's, and one with every operation on its app): it
        # may not read the demo's machine, so it may not name it.
        for ops, caveat in (("create,start", "ops = "), ("*", "apps = evil")):
            token = security.keyring().mint(["apps = evil", f"ops = {ops}"])
            fleet.channels.append(channel(fleet.flaps.address, security.client_tls(), token))
            evil = machines_pb2_grpc.MachinesServiceStub(fleet.channels[-1])
            await refused(
                evil.CreateMachine(attack, timeout=T), grpc.StatusCode.PERMISSION_DENIED, caveat
            )
        # Whoever may touch every app is told what is wrong: a machine of another app.
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await fleet.machines().CreateMachine(attack, timeout=T)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "config.standbys[0]" in (raised.value.details() or "")
        assert "of app 'demo'" in (raised.value.details() or "")

        # Straight to the workers, with flaps' own certificate. The demo primary's worker
        # holds its row, and refuses.
        flaps_tls = security.member_tls("flaps")
        at = {}
        for wid, proc in fleet.workers.items():
            fleet.channels.append(channel(proc.address, flaps_tls))
            at[wid] = worker_pb2_grpc.WorkerServiceStub(fleet.channels[-1])
        direct = w.CreateMachineRequest(
            app="evil", config=attack_config(primary.id), skip_launch=True
        )
        await refused(
            at[primary.worker_id].CreateMachine(direct, timeout=T),
            grpc.StatusCode.INVALID_ARGUMENT,
            "config.standbys[0]",
        )
        # A supersede naming a machine of another app as the slot's primary: refused, by the
        # app flaps says the primary is of.
        await refused(
            at[primary.worker_id].SupersedeMachine(
                w.SupersedeMachineRequest(
                    machine_id=primary.id,
                    generation=HIGH,
                    primary="w2-000000000000",
                    primary_app="evil",
                ),
                timeout=T,
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "primary_app",
        )
        # The other worker cannot tell whose machine the id is: it makes the machine, in a
        # slot that is evil's own (evil, the demo's id), and it is promoted there.
        made = (await at[standby.worker_id].CreateMachine(direct, timeout=T)).machine
        promoted = w.StartMachineRequest(machine_id=made.id, generation=HIGH)
        got = (await at[standby.worker_id].StartMachine(promoted, timeout=T)).machine
        assert (got.slot.id, got.slot.generation, got.slot.primary) == (
            primary.id,
            HIGH,
            made.id,
        )

        async def routed_on_top() -> bool:
            routes = await fleet.routes("evil")
            return any(r.machine_id == made.id and r.generation == HIGH for r in routes)

        await eventually(routed_on_top, "the proxy sees evil's machine at its generation")
        # The proxy judged evil's slot as it applied that row: a supersede it had decided on
        # would be under way by now. The demo serves on, from the same primary.
        await demo_serves(fleet, primary.id)
        assert {r.machine_id for r in await fleet.routes("demo")} == set(demo)
        assert await demo_rows(fleet, demo) == before
        proxy_log = fleet.proxies[0].stderr_path.read_text()
        assert "superseding" not in proxy_log
        assert "machine_outranked" not in proxy_log
