"""A real OTLP/gRPC trace receiver for tests: services export to it as to any collector.

`OtlpReceiver` implements `opentelemetry.proto.collector.trace.v1.TraceService` on
127.0.0.1:<free port> with a thread-pool `grpc.server`, so it keeps receiving while a test
blocks in grpcurl or awaits a process. It keeps every span with its resource and scope, and
answers questions about them: wait for a span matching a predicate (with a deadline), group
spans by trace, find a span's parent and children.

    receiver = OtlpReceiver().start()
    env = clean_env(**receiver.env())  # for a service process
    span = receiver.wait_for(lambda s: s.name == "/flaps.v1.MachinesService/CreateMachine")
    receiver.stop()
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

__all__ = ["Event", "OtlpReceiver", "Span", "SpanKind", "child"]

SpanKind = trace_pb2.Span.SpanKind

# Spans a receiver keeps at most: a test that exports more is broken, not busy.
MAX_SPANS = 100_000


def _value(value: common_pb2.AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(v) for v in value.array_value.values)
    if kind == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    if kind is None:
        return None
    return getattr(value, kind)


def _attributes(pairs: Iterable[common_pb2.KeyValue]) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


@dataclass(frozen=True)
class Event:
    name: str
    attributes: Mapping[str, Any]


@dataclass(frozen=True)
class Span:
    """One exported span; ids are lowercase hex, `parent_span_id` is "" for a root."""

    name: str
    kind: int  # SpanKind.SPAN_KIND_SERVER, ...
    trace_id: str
    span_id: str
    parent_span_id: str
    resource: Mapping[str, Any]
    scope: str
    attributes: Mapping[str, Any]
    events: tuple[Event, ...]
    status_code: int
    start_ns: int
    end_ns: int

    @property
    def service(self) -> str:
        return str(self.resource.get("service.name", ""))

    def event(self, name: str) -> Event:
        """The one event called `name`; AssertionError (listing what there is) otherwise."""
        found = [e for e in self.events if e.name == name]
        assert len(found) == 1, f"{self.name}: want one {name!r} event, have {self.events}"
        return found[0]

    def __str__(self) -> str:
        return f"{self.service}:{self.name}[{self.span_id} <- {self.parent_span_id or 'root'}]"


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects what OTLP exporters send it; thread-safe; start() it, stop() it."""

    def __init__(self) -> None:
        self._spans: list[Span] = []
        self._changed = threading.Condition()
        self._server: grpc.Server | None = None
        self.port = 0
        self.exports = 0
        """Export calls received (a batch each)."""
        self.raw: list[bytes] = []
        """Every export request as it came, serialized: what to search for what must not be
        in a span."""

    # -- the service -------------------------------------------------------------------------

    def Export(
        self,
        request: trace_service_pb2.ExportTraceServiceRequest,
        context: grpc.ServicerContext,
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        spans = [
            _span(span, resource, scope_spans.scope.name)
            for resource_spans in request.resource_spans
            for resource in [_attributes(resource_spans.resource.attributes)]
            for scope_spans in resource_spans.scope_spans
            for span in scope_spans.spans
        ]
        with self._changed:
            if len(self._spans) + len(spans) > MAX_SPANS:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"over {MAX_SPANS} spans")
            self._spans.extend(spans)
            self.raw.append(request.SerializeToString())
            self.exports += 1
            self._changed.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> OtlpReceiver:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="otlp"))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, server)
        self.port = server.add_insecure_port("127.0.0.1:0")
        if not self.port:
            raise RuntimeError("the OTLP receiver could not bind 127.0.0.1:0")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(None).wait(10)
            self._server = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, **extra: str) -> dict[str, str]:
        """The `OTEL_*` settings that make a nonomad process export here, quickly."""
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            **extra,
        }

    # -- questions ---------------------------------------------------------------------------

    @property
    def spans(self) -> list[Span]:
        """Every span received so far, in arrival order (a copy)."""
        with self._changed:
            return list(self._spans)

    def find(self, predicate: Callable[[Span], bool]) -> list[Span]:
        return [span for span in self.spans if predicate(span)]

    def wait_for(
        self, predicate: Callable[[Span], bool], deadline: float = 30.0, what: str = ""
    ) -> Span:
        """The first span matching `predicate`, waiting up to `deadline` seconds for it."""
        end = time.monotonic() + deadline
        with self._changed:
            while True:
                for span in self._spans:
                    if predicate(span):
                        return span
                remaining = end - time.monotonic()
                if remaining <= 0:
                    names = sorted({str(s) for s in self._spans})
                    raise AssertionError(
                        f"no span {what or 'matching'} within {deadline}s; received: {names}"
                    )
                self._changed.wait(remaining)

    async def until(
        self, predicate: Callable[[Span], bool], deadline: float = 30.0, what: str = ""
    ) -> Span:
        """`wait_for` without blocking the event loop."""
        return await asyncio.to_thread(self.wait_for, predicate, deadline, what)

    def traces(self) -> dict[str, list[Span]]:
        """Spans grouped by trace id, each group in start order."""
        out: dict[str, list[Span]] = {}
        for span in sorted(self.spans, key=lambda s: s.start_ns):
            out.setdefault(span.trace_id, []).append(span)
        return out

    def trace(self, trace_id: str) -> list[Span]:
        return self.traces().get(trace_id, [])

    def parent(self, span: Span) -> Span | None:
        """The span's parent, if it was received (None for a root or a remote parent)."""
        if not span.parent_span_id:
            return None
        for other in self.trace(span.trace_id):
            if other.span_id == span.parent_span_id:
                return other
        return None

    def children(self, span: Span, name: str | None = None) -> list[Span]:
        """The span's direct children (optionally only those called `name`), in start order."""
        return [
            other
            for other in self.trace(span.trace_id)
            if other.parent_span_id == span.span_id and (name is None or other.name == name)
        ]

    def child(self, span: Span, name: str) -> Span:
        """The one direct child called `name`; AssertionError (listing the children) if not."""
        found = self.children(span, name)
        assert len(found) == 1, (
            f"{span}: want one child {name!r}, have {[str(c) for c in self.children(span)]}"
        )
        return found[0]


def _span(span: trace_pb2.Span, resource: Mapping[str, Any], scope: str) -> Span:
    return Span(
        name=span.name,
        kind=span.kind,
        trace_id=span.trace_id.hex(),
        span_id=span.span_id.hex(),
        parent_span_id=span.parent_span_id.hex(),
        resource=resource,
        scope=scope,
        attributes=_attributes(span.attributes),
        events=tuple(Event(e.name, _attributes(e.attributes)) for e in span.events),
        status_code=span.status.code,
        start_ns=span.start_time_unix_nano,
        end_ns=span.end_time_unix_nano,
    )


async def child(otlp: OtlpReceiver, parent: Span, name: str, kind: int, service: str) -> Span:
    """The one span called `name` under `parent`, waiting for it to be exported."""

    def match(span: Span) -> bool:
        return span.parent_span_id == parent.span_id and span.name == name and span.kind == kind

    found = await otlp.until(match, what=f"{service} {name} under {parent}")
    assert len(otlp.find(match)) == 1, [str(s) for s in otlp.find(match)]
    assert found.trace_id == parent.trace_id
    assert found.service == service, found.resource
    return found
