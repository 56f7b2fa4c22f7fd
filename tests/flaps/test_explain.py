"""Why a machine is where it is, end to end: flaps hands its decision to the worker with the
create, the worker keeps it with the machine, GetPlacement reads it back, and watchers of
flaps see every region's outcome as it is decided."""

from __future__ import annotations

import grpc
import pytest

from flaps.v1 import machines_pb2 as m
from flaps.v1 import platform_pb2 as p
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from tests.flaps.conftest import Fleet, eventually
from tests.flaps.process_support import T, ams_and_syd, config


def ranked(candidates: object) -> dict[str, tuple[float, dict[str, float]]]:
    """Candidates by worker: score and sub-scores (equal workers tie in a random order)."""
    return {c.worker_id: (c.score, dict(c.sub_scores)) for c in candidates}  # type: ignore[attr-defined]


async def placement_of(fleet: Fleet, machine_id: str) -> pb.PlacementDecision | None:
    got = await fleet.machines().GetPlacement(
        m.GetPlacementRequest(machine_id=machine_id), timeout=T
    )
    return got.placement if got.HasField("placement") else None


async def test_the_worker_keeps_the_decision_that_placed_a_machine(fleet: Fleet) -> None:
    await ams_and_syd(fleet)
    machines, platform = fleet.machines(), fleet.platform()
    watch = platform.WatchPlacements(p.WatchPlacementsRequest(), timeout=3 * T)
    await watch.initial_metadata()  # subscribed: every decision from here on reaches it

    # Nothing changes between the simulation and the create: the same state.
    sim = await platform.SimulatePlacement(
        p.SimulatePlacementRequest(app="web", region="ams", config=config()), timeout=T
    )
    made = (
        await machines.CreateMachine(
            m.CreateMachineRequest(app="web", region="ams", config=config()), timeout=T
        )
    ).machine
    why = await placement_of(fleet, made.id)
    assert why is not None
    assert why.worker_id == made.worker_id
    assert why.sample_size == 8
    (region,) = why.regions
    assert (region.region, region.outcome, region.examined) == ("ams", "placed", 2)
    assert region.keyed_worker_id == ""  # no key: best score first
    assert ranked(region.candidates) == ranked(sim.candidates)
    assert dict(region.rejections_by_reason) == dict(sim.rejections_by_reason) == {}
    assert region.candidates[0].worker_id == made.worker_id
    assert set(region.candidates[0].sub_scores) == {"cpu", "memory", "image_cached"}

    # A region that cannot take it, then the fallback the request names: both are kept.
    for worker_id in ("ams-1", "ams-2"):
        await fleet.worker(worker_id).CordonWorker(w.CordonWorkerRequest(cordoned=True))

    async def cordons_seen() -> bool:
        sim = await platform.SimulatePlacement(
            p.SimulatePlacementRequest(app="web", region="ams", config=config()), timeout=T
        )
        return sim.rejections_by_reason["cordoned"] == 2

    await eventually(cordons_seen, 10, "flaps to see the cordons")
    sim = await platform.SimulatePlacement(
        p.SimulatePlacementRequest(app="web", regions=["ams", "syd"], config=config()), timeout=T
    )
    either = m.CreateMachineRequest(
        app="web", regions=["ams", "syd"], config=config(), idempotency_key="fb-1"
    )
    moved = (await machines.CreateMachine(either, timeout=T)).machine
    assert moved.worker_id == "syd-1"
    why = await placement_of(fleet, moved.id)
    assert why is not None
    ams, syd = why.regions
    assert (ams.region, ams.outcome, dict(ams.rejections_by_reason)) == (
        "ams",
        "exhausted",
        {"cordoned": 2},
    )
    assert not ams.candidates
    assert (syd.region, syd.outcome, why.worker_id) == ("syd", "placed", "syd-1")
    assert syd.keyed_worker_id == "syd-1"  # the key's worker is tried first
    assert ranked(syd.candidates) == ranked(sim.candidates)
    assert sim.rejections_by_reason["cordoned"] == 2

    # A retry under the same key returns the machine and leaves its decision as it was.
    again = (await machines.CreateMachine(either, timeout=T)).machine
    assert again.id == moved.id
    assert await placement_of(fleet, moved.id) == why

    # The watcher saw each region's outcome in order.
    seen = [(await watch.read()).event for _ in range(3)]
    watch.cancel()
    assert [(e.app, e.region, e.outcome, e.fallback) for e in seen] == [
        ("web", "ams", "placed", False),
        ("web", "ams", "exhausted", True),
        ("web", "syd", "placed", False),
    ]
    assert (seen[0].machine_id, seen[0].worker_id) == (made.id, made.worker_id)
    assert seen[1].rejections_by_reason["cordoned"] == 2
    assert (seen[2].machine_id, seen[2].candidates) == (moved.id, 1)

    # A machine made straight on a worker has no decision; a destroyed one keeps none.
    direct = (
        await fleet.worker("syd-1").CreateMachine(
            w.CreateMachineRequest(machine_id="syd-1-direct", app="web", config=config()),
            timeout=T,
        )
    ).machine
    assert await placement_of(fleet, direct.id) is None
    await machines.DestroyMachine(
        m.DestroyMachineRequest(machine_id=made.id, force=True), timeout=T
    )
    await machines.WaitMachine(
        m.WaitMachineRequest(machine_id=made.id, state=pb.MACHINE_STATE_DESTROYED), timeout=T
    )
    assert await placement_of(fleet, made.id) is None
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await placement_of(fleet, "ams-1-000000000000")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_worker_refuses_a_decision_over_its_bounds(fleet: Fleet) -> None:
    fleet.add_worker("ams-1", "ams")
    too_many = pb.PlacementDecision(regions=[pb.RegionPlacement(region="ams")] * 17)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await fleet.worker("ams-1").CreateMachine(
            w.CreateMachineRequest(app="web", config=config(), placement=too_many), timeout=T
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "placement.regions: at most 16 entries, got 17" in (err.value.details() or "")
    listed = await fleet.worker("ams-1").ListMachines(w.ListMachinesRequest(), timeout=T)
    assert not listed.machines
