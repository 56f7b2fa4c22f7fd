"""The simulated network's faults (partitions one-way and both, lost answers after the work was
done, a process's death resetting its connections, a host's death answering nothing) and a
real `runtime.server.Service` serving on it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
import pytest
from google.protobuf.wrappers_pb2 import StringValue
from grpc_health.v1 import health_pb2, health_pb2_grpc

from runtime import transport
from runtime.server import Service, register, time_left
from runtime.settings import ServiceSettings
from sim.net import UNREACHABLE_AFTER, LinkFaults, Network
from sim.world import Node, World

SERVICE = "simnet.v1.Work"


@dataclass
class Worker:
    """A handler that records every request it did, and can be held."""

    done: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    hold: asyncio.Event | None = None

    async def work(self, request: StringValue, context: Any) -> StringValue:
        try:
            if self.hold is not None:
                await self.hold.wait()
        except asyncio.CancelledError:
            self.cancelled.append(request.value)
            raise
        self.done.append(request.value)
        return StringValue(value=f"did {request.value}")

    async def count(self, request: StringValue, context: Any) -> Any:
        for i in range(int(request.value)):
            yield StringValue(value=str(i))

    def handler(self) -> grpc.GenericRpcHandler:
        decode, encode = StringValue.FromString, StringValue.SerializeToString
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Work": grpc.unary_unary_rpc_method_handler(self.work, decode, encode),
                "Count": grpc.unary_stream_rpc_method_handler(self.count, decode, encode),
            },
        )


@dataclass
class Cluster:
    world: World
    net: Network
    server: Node
    client: Node
    address: str
    worker: Worker

    def call(self, word: str, timeout: float | None = 5.0) -> StringValue | grpc.StatusCode:
        """One Work call from the client, run to its end."""
        return self.world.run(self.client, self.work(word, timeout))

    def channel(self) -> Any:
        """A channel to the server (on the node the caller runs on)."""
        return transport.current().channel(
            self.address, credentials=None, options=(), interceptors=None
        )

    async def work(self, word: str, timeout: float | None) -> StringValue | grpc.StatusCode:
        """One Work call: its answer, or the status it failed with."""
        work = self.channel().unary_unary(
            f"/{SERVICE}/Work", StringValue.SerializeToString, StringValue.FromString
        )
        try:
            answer: StringValue = await work(StringValue(value=word), timeout=timeout)
            return answer
        except grpc.aio.AioRpcError as err:
            return err.code()

    async def count(self, n: int, into: list[str]) -> None:
        """Stream Count(n), putting each message's value in `into` as it arrives."""
        stream = self.channel().unary_stream(
            f"/{SERVICE}/Count", StringValue.SerializeToString, StringValue.FromString
        )
        async for message in stream(StringValue(value=str(n)), timeout=60.0):
            into.append(message.value)


async def serve(worker: Worker, ip: str) -> int:
    """Serve `worker` on the node this runs on, at its address; the port."""
    server = transport.current().server(interceptors=None, options=())
    server.add_generic_rpc_handlers((worker.handler(),))
    port: int = server.add_insecure_port(f"{ip}:0")
    await server.start()
    return port


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    world = World(seed=4)
    net = Network(world)
    server, client = world.add("server"), world.add("client")
    ip = net.join(server)
    net.join(client)
    worker = Worker()
    port = world.run(server, serve(worker, ip))
    yield Cluster(world, net, server, client, f"{ip}:{port}", worker)
    world.close()


def test_a_call_takes_the_drawn_latency_there_and_back(cluster: Cluster) -> None:
    before = cluster.world.now
    assert cluster.call("a") == StringValue(value="did a")
    took = cluster.world.now - before
    low, high = cluster.net.faults.latency
    assert 2 * low <= took <= 2 * high


def test_across_a_partition_a_call_fails_at_its_deadline_or_when_keepalive_gives_up(
    cluster: Cluster,
) -> None:
    cluster.net.block("client", "server")
    start = cluster.world.now
    assert cluster.call("a", timeout=2.0) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert cluster.world.now - start == pytest.approx(2.0)
    start = cluster.world.now
    assert cluster.call("b", timeout=None) == grpc.StatusCode.UNAVAILABLE
    assert cluster.world.now - start == pytest.approx(UNREACHABLE_AFTER)
    assert cluster.worker.done == []  # nothing reached it
    cluster.net.heal()
    assert cluster.call("c") == StringValue(value="did c")


def test_a_one_way_partition_loses_the_answer_after_the_work_was_done(cluster: Cluster) -> None:
    cluster.net.block("server", "client", both=False)
    assert cluster.call("a", timeout=1.0) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert cluster.worker.done == ["a"]  # the work happened; the caller cannot know


def test_a_dead_process_resets_its_connections_a_dead_host_answers_nothing(
    cluster: Cluster,
) -> None:
    world, net = cluster.world, cluster.net
    cluster.worker.hold = asyncio.Event()
    # The server process dies with a call in flight: its caller hears of it at once.
    task = cluster.client.spawn(cluster.work("a", timeout=30.0))
    world.run_for(0.1)
    world.kill("server")
    net.crash("server")
    start = world.now
    world.run_until(start + 1.0, task.done)
    assert task.result() == grpc.StatusCode.UNAVAILABLE
    assert world.now - start < 0.01
    # Nobody listens there now: refused at once.
    assert cluster.call("b") == grpc.StatusCode.UNAVAILABLE
    # A server that dies with its host (no reset): a call in flight waits out its deadline.
    host = world.add("host")
    ip = net.join(host)
    cluster.address = f"{ip}:{world.run(host, serve(Worker(hold=asyncio.Event()), ip))}"
    sent = world.now
    task = cluster.client.spawn(cluster.work("c", timeout=3.0))
    world.run_for(0.1)
    world.kill("host")
    net.crash("host", reset=False)
    world.run_until(world.now + 10.0, task.done)
    assert task.result() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert world.now - sent == pytest.approx(3.0, abs=0.01)


def test_a_dead_client_cancels_the_handlers_of_its_calls(cluster: Cluster) -> None:
    cluster.worker.hold = asyncio.Event()
    cluster.client.spawn(cluster.work("a", timeout=30.0))
    cluster.world.run_for(0.1)
    cluster.world.kill("client")
    cluster.net.crash("client")
    cluster.world.run_for(0.1)
    assert cluster.worker.cancelled == ["a"]


def test_a_streams_messages_arrive_in_order_whatever_latency_each_drew(cluster: Cluster) -> None:
    cluster.net.faults = LinkFaults(latency=(0.0, 0.2))
    got: list[str] = []
    cluster.world.run(cluster.client, cluster.count(200, got))
    assert got == [str(i) for i in range(200)]


@pytest.mark.parametrize("latency", [(1.0, 0.5), (-0.1, 0.5)])
def test_link_faults_out_of_range_are_refused(latency: tuple[float, float]) -> None:
    with pytest.raises(ValueError, match="latency must be"):
        LinkFaults(latency=latency)


def test_a_partition_that_heals_in_time_delays_a_streams_messages_and_loses_none(
    cluster: Cluster,
) -> None:
    """TCP holds what a short partition cuts off: a stream across it goes silent, then gets
    every message, in order (a replica following a worker must not miss one)."""
    got: list[str] = []
    cluster.net.block("server", "client", both=False)
    task = cluster.client.spawn(cluster.count(50, got))
    cluster.world.run_for(5.0)
    assert got == []
    assert not task.done()
    cluster.net.unblock("server", "client", both=False)
    cluster.world.run_until(cluster.world.now + 5.0, task.done)
    assert task.result() is None
    assert got == [str(i) for i in range(50)]


def test_a_slow_link_draws_its_own_latency_in_order_until_it_ends(cluster: Cluster) -> None:
    net, world = cluster.net, cluster.world
    net.slow("client", "server", (1.0, 1.5), both=False)  # the request only
    before = world.now
    assert cluster.call("a") == StringValue(value="did a")
    assert 1.0 <= world.now - before <= 1.5 + 2 * net.faults.latency[1]
    got: list[str] = []
    net.slow("server", "client", (0.0, 0.5))  # overlapping: the slowest of a link holds
    world.run(cluster.client, cluster.count(100, got))
    assert got == [str(i) for i in range(100)]
    net.unslow("server", "client", (0.0, 0.5))
    net.unslow("client", "server", (1.0, 1.5), both=False)
    before = world.now
    assert cluster.call("b") == StringValue(value="did b")
    assert world.now - before <= 2 * net.faults.latency[1]
    with pytest.raises(ValueError, match="latency must be"):
        net.slow("client", "server", (2.0, 1.0))


def test_overlapping_partitions_of_one_link_end_with_the_last(cluster: Cluster) -> None:
    net = cluster.net
    net.block("client", "server")
    net.block("client", "server")
    net.unblock("client", "server")
    assert net.blocked("client", "server")
    assert net.blocked("server", "client")
    net.unblock("client", "server")
    assert not net.blocked("client", "server")
    assert cluster.call("a") == StringValue(value="did a")


def test_a_real_service_serves_its_health_on_the_simulated_network_and_stops_cleanly() -> None:
    world = World(seed=9)
    try:
        net = Network(world)
        node, client = world.add("svc"), world.add("client")
        ip = net.join(node)
        net.join(client)
        service = Service("svc", ServiceSettings(listen=f"{ip}:0", grace_period=1.0))
        running = node.spawn(service.run(handle_signals=False))
        address = world.run(node, service.wait_ready())
        assert address.startswith(f"{ip}:")

        async def check() -> int:
            channel = transport.current().channel(
                address, credentials=None, options=(), interceptors=None
            )
            answer = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5.0
            )
            return int(answer.status)

        assert world.run(client, check()) == health_pb2.HealthCheckResponse.SERVING
        service.request_shutdown()
        world.run_until(world.now + 10.0, running.done)
        assert running.result() == 0
    finally:
        world.close()


def test_time_left_in_a_handler_counts_down_in_virtual_time(cluster: Cluster) -> None:
    """What a handler passes on to the calls it makes for its caller (runtime.server.time_left)
    is the caller's deadline on the node's own clock: here, virtual time."""
    seen: list[float] = []

    class Slow(health_pb2_grpc.HealthServicer):
        async def Check(self, request: Any, context: Any) -> Any:
            await asyncio.sleep(3.0)
            seen.append(time_left(100.0))
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    ip = cluster.net.ip("server")

    async def serve_slow() -> int:
        server = transport.current().server(interceptors=None, options=())
        register(
            server,
            Slow(),
            health_pb2_grpc.add_HealthServicer_to_server,
            health_pb2.DESCRIPTOR.services_by_name["Health"],
            lambda err: None,
        )
        port: int = server.add_insecure_port(f"{ip}:0")
        await server.start()
        return port

    address = f"{ip}:{cluster.world.run(cluster.server, serve_slow())}"

    async def check() -> None:
        channel = transport.current().channel(
            address, credentials=None, options=(), interceptors=None
        )
        await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10.0
        )

    cluster.world.run(cluster.client, check())
    assert seen == [pytest.approx(7.0, abs=0.01)]
