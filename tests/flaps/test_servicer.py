"""flaps.v1.MachinesService and flaps.v1.PlatformService in-process (pytest-grpc-aio), on a
fake fleet: flyd workers w1, w2 (ams) and s1 (syd) on fake drivers, served on loopback and
followed by the replica flaps reads (tests/flaps/support.py).

Both servicers are wrapped with flaps.errors.map_error as flaps.main registers them, so the
codes seen here, and the worker's ErrorInfo passed on, are what a caller of flaps sees.
"""

from __future__ import annotations

import asyncio
import re
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from pytest_grpc_aio.plugin import GrpcContext

from flaps.errors import map_error
from flaps.service import LIMITS, Exchange, MachinesServicer, PlatformServicer, machine_suffix
from flaps.v1 import machines_pb2 as m
from flaps.v1 import machines_pb2_grpc, platform_pb2, platform_pb2_grpc
from flyd.v1 import machine_pb2 as pb
from model.errors import DOMAIN as FLYD
from model.validate import DEFAULT_DISK_MIB
from tests.flaps.servicer_support import Machines, MachinesServer, bid, exchange, fleet
from tests.flaps.support import FakeFleet
from tests.flyd.support import CREATED, DESTROYED, STARTED, STOPPED, config, create, held_pulls
from tests.servicers import (
    INVALID,
    NOT_FOUND,
    PRECONDITION,
    T,
    answer,
    bring,
    info_of,
    refused,
    registered,
    seconds,
    untested,
)

__all__ = ["exchange", "fleet"]

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


async def stall_streams(fleet: FakeFleet, *worker_ids: str) -> asyncio.Event:
    """The workers' streams send nothing more (no change, no heartbeat) until the returned
    event is set; returns once each is stuck."""
    release, all_stuck = asyncio.Event(), asyncio.Event()
    stuck: set[str] = set()

    def stall(worker_id: str) -> Callable[[], Awaitable[bool]]:
        async def held() -> bool:
            stuck.add(worker_id)
            if stuck == set(worker_ids):
                all_stuck.set()
            await release.wait()
            return False

        return held

    for worker_id in worker_ids:
        fleet.workers[worker_id].worker.stream.before_heartbeat = stall(worker_id)
    async with asyncio.timeout(T):
        await all_stuck.wait()
    return release


async def heard_since(fleet: FakeFleet, worker_id: str, when: float) -> None:
    """Wait until the replica has a heartbeat the worker sent at `when` or later."""

    def heard() -> bool:
        view = fleet.replica.worker(worker_id)
        return view is not None and view.last_heartbeat >= when

    await fleet.until(heard, f"a heartbeat of {worker_id} sent at {when}")


Platform = platform_pb2_grpc.PlatformServiceStub


# Requests that INVALID_ARGUMENT refuses, as CreateMachine and SimulatePlacement fields, with
# the field the message must name. A valid bid is app web, region ams, config().
BAD_BIDS: list[tuple[dict[str, Any], str]] = [
    ({"app": ""}, "app"),
    ({"app": "Web"}, "app"),
    ({"region": "", "regions": []}, "region"),
    ({"region": "mars"}, "region"),
    ({"region": "AMS"}, "region"),
    ({"region": "", "regions": ["syd", "mars"]}, "regions[1]"),
    ({"regions": ["mars"]}, "regions[0]"),
    ({"config": pb.MachineConfig(guest=config().guest)}, "config.image"),
    ({"config": config(memory=-1)}, "config.guest.memory_mib"),
    ({"config": config(cpu=100_000)}, "config.guest.cpu_millicores"),
]


class TestMachinesService(MachinesServer):
    # -- CreateMachine ----------------------------------------------------------------------

    async def test_create_claims_on_a_worker_of_the_region(
        self, servicer_stub: Machines, fleet: FakeFleet
    ) -> None:
        resp = await servicer_stub.CreateMachine(m.CreateMachineRequest(**bid()), timeout=T)
        machine = resp.machine
        assert machine.state == STARTED
        assert machine.worker_id in ("w1", "w2")
        assert re.fullmatch(rf"{machine.worker_id}-[0-9a-f]{{12}}", machine.id), machine.id
        assert fleet.owner_of(machine.id).worker.identity.worker_id == machine.worker_id
        assert not resp.HasField("lease")

    async def test_a_retry_with_the_same_idempotency_key_returns_the_same_machine(
        self, servicer_stub: Machines, fleet: FakeFleet
    ) -> None:
        request = m.CreateMachineRequest(**bid(idempotency_key="deploy-7"))
        first = (await servicer_stub.CreateMachine(request, timeout=T)).machine
        await fleet.seen(first.id)
        again = (await servicer_stub.CreateMachine(request, timeout=T)).machine
        assert (again.id, again.instance_id) == (first.id, first.instance_id)
        assert fleet.machine_ids() == {first.id}

    async def test_a_key_whose_machine_its_worker_dropped_creates_anew(
        self, servicer_stub: Machines, fleet: FakeFleet
    ) -> None:
        """The worker rolled the create back and dropped its row (no event tells a replica of
        that): the replica's last row of it still names the key, and holds nothing."""
        request = m.CreateMachineRequest(**bid(idempotency_key="deploy-8"))
        first = (await servicer_stub.CreateMachine(request, timeout=T)).machine
        await fleet.seen(first.id)
        await fleet.owner_of(first.id).worker.roll_back(first.id)
        assert first.id not in fleet.machine_ids()
        assert fleet.replica.by_key(first.app, "deploy-8") is not None
        again = (await servicer_stub.CreateMachine(request, timeout=T)).machine
        assert again.instance_id != first.instance_id
        assert again.id in fleet.machine_ids()

    # -- a key is placed only where no worker may hold it already --------------------------

    async def test_a_key_waits_for_a_silent_worker_that_cannot_say_until_it_is_given_up_on(
        self, servicer_stub: Machines, fleet: FakeFleet, exchange: Exchange
    ) -> None:
        """w1 stops answering: it may have made the key's machine (a claim that timed out)
        without the replica hearing of it, so the key is not placed on w2 meanwhile."""
        await fleet.cut("w1")
        fleet.clock.advance(2.0)  # w1's last heartbeat no longer vouches for it
        await heard_since(fleet, "w2", fleet.clock.now())
        request = m.CreateMachineRequest(**bid(idempotency_key="deploy-1"))
        err = await refused(servicer_stub.CreateMachine(request, timeout=T), UNAVAILABLE)
        info = info_of(err)
        assert (info.domain, info.reason) == ("flaps.nonomad", "KEY_IN_DOUBT")
        assert dict(info.metadata) == {
            "worker": "w1",
            "machine_id": f"w1-{machine_suffix('web', 'deploy-1')}",
        }
        assert "w1 was not heard from for 2.0s" in str(err.details())
        assert fleet.machine_ids() == set()
        # Silent for longer than --key-doubt: no longer waited for.
        fleet.clock.advance(exchange.key_doubt)
        await heard_since(fleet, "w2", fleet.clock.now())
        made = (await servicer_stub.CreateMachine(request, timeout=T)).machine
        assert made.worker_id == "w2"

    async def test_a_silent_worker_that_holds_the_key_unseen_is_asked_and_answers_it(
        self, servicer_stub: Machines, fleet: FakeFleet
    ) -> None:
        w1 = fleet.workers["w1"].worker
        stalled = await stall_streams(fleet, "w1")
        fleet.clock.advance(2.0)
        await heard_since(fleet, "w2", fleet.clock.now())
        # What a claim that timed out left on w1: the key's machine, which the replica lacks.
        held = await create(w1, f"w1-{machine_suffix('web', 'deploy-2')}", key="deploy-2")
        assert fleet.replica.machine(held.id) is None
        request = m.CreateMachineRequest(**bid(idempotency_key="deploy-2"))
        again = (await servicer_stub.CreateMachine(request, timeout=T)).machine
        assert (again.id, again.instance_id) == (held.id, held.instance_id)
        assert fleet.machine_ids() == {held.id}
        # A key w1 does not hold is placed: w1 says so (NOT_FOUND), silent or not.
        other = m.CreateMachineRequest(**bid(idempotency_key="deploy-3"))
        assert (await servicer_stub.CreateMachine(other, timeout=T)).machine.id
        stalled.set()

    async def test_a_key_a_worker_is_making_is_not_placed_again_meanwhile(
        self, servicer_stub: Machines, fleet: FakeFleet, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        w1 = fleet.workers["w1"].worker
        gate = held_pulls(w1, monkeypatch)
        suffix = machine_suffix("web", "deploy-4")
        making = asyncio.create_task(create(w1, f"w1-{suffix}", key="deploy-4"))

        def heard_making() -> bool:
            doubts, _ = fleet.replica.key_doubts(["ams"], suffix, margin=1.0, give_up_after=30.0)
            return any(d.creating for d in doubts)

        await fleet.until(heard_making, "w1's heartbeat saying it makes the key's machine")
        request = m.CreateMachineRequest(**bid(idempotency_key="deploy-4"))
        err = await refused(servicer_stub.CreateMachine(request, timeout=T), UNAVAILABLE)
        assert info_of(err).reason == "KEY_IN_DOUBT"
        assert "under way on worker w1" in str(err.details())
        gate.set()
        made = await making
        await fleet.seen(made.id)
        again = (await servicer_stub.CreateMachine(request, timeout=T)).machine
        assert (again.id, again.instance_id) == (made.id, made.instance_id)
        assert fleet.machine_ids() == {made.id}

    async def test_a_key_this_flaps_placed_is_found_before_the_replica_has_its_row(
        self, servicer_stub: Machines, fleet: FakeFleet
    ) -> None:
        """A worker that answers a create and freezes before it streams the row: a create
        under the key meanwhile asks that worker, and does not place the key again."""
        # Their streams stuck; their heartbeats, sent just now, still vouch for them.
        stalled = await stall_streams(fleet, "w1", "w2")
        request = m.CreateMachineRequest(**bid(idempotency_key="deploy-6"))
        first = (await servicer_stub.CreateMachine(request, timeout=T)).machine
        assert fleet.replica.machine(first.id) is None
        again = (await servicer_stub.CreateMachine(request, timeout=T)).machine
        assert (again.id, again.instance_id) == (first.id, first.instance_id)
        # Its worker gone too: the key is in doubt, not placed on the other worker.
        await fleet.cut(first.worker_id)
        await refused(servicer_stub.CreateMachine(request, timeout=T), UNAVAILABLE)
        assert fleet.machine_ids() == {first.id}
        stalled.set()

    async def test_creates_under_one_key_through_one_flaps_make_one_machine(
        self, servicer_stub: Machines, fleet: FakeFleet
    ) -> None:
        request = m.CreateMachineRequest(**bid(idempotency_key="deploy-5"))
        made = await asyncio.gather(
            *(servicer_stub.CreateMachine(request, timeout=T) for _ in range(4))
        )
        assert len({r.machine.instance_id for r in made}) == 1
        assert len(fleet.machine_ids()) == 1

    async def test_create_with_a_lease_returns_its_nonce(self, servicer_stub: Machines) -> None:
        request = m.CreateMachineRequest(**bid(lease_ttl=seconds(60)))
        resp = await servicer_stub.CreateMachine(request, timeout=T)
        assert resp.lease.nonce
        stop = m.StopMachineRequest(machine_id=resp.machine.id)
        err = await refused(servicer_stub.StopMachine(stop, timeout=T), PRECONDITION)
        assert (info_of(err).domain, info_of(err).reason) == (FLYD, "LEASE_HELD")
        stop.lease_nonce = resp.lease.nonce
        await servicer_stub.StopMachine(stop, timeout=T)

    async def test_a_standby_lands_on_another_worker_stopped(
        self, servicer_stub: Machines, fleet: FakeFleet
    ) -> None:
        primary = await servicer_stub.CreateMachine(m.CreateMachineRequest(**bid()), timeout=T)
        request = m.CreateMachineRequest(**bid(standby_for=[primary.machine.id]))
        standby = (await servicer_stub.CreateMachine(request, timeout=T)).machine
        assert standby.state == CREATED
        assert standby.worker_id in ("w1", "w2")
        assert standby.worker_id != primary.machine.worker_id
        assert list(standby.config.standbys) == [primary.machine.id]

    async def test_starting_a_standby_promotes_it_and_the_old_primary_can_be_told(
        self, servicer_stub: Machines, fleet: FakeFleet
    ) -> None:
        primary = await servicer_stub.CreateMachine(m.CreateMachineRequest(**bid()), timeout=T)
        pid = primary.machine.id
        request = m.CreateMachineRequest(**bid(standby_for=[pid]))
        standby = (await servicer_stub.CreateMachine(request, timeout=T)).machine
        await fleet.seen(standby.id)
        # A plain start of a standby through flaps: a promotion at the next generation.
        start = m.StartMachineRequest(machine_id=standby.id)
        promoted = (await servicer_stub.StartMachine(start, timeout=T)).machine
        assert (promoted.slot.generation, promoted.slot.primary) == (1, standby.id)
        # It is the primary now: starting it again, or repeating its promotion, changes nothing.
        again = (await servicer_stub.StartMachine(start, timeout=T)).machine
        assert again.slot.generation == 1
        repeat = m.StartMachineRequest(machine_id=standby.id, generation=1)
        assert (await servicer_stub.StartMachine(repeat, timeout=T)).machine.slot.generation == 1
        # The old primary is told; promoting it to the generation taken is refused, with why.
        told = m.SupersedeMachineRequest(machine_id=pid, generation=1, primary=standby.id)
        old = (await servicer_stub.SupersedeMachine(told, timeout=T)).machine
        assert (old.slot.generation, old.slot.primary) == (1, standby.id)
        back = m.StartMachineRequest(machine_id=pid, generation=1)
        err = await refused(servicer_stub.StartMachine(back, timeout=T), PRECONDITION)
        assert (info_of(err).domain, info_of(err).reason) == (FLYD, "SUPERSEDED")
        bad = m.SupersedeMachineRequest(machine_id=pid, generation=0, primary=standby.id)
        await refused(servicer_stub.SupersedeMachine(bad, timeout=T), INVALID, "generation")

    async def test_a_full_region_fails_fast_and_moves_only_when_asked(
        self, servicer_stub: Machines, fleet: FakeFleet
    ) -> None:
        big = config(memory=1024)  # a whole worker
        for _ in range(2):
            await servicer_stub.CreateMachine(m.CreateMachineRequest(**bid(config=big)), timeout=T)
        await fleet.until(lambda: fleet.free("w1") == fleet.free("w2") == 0, "ams full")
        full = m.CreateMachineRequest(**bid(config=big))
        err = await refused(
            servicer_stub.CreateMachine(full, timeout=T), grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        info = info_of(err)
        assert (info.domain, info.reason) == ("flaps.nonomad", "NO_CAPACITY")
        assert dict(info.metadata) == {"insufficient_memory": "2"}
        assert "ams" in (err.details() or "")
        assert len(fleet.machine_ids()) == 2  # nothing was created elsewhere
        full.regions.append("syd")
        moved = await servicer_stub.CreateMachine(full, timeout=T)
        assert moved.machine.worker_id == "s1"

    async def test_a_machine_that_asks_for_egress_goes_only_where_it_can_get_out(
        self, servicer_stub: Machines, fleet: FakeFleet
    ) -> None:
        out = config(memory=64)
        out.network.egress = True
        request = m.CreateMachineRequest(**bid(config=out))
        made = [await servicer_stub.CreateMachine(request, timeout=T) for _ in range(6)]
        assert {r.machine.worker_id for r in made} == {"w1"}  # w2 has room, not the label
        # syd's only worker has no way out: refused at once, saying why, and nothing made.
        err = await refused(
            servicer_stub.CreateMachine(
                m.CreateMachineRequest(**bid(region="syd", config=out)), timeout=T
            ),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        )
        info = info_of(err)
        assert (info.domain, info.reason) == ("flaps.nonomad", "NO_CAPACITY")
        assert dict(info.metadata) == {"missing_label": "1"}
        assert len(fleet.machine_ids()) == 6

    @pytest.mark.parametrize(
        ("fields", "field"),
        [
            *BAD_BIDS,
            ({"standby_for": ["Bad"]}, "standby_for[0]"),
            ({"standby_for": ["ghost"]}, "standby_for[0]"),
            ({"name": "n" * 64}, "name"),
            ({"lease_ttl": seconds(3601)}, "lease_ttl"),
            ({"lease_ttl": Duration(seconds=-1)}, "lease_ttl"),
        ],
    )
    async def test_a_bad_create_is_refused_naming_the_field_and_creates_nothing(
        self, servicer_stub: Machines, fleet: FakeFleet, fields: dict[str, Any], field: str
    ) -> None:
        request = m.CreateMachineRequest(**bid(**fields))
        await refused(servicer_stub.CreateMachine(request, timeout=T), INVALID, field)
        assert fleet.machine_ids() == set()

    # -- operations on a machine, each sent to the worker that owns it ----------------------

    @pytest.fixture
    async def placed(self, servicer_stub: Machines, fleet: FakeFleet) -> pb.Machine:
        """A started machine of app web in ams, already in the replica."""
        resp = await servicer_stub.CreateMachine(m.CreateMachineRequest(**bid()), timeout=T)
        await fleet.seen(resp.machine.id)
        return resp.machine

    async def test_get_reads_the_machine_from_its_worker(
        self, servicer_stub: Machines, fleet: FakeFleet, placed: pb.Machine
    ) -> None:
        got = await servicer_stub.GetMachine(m.GetMachineRequest(machine_id=placed.id), timeout=T)
        assert got.machine == fleet.owner_of(placed.id).worker.rows[placed.id].machine

    async def test_get_placement_reads_the_decision_its_worker_kept(
        self, servicer_stub: Machines, fleet: FakeFleet, placed: pb.Machine
    ) -> None:
        request = m.GetPlacementRequest(machine_id=placed.id)
        why = (await servicer_stub.GetPlacement(request, timeout=T)).placement
        assert why == fleet.owner_of(placed.id).worker.placement(placed.id)
        assert why.worker_id == placed.worker_id
        (region,) = why.regions
        assert (region.region, region.outcome, region.examined) == ("ams", "placed", 2)
        assert sorted(c.worker_id for c in region.candidates) == ["w1", "w2"]
        assert region.candidates[0].worker_id == placed.worker_id  # claimed on the best first

    @pytest.mark.parametrize(
        ("request_", "names"),
        [
            (m.ListMachinesRequest(), ["a", "b"]),
            (m.ListMachinesRequest(app="web"), ["a"]),
            (m.ListMachinesRequest(region="syd"), ["b"]),
            (m.ListMachinesRequest(app="api", region="ams"), []),
            (m.ListMachinesRequest(state=DESTROYED), ["c"]),
            (m.ListMachinesRequest(include_destroyed=True), ["a", "b", "c"]),
        ],
        ids=["all", "app", "region", "app-and-region", "destroyed", "include-destroyed"],
    )
    async def test_list_machines_reads_the_fleet_from_the_replica(
        self,
        servicer_stub: Machines,
        fleet: FakeFleet,
        request_: m.ListMachinesRequest,
        names: list[str],
    ) -> None:
        for name, app, region in [("a", "web", "ams"), ("b", "api", "syd"), ("c", "web", "ams")]:
            request = m.CreateMachineRequest(**bid(app=app, region=region, name=name))
            created = (await servicer_stub.CreateMachine(request, timeout=T)).machine
            await fleet.seen(created.id)
        destroy = m.DestroyMachineRequest(machine_id=created.id, force=True)
        await servicer_stub.DestroyMachine(destroy, timeout=T)
        await fleet.seen(created.id, DESTROYED)
        resp = await servicer_stub.ListMachines(request_, timeout=T)
        assert [mm.id for mm in resp.machines] == sorted(mm.id for mm in resp.machines)
        assert sorted(mm.name for mm in resp.machines) == names

    async def test_a_machine_lives_its_life_on_its_worker(
        self, servicer_stub: Machines, fleet: FakeFleet, placed: pb.Machine
    ) -> None:
        mid = placed.id
        owner = fleet.owner_of(mid)
        wait = m.WaitMachineRequest(machine_id=mid, timeout=seconds(5))

        async def reaches(state: int) -> pb.Machine:
            wait.state = state  # type: ignore[assignment]
            return (await servicer_stub.WaitMachine(wait, timeout=T)).machine

        stop = m.StopMachineRequest(machine_id=mid, signal="SIGINT")
        await servicer_stub.StopMachine(stop, timeout=T)
        await reaches(STOPPED)
        await servicer_stub.StartMachine(m.StartMachineRequest(machine_id=mid), timeout=T)
        await reaches(STARTED)
        usr1 = m.SignalMachineRequest(machine_id=mid, signal="SIGUSR1")
        assert (await servicer_stub.SignalMachine(usr1, timeout=T)).machine.state == STARTED
        await servicer_stub.RestartMachine(m.RestartMachineRequest(machine_id=mid), timeout=T)
        await reaches(STARTED)
        update = m.UpdateMachineRequest(machine_id=mid, config=config(memory=256))
        await servicer_stub.UpdateMachine(update, timeout=T)
        updated = await reaches(STARTED)
        assert (updated.config.guest.memory_mib, updated.id) == (256, mid)
        assert updated.instance_id != placed.instance_id
        destroy = m.DestroyMachineRequest(machine_id=mid, force=True)
        await servicer_stub.DestroyMachine(destroy, timeout=T)
        await reaches(DESTROYED)
        assert owner.driver.signals[:2] == [(mid, signal.SIGINT), (mid, signal.SIGUSR1)]
        events = await servicer_stub.ListMachineEvents(
            m.ListMachineEventsRequest(machine_id=mid), timeout=T
        )
        states = [e.to_state for e in events.events]
        assert (states[0], states[-1]) == (CREATED, DESTROYED)
        assert [e.machine_id for e in events.events] == [mid] * len(events.events)

    async def test_leases_are_the_owning_workers(
        self, servicer_stub: Machines, placed: pb.Machine
    ) -> None:
        acquire = m.AcquireLeaseRequest(machine_id=placed.id, ttl=seconds(30), owner="deploy")
        lease = (await servicer_stub.AcquireLease(acquire, timeout=T)).lease
        assert lease.nonce
        assert lease.owner == "deploy"
        release = m.ReleaseLeaseRequest(machine_id=placed.id, nonce=lease.nonce)
        await servicer_stub.ReleaseLease(release, timeout=T)
        again = (await servicer_stub.AcquireLease(acquire, timeout=T)).lease  # free again
        assert again.nonce != lease.nonce

    async def test_logs_stream_from_the_owning_worker(
        self, servicer_stub: Machines, fleet: FakeFleet, placed: pb.Machine
    ) -> None:
        driver = fleet.owner_of(placed.id).driver
        for i in range(3):
            driver.write_log(placed.id, f"line {i}")
        tail = m.GetMachineLogsRequest(machine_id=placed.id, tail_lines=2)
        lines = [item.line async for item in servicer_stub.GetMachineLogs(tail, timeout=T)]
        assert lines == ["line 1", "line 2"]
        follow = m.GetMachineLogsRequest(machine_id=placed.id, tail_lines=1, follow=True)
        call = servicer_stub.GetMachineLogs(follow, timeout=T)
        try:
            assert (await call.read()).line == "line 2"
            driver.write_log(placed.id, "line 3")  # the machine prints while the client follows
            assert (await call.read()).line == "line 3"
        finally:
            call.cancel()

    @pytest.mark.parametrize(
        ("rpc", "make"),
        [
            ("GetMachine", lambda mid: m.GetMachineRequest(machine_id=mid)),
            ("StartMachine", lambda mid: m.StartMachineRequest(machine_id=mid)),
            ("StopMachine", lambda mid: m.StopMachineRequest(machine_id=mid)),
            ("RestartMachine", lambda mid: m.RestartMachineRequest(machine_id=mid)),
            ("SignalMachine", lambda mid: m.SignalMachineRequest(machine_id=mid, signal="HUP")),
            ("DestroyMachine", lambda mid: m.DestroyMachineRequest(machine_id=mid, force=True)),
            ("WaitMachine", lambda mid: m.WaitMachineRequest(machine_id=mid, state=STARTED)),
            ("UpdateMachine", lambda mid: m.UpdateMachineRequest(machine_id=mid, config=config())),
            ("AcquireLease", lambda mid: m.AcquireLeaseRequest(machine_id=mid, ttl=seconds(9))),
            ("ReleaseLease", lambda mid: m.ReleaseLeaseRequest(machine_id=mid, nonce="x")),
            ("ListMachineEvents", lambda mid: m.ListMachineEventsRequest(machine_id=mid)),
            ("GetMachineLogs", lambda mid: m.GetMachineLogsRequest(machine_id=mid)),
            ("GetPlacement", lambda mid: m.GetPlacementRequest(machine_id=mid)),
            (
                "SupersedeMachine",
                lambda mid: m.SupersedeMachineRequest(machine_id=mid, generation=1, primary="m2"),
            ),
        ],
    )
    @pytest.mark.parametrize(
        ("machine_id", "message"),
        [
            ("ghost", "machine ghost not found"),  # no worker of that name: flaps answers
            ("w1-0123456789ab", "machine w1-0123456789ab not found on worker w1"),  # w1 answers
        ],
        ids=["unknown-worker", "unknown-on-w1"],
    )
    async def test_an_unknown_machine_is_not_found(
        self,
        servicer_stub: Machines,
        fleet: FakeFleet,
        rpc: str,
        make: Callable[[str], Any],
        machine_id: str,
        message: str,
    ) -> None:
        err = await refused(answer(servicer_stub, rpc, make(machine_id)), NOT_FOUND)
        assert err.details() == message
        assert fleet.machine_ids() == set()

    @pytest.mark.parametrize(
        ("rpc", "make", "field"),
        [
            ("GetMachine", lambda mid: m.GetMachineRequest(), "machine_id"),
            ("StartMachine", lambda mid: m.StartMachineRequest(), "machine_id"),
            ("ListMachines", lambda mid: m.ListMachinesRequest(app="Web"), "app"),
            ("ListMachines", lambda mid: m.ListMachinesRequest(region="mars"), "region"),
            (
                "StopMachine",
                lambda mid: m.StopMachineRequest(machine_id=mid, signal="SIGNOPE"),
                "signal",
            ),
            ("SignalMachine", lambda mid: m.SignalMachineRequest(machine_id=mid), "signal"),
            (
                "WaitMachine",
                lambda mid: m.WaitMachineRequest(
                    machine_id=mid, state=STOPPED, timeout=seconds(61)
                ),
                "timeout",
            ),
            ("WaitMachine", lambda mid: m.WaitMachineRequest(machine_id=mid), "state"),
            (
                "UpdateMachine",
                lambda mid: m.UpdateMachineRequest(machine_id=mid, config=config(memory=0)),
                "config.guest.memory_mib",
            ),
            ("AcquireLease", lambda mid: m.AcquireLeaseRequest(machine_id=mid), "ttl"),
            (
                "GetMachineLogs",
                lambda mid: m.GetMachineLogsRequest(machine_id=mid, tail_lines=10_001),
                "tail_lines",
            ),
        ],
    )
    async def test_bad_input_on_a_machine_is_refused_naming_the_field(
        self,
        servicer_stub: Machines,
        fleet: FakeFleet,
        placed: pb.Machine,
        rpc: str,
        make: Callable[[str], Any],
        field: str,
    ) -> None:
        owner = fleet.owner_of(placed.id).worker
        seq = owner.store.last_seq()
        await refused(answer(servicer_stub, rpc, make(placed.id)), INVALID, field)
        assert owner.store.last_seq() == seq  # nothing changed

    @pytest.mark.parametrize(
        ("state", "rpc", "make", "reason"),
        [
            (
                "stopped",
                "SignalMachine",
                lambda mid: m.SignalMachineRequest(machine_id=mid, signal="HUP"),
                "WRONG_STATE",
            ),
            (
                "stopped",
                "RestartMachine",
                lambda mid: m.RestartMachineRequest(machine_id=mid),
                "WRONG_STATE",
            ),
            (
                "started",
                "DestroyMachine",
                lambda mid: m.DestroyMachineRequest(machine_id=mid),
                "WRONG_STATE",
            ),
            (
                "destroyed",
                "StartMachine",
                lambda mid: m.StartMachineRequest(machine_id=mid),
                "MACHINE_DESTROYED",
            ),
            (
                "destroyed",
                "StopMachine",
                lambda mid: m.StopMachineRequest(machine_id=mid),
                "MACHINE_DESTROYED",
            ),
            (
                "leased",
                "UpdateMachine",
                lambda mid: m.UpdateMachineRequest(machine_id=mid, config=config()),
                "LEASE_HELD",
            ),
            (
                "leased",
                "AcquireLease",
                lambda mid: m.AcquireLeaseRequest(machine_id=mid, ttl=seconds(9)),
                "LEASE_HELD",
            ),
            (
                "leased",
                "ReleaseLease",
                lambda mid: m.ReleaseLeaseRequest(machine_id=mid, nonce="not-it"),
                "LEASE_HELD",
            ),
        ],
    )
    async def test_the_workers_refusal_is_passed_on_with_its_reason(
        self,
        servicer_stub: Machines,
        fleet: FakeFleet,
        placed: pb.Machine,
        state: str,
        rpc: str,
        make: Callable[[str], Any],
        reason: str,
    ) -> None:
        await bring(servicer_stub, m, placed.id, state)
        owner = fleet.owner_of(placed.id).worker
        before = owner.rows[placed.id].machine
        err = await refused(answer(servicer_stub, rpc, make(placed.id)), PRECONDITION)
        assert (info_of(err).domain, info_of(err).reason) == (FLYD, reason), err.details()
        assert owner.rows[placed.id].machine == before  # nothing changed

    async def test_a_machine_whose_worker_is_gone_is_unavailable(
        self, servicer_stub: Machines, fleet: FakeFleet, placed: pb.Machine
    ) -> None:
        await fleet.cut(placed.worker_id)  # the worker stops answering
        request = m.GetMachineRequest(machine_id=placed.id)
        await refused(servicer_stub.GetMachine(request, timeout=T), grpc.StatusCode.UNAVAILABLE)


class TestPlatformService:
    @pytest.fixture
    def grpc_add_to_server(self, exchange: Exchange) -> Callable[[Any, Any], None]:
        """PlatformService, and beside it on the same server a MachinesService on the same
        exchange (as flaps.main serves them), for the creates a watch of placements sees."""
        platform = registered(
            platform_pb2_grpc.add_PlatformServiceServicer_to_server,
            platform_pb2.DESCRIPTOR.services_by_name["PlatformService"],
            map_error,
            LIMITS,
        )
        machines = registered(
            machines_pb2_grpc.add_MachinesServiceServicer_to_server,
            m.DESCRIPTOR.services_by_name["MachinesService"],
            map_error,
            LIMITS,
        )

        def add(servicer: Any, server: Any) -> None:
            platform(servicer, server)
            machines(MachinesServicer(exchange), server)

        return add

    @pytest.fixture
    def grpc_stub_cls(self) -> type[Platform]:
        return Platform

    @pytest.fixture
    def grpc_servicer(self, exchange: Exchange) -> PlatformServicer:
        return PlatformServicer(exchange)

    async def test_list_regions_sums_the_workers(self, servicer_stub: Platform) -> None:
        request = platform_pb2.ListRegionsRequest(guest=pb.GuestConfig(memory_mib=512))
        resp = await servicer_stub.ListRegions(request, timeout=T)
        assert [
            (r.name, r.workers, r.alive_workers, r.total.memory_mib, r.free.machines, r.fits)
            for r in resp.regions
        ] == [("ams", 2, 2, 2048, 20, 4), ("syd", 1, 1, 1024, 10, 2)]

    async def test_a_config_that_says_no_disk_is_placed_at_the_disk_its_worker_reserves(
        self, exchange: Exchange
    ) -> None:
        """0 is the default disk (`guest_disk_mib`): placement counts what the worker will
        reserve and make, not nothing; the config itself is passed on as it was asked."""
        cfg = config()
        bid_ = exchange.request("web", ["ams"], cfg, [], None)
        assert (bid_.guest.disk_mib, cfg.guest.disk_mib) == (DEFAULT_DISK_MIB, 0)
        cfg.guest.disk_mib = 64
        assert exchange.request("web", ["ams"], cfg, [], None).guest.disk_mib == 64

    @pytest.mark.parametrize("guest", ["cpu_millicores", "memory_mib", "disk_mib"])
    async def test_list_regions_refuses_a_negative_size(
        self, servicer_stub: Platform, guest: str
    ) -> None:
        request = platform_pb2.ListRegionsRequest(guest=pb.GuestConfig(**{guest: -1}))
        await refused(servicer_stub.ListRegions(request, timeout=T), INVALID, "guest")

    @pytest.mark.parametrize(
        ("region", "workers"), [("", ["s1", "w1", "w2"]), ("ams", ["w1", "w2"]), ("syd", ["s1"])]
    )
    async def test_list_workers(
        self, servicer_stub: Platform, region: str, workers: list[str]
    ) -> None:
        resp = await servicer_stub.ListWorkers(
            platform_pb2.ListWorkersRequest(region=region), timeout=T
        )
        assert [w.info.id for w in resp.workers] == workers
        assert {w.status for w in resp.workers} == {platform_pb2.WORKER_STATUS_ALIVE}
        assert all(w.info.address.startswith("127.0.0.1:") for w in resp.workers)

    async def test_list_workers_a_page_at_a_time(self, servicer_stub: Platform) -> None:
        pages, token = [], ""
        while True:
            resp = await servicer_stub.ListWorkers(
                platform_pb2.ListWorkersRequest(page_size=2, page_token=token), timeout=T
            )
            pages.append([w.info.id for w in resp.workers])
            token = resp.next_page_token
            if not token:
                break
        assert pages == [["s1", "w1"], ["w2"]]

    @pytest.mark.parametrize("size", [-1, 5001])
    async def test_list_workers_refuses_a_bad_page_size(
        self, servicer_stub: Platform, size: int
    ) -> None:
        request = platform_pb2.ListWorkersRequest(page_size=size)
        await refused(servicer_stub.ListWorkers(request, timeout=T), INVALID, "page_size")

    @pytest.mark.parametrize("region", ["mars", "AMS", "a_b"])
    async def test_list_workers_refuses_an_unknown_region(
        self, servicer_stub: Platform, region: str
    ) -> None:
        request = platform_pb2.ListWorkersRequest(region=region)
        await refused(servicer_stub.ListWorkers(request, timeout=T), INVALID, "region")

    async def test_simulate_placement_ranks_without_claiming(
        self, servicer_stub: Platform, fleet: FakeFleet
    ) -> None:
        request = platform_pb2.SimulatePlacementRequest(**bid(regions=["syd"]))
        resp = await servicer_stub.SimulatePlacement(request, timeout=T)
        assert sorted(c.worker_id for c in resp.candidates) == ["s1", "w1", "w2"]
        assert [c.region for c in resp.candidates][:2] == ["ams", "ams"]  # region order first
        assert all(c.sub_scores for c in resp.candidates)
        assert list(resp.rejections) == []
        assert fleet.machine_ids() == set()  # nothing was claimed
        # How many of its size fit in the regions asked, as ListRegions counts them.
        regions = await servicer_stub.ListRegions(
            platform_pb2.ListRegionsRequest(guest=request.config.guest), timeout=T
        )
        assert resp.fits == sum(r.fits for r in regions.regions if r.name in ("ams", "syd")) > 3

    async def test_a_plan_for_machines_that_ask_for_egress_counts_only_where_they_can_go(
        self, servicer_stub: Platform
    ) -> None:
        out = config()
        out.network.egress = True
        request = platform_pb2.SimulatePlacementRequest(**bid(regions=["syd"], config=out))
        resp = await servicer_stub.SimulatePlacement(request, timeout=T)
        assert [c.worker_id for c in resp.candidates] == ["w1"]
        assert dict(resp.rejections_by_reason) == {"missing_label": 2}  # w2 and s1
        everywhere = await servicer_stub.SimulatePlacement(
            platform_pb2.SimulatePlacementRequest(**bid(regions=["syd"])), timeout=T
        )
        assert 0 < resp.fits < everywhere.fits  # w1's room only

    async def test_simulate_placement_counts_every_rejection(self, servicer_stub: Platform) -> None:
        request = platform_pb2.SimulatePlacementRequest(**bid(config=config(memory=2048)))
        resp = await servicer_stub.SimulatePlacement(request, timeout=T)
        assert list(resp.candidates) == []
        # Memory is indexed: the workers short of it are counted for the region, not drawn
        # one by one (only a candidate stage names the workers it rejects).
        assert list(resp.rejections) == []
        assert dict(resp.rejections_by_reason) == {"insufficient_memory": 2}
        assert resp.fits == 0

    @pytest.mark.parametrize(("fields", "field"), BAD_BIDS)
    async def test_a_bad_simulation_is_refused_naming_the_field(
        self, servicer_stub: Platform, fields: dict[str, Any], field: str
    ) -> None:
        request = platform_pb2.SimulatePlacementRequest(**bid(**fields))
        await refused(servicer_stub.SimulatePlacement(request, timeout=T), INVALID, field)

    async def test_cordon_worker_goes_to_the_worker_and_placement_passes_it_over(
        self, servicer_stub: Platform, fleet: FakeFleet
    ) -> None:
        def capacity_cordoned(worker_id: str) -> bool:
            view = fleet.replica.worker(worker_id)
            return view is not None and view.capacity.cordoned

        cordon = platform_pb2.CordonWorkerRequest(worker_id="w1", cordoned=True)
        assert (await servicer_stub.CordonWorker(cordon, timeout=T)).cordoned
        assert fleet.workers["w1"].worker.cordoned
        # Its next heartbeat tells the replica; then no create is offered to it.
        await fleet.until(lambda: capacity_cordoned("w1"), "w1 cordoned in the replica")
        simulate = platform_pb2.SimulatePlacementRequest(**bid())
        resp = await servicer_stub.SimulatePlacement(simulate, timeout=T)
        assert [c.worker_id for c in resp.candidates] == ["w2"]
        uncordon = platform_pb2.CordonWorkerRequest(worker_id="w1", cordoned=False)
        assert not (await servicer_stub.CordonWorker(uncordon, timeout=T)).cordoned
        assert not fleet.workers["w1"].worker.cordoned
        await fleet.until(lambda: not capacity_cordoned("w1"), "w1 uncordoned in the replica")

    @pytest.mark.parametrize(
        ("worker_id", "code", "words"),
        [("nope", NOT_FOUND, "worker nope not found"), ("", INVALID, "worker_id: is required")],
    )
    async def test_cordon_worker_refuses_an_unknown_or_missing_worker(
        self,
        servicer_stub: Platform,
        fleet: FakeFleet,
        worker_id: str,
        code: grpc.StatusCode,
        words: str,
    ) -> None:
        request = platform_pb2.CordonWorkerRequest(worker_id=worker_id, cordoned=True)
        err = await refused(servicer_stub.CordonWorker(request, timeout=T), code)
        assert err.details() == words
        assert not any(f.worker.cordoned for f in fleet.workers.values())

    async def test_watch_placements_sees_each_regions_decision(
        self, servicer_stub: Platform, grpc_context: GrpcContext
    ) -> None:
        machines = Machines(grpc_context.channel)
        call = servicer_stub.WatchPlacements(platform_pb2.WatchPlacementsRequest(), timeout=T)
        try:
            await call.initial_metadata()  # subscribed: every decision from here on reaches it
            made = await machines.CreateMachine(m.CreateMachineRequest(**bid()), timeout=T)
            placed = await call.read()
            assert isinstance(placed, platform_pb2.WatchPlacementsResponse)
            event = placed.event
            assert (event.app, event.region, event.outcome) == ("web", "ams", "placed")
            assert (event.machine_id, event.worker_id) == (made.machine.id, made.machine.worker_id)
            assert (event.candidates, event.fallback, placed.dropped) == (2, False, False)
            # Too big for any worker: ams has none (syd still to try), then syd has none.
            big = m.CreateMachineRequest(**bid(regions=["syd"], config=config(memory=1025)))
            await refused(
                machines.CreateMachine(big, timeout=T), grpc.StatusCode.RESOURCE_EXHAUSTED
            )
            seen = []
            for _ in range(2):
                item = await call.read()
                assert isinstance(item, platform_pb2.WatchPlacementsResponse)
                seen.append(item.event)
            assert [(e.region, e.outcome, e.fallback, e.machine_id) for e in seen] == [
                ("ams", "exhausted", True, ""),
                ("syd", "exhausted", False, ""),
            ]
            assert dict(seen[0].rejections_by_reason) == {"insufficient_memory": 2}
        finally:
            call.cancel()


def test_every_rpc_of_each_service_is_called_here() -> None:
    machines = m.DESCRIPTOR.services_by_name["MachinesService"]
    platform = platform_pb2.DESCRIPTOR.services_by_name["PlatformService"]
    assert untested(machines, TestMachinesService) == []
    assert untested(platform, TestPlatformService) == []
