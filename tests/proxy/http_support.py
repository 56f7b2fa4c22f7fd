"""Test support for the proxy's data plane: a fake router, real backends and raw clients.

Everything listens on 127.0.0.1. The backends are small asyncio HTTP/1.1 servers that record
what they saw (connections accepted, requests with their headers and bodies), so a test can
check what the proxy really sent. The client speaks raw bytes, so tests can be hostile too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from ipaddress import ip_network
from typing import Any

from proxy.errors import NoBackend, UnknownApp
from proxy.http import HttpProxy
from proxy.limits import Limits
from proxy.pins import PinCheck
from proxy.routing import Backend
from proxy.stats import Stats

WAIT = 5.0  # every wait in these tests is bounded by this


# -- the fake router -------------------------------------------------------------------------


@dataclass
class Release:
    machine_id: str
    ok: bool
    connect_failed: bool


class FakeRouter:
    """The `proxy.routing.Router` protocol over a fixed list of backends per app.

    It hands out backends in turn (skipping `exclude`d ones), honours `pinned`, raises
    UnknownApp for an app it does not know and NoBackend (with `no_backend_reason`) when nothing
    is left. It records every acquire and release so tests can check they pair up.

    With `fast` it also offers the optional `try_acquire` (answer now or say None), which lets
    the proxy start a request from its parser callback; without, every request goes through
    the connection's task. `fast_default` is what tests get when they do not say.
    """

    fast_default = False

    def __init__(
        self,
        apps: dict[str, list[Backend]],
        no_backend_reason: str = "",
        *,
        fast: bool | None = None,
    ) -> None:
        self.apps = apps
        self.no_backend_reason = no_backend_reason
        self.acquired: list[str] = []
        self.released: list[Release] = []
        self.waiting = 0
        # When set, acquire waits for it first (as the real router waits for a cold start).
        self.gate: asyncio.Event | None = None
        self._turn = 0
        if self.fast_default if fast is None else fast:
            self.try_acquire = self._try_acquire

    def _try_acquire(
        self, app: str, *, pinned: str | None = None, exclude: frozenset[str] = frozenset()
    ) -> Backend | None:
        if self.gate is not None and not self.gate.is_set():
            return None  # it would wait
        return self._pick(app, pinned, exclude)

    async def acquire(
        self, app: str, *, pinned: str | None = None, exclude: frozenset[str] = frozenset()
    ) -> Backend:
        if self.gate is not None:
            self.waiting += 1
            try:
                async with asyncio.timeout(WAIT):
                    await self.gate.wait()
            finally:
                self.waiting -= 1
        return self._pick(app, pinned, exclude)

    def _pick(self, app: str, pinned: str | None, exclude: frozenset[str]) -> Backend:
        if app not in self.apps:
            raise UnknownApp(f"no app named {app!r}")
        if self.no_backend_reason:
            raise NoBackend(self.no_backend_reason)
        candidates = [b for b in self.apps[app] if b.machine_id not in exclude]
        if pinned is not None:
            candidates = [b for b in candidates if b.machine_id == pinned]
        if not candidates:
            raise NoBackend(f"no machine of {app!r} left to try")
        backend = candidates[self._turn % len(candidates)]
        self._turn += 1
        self.acquired.append(backend.machine_id)
        return backend

    def release(self, backend: Backend, *, ok: bool, connect_failed: bool = False) -> None:
        self.released.append(Release(backend.machine_id, ok, connect_failed))

    @property
    def balanced(self) -> bool:
        """Every acquire has exactly one release (for the same machine)."""
        return sorted(self.acquired) == sorted(r.machine_id for r in self.released)


def backend_for(machine_id: str, port: int, app: str = "web") -> Backend:
    return Backend(machine_id, app, "worker-1", "ams", "127.0.0.1", port)


def dead_port() -> int:
    """A port on 127.0.0.1 with nothing listening (connections are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- backends -----------------------------------------------------------------------------------


@dataclass
class SeenRequest:
    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes = b""

    def header(self, name: str) -> str | None:
        values = [v for k, v in self.headers if k.lower() == name.lower()]
        return ", ".join(values) if values else None


class Exchange:
    """One request as a backend handler sees it: its head, its body as a stream, the writer."""

    def __init__(
        self, seen: SeenRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.seen = seen
        self.reader = reader
        self.writer = writer
        self._length = -1
        self._chunked = False
        te = seen.header("transfer-encoding")
        if te is not None and "chunked" in te.lower():
            self._chunked = True
        elif (cl := seen.header("content-length")) is not None:
            self._length = int(cl)
        self.body_done = False

    async def chunks(self) -> AsyncIterator[bytes]:
        """The request body as it arrives (de-chunked)."""
        if self.body_done:
            return
        if self._chunked:
            while True:
                size_line = await self.reader.readuntil(b"\r\n")
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    while (await self.reader.readuntil(b"\r\n")) != b"\r\n":
                        pass  # trailers
                    break
                data = await self.reader.readexactly(size)
                await self.reader.readexactly(2)
                self.seen.body += data
                yield data
        else:
            left = max(self._length, 0)
            while left:
                data = await self.reader.read(min(left, 65536))
                if not data:
                    raise ConnectionError("body cut short")
                left -= len(data)
                self.seen.body += data
                yield data
        self.body_done = True

    async def read_body(self) -> bytes:
        async for _ in self.chunks():
            pass
        return self.seen.body

    def respond(
        self,
        status: int = 200,
        body: bytes = b"",
        headers: list[tuple[str, str]] | None = None,
        *,
        length: bool = True,
    ) -> None:
        lines = [f"HTTP/1.1 {status} X"]
        for name, value in headers or []:
            lines.append(f"{name}: {value}")
        if length:
            lines.append(f"Content-Length: {len(body)}")
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)


Handler = Callable[[Exchange], Awaitable[bool | None]]  # False: close the connection after


async def echo(ex: Exchange) -> None:
    """200 with a JSON body describing the request (the body itself as its length and text)."""
    body = await ex.read_body()
    doc = {
        "method": ex.seen.method,
        "target": ex.seen.target,
        "headers": ex.seen.headers,
        "body_len": len(body),
        "body": body.decode("latin-1")[:200],
    }
    ex.respond(200, json.dumps(doc).encode(), [("Content-Type", "application/json")])


def gated(gate: asyncio.Event, body: bytes) -> Handler:
    """A handler that answers 200 with `body` once `gate` is set (bounded by WAIT)."""

    async def handler(ex: Exchange) -> None:
        async with asyncio.timeout(WAIT):
            await gate.wait()
        ex.respond(200, body)

    return handler


class TestBackend:
    """A real HTTP/1.1 server on 127.0.0.1 that counts connections and records requests."""

    __test__ = False

    def __init__(self, machine_id: str, handler: Handler = echo) -> None:
        self.machine_id = machine_id
        self.handler = handler
        self.connections = 0
        self.open = 0  # connections open now
        self.most_open = 0  # the most open at once
        self.requests: list[SeenRequest] = []
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> TestBackend:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    def backend(self, app: str = "web") -> Backend:
        return backend_for(self.machine_id, self.port, app)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        self.connections += 1
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                seen = _parse_head(head)
                self.requests.append(seen)
                ex = Exchange(seen, reader, writer)
                keep = await self.handler(ex)
                if not ex.body_done and keep is not False:
                    await ex.read_body()
                await writer.drain()
                if keep is False or (seen.header("connection") or "").lower() == "close":
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        except asyncio.CancelledError:
            return  # stopped: asyncio's server callback must not see a cancelled task
        finally:
            self.open -= 1
            self._writers.discard(writer)
            self._tasks.discard(task)
            with contextlib.suppress(Exception):
                writer.close()


def _parse_head(head: bytes) -> SeenRequest:
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers = []
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers.append((name.strip(), value.strip()))
    return SeenRequest(method, target, headers)


# -- a raw client -------------------------------------------------------------------------------


@dataclass
class Response:
    status: int
    headers: list[tuple[str, str]]
    body: bytes = b""
    chunks: list[bytes] = field(default_factory=list)

    def header(self, name: str) -> str | None:
        values = [v for k, v in self.headers if k.lower() == name.lower()]
        return ", ".join(values) if values else None

    def json(self) -> dict[str, object]:
        doc = json.loads(self.body)
        assert isinstance(doc, dict)
        return doc

    @property
    def text(self) -> str:
        return self.body.decode()


class RawClient:
    """One TCP connection to the proxy; send bytes, read responses (HTTP/1.1 framing)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(cls, port: int, source: str | None = None) -> RawClient:
        """Connect to the proxy on 127.0.0.1, from `source` (another loopback address, to be
        another client) when given."""
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, local_addr=(source, 0) if source else None
        )
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def request(
        self,
        host: str,
        target: str = "/",
        method: str = "GET",
        headers: list[tuple[str, str]] | None = None,
        body: bytes | None = None,
    ) -> Response:
        await self.send(build_request(host, target, method, headers, body))
        return await self.response(head=method == "HEAD")

    async def response(
        self, *, head: bool = False, on_chunk: Callable[[bytes], None] | None = None
    ) -> Response:
        async with asyncio.timeout(WAIT):
            head_bytes = await self.reader.readuntil(b"\r\n\r\n")
            lines = head_bytes.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ", 2)[1])
            headers = []
            for line in lines[1:]:
                if line:
                    name, _, value = line.partition(":")
                    headers.append((name.strip(), value.strip()))
            resp = Response(status, headers)
            if head or status in (204, 304) or 100 <= status < 200:
                return resp
            te = resp.header("transfer-encoding")
            cl = resp.header("content-length")
            if te is not None and "chunked" in te.lower():
                while True:
                    size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                    if size == 0:
                        while (await self.reader.readuntil(b"\r\n")) != b"\r\n":
                            pass
                        break
                    data = await self.reader.readexactly(size)
                    await self.reader.readexactly(2)
                    resp.chunks.append(data)
                    if on_chunk is not None:
                        on_chunk(data)
                resp.body = b"".join(resp.chunks)
            elif cl is not None:
                resp.body = await self.reader.readexactly(int(cl))
            else:
                resp.body = await self.reader.read()
            return resp

    async def closed(self) -> bool:
        """Whether the proxy closes this connection (EOF or reset) within WAIT seconds."""
        try:
            async with asyncio.timeout(WAIT):
                while await self.reader.read(65536):
                    pass
        except TimeoutError:
            return False
        except ConnectionError:
            pass
        self.writer.close()
        return True

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


def build_request(
    host: str,
    target: str = "/",
    method: str = "GET",
    headers: list[tuple[str, str]] | None = None,
    body: bytes | None = None,
) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}"]
    for name, value in headers or []:
        lines.append(f"{name}: {value}")
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


async def eventually(check: Callable[[], bool], what: str) -> None:
    """Wait (bounded) until `check()` holds; for effects that land a moment after a response."""
    async with asyncio.timeout(WAIT):
        # Polling: the effects checked (a release, a count on a backend) have no event of
        # their own, and giving them one would change the code under test.
        while not check():  # noqa: ASYNC110
            await asyncio.sleep(0.005)
    assert check(), what


# -- the proxy under test -------------------------------------------------------------------------

DOMAIN = "nonomad.test"


@dataclass
class Edge:
    """An HttpProxy on 127.0.0.1 in front of a FakeRouter."""

    proxy: HttpProxy
    router: FakeRouter
    stats: Stats
    port: int
    clients: list[RawClient] = field(default_factory=list)

    async def client(self, source: str | None = None) -> RawClient:
        """A new connection to the proxy (closed when the edge stops, if not before), from
        the loopback address `source` when given."""
        client = await RawClient.connect(self.port, source)
        self.clients.append(client)
        return client

    async def get(self, app: str, target: str = "/", **kwargs: Any) -> Response:
        client = await self.client()
        try:
            return await client.request(f"{app}.{DOMAIN}", target, **kwargs)
        finally:
            await client.close()


@contextlib.asynccontextmanager
async def edge(
    router: FakeRouter,
    limits: Limits | None = None,
    pin_check: PinCheck | None = None,
    trusted_proxies: Sequence[str] = (),
) -> AsyncIterator[Edge]:
    stats = Stats()
    proxy = HttpProxy(
        router,
        stats,
        domain=DOMAIN,
        region="ams",
        limits=limits or Limits(),
        pin_check=pin_check,
        trusted_proxies=[ip_network(n) for n in trusted_proxies],
    )
    _, port = await proxy.serve("127.0.0.1", 0)
    e = Edge(proxy, router, stats, port)
    try:
        yield e
    finally:
        for client in e.clients:
            await client.close()
        await proxy.close(grace=1.0)


Start = Callable[..., Awaitable[TestBackend]]
"""The `start` fixture (tests/proxy/conftest.py): `await start(machine_id, handler)`."""
