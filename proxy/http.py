"""The proxy's data plane: an asyncio HTTP/1.1 reverse proxy.

Each client connection is an `asyncio.Protocol` whose parser (httptools, i.e. llhttp: the
fastest of the candidates measured in bench/proxy_bench.py) turns bytes into requests; one task
per connection takes them in order, asks the router for a backend, and hands each request to a
pooled upstream connection. Everything after that is callbacks: the upstream's parser writes
the response head and body straight to the client transport as they arrive, so a body is never
held whole, and flow control is the transports' own (a full write buffer on one side pauses
reading on the other). When the exchange ends, `_Client.exchange_done` releases the machine
and pools the connection, still in the callback.

Why a protocol and not streams: each event-loop turn costs about as much as all the HTTP work
of a request, so a request should take as few as possible. Through the task it costs one
wake-up; when the router offers the optional `try_acquire` (a non-waiting `acquire`) and a
pooled connection is idle, none: the request goes out from the parser callback.

Timeouts use one lazily re-armed timer per connection: each phase only moves a deadline, and
the timer, when it fires, re-arms itself if the deadline moved on.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from collections.abc import Callable
from typing import Final, cast

import httptools
import structlog
from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind, Tracer, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from proxy.deadline import Timed
from proxy.errors import BadRequest, BodyTooLarge, HeadersTooLarge, ProxyError, UnknownApp
from proxy.exchange import (
    O_BAD_RESPONSE,
    O_CLIENT_ERROR,
    O_CLIENT_GONE,
    O_DONE,
    O_DONE_CLOSE,
    O_LOST,
    O_MACHINE_LOST,
    O_TIMEOUT,
    O_UPGRADED,
    PAUSE_BUFFER,
    PAUSE_DEAD,
    PAUSE_QUEUE,
    Request,
    Traced,
)
from proxy.limits import Limits
from proxy.routing import Backend, Router
from proxy.stats import Stats
from proxy.upstream import Pool, Upstream
from proxy.wire import (
    CHUNK_END,
    CRLF,
    OVERLOADED,
    REQ_SPECIAL,
    REQ_SPECIAL_TRACED,
    error_response,
)

log = structlog.get_logger("proxy.http")


_W3C: Final = TraceContextTextMapPropagator()
_CONNECTION_TOKENS: Final = frozenset({b"close", b"keep-alive", b"upgrade"})
_IDEMPOTENT: Final = frozenset({b"GET", b"HEAD"})
_QUEUE_MAX: Final = 16  # pipelined requests parsed ahead before reading pauses


# Client connection phases (what its deadline is for).
_C_BUSY: Final = 0  # a request is complete and being answered: no read deadline
_C_HEAD: Final = 1
_C_BODY: Final = 2
_C_IDLE: Final = 3


class _RequestError(Exception):
    """Raised from a parser callback to stop parsing; the error is in `error`."""

    def __init__(self, error: ProxyError) -> None:
        super().__init__(str(error))
        self.error = error


# -- client: one connection from outside ------------------------------------------------------


class _Client(Timed):
    """A client connection: parses its requests and answers them in order."""

    __slots__ = (
        "backend",
        "closed",
        "cur",
        "dead",
        "fed_other",
        "h_chunked",
        "h_cl",
        "h_conn_extra",
        "h_hosts",
        "h_ka",
        "h_parts",
        "h_traceparent",
        "h_tracestate",
        "h_upgrade",
        "h_xff",
        "head_exact",
        "head_raw",
        "host",
        "in_head",
        "limits",
        "parser",
        "paused",
        "peer",
        "phase",
        "pin",
        "pin_name",
        "proxy",
        "req_special",
        "reqs",
        "shutting_down",
        "task",
        "transport",
        "tunnel",
        "tunnel_buf",
        "up",
        "upgraded",
        "url",
        "waiter",
        "write_stalled",
        "xff_line",
    )

    def __init__(self, proxy: HttpProxy) -> None:
        self._init_timer(proxy._loop)
        self.proxy = proxy
        self.limits = proxy.limits
        self.pin_name = proxy._pin_header
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.peer = b"unknown"
        self.xff_line = _forwarded_line(self.peer)
        self.reqs: deque[Request] = deque()
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
        self.phase = _C_HEAD
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
        # the upstream head: the request line (method and target filled in at its end), then
        # the headers as they come
        self.h_parts: list[bytes] = [b"", b" ", b"", b" HTTP/1.1\r\n"]
        self.h_ka = False
        self.h_cl = -1
        self.h_chunked = False
        self.h_hosts = 0
        self.h_xff: bytes | None = None
        self.h_upgrade = b""
        self.h_conn_extra: list[bytes] | None = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, though they are one.
        self.transport = transport = cast(asyncio.Transport, transport)
        proxy = self.proxy
        if proxy._closing or len(proxy._conns) >= self.limits.max_connections:
            self.closed = True
            transport.write(OVERLOADED)
            transport.close()
            return
        proxy._conns.add(self)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and peer:
            self.peer = str(peer[0]).encode()
            self.xff_line = _forwarded_line(self.peer)
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
            return
        except httptools.HttpParserCallbackError as exc:
            context = exc.__context__
            if isinstance(context, _RequestError):
                self._fail(context.error)
            else:
                log.warning("proxy_parser_callback_failed", exc_info=exc)
                self._fail(BadRequest("malformed request"))
            return
        except httptools.HttpParserError as exc:
            self._fail(BadRequest(f"malformed request: {_parser_reason(exc)}"))
            return
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
        elif self.phase == _C_BODY:
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
        if self.phase == _C_BUSY:
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
        if self.paused and phase in (_C_HEAD, _C_BODY):
            self._set_deadline(self.limits.body_timeout)  # it is us who stopped reading
            return
        if phase == _C_IDLE:
            self._close()
        elif phase == _C_HEAD:
            if self.up is None and not self.reqs and self.in_head:
                self._write(
                    error_response(408, "request head not received in time", keep_alive=False)
                )
            self._close()
        elif phase == _C_BODY:
            if self.up is None or not self.up.got_head:
                self._write(error_response(408, "request body stalled", keep_alive=False))
            self._abort()

    # httptools callbacks

    def on_message_begin(self) -> None:
        self.in_head = True
        self.head_raw = 0
        self.head_exact = 0
        if self.phase != _C_HEAD:
            self.phase = _C_HEAD
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
            elif lname == b"content-length":
                self.h_cl = int(value)  # llhttp has checked it is digits
            elif lname == b"transfer-encoding":
                self.h_chunked = True  # llhttp rejects a request whose last coding is not chunked
                return
            elif lname == b"x-forwarded-for":
                xff = self.h_xff
                self.h_xff = value if xff is None else xff + b", " + value
                return
            elif lname == b"connection":
                for token in value.split(b","):
                    token = token.strip().lower()
                    if token == b"keep-alive":
                        self.h_ka = True
                    elif token and token not in _CONNECTION_TOKENS:
                        if self.h_conn_extra is None:
                            self.h_conn_extra = []
                        self.h_conn_extra.append(token)
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
            else:
                return  # other hop-by-hop headers, and X-Forwarded-Proto/Host: ours replace them
        elif lname == self.pin_name:
            self.pin = value
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
        # An HTTP/1.0 request keeps the connection only if it says keep-alive: otherwise
        # the (slower) version check is not needed.
        req.http10 = (self.h_ka or not keep_alive) and parser.get_http_version() == "1.0"
        req.keep_alive = keep_alive and not self.shutting_down
        req.upgrade = parser.should_upgrade()
        req.chunked = self.h_chunked
        cl = self.h_cl
        req.has_body = req.chunked or cl > 0
        host = self.host
        if self.h_hosts > 1:
            req.error = BadRequest("more than one Host header")
        elif method == b"CONNECT":
            req.error = BadRequest("CONNECT is not supported")
        elif cl > self.limits.max_body_bytes:
            req.error = BodyTooLarge(
                f"request body of {cl} bytes is over the limit of {self.limits.max_body_bytes}"
            )
        else:
            req.app = proxy._app_for(host)
            if req.app is None:
                req.error = UnknownApp(
                    f"no app at host {host.decode('latin-1')!r}: expected <app>.{proxy.domain}"
                )
            elif self.pin is not None:
                req.pinned = self.pin.decode("latin-1").strip() or None
            req.retryable = method in _IDEMPOTENT and not req.has_body and req.pinned is None
        if req.error is not None:
            # A bad request closes the connection after the answer; so does one whose body
            # is not going to be read.
            req.fatal = isinstance(req.error, BadRequest) or req.has_body or req.upgrade
            req.keep_alive = req.keep_alive and not req.fatal
        if req.upgrade and req.error is None:
            framing = b"connection: upgrade\r\nupgrade: " + self.h_upgrade + CRLF
        elif req.chunked:
            framing = b"transfer-encoding: chunked\r\n"
        else:
            framing = b""
        parts = self.h_parts
        parts[0] = method
        parts[2] = self.url
        if self.h_conn_extra is not None:
            parts = [_drop_headers(b"".join(parts), self.h_conn_extra)]
        xff = self.h_xff
        if xff is None:
            parts.append(self.xff_line)
        else:
            parts += (b"X-Forwarded-For: ", xff, b", ", self.xff_line[17:])
        tracer = proxy._tracer
        if tracer is None:
            parts += (host, CRLF, framing, CRLF)
        else:
            parts += (host, CRLF, framing, self._trace(req, tracer), CRLF)
        req.head = b"".join(parts)
        self._reset_head()
        if req.has_body and req.error is None:
            self.cur = req
            req.body_buf = []
            self.phase = _C_BODY
            self._set_deadline(self.limits.body_timeout)
        else:
            req.complete = not req.has_body
            self.phase = _C_BUSY
            self._deadline = math.inf  # (_clear_deadline, inlined)
            if req.fatal:
                self.dead = True
                self._pause(PAUSE_DEAD)
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
        if self.phase == _C_BODY:
            self.phase = _C_BUSY
            self._clear_deadline()
        if req.chunked:
            sink = req.sink
            if sink is not None:
                sink.send_body(CHUNK_END)
            elif req.body_buf is not None:
                req.body_buf.append(CHUNK_END)
        req.sink = None

    # requests in, answers out

    def _queue(self, req: Request) -> None:
        reqs = self.reqs
        if (
            self.waiter is not None  # the task is idle, so nothing is ahead of `req`
            and not reqs
            and self.proxy._try_acquire is not None
            and self._start_now(req)
        ):
            return
        reqs.append(req)
        if len(reqs) > _QUEUE_MAX:
            self._pause(PAUSE_QUEUE)
        if self.up is None:  # else exchange_done wakes the task when the answer is out
            self._wake()

    def _start_now(self, req: Request) -> bool:
        """The fast path: when the router can name a machine at once and a pooled connection
        to it is idle, send `req` from this callback, without waking the task (a task switch
        is an event-loop turn: at moderate load, a good part of a request's cost)."""
        if req.error is not None or req.upgrade or req.app is None or self.closed:
            return False
        try_acquire = self.proxy._try_acquire
        assert try_acquire is not None
        traced = req.trace
        token = None if traced is None else otel_context.attach(traced.context)
        try:
            # With the span current, a machine started for it (scale from zero) is its child.
            backend = try_acquire(req.app, pinned=req.pinned, exclude=frozenset())
        except Exception:  # the task's acquire says why, with the router's own error
            return False
        finally:
            if token is not None:
                otel_context.detach(token)
        if backend is None:
            return False
        up = self.proxy._pool.take(backend)
        if up is None:
            req.backend = backend  # acquired: the task only connects
            return False
        self.backend = backend
        up.begin(self, req)
        return True

    def _fail(self, error: ProxyError) -> None:
        """The request stream is broken: answer `error` after what is queued, then close."""
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
            return
        req = Request(self._loop.time())
        req.error = error
        req.fatal = True
        self.phase = _C_BUSY
        self._clear_deadline()
        self._queue(req)

    def _on_upgrade(self, rest: bytes) -> None:
        self.upgraded = True
        self.tunnel_buf += rest
        self.cur = None
        self.phase = _C_BUSY
        self._clear_deadline()

    def start_tunnel(self, up: Upstream) -> None:
        """The machine accepted the upgrade: splice bytes both ways until either side closes."""
        self.tunnel = up
        self.up = up
        assert up.transport is not None
        if self.tunnel_buf:
            up.transport.write(bytes(self.tunnel_buf))
            self.tunnel_buf.clear()
        self.paused = 0
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()
        req = up.req
        if req is not None:
            self._answered(req, 101, self._loop.time(), up.backend.machine_id)

    async def _serve(self) -> None:
        """Take requests in order and start each exchange; the exchange itself runs in
        callbacks and ends in `exchange_done`, so a request costs this task one wake-up."""
        reqs = self.reqs
        try:
            while not self.closed:
                if self.up is not None or not reqs:
                    if self.up is None and self.shutting_down:
                        self._close()
                        return
                    waiter = self.waiter = self._loop.create_future()
                    try:
                        await waiter
                    finally:
                        self.waiter = None
                    continue
                req = reqs.popleft()
                if self.paused & PAUSE_QUEUE and len(reqs) < _QUEUE_MAX:
                    self._resume(PAUSE_QUEUE)
                try:
                    await self._start(req)
                except asyncio.CancelledError:
                    if req.trace is not None:  # gone while waiting for a machine
                        req.trace.abandon()
                        req.trace = None
                    raise
        except asyncio.CancelledError:
            self._abort()  # the client went away (or shutdown ran out of grace)
        except Exception:
            log.warning("proxy_connection_failed", peer=self.peer, exc_info=True)
            self._abort()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _start(self, req: Request) -> None:
        """Find a machine for `req` and hand the request to a connection to it (or answer
        with the error)."""
        if req.error is not None or (req.upgrade and not self.upgraded):
            if req.backend is not None:  # acquired by the fast path: not going to be used
                self.proxy.router.release(req.backend, ok=False)
                req.backend = None
            if req.error is not None:
                self._after(self._reply_error(req, req.error.status, str(req.error)))
            else:
                self._after(self._reply_error(req, 400, "bad upgrade request"))
            return
        app = req.app
        assert app is not None
        proxy = self.proxy
        router = proxy.router
        exclude: frozenset[str] = frozenset()
        attempts = 0
        while True:
            backend = req.backend
            if backend is None:
                traced = req.trace
                token = None if traced is None else otel_context.attach(traced.context)
                try:
                    backend = await router.acquire(app, pinned=req.pinned, exclude=exclude)
                except ProxyError as err:
                    self._after(self._reply_error(req, err.status, str(err)))
                    return
                except Exception:
                    log.warning("proxy_router_failed", app=app, exc_info=True)
                    self._after(self._reply_error(req, 502, "routing failed"))
                    return
                finally:
                    if token is not None:
                        otel_context.detach(token)
            else:
                req.backend = None  # a replay after a stale pooled connection: acquired already
            up: Upstream | None = None
            handed = connect_failed = False
            try:
                if req.error is None and not self.closed:
                    if not req.replay:
                        up = proxy._pool.take(backend)
                    if up is None:
                        up = await self._connect(backend)
                        connect_failed = up is None
                    if up is not None and not self.closed:
                        self.backend = backend
                        up.begin(self, req)
                        handed = True
                        return
            finally:
                if not handed:
                    if up is not None:
                        up.abort()
                    router.release(backend, ok=False, connect_failed=connect_failed)
            if req.error is not None:  # the body went over the limit while we waited
                self._after(self._reply_error(req, req.error.status, str(req.error)))
                return
            if not connect_failed:
                return  # the client is gone
            if req.retryable and attempts < self.limits.max_retries:
                attempts += 1
                exclude = exclude | {backend.machine_id}
                continue
            self._after(
                self._reply_error(
                    req,
                    502,
                    f"could not connect to machine {backend.machine_id}",
                    machine_id=backend.machine_id,
                )
            )
            return

    def exchange_done(self, up: Upstream, req: Request, outcome: int) -> None:
        """The exchange on `up` is over: release the machine, pool or drop the connection,
        answer with an error if the machine gave no answer, and go on (or close)."""
        proxy = self.proxy
        backend = self.backend
        assert backend is not None
        if self.up is up:
            self.up = None
        now = self._loop.time()
        if (
            outcome == O_LOST
            and up.reused
            and not up.got_head
            and req.retryable
            and not self.closed
        ):
            # The pooled connection died under us (the machine closed it while idle): replay
            # the safe request once, on a fresh connection to the same machine.
            up.abort()
            req.backend = backend
            req.replay = True
            req.retryable = False
            self.reqs.appendleft(req)
            self._wake()
            return
        if (
            outcome == O_MACHINE_LOST
            and not up.got_head
            and req.retryable
            and req.complete
            and not req.moved
            and not self.closed
        ):
            # A safe request whose machine was lost before it answered: send it once more,
            # to whatever the router picks now (the lost machine's standby, once started).
            up.abort()
            self.backend = None
            proxy.router.release(backend, ok=False)
            req.moved = True
            self.reqs.appendleft(req)
            self._wake()
            return
        self.backend = None
        if outcome == O_DONE and not proxy._closing and not self.closed:
            proxy._pool.put(up, now)
        elif outcome in (O_DONE, O_DONE_CLOSE):
            up.close()  # the exchange went well: a graceful close
        else:
            up.abort()
        proxy.router.release(backend, ok=up.got_head, connect_failed=False)
        machine_id = backend.machine_id
        if self.closed:
            if req.trace is not None:
                req.trace.abandon()
            return
        if outcome in (O_DONE, O_DONE_CLOSE):
            # (`_answered`, inlined on the path every request takes)
            proxy.stats.record(req.app, up.status, now - req.started)
            if req.trace is not None:
                self._answered_traced(req, up.status, machine_id)
            keep = up.keep_client
        elif outcome == O_UPGRADED:
            keep = False
        elif up.got_head:  # the response is cut short: the client sees a truncated body
            self._answered(req, up.status, now, machine_id)
            keep = False
        elif outcome == O_TIMEOUT:
            keep = self._reply_error(
                req, 504, f"machine {machine_id} did not answer in time", now, machine_id
            )
        elif outcome == O_CLIENT_ERROR and req.error is not None:
            keep = self._reply_error(req, req.error.status, str(req.error), now)
        elif outcome == O_MACHINE_LOST:
            keep = self._reply_error(
                req, 502, f"machine {machine_id} was lost before it answered", now, machine_id
            )
        elif outcome == O_BAD_RESPONSE:
            keep = self._reply_error(
                req, 502, f"machine {machine_id} sent an invalid response", now, machine_id
            )
        else:
            keep = self._reply_error(
                req,
                502,
                f"machine {machine_id} closed the connection without a response",
                now,
                machine_id,
            )
        self._after(keep, now)

    async def _connect(self, backend: Backend) -> Upstream | None:
        proxy = self.proxy
        try:
            async with asyncio.timeout(self.limits.upstream_connect_timeout):
                _, protocol = await self._loop.create_connection(
                    lambda: Upstream(proxy, backend), backend.host, backend.port
                )
        except (OSError, TimeoutError) as exc:
            log.debug("proxy_connect_failed", machine_id=backend.machine_id, error=str(exc))
            return None
        assert isinstance(protocol, Upstream)
        return protocol

    def _reply_error(
        self,
        req: Request,
        status: int,
        reason: str,
        now: float | None = None,
        machine_id: str | None = None,
    ) -> bool:
        """Answer `req` with an error of ours; whether the connection can go on."""
        keep = (
            req.keep_alive
            and req.complete
            and not req.fatal
            and not self.dead
            and not self.upgraded
            and not self.proxy._closing
        )
        self._write(
            error_response(
                status, reason, keep_alive=keep, head_only=req.is_head, http10=req.http10
            )
        )
        self._answered(req, status, self._loop.time() if now is None else now, machine_id)
        return keep

    def _answered(self, req: Request, status: int, now: float, machine_id: str | None) -> None:
        """`req` got its answer (the head of it, at least): count it, end its span."""
        self.proxy.stats.record(req.app, status, now - req.started)
        if req.trace is not None:
            self._answered_traced(req, status, machine_id)

    @staticmethod
    def _answered_traced(req: Request, status: int, machine_id: str | None) -> None:
        traced = req.trace
        if traced is not None:
            req.trace = None
            traced.end(status, machine_id)

    def _after(self, keep: bool, now: float | None = None) -> None:
        """An answer is written: close, go on with the next request, or wait for one."""
        if not keep or self.proxy._closing:
            self._close()
        elif self.reqs:
            self._wake()
        elif self.cur is None and not self.in_head and not self.dead:
            self.phase = _C_IDLE
            if now is None:
                now = self._loop.time()
            self._set_deadline_at(now + self.limits.idle_keepalive)

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


def _drop_headers(buf: bytes, names: list[bytes]) -> bytes:
    """`buf` without the header lines whose (lowercased) names are in `names`."""
    drop = set(names)
    out = bytearray()
    for line in buf.split(CRLF):
        if line and line.split(b":", 1)[0].strip().lower() not in drop:
            out += line
            out += CRLF
    return bytes(out)


def _forwarded_line(peer: bytes) -> bytes:
    """The X-Forwarded-* lines for a client at `peer`, up to the value of X-Forwarded-Host."""
    return b"X-Forwarded-For: " + peer + b"\r\nX-Forwarded-Proto: http\r\nX-Forwarded-Host: "


def _parser_reason(exc: Exception) -> str:
    return str(exc) or type(exc).__name__


# -- the proxy -------------------------------------------------------------------------------


class HttpProxy:
    """The edge's HTTP/1.1 data plane: routes `<app>.<domain>` to the app's machines.

    `router` chooses machines (see proxy.routing); `stats` counts what happens. Responses name
    the machine that served them in `machine_header`; a request may ask for one machine with
    `pin_header`. If the router also has `try_acquire(app, *, pinned, exclude) -> Backend |
    None` (what `acquire` would return without waiting, or None if it would wait), requests
    start without a task switch. Create it inside the running event loop.
    """

    def __init__(
        self,
        router: Router,
        stats: Stats,
        *,
        domain: str,
        region: str,
        limits: Limits = Limits(),
        machine_header: str = "nonomad-machine-id",
        pin_header: str = "nonomad-force-instance-id",
        tracer: Tracer | None = None,
    ) -> None:
        self.router = router
        # Optional fast path: `try_acquire(app, *, pinned, exclude) -> Backend | None`, the
        # same as `acquire` when it would not wait, None when it would.
        self._try_acquire: Callable[..., Backend | None] | None = getattr(
            router, "try_acquire", None
        )
        self.stats = stats
        self.domain = domain.lower().strip(".")
        self.region = region
        self.limits = limits
        self.machine_header = machine_header
        self.pin_header = pin_header
        self._suffix = b"." + self.domain.encode("ascii")
        self._pin_header = pin_header.lower().encode("ascii")
        self._machine_header = machine_header.encode("ascii")
        self._machine_lines: dict[str, bytes] = {}
        self._apps: dict[bytes, str | None] = {}
        self._loop = asyncio.get_running_loop()
        self._pool = Pool(limits.pool_size_per_backend, limits.upstream_idle_timeout)
        self._conns: set[_Client] = set()
        self._server: asyncio.Server | None = None
        self._closing = False
        self._all_closed: asyncio.Event | None = None
        # Tracing: a SERVER span per request when a tracer is given; without one, the only
        # cost per request is a None check.
        self._tracer = tracer
        self._req_special = REQ_SPECIAL if tracer is None else REQ_SPECIAL_TRACED

    async def serve(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        """Listen on host:port (0: any free port); returns the address bound."""
        self._server = await self._loop.create_server(
            lambda: _Client(self), host, port, backlog=1024, reuse_address=True
        )
        sockname = self._server.sockets[0].getsockname()
        return str(sockname[0]), int(sockname[1])

    async def close(self, grace: float = 10.0) -> None:
        """Stop accepting; close idle connections now; give requests in flight `grace` seconds
        to finish, then cut what is left."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        self._all_closed = asyncio.Event()
        for conn in list(self._conns):
            conn.shutdown()
        if self._conns:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace):
                    await self._all_closed.wait()
        tasks = [conn.task for conn in self._conns if conn.task is not None]
        for conn in list(self._conns):
            conn._abort()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._pool.close()
        if self._server is not None:
            await self._server.wait_closed()

    def machines_lost(self, machine_ids: frozenset[str], reason: str = "") -> int:
        """End at once the exchanges in flight to these machines (their worker is dead):
        a GET or HEAD that got no answer yet is sent again elsewhere, others get a 502, and
        responses cut short end their client connection. Idle pooled connections to them
        are closed. Returns how many exchanges were ended. Callable from any callback."""
        self._pool.drop(machine_ids)
        lost = [
            conn.up
            for conn in self._conns
            if conn.up is not None and conn.up.backend.machine_id in machine_ids
        ]
        for up in lost:
            up.lose()
        if lost:
            log.warning(
                "proxy_requests_lost",
                machines=sorted(machine_ids),
                requests=len(lost),
                reason=reason,
            )
        return len(lost)

    @property
    def connections(self) -> int:
        """Client connections open now."""
        return len(self._conns)

    @property
    def idle_upstream_connections(self) -> int:
        return self._pool.idle_count()

    # for the connections

    def _conn_closed(self, conn: _Client) -> None:
        self._conns.discard(conn)
        if not self._conns and self._all_closed is not None:
            self._all_closed.set()

    def _app_for(self, host: bytes) -> str | None:
        apps = self._apps
        try:
            return apps[host]
        except KeyError:
            pass
        app = self._parse_host(host)
        if len(apps) >= 4096:
            apps.clear()
        apps[host] = app
        return app

    def _parse_host(self, host: bytes) -> str | None:
        name = host.strip().lower()
        if name.startswith(b"["):
            return None  # an IP literal names no app
        name = name.rsplit(b":", 1)[0] if b":" in name else name
        name = name.rstrip(b".")
        suffix = self._suffix
        if not name.endswith(suffix):
            return None
        app = name[: -len(suffix)]
        if not app or b"." in app or not app.isascii():
            return None
        return app.decode("ascii")

    def _machine_line(self, backend: Backend) -> bytes:
        try:
            return self._machine_lines[backend.machine_id]
        except KeyError:
            pass
        line = self._machine_header + b": " + backend.machine_id.encode("latin-1") + CRLF
        if len(self._machine_lines) >= 4096:
            self._machine_lines.clear()
        self._machine_lines[backend.machine_id] = line
        return line
