"""Operation spans: one `flyd.<op>` span per requested operation, a `step` event per commit.

A Worker on the real LMDB store and the fake driver, with an in-memory span exporter; each test
opens a span standing for the RPC's server span and checks the operation's span against it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Span, StatusCode, Tracer

from flyd import fsm
from flyd.runner import Runner
from flyd.traces import OpTracer
from flyd.v1 import machine_pb2 as pb
from model.errors import FailedPrecondition
from tests.flyd.support import (
    DEADLINE,
    Flyd,
    Node,
    config,
    settled,
    until,
)

S = pb.MachineState


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracer(exporter: InMemorySpanExporter) -> Iterator[Tracer]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("test")
    provider.shutdown()


@pytest.fixture
def flyd(node: Node, tracer: Tracer) -> Flyd:
    return node.boot(op_tracer=OpTracer(tracer, "w1"))


def spans_named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def steps(span: ReadableSpan) -> list[tuple[str, str, str]]:
    """(from_state, to_state, step) of each step event."""
    out = []
    for event in span.events:
        if event.name != "step":
            continue
        attrs = event.attributes or {}
        out.append((str(attrs["from_state"]), str(attrs["to_state"]), str(attrs["step"])))
    return out


def child_of(span: ReadableSpan, parent: Span) -> bool:
    ctx = parent.get_span_context()
    return (
        span.parent is not None
        and span.parent.span_id == ctx.span_id
        and span.context is not None
        and span.context.trace_id == ctx.trace_id
    )


async def test_create_is_one_span_under_the_rpc_with_a_step_per_commit(
    flyd: Flyd, tracer: Tracer, exporter: InMemorySpanExporter
) -> None:
    with tracer.start_as_current_span("rpc CreateMachine") as rpc:
        machine = await flyd.worker.create(
            machine_id="m1", name="", app="web", config=config(), skip_launch=False
        )
    assert machine.state == S.MACHINE_STATE_STARTED
    [span] = spans_named(exporter, "flyd.create")
    assert child_of(span, rpc)
    assert dict(span.attributes or {}) == {
        "nonomad.machine_id": "m1",
        "nonomad.app": "web",
        "nonomad.worker": "w1",
    }
    assert steps(span) == [
        ("unspecified", "created", "begin"),
        ("created", "starting", "spawn"),
        ("starting", "started", "release"),
    ]
    reasons = [str((e.attributes or {})["reason"]) for e in span.events]
    assert reasons[0] == "created"
    assert reasons[2].startswith("running (pid ")
    assert span.status.status_code == StatusCode.UNSET


async def test_a_stop_span_ends_when_its_background_step_commits(
    flyd: Flyd, tracer: Tracer, exporter: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = flyd.worker
    await w.create(machine_id="m1", name="", app="web", config=config(), skip_launch=False)
    logged: dict[str, int] = {}  # state -> the trace current when its commit was logged
    log_commit = Runner._log_commit

    def spy(machine_id: str, steps: list[fsm.Transition], seq: int) -> None:
        logged[fsm.state_name(steps[-1].to_state)] = (
            trace.get_current_span().get_span_context().trace_id
        )
        log_commit(machine_id, steps, seq)

    monkeypatch.setattr(Runner, "_log_commit", staticmethod(spy))
    with tracer.start_as_current_span("rpc StopMachine") as rpc:
        await w.stop("m1", None, None)
        # the RPC returns here; the machine is stopping, and the kill goes on in a task
        assert spans_named(exporter, "flyd.stop") == []
    await until(w, settled(w, "m1", S.MACHINE_STATE_STOPPED))
    [span] = spans_named(exporter, "flyd.stop")
    assert child_of(span, rpc)
    assert steps(span) == [("started", "stopping", "kill"), ("stopping", "stopped", "done")]
    # Each commit is logged with the operation's span current, so log lines carry its trace id
    # (test_tracing_process checks a task that inherited another RPC's context).
    trace_id = rpc.get_span_context().trace_id
    assert logged == {"stopping": trace_id, "stopped": trace_id}


async def test_a_refused_operation_is_a_failed_span(
    flyd: Flyd, tracer: Tracer, exporter: InMemorySpanExporter
) -> None:
    w = flyd.worker
    await w.create(machine_id="m1", name="", app="web", config=config(), skip_launch=True)
    await w.destroy("m1", force=False)
    await until(w, settled(w, "m1", S.MACHINE_STATE_DESTROYED))
    with tracer.start_as_current_span("rpc StartMachine") as rpc, pytest.raises(FailedPrecondition):
        await w.start("m1")
    [span] = spans_named(exporter, "flyd.start")
    assert child_of(span, rpc)
    assert span.status.status_code == StatusCode.ERROR
    assert [e.name for e in span.events] == ["exception"]  # and no step
    assert "cannot start a destroyed machine" in (span.status.description or "")


@pytest.mark.parametrize(
    ("op", "story"),
    [
        (
            "restart",
            [
                ("started", "restarting", "kill"),
                ("restarting", "restarting", "spawn"),
                ("restarting", "started", "release"),
            ],
        ),
        ("signal", [("started", "started", "send"), ("started", "started", "done")]),
        (
            "destroy",
            [
                ("started", "destroying", "kill"),
                ("destroying", "destroying", "cleanup"),
                ("destroying", "destroyed", "done"),
            ],
        ),
    ],
)
async def test_each_operation_has_its_span(
    flyd: Flyd,
    tracer: Tracer,
    exporter: InMemorySpanExporter,
    op: str,
    story: list[tuple[str, str, str]],
) -> None:
    w = flyd.worker
    await w.create(machine_id="m1", name="", app="web", config=config(), skip_launch=False)
    with tracer.start_as_current_span(f"rpc {op}") as rpc:
        if op == "restart":
            await w.restart("m1", None, None)
            await until(w, settled(w, "m1", S.MACHINE_STATE_STARTED))
        elif op == "signal":
            await w.signal("m1", 10)
        else:
            await w.destroy("m1", force=True)
            await until(w, settled(w, "m1", S.MACHINE_STATE_DESTROYED))
    [span] = spans_named(exporter, f"flyd.{op}")
    assert child_of(span, rpc)
    assert steps(span) == story
    assert span.end_time is not None


async def test_an_update_span_spans_the_old_process_stop_and_the_new_start(
    flyd: Flyd, tracer: Tracer, exporter: InMemorySpanExporter
) -> None:
    w = flyd.worker
    await w.create(machine_id="m1", name="", app="web", config=config(), skip_launch=False)
    with tracer.start_as_current_span("rpc UpdateMachine") as rpc:
        await w.update("m1", config("v2"), skip_launch=False)
        await until(w, settled(w, "m1", S.MACHINE_STATE_STARTED), DEADLINE)
    [span] = spans_named(exporter, "flyd.update")
    assert child_of(span, rpc)
    assert steps(span) == [
        ("started", "stopping", "kill"),
        ("stopping", "starting", "spawn"),
        ("starting", "started", "release"),
    ]


async def test_without_a_tracer_no_span_is_made(
    node: Node, tracer: Tracer, exporter: InMemorySpanExporter
) -> None:
    flyd = node.boot()
    try:
        with tracer.start_as_current_span("rpc CreateMachine"):
            await flyd.worker.create(
                machine_id="m1", name="", app="web", config=config(), skip_launch=False
            )
            await flyd.worker.stop("m1", None, None)
    finally:
        await flyd.kill()
    assert [s.name for s in exporter.get_finished_spans()] == ["rpc CreateMachine"]
