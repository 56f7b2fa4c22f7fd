"""What the two sides of an exchange share: the parsed request (`Request`) and its span
(`Traced`), where its body goes (`BodySink`), how an exchange with a machine ends (the `O_*`
outcomes) and why a client connection stops reading (the `PAUSE_*` reasons).

The client side (proxy.client, proxy.forward) fills a `Request` in; the machine side
(proxy.upstream) sends it, streams the rest of its body and reports how the exchange ended.
"""

from __future__ import annotations

from typing import Final, Protocol

from opentelemetry.context import Context
from opentelemetry.trace import Span, StatusCode

from proxy.errors import ProxyError
from proxy.routing import Backend

# Why a client connection's reading is paused (a bit mask: it resumes when all are gone).
PAUSE_BUFFER: Final = 1  # a request body is buffered while no backend is ready
PAUSE_UPSTREAM: Final = 2  # the machine is not reading the request body fast enough
PAUSE_QUEUE: Final = 4  # too many pipelined requests ahead
PAUSE_DEAD: Final = 8  # the parser has failed: read nothing more

# How an exchange with a machine ended.
O_DONE: Final = 1  # response complete, connection reusable
O_DONE_CLOSE: Final = 2  # response complete, connection not reusable
O_CONNECT_FAILED: Final = 3
O_LOST: Final = 4  # the machine closed the connection (or it broke) mid-exchange
O_TIMEOUT: Final = 5
O_BAD_RESPONSE: Final = 6
O_CLIENT_ERROR: Final = 7  # the client broke the request (body too large) mid-stream
O_UPGRADED: Final = 8  # a tunnel ran and is over
O_CLIENT_GONE: Final = 9
O_MACHINE_LOST: Final = 10  # the router declared the machine lost (its worker is dead)


class BodySink(Protocol):
    """Where the rest of a request's body goes once a machine connection carries the request
    (proxy.upstream.Upstream)."""

    def send_body(self, framed: bytes) -> None: ...

    def _finish(self, outcome: int) -> None: ...

    def abort(self) -> None: ...


class Request:
    """One request, from the end of its head until it is answered."""

    __slots__ = (
        "app",
        "backend",
        "body_buf",
        "body_size",
        "chunked",
        "complete",
        "error",
        "fatal",
        "has_body",
        "head",
        "http10",
        "is_head",
        "keep_alive",
        "method",
        "moved",
        "pin_due",
        "pin_token",
        "pinned",
        "replay",
        "retryable",
        "sink",
        "started",
        "trace",
        "upgrade",
    )

    def __init__(self, started: float) -> None:
        self.started = started
        self.method = b""
        self.head = b""
        self.app: str | None = None
        self.pinned: str | None = None
        # A pin the edge has yet to check (proxy.pins), with the token sent for it.
        self.pin_due = False
        self.pin_token: bytes | None = None
        self.keep_alive = False
        self.http10 = False
        self.is_head = False
        self.chunked = False
        self.has_body = False
        self.upgrade = False
        self.complete = False
        # Framed body bytes received before a machine is attached; None once attached.
        self.body_buf: list[bytes] | None = None
        self.body_size = 0
        self.sink: BodySink | None = None
        self.error: ProxyError | None = None
        self.fatal = False  # the connection cannot go on after this request
        self.retryable = False  # safe to send again to another machine
        self.replay = False  # being sent again after a pooled connection died under it
        self.moved = False  # being sent again, elsewhere, after its machine was lost
        self.backend: Backend | None = None  # acquired already (for a replay)
        self.trace: Traced | None = None  # its span, when tracing is on


class Traced:
    """A request's SERVER span and the context that makes it current."""

    __slots__ = ("context", "span")

    def __init__(self, span: Span, context: Context) -> None:
        self.span = span
        self.context = context

    def end(self, status: int, machine_id: str | None) -> None:
        span = self.span
        span.set_attribute("http.response.status_code", status)
        if machine_id is not None:
            span.set_attribute("nonomad.machine_id", machine_id)
        if status >= 500:
            span.set_status(StatusCode.ERROR)
        span.end()

    def abandon(self) -> None:
        self.span.set_status(StatusCode.ERROR, "the client went away before the answer")
        self.span.end()
