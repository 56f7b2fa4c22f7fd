"""The client side of the data plane, reading: one connection from outside (`ClientConnection`).

Its parser (httptools, i.e. llhttp: the fastest of the candidates measured in
bench/proxy_bench.py) turns the bytes into `Request`s: it bounds heads and bodies (proxy.limits),
finds the app the Host names, builds the head sent to the machine and passes the body on to the
machine connection, buffering a bounded amount until there is one.

The head a machine gets is the edge's own reading of the request: its framing (Content-Length or
chunked) written by the edge from what it parsed, never the client's lines, and the body exactly
the one parsed (llhttp refuses duplicate or conflicting lengths, Content-Length beside
Transfer-Encoding, a last coding other than chunked, obs-fold, bare CR or LF, bad chunk sizes,
whitespace before a colon; the edge refuses what llhttp lets through: a Connection header naming a
framing or routing header, another coding before chunked, Transfer-Encoding in HTTP/1.0, a body on
an upgrade, versions other than 1.1 and 1.0). Hop-by-hop headers (the standard ones and those
Connection names) and the proxy's own `nonomad-*` ones are dropped, the forwarding headers are the
edge's (proxy.forwarded) and, with tracing on, the trace context is the request's span. Requests
are handed on once the data they came in is parsed, so that no byte of one reaches a machine when
that data breaks the framing; nothing pipelined after a request that ends the connection is read.

It also handles the connection: admission, flow control, deadlines, shutdown and close. What
becomes of each parsed request is the subclass's (proxy.forward.Client: `_queue`, `_serve`).
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Final, Protocol, cast

import httptools
import structlog
from opentelemetry.trace import SpanKind, Tracer, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from proxy.deadline import Timed
from proxy.errors import (
    BadRequest,
    BodyTooLarge,
    HeadersTooLarge,
    ProxyError,
    UnknownApp,
    UnsupportedCoding,
    UnsupportedVersion,
)
from proxy.exchange import (
    O_CLIENT_ERROR,
    O_CLIENT_GONE,
    PAUSE_BUFFER,
    PAUSE_DEAD,
    Request,
    Traced,
)
from proxy.forwarded import CHAINED, WRITTEN, Forwarding
from proxy.routing import Backend, Router
from proxy.upstream import Owner, Upstream
from proxy.wire import (
    CHUNK_END,
    CRLF,
    FORWARDED,
    FRAMING,
    OVERLOADED,
    connection_options,
    drop_headers,
    error_response,
)

log = structlog.get_logger("proxy.http")  # the data plane logs under one name

_W3C: Final = TraceContextTextMapPropagator()
_CONNECTION_TOKENS: Final = frozenset({b"close", b"keep-alive", b"upgrade"})
_IDEMPOTENT: Final = frozenset({b"GET", b"HEAD"})
NAMESPACE: Final = b"nonomad-"
"""Request headers whose names start so are the proxy's: read by it, never sent to a machine."""
TOKEN_HEADER: Final = b"nonomad-token"
"""A token (model.tokens) that lets a request pin a machine of an app it may read."""

# Client connection phases (what its deadline is for).
C_BUSY: Final = 0  # a request is complete and being answered: no read deadline
C_HEAD: Final = 1
C_BODY: Final = 2
C_IDLE: Final = 3


class Edge(Owner, Protocol):
    """What a client connection uses of its proxy (proxy.http.HttpProxy)."""

    router: Router
    domain: str
    _conns: set[ClientConnection]
    _pin_header: bytes
    _pin_check: Callable[[str, str, bytes | None], Awaitable[str | None]] | None
    _req_special: frozenset[bytes]
    _tracer: Tracer | None
    _forwarding: Forwarding

    def _conn_closed(self, conn: ClientConnection) -> None: ...

    def _admit(self, conn: ClientConnection) -> bool: ...

    def _app_for(self, host: bytes) -> str | None: ...


class _RequestError(Exception):
    """Raised from a parser callback to stop parsing; the error is in `error`."""

    def __init__(self, error: ProxyError) -> None:
        super().__init__(str(error))
        self.error = error


class _Stopped(Exception):
    """Raised from a parser callback when a request begins after one that ends the
    connection: nothing after it is read."""


class ClientConnection(Timed):
    """A client connection: parses its requests and hands them to `_queue`."""

    __slots__ = (
        "backend",
        "closed",
        "cur",
        "dead",
        "fed_other",
        "fwd_lines",
        "h_chunked",
        "h_cl",
        "h_coding",
        "h_conn_extra",
        "h_hop",
        "h_hosts",
        "h_ka",
        "h_parts",
        "h_traceparent",
        "h_tracestate",
        "h_upgrade",
        "head_exact",
        "head_raw",
        "host",
        "in_head",
        "limits",
        "parsed",
        "parser",
        "paused",
        "peer",
        "phase",
        "pin",
        "pin_name",
        "pin_token",
        "proxy",
        "req_special",
        "reqs",
        "shutting_down",
        "task",
        "transport",
        "trusted",
        "tunnel",
        "tunnel_buf",
        "up",
        "upgraded",
        "url",
        "waiter",
        "write_stalled",
    )

    def __init__(self, proxy: Edge) -> None:
        self._init_timer(proxy._loop)
        self.proxy = proxy
        self.limits = proxy.limits
        self.pin_name = proxy._pin_header
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.peer = b"unknown"
        self.trusted = False  # the peer is a hop the operator trusts (proxy.forwarded)
        self.fwd_lines = Forwarding.lines(self.peer)
        self.reqs: deque[Request] = deque()
        # Requests whose heads the parser completed in the data being fed: handed on
        # (`_queue`) once it is all parsed, so that a framing error anywhere in it stops
        # them before any byte of theirs reaches a machine.
        self.parsed: list[Request] = []
        self.cur: Request | None = None  # being parsed: head done, body in progress
        self.task: asyncio.Task[None] | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.up: Upstream | None = None  # the machine connection answering now
        self.backend: Backend | None = None  # the machine `up` goes to (acquired)
        self.tunnel: Upstream | None = None
        self.tunnel_buf = bytearray()
        self.upgraded = False
        self.closed = False
        self.dead = False
        self.shutting_down = False
        self.paused = 0
        self.write_stalled = False
        self.phase = C_HEAD
        self.in_head = False
        self.head_raw = 0
        self.head_exact = 0
        self.fed_other = 0
        self.req_special = proxy._req_special
        self.h_traceparent: bytes | None = None  # read only when tracing is on
        self.h_tracestate: bytes | None = None
        self._reset_head()

    def _reset_head(self) -> None:
        self.url = b""
        self.host = b""
        self.pin: bytes | None = None
        self.pin_token: bytes | None = None
        # the upstream head: the request line (method and target filled in at its end), then
        # the headers as they come
        self.h_parts: list[bytes] = [b"", b" ", b"", b" HTTP/1.1\r\n"]
        self.h_ka = False
        self.h_cl = -1
        self.h_chunked = False
        self.h_coding: bytes | None = None  # a transfer coding other than chunked
        self.h_hosts = 0
        self.h_hop: dict[bytes, bytes] | None = None  # a trusted hop's forwarding headers
        self.h_upgrade = b""
        self.h_conn_extra: list[bytes] | None = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, though they are one.
        self.transport = transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and peer:
            self.peer = str(peer[0]).encode()
        if not self.proxy._admit(self):
            self.closed = True
            transport.write(OVERLOADED)
            transport.close()
            return
        if self.peer != b"unknown":
            self.fwd_lines = Forwarding.lines(self.peer)
            self.trusted = self.proxy._forwarding.trusts(self.peer.decode())
        self._set_deadline(self.limits.header_timeout)
        self.task = self._loop.create_task(self._serve())

    def data_received(self, data: bytes) -> None:
        tunnel = self.tunnel
        if tunnel is not None:
            assert tunnel.transport is not None
            tunnel.transport.write(data)
            return
        if self.upgraded:
            self.tunnel_buf += data
            if len(self.tunnel_buf) > self.limits.buffer_bytes:
                self._pause(PAUSE_BUFFER)
            return
        if self.dead:
            return
        was_in_head = self.in_head
        self.fed_other = 0
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._on_upgrade(data[exc.args[0] :])
            self._hand_on()
            return
        except httptools.HttpParserCallbackError as exc:
            context = exc.__context__
            if isinstance(context, _RequestError):
                self._fail(context.error)
            elif isinstance(context, _Stopped):
                self._hand_on()
            else:
                log.warning("proxy_parser_callback_failed", exc_info=exc)
                self._fail(BadRequest("malformed request"))
            return
        except httptools.HttpParserError as exc:
            self._fail(BadRequest(f"malformed request: {_parser_reason(exc)}"))
            return
        if self.parsed:
            self._hand_on()
        if self.in_head:
            # A head still incomplete: llhttp holds a partial header line for us, so bound
            # the raw bytes too (of a chunk where a head began, what was not an earlier
            # request's head or body).
            if was_in_head:
                self.head_raw += len(data)
            else:
                self.head_raw = len(data) - self.fed_other
            if self.head_raw > self.limits.max_header_bytes:
                self._fail(HeadersTooLarge("request head too large"))
        elif self.phase == C_BODY:
            self._set_deadline(self.limits.body_timeout)

    def eof_received(self) -> bool | None:
        # A client that stops sending has gone (a half-close is treated as a close): what it
        # was waiting for is abandoned, so its machine slot is freed at once.
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_timer()
        self.proxy._conn_closed(self)
        tunnel = self.tunnel
        up = self.up
        if tunnel is not None:
            if tunnel.transport is not None:
                tunnel.transport.close()  # its connection_lost ends the exchange
        elif up is not None:
            up._finish(O_CLIENT_GONE)
        for req in self.reqs:  # machines acquired for requests nobody will send now
            if req.backend is not None:
                self.proxy.router.release(req.backend, ok=False)
                req.backend = None
            if req.trace is not None:
                req.trace.abandon()
                req.trace = None
        self.reqs.clear()
        task = self.task
        if task is not None and not task.done():
            task.cancel()

    def pause_writing(self) -> None:
        up = self.up
        if up is not None and up.transport is not None and not up.read_paused:
            up.read_paused = True
            up.transport.pause_reading()
        self.write_stalled = True
        stall_deadline = self._loop.time() + self.limits.body_timeout
        if stall_deadline < self._deadline:
            self._set_deadline_at(stall_deadline)

    def resume_writing(self) -> None:
        self.write_stalled = False
        up = self.up
        if up is not None and up.transport is not None and up.read_paused:
            up.read_paused = False
            up.transport.resume_reading()
        if self.phase == C_BUSY:
            self._clear_deadline()

    # flow control

    def _pause(self, reason: int) -> None:
        if not self.paused and self.transport is not None and not self.closed:
            self.transport.pause_reading()
        self.paused |= reason

    def _resume(self, reason: int) -> None:
        if self.paused & reason:
            self.paused &= ~reason
            if not self.paused and self.transport is not None and not self.closed:
                self.transport.resume_reading()

    def _expired(self) -> None:
        if self.write_stalled:
            log.debug("proxy_client_write_stalled", peer=self.peer)
            self._abort()
            return
        phase = self.phase
        if self.paused and phase in (C_HEAD, C_BODY):
            self._set_deadline(self.limits.body_timeout)  # it is us who stopped reading
            return
        if phase == C_IDLE:
            self._close()
        elif phase == C_HEAD:
            if self.up is None and not self.reqs and self.in_head:
                self._write(
                    error_response(408, "request head not received in time", keep_alive=False)
                )
            self._close()
        elif phase == C_BODY:
            if self.up is None or not self.up.got_head:
                self._write(error_response(408, "request body stalled", keep_alive=False))
            self._abort()

    # httptools callbacks

    def on_message_begin(self) -> None:
        if self.dead:
            raise _Stopped  # pipelined behind a request that ends the connection
        self.in_head = True
        self.head_raw = 0
        self.head_exact = 0
        if self.phase != C_HEAD:
            self.phase = C_HEAD
            self._set_deadline_at(self._loop.time() + self.limits.header_timeout)

    def on_url(self, url: bytes) -> None:
        self.url = self.url + url if self.url else url
        size = self.head_exact + len(url)
        self.head_exact = size
        if size > self.limits.max_header_bytes:
            raise _RequestError(HeadersTooLarge("request head too large"))

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.in_head:
            return  # trailers of a chunked body: dropped
        size = self.head_exact + len(name) + len(value) + 4
        self.head_exact = size
        if size > self.limits.max_header_bytes:
            raise _RequestError(HeadersTooLarge("request head too large"))
        lname = name.lower()
        if lname in self.req_special:
            if lname == b"host":
                self.host = value
                self.h_hosts += 1
            elif lname == b"connection":
                if value.lower() == b"keep-alive":
                    self.h_ka = True
                else:
                    self._read_connection(value)
                return
            elif lname == b"content-length":
                # llhttp has checked it: digits, one header, no Transfer-Encoding beside it.
                # The edge writes its own, from this.
                self.h_cl = int(value)
                return
            elif lname == b"transfer-encoding":
                if value.lower() == b"chunked":
                    self.h_chunked = True
                else:
                    # A coding other than chunked is refused: last (llhttp's 400 too, once the
                    # head is complete), the body cannot be delimited; before chunked (501), it
                    # would be lost when the edge frames the body anew.
                    codings = [c.strip(b" \t").lower() for c in value.split(b",")]
                    codings = [c for c in codings if c]
                    self.h_chunked = bool(codings) and codings[-1] == b"chunked"
                    other = [c for c in codings if c != b"chunked"]
                    if other and self.h_coding is None:
                        self.h_coding = other[0][:40]
                return
            elif lname == b"upgrade":
                self.h_upgrade = value
                return
            elif lname == b"traceparent":  # (tracing on) the span's parent; ours replaces it
                self.h_traceparent = value
                return
            elif lname == b"tracestate":
                self.h_tracestate = value
                return
            elif lname in FORWARDED:
                if not self.trusted:
                    return  # a client's word on who it is: the edge writes its own
                if lname in WRITTEN:  # a trusted hop's: chained or kept in the edge's own
                    hop = self.h_hop
                    if hop is None:
                        hop = self.h_hop = {}
                    was = hop.get(lname)
                    if was is None:
                        hop[lname] = value
                    elif lname in CHAINED:
                        hop[lname] = was + b", " + value
                    return
                # the others from a trusted hop pass on
            else:
                return  # other hop-by-hop headers: not passed on
        elif lname.startswith(NAMESPACE):
            # The proxy's own headers: read here, never passed on to a machine.
            if lname == self.pin_name:
                self.pin = value
            elif lname == TOKEN_HEADER:
                self.pin_token = value
            return
        self.h_parts += (name, b": ", value, CRLF)

    def on_headers_complete(self) -> None:
        self.in_head = False
        self.fed_other += self.head_exact + 64  # what the head took, with its line ends
        parser = self.parser
        proxy = self.proxy
        req = Request(self._loop.time())
        method = parser.get_method()
        req.method = method
        req.is_head = method == b"HEAD"
        keep_alive = parser.should_keep_alive()
        version = "1.1"
        if self.h_ka or not keep_alive:
            # Only HTTP/1.1 keeps its connection without saying keep-alive (the versions
            # llhttp takes are 0.9, 1.0, 1.1 and 2.0), so the (slower) version check is needed
            # only here.
            version = parser.get_http_version()
            req.http10 = version == "1.0"
        req.keep_alive = keep_alive and not self.shutting_down
        req.upgrade = parser.should_upgrade()
        req.chunked = self.h_chunked
        cl = self.h_cl
        req.has_body = req.chunked or cl > 0
        host = self.host
        url = self.url
        target = url[:8].lower()
        if target.startswith((b"http://", b"https://")):
            # Absolute form (RFC 9112 3.2.2): the target's authority names the app, and a
            # machine is sent the origin form. A Host that says otherwise is refused.
            authority, _, path = url[url.index(b"//") + 2 :].partition(b"/")
            authority, q, query = authority.partition(b"?")
            url = b"/" + path if not q else b"/?" + query
            if self.h_hosts and host.strip().lower() != authority.lower():
                req.error = BadRequest("Host does not match the request target's authority")
            elif not self.h_hosts:
                self.h_parts += (b"Host", b": ", authority, CRLF)
            host = authority
        if req.error is not None:
            pass
        elif version != "1.1" and version != "1.0":
            req.error = UnsupportedVersion(f"HTTP/{version} is not supported: 1.1 or 1.0 only")
        elif self.h_coding is not None:
            if req.chunked:
                req.error = UnsupportedCoding(
                    f"transfer coding {self.h_coding.decode('latin-1')!r} is not supported: "
                    "only chunked"
                )
            else:
                req.error = BadRequest("Transfer-Encoding whose last coding is not chunked")
        elif req.chunked and req.http10:
            # RFC 9112 6.1: an HTTP/1.0 message with Transfer-Encoding has faulty framing.
            req.error = BadRequest("Transfer-Encoding in an HTTP/1.0 request")
        elif req.upgrade and req.has_body:
            # Its body would go to a machine that may refuse the upgrade and read it as
            # the next request.
            req.error = BadRequest("an upgrade request cannot have a body")
        elif self.h_hosts > 1:
            req.error = BadRequest("more than one Host header")
        elif method == b"CONNECT":
            req.error = BadRequest("CONNECT is not supported")
        elif cl > self.limits.max_body_bytes:
            req.error = BodyTooLarge(
                f"request body of {cl} bytes is over the limit of {self.limits.max_body_bytes}"
            )
        else:
            req.app = proxy._app_for(host)
            if req.app == "":
                req.app = None
                req.error = BadRequest("malformed Host (its port must be 1-65535)")
            elif req.app is None:
                req.error = UnknownApp(
                    f"no app at host {host[:80].decode('latin-1')!r}: expected <app>.{proxy.domain}"
                )
            elif self.pin is not None:
                req.pinned = self.pin.decode("latin-1").strip() or None
                if req.pinned is not None and proxy._pin_check is not None:
                    # Checked before it is routed (proxy.forward: the check may ask flaps).
                    req.pin_token = self.pin_token
                    req.pin_due = True
            req.retryable = method in _IDEMPOTENT and not req.has_body and req.pinned is None
        if req.error is not None:
            # A bad request closes the connection after the answer; so does one whose body
            # is not going to be read.
            req.fatal = isinstance(req.error, BadRequest) or req.has_body or req.upgrade
            req.keep_alive = req.keep_alive and not req.fatal
        # The framing is the edge's own: the body it forwards is the one it parsed.
        if req.upgrade and req.error is None:
            framing = b"connection: upgrade\r\nupgrade: " + self.h_upgrade + CRLF
        elif req.chunked:
            framing = b"transfer-encoding: chunked\r\n"
        elif cl >= 0:
            framing = b"content-length: %d\r\n" % cl
        else:
            framing = b""
        parts = self.h_parts
        parts[0] = method
        parts[2] = url
        hop = self.h_hop
        if self.h_conn_extra is not None:
            parts = drop_headers(parts, self.h_conn_extra, 4)
            if hop is not None:
                for name in self.h_conn_extra:
                    hop.pop(name, None)
        if hop is None:
            parts += (self.fwd_lines, host, Forwarding.host_line(host))
        else:
            parts.append(proxy._forwarding.chained(self.peer, hop, host))
        tracer = proxy._tracer
        if tracer is None:
            parts += (framing, CRLF)
        else:
            parts += (framing, self._trace(req, tracer), CRLF)
        req.head = b"".join(parts)
        self._reset_head()
        if req.has_body and req.error is None:
            self.cur = req
            req.body_buf = []
            self.phase = C_BODY
            self._set_deadline(self.limits.body_timeout)
        else:
            req.complete = not req.has_body
            self.phase = C_BUSY
            self._deadline = math.inf  # (_clear_deadline, inlined)
            if req.fatal:
                self.dead = True
                self._pause(PAUSE_DEAD)
        self.parsed.append(req)

    def _read_connection(self, value: bytes) -> None:
        """Read a Connection header: keep-alive, and the options that name headers to drop.
        One naming a header the edge frames or routes by is refused (proxy.wire.FRAMING)."""
        try:
            options = connection_options(value)
        except ValueError as exc:
            raise _RequestError(
                BadRequest(f"malformed Connection header: {exc.args[0][:40].decode('latin-1')!r}")
            ) from None
        for option in options:
            if option == b"keep-alive":
                self.h_ka = True
            elif option in FRAMING:
                raise _RequestError(
                    BadRequest(
                        f"Connection names {option.decode()}: the edge frames and routes the "
                        "request by it, so it cannot be dropped as hop-by-hop"
                    )
                )
            elif option not in _CONNECTION_TOKENS:
                if self.h_conn_extra is None:
                    self.h_conn_extra = []
                self.h_conn_extra.append(option)

    def _hand_on(self) -> None:
        """Queue the requests whose heads were parsed from the data just fed."""
        parsed = self.parsed
        self.parsed = []
        for req in parsed:
            self._queue(req)

    def _trace(self, req: Request, tracer: Tracer) -> bytes:
        """Start `req`'s SERVER span (a child of the client's `traceparent`, if any); the
        header lines that carry it to the machine."""
        carrier = {}
        if self.h_traceparent is not None:
            carrier["traceparent"] = self.h_traceparent.decode("latin-1")
            self.h_traceparent = None
        if self.h_tracestate is not None:
            carrier["tracestate"] = self.h_tracestate.decode("latin-1")
            self.h_tracestate = None
        parent = _W3C.extract(carrier) if carrier else None
        method = req.method.decode("latin-1")
        path = self.url.split(b"?", 1)[0].decode("latin-1")
        attributes = {"http.request.method": method, "url.path": path}
        if req.app is not None:
            attributes["nonomad.app"] = req.app
        span = tracer.start_span(
            f"HTTP {method}", context=parent, kind=SpanKind.SERVER, attributes=attributes
        )
        context = set_span_in_context(span, parent)
        req.trace = Traced(span, context)
        out: dict[str, str] = {}
        _W3C.inject(out, context=context)
        return "".join(f"{k}: {v}\r\n" for k, v in out.items()).encode("latin-1")

    def on_body(self, data: bytes) -> None:
        req = self.cur
        if req is None:
            return
        self.fed_other += len(data)
        size = req.body_size + len(data)
        req.body_size = size
        if size > self.limits.max_body_bytes:
            raise _RequestError(
                BodyTooLarge(f"request body is over the limit of {self.limits.max_body_bytes}")
            )
        framed = b"%x\r\n%b\r\n" % (len(data), data) if req.chunked else data
        sink = req.sink
        if sink is not None:
            sink.send_body(framed)
            return
        buf = req.body_buf
        if buf is not None:
            buf.append(framed)
            if size > self.limits.buffer_bytes:
                self._pause(PAUSE_BUFFER)

    def on_message_complete(self) -> None:
        req = self.cur
        if req is None:
            return
        self.cur = None
        req.complete = True
        if self.phase == C_BODY:
            self.phase = C_BUSY
            self._clear_deadline()
        if req.chunked:
            sink = req.sink
            if sink is not None:
                sink.send_body(CHUNK_END)
            elif req.body_buf is not None:
                req.body_buf.append(CHUNK_END)
        req.sink = None

    def _fail(self, error: ProxyError) -> None:
        """The request stream is broken: answer `error` after what is queued, then close."""
        in_head = self.in_head
        self.dead = True
        self.in_head = False
        self._pause(PAUSE_DEAD)
        cur = self.cur
        if cur is not None:
            # Mid-body (chunked over the limit, or a bad chunk): it may be on its way.
            self.cur = None
            cur.error = error
            cur.fatal = True
            sink = cur.sink
            if sink is not None:
                sink._finish(O_CLIENT_ERROR)
                sink.abort()
            self._hand_on()  # (if its head came in this data, it goes no further than here)
            return
        parsed = self.parsed
        if parsed and not in_head:
            # Broken after the head of the last request parsed (llhttp checks some of its
            # framing once the head is complete): that request is the broken one.
            last = parsed[-1]
            if last.error is None:
                last.error = error
            last.fatal = True
            last.keep_alive = False
            self._hand_on()
            return
        self._hand_on()
        req = Request(self._loop.time())
        req.error = error
        req.fatal = True
        self.phase = C_BUSY
        self._clear_deadline()
        self._queue(req)

    def _on_upgrade(self, rest: bytes) -> None:
        self.upgraded = True
        self.tunnel_buf += rest
        self.cur = None
        self.phase = C_BUSY
        self._clear_deadline()

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def _close(self) -> None:
        self.closed = True
        self._stop_timer()
        if self.transport is not None:
            self.transport.close()

    def _abort(self) -> None:
        self.closed = True
        self._stop_timer()
        if self.transport is not None:
            self.transport.abort()

    @property
    def idle(self) -> bool:
        """No request in progress: nothing read of one, nothing being answered."""
        return self.up is None and not self.reqs and self.cur is None and not self.in_head

    def shutdown(self) -> None:
        """Close now if idle; otherwise after the answer in progress."""
        self.shutting_down = True
        if (
            self.up is None
            and not self.reqs
            and self.cur is None
            and not self.in_head
            and self.waiter is not None
        ):
            self._close()

    # what the subclass does with the requests (proxy.forward.Client)

    def _queue(self, req: Request) -> None:
        """Answer `req` after the requests before it. Its body may still be arriving; one with
        an `error` is answered with that error."""
        raise NotImplementedError

    async def _serve(self) -> None:
        """The connection's task (started once the connection is accepted)."""
        raise NotImplementedError


def _parser_reason(exc: Exception) -> str:
    return str(exc) or type(exc).__name__
