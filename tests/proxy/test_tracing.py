"""The proxy's tracing contract, against an in-memory span exporter: a SERVER span per request
(parented on the client's traceparent, handed on to the machine), a scale-from-zero start that
is its child through the gRPC client interceptor, and the `proxy.failover` span."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import grpc
import grpc.aio
import pytest
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import aio_client_interceptors
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode, Tracer

from flaps.v1 import machines_pb2, machines_pb2_grpc
from flyd.v1 import machine_pb2 as pb
from proxy.control import FlapsClient
from proxy.http import HttpProxy
from proxy.stats import Stats
from registry.view import SUSPECT
from tests.proxy.http_support import (
    DOMAIN,
    FakeRouter,
    RawClient,
    TestBackend,
    backend_for,
    dead_port,
    eventually,
)
from tests.proxy.support import STOPPED, FakeFlaps, FakeRegistry, machine, settle, world

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


@dataclass
class Traces:
    provider: TracerProvider
    exporter: InMemorySpanExporter

    @property
    def tracer(self) -> Tracer:
        return self.provider.get_tracer("test")

    def spans(self, name: str | None = None) -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if name is None or s.name == name]


@pytest.fixture
def traces() -> Iterator[Traces]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield Traces(provider, exporter)
    provider.shutdown()


@pytest.fixture
async def backend() -> AsyncIterator[TestBackend]:
    b = await TestBackend("m-1").start()
    yield b
    await b.stop()


async def send(port: int, app: str, method: str = "GET", **kwargs: object) -> tuple[int, str]:
    client = await RawClient.connect(port)
    try:
        resp = await client.request(f"{app}.{DOMAIN}", "/items?page=2", method, **kwargs)  # type: ignore[arg-type]
    finally:
        await client.close()
    return resp.status, resp.text


@pytest.mark.parametrize("fast", [False, True])
async def test_each_request_is_a_server_span_handed_on_to_the_machine(
    traces: Traces, backend: TestBackend, fast: bool
) -> None:
    router = FakeRouter(
        {"web": [backend.backend()], "down": [backend_for("m-down", dead_port(), "down")]},
        fast=fast,
    )
    proxy = HttpProxy(router, Stats(), domain=DOMAIN, region="ams", tracer=traces.tracer)
    _, port = await proxy.serve("127.0.0.1", 0)
    try:
        # With a traceparent: the span is its child, and the machine gets the span's own.
        status, _ = await send(
            port, "web", headers=[("traceparent", TRACEPARENT), ("tracestate", "k=v")]
        )
        assert status == 200
        [span] = traces.spans()
        assert span.name == "HTTP GET"
        assert span.kind == SpanKind.SERVER
        assert format(span.context.trace_id, "032x") == CLIENT_TRACE
        assert span.parent is not None
        assert format(span.parent.span_id, "016x") == CLIENT_SPAN
        assert dict(span.attributes or {}) == {
            "http.request.method": "GET",
            "url.path": "/items",
            "http.response.status_code": 200,
            "nonomad.app": "web",
            "nonomad.machine_id": "m-1",
        }
        seen = backend.requests[-1]
        assert [v for k, v in seen.headers if k.lower() == "traceparent"] == [
            f"00-{CLIENT_TRACE}-{span.context.span_id:016x}-01"
        ]
        assert seen.header("tracestate") == "k=v"

        # Without one: a new trace, still handed on.
        traces.exporter.clear()
        assert (await send(port, "web", "POST", body=b"x"))[0] == 200
        [span] = traces.spans()
        assert span.name == "HTTP POST"
        assert span.parent is None
        handed = backend.requests[-1].header("traceparent") or ""
        assert handed.startswith(f"00-{span.context.trace_id:032x}-{span.context.span_id:016x}-")

        # Errors: the status says so; the machine is named when one was tried.
        traces.exporter.clear()
        assert (await send(port, "down", "POST", body=b"x"))[0] == 502  # not retried
        assert (await send(port, "nope"))[0] == 404
        down, unknown = traces.spans()
        assert down.attributes is not None
        assert unknown.attributes is not None
        assert down.attributes["http.response.status_code"] == 502
        assert down.attributes["nonomad.machine_id"] == "m-down"
        assert down.status.status_code == StatusCode.ERROR
        assert unknown.attributes["http.response.status_code"] == 404
        assert "nonomad.machine_id" not in unknown.attributes
        assert unknown.status.status_code == StatusCode.UNSET
    finally:
        await proxy.close(grace=1.0)


async def test_without_a_tracer_the_traceparent_passes_through_untouched(
    backend: TestBackend,
) -> None:
    proxy = HttpProxy(FakeRouter({"web": [backend.backend()]}), Stats(), domain=DOMAIN, region="x")
    _, port = await proxy.serve("127.0.0.1", 0)
    try:
        assert (await send(port, "web", headers=[("traceparent", TRACEPARENT)]))[0] == 200
    finally:
        await proxy.close(grace=1.0)
    assert backend.requests[-1].header("traceparent") == TRACEPARENT


class FlapsServer(machines_pb2_grpc.MachinesServiceServicer):
    """StartMachine over real gRPC: marks the machine started in the fake registry."""

    def __init__(self, registry: FakeRegistry) -> None:
        self.registry = registry

    async def StartMachine(
        self, request: machines_pb2.StartMachineRequest, context: grpc.aio.ServicerContext
    ) -> machines_pb2.StartMachineResponse:
        row = self.registry.set_state(request.machine_id, pb.MachineState.MACHINE_STATE_STARTED)
        return machines_pb2.StartMachineResponse(machine=row)


async def test_a_cold_start_is_a_child_of_the_request_through_the_grpc_interceptor(
    traces: Traces, backend: TestBackend
) -> None:
    registry = FakeRegistry()
    registry.add_worker("w1")
    registry.put(machine("cold-1", state=STOPPED, port=backend.port))
    server = grpc.aio.server()
    machines_pb2_grpc.add_MachinesServiceServicer_to_server(FlapsServer(registry), server)
    flaps_port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    interceptors = aio_client_interceptors(tracer_provider=traces.provider)
    flaps = FlapsClient(
        f"127.0.0.1:{flaps_port}",
        channel=lambda address: grpc.aio.insecure_channel(address, interceptors=interceptors),
    )
    try:
        async with world(registry, flaps) as w:
            proxy = HttpProxy(w.router, w.stats, domain=DOMAIN, region="ams", tracer=traces.tracer)
            _, port = await proxy.serve("127.0.0.1", 0)
            try:
                status, text = await send(port, "web", headers=[("traceparent", TRACEPARENT)])
                # The machine may serve before flaps' answer is back: the start is counted then.
                await eventually(lambda: w.stats.cold_starts == 1, "the cold start counted")
            finally:
                await proxy.close(grace=1.0)
    finally:
        await flaps.close()
        await server.stop(None)
    assert status == 200, text
    assert w.stats.cold_starts == 1
    [request] = traces.spans("HTTP GET")
    [start] = [s for s in traces.spans() if s.kind == SpanKind.CLIENT]
    assert "StartMachine" in start.name
    assert start.parent is not None
    assert start.parent.span_id == request.context.span_id
    assert start.context.trace_id == request.context.trace_id
    assert request.attributes is not None
    assert request.attributes["nonomad.machine_id"] == "cold-1"


class TracedFlaps(FakeFlaps):
    """FakeFlaps that notes which span was current at each start."""

    def __init__(self, registry: FakeRegistry) -> None:
        super().__init__(registry)
        self.spans: list[int] = []

    async def start(self, machine_id: str, generation: int = 0) -> pb.Machine:
        self.spans.append(trace.get_current_span().get_span_context().span_id)
        return await super().start(machine_id, generation)


async def test_a_failover_is_an_internal_span_around_its_standby_starts(traces: Traces) -> None:
    registry = FakeRegistry()
    for worker in ("w1", "w2"):
        registry.add_worker(worker)
    registry.put(machine("p", worker="w1"))
    registry.put(machine("sb", worker="w2", state=STOPPED, standbys=["p"]))
    flaps = TracedFlaps(registry)
    async with world(registry, flaps, tracer=traces.tracer) as w:
        w.probes.dead_workers.add("w1.test:7000")
        registry.set_status("w1", SUSPECT)
        await settle()
        assert w.router.is_dead("w1")
        for _ in range(100):  # the failover runs in its own task
            if traces.spans("proxy.failover"):
                break
            await asyncio.sleep(0)
    [span] = traces.spans("proxy.failover")
    assert span.kind == SpanKind.INTERNAL
    assert dict(span.attributes or {}) == {
        "nonomad.worker": "w1",
        "nonomad.region": "ams",
        "nonomad.standbys_started": 1,
    }
    assert flaps.starts == ["sb"]
    assert flaps.spans == [span.context.span_id]
