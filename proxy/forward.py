"""The client side of the data plane, answering: `Client` completes `ClientConnection`
(proxy.client) with what becomes of each request it parses.

Requests are answered in order, each by a machine the router picks (proxy.routing), over a
pooled or new connection to it (proxy.upstream). The connection's task takes them one at a time;
once a request is handed to its machine connection everything is callbacks, and the exchange
ends in `Client.exchange_done`, still in the callback: it releases the machine, pools the
connection and goes on with the next request. A GET or HEAD without a body or a pinned machine
is sent again where that is safe: to another machine when its connection is refused, once more
on a fresh connection when a pooled one turns out dead, once elsewhere when its machine is lost
(or drops the connection) before answering. Otherwise a request its machine did not answer gets
an error of the proxy's own.

Why a protocol and not streams: each event-loop turn costs about as much as all the HTTP work
of a request, so a request should take as few as possible. Through the task it costs one
wake-up; when the router offers the optional `try_acquire` (a non-waiting `acquire`) and a
pooled connection is idle, none: the request goes out from the parser callback.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final, Protocol

import structlog
from opentelemetry import context as otel_context

from proxy.client import C_IDLE, ClientConnection, Edge
from proxy.errors import Forbidden, ProxyError
from proxy.exchange import (
    O_BAD_RESPONSE,
    O_CLIENT_ERROR,
    O_DONE,
    O_DONE_CLOSE,
    O_LOST,
    O_MACHINE_LOST,
    O_TIMEOUT,
    O_UPGRADED,
    PAUSE_QUEUE,
    Request,
)
from proxy.routing import Backend
from proxy.stats import Stats
from proxy.upstream import Upstream
from proxy.wire import error_response

log = structlog.get_logger("proxy.http")  # the data plane logs under one name

_QUEUE_MAX: Final = 16  # pipelined requests parsed ahead before reading pauses
_AT_CAP: Final = object()  # (Client._machine_connection) the machine's connections stayed all busy


class Proxy(Edge, Protocol):
    """What the answering side uses of its proxy (proxy.http.HttpProxy), besides `Edge`."""

    stats: Stats
    _try_acquire: Callable[..., Backend | None] | None


class Client(ClientConnection):
    """A client connection (proxy.client) that answers its requests in order."""

    __slots__ = ()

    proxy: Proxy

    def __init__(self, proxy: Proxy) -> None:
        super().__init__(proxy)  # (typed here so that the proxy must offer `Proxy`)

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
        if req.error is not None or req.upgrade or req.app is None or self.closed or req.pin_due:
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
        if req.pin_due and req.pinned is not None and proxy._pin_check is not None:
            req.pin_due = False
            refused = await proxy._pin_check(app, req.pinned, req.pin_token)
            if refused is not None:
                self._after(self._reply_error(req, Forbidden.status, refused))
                return
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
            handed = connect_failed = at_cap = False
            try:
                if req.error is None and not self.closed:
                    got = await self._machine_connection(backend, pooled=not req.replay)
                    at_cap = got is _AT_CAP
                    up = got if isinstance(got, Upstream) else None
                    connect_failed = got is None
                    if up is not None and not self.closed and req.error is None:
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
            if at_cap and not self.closed:
                cap = self.limits.max_connections_per_machine
                log.info("proxy_machine_at_connection_cap", machine_id=backend.machine_id, cap=cap)
                self._after(
                    self._reply_error(
                        req,
                        503,
                        f"machine {backend.machine_id} has {cap} connections open, the most the "
                        "edge opens to one machine, and none came free in time",
                        machine_id=backend.machine_id,
                    )
                )
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
            outcome in (O_MACHINE_LOST, O_LOST)
            and not up.got_head
            and req.retryable
            and req.complete
            and not req.moved
            and not self.closed
        ):
            # A safe request whose machine was lost, or dropped a fresh connection, before it
            # answered (a machine killed with its host): send it once more, to whatever the
            # router picks now (the lost machine's standby, once promoted).
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

    async def _machine_connection(
        self, backend: Backend, *, pooled: bool
    ) -> Upstream | object | None:
        """A connection to `backend`: an idle pooled one (when `pooled`), or a new one if the
        machine is under the pool's cap; at the cap, the first of those to come free within
        upstream_connect_timeout. None when the machine refused or did not answer, _AT_CAP
        when nothing came free in time."""
        pool = self.proxy._pool
        machine_id = backend.machine_id
        deadline = self._loop.time() + self.limits.upstream_connect_timeout
        while True:
            if pooled:
                up = pool.take(backend)
                if up is not None:
                    return up
            if pool.opening(machine_id):
                return await self._connect(backend, deadline)
            left = deadline - self._loop.time()
            if left <= 0 or not await pool.wait(machine_id, left) or self.closed:
                return _AT_CAP
            pooled = True  # a fresh connection is only needed for a replay: any free one will do

    async def _connect(self, backend: Backend, deadline: float) -> Upstream | None:
        """Open a connection the pool has counted (`Pool.opening`) by `deadline`."""
        proxy = self.proxy
        made: list[Upstream] = []

        def upstream() -> Upstream:
            up = Upstream(proxy, backend)
            made.append(up)
            return up

        connected = False
        try:
            async with asyncio.timeout_at(deadline):
                _, protocol = await self._loop.create_connection(
                    upstream, backend.host, backend.port
                )
            connected = True
        except (OSError, TimeoutError) as exc:
            log.debug("proxy_connect_failed", machine_id=backend.machine_id, error=str(exc))
            return None
        finally:
            if not connected:  # (also when cancelled: the client went away)
                if made:
                    made[0].abort()
                    made[0].uncount()
                else:
                    proxy._pool.closed(backend.machine_id)
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
            self.phase = C_IDLE
            if now is None:
                now = self._loop.time()
            self._set_deadline_at(now + self.limits.idle_keepalive)
