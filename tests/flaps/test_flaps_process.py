"""flaps as a real process in front of real flyd workers: the exchange, end to end."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from flaps.v1 import machines_pb2 as m
from flaps.v1 import platform_pb2 as p
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from tests.flaps.conftest import Fleet, eventually
from tests.flaps.process_support import T, ams_and_syd, config
from tests.harness import error_info

S = pb.MachineState
C = grpc.StatusCode


def rpc_error(err: pytest.ExceptionInfo[grpc.aio.AioRpcError]) -> tuple[C, str]:
    return err.value.code(), err.value.details() or ""


async def test_a_machine_created_through_one_flaps_is_at_once_usable_through_another(
    fleet: Fleet,
) -> None:
    await ams_and_syd(fleet, flaps=2)
    a, b = fleet.machines(0), fleet.machines(1)
    created = (
        await a.CreateMachine(
            m.CreateMachineRequest(app="web", region="ams", config=config()), timeout=T
        )
    ).machine
    assert created.state == S.MACHINE_STATE_STARTED
    assert created.region == "ams"
    assert created.worker_id in ("ams-1", "ams-2")

    # No eventual-consistency 404: the other flaps routes by the machine id at once.
    got = (await b.GetMachine(m.GetMachineRequest(machine_id=created.id), timeout=T)).machine
    assert got.instance_id == created.instance_id
    await b.StopMachine(m.StopMachineRequest(machine_id=created.id), timeout=T)
    stopped = (
        await a.WaitMachine(
            m.WaitMachineRequest(
                machine_id=created.id, state=S.MACHINE_STATE_STOPPED, timeout=Duration(seconds=20)
            ),
            timeout=T,
        )
    ).machine
    assert stopped.state == S.MACHINE_STATE_STOPPED
    await a.StartMachine(m.StartMachineRequest(machine_id=created.id), timeout=T)
    await b.RestartMachine(m.RestartMachineRequest(machine_id=created.id), timeout=T)
    await b.WaitMachine(
        m.WaitMachineRequest(machine_id=created.id, state=S.MACHINE_STATE_STARTED), timeout=T
    )
    await a.SignalMachine(m.SignalMachineRequest(machine_id=created.id, signal="SIGHUP"), timeout=T)

    async def listed() -> bool:
        resp = await b.ListMachines(m.ListMachinesRequest(app="web"), timeout=T)
        return [mm.id for mm in resp.machines] == [created.id]

    await eventually(listed, 10, "the machine in flaps B's registry view")
    events = (
        await b.ListMachineEvents(m.ListMachineEventsRequest(machine_id=created.id), timeout=T)
    ).events
    assert [e.type for e in events][:3] == ["create", "start", "start"]
    assert {"stop", "restart", "signal"} <= {e.type for e in events}

    await a.DestroyMachine(m.DestroyMachineRequest(machine_id=created.id, force=True), timeout=T)
    await b.WaitMachine(
        m.WaitMachineRequest(machine_id=created.id, state=S.MACHINE_STATE_DESTROYED), timeout=T
    )


async def test_a_retry_with_the_same_idempotency_key_returns_the_same_machine(
    fleet: Fleet,
) -> None:
    await ams_and_syd(fleet, flaps=2)
    request = m.CreateMachineRequest(
        app="web",
        region="ams",
        config=config(),
        idempotency_key="deploy-42/web-1",
        skip_launch=True,
    )
    first = (await fleet.machines(0).CreateMachine(request, timeout=T)).machine

    async def seen_by_b() -> bool:
        resp = await fleet.machines(1).ListMachines(m.ListMachinesRequest(app="web"), timeout=T)
        return len(resp.machines) == 1

    await eventually(seen_by_b, 10, "flaps B to see the machine")
    again = (await fleet.machines(1).CreateMachine(request, timeout=T)).machine
    assert again.id == first.id
    total = 0
    for worker_id in fleet.workers:
        listed = await fleet.worker(worker_id).ListMachines(w.ListMachinesRequest(), timeout=T)
        total += len(listed.machines)
    assert total == 1


async def test_no_room_fails_fast_with_reasons_and_never_moves_region_unasked(
    fleet: Fleet,
) -> None:
    await ams_and_syd(fleet)
    machines = fleet.machines()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await machines.CreateMachine(
            m.CreateMachineRequest(app="big", region="ams", config=config(memory_mib=600)),
            timeout=T,
        )
    assert err.value.code() == C.RESOURCE_EXHAUSTED
    assert "2 insufficient_memory" in (err.value.details() or "")
    status = rpc_status.from_call(err.value)
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    assert info.reason == "NO_CAPACITY"
    assert info.metadata["insufficient_memory"] == "2"

    # Cordoned workers are skipped; only a region the request names is used as a fallback.
    for worker_id in ("ams-1", "ams-2"):
        await fleet.worker(worker_id).CordonWorker(w.CordonWorkerRequest(cordoned=True))

    async def cordon_seen() -> bool:
        sim = await fleet.platform().SimulatePlacement(
            p.SimulatePlacementRequest(app="web", region="ams", config=config()), timeout=T
        )
        return sim.rejections_by_reason["cordoned"] == 2

    await eventually(cordon_seen, 10, "flaps to see the cordons")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await machines.CreateMachine(
            m.CreateMachineRequest(app="web", region="ams", config=config()), timeout=T
        )
    assert rpc_error(err) == (
        C.RESOURCE_EXHAUSTED,
        "no worker in ams can take the machine (2 cordoned)",
    )
    placed = (
        await machines.CreateMachine(
            m.CreateMachineRequest(app="web", regions=["ams", "syd"], config=config()), timeout=T
        )
    ).machine
    assert placed.region == "syd"


async def test_a_standby_never_shares_its_primarys_worker(fleet: Fleet) -> None:
    await ams_and_syd(fleet)
    machines = fleet.machines()
    primary = (
        await machines.CreateMachine(
            m.CreateMachineRequest(app="db", region="ams", config=config()), timeout=T
        )
    ).machine
    for _ in range(3):
        standby = (
            await machines.CreateMachine(
                m.CreateMachineRequest(
                    app="db", region="ams", config=config(), standby_for=[primary.id]
                ),
                timeout=T,
            )
        ).machine
        assert standby.worker_id != primary.worker_id
        assert standby.state == S.MACHINE_STATE_CREATED  # waits, stopped, for its moment
        assert list(standby.config.standbys) == [primary.id]


async def test_leases_and_updates_go_to_the_owning_worker(fleet: Fleet) -> None:
    await ams_and_syd(fleet)
    machines = fleet.machines()
    created = await machines.CreateMachine(
        m.CreateMachineRequest(
            app="web", region="syd", config=config(), lease_ttl=Duration(seconds=60)
        ),
        timeout=T,
    )
    machine, lease = created.machine, created.lease
    assert lease.nonce

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await machines.StopMachine(m.StopMachineRequest(machine_id=machine.id), timeout=T)
    assert err.value.code() == C.FAILED_PRECONDITION
    assert "lease" in (err.value.details() or "")
    # The worker's reason comes through flaps as the worker gave it.
    assert error_info(err.value) == ("LEASE_HELD", "flyd.nonomad", {})

    bigger = config(memory_mib=128)
    updated = (
        await machines.UpdateMachine(
            m.UpdateMachineRequest(machine_id=machine.id, config=bigger, lease_nonce=lease.nonce),
            timeout=T,
        )
    ).machine
    assert updated.id == machine.id
    assert updated.instance_id != machine.instance_id
    assert updated.config.guest.memory_mib == 128
    await machines.WaitMachine(
        m.WaitMachineRequest(
            machine_id=machine.id, state=S.MACHINE_STATE_STARTED, instance_id=updated.instance_id
        ),
        timeout=T,
    )

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await machines.ReleaseLease(
            m.ReleaseLeaseRequest(machine_id=machine.id, nonce="nope"), timeout=T
        )
    assert err.value.code() == C.FAILED_PRECONDITION
    await machines.ReleaseLease(
        m.ReleaseLeaseRequest(machine_id=machine.id, nonce=lease.nonce), timeout=T
    )
    await machines.StopMachine(m.StopMachineRequest(machine_id=machine.id), timeout=T)


async def test_the_platform_api_explains_the_fleet(fleet: Fleet) -> None:
    await ams_and_syd(fleet)
    platform = fleet.platform()
    regions = (
        await platform.ListRegions(
            p.ListRegionsRequest(guest=pb.GuestConfig(cpu_millicores=100, memory_mib=100)),
            timeout=T,
        )
    ).regions
    assert [(r.name, r.workers, r.alive_workers, r.fits) for r in regions] == [
        ("ams", 2, 2, 10),
        ("syd", 1, 1, 5),
    ]

    workers = (await platform.ListWorkers(p.ListWorkersRequest(region="ams"), timeout=T)).workers
    assert sorted(wk.info.id for wk in workers) == ["ams-1", "ams-2"]
    assert all(wk.status == p.WORKER_STATUS_ALIVE for wk in workers)

    sim = await platform.SimulatePlacement(
        p.SimulatePlacementRequest(app="web", region="ams", config=config(memory_mib=400)),
        timeout=T,
    )
    assert len(sim.candidates) == 2
    assert {"cpu", "memory", "image_cached"} <= set(sim.candidates[0].sub_scores)
    assert sim.candidates[0].score >= sim.candidates[1].score
    # Simulation claims nothing.
    for worker_id in ("ams-1", "ams-2"):
        cap = (await fleet.worker(worker_id).GetCapacity(w.GetCapacityRequest())).capacity
        assert cap.free.memory_mib == 512


BAD: list[tuple[str, str, Any, C, str]] = [
    (
        "unknown region",
        "CreateMachine",
        m.CreateMachineRequest(app="web", region="mars", config=config()),
        C.INVALID_ARGUMENT,
        "unknown region 'mars'",
    ),
    (
        "no region",
        "CreateMachine",
        m.CreateMachineRequest(app="web", config=config()),
        C.INVALID_ARGUMENT,
        "region",
    ),
    (
        "bad app",
        "CreateMachine",
        m.CreateMachineRequest(app="Web App", region="ams", config=config()),
        C.INVALID_ARGUMENT,
        "app",
    ),
    (
        "zero cpu",
        "CreateMachine",
        m.CreateMachineRequest(
            app="web",
            region="ams",
            config=pb.MachineConfig(image="demo:v1", guest=pb.GuestConfig(memory_mib=64)),
        ),
        C.INVALID_ARGUMENT,
        "config.guest.cpu_millicores",
    ),
    (
        "negative memory",
        "CreateMachine",
        m.CreateMachineRequest(app="web", region="ams", config=config(memory_mib=-1)),
        C.INVALID_ARGUMENT,
        "config.guest.memory_mib",
    ),
    (
        "malformed image",
        "CreateMachine",
        m.CreateMachineRequest(app="web", region="ams", config=config(image="UPPER:case:x")),
        C.INVALID_ARGUMENT,
        "config.image",
    ),
    (
        "unknown standby primary",
        "CreateMachine",
        m.CreateMachineRequest(
            app="web", region="ams", config=config(), standby_for=["ams-1-000000000000"]
        ),
        C.INVALID_ARGUMENT,
        "standby_for[0]",
    ),
    (
        "lease too long",
        "CreateMachine",
        m.CreateMachineRequest(
            app="web", region="ams", config=config(), lease_ttl=Duration(seconds=7200)
        ),
        C.INVALID_ARGUMENT,
        "lease_ttl",
    ),
    (
        "unknown machine",
        "GetMachine",
        m.GetMachineRequest(machine_id="ams-1-ffffffffffff"),
        C.NOT_FOUND,
        "ams-1-ffffffffffff",
    ),
    (
        "unowned machine",
        "StartMachine",
        m.StartMachineRequest(machine_id="nowhere"),
        C.NOT_FOUND,
        "nowhere",
    ),
    ("no machine id", "StopMachine", m.StopMachineRequest(), C.INVALID_ARGUMENT, "machine_id"),
    (
        "wait too long",
        "WaitMachine",
        m.WaitMachineRequest(
            machine_id="x", state=S.MACHINE_STATE_STARTED, timeout=Duration(seconds=61)
        ),
        C.INVALID_ARGUMENT,
        "timeout",
    ),
    (
        "list bad region",
        "ListMachines",
        m.ListMachinesRequest(app="web", region="mars"),
        C.INVALID_ARGUMENT,
        "mars",
    ),
]


async def test_bad_input_is_refused_with_the_field_named_and_nothing_changes(
    fleet: Fleet,
) -> None:
    await ams_and_syd(fleet)
    machines = fleet.machines()
    for name, rpc, request, code, text in BAD:
        try:
            await getattr(machines, rpc)(request, timeout=T)
        except grpc.aio.AioRpcError as err:
            assert err.code() == code, (name, err.details())
            assert text in (err.details() or ""), (name, err.details())
        else:
            pytest.fail(f"{name}: {rpc} was accepted")
    # An invalid transition is the worker's answer, passed on.
    made = (
        await machines.CreateMachine(
            m.CreateMachineRequest(app="web", region="ams", config=config(), skip_launch=True),
            timeout=T,
        )
    ).machine
    await machines.DestroyMachine(m.DestroyMachineRequest(machine_id=made.id), timeout=T)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await machines.StartMachine(m.StartMachineRequest(machine_id=made.id), timeout=T)
    assert err.value.code() == C.FAILED_PRECONDITION
    for worker_id in fleet.workers:
        listed = await fleet.worker(worker_id).ListMachines(w.ListMachinesRequest(), timeout=T)
        assert not listed.machines  # only the destroyed one was ever made


async def test_two_flaps_racing_into_a_nearly_full_region_never_oversubscribe(
    fleet: Fleet,
) -> None:
    # Two workers with room for 10 machines each; 6 already taken; 40 bids race for 14 slots.
    fleet.add_worker("race-1", "race", "--capacity.memory-mib", "1000")
    fleet.add_worker("race-2", "race", "--capacity.memory-mib", "1000")
    fleet.add_flaps()
    fleet.add_flaps()
    await fleet.until_alive(0)
    await fleet.until_alive(1)
    for i in range(6):
        await fleet.machines(i % 2).CreateMachine(
            m.CreateMachineRequest(
                app="pre", region="race", config=config(memory_mib=100), skip_launch=True
            ),
            timeout=T,
        )

    async def bid(i: int) -> pb.Machine | C:
        try:
            resp = await fleet.machines(i % 2).CreateMachine(
                m.CreateMachineRequest(
                    app="race", region="race", config=config(memory_mib=100), skip_launch=True
                ),
                timeout=T,
            )
        except grpc.aio.AioRpcError as err:
            return err.code()
        return resp.machine

    results = await asyncio.gather(*(bid(i) for i in range(40)))
    made = [r for r in results if isinstance(r, pb.Machine)]
    refused = [r for r in results if not isinstance(r, pb.Machine)]
    assert set(refused) <= {C.RESOURCE_EXHAUSTED}
    assert len({mm.id for mm in made}) == len(made)  # none created twice
    assert len(made) == 14  # every slot is used: a refusal moves on to the next worker

    on_workers = []
    for worker_id in ("race-1", "race-2"):
        worker = fleet.worker(worker_id)
        cap = (await worker.GetCapacity(w.GetCapacityRequest(), timeout=T)).capacity
        assert cap.free.memory_mib >= 0  # never oversubscribed
        listed = await worker.ListMachines(w.ListMachinesRequest(app="race"), timeout=T)
        on_workers += [mm.id for mm in listed.machines]
    assert sorted(on_workers) == sorted(mm.id for mm in made)  # none lost


async def test_two_flaps_racing_the_same_key_create_one_machine(fleet: Fleet) -> None:
    # Four workers whose free room changes with every round, seen by two flaps whose views
    # are never quite in step: each round, both are asked for the same key at once.
    for i in range(4):
        fleet.add_worker(f"ams-{i}", "ams", "--capacity.memory-mib", "65536")
    fleet.add_flaps()
    fleet.add_flaps()
    for i in range(2):
        await fleet.until_alive(i)
    a, b = fleet.machines(0), fleet.machines(1)

    async def create(flaps: Any, key: str, memory_mib: int) -> pb.Machine:
        request = m.CreateMachineRequest(
            app="race",
            region="ams",
            config=config(memory_mib),
            idempotency_key=key,
            skip_launch=True,
        )
        return (await flaps.CreateMachine(request, timeout=T)).machine

    for i in range(100):
        key, size = f"key-{i}", 16 + 16 * (i % 7)
        first, second = await asyncio.gather(create(a, key, size), create(b, key, size))
        assert first.id == second.id, f"round {i}: two machines for one key"
    held: list[str] = []
    for worker_id in fleet.workers:
        listed = await fleet.worker(worker_id).ListMachines(
            w.ListMachinesRequest(app="race"), timeout=T
        )
        held += [machine.idempotency_key for machine in listed.machines]
    assert sorted(held) == sorted(f"key-{i}" for i in range(100))
