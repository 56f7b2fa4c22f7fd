"""netd's forwarding: each connection accepted on a machine's published port, spliced to the
service's port on the loopback of the machine's network namespace (see `flyd.drivers.netd`).

A socket lives in the namespace its maker's thread was in when it made it, so the socket into
the machine is made inside its namespace (`enter`, netd's) and connected to 127.0.0.1 there:
an app listening on 127.0.0.1 or 0.0.0.0 alike is reached, and sees its client as 127.0.0.1.
Standard library only, like netd.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

__all__ = ["Forwarder"]

MAX_CONNECTIONS = 8192
_PIPE_HIGH_WATER = 256 << 10
_CONNECT_TIMEOUT_S = 5.0


class _Splice(asyncio.Protocol):
    """One side of a forwarded connection: what it reads, the other side writes."""

    def __init__(self, forwarder: Forwarder, *, refuse: bool = False) -> None:
        self.forwarder = forwarder
        self.refuse = refuse  # reset it as soon as it is made: nothing to forward to
        self.transport: asyncio.Transport | None = None
        self.peer: _Splice | None = None
        self.early: list[bytes] = []  # bytes read before the other side was connected
        self.eof_early = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self.refuse:
            transport.abort()
            return
        transport.set_write_buffer_limits(high=_PIPE_HIGH_WATER)

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is None or peer.transport is None:
            self.early.append(data)
            if sum(map(len, self.early)) > _PIPE_HIGH_WATER and self.transport is not None:
                self.transport.pause_reading()
            return
        peer.transport.write(data)

    def eof_received(self) -> bool:
        peer = self.peer
        if peer is None or peer.transport is None:
            self.eof_early = True
        elif peer.transport.can_write_eof():
            peer.transport.write_eof()
        return True  # keep the other direction open (half-close)

    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.forwarder.connections.discard(self)
        peer, self.peer = self.peer, None
        if peer is not None and peer.transport is not None:
            peer.peer = None
            peer.transport.close()

    def join(self, other: _Splice) -> None:
        """Link with `other` (now connected) and pass on what was read meanwhile."""
        self.peer, other.peer = other, self
        assert other.transport is not None
        assert self.transport is not None
        for chunk in self.early:
            other.transport.write(chunk)
        self.early.clear()
        if self.eof_early and other.transport.can_write_eof():
            other.transport.write_eof()
        self.transport.resume_reading()


class Forwarder:
    """The connections netd forwards. `enter(netns, work)`: `work()` run in the network
    namespace `netns`; `log(event, **fields)`: netd's log."""

    def __init__(
        self, enter: Callable[[int, Callable[[], Any]], Any], log: Callable[..., None]
    ) -> None:
        self._enter = enter
        self._log = log
        self.connections: set[_Splice] = set()

    def accepted(
        self, netns: Callable[[], int | None], internal_port: int, gone: Callable[[], None]
    ) -> asyncio.Protocol:
        """The protocol for a connection just accepted on a published port: forwarded to
        `internal_port` in the namespace `netns()` names (None: the machine is down). `gone()`
        when nothing listens there any more."""
        if netns() is None or len(self.connections) >= MAX_CONNECTIONS:
            # Nothing to forward to (the machine is stopped), or too busy: reset at once.
            return _Splice(self, refuse=True)
        client = _Splice(self)
        self.connections.add(client)
        task = asyncio.ensure_future(self._connect(client, netns, internal_port, gone))
        task.add_done_callback(self._retrieve)
        return client

    async def _connect(
        self,
        client: _Splice,
        netns: Callable[[], int | None],
        internal_port: int,
        gone: Callable[[], None],
    ) -> None:
        loop = asyncio.get_running_loop()
        fd = netns()
        if fd is None:
            if client.transport is not None:
                client.transport.abort()
            return
        sock = self._enter(fd, lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            async with asyncio.timeout(_CONNECT_TIMEOUT_S):
                await loop.sock_connect(sock, ("127.0.0.1", internal_port))
            upstream = _Splice(self)
            self.connections.add(upstream)
            await loop.create_connection(lambda: upstream, sock=sock)
        except (OSError, TimeoutError):
            sock.close()
            if client.transport is not None:
                client.transport.abort()  # a reset: the service is not there (any more)
            gone()
            return
        if client.transport is None or client.transport.is_closing():
            assert upstream.transport is not None
            upstream.transport.close()
            return
        if client.transport is not None:
            client.transport.set_write_buffer_limits(high=_PIPE_HIGH_WATER)
        client.join(upstream)

    def _retrieve(self, task: asyncio.Future[Any]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._log("forward_failed", error=repr(task.exception()))
