"""A traced flaps client as its own process, tracing set up the way every service sets it up.

    python -m tests.e2e._traced_client <flaps host:port> <app> <region>

Under one root span (`e2e.create_and_wait`) it creates a machine through flaps and waits for
it to be started, over a channel from `aio_channel`; then it flushes its spans to the OTLP
endpoint in `OTEL_*` and prints one JSON line: the machine, its state, the root span's ids.
Its own process because OpenTelemetry's global tracer provider is set once per process.
"""

from __future__ import annotations

import asyncio
import json
import sys

from google.protobuf.duration_pb2 import Duration
from opentelemetry import trace

from flaps.v1 import machines_pb2 as m
from flaps.v1 import machines_pb2_grpc
from flyd.v1 import machine_pb2 as pb
from runtime import aio_channel, configure_logging, setup_tracing, shutdown_tracing

RPC_TIMEOUT = 30.0


async def main(address: str, app: str, region: str) -> None:
    configure_logging("e2e-client", "info")
    if not setup_tracing("e2e-client"):
        raise SystemExit("tracing is off: set OTEL_EXPORTER_OTLP_ENDPOINT")
    tracer = trace.get_tracer("tests.e2e")
    config = pb.MachineConfig(
        image="demo:v1",
        guest=pb.GuestConfig(cpu_millicores=100, memory_mib=64),
        entrypoint=["sleep"],
        cmd=["1000"],
    )
    async with aio_channel(address) as channel:
        stub = machines_pb2_grpc.MachinesServiceStub(channel)
        with tracer.start_as_current_span("e2e.create_and_wait") as root:
            created = await stub.CreateMachine(
                m.CreateMachineRequest(app=app, region=region, config=config),
                timeout=RPC_TIMEOUT,
            )
            waited = await stub.WaitMachine(
                m.WaitMachineRequest(
                    machine_id=created.machine.id,
                    state=pb.MachineState.MACHINE_STATE_STARTED,
                    timeout=Duration(seconds=20),
                ),
                timeout=RPC_TIMEOUT,
            )
    await asyncio.to_thread(shutdown_tracing)  # every span is exported before we answer
    context = root.get_span_context()
    print(
        json.dumps(
            {
                "machine_id": waited.machine.id,
                "worker_id": waited.machine.worker_id,
                "state": pb.MachineState.Name(waited.machine.state),
                "trace_id": format(context.trace_id, "032x"),
                "span_id": format(context.span_id, "016x"),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    asyncio.run(main(*sys.argv[1:]))
