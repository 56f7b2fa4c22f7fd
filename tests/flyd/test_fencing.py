"""A returning worker fences its slot primaries and confirms them with the other members
(flyd.fencing): a Worker on a FakeDriver, its peers a fake the test scripts, time a ManualClock
(the scheduler's) and a fake monotonic clock (time away)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import pytest

from flyd.fencing import Peer, PeerUnreachable
from flyd.images.cache import ImageCache
from flyd.store import MemoryMachineLog
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2
from tests.flyd.support import (
    DEADLINE,
    Flyd,
    Node,
    config,
    until,
)

S = pb.MachineState
STARTED, STOPPED = S.MACHINE_STATE_STARTED, S.MACHINE_STATE_STOPPED


@dataclass
class FakePeers:
    """The other members of each slot and their rows, as the test sets them; `down` makes
    every lookup fail (the replicas and the workers cannot be reached)."""

    rows: dict[str, pb.Machine] = field(default_factory=dict)
    down: bool = False
    asked: int = 0

    async def members(self, app: str, slot: str) -> list[Peer]:
        self.asked += 1
        if self.down:
            raise PeerUnreachable("every replica is down")
        return [
            Peer(m.id, m.worker_id, f"{m.worker_id}:1")
            for m in self.rows.values()
            if m.app == app and m.slot.id == slot
        ]

    async def row(self, peer: Peer) -> pb.Machine | None:
        if self.down:
            raise PeerUnreachable(f"worker {peer.worker_id} does not answer")
        return self.rows.get(peer.machine_id)


class Away:
    """The monotonic clock fencing measures time away with."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Host:
    """The worker's node and its log, which outlive each flyd here; the other members fencing
    asks, and the time away it measures."""

    node: Node
    images: ImageCache
    store: MemoryMachineLog = field(default_factory=MemoryMachineLog)
    peers: FakePeers = field(default_factory=FakePeers)
    away: Away = field(default_factory=Away)

    def boot(self, *, recover: bool = True, peers: bool = True) -> Flyd:
        return self.node.boot(
            store=self.store,
            images=self.images,
            recover=recover,
            peers=self.peers if peers else None,
            monotonic=self.away,
        )

    async def restart(self, flyd: Flyd) -> Flyd:
        """flyd dies (its machines run on) and starts again on the same store."""
        await flyd.worker.close()
        await flyd.driver.close()
        return self.boot()


@pytest.fixture
def world(node: Node, images: ImageCache) -> Host:
    return Host(node, images)


def standby_row(primary: pb.Machine, generation: int, serving: str) -> pb.Machine:
    return pb.Machine(
        id="w2-sb",
        app=primary.app,
        worker_id="w2",
        state=STARTED if serving == "w2-sb" else STOPPED,
        slot=pb.SlotState(id=primary.id, generation=generation, primary=serving),
    )


async def confirm_all(flyd: Flyd) -> None:
    fencing = flyd.worker.fencing
    for machine_id in fencing.pending():
        await fencing.confirm(machine_id)


async def started_primary(flyd: Flyd) -> pb.Machine:
    return await flyd.worker.create(
        machine_id="w1-p", name="", app="db", config=config(), skip_launch=False
    )


async def test_a_restarted_worker_fences_before_anyone_hears_it_and_stands_down(
    world: Host,
) -> None:
    flyd = world.boot()
    primary = await started_primary(flyd)
    assert not primary.slot.fenced  # (nothing to fence until it comes back)
    world.peers.rows["w2-sb"] = standby_row(primary, 1, "w2-sb")  # promoted meanwhile

    flyd = await world.restart(flyd)
    fenced = flyd.worker.get("w1-p").machine
    assert (fenced.state, fenced.slot.fenced) == (STARTED, True)
    # A follower's first items: the fence is in the log it replays before any heartbeat.
    stop = asyncio.Event()
    items = flyd.worker.watch(0, heartbeat_interval=DEADLINE, stop=stop)
    async with contextlib.aclosing(items):
        snapshot = await anext(items)
    [row] = snapshot.snapshot.machines
    assert row.slot.fenced

    await confirm_all(flyd)
    assert world.peers.asked == 1
    now = flyd.worker.get("w1-p").machine
    assert now.slot == pb.SlotState(id="w1-p", generation=1, primary="w2-sb", fenced=False)
    await flyd.worker.wait("w1-p", STOPPED, DEADLINE)
    types = [e.type for e in flyd.worker.events("w1-p")]
    assert types[-4:] == ["fence", "start", "supersede", "stop"]  # (start: re-attached)
    assert flyd.worker.fencing.superseded_total == 1


async def test_a_fence_is_lifted_when_no_member_outranks_it(world: Host) -> None:
    flyd = world.boot()
    primary = await started_primary(flyd)
    world.peers.rows["w2-sb"] = standby_row(primary, 0, primary.id)  # still standing by
    flyd = await world.restart(flyd)
    assert flyd.worker.fencing.pending() == ["w1-p"]
    await confirm_all(flyd)
    row = flyd.worker.get("w1-p").machine
    assert (row.state, row.slot.fenced, row.slot.generation) == (STARTED, False, 0)
    assert flyd.worker.fencing.pending() == []


async def test_another_apps_claim_on_the_slots_id_does_not_supersede_it(world: Host) -> None:
    """Issue 27, attack 1, on a returning worker: evil's machine, made before the demo's
    primary (so nothing could refuse its standbys), names the primary's id as its slot and is
    promoted far above; another of evil's, elsewhere, even higher. Neither is a member of the
    demo's slot: the fence is lifted, the demo's primary serves on."""
    flyd = world.boot()
    evil = config()
    evil.standbys.append("w1-p")
    await flyd.worker.create(machine_id="w1-e", name="", app="evil", config=evil, skip_launch=True)
    await flyd.worker.start("w1-e", generation=1_000_000)
    primary = await started_primary(flyd)
    foreign = standby_row(primary, 2_000_000, "w2-sb")
    foreign.app = "evil"  # another app's row of that slot id, elsewhere
    world.peers.rows["w2-sb"] = foreign
    world.peers.rows["w2-own"] = standby_row(primary, 0, primary.id)
    world.peers.rows["w2-own"].id = "w2-own"
    flyd = await world.restart(flyd)
    assert flyd.worker.fencing.pending() == ["w1-e", "w1-p"]
    await confirm_all(flyd)
    row = flyd.worker.get("w1-p").machine
    assert row.slot == pb.SlotState(id="w1-p", generation=0, primary="w1-p")
    assert row.state == STARTED
    # Evil's own slot of that id is judged among evil's rows: its copy here is outranked by
    # its other one, and stands by for it.
    assert flyd.worker.get("w1-e").machine.slot.primary == "w2-sb"
    assert flyd.worker.fencing.superseded_total == 1


async def test_a_fence_stays_on_until_the_members_can_be_asked(world: Host) -> None:
    flyd = world.boot()
    primary = await started_primary(flyd)
    world.peers.rows["w2-sb"] = standby_row(primary, 0, primary.id)
    world.peers.down = True
    flyd = await world.restart(flyd)
    shutdown = asyncio.Event()
    runner = asyncio.create_task(flyd.worker.fencing.run(shutdown))
    try:
        for _ in range(50):  # it tries at once, then backs off (on the clock)
            await asyncio.sleep(0)
        tries = world.peers.asked
        assert tries >= 1
        assert flyd.worker.get("w1-p").machine.slot.fenced
        world.peers.down = False
        world.node.clock.advance(5.0)  # past any backoff
        await until(flyd.worker, lambda: not flyd.worker.get("w1-p").machine.slot.fenced)
        assert world.peers.asked > tries
    finally:
        shutdown.set()
        await runner


async def test_a_worker_away_longer_than_fence_after_fences_before_its_next_heartbeat(
    world: Host,
) -> None:
    flyd = world.boot()
    primary = await started_primary(flyd)
    stop = asyncio.Event()
    items = flyd.worker.watch(flyd.store.last_seq(), heartbeat_interval=0.01, stop=stop)
    async with contextlib.aclosing(items):
        first = await anext(items)
        assert first.WhichOneof("item") == "heartbeat"
        world.away.now += 3.0  # frozen (SIGSTOP) for 3 s, then thawed
        got: list[worker_pb2.WatchEventsResponse] = []
        async with asyncio.timeout(DEADLINE):
            while not got or got[-1].WhichOneof("item") != "heartbeat":
                got.append(await anext(items))
    kinds = [item.WhichOneof("item") for item in got]
    assert kinds == ["change", "heartbeat"], kinds
    assert got[0].change.event.type == "fence"
    assert got[0].change.machine.id == primary.id
    assert flyd.worker.fencing.fenced_total == 1
    # A short pause is not an absence.
    world.away.now += 0.1
    assert not await flyd.worker.fencing.check_awake()


async def test_a_fence_whose_heartbeat_was_cancelled_is_still_confirmed(world: Host) -> None:
    """After a long freeze the replicas tear the stream down, cancelling the heartbeat that
    noticed the absence mid-fence: the fencing finishes anyway and the fence is confirmed
    (here: superseded), not left on for good."""
    flyd = world.boot()
    primary = await started_primary(flyd)
    world.peers.rows["w2-sb"] = standby_row(primary, 1, "w2-sb")  # promoted while frozen
    shutdown = asyncio.Event()
    runner = asyncio.create_task(flyd.worker.fencing.run(shutdown))
    try:
        await asyncio.sleep(0)
        world.away.now += 5.0
        heartbeat = asyncio.create_task(flyd.worker.fencing.check_awake())
        await asyncio.sleep(0)  # it started fencing ...
        heartbeat.cancel()  # ... and its stream went away
        with contextlib.suppress(asyncio.CancelledError):
            await heartbeat
        await until(flyd.worker, lambda: flyd.worker.get("w1-p").machine.slot.primary == "w2-sb")
        await flyd.worker.wait("w1-p", STOPPED, DEADLINE)
        assert flyd.worker.fencing.fenced_total == 1
    finally:
        shutdown.set()
        await runner


async def test_without_a_replica_to_ask_nothing_is_fenced(world: Host) -> None:
    flyd = world.boot(peers=False)
    await started_primary(flyd)
    await flyd.worker.close()
    await flyd.driver.close()
    flyd = world.boot(peers=False)
    assert not flyd.worker.get("w1-p").machine.slot.fenced
    world.away.now += 10
    assert not await flyd.worker.fencing.check_awake()


async def test_a_standby_promoted_and_told_it_was_outranked(world: Host) -> None:
    """The worker side of a failover, on the standby's worker: a plain start is refused, a
    promotion starts it, a repeat changes nothing; a higher claim stops it again."""
    flyd = world.boot()
    w = flyd.worker
    cfg = config()
    cfg.standbys.append("w1-p")
    standby = await w.create(machine_id="w2-sb", name="", app="db", config=cfg, skip_launch=False)
    assert standby.state == S.MACHINE_STATE_CREATED
    promoted = await w.start("w2-sb", generation=1)
    assert promoted.slot == pb.SlotState(id="w1-p", generation=1, primary="w2-sb")
    await w.wait("w2-sb", STARTED, DEADLINE)
    again = await w.start("w2-sb", generation=1)
    assert again.slot.generation == 1
    assert [e.type for e in w.events("w2-sb")].count("promote") == 1
    told = await w.supersede("w2-sb", 2, "w3-other", "db")
    assert told.slot.primary == "w3-other"
    await w.wait("w2-sb", STOPPED, DEADLINE)
