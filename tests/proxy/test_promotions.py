"""Promotions and stale views (docs/fencing.md): each generation of a slot is one member's own,
so proxies that disagree about workers never record two promotions at one generation; a proxy
whose view lags routes the old primary only until it applies the promoted row, and never once
it declared the old primary's worker dead; a slot whose serving member was stopped (idle) when
its worker died is taken over by a standby on the next request.

Routers over fakes on a ManualClock (tests/proxy/support.py). `Workers` stands for the workers
behind flaps: it keeps the true rows, applies flyd's own rule to each start (model.slots), and
replicates every change to the registries of the proxies that follow it.
"""

from __future__ import annotations

import asyncio
import itertools

import grpc

from flyd.v1 import machine_pb2 as pb
from model import slots
from model.errors import FailedPrecondition
from proxy.control import FlapsFailed, standby_candidates
from registry.view import DEAD, SUSPECT
from tests.proxy.support import (
    STARTED,
    STOPPED,
    FakeFlaps,
    FakeRegistry,
    fleet,
    machine,
    settle,
    world,
)

WORKERS = {"w1": "ams", "w2": "ams", "w3": "ams"}


def trio() -> list[pb.Machine]:
    """p on w1 (started), its standbys s on w2 and t on w3 (stopped)."""
    return [
        machine("p", worker="w1"),
        machine("s", worker="w2", state=STOPPED, standbys=["p"]),
        machine("t", worker="w3", state=STOPPED, standbys=["p"]),
    ]


class Workers(FakeFlaps):
    """The workers behind flaps: starts follow flyd's rule (a stale promotion is refused as
    SUPERSEDED), each change reaches every follower's registry, and every recorded promotion is
    kept as (generation, machine). `ambiguous`: machines whose start commits, then fails with
    an error that is not worth retrying (the caller cannot tell whether it happened)."""

    def __init__(self, *followers: FakeRegistry) -> None:
        super().__init__(followers[0])
        self.followers = followers
        self.promotions: list[tuple[int, str]] = []
        self.ambiguous: set[str] = set()

    def _put(self, row: pb.Machine) -> None:
        for registry in self.followers:
            registry.put(row)

    async def start(self, machine_id: str, generation: int = 0) -> pb.Machine:
        self.starts.append(machine_id)
        self.generations.append(generation)
        await self.gate.wait()
        row = self.registry.machine(machine_id)
        assert row is not None
        try:
            promoted = slots.promotion(row, generation)
        except FailedPrecondition as err:
            raise FlapsFailed(
                str(err), code=grpc.StatusCode.FAILED_PRECONDITION, reason=err.reason
            ) from None
        if promoted is not None:
            row = slots.with_slot(row, promoted)
            self.promotions.append((generation, machine_id))
        if row.state != STARTED:
            started = pb.Machine()
            started.CopyFrom(row)
            started.state = STARTED
            row = started
        self._put(row)
        if machine_id in self.ambiguous:
            raise FlapsFailed(
                f"could not start machine {machine_id}: INTERNAL: the connection broke",
                code=grpc.StatusCode.INTERNAL,
            )
        return row

    async def supersede(self, machine_id: str, generation: int, primary: str) -> pb.Machine:
        self.supersedes.append((machine_id, generation, primary))
        row = self.registry.machine(machine_id)
        assert row is not None
        new = slots.superseded(row, generation, primary)
        if new is None:
            return row
        row = slots.with_slot(row, new)
        row.state = STOPPED
        self._put(row)
        return row


def test_each_generation_is_one_members_own_whatever_a_proxy_believes() -> None:
    """Every view a proxy may hold of the slot (which claim is on top, which standby workers
    look usable): the generation it promotes a standby to names that standby alone."""
    owners: dict[int, set[str]] = {}
    for top, usable in itertools.product(range(6), itertools.product([True, False], repeat=2)):
        claim = pb.SlotState(id="p", generation=top, primary="p")
        rows = [slots.with_slot(r, claim) for r in trio()]
        workers = dict(zip(["w2", "w3"], usable, strict=True))
        _, stopped = standby_candidates(rows[0], rows, lambda w, ok=workers: ok.get(w, True))
        for standby in stopped:
            row = next(r for r in rows if r.id == standby)
            generation = slots.promotion_generation(row, rows)
            assert generation > top
            owners.setdefault(generation, set()).add(standby)
    assert all(len(who) == 1 for who in owners.values()), owners
    assert (owners[1], owners[2]) == ({"s"}, {"t"})


async def test_proxies_that_see_different_workers_record_one_promotion_per_generation() -> None:
    # Proxy a sees every worker alive; proxy b lost w2 (it has it dead). Both lose w1.
    view_a, view_b = fleet(*trio(), workers=WORKERS), fleet(*trio(), workers=WORKERS)
    view_b.set_status("w2", DEAD)
    workers = Workers(view_a, view_b)
    async with world(view_a, workers) as a, world(view_b, workers) as b:
        for w, view in ((a, view_a), (b, view_b)):
            w.probes.dead_workers.add("w1.test:7000")
            view.set_status("w1", SUSPECT)
        await settle()
        assert (a.router.is_dead("w1"), b.router.is_dead("w1")) == (True, True)
        # a promoted s, b (which could not use s) promoted t: each at its own generation, so
        # the claims order them, (2, t) over (1, s), and a tells s's worker to stand down.
        assert sorted(workers.promotions) == [(1, "s"), (2, "t")]
        await a.advance(0.1)
        await b.advance(0.1)
        assert ("s", 2, "t") in workers.supersedes
        s = view_a.machine("s")
        assert s is not None
        assert (s.state, slots.claim(s)) == (STOPPED, (2, "t"))
        assert (await a.router.acquire("web")).machine_id == "t"
        assert (await b.router.acquire("web")).machine_id == "t"
    generations = [g for g, _ in workers.promotions]
    assert len(generations) == len(set(generations))  # one promotion per generation


async def test_after_an_ambiguous_failure_the_next_standby_gets_its_own_generation() -> None:
    """s's start failed after its worker committed the promotion: the proxy moves on to t, at
    t's generation (2), not at s's (1), which s may hold now."""
    view = fleet(*trio(), workers=WORKERS)
    workers = Workers(view)
    workers.ambiguous.add("s")
    async with world(view, workers) as w:
        w.probes.dead_workers.add("w1.test:7000")
        view.set_status("w1", SUSPECT)
        await w.advance(1.0, steps=5)
        assert list(zip(workers.starts, workers.generations, strict=True)) == [("s", 1), ("t", 2)]
        assert workers.promotions == [(1, "s"), (2, "t")]
        assert (await w.router.acquire("web")).machine_id == "t"


async def test_a_stale_view_routes_the_old_primary_only_until_it_applies_the_promotion() -> None:
    """Another proxy promoted s; this one has not applied s's row yet. Its worker w1 is not
    declared dead here (flyd died, its machine runs on): p may still get requests, which is
    the window docs/fencing.md bounds. Once the row is applied p gets nothing, and a GET in
    flight to it is sent again to s."""
    view = fleet(*trio()[:2])
    async with world(view) as w:
        lost: list[frozenset[str]] = []
        w.router.on_machines_lost(lambda ids, why: lost.append(ids))
        in_flight = await w.router.acquire("web")
        assert in_flight.machine_id == "p"  # the window: the promoted row has not arrived
        promoted = machine("s", worker="w2", standbys=["p"])
        view.put(slots.with_slot(promoted, pb.SlotState(id="p", generation=1, primary="s")))
        await w.advance(0.1)
        assert lost == [frozenset({"p"})]  # the request in flight to p ends ...
        retry = await w.router.acquire("web", exclude=frozenset({"p"}))
        assert retry.machine_id == "s"  # ... and goes to the new primary
        for _ in range(5):
            assert (await w.router.acquire("web")).machine_id == "s"
        w.router.release(in_flight, ok=False)
        w.router.release(retry, ok=True)


async def test_a_stale_view_never_routes_the_old_primary_once_its_worker_is_dead() -> None:
    """This proxy declared w1 dead before the promoted row arrived (its own promotion is still
    on its way): requests wait, and never go to p; they get s once its row is applied."""
    view = fleet(*trio()[:2])
    async with world(view) as w:
        w.flaps.gate.clear()  # this proxy's promotion of s does not land yet
        w.probes.dead_workers.add("w1.test:7000")
        view.set_status("w1", SUSPECT)
        await settle()
        assert w.router.is_dead("w1")
        waiting = asyncio.create_task(w.router.acquire("web"))
        await w.advance(2.0, steps=8)
        assert not waiting.done()  # held: p is on a dead worker, s has not been promoted here
        # Another proxy's promotion of s reaches this view.
        promoted = machine("s", worker="w2", standbys=["p"])
        view.put(slots.with_slot(promoted, pb.SlotState(id="p", generation=1, primary="s")))
        await w.advance(0.1)
        assert (await waiting).machine_id == "s"
        w.flaps.gate.set()  # its own promotion lands: a repeat, nothing changes
        await settle()
        row = view.machine("s")
        assert row is not None
        assert slots.claim(row) == (1, "s")
        assert (await w.router.acquire("web")).machine_id == "s"


async def test_a_primary_stopped_when_its_worker_died_is_taken_over_on_the_next_request() -> None:
    """p was autostopped; then w1 died. Nobody failed it over (it was not running), and it
    cannot be started where it is: the next request promotes s instead of getting a 503."""
    p = machine("p", worker="w1", state=STOPPED)
    view = fleet(p, machine("s", worker="w2", state=STOPPED, standbys=["p"]))
    async with world(view) as w:
        view.set_status("w1", DEAD)
        await settle()
        assert w.flaps.starts == []  # no failover: nothing ran on w1
        backend = await w.router.acquire("web")
        assert backend.machine_id == "s"
        assert (w.flaps.starts, w.flaps.generations) == (["s"], [1])
        assert w.stats.failovers == 1
        row = view.machine("s")
        assert row is not None
        assert slots.claim(row) == (1, "s")
        w.router.release(backend, ok=True)


async def test_a_stopped_primary_on_a_live_worker_is_started_where_it_is() -> None:
    view = fleet(
        machine("p", worker="w1", state=STOPPED),
        machine("s", worker="w2", state=STOPPED, standbys=["p"]),
    )
    async with world(view) as w:
        assert (await w.router.acquire("web")).machine_id == "p"
        assert (w.flaps.starts, w.flaps.generations) == (["p"], [0])
        assert w.stats.failovers == 0
