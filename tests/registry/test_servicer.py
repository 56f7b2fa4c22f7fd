"""registry.v1.RegistryService in-process (pytest-grpc-aio), on a running Replica.

The servicer is wrapped with registry.service.map_error as `serve_replica` registers it.
Workers are `FakeWorker`s on loopback; replica time is a ManualClock the tests advance.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from flyd.v1 import machine_pb2 as pb
from registry.fakes import FakeWorker
from registry.replica import Replica
from registry.service import RegistryServicer, map_error
from registry.settings import FOLLOWS_PER_CALLER
from registry.v1 import registry_pb2 as r
from registry.v1 import registry_pb2_grpc
from registry.view import ALIVE, DEAD
from runtime import error_info
from runtime.clock import ManualClock
from runtime.streams import STREAM_CAP
from tests.registry.support import DEADLINE, MALFORMED_WORKERS, eventually, running, status_is
from tests.servicers import INVALID, T, refused, registered

Stub = registry_pb2_grpc.RegistryServiceStub
S = pb.MachineState


@pytest.fixture
def grpc_add_to_server() -> Callable[[Any, Any], None]:
    return registered(
        registry_pb2_grpc.add_RegistryServiceServicer_to_server,
        r.DESCRIPTOR.services_by_name["RegistryService"],
        map_error,
    )


@pytest.fixture
def grpc_stub_cls() -> type[Stub]:
    return Stub


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def replica(clock: ManualClock) -> AsyncIterator[Replica]:
    async with running(Replica(clock=clock)) as replica:
        yield replica


@pytest.fixture
def draining() -> asyncio.Event:
    """The embedding service's `draining` event: set when its shutdown begins."""
    return asyncio.Event()


@pytest.fixture
def follows_per_caller() -> int:
    """Follow streams one caller may hold (--follows-per-caller)."""
    return FOLLOWS_PER_CALLER


@pytest.fixture
def grpc_servicer(
    replica: Replica, draining: asyncio.Event, follows_per_caller: int
) -> RegistryServicer:
    return RegistryServicer(replica, draining=draining, follows_per_caller=follows_per_caller)


@pytest.fixture
async def fake() -> AsyncIterator[FakeWorker]:
    """Worker w1 (ams) on loopback with machine m1 started; it beats only when told to."""
    worker = FakeWorker("w1", "ams", heartbeat_interval=None)
    worker.change("m1", S.MACHINE_STATE_STARTED)
    await worker.serve()
    try:
        yield worker
    finally:
        await worker.stop()


@pytest.mark.parametrize(("worker", "field"), [(None, "worker"), *MALFORMED_WORKERS])
async def test_announce_refuses_bad_input_naming_the_field(
    servicer_stub: Stub, replica: Replica, worker: pb.WorkerInfo | None, field: str
) -> None:
    call = servicer_stub.Announce(r.AnnounceRequest(worker=worker), timeout=T)
    await refused(call, INVALID, field)
    assert replica.workers() == []  # nothing changed


async def test_an_announced_worker_is_followed(
    servicer_stub: Stub, replica: Replica, fake: FakeWorker
) -> None:
    resp = await servicer_stub.Announce(r.AnnounceRequest(worker=fake.info), timeout=T)
    assert [(info.id, info.address) for info in resp.workers] == [("w1", fake.address)]
    await eventually(replica, lambda: replica.machine("m1") is not None, "m1 in the replica")
    assert fake.watch_requests == [0]  # a new follower starts from a snapshot
    again = await servicer_stub.Announce(r.AnnounceRequest(worker=fake.info), timeout=T)
    assert [info.id for info in again.workers] == ["w1"]  # idempotent: still one member


async def test_list_members_reports_liveness_and_what_was_applied(
    servicer_stub: Stub, replica: Replica, clock: ManualClock
) -> None:
    beating = FakeWorker("w1", "ams", heartbeat_interval=0.05)
    await beating.serve()
    try:
        await servicer_stub.Announce(r.AnnounceRequest(worker=beating.info), timeout=T)
        ghost = pb.WorkerInfo(id="w2", region="syd", address="127.0.0.1:9")
        await servicer_stub.Announce(r.AnnounceRequest(worker=ghost), timeout=T)
        await eventually(replica, status_is(replica, "w1", ALIVE), "w1 alive")
        clock.advance(1.5)
        # w2 was never heard from; w1 keeps beating (and is alive again after its next beat)
        w1_alive, w2_dead = status_is(replica, "w1", ALIVE), status_is(replica, "w2", DEAD)
        await eventually(replica, lambda: w1_alive() and w2_dead(), "w1 alive, w2 dead")
        resp = await servicer_stub.ListMembers(r.ListMembersRequest(), timeout=T)
        members = {m.worker.id: m for m in resp.members}
        assert members["w1"].status == r.MEMBER_STATUS_ALIVE
        assert members["w1"].worker.address == beating.address
        assert members["w1"].capacity.total.machines == 100
        assert members["w1"].last_heartbeat.seconds > 0
        assert members["w2"].status == r.MEMBER_STATUS_DEAD
        assert not members["w2"].HasField("last_heartbeat")
    finally:
        await beating.stop()


async def follow_w1(replica: Replica, fake: FakeWorker) -> None:
    """The replica follows worker w1, and has its machine m1."""
    replica.add_worker(fake.info)
    await eventually(replica, lambda: replica.machine("m1") is not None, "m1 in the replica")


async def test_list_members_of_an_empty_replica(servicer_stub: Stub) -> None:
    resp = await servicer_stub.ListMembers(r.ListMembersRequest(), timeout=T)
    assert list(resp.members) == []


async def test_follow_sends_the_view_then_live_changes(
    servicer_stub: Stub, replica: Replica, fake: FakeWorker
) -> None:
    await follow_w1(replica, fake)
    call = servicer_stub.Follow(r.FollowRequest(), timeout=DEADLINE)
    try:
        first = await call.read()
        assert isinstance(first, r.FollowResponse)
        assert (first.worker_id, first.worker.region) == ("w1", "ams")
        assert [m.id for m in first.item.snapshot.machines] == ["m1"]
        fake.change("m2", S.MACHINE_STATE_CREATED)  # the worker commits a change now
        item = await call.read()
        while not item.item.HasField("change"):  # heartbeats and status updates on the way
            item = await call.read()
        assert (item.worker_id, item.item.change.machine.id) == ("w1", "m2")
        assert item.item.change.event.seq == 2
    finally:
        call.cancel()


@pytest.mark.parametrize("follows_per_caller", [1])
async def test_a_caller_holds_at_most_its_cap_of_follow_streams(
    servicer_stub: Stub, replica: Replica, fake: FakeWorker
) -> None:
    await follow_w1(replica, fake)
    call = servicer_stub.Follow(r.FollowRequest(), timeout=DEADLINE)
    try:
        assert (await call.read()).worker_id == "w1"  # it is following
        err = await refused(
            servicer_stub.Follow(r.FollowRequest(), timeout=DEADLINE).read(),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        )
        info = error_info(err)
        assert info is not None
        assert (info.reason, info.metadata["kind"]) == (STREAM_CAP, "Follow streams")
        assert "--follows-per-caller 1" in (err.details() or "")
    finally:
        call.cancel()
    # Once that one has ended, the caller may follow again.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while True:
        again = servicer_stub.Follow(r.FollowRequest(), timeout=DEADLINE)
        try:
            assert (await again.read()).worker_id == "w1"
            break
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # the cancel is on its way
            assert loop.time() < deadline
            await asyncio.sleep(0.005)
        finally:
            again.cancel()


async def test_follow_ends_unavailable_when_the_service_drains(
    servicer_stub: Stub, draining: asyncio.Event
) -> None:
    call = servicer_stub.Follow(r.FollowRequest(), timeout=DEADLINE)
    draining.set()
    err = await refused(call.read(), grpc.StatusCode.UNAVAILABLE)
    assert err.details() == "the registry replica is shutting down"


async def test_list_slot_names_each_member_with_its_worker(
    servicer_stub: Stub, replica: Replica, fake: FakeWorker
) -> None:
    await follow_w1(replica, fake)
    resp = await servicer_stub.ListSlot(r.ListSlotRequest(app="app", slot="m1"), timeout=T)
    [member] = resp.members
    assert (member.machine.id, member.worker.id, member.worker.address) == (
        "m1",
        "w1",
        fake.address,
    )
    none = await servicer_stub.ListSlot(r.ListSlotRequest(app="app", slot="m9"), timeout=T)
    assert list(none.members) == []
    for request, field in [
        (r.ListSlotRequest(app="Bad App", slot="m1"), "app"),
        (r.ListSlotRequest(app="app"), "slot"),
    ]:
        await refused(servicer_stub.ListSlot(request, timeout=T), INVALID, field)
