"""The proxy's metrics and traces from a real proxy process: /metrics scraped over HTTP, spans
exported over OTLP to a collector in the test, and the traceparent a machine receives."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import grpc
import grpc.aio
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from proxy.metrics import ProxyCollector
from proxy.stats import Stats
from tests.conftest import DEMO_APP
from tests.proxy.support import DEADLINE, eventually, get, proxy_fleet

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: str) -> Samples:
    """Every sample of a Prometheus text page, by name and sorted labels."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def scrape(address: str) -> Samples:
    def fetch() -> str:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=DEADLINE) as resp:
            return str(resp.read().decode())

    return samples(await asyncio.to_thread(fetch))


async def test_the_collector_reads_the_stats_at_scrape_time() -> None:
    from prometheus_client import generate_latest

    stats = Stats()
    registry = CollectorRegistry()
    ProxyCollector(stats).register(registry)
    stats.record("web", 200, 0.0004)
    stats.record("web", 200, 0.003)
    stats.record(None, 400, 0.0001)
    stats.cold_start()
    stats.worker_dead()
    got = samples(generate_latest(registry).decode())
    assert got[("nonomad_proxy_requests_total", (("app", "web"), ("status", "200")))] == 2
    assert got[("nonomad_proxy_requests_total", (("app", ""), ("status", "400")))] == 1
    assert got[("nonomad_proxy_request_duration_seconds_bucket", (("le", "0.0005"),))] == 2
    assert got[("nonomad_proxy_request_duration_seconds_bucket", (("le", "0.005"),))] == 3
    assert got[("nonomad_proxy_request_duration_seconds_bucket", (("le", "+Inf"),))] == 3
    assert got[("nonomad_proxy_request_duration_seconds_count", ())] == 3
    assert abs(got[("nonomad_proxy_request_duration_seconds_sum", ())] - 0.0035) < 1e-9
    assert got[("nonomad_proxy_cold_starts_total", ())] == 1
    assert got[("nonomad_proxy_workers_declared_dead_total", ())] == 1
    assert got[("nonomad_proxy_failovers_total", ())] == 0


async def test_metrics_scraped_from_a_real_proxy(tmp_path: Path, image_source: Path) -> None:
    async with proxy_fleet(tmp_path, image_source) as fleet:
        fleet.add_worker("w1")
        fleet.start_flaps()
        await fleet.until_alive()
        cold = await fleet.create("cold", skip_launch=True)
        proxy = fleet.add_proxy("--metrics-listen", "127.0.0.1:0")
        await fleet.until_routed("cold", 1)
        for _ in range(3):
            reply = await get(proxy.http, "cold")
            assert reply.headers["nonomad-machine-id"] == cold.id
        assert (await get(proxy.http, "nope")).status == 404

        got = await scrape(proxy.announced["NONOMAD_METRICS"])
        assert got[("nonomad_proxy_requests_total", (("app", "cold"), ("status", "200")))] == 3
        assert got[("nonomad_proxy_requests_total", (("app", "nope"), ("status", "404")))] == 1
        assert got[("nonomad_proxy_request_duration_seconds_count", ())] == 4
        assert got[("nonomad_proxy_request_duration_seconds_sum", ())] > 0
        assert got[("nonomad_proxy_cold_starts_total", ())] == 1
        assert got[("nonomad_proxy_failovers_total", ())] == 0
        assert got[("nonomad_proxy_requests_in_flight", (("app", "cold"),))] == 0
        assert got[("nonomad_proxy_registry_heartbeat_age_seconds", (("worker", "w1"),))] >= 0


# A machine that answers with the traceparent it received.
TRACEPARENT_APP = DEMO_APP.replace(
    """body = f"hello from {os.environ['MACHINE_ID']}\\n".encode()""",
    """body = (self.headers.get("traceparent") or "none").encode()""",
)
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace collector that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[trace_pb2.Span] = []

    async def Export(
        self,
        request: trace_service_pb2.ExportTraceServiceRequest,
        context: grpc.aio.ServicerContext,
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                self.spans.extend(scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


async def test_a_traced_proxy_hands_the_clients_trace_on_to_the_machine(
    tmp_path: Path, image_source: Path
) -> None:
    collector = Collector()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    otel = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
    }
    try:
        async with proxy_fleet(tmp_path, image_source) as fleet:
            fleet.add_worker("w1")
            fleet.start_flaps()
            await fleet.until_alive()
            m = await fleet.create("traced", entrypoint=["python3", "-u", "-c", TRACEPARENT_APP])
            proxy = fleet.add_proxy(env=otel)
            await fleet.until_routed("traced", 1)

            async def served() -> bool:
                return (await get(proxy.http, "traced")).status == 200

            await eventually(served, "the machine to serve")
            reply = await get(
                proxy.http,
                "traced",
                "/orders?id=7",
                headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
            )
            assert reply.status == 200
            version, trace_id, parent_id, _ = reply.body.decode().split("-")
            assert (version, trace_id) == ("00", CLIENT_TRACE)
            assert parent_id != CLIENT_SPAN  # the proxy's span, not the client's

            def exported() -> bool:
                return any(s.span_id.hex() == parent_id for s in collector.spans)

            await eventually(exported, "the proxy's span to be exported")
            [span] = [s for s in collector.spans if s.span_id.hex() == parent_id]
            assert span.name == "HTTP GET"
            assert span.kind == trace_pb2.Span.SPAN_KIND_SERVER
            assert span.trace_id.hex() == CLIENT_TRACE
            assert span.parent_span_id.hex() == CLIENT_SPAN
            attributes = {a.key: a.value for a in span.attributes}
            assert attributes["url.path"].string_value == "/orders"
            assert attributes["http.request.method"].string_value == "GET"
            assert attributes["http.response.status_code"].int_value == 200
            assert attributes["nonomad.app"].string_value == "traced"
            assert attributes["nonomad.machine_id"].string_value == m.id
    finally:
        await server.stop(None)
