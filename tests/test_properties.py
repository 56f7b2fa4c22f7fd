"""Properties of every service under hostile requests (issue 19), with hypothesis.

Each RPC of flyd's WorkerService and flaps' MachinesService and PlatformService has a property
test of its own (`test_every_rpc_survives_hostile_requests`, one per method walked from the
descriptors): a valid request (an image, a small guest, a machine id the worker has) with up to
three fields at any depth set to hostile values (tests/properties.py: strings far over any
bound, names with a trailing newline, numbers at the ends of their type, unknown enums, lists
of thousands). Before each call every worker holds a few machines, one started and the others
created with skip_launch; whatever comes in:

- no call answers UNKNOWN or INTERNAL (a crash, or an exception nobody mapped), nor
  UNIMPLEMENTED;
- a fresh replica, following the workers from nothing, sees each of them ALIVE with every
  machine it has, and the replica flaps embeds still sees every worker alive;
- every machine can then be destroyed (a leased one with its nonce).

The registry's and the edge's RPCs get the same requests; every RPC of every service, health
and reflection included, gets bytes that are not its request (INVALID_ARGUMENT in plain words).

The workers are flyd on the fake driver, each served as its main() serves it; flaps, the
registry and the edge run on one in-process server with their limits and error mapping. One
set of them serves the whole module; the examples are few (derandomized: a failure is a
repro, not weather) so that the module stays well under a minute. Then real processes: the
hostile run's worst requests against a real flyd, and a worker whose snapshot is past gRPC's
4 MiB message limit, read by a fresh replica and listed through flyd and flaps. The
regression tests of each defect are beside each service's own tests (tests/*/test_hostile.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.duration_pb2 import Duration
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flaps import placement
from flaps.errors import map_error as flaps_map_error
from flaps.service import LIMITS as FLAPS_LIMITS
from flaps.service import Exchange, MachinesServicer, PlatformServicer, Workers
from flaps.v1 import machines_pb2, machines_pb2_grpc, platform_pb2, platform_pb2_grpc
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
from runtime.limits import DEFAULT_LIMITS
from runtime.server import add_health_and_reflection
from tests.flaps.conftest import Fleet, eventually
from tests.flaps.support import FakeFleet, fake_fleet
from tests.flyd.support import DEADLINE, Flyd, config
from tests.harness import ServiceProcess
from tests.properties import Known, hostile, requests, valid
from tests.proxy.support import fleet, machine, world
from tests.registry.support import running

CRASHES = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
CALL_TIMEOUT = 1.0
# How long a stream is read for its first item: a watch may rightly send nothing for long.
STREAM_WAIT = 0.2
S = pb.MachineState
DESTROYED = S.MACHINE_STATE_DESTROYED


def _examples(n: int) -> settings:
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=True,  # the same examples on every run: a failure is a repro, not weather
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


WORKER = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"]
MACHINES = machines_pb2.DESCRIPTOR.services_by_name["MachinesService"]
PLATFORM = platform_pb2.DESCRIPTOR.services_by_name["PlatformService"]
REGISTRY = registry_pb2.DESCRIPTOR.services_by_name["RegistryService"]
PROXY = proxy_pb2.DESCRIPTOR.services_by_name["ProxyService"]
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]
REFLECTION = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]


def _methods(*services: ServiceDescriptor) -> list[MethodDescriptor]:
    return [method for service in services for method in service.methods]


def _path(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


def _name(method: MethodDescriptor) -> str:
    return f"{method.containing_service.name}.{method.name}"


TENANT_RPCS = _methods(WORKER, MACHINES, PLATFORM)
EDGE_RPCS = _methods(REGISTRY, PROXY)
EVERY_RPC = _methods(WORKER, MACHINES, PLATFORM, REGISTRY, PROXY, HEALTH, REFLECTION)
# The machines each worker holds before a hostile call: one started, the rest skip_launch.
ROWS = {"w1": 3, "s1": 1}
CONFIG = config(cpu=10, memory=16)
_ids = itertools.count()


@dataclass
class World:
    """flaps, the registry and the edge on one in-process server, over a fleet of workers."""

    loop: asyncio.AbstractEventLoop
    channel: grpc.aio.Channel
    fleet: FakeFleet
    worker_channels: dict[str, grpc.aio.Channel]

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def channel_for(self, method: MethodDescriptor) -> grpc.aio.Channel:
        """Worker RPCs go to worker w1 (served as flyd serves them), the rest in-process."""
        return self.worker_channels["w1"] if method.containing_service is WORKER else self.channel


@contextlib.asynccontextmanager
async def _serving(root: Path) -> AsyncIterator[World]:
    async with contextlib.AsyncExitStack() as stack:
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
        for servicer, add, service, mapper, limits in [
            (
                MachinesServicer(exchange),
                machines_pb2_grpc.add_MachinesServiceServicer_to_server,
                MACHINES,
                flaps_map_error,
                FLAPS_LIMITS,
            ),
            (
                PlatformServicer(exchange),
                platform_pb2_grpc.add_PlatformServiceServicer_to_server,
                PLATFORM,
                flaps_map_error,
                FLAPS_LIMITS,
            ),
            (
                RegistryServicer(replica, draining=draining),
                registry_pb2_grpc.add_RegistryServiceServicer_to_server,
                REGISTRY,
                registry_map_error,
                DEFAULT_LIMITS,
            ),
            (
                ProxyServicer(edge.router, edge.stats),
                proxy_pb2_grpc.add_ProxyServiceServicer_to_server,
                PROXY,
                proxy_map_error,
                DEFAULT_LIMITS,
            ),
        ]:
            register(server, servicer, add, service, mapper, limits)
        names = [s.full_name for s in (MACHINES, PLATFORM, REGISTRY, PROXY)]
        add_health_and_reflection(server, health.aio.HealthServicer(), names)
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
        yield World(asyncio.get_running_loop(), channel, fake, to_workers)


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """One loop of the module's own, driven example by example from synchronous tests
    (hypothesis runs each example to its end before drawing the next)."""
    loop = asyncio.new_event_loop()
    serving = _serving(tmp_path_factory.mktemp("properties"))
    try:
        yield loop.run_until_complete(serving.__aenter__())
        loop.run_until_complete(serving.__aexit__(None, None, None))
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


async def _call(
    channel: grpc.aio.Channel, method: MethodDescriptor, payload: bytes
) -> tuple[grpc.StatusCode, str]:
    """Call `method` with `payload` (a stream: read for its first item); its status and
    details. Fails on a crash's status."""
    path = _path(method)
    try:
        if method.server_streaming:
            if method.client_streaming:
                call: Any = channel.stream_stream(path)(iter([payload]), timeout=CALL_TIMEOUT)
            else:
                call = channel.unary_stream(path)(payload, timeout=CALL_TIMEOUT)
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(call.read(), STREAM_WAIT)
            finally:
                call.cancel()
        else:
            await channel.unary_unary(path)(payload, timeout=CALL_TIMEOUT)
    except grpc.aio.AioRpcError as err:
        assert err.code() not in CRASHES, f"{path} answered {err.code().name}: {err.details()}"
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


async def _ensure_rows(world: World) -> list[str]:
    """Every worker holds its few machines (ROWS), uncordoned; their ids, once flaps' replica
    has them all."""
    live = []
    for worker_id, flyd in world.fleet.workers.items():
        flyd.worker.cordon(False)  # a cordon drawn before would only refuse these creates
        have = [mid for mid, row in flyd.worker.rows.items() if row.state != DESTROYED]
        for i in range(len(have), ROWS[worker_id]):
            machine_id = f"{worker_id}-p{next(_ids)}"
            await flyd.worker.create(
                machine_id=machine_id, name="", app="web", config=CONFIG, skip_launch=i > 0
            )
            have.append(machine_id)
        live += have
    for machine_id in live:
        await world.fleet.seen(machine_id)
    return sorted(live)


async def _still_whole(world: World) -> None:
    """After a hostile call: a fresh replica sees every worker alive with all its machines,
    flaps' own replica still sees every worker alive, and every machine can be destroyed."""
    workers = world.fleet.workers
    for flyd in workers.values():
        flyd.worker.cordon(False)
    fresh = Replica(clock=ManualClock())
    async with running(fresh):
        for flyd in workers.values():
            fresh.add_worker(flyd.worker.info())

        def seen_whole() -> bool:
            for worker_id, flyd in workers.items():
                view = fresh.worker(worker_id)
                rows = {m.id for m in fresh.machines(worker_id=worker_id)}
                if view is None or view.status != ALIVE or rows != set(flyd.worker.rows):
                    return False
            return True

        assert await fresh.wait_for(seen_whole, DEADLINE), "a fresh replica lost a worker"
    statuses = {v.info.id: v.status for v in world.fleet.replica.workers()}
    assert statuses == dict.fromkeys(workers, ALIVE)
    for worker_id, flyd in workers.items():
        await _destroy_all(world.worker_channels[worker_id], flyd)


async def _destroy_all(channel: grpc.aio.Channel, flyd: Flyd) -> None:
    """Every machine of the worker can be destroyed: each ends DESTROYED. Then its rows are
    dropped, so that every example starts from the same few."""
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    for machine_id, row in list(flyd.worker.rows.items()):
        if row.state == DESTROYED:
            continue
        nonce = row.lease["nonce"] if row.lease else ""
        request = worker_pb2.DestroyMachineRequest(
            machine_id=machine_id, force=True, lease_nonce=nonce
        )
        await stub.DestroyMachine(request, timeout=DEADLINE)
        wait = worker_pb2.WaitMachineRequest(
            machine_id=machine_id, state=DESTROYED, timeout=Duration(seconds=int(DEADLINE))
        )
        got = await stub.WaitMachine(wait, timeout=DEADLINE)
        assert got.machine.state == DESTROYED, machine_id
    await flyd.worker.runner.drop(list(flyd.worker.rows))


# -- every RPC, one property each ---------------------------------------------------------------


def test_the_suite_covers_every_rpc() -> None:
    """Each RPC of every service is a parametrization of its own below: one added to a proto
    is tested without anyone listing it."""
    every = {_path(m) for s in (WORKER, MACHINES, PLATFORM, REGISTRY, PROXY) for m in s.methods}
    assert {_path(m) for m in TENANT_RPCS + EDGE_RPCS} == every
    standard = {_path(m) for s in (HEALTH, REFLECTION) for m in s.methods}
    assert {_path(m) for m in EVERY_RPC} == every | standard
    assert len(TENANT_RPCS) == len(WORKER.methods) + len(MACHINES.methods) + len(PLATFORM.methods)


@pytest.mark.parametrize("method", TENANT_RPCS, ids=_name)
def test_every_rpc_survives_hostile_requests(services: World, method: MethodDescriptor) -> None:
    answers: list[grpc.StatusCode] = []

    @_examples(10)
    @given(data=st.data())
    def example(data: st.DataObject) -> None:
        live = services.run(_ensure_rows(services))
        if method.containing_service is WORKER:
            live = [mid for mid in live if mid.startswith("w1-")]
        machine_id = data.draw(st.sampled_from(live), label="machine")
        owner = services.fleet.owner_of(machine_id).worker
        known = Known(
            machine_id=machine_id,
            fresh_id=f"w1-n{next(_ids)}",
            config=CONFIG,
            state=owner.rows[machine_id].state,
        )
        request = data.draw(hostile(valid(method.input_type, known)), label="request")
        payload = request.SerializeToString()
        code, _ = services.run(_call(services.channel_for(method), method, payload))
        answers.append(code)
        services.run(_still_whole(services))

    example()
    assert answers, f"{_name(method)} was never called"
    assert grpc.StatusCode.UNIMPLEMENTED not in answers, f"{_name(method)} is not served"
    # The valid request itself, at least, got past the checks into the service's logic.
    assert set(answers) != {grpc.StatusCode.INVALID_ARGUMENT}, f"{_name(method)}: all refused"


@pytest.mark.parametrize("method", EDGE_RPCS, ids=_name)
def test_the_registry_and_the_edge_survive_hostile_requests(
    services: World, method: MethodDescriptor
) -> None:
    answers: list[grpc.StatusCode] = []

    @_examples(5)
    @given(data=st.data())
    def example(data: st.DataObject) -> None:
        known = Known(machine_id="web-a", fresh_id="web-b", config=CONFIG)
        request = data.draw(hostile(valid(method.input_type, known)), label="request")
        code, _ = services.run(_call(services.channel, method, request.SerializeToString()))
        answers.append(code)

    example()
    assert grpc.StatusCode.UNIMPLEMENTED not in answers, f"{_name(method)} is not served"


@pytest.mark.parametrize("method", EVERY_RPC, ids=_name)
def test_bytes_that_are_not_a_request_are_refused_in_plain_words(
    services: World, method: MethodDescriptor
) -> None:
    """Garbage, truncated messages, invalid UTF-8: never UNKNOWN; a message that cannot be
    decoded is INVALID_ARGUMENT saying so, without a Python class name. (What does decode
    may be UNIMPLEMENTED: grpc's health servicer has no List.)"""
    channel = services.channel_for(method)

    @_examples(4)
    @given(data=st.data())
    def example(data: st.DataObject) -> None:
        whole = data.draw(requests(method.input_type), label="request").SerializeToString()
        payload = data.draw(
            st.one_of(
                st.binary(max_size=64),
                st.integers(0, max(0, len(whole) - 1)).map(lambda n: whole[:n]),  # truncated
            ),
            label="payload",
        )
        services.run(_call(channel, method, payload))
        for flyd in services.fleet.workers.values():
            flyd.worker.cordon(False)  # what decoded as a cordon must not refuse later creates

    example()
    # A tag whose varint never ends: no message of any type decodes from it.
    code, details = services.run(_call(channel, method, b"\x0a\x02ok\xff"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed or truncated" in details
    assert "Error" not in details
    assert "<class" not in details


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


async def _pages(list_page: Callable[[str], Any]) -> list[pb.Machine]:
    """Every machine of a paged ListMachines, each page read with a default client's 4 MiB
    receive limit."""
    out: list[pb.Machine] = []
    token = ""
    while True:
        page = await list_page(token)
        out += page.machines
        if not page.next_page_token:
            return out
        token = page.next_page_token


async def test_a_worker_whose_machines_outgrow_one_message_stays_whole(
    tmp_path: Path, image_source: Path
) -> None:
    """Defect 1 at scale, against real processes: 84 machines of 60 KB configs (within every
    bound; skip_launch), 12 of them destroyed, so that the worker's snapshot is past gRPC's
    4 MiB message limit. A fresh replica follows the worker and keeps it ALIVE with every
    row; ListMachines through flyd and through flaps, page by page, lists every machine."""
    cluster = Fleet(tmp_path, image_source)
    try:
        address = cluster.add_worker(
            "w1",
            "ams",
            "--capacity.machines",
            "200",
            "--capacity.cpu-millicores",
            "8000",
            "--capacity.memory-mib",
            "8192",
        ).address
        async with grpc.aio.insecure_channel(address) as to_flyd:
            await _outgrow_one_message(cluster, address, to_flyd)
    finally:
        await cluster.close()


async def _outgrow_one_message(cluster: Fleet, address: str, to_flyd: grpc.aio.Channel) -> None:
    stub = worker_pb2_grpc.WorkerServiceStub(to_flyd)
    heavy = pb.MachineConfig(
        image="demo:v1", guest=pb.GuestConfig(cpu_millicores=10, memory_mib=16)
    )
    ids = [f"w1-big-{i}" for i in range(84)]
    gone = set(ids[::7])
    one_at_a_time = asyncio.Semaphore(8)

    async def create(machine_id: str) -> None:
        config = pb.MachineConfig()
        config.CopyFrom(heavy)
        config.cmd.extend([machine_id[-1] * 4000] * 15)
        async with one_at_a_time:
            await stub.CreateMachine(
                worker_pb2.CreateMachineRequest(
                    machine_id=machine_id, app="demo", config=config, skip_launch=True
                ),
                timeout=60,
            )
            if machine_id in gone:
                destroy = worker_pb2.DestroyMachineRequest(machine_id=machine_id)
                await stub.DestroyMachine(destroy, timeout=60)

    await asyncio.gather(*(create(machine_id) for machine_id in ids))

    def flyd_page(destroyed: bool) -> Callable[[str], Any]:
        def page(token: str) -> Any:
            request = worker_pb2.ListMachinesRequest(include_destroyed=destroyed, page_token=token)
            return stub.ListMachines(request, timeout=30)

        return page

    live = await _pages(flyd_page(False))
    assert sorted(m.id for m in live) == sorted(set(ids) - gone)
    assert sum(m.ByteSize() for m in live) > 4 * 2**20  # more than one message could hold
    every = await _pages(flyd_page(True))
    assert sorted(m.id for m in every) == sorted(ids)

    # A fresh replica, following the worker from nothing.
    info = (await stub.GetCapacity(worker_pb2.GetCapacityRequest(), timeout=30)).worker
    info.address = address
    replica = Replica(suspect_after=10, dead_after=20)  # a loaded host's pauses are not deaths
    async with running(replica):
        replica.add_worker(info)

        def whole() -> bool:
            view = replica.worker("w1")
            rows = {m.id: m.state for m in replica.machines(worker_id="w1")}
            return view is not None and view.status == ALIVE and rows.keys() == set(ids)

        assert await replica.wait_for(whole, 60), "the fresh replica never saw the worker whole"
        # Still followed after the snapshot: a change arrives, the worker stays alive.
        last = ids[-1]
        await stub.DestroyMachine(worker_pb2.DestroyMachineRequest(machine_id=last), timeout=30)

        def destroyed() -> bool:
            row = replica.machine(last)
            return row is not None and row.state == DESTROYED

        assert await replica.wait_for(destroyed, 30)
        view = replica.worker("w1")
        assert view is not None
        assert view.status == ALIVE

    # flaps follows the worker too, and lists its machines in pages.
    flaps = cluster.add_flaps()
    await cluster.until_alive()
    async with grpc.aio.insecure_channel(flaps.address) as to_flaps:
        machines = machines_pb2_grpc.MachinesServiceStub(to_flaps)

        def flaps_page(token: str) -> Any:
            request = machines_pb2.ListMachinesRequest(
                app="demo", include_destroyed=True, page_token=token
            )
            return machines.ListMachines(request, timeout=30)

        async def listed() -> bool:
            return sorted(m.id for m in await _pages(flaps_page)) == sorted(ids)

        await eventually(listed, 60, "every machine listed through flaps")
