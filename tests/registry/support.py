"""What the registry tests share: running a replica, serving it, waiting on it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from flyd.v1 import machine_pb2 as pb
from registry.fakes import FakeWorker
from registry.replica import Replica, ReplicaEvent, Subscription
from registry.service import RegistryServicer, map_error
from registry.v1 import registry_pb2, registry_pb2_grpc
from registry.view import Status, View, WorkerView
from runtime import Service, ServiceSettings
from tests.servicers import serving

# How long any test waits for a condition before it fails (never reached when things work).
DEADLINE = 10.0


MALFORMED_WORKERS = [
    (pb.WorkerInfo(region="ams", address="h:1"), "worker.id"),
    (pb.WorkerInfo(id="W1", region="ams", address="h:1"), "worker.id"),
    (pb.WorkerInfo(id="w_1", region="ams", address="h:1"), "worker.id"),
    (pb.WorkerInfo(id="w1", address="h:1"), "worker.region"),
    (pb.WorkerInfo(id="w1", region="a_b", address="h:1"), "worker.region"),
    (pb.WorkerInfo(id="w1", region="AMS", address="h:1"), "worker.region"),
    (pb.WorkerInfo(id="w1", region="ams"), "worker.address"),
    (pb.WorkerInfo(id="w1", region="ams", address="nohost"), "worker.address"),
    (pb.WorkerInfo(id="w1", region="ams", address="localhost"), "worker.address"),
    (pb.WorkerInfo(id="w1", region="ams", address="::1:80"), "worker.address"),
    (pb.WorkerInfo(id="w1", region="ams", address="h:99999"), "worker.address"),
    (pb.WorkerInfo(id="w1", region="ams", address="h:0"), "worker.address"),
    (pb.WorkerInfo(id="w1", region="ams", address="h:1", boot_id="x y"), "worker.boot_id"),
]
"""Worker infos that are refused, each with the field it is refused for."""


@contextlib.asynccontextmanager
async def running(replica: Replica) -> AsyncIterator[Replica]:
    """Run `replica` in this event loop until the block ends."""
    shutdown = asyncio.Event()
    task = asyncio.create_task(replica.run(shutdown))
    try:
        yield replica
    finally:
        shutdown.set()
        async with asyncio.timeout(DEADLINE):
            await task


@contextlib.asynccontextmanager
async def served(replica: Replica, **servicer_args: int) -> AsyncIterator[str]:
    """Serve RegistryService for `replica` in-process, wired as flaps and proxy wire it."""
    service = Service("registry-test", ServiceSettings(listen="127.0.0.1:0", grace_period=2))
    service.add(
        RegistryServicer(replica, draining=service.draining, **servicer_args),
        registry_pb2_grpc.add_RegistryServiceServicer_to_server,
        registry_pb2.DESCRIPTOR.services_by_name["RegistryService"],
        map_error,
    )
    async with serving(service) as address:
        yield address


async def eventually(replica: Replica, predicate: Callable[[], bool], what: str) -> None:
    """Wait (with a deadline) until `predicate()` holds; fail naming `what` otherwise."""
    assert await replica.wait_for(predicate, DEADLINE), f"timed out waiting for {what}"


async def on_fake(fake: FakeWorker, predicate: Callable[[], bool], what: str) -> None:
    """Wait (with a deadline) until `predicate()` about a fake worker's streams holds."""
    assert await fake.wait_for(predicate, DEADLINE), f"timed out waiting for {what}"


def view_of(replica: Replica | View, worker_id: str) -> WorkerView:
    """The replica's (or view's) view of a worker it must know."""
    view = replica.worker(worker_id)
    assert view is not None, f"the replica does not know {worker_id}"
    return view


def connected(replica: Replica, worker_id: str) -> Callable[[], bool]:
    return lambda: replica.worker(worker_id) is not None and view_of(replica, worker_id).connected


def status_is(replica: Replica, worker_id: str, status: Status) -> Callable[[], bool]:
    def check() -> bool:
        view = replica.worker(worker_id)
        return view is not None and view.status == status

    return check


def drain(sub: Subscription[ReplicaEvent]) -> list[ReplicaEvent]:
    """Everything queued on `sub` right now."""
    out = []
    while (event := sub.get_nowait()) is not None:
        out.append(event)
    return out


async def statuses_until(
    sub: Subscription[ReplicaEvent], worker_id: str, final: Status
) -> list[Status]:
    """The statuses of `worker_id`'s worker events on `sub`, up to and including `final`."""
    seen: list[Status] = []
    async with asyncio.timeout(DEADLINE):
        async for event in sub:
            if event.kind == "worker" and event.worker_id == worker_id:
                if not seen or seen[-1] != event.status:
                    seen.append(event.status)
                if event.status == final:
                    return seen
    raise AssertionError(f"subscription ended before {worker_id} became {final}: {seen}")
