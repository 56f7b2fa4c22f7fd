"""A real flyd with tracing on: its operation spans reach an OTLP collector under the RPC's span."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from flyd.drivers.rundir import kill_all
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from flyd.v1 import worker_pb2_grpc
from tests import host_ports
from tests.conftest import remove_cgroups
from tests.flyd.process_support import DEADLINE, config, wait_state
from tests.harness import ServiceProcess, clean_env, flyd_args

S = pb.MachineState


@dataclass
class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """A fake OTLP collector that keeps every span, with its attributes and events."""

    spans: list[dict[str, Any]] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    async def Export(self, request: Any, context: Any) -> Any:
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(
                        {
                            "name": span.name,
                            "span_id": span.span_id.hex(),
                            "trace_id": span.trace_id.hex(),
                            "parent_span_id": span.parent_span_id.hex(),
                            "attributes": {a.key: a.value.string_value for a in span.attributes},
                            "events": [
                                (e.name, {a.key: a.value.string_value for a in e.attributes})
                                for e in span.events
                            ],
                        }
                    )
        self.arrived.set()
        return trace_service_pb2.ExportTraceServiceResponse()

    async def span(self, name: str) -> dict[str, Any]:
        """The first span called `name`, once it has arrived."""
        async with asyncio.timeout(DEADLINE):
            while True:
                found = [s for s in self.spans if s["name"] == name]
                if found:
                    return found[0]
                self.arrived.clear()
                await self.arrived.wait()


@pytest.fixture
async def collector() -> AsyncIterator[tuple[Collector, int]]:
    collector = Collector()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield collector, port
    await server.stop(None)


async def test_a_traced_flyd_exports_operation_spans_under_the_rpc_spans(
    collector: tuple[Collector, int], tmp_path: Path, image_source: Path
) -> None:
    spans, port = collector
    prefix = f"nonomad-test-{uuid.uuid4().hex[:8]}"
    env = clean_env(
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}",
        OTEL_EXPORTER_OTLP_INSECURE="true",
        OTEL_BSP_SCHEDULE_DELAY="50",  # ms: export soon, not after the default 5 s
    )
    args = flyd_args(
        tmp_path / "data", image_source, "w1", "ams", "--cgroup-prefix", prefix, "--ports",
        host_ports.flag(host_ports.block()),
    )  # fmt: skip
    flyd = ServiceProcess("flyd", args, tmp_path / "flyd.log", env=env).start()
    try:
        async with grpc.aio.insecure_channel(flyd.address) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            created = (
                await stub.CreateMachine(
                    w.CreateMachineRequest(app="demo", config=config()), timeout=DEADLINE
                )
            ).machine
            assert created.state == S.MACHINE_STATE_STARTED
            await stub.StopMachine(w.StopMachineRequest(machine_id=created.id), timeout=DEADLINE)
            await wait_state(stub, created.id, S.MACHINE_STATE_STOPPED)

            for op, rpc in [("create", "CreateMachine"), ("stop", "StopMachine")]:
                span = await spans.span(f"flyd.{op}")
                server = await spans.span(f"/flyd.v1.WorkerService/{rpc}")
                assert (span["parent_span_id"], span["trace_id"]) == (
                    server["span_id"],
                    server["trace_id"],
                )
                assert span["attributes"] == {
                    "nonomad.machine_id": created.id,
                    "nonomad.app": "demo",
                    "nonomad.worker": "w1",
                }
                assert {name for name, _ in span["events"]} == {"step"}
            create = await spans.span("flyd.create")
            assert [(a["from_state"], a["to_state"]) for _, a in create["events"]] == [
                ("unspecified", "created"),
                ("created", "starting"),
                ("starting", "started"),
            ]
            # The stopped step, committed after StopMachine returned, is logged with its trace.
            stop = await spans.span("flyd.stop")
            assert any(
                f'"trace_id": "{stop["trace_id"]}"' in line and '"state": "stopped"' in line
                for line in flyd.stderr_path.read_text().splitlines()
            )
            await stub.DestroyMachine(w.DestroyMachineRequest(machine_id=created.id))
            await wait_state(stub, created.id, S.MACHINE_STATE_DESTROYED)
    finally:
        flyd.kill()
        kill_all(tmp_path / "data" / "machines")  # netd (OCI) outlives flyd, as it is meant to
        remove_cgroups(prefix)
