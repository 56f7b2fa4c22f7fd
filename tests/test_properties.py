"""Properties of every service under arbitrary requests (issue 19), with hypothesis.

Every RPC of every service is called with arbitrary messages of its request type
(tests/properties.py): values and sizes anywhere in their range, names with trailing newlines,
strings far over any bound, lists longer than allowed. Whatever comes in:

- no call answers UNKNOWN or INTERNAL (a crash, or an exception nobody mapped);
- every machine a worker holds can still be destroyed (a leased one with its nonce);
- a fresh replica reading the worker's snapshot from scratch sees every machine the worker
  has, and the replica flaps embeds still sees every worker alive.

The services run in-process on one server, as their main() registers them (limits, error
mapping), over fake drivers and fake fleets; the examples are few and bounded so the suite
stays fast. The regression tests of each defect are beside each service's own tests
(tests/*/test_hostile.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flaps import placement
from flaps.errors import map_error as flaps_map_error
from flaps.service import LIMITS as FLAPS_LIMITS
from flaps.service import Exchange, MachinesServicer, PlatformServicer, Workers
from flaps.v1 import machines_pb2, machines_pb2_grpc, platform_pb2, platform_pb2_grpc
from flyd.fakes import FakeHost
from flyd.service import LIMITS as FLYD_LIMITS
from flyd.service import WorkerServicer
from flyd.service import map_error as flyd_map_error
from flyd.store import MemoryMachineLog
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2, worker_pb2_grpc
from proxy.service import ProxyServicer
from proxy.service import map_error as proxy_map_error
from proxy.v1 import proxy_pb2, proxy_pb2_grpc
from registry.replica import Replica
from registry.service import RegistryServicer
from registry.service import map_error as registry_map_error
from registry.v1 import registry_pb2, registry_pb2_grpc
from registry.view import ALIVE, View
from runtime import register
from runtime.clock import ManualClock
from tests.flaps.support import FakeFleet, fake_fleet
from tests.flyd.support import Flyd, boot, image_cache, image_source
from tests.harness import ServiceProcess
from tests.properties import requests
from tests.proxy.support import fleet, machine, world
from tests.registry.support import running

CRASHES = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
CALL_TIMEOUT = 2.0
S = pb.MachineState
PROPERTY_SETTINGS = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,  # the same examples on every run: a failure is a repro, not weather
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

WORKER = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"]
MACHINES = machines_pb2.DESCRIPTOR.services_by_name["MachinesService"]
PLATFORM = platform_pb2.DESCRIPTOR.services_by_name["PlatformService"]
REGISTRY = registry_pb2.DESCRIPTOR.services_by_name["RegistryService"]
PROXY = proxy_pb2.DESCRIPTOR.services_by_name["ProxyService"]


@dataclass
class World:
    """Every service on one in-process server, and what they stand on."""

    loop: asyncio.AbstractEventLoop
    channel: grpc.aio.Channel
    flyd: Flyd
    fleet: FakeFleet
    worker_channels: dict[str, grpc.aio.Channel]

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)


@contextlib.asynccontextmanager
async def _serving(
    root: Path,
) -> AsyncIterator[tuple[grpc.aio.Channel, Flyd, FakeFleet, dict[str, grpc.aio.Channel]]]:
    async with contextlib.AsyncExitStack() as stack:
        clock = ManualClock()
        flyd = boot(
            store=MemoryMachineLog(),
            host=FakeHost(clock),
            clock=clock,
            images=image_cache(root / "w", image_source(root / "w")),
        )
        flyd.worker.recover()
        stack.push_async_callback(flyd.kill)
        fake = await stack.enter_async_context(
            fake_fleet(root / "fleet", {"w1": "ams", "s1": "syd"})
        )
        workers = Workers(fake.replica)
        stack.push_async_callback(workers.close)
        exchange = Exchange(fake.replica, workers, placement.Pipeline())
        replica = await stack.enter_async_context(running(Replica(clock=ManualClock())))
        edge = await stack.enter_async_context(world(fleet(machine("web-a", worker="w1"))))

        server = grpc.aio.server()
        draining = asyncio.Event()
        register(
            server,
            WorkerServicer(flyd.worker, heartbeat_interval=60.0, draining=draining),
            worker_pb2_grpc.add_WorkerServiceServicer_to_server,
            WORKER,
            flyd_map_error,
            FLYD_LIMITS,
        )
        for servicer, add, service in [
            (
                MachinesServicer(exchange),
                machines_pb2_grpc.add_MachinesServiceServicer_to_server,
                MACHINES,
            ),
            (
                PlatformServicer(exchange),
                platform_pb2_grpc.add_PlatformServiceServicer_to_server,
                PLATFORM,
            ),
        ]:
            register(server, servicer, add, service, flaps_map_error, FLAPS_LIMITS)
        register(
            server,
            RegistryServicer(replica, draining=draining),
            registry_pb2_grpc.add_RegistryServiceServicer_to_server,
            REGISTRY,
            registry_map_error,
        )
        register(
            server,
            ProxyServicer(edge.router, edge.stats),
            proxy_pb2_grpc.add_ProxyServiceServicer_to_server,
            PROXY,
            proxy_map_error,
        )
        address = f"unix-abstract:nonomad-properties-{uuid.uuid4().hex}"
        server.add_insecure_port(address)
        await server.start()

        async def stop() -> None:
            draining.set()
            await server.stop(None)

        stack.push_async_callback(stop)
        channel = grpc.aio.insecure_channel(address)
        stack.push_async_callback(channel.close)
        to_workers = {}
        for worker_id, worker in fake.workers.items():
            to_workers[worker_id] = grpc.aio.insecure_channel(worker.worker.identity.address)
            stack.push_async_callback(to_workers[worker_id].close)
        yield channel, flyd, fake, to_workers


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """One loop of the module's own, driven example by example from synchronous tests
    (hypothesis runs each example to its end before drawing the next)."""
    loop = asyncio.new_event_loop()
    serving = _serving(tmp_path_factory.mktemp("properties"))
    try:
        channel, flyd, fake, to_workers = loop.run_until_complete(serving.__aenter__())
        try:
            yield World(loop, channel, flyd, fake, to_workers)
        finally:
            loop.run_until_complete(serving.__aexit__(None, None, None))
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


async def _call(
    channel: grpc.aio.Channel, method: MethodDescriptor, request: Message | bytes
) -> None:
    """Call `method` with `request` (or raw bytes; a stream: its first item); fail on a
    crash's status."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    payload = request if isinstance(request, bytes) else request.SerializeToString()
    try:
        if method.server_streaming:
            call = channel.unary_stream(path)(payload, timeout=CALL_TIMEOUT)
            try:
                await call.read()
            finally:
                call.cancel()
        else:
            await channel.unary_unary(path)(payload, timeout=CALL_TIMEOUT)
    except grpc.aio.AioRpcError as err:
        assert err.code() not in CRASHES, f"{path} answered {err.code().name}: {err.details()}"


async def _destroy_all(channel: grpc.aio.Channel, flyd: Flyd) -> None:
    """Every machine of the worker can be destroyed: each ends DESTROYED."""
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    for machine_id, row in list(flyd.worker.rows.items()):
        if row.state == S.MACHINE_STATE_DESTROYED:
            continue
        nonce = row.lease["nonce"] if row.lease else ""
        request = worker_pb2.DestroyMachineRequest(
            machine_id=machine_id, force=True, lease_nonce=nonce
        )
        await stub.DestroyMachine(request, timeout=CALL_TIMEOUT)
        wait = worker_pb2.WaitMachineRequest(machine_id=machine_id, state=S.MACHINE_STATE_DESTROYED)
        got = await stub.WaitMachine(wait, timeout=CALL_TIMEOUT)
        assert got.machine.state == S.MACHINE_STATE_DESTROYED, machine_id


async def _fresh_view_sees_all(channel: grpc.aio.Channel, flyd: Flyd) -> None:
    """A replica that starts from nothing rebuilds every row from the worker's snapshot."""
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    view = View(suspect_after=1, dead_after=2)
    view.add(flyd.worker.info(), 0.0)
    call = stub.WatchEvents(worker_pb2.WatchEventsRequest(from_seq=0), timeout=CALL_TIMEOUT)
    try:
        async for item in call:
            view.apply("w1", item, 0.0)
            if item.WhichOneof("item") == "snapshot" and not item.snapshot.more:
                break
    finally:
        call.cancel()
    assert {m.id for m in view.machines()} == set(flyd.worker.rows)


def _methods(service: Any) -> st.SearchStrategy[MethodDescriptor]:
    return st.sampled_from(list(service.methods))


@PROPERTY_SETTINGS
@given(data=st.data())
def test_the_worker_survives_any_request(services: World, data: st.DataObject) -> None:
    method = data.draw(_methods(WORKER), label="rpc")
    request = data.draw(requests(method.input_type), label="request")
    services.run(_call(services.channel, method, request))
    services.run(_destroy_all(services.channel, services.flyd))
    services.run(_fresh_view_sees_all(services.channel, services.flyd))
    services.flyd.worker.cordon(False)  # a cordon drawn here would only refuse later creates


@PROPERTY_SETTINGS
@given(data=st.data())
def test_flaps_survives_any_request(services: World, data: st.DataObject) -> None:
    method = data.draw(_methods(MACHINES) | _methods(PLATFORM), label="rpc")
    request = data.draw(requests(method.input_type), label="request")
    services.run(_call(services.channel, method, request))
    fake = services.fleet
    for worker_id, flyd in fake.workers.items():
        services.run(_destroy_all(services.worker_channels[worker_id], flyd))
    # Whatever a tenant sent, no worker went missing from the replica flaps embeds.
    assert {v.info.id: v.status for v in fake.replica.workers()} == dict.fromkeys(
        fake.workers, ALIVE
    )


@PROPERTY_SETTINGS
@given(data=st.data())
def test_the_registry_and_the_edge_survive_any_request(
    services: World, data: st.DataObject
) -> None:
    method = data.draw(_methods(REGISTRY) | _methods(PROXY), label="rpc")
    request = data.draw(requests(method.input_type), label="request")
    services.run(_call(services.channel, method, request))


@PROPERTY_SETTINGS
@given(data=st.data())
def test_no_service_crashes_on_bytes_that_are_not_its_request(
    services: World, data: st.DataObject
) -> None:
    """Garbage, truncated messages, invalid UTF-8: INVALID_ARGUMENT, never UNKNOWN."""
    every = [WORKER, MACHINES, PLATFORM, REGISTRY, PROXY]
    method = data.draw(st.sampled_from([m for s in every for m in s.methods]), label="rpc")
    valid = data.draw(requests(method.input_type), label="request").SerializeToString()
    payload = data.draw(
        st.one_of(
            st.binary(max_size=64),
            st.integers(0, max(0, len(valid) - 1)).map(lambda n: valid[:n]),  # truncated
            st.just(valid + b"\xff"),
        ),
        label="payload",
    )
    services.run(_call(services.channel, method, payload))
    services.run(_destroy_all(services.channel, services.flyd))


# -- a real process ----------------------------------------------------------------------------


async def test_a_real_flyd_stays_whole_under_the_hostile_run(
    flyd_factory: Callable[..., ServiceProcess],
    stub_for: Callable[[str], worker_pb2_grpc.WorkerServiceStub],
) -> None:
    """The hostile run's worst requests against a real flyd (real LMDB, real processes),
    read back by a client with gRPC's default 4 MiB receive limit."""
    flyd = flyd_factory()
    stub = stub_for(flyd.address)
    invalid = grpc.StatusCode.INVALID_ARGUMENT

    def demo(**fields: Any) -> pb.MachineConfig:
        guest = pb.GuestConfig(cpu_millicores=10, memory_mib=16)
        return pb.MachineConfig(image="demo:v1", guest=guest, **fields)

    async with grpc.aio.insecure_channel(flyd.address) as channel:
        raw = channel.unary_unary("/flyd.v1.WorkerService/CreateMachine")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await raw(b"\x22\x05ab", timeout=CALL_TIMEOUT)  # a truncated config
        assert caught.value.code() == invalid
    for request in [
        worker_pb2.CreateMachineRequest(app="demo", config=demo(cmd=["a" * 2**20])),
        worker_pb2.CreateMachineRequest(machine_id="fzmid\n", app="demo", config=demo()),
        worker_pb2.CreateMachineRequest(app="d" * 2**20, config=demo()),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.CreateMachine(request, timeout=CALL_TIMEOUT)
        assert caught.value.code() == invalid
        assert len(caught.value.details() or "") < 200

    # Machines as large as the bounds allow, created and destroyed, as in the issue.
    heavy = demo(cmd=["a" * 4000] * 15)
    for i in range(8):
        request = worker_pb2.CreateMachineRequest(
            machine_id=f"big-{i}", app="demo", config=heavy, skip_launch=True
        )
        await stub.CreateMachine(request, timeout=30)
        if i % 2:
            destroy = worker_pb2.DestroyMachineRequest(machine_id=f"big-{i}")
            await stub.DestroyMachine(destroy, timeout=30)
    listed = await stub.ListMachines(
        worker_pb2.ListMachinesRequest(include_destroyed=True), timeout=30
    )
    assert {m.id for m in listed.machines} == {f"big-{i}" for i in range(8)}
    view = View(suspect_after=1, dead_after=2)
    info = (await stub.GetCapacity(worker_pb2.GetCapacityRequest(), timeout=30)).worker
    info.address = flyd.address
    view.add(info, 0.0)
    call = stub.WatchEvents(worker_pb2.WatchEventsRequest(from_seq=0), timeout=30)
    async for item in call:
        view.apply(info.id, item, 0.0)
        if item.WhichOneof("item") == "snapshot" and not item.snapshot.more:
            break
    call.cancel()
    assert {m.id for m in view.machines()} == {f"big-{i}" for i in range(8)}

    started = await stub.CreateMachine(
        worker_pb2.CreateMachineRequest(app="demo", config=demo()), timeout=30
    )
    stop = worker_pb2.SignalMachineRequest(machine_id=started.machine.id, signal="SIGSTOP")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.SignalMachine(stop, timeout=30)
    assert caught.value.code() == invalid
