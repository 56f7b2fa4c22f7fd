"""The router and slots (proxy.fencing): only the member holding its slot's top claim gets
requests; an outranked copy's requests end and its worker is told; a fenced or failing member
makes requests wait for the failover instead of failing; promotions name the next generation.

A Router over fakes on a ManualClock (tests/proxy/support.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from flyd.v1 import machine_pb2 as pb
from model import slots
from proxy.control import FlapsFailed
from proxy.errors import NoBackend
from registry.view import ALIVE, DEAD, SUSPECT
from tests.proxy.support import STARTED, STOPPED, FakeFlaps, fleet, machine, settle, world


def claimed(row: pb.Machine, generation: int, primary: str, *, fenced: bool = False) -> pb.Machine:
    """`row` with its slot's claim set (the slot is the one its config gives it)."""
    slot = slots.slot_of(row).id
    return slots.with_slot(
        row, pb.SlotState(id=slot, generation=generation, primary=primary, fenced=fenced)
    )


def pair(*, promoted: bool = False, fenced: bool = False) -> list[pb.Machine]:
    """p on w1 (started) and its standby s on w2: s promoted to generation 1 when `promoted`."""
    p = claimed(machine("p", worker="w1"), 0, "p", fenced=fenced)
    s = machine("s", worker="w2", state=STARTED if promoted else STOPPED, standbys=["p"])
    return [p, claimed(s, 1, "s") if promoted else s]


async def test_only_the_member_holding_the_top_claim_gets_requests() -> None:
    async with world(fleet(*pair(promoted=True))) as w:
        await settle()
        for _ in range(5):
            assert (await w.router.acquire("web")).machine_id == "s"
        # p still runs on a live worker: its worker is told, once per supersede_retry, and
        # stops it (here the fake does what flyd would).
        assert w.flaps.supersedes == [("p", 1, "s")]
        [(_, routes)] = w.router.routes("web")
        by_id = {r.machine_id: r for r in routes}
        assert (by_id["p"].healthy, by_id["p"].generation) == (False, 1)
        assert (by_id["s"].healthy, by_id["s"].superseded, by_id["s"].generation) == (
            True,
            False,
            1,
        )
        assert w.registry.machine("p").state == STOPPED  # type: ignore[union-attr]
        assert slots.slot_of(w.registry.machine("p")).primary == "s"  # type: ignore[arg-type]


async def test_another_apps_machine_naming_the_slot_is_no_member_of_it() -> None:
    """Issue 27, attack 1, at the edge: evil's machine names p's slot and claims it far above.
    Slots are indexed by (app, slot): it is alone in evil's, p serves web on, nobody is told
    to supersede it, and a failover of p promotes s at its own generation among web's."""
    registry = fleet(*pair())
    async with world(registry) as w:
        evil = machine("e", app="evil", worker="w2", standbys=["p"])
        registry.put(claimed(evil, 1_000_000, "e"))
        await settle()
        assert (await w.router.acquire("web")).machine_id == "p"
        assert (await w.router.acquire("evil")).machine_id == "e"
        assert w.flaps.supersedes == []
        [(_, routes)] = w.router.routes("web")
        assert [(r.machine_id, r.healthy, r.superseded, r.generation) for r in routes] == [
            ("p", True, False, 0),
            ("s", False, False, 0),
        ]
        registry.set_status("w1", SUSPECT)
        w.probes.dead_workers.add("w1.test:7000")
        await settle()
        assert (w.flaps.starts, w.flaps.generations) == (["s"], [1])
        assert (await w.router.acquire("web")).machine_id == "s"
        assert w.flaps.supersedes == []


async def test_an_outranked_copy_on_a_silent_worker_is_left_to_fence_itself() -> None:
    registry = fleet(*pair())
    async with world(registry) as w:
        registry.set_status("w1", SUSPECT)
        w.probes.dead_workers.add("w1.test:7000")
        await settle()
        assert w.flaps.starts == ["s"]
        assert w.flaps.generations == [1]
        assert w.flaps.supersedes == []  # nobody can reach p's worker now
        assert (await w.router.acquire("web")).machine_id == "s"
        [(_, routes)] = w.router.routes("web")
        assert [(r.machine_id, r.superseded) for r in routes] == [("p", True), ("s", False)]


async def test_requests_in_flight_to_a_copy_that_stops_serving_end() -> None:
    registry = fleet(*pair())
    async with world(registry) as w:
        heard: list[tuple[frozenset[str], str]] = []
        w.router.on_machines_lost(lambda ids, why: heard.append((ids, why)))
        assert (await w.router.acquire("web")).machine_id == "p"
        # Another proxy promoted s; this one hears of it from the registry.
        registry.put(claimed(machine("s", worker="w2", standbys=["p"]), 1, "s"))
        await settle()
        assert heard == [(frozenset({"p"}), "slot p moved on to s")]
        assert (await w.router.acquire("web")).machine_id == "s"


async def test_a_fenced_primary_holds_requests_until_its_worker_confirms_it() -> None:
    registry = fleet(*pair(fenced=True))
    async with world(registry) as w:
        waiting = asyncio.create_task(w.router.acquire("web"))
        await w.advance(1.0, steps=4)
        assert not waiting.done()  # held, not refused
        registry.put(claimed(machine("p", worker="w1"), 0, "p"))  # the fence is lifted
        await w.advance(0.1)
        assert (await waiting).machine_id == "p"


async def test_a_primary_that_refuses_holds_requests_for_its_standby() -> None:
    registry = fleet(*pair())
    async with world(registry, unhealthy_for=5.0) as w:
        backend = await w.router.acquire("web")
        w.router.release(backend, ok=False, connect_failed=True)  # killed with its host
        waiting = asyncio.create_task(w.router.acquire("web", exclude=frozenset({"p"})))
        await w.advance(1.0, steps=4)
        assert not waiting.done()  # a 503 here is what the issue measured
        registry.set_status("w1", SUSPECT)
        w.probes.dead_workers.add("w1.test:7000")
        await w.advance(0.5, steps=5)
        assert (await waiting).machine_id == "s"


async def test_a_fenced_machine_alone_in_its_slot_still_serves() -> None:
    """Nobody can have taken over a machine without standbys: its fence (every restarted
    worker fences what it runs until confirmed) does not keep requests from it."""
    lone = claimed(machine("a", worker="w1"), 0, "a", fenced=True)
    async with world(fleet(lone)) as w:
        assert (await w.router.acquire("web")).machine_id == "a"
        [(_, [route])] = w.router.routes("web")
        assert (route.fenced, route.healthy) == (True, True)


async def test_requests_do_not_wait_for_a_standby_that_cannot_take_over() -> None:
    registry = fleet(*pair())
    async with world(registry, unhealthy_for=5.0) as w:
        registry.set_status("w2", DEAD)  # the standby's worker is gone too
        backend = await w.router.acquire("web")
        w.router.release(backend, ok=False, connect_failed=True)
        with pytest.raises(NoBackend, match="refused a connection recently"):
            await w.router.acquire("web")


async def test_a_promotion_refused_as_superseded_is_not_tried_on_another_standby() -> None:
    registry = fleet(
        *pair(),
        machine("t", worker="s1", state=STOPPED, standbys=["p"]),
        workers={"w1": "ams", "w2": "ams", "s1": "ams"},
    )
    async with world(registry) as w:
        w.flaps.fail["s"] = FlapsFailed(
            "could not start machine s: FAILED_PRECONDITION: slot p is at generation 1",
            code=grpc.StatusCode.FAILED_PRECONDITION,
            reason="SUPERSEDED",
        )
        registry.set_status("w1", SUSPECT)
        w.probes.dead_workers.add("w1.test:7000")
        await settle()
        assert w.flaps.starts == ["s"]  # not t: someone else promoted a member already
        assert w.stats.failovers == 0


async def test_a_fenced_primary_alone_with_dead_members_is_promoted_in_place() -> None:
    """Its worker came back but cannot reach the standby's, which is dead: waiting for the
    fence to lift would leave nothing serving; the proxy promotes the fenced copy itself."""
    registry = fleet(*pair(fenced=True))
    async with world(registry) as w:
        registry.set_status("w2", SUSPECT)
        w.probes.dead_workers.add("w2.test:7000")
        await settle()
        assert w.router.is_dead("w2")
        # Generation 1 is s's own (model.slots.promotion_generation): p's next is 2.
        assert (w.flaps.starts, w.flaps.generations) == (["p"], [2])
        row = w.registry.machine("p")
        assert row is not None
        assert (row.slot.generation, row.slot.primary, row.slot.fenced) == (2, "p", False)
        await w.advance(0.1)
        assert (await w.router.acquire("web")).machine_id == "p"


async def test_a_fenced_primary_waits_while_a_member_can_still_answer() -> None:
    async with world(fleet(*pair(fenced=True))) as w:
        await w.advance(3.0, steps=6)
        assert w.flaps.starts == []  # its worker will confirm with s's


def test_a_promotion_is_to_the_members_own_generation_above_any_claim() -> None:
    p = claimed(machine("p", worker="w1"), 3, "p")
    s = claimed(machine("s", worker="w2", state=STOPPED, standbys=["p"]), 3, "p")
    rows = [p, s, machine("other", worker="w2")]  # (another slot)
    # Two members, in their order p (the slot's first primary), s: s owns the odd generations.
    assert slots.promotion_generation(s, rows) == 5
    assert slots.promotion_generation(p, rows) == 4


async def test_a_slot_routed_nothing_fails_over_and_its_outranked_copy_is_told_when_back() -> None:
    """Machines without services get no requests, but a slot of them fails over all the same
    (WorkerWatch reads the registry): so a copy of it that runs outranked, on a worker this
    proxy had declared dead and that is back, is told to stand down as a routed copy is."""
    p = claimed(machine("p", worker="w1", services=False), 0, "p")
    s = machine("s", worker="w2", state=STOPPED, standbys=["p"], services=False)
    registry = fleet(p, s)
    async with world(registry) as w:
        registry.set_status("w1", SUSPECT)
        w.probes.dead_workers.add("w1.test:7000")
        await settle()
        assert (w.flaps.starts, w.flaps.generations) == (["s"], [1])
        assert w.flaps.supersedes == []  # p's worker hears nothing now
        # w1 is back, p running on it (its fence lifted before s was promoted): told.
        w.probes.dead_workers.clear()
        registry.set_status("w1", ALIVE)
        await settle()
        assert w.flaps.supersedes == [("p", 1, "s")]
        assert w.registry.machine("p").state == STOPPED  # type: ignore[union-attr]
        # Told once per supersede_retry, however many events its slot has meanwhile.
        registry.put(claimed(machine("p", worker="w1", services=False), 0, "p"))
        await settle()
        assert w.flaps.supersedes == [("p", 1, "s")]
        w.clock.advance(2.0)
        registry.put(claimed(machine("p", worker="w1", services=False), 0, "p"))
        await settle()
        assert w.flaps.supersedes == [("p", 1, "s"), ("p", 1, "s")]


@pytest.mark.parametrize("services", [True, False], ids=["routed", "routed-nothing"])
async def test_a_supersede_that_fails_is_tried_again_though_nothing_in_its_slot_changes(
    services: bool,
) -> None:
    """Its worker's disk failed the supersede: no later row of the slot would make the router
    look again, so it looks again itself once supersede_retry has passed."""
    p = claimed(machine("p", worker="w1", services=services), 0, "p")
    s = machine("s", worker="w2", standbys=["p"], services=services)
    registry = fleet(p, claimed(s, 1, "s"))

    class FailingOnce(FakeFlaps):
        async def supersede(self, machine_id: str, generation: int, primary: str) -> pb.Machine:
            if not self.supersedes:
                self.supersedes.append((machine_id, generation, primary))
                raise FlapsFailed("INTERNAL: disk w1: input/output error")
            return await super().supersede(machine_id, generation, primary)

    async with world(registry, FailingOnce(registry)) as w:
        await settle()
        assert w.flaps.supersedes == [("p", 1, "s")]
        assert w.registry.machine("p").state == STARTED  # type: ignore[union-attr]
        w.clock.advance(2.0)
        await settle()
        assert w.flaps.supersedes == [("p", 1, "s"), ("p", 1, "s")]
        assert w.registry.machine("p").state == STOPPED  # type: ignore[union-attr]
