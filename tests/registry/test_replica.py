"""The replica's loops against fake workers on real gRPC ports, time on a ManualClock."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from flyd.v1 import machine_pb2 as pb
from registry.errors import InvalidArgument
from registry.fakes import FakeWorker
from registry.replica import FOLLOW_RESYNC, RESYNC, Replica, Subscription
from registry.service import RegistryServicer
from registry.v1 import registry_pb2 as r
from registry.v1 import registry_pb2_grpc
from registry.view import ALIVE, DEAD, SUSPECT, UNKNOWN
from runtime import aio_channel
from runtime.clock import ManualClock, SystemClock
from tests.registry.support import (
    DEADLINE,
    connected,
    drain,
    eventually,
    on_fake,
    running,
    served,
    status_is,
    view_of,
)

S = pb.MachineState


@pytest.fixture
async def fake() -> AsyncIterator[FakeWorker]:
    worker = FakeWorker("w1", "ams", heartbeat_interval=None)
    await worker.serve()
    yield worker
    await worker.stop()


def has_state(replica: Replica, machine_id: str, state: int) -> bool:
    row = replica.machine(machine_id)
    return row is not None and row.state == state


# -- following -----------------------------------------------------------------------------------


async def test_liveness_goes_alive_suspect_dead_alive_as_the_clock_moves(fake: FakeWorker) -> None:
    clock = ManualClock()
    replica = Replica(clock=clock, suspect_after=0.6, dead_after=1.0)
    replica.add_worker(fake.info)
    async with running(replica):
        sub = replica.subscribe()
        await on_fake(fake, lambda: fake.streams > 0, "the replica to follow")
        fake.beat()
        await eventually(replica, status_is(replica, "w1", ALIVE), "alive")
        # the worker falls silent: only the clock moves from here
        clock.advance(0.7)
        await eventually(replica, status_is(replica, "w1", SUSPECT), "suspect")
        clock.advance(0.4)
        await eventually(replica, status_is(replica, "w1", DEAD), "dead")
        fake.beat()
        await eventually(replica, status_is(replica, "w1", ALIVE), "alive again")
        statuses = [e.status for e in drain(sub) if e.kind == "worker"]
        assert [s for i, s in enumerate(statuses) if i == 0 or statuses[i - 1] != s] == [
            UNKNOWN,
            ALIVE,
            SUSPECT,
            DEAD,
            ALIVE,
        ]


async def test_a_restarted_worker_is_followed_from_the_last_seq_applied(fake: FakeWorker) -> None:
    fake.change("m1")
    fake.change("m2")
    replica = Replica(clock=SystemClock(), retry_max=0.1)
    replica.add_worker(fake.info)
    async with running(replica):
        await eventually(replica, lambda: replica.machine("m2") is not None, "the snapshot")
        fake.change("m1", S.MACHINE_STATE_STARTED)
        await eventually(replica, lambda: has_state(replica, "m1", S.MACHINE_STATE_STARTED), "m1")
        # the worker goes away and comes back on the same port, having moved on meanwhile
        address = fake.address
        await fake.stop()
        await eventually(replica, lambda: not view_of(replica, "w1").connected, "disconnect")
        fake.change("m3")
        await fake.serve(address)
        await eventually(replica, lambda: replica.machine("m3") is not None, "m3")
    assert fake.watch_requests[0] == 0
    assert fake.watch_requests[-1] == 3  # resumed after the last change it had applied
    view = replica.worker("w1")
    assert view is not None
    assert (view.seq, view.snapshots) == (4, 1)
    assert sorted(m.id for m in replica.machines()) == ["m1", "m2", "m3"]


async def test_a_stream_silent_for_too_long_is_reopened(fake: FakeWorker) -> None:
    fake.change("m1")
    clock = ManualClock()
    replica = Replica(clock=clock, suspect_after=0.6, dead_after=1.0)
    replica.add_worker(fake.info)
    async with running(replica):
        await eventually(replica, lambda: replica.machine("m1") is not None, "the snapshot")
        # the worker freezes: its connection stays open but nothing comes (2 s on the clock)
        clock.advance(1.5)
        await eventually(replica, status_is(replica, "w1", DEAD), "dead")
        assert fake.watch_requests == [0]  # dead is not a reason to reconnect yet
        clock.advance(1.0)
        await on_fake(fake, lambda: len(fake.watch_requests) == 2, "a new stream")
        assert fake.watch_requests == [0, 1]  # resumed where it was
        await on_fake(fake, lambda: fake.streams == 1, "the old stream closed")
        fake.beat()
        await eventually(replica, status_is(replica, "w1", ALIVE), "alive")


async def test_a_worker_whose_log_restarted_is_resynced_from_a_snapshot(fake: FakeWorker) -> None:
    for i in range(5):
        fake.change(f"old{i}")
    replica = Replica(retry_max=0.1)
    replica.add_worker(fake.info)
    async with running(replica):
        await eventually(replica, lambda: replica.machine("old4") is not None, "the old log")
        # the worker's data is wiped: same id and port, a log that starts over
        address = fake.address
        await fake.stop()
        wiped = FakeWorker("w1", "ams", heartbeat_interval=None)
        wiped.change("new0")
        await wiped.serve(address)
        try:
            await eventually(replica, lambda: replica.machine("new0") is not None, "new0")
            assert replica.machine("old4") is None
            assert wiped.watch_requests[-2:] == [5, 0]  # refused as ahead, then from scratch
        finally:
            await wiped.stop()


async def test_announcing_a_new_address_refollows_at_once(fake: FakeWorker) -> None:
    replica = Replica(retry_max=5.0)  # a long backoff: only the announce can be this quick
    replica.add_worker(fake.info)
    async with running(replica):
        await eventually(replica, connected(replica, "w1"), "connected")
        moved = FakeWorker("w1", "ams", heartbeat_interval=None)
        moved.change("m9")
        await moved.serve()
        try:
            assert replica.add_worker(moved.info) is False  # known, but moved
            await eventually(replica, lambda: replica.machine("m9") is not None, "m9")
            assert view_of(replica, "w1").info.address == moved.address
        finally:
            await moved.stop()


async def test_add_address_asks_the_worker_who_it_is() -> None:
    worker = FakeWorker("w7", "syd", heartbeat_interval=0.05)
    address = await worker.serve()
    try:
        replica = Replica()
        replica.add_address(address)
        async with running(replica):
            await eventually(replica, status_is(replica, "w7", ALIVE), "w7 alive")
            assert replica.regions() == {"syd"}
        with pytest.raises(InvalidArgument, match="address"):
            Replica().add_address("no-port")
    finally:
        await worker.stop()


# -- subscriptions -------------------------------------------------------------------------------


async def test_a_subscriber_that_falls_behind_gets_one_resync_marker(fake: FakeWorker) -> None:
    replica = Replica()
    replica.add_worker(fake.info)
    async with running(replica):
        await eventually(replica, connected(replica, "w1"), "connected")
        slow = replica.subscribe(maxsize=4)
        for i in range(20):
            fake.change(f"m{i}")
        await eventually(replica, lambda: replica.machine("m19") is not None, "m19")
        events = drain(slow)
        assert len(events) <= 4
        assert [e.kind for e in events].count("resync") == 1
        assert events[0] is RESYNC
        assert slow.overflows >= 1
        # a resync means: re-read the view, which has everything
        assert len(replica.machines()) == 20
    assert slow.closed  # the replica stopped: its subscriptions end


def test_a_coalescing_subscription_keeps_the_latest_of_each_key_once_behind() -> None:
    sub: Subscription[tuple[str, int]] = Subscription(3, ("resync", 0), key=lambda item: item[0])
    for i in range(10):
        sub.put(("a" if i % 2 else "b", i))
    sub.put(("c", 10))
    assert sub.overflows == 1
    assert [sub.get_nowait() for _ in range(len(sub))] == [("b", 8), ("a", 9), ("c", 10)]
    # caught up: a queue again, in order, every item
    for i in range(3):
        sub.put(("a", i))
    assert [sub.get_nowait() for _ in range(len(sub))] == [("a", 0), ("a", 1), ("a", 2)]


async def test_a_subscription_is_bounded_and_ends_when_closed() -> None:
    sub: Subscription[int] = Subscription(3, marker=-1)
    for i in range(7):
        sub.put(i)
    assert len(sub) <= 3
    sub.close()
    assert [i async for i in sub] == [-1, 5, 6]
    with pytest.raises(ValueError, match="maxsize"):
        Subscription(0, marker=-1)


async def test_wait_for_gives_up_at_its_deadline() -> None:
    replica = Replica()
    assert await replica.wait_for(lambda: True, 0) is True
    assert await replica.wait_for(lambda: False, 0.05) is False


# -- membership ----------------------------------------------------------------------------------


async def test_workers_known_to_a_peer_are_followed_here_too(fake: FakeWorker) -> None:
    fake.change("m1")
    first = Replica()
    first.add_worker(fake.info)
    async with running(first), served(first) as address:
        second = Replica(peers=[address])
        async with running(second):
            # the second replica was told nothing: it learns w1 from its peer and follows it
            await eventually(second, lambda: second.machine("m1") is not None, "m1 via peer")


async def test_a_peer_takes_over_a_worker_only_when_ours_is_dead(fake: FakeWorker) -> None:
    clock = ManualClock()
    replica = Replica(clock=clock)
    stale = pb.WorkerInfo(id="w2", region="ams", address="127.0.0.1:9", boot_id="old")
    replica.add_worker(stale)
    replica.add_worker(fake.info)
    fresh = pb.WorkerInfo(id="w2", region="ams", address="127.0.0.1:10", boot_id="new")

    def member(info: pb.WorkerInfo, status: int) -> r.Member:
        return r.Member(worker=info, status=status)  # type: ignore[arg-type]

    async with running(replica):
        await on_fake(fake, lambda: fake.streams > 0, "the replica to follow w1")
        fake.beat()
        await eventually(replica, status_is(replica, "w1", ALIVE), "w1 alive")
        # w2 is not dead yet: a peer's other view of it is ignored
        assert replica.merge_members([member(fresh, ALIVE)]) == 0
        clock.advance(1.5)
        await eventually(replica, status_is(replica, "w2", DEAD), "w2 dead")
        assert replica.merge_members([member(fresh, SUSPECT)]) == 0
        assert replica.merge_members([member(fresh, ALIVE)]) == 1
        assert view_of(replica, "w2").info.address == "127.0.0.1:10"
        # an alive worker is never taken over, and garbage is skipped
        fake.beat()
        await eventually(replica, status_is(replica, "w1", ALIVE), "w1 alive again")
        moved = pb.WorkerInfo(id="w1", region="ams", address="127.0.0.1:11")
        bad = pb.WorkerInfo(id="BAD", region="ams", address="127.0.0.1:12")
        assert replica.merge_members([member(moved, ALIVE), member(bad, ALIVE)]) == 0
        assert view_of(replica, "w1").info.address == fake.address


async def test_a_worker_dead_past_forget_after_is_forgotten_and_not_learned_again(
    fake: FakeWorker,
) -> None:
    from registry import metrics

    clock = ManualClock()
    replica = Replica(clock=clock, forget_after=5.0)
    replica.add_worker(fake.info)
    fake.change("m1", S.MACHINE_STATE_STARTED)
    async with running(replica):
        await on_fake(fake, lambda: fake.streams > 0, "the replica to follow")
        fake.beat()
        await eventually(replica, lambda: replica.machine("m1") is not None, "m1 applied")
        await fake.stop()  # the worker dies for good
        before = metrics.FORGOTTEN._value.get()
        clock.advance(2.0)
        await eventually(replica, status_is(replica, "w1", DEAD), "w1 dead")
        clock.advance(4.0)
        await eventually(replica, lambda: replica.worker("w1") is None, "w1 forgotten")
        assert replica.machine("m1") is None
        assert metrics.FORGOTTEN._value.get() == before + 1
        # A peer that still lists it dead does not bring it back; alive, it does.
        dead = r.Member(worker=fake.info, status=DEAD)  # type: ignore[arg-type]
        assert replica.merge_members([dead]) == 0
        assert replica.worker("w1") is None
        alive = r.Member(worker=fake.info, status=ALIVE)  # type: ignore[arg-type]
        assert replica.merge_members([alive]) == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"suspect_after": 0}, "suspect_after must be > 0"),
        ({"suspect_after": 1.0, "dead_after": 0.5}, "must be greater than suspect_after"),
        ({"retry_max": 0.01}, "retry_max"),
        ({"upstream": "nohost"}, "upstream"),
        ({"peers": ["127.0.0.1:1", "x:y"]}, "peers"),
    ],
)
def test_replica_settings_are_validated(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Replica(**kwargs)  # type: ignore[arg-type]


async def test_a_replica_runs_once() -> None:
    replica = Replica()
    async with running(replica):
        pass
    with pytest.raises(RuntimeError, match="once"):
        await replica.run(asyncio.Event())
    assert replica.subscribe().closed


# -- the Follow stream ---------------------------------------------------------------------------


async def test_a_slow_follower_is_resynced_from_a_fresh_snapshot(fake: FakeWorker) -> None:
    fake.change("m0")
    replica = Replica()
    replica.add_worker(fake.info)
    async with running(replica):
        await eventually(replica, lambda: replica.machine("m0") is not None, "m0")
        servicer = RegistryServicer(replica, follow_queue=3)
        stream = servicer.feed(r.FollowRequest())
        first = await anext(stream)
        assert first.item.snapshot.seq == 1
        # the follower reads nothing while the worker changes a lot
        for i in range(1, 10):
            fake.change(f"m{i}")
        await eventually(replica, lambda: replica.machine("m9") is not None, "m9")
        resent = await anext(stream)
        # not nine queued changes but the whole worker again, at its newest seq
        assert resent.item.WhichOneof("item") == "snapshot"
        assert resent.item.snapshot.seq == 10
        assert len(resent.item.snapshot.machines) == 10
        await stream.aclose()
    assert FOLLOW_RESYNC.worker_id == ""  # the marker itself never leaves the servicer


async def test_a_follower_that_asks_for_batches_gets_what_is_ready_in_one_message(
    fake: FakeWorker,
) -> None:
    fake.change("m0")
    replica = Replica()
    replica.add_worker(fake.info)
    async with running(replica):
        await eventually(replica, lambda: replica.machine("m0") is not None, "m0")
        stream = RegistryServicer(replica).feed(r.FollowRequest(max_batch=8))
        first = await anext(stream)  # the view
        assert (list(first.batch) or [first])[0].item.snapshot.seq == 1
        # the follower reads nothing while the worker changes five times
        for i in range(1, 6):
            fake.change(f"m{i}")
        await eventually(replica, lambda: replica.machine("m5") is not None, "m5")
        items: list[r.FollowResponse] = []
        sizes = []
        while sum(item.item.HasField("change") for item in items) < 5:
            message = await anext(stream)
            sizes.append(len(message.batch))
            items += list(message.batch) or [message]
        await stream.aclose()
    changes = [item.item.change.event.seq for item in items if item.item.HasField("change")]
    assert changes == [2, 3, 4, 5, 6]  # in order, each as it would have come alone
    assert max(sizes) >= 5  # what was ready came in one message
    assert not any(item.batch for item in items)  # a batch never holds batches


async def test_follow_streams_end_unavailable_when_the_replica_stops(fake: FakeWorker) -> None:
    replica = Replica()
    replica.add_worker(fake.info)
    shutdown = asyncio.Event()
    task = asyncio.create_task(replica.run(shutdown))
    async with served(replica) as address, aio_channel(address) as channel:
        call = registry_pb2_grpc.RegistryServiceStub(channel).Follow(r.FollowRequest())
        first = await call.read()
        assert first.worker_id == "w1"
        shutdown.set()
        await asyncio.wait_for(task, DEADLINE)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(read_to_end(call), DEADLINE)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def read_to_end(call: grpc.aio.UnaryStreamCall) -> None:
    while await call.read() is not grpc.aio.EOF:
        pass
