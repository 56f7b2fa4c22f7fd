"""One OpenTelemetry span per machine operation, with a span event per committed step.

The contract others test against: an operation started by an RPC (create, start, stop,
restart, destroy, update, signal) produces one span `flyd.<op>` whose parent is the context
current when the operation was submitted (the RPC's server span), with attributes
`nonomad.machine_id`, `nonomad.app` and `nonomad.worker`, and one event `step` per committed
step (attributes `from_state`, `to_state`, `step`, `reason`, `type`, `seq`). The span ends when
the machine rests again (no operation in progress), which may be in a background task long
after the RPC returned, or when the operation fails.

The Worker holds an `OpTracer` only while tracing is on; with tracing off it holds None and
the create path runs none of this.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from flyd import fsm

__all__ = ["OpSpan", "OpTracer"]


class OpSpan:
    """The span of one operation on one machine."""

    __slots__ = ("_span", "ended")

    def __init__(self, span: Span) -> None:
        self._span = span
        self.ended = False

    def step(self, t: fsm.Transition, seq: int) -> None:
        """Record one committed step."""
        op = t.row.op
        self._span.add_event(
            "step",
            {
                "from_state": fsm.state_name(t.from_state),
                "to_state": fsm.state_name(t.to_state),
                "step": op.step if op is not None else "done",
                "reason": t.reason,
                "type": t.type,
                "seq": seq,
            },
        )

    def current(self) -> AbstractContextManager[Span]:
        """Make it the current span (for log lines), without ending it on exit."""
        return trace.use_span(self._span, end_on_exit=False)

    def end(self, error: BaseException | None = None, *, superseded_by: str = "") -> None:
        """End the span (once): ok, failed with `error`, or cut short by another operation."""
        if self.ended:
            return
        self.ended = True
        if error is not None:
            self._span.record_exception(error)
            self._span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        elif superseded_by:
            self._span.set_attribute("nonomad.superseded_by", superseded_by)
        self._span.end()


class OpTracer:
    """Starts operation spans and keeps the open one of each machine for its later steps."""

    def __init__(self, tracer: Tracer, worker_id: str) -> None:
        self._tracer = tracer
        self._worker_id = worker_id
        self._open: dict[str, OpSpan] = {}

    def start(self, op: str, machine_id: str, app: str) -> OpSpan:
        """A span for `op`, a child of the current context (capture it where the RPC runs)."""
        span = self._tracer.start_span(
            f"flyd.{op}",
            context=otel_context.get_current(),
            kind=SpanKind.INTERNAL,
            attributes={
                "nonomad.machine_id": machine_id,
                "nonomad.app": app,
                "nonomad.worker": self._worker_id,
            },
        )
        return OpSpan(span)

    def attach(self, machine_id: str, op_span: OpSpan, op: str) -> None:
        """Make `op_span` the one the machine's next steps go to (it holds the machine's lock)."""
        previous = self._open.get(machine_id)
        if previous is not None and previous is not op_span:
            previous.end(superseded_by=op)
        self._open[machine_id] = op_span

    def current(self, machine_id: str) -> OpSpan | None:
        return self._open.get(machine_id)

    def committed(self, machine_id: str, t: fsm.Transition, seq: int) -> OpSpan | None:
        """Record a committed step on the machine's open span, and return that span.

        The span ends with the step that leaves the machine at rest.
        """
        op_span = self._open.get(machine_id)
        if op_span is None:
            return None
        op_span.step(t, seq)
        if t.row.op is None:
            del self._open[machine_id]
            op_span.end()
        return op_span

    def rested(self, machine_id: str) -> None:
        """The machine has no operation in progress any more: its open span ends."""
        op_span = self._open.pop(machine_id, None)
        if op_span is not None:
            op_span.end()

    def finish(
        self, machine_id: str, op_span: OpSpan, error: BaseException | None, *, resting: bool
    ) -> None:
        """The operation's call returned or raised: end its span unless its steps go on.

        `resting`: the machine has no operation in progress any more.
        """
        if error is None and not resting and self._open.get(machine_id) is op_span:
            return  # a later commit, in a background task, ends it
        if self._open.get(machine_id) is op_span:
            del self._open[machine_id]
        op_span.end(error)
