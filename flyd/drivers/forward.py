"""netd's forwarding: each connection accepted on a machine's published port, spliced to the
service's port on the loopback of the machine's network namespace (see `flyd.drivers.netd`).

A socket lives in the namespace its maker's thread was in when it made it, so the socket into
the machine is made inside its namespace (`enter`, netd's) and connected to 127.0.0.1 there:
an app listening on 127.0.0.1 or 0.0.0.0 alike is reached, and sees its client as 127.0.0.1.

A forwarded connection holds two of netd's descriptors (the client's, the one into the
machine) for as long as either side keeps it open, so a machine's clients decide what netd
spends on it: one machine flooded with connections would take every descriptor netd has, and
the published ports of every other machine would stop accepting (EMFILE). So each machine
has a budget: at most `per_machine` forwarded connections at once (a descriptor budget of
2 * `per_machine` + `MACHINE_DESCRIPTORS` for its namespaces, its sock_diag socket and its
ports); one more is reset at once, as a host whose backlog overflows would, and counted
(`refused`, per machine, which netd's `hello` reports). All machines together get what netd's
descriptor limit leaves once its own are set aside (`OWN_DESCRIPTORS`); netd raises that
limit to what the host allows when it starts (`fdlimit.raise_nofile`). Standard library only, like
netd.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

__all__ = ["CONNECTIONS_PER_MACHINE", "Forwarder"]

CONNECTIONS_PER_MACHINE = 1024  # the default budget: 2048 descriptors of forwarded connections
MACHINE_DESCRIPTORS = 32  # a machine's own in netd: 2 namespaces, sock_diag, up to 16 ports
OWN_DESCRIPTORS = 512  # netd's own: its control socket and clients, netlink, nft, spares
_PIPE_HIGH_WATER = 256 << 10
_CONNECT_TIMEOUT_S = 5.0


class _Splice(asyncio.Protocol):
    """One side of a forwarded connection: what it reads, the other side writes."""

    def __init__(
        self, forwarder: Forwarder, *, refuse: bool = False, machine: str | None = None
    ) -> None:
        self.forwarder = forwarder
        self.refuse = refuse  # reset it as soon as it is made: nothing to forward to
        self.machine = machine  # the client's side counts against this machine's budget
        self.transport: asyncio.Transport | None = None
        self.peer: _Splice | None = None
        self.early: list[bytes] = []  # bytes read before the other side was connected
        self.eof_early = False
        self.eof = False  # its peer said it sends no more

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
        self.eof = True
        peer = self.peer
        if peer is None or peer.transport is None:
            self.eof_early = True
        else:
            if peer.transport.can_write_eof():
                peer.transport.write_eof()
            if peer.eof:  # both directions are done: nothing keeps the pair (and its fds)
                self._close_both()
        return True  # keep the other direction open (half-close)

    def _close_both(self) -> None:
        for side in (self, self.peer):
            if side is not None and side.transport is not None:
                side.transport.close()  # (after what it still has to write)

    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.forwarder.connections.discard(self)
        if self.machine is not None:
            self.forwarder.ended(self.machine)
            self.machine = None
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
    """The connections netd forwards, within each machine's budget. `enter(netns, work)`:
    `work()` run in the network namespace `netns`; `log(event, **fields)`: netd's log;
    `nofile`: netd's descriptor limit; `per_machine`: connections at once per machine."""

    def __init__(
        self,
        enter: Callable[[int, Callable[[], Any]], Any],
        log: Callable[..., None],
        *,
        nofile: int,
        per_machine: int = CONNECTIONS_PER_MACHINE,
    ) -> None:
        self._enter = enter
        self._log = log
        self.nofile = nofile
        self.per_machine = per_machine
        self.connections: set[_Splice] = set()
        self.open: dict[str, int] = {}  # forwarded connections per machine, now
        self.refused: dict[str, int] = {}  # reset over the machine's budget (or netd's)

    def accepted(
        self,
        machine: str,
        netns: Callable[[], int | None],
        internal_port: int,
        gone: Callable[[], None],
        *,
        machines: int,
    ) -> asyncio.Protocol:
        """The protocol for a connection just accepted on one of `machine`'s published
        ports: forwarded to `internal_port` in the namespace `netns()` names (None: the
        machine is down), unless that would go over its budget or netd's (`machines`: how
        many netd holds, each with its own descriptors). `gone()` when nothing listens there
        any more."""
        if netns() is None:
            return _Splice(self, refuse=True)  # nothing to forward to: the machine is stopped
        spare = self.nofile - OWN_DESCRIPTORS - machines * MACHINE_DESCRIPTORS
        if self.open.get(machine, 0) >= self.per_machine or 2 * len(self.connections) >= spare:
            refused = self.refused[machine] = self.refused.get(machine, 0) + 1
            if refused & (refused - 1) == 0:  # the 1st, 2nd, 4th, ...: a flood logs little
                self._log("connections_refused", machine=machine, refused=refused)
            return _Splice(self, refuse=True)
        self.open[machine] = self.open.get(machine, 0) + 1
        client = _Splice(self, machine=machine)
        self.connections.add(client)
        task = asyncio.ensure_future(self._connect(client, netns, internal_port, gone))
        task.add_done_callback(self._retrieve)
        return client

    def ended(self, machine: str) -> None:
        """One of the machine's forwarded connections is over (its client's side closed)."""
        left = self.open.get(machine, 0) - 1
        if left > 0:
            self.open[machine] = left
        else:
            self.open.pop(machine, None)

    def forget(self, machine: str) -> None:
        """The machine is gone: its count of refusals goes (its open connections end on
        their own as their ports close)."""
        self.refused.pop(machine, None)

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
