"""The proxy's data plane: `HttpProxy`, an asyncio HTTP/1.1 reverse proxy from
`<app>.<domain>` to the app's machines.

`HttpProxy` listens, holds what its connections share (the router, the stats, the pool of idle
machine connections, the open client connections, the Host-to-app and machine-header caches),
ends the exchanges of lost machines and shuts down. The connections are proxy.client (reading a
client's requests), proxy.forward (answering them) and proxy.upstream (talking to machines).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable

import structlog
from opentelemetry.trace import Tracer

from proxy.client import NAMESPACE, ClientConnection
from proxy.forward import Client
from proxy.forwarded import Forwarding, Network
from proxy.limits import Limits
from proxy.routing import Backend, Router
from proxy.stats import Stats
from proxy.upstream import Pool
from proxy.wire import CRLF, REQ_SPECIAL, REQ_SPECIAL_TRACED
from runtime.validate import is_name

log = structlog.get_logger("proxy.http")


class HttpProxy:
    """The edge's HTTP/1.1 data plane: routes `<app>.<domain>` to the app's machines.

    `router` chooses machines (see proxy.routing); `stats` counts what happens. Responses name
    the machine that served them in `machine_header`; a request may ask for one machine with
    `pin_header`, if `await pin_check(app, machine id, its nonomad-token header)` says None (else
    403 with what it said; without a pin_check, any request may). Request headers of the
    proxy's namespace (`nonomad-*`) never reach a machine, nor do a client's forwarding headers
    (X-Forwarded-For and its kin): the edge writes its own, and chains a hop's only for
    connections from the `trusted_proxies` networks (proxy.forwarded). If the router also has
    `try_acquire(app, *, pinned, exclude) -> Backend | None` (what `acquire` would return
    without waiting, or None if it would wait), requests start without a task switch. Create
    it inside the running event loop.
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
        pin_check: Callable[[str, str, bytes | None], Awaitable[str | None]] | None = None,
        tracer: Tracer | None = None,
        trusted_proxies: Iterable[Network] = (),
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
        if not self._pin_header.startswith(NAMESPACE):
            raise ValueError(f"pin_header must start with {NAMESPACE.decode()}: {pin_header}")
        self._pin_check = pin_check
        self._machine_header = machine_header.encode("ascii")
        self._machine_lines: dict[str, bytes] = {}
        self._apps: dict[bytes, str | None] = {}
        self._loop = asyncio.get_running_loop()
        self._forwarding = Forwarding(trusted_proxies)
        self._pool = Pool(
            limits.pool_size_per_backend,
            limits.upstream_idle_timeout,
            limits.max_connections_per_machine,
        )
        self._conns: set[ClientConnection] = set()
        self._by_peer: dict[bytes, set[ClientConnection]] = {}
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
            lambda: Client(self), host, port, backlog=1024, reuse_address=True
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

    def upstream_connections(self, machine_id: str) -> int:
        """Connections open (or opening) to a machine now, busy and idle."""
        return self._pool.open_count(machine_id)

    # for the connections

    def _conn_closed(self, conn: ClientConnection) -> None:
        self._conns.discard(conn)
        mine = self._by_peer.get(conn.peer)
        if mine is not None:
            mine.discard(conn)
            if not mine:
                del self._by_peer[conn.peer]
        if not self._conns and self._all_closed is not None:
            self._all_closed.set()

    def _admit(self, conn: ClientConnection) -> bool:
        """Whether to serve a new connection: its client is under its own limit, and the
        proxy under its limit or able to make room by cutting off an idle connection of the
        client that holds the most (so no client can hold every slot)."""
        if self._closing:
            return False
        limits = self.limits
        mine = self._by_peer.get(conn.peer)
        if mine is not None and len(mine) >= limits.max_connections_per_client:
            return False
        if len(self._conns) >= limits.max_connections and not self._cut_idle():
            return False
        self._conns.add(conn)
        if mine is None:
            mine = self._by_peer[conn.peer] = set()
        mine.add(conn)
        return True

    def _cut_idle(self) -> bool:
        heaviest = max(self._by_peer.values(), key=len, default=None)
        for conn in heaviest or ():
            if conn.idle:
                log.info("proxy_idle_cut", peer=conn.peer, connections=len(heaviest or ()))
                conn._close()
                self._conn_closed(conn)  # its slot is free now, not when the close completes
                return True
        return False

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
        """The app `host` names; None for none, "" for a malformed Host (a bad port)."""
        name = host.strip().lower()
        if name.startswith(b"["):
            return None  # an IP literal names no app
        if b":" in name:
            name, _, port = name.rpartition(b":")
            if port and not (port.isdigit() and len(port) <= 5 and 1 <= int(port) <= 65535):
                return ""
        name = name.rstrip(b".")
        suffix = self._suffix
        if not name.endswith(suffix):
            return None
        app = name[: -len(suffix)]
        if not app.isascii() or not is_name(app.decode("ascii")):
            return None  # one name check for every identifier: runtime.validate's
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
