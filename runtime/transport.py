"""Where a service's gRPC servers and client channels come from: the transport of the task that
asks for one.

Every server a `Service` binds and every channel `aio_channel` opens is made by `current()`:
real `grpc.aio` (`GRPC`) unless the task runs under another. A simulated cluster (sim.net)
runs many services in one process on virtual time, where gRPC's C core cannot go (it keeps
its own threads, sockets and clock), so each simulated node's tasks run under a transport of
that node's own, which carries the same serialized messages over simulated links and raises
the same `grpc.aio.AioRpcError`s. The transport is a property of the running task, as the
running loop is: a context variable, set once for a node, inherited by every task it starts.
"""

from __future__ import annotations

import contextvars
from collections.abc import Sequence
from typing import Any, Protocol

import grpc
import grpc.aio

Option = tuple[str, Any]


class Transport(Protocol):
    def server(self, *, interceptors: Sequence[Any] | None, options: Sequence[Option]) -> Any:
        """A `grpc.aio.Server`, or what behaves as one: add handlers, ports, start, stop."""
        ...

    def channel(
        self,
        target: str,
        *,
        credentials: grpc.ChannelCredentials | None,
        options: Sequence[Option],
        interceptors: Sequence[Any] | None,
    ) -> grpc.aio.Channel:
        """A client channel to `target`: plaintext when `credentials` is None."""
        ...


class GrpcTransport:
    """The real network: grpc.aio's servers and channels."""

    def server(self, *, interceptors: Sequence[Any] | None, options: Sequence[Option]) -> Any:
        return grpc.aio.server(interceptors=interceptors, options=options)

    def channel(
        self,
        target: str,
        *,
        credentials: grpc.ChannelCredentials | None,
        options: Sequence[Option],
        interceptors: Sequence[Any] | None,
    ) -> grpc.aio.Channel:
        if credentials is None:
            return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
        return grpc.aio.secure_channel(
            target, credentials, options=options, interceptors=interceptors
        )


GRPC: Transport = GrpcTransport()

_current: contextvars.ContextVar[Transport] = contextvars.ContextVar(
    "nonomad_transport", default=GRPC
)


def current() -> Transport:
    """The transport of the running task (`GRPC` unless it runs under another)."""
    return _current.get()


def use(transport: Transport) -> contextvars.Token[Transport]:
    """Make `transport` this context's (and every task's it starts from now on)."""
    return _current.set(transport)
