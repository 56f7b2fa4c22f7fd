"""The machine side of the data plane: one connection to a machine (`Upstream`) and the idle
ones kept per machine (`Pool`).

An `Upstream` carries one exchange at a time. It writes the request head and what of the body
has arrived; its response parser (httptools) then writes the response head and body straight to
the client transport as they arrive, so a body is never held whole, and flow control is the
transports' own (a full write buffer on one side pauses reading on the other). When the exchange
ends it tells the client connection how (`Downstream.exchange_done`), still in the callback.
It knows the client connection and the proxy only as the Protocols `Downstream` and `Owner`.

A machine's response is framed anew as well: the client gets a Content-Length the edge wrote
from the one llhttp parsed (which refuses duplicate ones and Content-Length beside
Transfer-Encoding), or a body the edge chunked itself; the headers the machine's Connection names
are dropped. A connection goes back to the pool only when the exchange ended exactly: the request
sent whole, the response read to its end and nothing after it (bytes beyond a response, or a
transfer coding other than chunked, end the connection), so no byte of one exchange is read as
part of another's.

The pool also caps the connections open to each machine (`Pool.opening`): a request that finds
its machine at the cap waits for one of them to come free (`Pool.wait`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from typing import Final, Protocol, cast

import httptools

from proxy.deadline import Timed
from proxy.exchange import (
    O_BAD_RESPONSE,
    O_DONE,
    O_DONE_CLOSE,
    O_LOST,
    O_MACHINE_LOST,
    O_TIMEOUT,
    O_UPGRADED,
    PAUSE_BUFFER,
    PAUSE_UPSTREAM,
    Request,
)
from proxy.limits import Limits
from proxy.routing import Backend
from proxy.wire import (
    CHUNK_END,
    CRLF,
    RESP_SPECIAL,
    STATUS_LINES,
    connection_options,
    drop_headers,
)

# Upstream connection phases.
_U_POOLED: Final = 0
_U_WAIT_HEAD: Final = 1
_U_BODY: Final = 2
_U_TUNNEL: Final = 3


class Owner(Protocol):
    """What an upstream connection reads of the proxy that made it (proxy.http.HttpProxy)."""

    limits: Limits
    _loop: asyncio.AbstractEventLoop
    _pool: Pool
    _closing: bool

    def _machine_line(self, backend: Backend) -> bytes: ...


class Downstream(Protocol):
    """The client connection an exchange answers (proxy.forward.Client), as its upstream
    connection sees it."""

    transport: asyncio.Transport | None
    up: Upstream | None
    paused: int
    dead: bool

    def _pause(self, reason: int) -> None: ...

    def _resume(self, reason: int) -> None: ...

    def exchange_done(self, up: Upstream, req: Request, outcome: int) -> None: ...

    def start_tunnel(self, up: Upstream) -> None: ...


class _BadResponse(Exception):
    """Raised from a parser callback: the machine's response cannot be passed on safely."""


class Upstream(Timed):
    """A connection to one machine: idle in the pool, or carrying one exchange at a time. It
    is counted in its pool's cap from its opening (`Pool.opening`) until it is lost."""

    __slots__ = (
        "backend",
        "client",
        "closed",
        "counted",
        "eof_body",
        "got_head",
        "hparts",
        "in_head",
        "interim",
        "keep_client",
        "machine_line",
        "no_body",
        "parser",
        "parser_dirty",
        "pending",
        "phase",
        "pool",
        "proxy",
        "read_paused",
        "rechunk",
        "req",
        "resp_cl",
        "resp_close",
        "resp_drop",
        "resp_te",
        "resp_upgrade",
        "reused",
        "status",
        "transport",
    )

    def __init__(self, proxy: Owner, backend: Backend) -> None:
        self._init_timer(proxy._loop)
        self.proxy = proxy
        self.pool = proxy._pool
        self.backend = backend
        self.machine_line = proxy._machine_line(backend)
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.parser_dirty = False
        self.closed = False
        self.client: Downstream | None = None
        self.req: Request | None = None
        self.phase = _U_POOLED
        self.read_paused = False
        self.reused = False
        self.counted = True
        self._reset_response()

    def _reset_response(self) -> None:
        self.status = 0
        self.got_head = False
        self.in_head = False
        self.interim = False
        self.hparts: list[bytes] = [b""]  # the status line goes first, when it is known
        self.resp_cl = -1
        self.resp_te = False
        self.resp_close = False
        self.resp_drop: list[bytes] | None = None  # headers its Connection names
        self.resp_upgrade = b""
        self.keep_client = False
        self.no_body = False
        self.eof_body = False
        self.rechunk = False
        self.pending: bytes | None = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, though they are one.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        client = self.client
        if self.phase == _U_TUNNEL:
            if client is not None and client.transport is not None:
                client.transport.write(data)
            return
        if client is None:  # bytes nobody asked for, on an idle connection
            self.abort()
            return
        if self.phase == _U_BODY:
            self._set_deadline(self.proxy.limits.read_timeout)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._start_tunnel(data[exc.args[0] :])
            return
        except httptools.HttpParserError:
            self._flush_pending()
            self._finish(O_BAD_RESPONSE)
            self.abort()
            return
        if self.pending is not None:
            self._flush_pending()
        if self.req is None and self.no_body and client is not None:
            # A HEAD (or similar) response ended at its head; llhttp expected a body, so the
            # next exchange gets a fresh parser.
            self.parser_dirty = True

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost does the rest

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_timer()
        self.pool.discard(self)
        self.uncount()
        client = self.client
        if self.phase == _U_TUNNEL:
            if client is not None and client.transport is not None:
                client.transport.close()
            self._finish(O_UPGRADED)
            return
        if self.req is not None:
            if self.got_head and self.eof_body and exc is None:
                # A body delimited by the connection closing has ended.
                self._send_to_client(CHUNK_END if self.rechunk else b"")
                self._finish(O_DONE_CLOSE)
            else:
                self._flush_pending()
                self._finish(O_LOST)

    def pause_writing(self) -> None:
        client = self.client
        if client is not None:
            client._pause(PAUSE_UPSTREAM)

    def resume_writing(self) -> None:
        client = self.client
        if client is not None:
            client._resume(PAUSE_UPSTREAM)

    # the exchange

    def begin(self, client: Downstream, req: Request) -> None:
        """Send `req` (and what of its body has arrived); the client hears of the outcome
        through `Client.exchange_done`."""
        assert self.transport is not None
        if self.parser_dirty:
            self.parser = httptools.HttpResponseParser(self)
            self.parser_dirty = False
        self._reset_response()
        self.client = client
        self.req = req
        client.up = self
        buf = req.body_buf
        req.body_buf = None
        if buf:
            self.transport.write(b"".join((req.head, *buf)))
            client._resume(PAUSE_BUFFER)
        else:
            self.transport.write(req.head)
        if not req.complete:
            req.sink = self
        self.phase = _U_WAIT_HEAD
        self._set_deadline_at(self._loop.time() + self.proxy.limits.upstream_response_timeout)

    def send_body(self, framed: bytes) -> None:
        assert self.transport is not None
        self.transport.write(framed)
        if self.phase == _U_WAIT_HEAD:
            self._set_deadline(self.proxy.limits.upstream_response_timeout)

    def _finish(self, outcome: int) -> None:
        """The exchange is over (from this side): tell the client."""
        req = self.req
        if req is None:
            return
        self.req = None
        self._deadline = math.inf  # (_clear_deadline, inlined: every request comes here)
        if req.sink is self:
            req.sink = None
        client = self.client
        if client is not None and self.phase != _U_TUNNEL:
            client.up = None
            if client.paused & PAUSE_UPSTREAM:
                client._resume(PAUSE_UPSTREAM)
            if not req.complete:
                client.dead = True  # the rest of its body has nowhere to go
        if self.read_paused and self.transport is not None:
            self.read_paused = False
            self.transport.resume_reading()
        if client is not None:
            client.exchange_done(self, req, outcome)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def uncount(self) -> None:
        """Leave the pool's count of connections to the machine (once: when lost, or when
        its opening failed)."""
        if self.counted:
            self.counted = False
            self.pool.closed(self.backend.machine_id)

    def abort(self) -> None:
        """Close this connection now (its exchange, if any, failed)."""
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def lose(self) -> None:
        """The machine is gone (its worker was declared dead): end the exchange now rather
        than wait for a timeout; the client decides whether to send the request elsewhere."""
        if self.phase == _U_TUNNEL:
            self.abort()  # connection_lost closes the client side
            return
        self._flush_pending()
        self._finish(O_MACHINE_LOST)
        self.abort()

    def _start_tunnel(self, rest: bytes) -> None:
        client = self.client
        req = self.req
        if self.status != 101 or client is None or req is None or not req.upgrade:
            self._flush_pending()
            self._finish(O_BAD_RESPONSE)
            self.abort()
            return
        self._flush_pending()
        assert client.transport is not None
        assert self.transport is not None
        if rest:
            client.transport.write(rest)
        self.phase = _U_TUNNEL
        self._clear_deadline()
        client.start_tunnel(self)

    def _flush_pending(self) -> None:
        pending = self.pending
        if pending is not None:
            self.pending = None
            client = self.client
            if client is not None and client.transport is not None:
                client.transport.write(pending)

    def _send_to_client(self, data: bytes) -> None:
        pending = self.pending
        if pending is not None:
            self.pending = None
            data = pending + data
        client = self.client
        if data and client is not None and client.transport is not None:
            client.transport.write(data)

    def _expired(self) -> None:
        phase = self.phase
        if phase == _U_POOLED:
            self.abort()
        elif self.read_paused:  # the client is slow, not the machine: its own timer judges
            self._set_deadline(self.proxy.limits.read_timeout)
        elif phase in (_U_WAIT_HEAD, _U_BODY):
            self._flush_pending()
            self._finish(O_TIMEOUT)
            self.abort()

    # httptools callbacks

    def on_message_begin(self) -> None:
        if self.req is None:
            # A response begins after the exchange ended: the machine sent more than the
            # length it gave. Read on, it would answer the next request on this connection.
            raise _BadResponse("bytes after the end of a response")
        self.in_head = True  # (begin, or an interim response's end, reset the rest)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.in_head:
            return  # trailers: dropped
        lname = name.lower()
        if lname in RESP_SPECIAL:
            if lname == b"content-length":
                # llhttp has checked it: digits, one header, no Transfer-Encoding beside it.
                # The edge writes its own, from this.
                self.resp_cl = int(value)
                return
            elif lname == b"transfer-encoding":
                if value.lower() != b"chunked":
                    codings = [c.strip(b" \t").lower() for c in value.split(b",")]
                    if any(c and c != b"chunked" for c in codings):
                        # The body would reach the client without its coding, framed anew.
                        raise _BadResponse("a transfer coding other than chunked")
                self.resp_te = True
                return
            elif lname == b"connection":
                lvalue = value.lower()
                if lvalue == b"keep-alive":
                    return
                if lvalue == b"close":
                    self.resp_close = True
                    return
                try:
                    options = connection_options(value)
                except ValueError:
                    raise _BadResponse("a malformed Connection header") from None
                for option in options:
                    if option == b"close":
                        self.resp_close = True
                    elif option != b"keep-alive" and option != b"upgrade":
                        if self.resp_drop is None:
                            self.resp_drop = []
                        self.resp_drop.append(option)
                return
            elif lname == b"upgrade":
                self.resp_upgrade = value
                return
            else:
                return
        self.hparts += (name, b": ", value, CRLF)

    def on_headers_complete(self) -> None:
        self.in_head = False
        req = self.req
        client = self.client
        if req is None or client is None:
            return
        status = self.parser.get_status_code()
        if status < 100:
            raise _BadResponse(f"status {status}")
        self.status = status
        if self.resp_drop is not None:
            self.hparts = drop_headers(self.hparts, self.resp_drop, 1)
            self.resp_drop = None
        if 100 <= status < 200 and status != 101:
            self.interim = True
            parts = self.hparts
            if not req.http10:
                parts[0] = STATUS_LINES.get(status, b"")
                parts.append(CRLF)
                self._send_to_client(b"".join(parts))
            self.hparts = [b""]
            self.resp_cl = -1
            self.resp_te = self.resp_close = False
            self.resp_upgrade = b""
            return
        self.interim = False
        self.got_head = True
        self.phase = _U_BODY  # each body chunk moves the deadline on (data_received)
        proxy = self.proxy
        keep = (
            req.keep_alive
            and req.complete
            and not req.upgrade
            and not client.dead
            and not proxy._closing
        )
        # The framing is the edge's own: the body it forwards is the one it parsed.
        framing = b""
        cl = self.resp_cl
        if status == 101:
            if not req.upgrade:
                keep = False
            framing = b"connection: upgrade\r\nupgrade: " + self.resp_upgrade + CRLF
        elif req.is_head or status == 204 or status == 304:
            self.no_body = True
            if cl >= 0 and status != 204:  # (the length of the body a GET would have)
                framing = b"content-length: %d\r\n" % cl
        elif self.resp_te or cl < 0:
            self.eof_body = not self.resp_te
            if req.http10:
                keep = False  # no chunked for HTTP/1.0: the body ends when we close
            else:
                self.rechunk = True
                framing = b"transfer-encoding: chunked\r\n"
        else:
            framing = b"content-length: %d\r\n" % cl
        self.keep_client = keep
        if status == 101:
            pass  # the connection becomes the tunnel: its Connection header says so
        elif not keep:
            framing += b"connection: close\r\n"
        elif req.http10:
            framing += b"connection: keep-alive\r\n"
        parts = self.hparts
        parts[0] = STATUS_LINES.get(status) or b"HTTP/1.1 %d Unknown\r\n" % status
        parts += (self.machine_line, framing, CRLF)
        self.pending = b"".join(parts)
        if self.no_body:
            self._flush_pending()
            reusable = (
                not self.resp_close and req.complete and self.parser.get_http_version() == "1.1"
            )
            if cl < 0 and not self.resp_te and status != 204 and status != 304:
                reusable = False  # llhttp would read a body up to EOF: give up on it
            self._finish(O_DONE if reusable else O_DONE_CLOSE)

    def on_body(self, data: bytes) -> None:
        if self.req is None:  # body bytes after a HEAD response: the connection is suspect
            self.resp_close = True
            self.parser_dirty = True
            self.abort()
            return
        if self.rechunk:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        self._send_to_client(data)

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        req = self.req
        if req is None or self.status == 101:
            return  # after a 101, llhttp raises HttpParserUpgrade: the tunnel starts there
        if self.rechunk:
            self._send_to_client(CHUNK_END)
        elif self.pending is not None:
            self._flush_pending()
        # Not reused when the machine answered before the request's body was all sent: it
        # would read the rest of the body from the next request.
        reusable = not self.eof_body and req.complete and self.parser.should_keep_alive()
        self._finish(O_DONE if reusable else O_DONE_CLOSE)


class Pool:
    """Idle connections per machine, newest first (they are the least likely to be stale),
    and the count of all those open to each, held under a cap."""

    __slots__ = ("_cap", "_idle", "_open", "_size", "_timeout", "_waiters")

    def __init__(self, size: int, timeout: float, cap: int) -> None:
        self._idle: dict[str, list[Upstream]] = {}
        self._size = size
        self._timeout = timeout
        self._cap = cap
        self._open: dict[str, int] = {}
        # Requests waiting for a connection to a machine at its cap, oldest first (at most
        # one per client connection, so bounded by the proxy's max_connections).
        self._waiters: dict[str, deque[asyncio.Future[None]]] = {}

    def opening(self, machine_id: str) -> bool:
        """Count a connection about to be opened to the machine: False (and nothing counted)
        when it has `cap` open already. The Upstream made leaves the count when it is lost
        (`Upstream.uncount`); if none is made, call `closed`."""
        n = self._open.get(machine_id, 0)
        if n >= self._cap:
            return False
        self._open[machine_id] = n + 1
        return True

    def closed(self, machine_id: str) -> None:
        """A connection to the machine is gone (or its opening failed): one may open now."""
        n = self._open.get(machine_id, 0) - 1
        if n > 0:
            self._open[machine_id] = n
        else:
            self._open.pop(machine_id, None)
        self._wake(machine_id)

    def open_count(self, machine_id: str) -> int:
        """Connections open or opening to the machine."""
        return self._open.get(machine_id, 0)

    async def wait(self, machine_id: str, timeout: float) -> bool:
        """Wait until a connection to the machine is pooled or closed (either lets one
        waiting request go on), at most `timeout` seconds; whether that happened."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters = self._waiters.setdefault(machine_id, deque())
        waiters.append(fut)
        woken = False
        try:
            async with asyncio.timeout(timeout):
                await fut
            woken = True
        except TimeoutError:
            woken = fut.done() and not fut.cancelled()  # woken as the time ran out
        finally:
            if not fut.done():
                fut.cancel()
            elif not woken and not fut.cancelled():
                self._wake(machine_id)  # woken, then cancelled: the next one goes instead
            with contextlib.suppress(ValueError):
                waiters.remove(fut)
            if not waiters and self._waiters.get(machine_id) is waiters:
                del self._waiters[machine_id]
        return woken

    def _wake(self, machine_id: str) -> None:
        waiters = self._waiters.get(machine_id)
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    def take(self, backend: Backend) -> Upstream | None:
        idle = self._idle.get(backend.machine_id)
        while idle:
            up = idle.pop()
            was = up.backend
            transport = up.transport
            if (
                not up.closed
                and transport is not None
                and not transport.is_closing()
                and was.port == backend.port
                and was.host == backend.host
            ):
                up.reused = True
                return up
            up.abort()
        return None

    def put(self, up: Upstream, now: float) -> None:
        if up.closed or up.transport is None or up.transport.is_closing():
            return
        idle = self._idle.setdefault(up.backend.machine_id, [])
        if len(idle) >= self._size:
            up.abort()
            return
        up.client = None
        up.phase = _U_POOLED
        up._set_deadline_at(now + self._timeout, slack=self._timeout)
        idle.append(up)
        if self._waiters:
            self._wake(up.backend.machine_id)

    def discard(self, up: Upstream) -> None:
        idle = self._idle.get(up.backend.machine_id)
        if idle and up in idle:
            idle.remove(up)
            if not idle:
                del self._idle[up.backend.machine_id]

    def drop(self, machine_ids: frozenset[str]) -> None:
        """Close the idle connections to these machines."""
        for machine_id in machine_ids:
            for up in self._idle.pop(machine_id, ()):
                up.abort()

    def close(self) -> None:
        idle, self._idle = self._idle, {}
        for ups in idle.values():
            for up in ups:
                up.abort()

    def idle_count(self) -> int:
        return sum(len(ups) for ups in self._idle.values())
