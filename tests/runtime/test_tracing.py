"""Tracing: off unless the OTEL_* environment asks, and then spans reach an OTLP collector."""

from __future__ import annotations

import asyncio
import json

import pytest

from runtime import (
    client_interceptors,
    server_interceptors,
    setup_tracing,
    tracing_enabled,
    tracing_requested,
)
from tests.runtime._processes import start_module

SERVER_KIND, CLIENT_KIND = 2, 3  # opentelemetry.proto.trace.v1.Span.SpanKind


def test_without_otel_environment_tracing_is_off() -> None:
    assert setup_tracing("flyd", **{"nonomad.worker": "w1"}) is False
    assert not tracing_enabled()
    assert server_interceptors() == []
    assert client_interceptors() == []


@pytest.mark.parametrize(
    ("env", "requested"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_SDK_DISABLED": "false"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_SERVICE_NAME": "flyd"}, False),
    ],
)
def test_which_environment_requests_tracing(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], requested: bool
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert tracing_requested() is requested


async def test_spans_reach_the_collector_and_logs_carry_the_trace() -> None:
    # A separate process: the global tracer provider can be set only once per process.
    probe = await start_module("tests.runtime._tracing_probe")
    stdout, stderr = await asyncio.wait_for(probe.communicate(), 20)
    assert probe.returncode == 0, stderr.decode()
    report = json.loads(stdout.decode().splitlines()[-1])

    assert report["enabled"] is True
    assert report["interceptors_on"] == [1, 4]
    assert report["interceptors_after_shutdown"] == [0, 0]
    assert report["codes"] == ["INTERNAL"]
    assert report["exit_code"] == 0

    spans = report["spans"]
    servers = [s for s in spans if s["kind"] == SERVER_KIND]
    clients = {s["span_id"]: s for s in spans if s["kind"] == CLIENT_KIND}
    assert len(servers) == 2
    for server in servers:
        assert server["name"] == "/nonomad.test.v1.EchoService/Say"
        # Context crossed the wire: the server span is a child of the client's.
        parent = clients[server["parent_span_id"]]
        assert parent["trace_id"] == server["trace_id"]
        assert server["resource"]["service.name"] == "probe"
        assert server["resource"]["nonomad.worker"] == "w1"
        assert server["resource"]["cloud.region"] == "ams"

    [failure] = [
        json.loads(line)
        for line in stderr.decode().splitlines()
        if line.startswith("{") and json.loads(line)["event"] == "rpc_failed"
    ]
    assert (failure["trace_id"], failure["span_id"]) in {
        (s["trace_id"], s["span_id"]) for s in servers
    }
