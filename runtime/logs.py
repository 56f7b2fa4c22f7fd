"""Structured logs: one JSON object per line on stderr, for structlog and stdlib `logging` alike.

Every line carries `ts` (ISO 8601, UTC), `level`, `service`, `event`, the static fields given
to `configure_logging` (worker, region, ...), whatever the code bound with
`structlog.contextvars.bind_contextvars(machine_id=..., state=...)`, and `trace_id`/`span_id`
while an OpenTelemetry span is current.

Log with `structlog.get_logger(__name__).info("machine_started", machine_id=mid)`; event names
are snake_case verbs or nouns, values go in keyword arguments, never formatted into the event.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping

import structlog
from opentelemetry import trace
from structlog.typing import EventDict, Processor, WrappedLogger

__all__ = ["configure_logging"]

_LEVELS: Mapping[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}

# Keys that lead every line, in this order, so lines read well without a JSON viewer.
_LEADING_KEYS = ("ts", "level", "service", "event")


class _StderrHandler(logging.Handler):
    """Writes to whatever `sys.stderr` is at the time of the call.

    A StreamHandler would keep the stream it was built with, so output replaced later (pytest
    capture, a supervisor redirecting stderr) would be missed.
    """

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def _add_trace_context(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    # With tracing off the current span is the invalid singleton: one context lookup per line.
    span_context = trace.get_current_span().get_span_context()
    if span_context.is_valid:
        event_dict["trace_id"] = format(span_context.trace_id, "032x")
        event_dict["span_id"] = format(span_context.span_id, "016x")
    return event_dict


def _static_fields(fields: Mapping[str, str]) -> Processor:
    def add(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
        for key, value in fields.items():
            event_dict.setdefault(key, value)
        return event_dict

    return add


def _lead_with_standard_keys(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    ordered = {key: event_dict.pop(key) for key in _LEADING_KEYS if key in event_dict}
    ordered.update(event_dict)
    return ordered


def _structlog_processors() -> list[Processor]:
    # Runs at the call site, for structlog calls only. Dropping filtered events first keeps a
    # disabled debug line to one isEnabledFor() check; the rest happens in the handler's
    # formatter, which stdlib records go through as well.
    return [
        structlog.stdlib.filter_by_level,
        structlog.stdlib.PositionalArgumentsFormatter(),
        structlog.processors.StackInfoRenderer(),
        structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
    ]


def configure_logging(service: str, level: str, **static: str) -> None:
    """Send structlog and stdlib logs of this process to stderr as JSON lines.

    `level` is one of debug, info, warning, error. `static` fields (worker="w1", region="ams")
    appear on every line. Calling it again replaces the previous configuration.
    """
    try:
        threshold = _LEVELS[level.lower()]
    except KeyError:
        raise ValueError(
            f"unknown log level {level!r}; expected one of {', '.join(_LEVELS)}"
        ) from None

    fields = {"service": service, **static}
    # Shared by structlog events and foreign (stdlib) records; it lives in the formatter, not
    # in structlog's chain, so loggers structlog cached before a reconfiguration pick it up.
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_logger_name],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            _static_fields(fields),
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
            _add_trace_context,
            structlog.processors.format_exc_info,
            _lead_with_standard_keys,
            structlog.processors.JSONRenderer(),
        ],
    )
    handler = _StderrHandler()
    handler.setFormatter(formatter)

    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _StderrHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(threshold)

    structlog.configure(
        processors=_structlog_processors(),
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
