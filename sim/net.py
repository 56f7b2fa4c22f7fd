"""The simulated network: gRPC between the nodes of a World, on virtual time.

Each node that joins the network gets an address of its own (`10.0.0.N`) and a transport
(runtime.transport) under which all its tasks run, so the services' own code opens its servers
and channels here without knowing it. What crosses is what crosses a real wire: the request
serialized by the client's stub, the response serialized by the server's handler, the status
code, details and trailing metadata; a client sees the same `grpc.aio.AioRpcError`s it sees on
loopback (a contract suite, tests/sim/test_net_contract.py, runs the same calls against both).

Between two nodes messages travel in order (one HTTP/2 connection: nothing overtakes), each
after a latency drawn from the seed. The faults:

- a *slow link* (`slow(a, b, latency)`, one-way or both) draws its messages' latency from
  `latency` instead, still in order;
- a *partition* (`block(a, b)`, one-way or both) holds messages, as TCP does until it gives
  up: a call made across it fails at its deadline, or UNAVAILABLE once keepalive would have
  noticed (`UNREACHABLE_AFTER`); a stream across it goes silent the same way; what the
  partition held arrives when it ends, in order, to whoever still waits for it;
- a *process death* (`crash(node)`, what a SIGKILL does) resets its connections: the calls in
  flight to it fail UNAVAILABLE one latency later, and the handlers serving its own calls on
  other nodes are cancelled, as gRPC cancels a handler whose client went away;
- a *host death* (`crash(node, reset=False)`) answers nothing more: its peers find out only
  from their deadlines and keepalives.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import random
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import grpc
import grpc.aio

from runtime import transport
from sim.world import Node, SimulationError, World

UNREACHABLE_AFTER = 20.0
"""Seconds a call across a partition waits for an answer before gRPC gives up on the
connection (its connect timeout and keepalive watchdog are of this order): UNAVAILABLE."""

ORDER_GAP = 1e-6
"""Seconds between two messages of one link that would otherwise arrive at the same time."""

Deliver = Callable[[], None]
C = TypeVar("C", bound="_CallBase")


@dataclass
class LinkFaults:
    """How messages travel: a latency drawn per message (uniform). Nothing is lost on a live
    connection (TCP retransmits): a partition holds messages, it does not drop them."""

    latency: tuple[float, float] = (0.0002, 0.002)

    def __post_init__(self) -> None:
        low, high = self.latency
        if not 0.0 <= low <= high:
            raise ValueError("LinkFaults.latency must be (low, high) with 0 <= low <= high")


@dataclass
class NetStats:
    messages: int = 0
    held: int = 0  # by a partition, delivered once it ends (to whoever still listens)
    refused: int = 0  # calls to an address nobody listens on
    resets: int = 0  # calls failed by the death of a process at the other end


class Network:
    """Every address of a World, the servers listening on them, and the links between."""

    def __init__(self, world: World, faults: LinkFaults | None = None) -> None:
        self.world = world
        # One stream of draws per link (src, dst): a message's latency depends on its link's
        # traffic only, not on the order in which one step sends to several nodes.
        self._rngs: dict[tuple[str, str], random.Random] = {}
        self.faults = faults or LinkFaults()
        self.stats = NetStats()
        self._ips: dict[str, str] = {}
        self._listeners: dict[tuple[str, int], SimServer] = {}  # bound (serving once started)
        self._blocked: collections.Counter[tuple[str, str]] = collections.Counter()
        self._held: dict[tuple[str, str], list[Deliver]] = {}
        self._slow: dict[tuple[str, str], list[tuple[float, float]]] = {}
        self._last: dict[tuple[str, str], float] = {}  # link -> latest delivery time
        self._calls: dict[int, _ServerCall] = {}
        self._ids = itertools.count(1)

    # -- membership --

    def join(self, node: Node) -> str:
        """Give `node` an address and make this network its tasks' transport; its address."""
        ip = self._ips.get(node.name) or f"10.0.{len(self._ips) // 250}.{len(self._ips) % 250 + 1}"
        self._ips[node.name] = ip
        node.context.run(transport.use, SimTransport(self, node, ip))
        return ip

    def ip(self, node: str) -> str:
        return self._ips[node]

    def crash(self, node: str, *, reset: bool = True) -> None:
        """`node`'s process is gone: its listeners close, and with `reset` (a process death,
        not a host's) its peers hear of it: calls in flight to it fail UNAVAILABLE, its own
        calls' handlers elsewhere are cancelled."""
        for key in [k for k, server in self._listeners.items() if server.node.name == node]:
            del self._listeners[key]
        for call in list(self._calls.values()):
            if call.server_node == node:
                self._forget(call)
                if reset:
                    self.stats.resets += 1
                    call.reply_from_peer(node, _Status.reset(node))
            elif call.client_node == node:
                self._forget(call)
                if reset:
                    call.cancel_on_server()

    # -- faults --

    def block(self, src: str, dst: str, *, both: bool = True) -> None:
        """Messages from `src` to `dst` (and back, with `both`) are held until the partition
        ends, as TCP holds them: a call waiting on them fails by its deadline or keepalive
        (UNREACHABLE_AFTER); what arrives after that finds nobody waiting. Partitions of one
        link overlap: it is open again once each has ended."""
        self._blocked[(src, dst)] += 1
        if both:
            self._blocked[(dst, src)] += 1
        self.world.record("net", f"block {src}{'<' if both else ''}->{dst}")

    def slow(self, src: str, dst: str, latency: tuple[float, float], *, both: bool = True) -> None:
        """Messages from `src` to `dst` (and back, with `both`) take a latency drawn from
        `latency` (low, high), still in order, until `unslow` with the same arguments; of
        slowdowns that overlap on a link, the slowest holds."""
        LinkFaults(latency)  # checked as any latency is
        for link in [(src, dst), (dst, src)] if both else [(src, dst)]:
            self._slow.setdefault(link, []).append(latency)
        self.world.record("net", f"slow {src}{'<' if both else ''}->{dst} {latency[1]:.3f}s")

    def unslow(
        self, src: str, dst: str, latency: tuple[float, float], *, both: bool = True
    ) -> None:
        """The slowdown `slow(src, dst, latency, both=both)` made ends (others stay)."""
        for link in [(src, dst), (dst, src)] if both else [(src, dst)]:
            active = self._slow.get(link, [])
            if latency in active:  # (not if a heal ended it already)
                active.remove(latency)
            if not active:
                self._slow.pop(link, None)
        self.world.record("net", f"unslow {src}{'<' if both else ''}->{dst}")

    def unblock(self, src: str, dst: str, *, both: bool = True) -> None:
        """The partition `block(src, dst, both=both)` made ends (others stay)."""
        for link in [(src, dst), (dst, src)] if both else [(src, dst)]:
            self._blocked[link] -= 1
            if self._blocked[link] <= 0:
                del self._blocked[link]
                self._release(link)
        self.world.record("net", f"unblock {src}{'<' if both else ''}->{dst}")

    def heal(self) -> None:
        """Every partition and slowdown ends."""
        links = list(self._blocked)
        self._blocked.clear()
        self._slow.clear()
        for link in links:
            self._release(link)
        self.world.record("net", "healed")

    def blocked(self, src: str, dst: str) -> bool:
        return (src, dst) in self._blocked

    def _release(self, link: tuple[str, str]) -> None:
        for deliver in self._held.pop(link, []):
            self._carry(link, deliver)

    # -- carrying --

    def send(self, src: str, dst: str, deliver: Deliver) -> bool:
        """Carry a message from node `src` to node `dst`, in order behind the link's earlier
        ones, after a drawn latency (later, across a partition); `deliver` runs on `dst`'s
        loop then, if `dst` is still up. False when nobody is there to hold it for."""
        self.stats.messages += 1
        link = (src, dst)
        if link in self._blocked:
            self.stats.held += 1
            self._held.setdefault(link, []).append(deliver)
            return dst in self.world.nodes
        return self._carry(link, deliver)

    def _carry(self, link: tuple[str, str], deliver: Deliver) -> bool:
        now = self.world.now
        # Strictly after the link's previous message: timers due at the same instant run in
        # no promised order.
        after = self._last.get(link, -1.0) + ORDER_GAP
        slow = self._slow.get(link)
        latency = max(slow, key=lambda bounds: bounds[1]) if slow else self.faults.latency
        rng = self._rngs.get(link)
        if rng is None:
            rng = self._rngs[link] = self.world.entropy.child(f"net/{link[0]}->{link[1]}").rng()
        when = max(now + rng.uniform(*latency), after)
        self._last[link] = when
        return self.world.deliver(link[1], deliver, when - now)

    def listener(self, address: str) -> SimServer | None:
        """The server serving at `address`, if one is (bound and started)."""
        host, _, port = address.rpartition(":")
        try:
            server = self._listeners.get((host, int(port)))
        except ValueError:
            return None
        return server if server is not None and server._serving else None

    def _bind(self, server: SimServer, host: str, port: int) -> int:
        """Bind `host:port` for `server` (port 0: the first free from 40000); the port."""
        if port == 0:
            port = 40000
            while (host, port) in self._listeners:
                port += 1
        elif (host, port) in self._listeners:
            raise RuntimeError(f"Failed to bind to address {host}:{port}: address in use")
        self._listeners[(host, port)] = server
        return port

    def _unlisten(self, server: SimServer) -> None:
        for key in [k for k, s in self._listeners.items() if s is server]:
            del self._listeners[key]

    def _forget(self, call: _ServerCall) -> None:
        self._calls.pop(call.id, None)


def _address_of(target: str) -> str:
    for prefix in ("dns:///", "ipv4:", "dns:"):
        if target.startswith(prefix):
            return target[len(prefix) :]
    return target


# -- what travels back: a status, and for a stream, messages before it -----------------------


@dataclass(frozen=True)
class _Status:
    code: grpc.StatusCode
    details: str = ""
    trailing: tuple[tuple[str, str | bytes], ...] = ()

    @staticmethod
    def reset(node: str) -> _Status:
        return _Status(grpc.StatusCode.UNAVAILABLE, f"Socket closed ({node} went away)")

    def error(self) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(
            self.code,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(*self.trailing),
            self.details,
            f"simulated: {self.code.name}: {self.details}",
        )


class _HandlerCallDetails(NamedTuple):
    method: str
    invocation_metadata: tuple[tuple[str, str | bytes], ...]


# -- the server side --------------------------------------------------------------------------


class SimServer:
    """What `grpc.aio.server()` gives, on the network: handlers, ports, start and stop."""

    def __init__(self, net: Network, node: Node, ip: str) -> None:
        self.net = net
        self.node = node
        self.ip = ip
        self._generic: list[Any] = []
        self._registered: dict[str, Any] = {}
        self._serving = False
        self._calls: set[_ServerCall] = set()

    def add_generic_rpc_handlers(self, handlers: Sequence[Any]) -> None:
        self._generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        for name, handler in handlers.items():
            self._registered[f"/{service}/{name}"] = handler

    def add_insecure_port(self, address: str) -> int:
        return self._bind(address)

    def add_secure_port(self, address: str, credentials: Any) -> int:
        return self._bind(address)  # the simulated wire carries identities, not TLS

    def _bind(self, address: str) -> int:
        host, _, port_text = address.rpartition(":")
        host = host.strip("[]")
        if host not in (self.ip, "0.0.0.0", "::", ""):
            raise RuntimeError(
                f"Failed to bind to address {address}: {self.node.name} is {self.ip}"
            )
        return self.net._bind(self, self.ip, int(port_text))

    async def start(self) -> None:
        self._serving = True

    async def stop(self, grace: float | None) -> None:
        """New calls are refused at once; those under way get `grace` seconds, then are
        cancelled (their callers see CANCELLED)."""
        self._serving = False
        self.net._unlisten(self)
        running = [call.task for call in self._calls if call.task is not None]
        if grace and running:
            await asyncio.wait(running, timeout=grace)
        for call in list(self._calls):
            call.cancel_handler(_Status(grpc.StatusCode.CANCELLED, "server shutting down"))

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        return True

    def handler(self, method: str, metadata: tuple[tuple[str, str | bytes], ...]) -> Any:
        registered = self._registered.get(method)
        if registered is not None:
            return registered
        details = _HandlerCallDetails(method, metadata)
        for generic in self._generic:
            found = generic.service(details)
            if found is not None:
                return found
        return None


class SimServicerContext:
    """The part of `grpc.aio.ServicerContext` a handler uses."""

    def __init__(self, call: _ServerCall, deadline: float | None) -> None:
        self._call = call
        self._deadline = deadline  # the server loop's time
        self.code: grpc.StatusCode | None = None
        self.details: str = ""
        self.trailing: tuple[tuple[str, str | bytes], ...] = ()
        self._done: list[Callable[[Any], None]] = []

    async def abort(
        self,
        code: grpc.StatusCode,
        details: str = "",
        trailing_metadata: Sequence[tuple[str, str | bytes]] = (),
    ) -> None:
        if code == grpc.StatusCode.OK:
            raise ValueError("abort() with OK is not allowed")
        self.code, self.details = code, details
        if trailing_metadata:
            self.trailing = tuple(trailing_metadata)
        raise grpc.aio.AbortError()

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str | bytes]]) -> None:
        self.trailing = tuple(metadata)

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self._call.metadata

    def time_remaining(self) -> float | None:
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - asyncio.get_running_loop().time())

    def peer(self) -> str:
        return f"ipv4:{self._call.client_ip}:{self._call.client_port}"

    def peer_identities(self) -> None:
        return None

    def peer_identity_key(self) -> None:
        return None

    def auth_context(self) -> dict[str, list[bytes]]:
        return {"transport_security_type": [b"insecure"]}

    def cancelled(self) -> bool:
        return self._call.cancelled

    def done(self) -> bool:
        return self._call.finished

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        self._done.append(callback)

    async def write(self, message: Any) -> None:
        self._call.send_message(message)

    async def send_initial_metadata(self, metadata: Sequence[tuple[str, str | bytes]]) -> None:
        pass


@dataclass(eq=False)
class _ServerCall:
    """One call, as the server runs it; it answers the client through the network."""

    net: Network
    id: int
    method: str
    metadata: tuple[tuple[str, str | bytes], ...]
    client_node: str
    client_ip: str
    client_port: int
    server_node: str
    reply: Callable[[_Status | None, bytes | None], None]  # runs on the client's loop
    task: asyncio.Task[None] | None = None
    server: SimServer | None = None
    serializer: Callable[[Any], bytes] | None = None
    cancelled: bool = False
    finished: bool = False
    context: SimServicerContext | None = field(default=None, repr=False)

    def reply_from_peer(self, node: str, status: _Status) -> None:
        """The reset a process's death sends its peers: one latency later, on the client."""
        self.finished = True
        self.net.send(node, self.client_node, lambda: self.reply(status, None))

    def answer(self, status: _Status | None, payload: bytes | None) -> None:
        if self.finished:
            return
        self.finished = True
        self.net._forget(self)
        if self.server is not None:
            self.server._calls.discard(self)
        if self.context is not None:
            for callback in self.context._done:
                callback(self.context)
        self.net.send(self.server_node, self.client_node, lambda: self.reply(status, payload))

    def send_message(self, message: Any) -> None:
        assert self.serializer is not None
        payload = self.serializer(message)
        self.net.send(self.server_node, self.client_node, lambda: self.reply(None, payload))

    def cancel_here(self) -> None:
        """The client went away (on the server's loop): the handler is cancelled."""
        self.cancelled = True
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def cancel_on_server(self) -> None:
        """The client's process died: its connection's reset reaches the server at once."""
        self.net.world.deliver(self.server_node, self.cancel_here)

    def cancel_handler(self, status: _Status) -> None:
        """The server stops: the handler is cancelled and its caller hears `status`."""
        self.cancel_here()
        self.answer(status, None)

    async def run(self, handler: Any, raw: bytes, deadline: float | None) -> None:
        context = self.context = SimServicerContext(self, deadline)
        self.serializer = handler.response_serializer or (lambda m: m)
        timer = None
        if deadline is not None:
            loop = asyncio.get_running_loop()
            task = asyncio.current_task()
            assert task is not None
            timer = loop.call_at(deadline, task.cancel)
        try:
            request = handler.request_deserializer(raw) if handler.request_deserializer else raw
            if handler.unary_unary is not None:
                response = await handler.unary_unary(request, context)
                status = _final(context)
                self.answer(status, self.serializer(response) if status is None else None)
            elif handler.unary_stream is not None:
                behaviour = handler.unary_stream(request, context)
                if isinstance(behaviour, AsyncIterator):
                    async with contextlib.aclosing(behaviour):  # type: ignore[type-var]
                        async for message in behaviour:
                            self.send_message(message)
                else:
                    await behaviour
                self.answer(_final(context) or _Status(grpc.StatusCode.OK), None)
            else:
                self.answer(_Status(grpc.StatusCode.UNIMPLEMENTED, "streamed requests"), None)
        except grpc.aio.AbortError:
            self.answer(_final(context), None)
        except asyncio.CancelledError:  # its client went away, or its deadline passed
            if self.cancelled:
                self.answer(_Status(grpc.StatusCode.CANCELLED, "Cancelled"), None)
            else:
                self.answer(_Status(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"), None)
        except Exception as err:  # what grpc.aio answers for a handler's own error
            self.answer(_Status(grpc.StatusCode.UNKNOWN, f"Unexpected {type(err)}: {err}"), None)
        finally:
            if timer is not None:
                timer.cancel()


def _final(context: SimServicerContext) -> _Status | None:
    """The status a handler chose, or None for OK."""
    if context.code is None or context.code == grpc.StatusCode.OK:
        return None
    return _Status(context.code, context.details, context.trailing)


# -- the client side --------------------------------------------------------------------------


class SimTransport:
    """One node's transport (runtime.transport.Transport) on the network."""

    def __init__(self, net: Network, node: Node, ip: str) -> None:
        self.net = net
        self.node = node
        self.ip = ip
        self._ports = itertools.count(50000)

    def server(self, *, interceptors: Sequence[Any] | None, options: Sequence[Any]) -> SimServer:
        if interceptors:
            raise SimulationError(f"node {self.node.name}: server interceptors are not simulated")
        return SimServer(self.net, self.node, self.ip)

    def channel(
        self,
        target: str,
        *,
        credentials: grpc.ChannelCredentials | None,
        options: Sequence[Any],
        interceptors: Sequence[Any] | None,
    ) -> SimChannel:
        if interceptors:
            raise SimulationError(f"node {self.node.name}: client interceptors are not simulated")
        return SimChannel(self, _address_of(target), next(self._ports))


class SimChannel:
    """What `grpc.aio.insecure_channel()` gives, on the network."""

    def __init__(self, owner: SimTransport, address: str, port: int) -> None:
        self._owner = owner
        self.address = address
        self.port = port
        self._closed = False

    def unary_unary(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes] | None = None,
        response_deserializer: Callable[[bytes], Any] | None = None,
        _registered_method: bool = False,
    ) -> Callable[..., SimUnaryUnaryCall]:
        return self._method(SimUnaryUnaryCall, method, request_serializer, response_deserializer)

    def unary_stream(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes] | None = None,
        response_deserializer: Callable[[bytes], Any] | None = None,
        _registered_method: bool = False,
    ) -> Callable[..., SimUnaryStreamCall]:
        return self._method(SimUnaryStreamCall, method, request_serializer, response_deserializer)

    def _method(
        self,
        kind: type[C],
        method: str,
        serializer: Callable[[Any], bytes] | None,
        deserializer: Callable[[bytes], Any] | None,
    ) -> Callable[..., C]:
        """A stub's multi-callable: each call starts one RPC of `kind`."""

        def call(
            request: Any,
            *,
            timeout: float | None = None,
            metadata: Sequence[tuple[str, str | bytes]] | None = None,
            **_: Any,  # wait_for_ready, compression: nothing to do with them here
        ) -> C:
            started = self._start(method, request, serializer, timeout, metadata)
            return kind(started, deserializer)

        return call

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        raise SimulationError(f"{method}: streamed requests are not simulated")

    stream_stream = stream_unary

    def _start(
        self,
        method: str,
        request: Any,
        serializer: Callable[[Any], bytes] | None,
        timeout: float | None,
        metadata: Sequence[tuple[str, str | bytes]] | None,
    ) -> _ClientCall:
        if self._closed:
            raise RuntimeError("the channel is closed")  # as grpc.aio's UsageError says
        call = _ClientCall(
            self._owner, self.address, self.port, method, tuple(metadata or ()), timeout
        )
        call.send(serializer(request) if serializer else request)
        return call

    async def close(self, grace: float | None = None) -> None:
        self._closed = True

    async def channel_ready(self) -> None:
        return None

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return grpc.ChannelConnectivity.READY

    async def __aenter__(self) -> SimChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _ClientCall:
    """One call, as the client sees it: messages and a final status arrive in order."""

    def __init__(
        self,
        owner: SimTransport,
        address: str,
        port: int,
        method: str,
        metadata: tuple[tuple[str, str | bytes], ...],
        timeout: float | None,
    ) -> None:
        self.owner = owner
        self.net = owner.net
        self.address = address
        self.method = method
        self.metadata = metadata
        self.port = port
        self.loop = asyncio.get_running_loop()
        self.inbox: asyncio.Queue[tuple[_Status | None, bytes | None]] = asyncio.Queue()
        self.server_call: _ServerCall | None = None
        started = self.loop.time()
        self.deadline = None if timeout is None else started + timeout
        self.give_up = started + UNREACHABLE_AFTER  # pushed back by every message heard

    def send(self, raw: bytes) -> None:
        net, me = self.net, self.owner.node.name
        server = net.listener(self.address)
        if server is None:
            # Nobody listens there: a connection refused comes back (from a host that is up).
            net.stats.refused += 1
            status = _Status(
                grpc.StatusCode.UNAVAILABLE,
                f"failed to connect to all addresses; last error: {self.address}: "
                "Connection refused",
            )
            self.inbox.put_nowait((status, None))
            return
        call = self.server_call = _ServerCall(
            net=net,
            id=next(net._ids),
            method=self.method,
            metadata=self.metadata,
            client_node=me,
            client_ip=self.owner.ip,
            client_port=self.port,
            server_node=server.node.name,
            reply=self._receive,
        )
        net._calls[call.id] = call
        remaining = None if self.deadline is None else self.deadline - self.loop.time()

        def arrive() -> None:
            # On the server's loop, in its node's context: the handler runs there.
            if net.listener(self.address) is not server:  # (stopped, or gone, meanwhile)
                call.answer(_Status(grpc.StatusCode.UNAVAILABLE, "Connection refused"), None)
                return
            handler = server.handler(self.method, self.metadata)
            if handler is None:
                call.answer(_Status(grpc.StatusCode.UNIMPLEMENTED, "Method not found!"), None)
                return
            loop = asyncio.get_running_loop()
            deadline = None if remaining is None else loop.time() + remaining
            call.server = server
            server._calls.add(call)
            call.task = loop.create_task(call.run(handler, raw, deadline))

        net.send(me, server.node.name, arrive)

    def _receive(self, status: _Status | None, payload: bytes | None) -> None:
        self.give_up = self.loop.time() + UNREACHABLE_AFTER
        self.inbox.put_nowait((status, payload))

    async def next(self) -> tuple[_Status | None, bytes | None]:
        """The next message (None, payload) or the final (status, payload-or-None)."""
        while True:
            if self.inbox.qsize():  # (what arrived by the deadline is read, late or not)
                return self.inbox.get_nowait()
            now = self.loop.time()
            limit = self.give_up if self.deadline is None else min(self.deadline, self.give_up)
            try:
                return await asyncio.wait_for(self.inbox.get(), max(0.0, limit - now))
            except TimeoutError:
                if self.inbox.qsize():
                    continue
                self.abandon()
                if self.deadline is not None and self.loop.time() >= self.deadline:
                    return _Status(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"), None
                return _Status(
                    grpc.StatusCode.UNAVAILABLE, "keepalive watchdog timeout (unreachable)"
                ), None
            except asyncio.CancelledError:
                self.abandon()
                raise

    def abandon(self) -> None:
        """The client gives up on the call: tell the server (an RST_STREAM), if it can hear."""
        call = self.server_call
        if call is None or call.finished:
            return
        call.finished = True
        self.net._forget(call)
        self.net.send(self.owner.node.name, call.server_node, call.cancel_here)


class _CallBase:
    def __init__(
        self,
        call: _ClientCall,
        deserializer: Callable[[bytes], Any] | None,
    ) -> None:
        self._call = call
        self._deserialize = deserializer or (lambda raw: raw)
        self._status: _Status | None = None
        self._cancelled = False

    async def code(self) -> grpc.StatusCode | None:  # (coroutines, as grpc.aio's are)
        return None if self._status is None else self._status.code

    async def details(self) -> str | None:
        return None if self._status is None else self._status.details

    async def trailing_metadata(self) -> grpc.aio.Metadata:
        return grpc.aio.Metadata(*(self._status.trailing if self._status else ()))

    async def initial_metadata(self) -> grpc.aio.Metadata:
        return grpc.aio.Metadata()

    def cancelled(self) -> bool:
        return self._cancelled

    def done(self) -> bool:
        return self._status is not None or self._cancelled

    def _fail(self, status: _Status) -> None:
        self._status = status
        raise status.error()


class SimUnaryUnaryCall(_CallBase):
    """Awaitable as grpc.aio's UnaryUnaryCall: the response, or AioRpcError."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._task = asyncio.get_running_loop().create_task(self._result())

    async def _result(self) -> Any:
        status, payload = await self._call.next()
        if status is not None:
            self._fail(status)
        self._status = _Status(grpc.StatusCode.OK)
        assert payload is not None
        return self._deserialize(payload)

    def cancel(self) -> bool:
        if self.done():
            return False
        self._cancelled = True
        self._call.abandon()
        return self._task.cancel()

    def __await__(self) -> Any:
        return self._task.__await__()


class SimUnaryStreamCall(_CallBase):
    """Iterable as grpc.aio's UnaryStreamCall: the responses, then AioRpcError unless OK."""

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[Any]:
        while (message := await self.read()) is not grpc.aio.EOF:
            yield message

    async def read(self) -> Any:
        if self._status is not None:
            if self._status.code == grpc.StatusCode.OK:
                return grpc.aio.EOF
            raise self._status.error()
        status, payload = await self._call.next()
        if status is None:
            assert payload is not None
            return self._deserialize(payload)
        if status.code == grpc.StatusCode.OK:
            self._status = status
            return grpc.aio.EOF
        self._fail(status)

    def cancel(self) -> bool:
        if self.done():
            return False
        self._cancelled = True
        self._status = _Status(grpc.StatusCode.CANCELLED, "Locally cancelled by application!")
        self._call.abandon()
        return True
