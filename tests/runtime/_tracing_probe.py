"""Runs a traced service against a fake OTLP collector and prints what the collector received.

Run as its own process by test_tracing.py because OpenTelemetry's global tracer provider can
be set only once per process. Prints one JSON document on stdout; logs go to stderr.

    python -m tests.runtime._tracing_probe
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import grpc
import grpc.aio
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from runtime import (
    Service,
    ServiceSettings,
    aio_channel,
    client_interceptors,
    configure_logging,
    server_interceptors,
    setup_tracing,
)
from tests.runtime import _echo
from tests.runtime._support import running


class FakeCollector(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every span exported to it."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []

    async def Export(self, request: Any, context: Any) -> Any:
        for resource_spans in request.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(
                        {
                            "name": span.name,
                            "kind": span.kind,
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent_span_id": span.parent_span_id.hex(),
                            "resource": resource,
                        }
                    )
        return trace_service_pb2.ExportTraceServiceResponse()


async def main() -> None:
    collector = FakeCollector()
    collector_server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, collector_server)
    port = collector_server.add_insecure_port("127.0.0.1:0")
    await collector_server.start()

    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{port}"
    os.environ["OTEL_EXPORTER_OTLP_INSECURE"] = "true"
    configure_logging("probe", "info")
    enabled = setup_tracing("probe", **{"nonomad.worker": "w1", "cloud.region": "ams"})
    interceptors_on = (len(server_interceptors()), len(client_interceptors()))

    service = Service("probe", ServiceSettings())
    service.add(
        _echo.EchoServicer(),
        _echo.add_EchoServiceServicer_to_server,
        _echo.DESCRIPTOR,
        _echo.map_error,
    )
    codes = []
    async with running(service) as run:
        async with aio_channel(service.address) as channel:
            client = _echo.EchoClient(channel)
            await client.say("hello")
            try:
                await client.say("crash")
            except grpc.aio.AioRpcError as error:
                codes.append(error.code().name)
        service.request_shutdown()
        exit_code = await run  # flushes the spans to the collector
    await collector_server.stop(None)

    print(
        json.dumps(
            {
                "enabled": enabled,
                "interceptors_on": interceptors_on,
                "interceptors_after_shutdown": (
                    len(server_interceptors()),
                    len(client_interceptors()),
                ),
                "codes": codes,
                "exit_code": exit_code,
                "spans": collector.spans,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    asyncio.run(main())
