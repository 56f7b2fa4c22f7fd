"""configure_logging: JSON lines on stderr with the standard keys, context and trace ids."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

import pytest
import structlog
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import NoOpTracerProvider

from runtime import configure_logging

pytestmark = pytest.mark.usefixtures("restore_logging")

log = structlog.get_logger("nonomad.tests.logs")


def lines(capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    err = capsys.readouterr().err
    return [json.loads(line) for line in err.splitlines() if line.strip()]


def test_json_line_with_standard_and_static_keys(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("flyd", "info", worker="w1", region="ams")
    log.info("machine_started", machine_id="m1")
    [line] = lines(capsys)
    assert list(line)[:4] == ["ts", "level", "service", "event"]
    assert line["level"] == "info"
    assert line["service"] == "flyd"
    assert line["event"] == "machine_started"
    assert (line["worker"], line["region"], line["machine_id"]) == ("w1", "ams", "m1")
    ts = datetime.fromisoformat(line["ts"])
    assert ts.utcoffset() == UTC.utcoffset(None)
    assert "trace_id" not in line


def test_contextvars_appear_until_cleared(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("flyd", "info")
    structlog.contextvars.bind_contextvars(machine_id="m7", state="starting")
    log.info("step")
    structlog.contextvars.clear_contextvars()
    log.info("after")
    first, second = lines(capsys)
    assert (first["machine_id"], first["state"]) == ("m7", "starting")
    assert "machine_id" not in second


def test_stdlib_logging_goes_through_the_same_renderer(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("flaps", "info", region="syd")
    structlog.contextvars.bind_contextvars(request_id="r1")
    logging.getLogger("grpc.test").warning("channel %s closed", "x")
    [line] = lines(capsys)
    assert line["event"] == "channel x closed"
    assert line["level"] == "warning"
    assert (line["service"], line["region"], line["request_id"]) == ("flaps", "syd", "r1")
    assert line["logger"] == "grpc.test"


def test_level_filters_both_kinds(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("flyd", "warning")
    log.info("hidden")
    logging.getLogger("other").info("hidden too")
    log.warning("shown")
    assert [line["event"] for line in lines(capsys)] == ["shown"]


def test_exception_traceback_is_one_field(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("flyd", "info")
    try:
        raise ValueError("bad thing")
    except ValueError:
        log.exception("step_failed")
    [line] = lines(capsys)
    assert line["level"] == "error"
    assert "ValueError: bad thing" in line["exception"]


def test_configuring_twice_replaces_not_duplicates(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("flyd", "info", worker="old")
    configure_logging("flyd", "debug", worker="new")
    log.debug("once")
    logging.getLogger("stdlib").info("once too")
    first, second = lines(capsys)
    assert (first["event"], first["worker"]) == ("once", "new")
    assert (second["event"], second["worker"]) == ("once too", "new")


def test_trace_and_span_ids_inside_an_active_span(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("flyd", "info")
    tracer = TracerProvider(shutdown_on_exit=False).get_tracer("test")
    with tracer.start_as_current_span("create_machine") as span:
        log.info("inside")
        logging.getLogger("stdlib").info("inside too")
    log.info("outside")
    inside, inside_stdlib, outside = lines(capsys)
    context = span.get_span_context()
    for line in (inside, inside_stdlib):
        assert line["trace_id"] == format(context.trace_id, "032x")
        assert line["span_id"] == format(context.span_id, "016x")
    assert "trace_id" not in outside


def test_no_trace_keys_when_tracing_is_off(capsys: pytest.CaptureFixture[str]) -> None:
    # What the API hands out before any SDK provider is installed: spans without valid ids.
    configure_logging("flyd", "info")
    with NoOpTracerProvider().get_tracer("test").start_as_current_span("create_machine"):
        log.info("inside")
    [line] = lines(capsys)
    assert "trace_id" not in line
    assert "span_id" not in line


def test_an_unsampled_span_still_correlates_by_trace_id(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A caller that did not sample still gave the trace its id: lines of every service that
    # handled the request share it, whether or not any span of it is exported.
    configure_logging("flyd", "info")
    tracer = TracerProvider(sampler=ALWAYS_OFF, shutdown_on_exit=False).get_tracer("test")
    with tracer.start_as_current_span("create_machine") as span:
        log.info("inside")
    [line] = lines(capsys)
    assert not span.is_recording()
    context = span.get_span_context()
    assert line["trace_id"] == format(context.trace_id, "032x")
    assert line["span_id"] == format(context.span_id, "016x")


def test_unknown_level_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown log level 'verbose'"):
        configure_logging("flyd", "verbose")
