"""The contract between the proxy's data plane (proxy.http, whose client connections in
proxy.client and proxy.forward call the router) and its control plane (proxy.router).

The data plane parses HTTP and moves bytes; for every request it asks the router for a
backend and tells it how the request went. The router owns everything about machines: the
route table from the registry replica, health, concurrency limits, scale from zero, autostop
and failover.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Backend:
    """One machine a request may be sent to."""

    machine_id: str
    app: str
    worker_id: str
    region: str
    host: str
    port: int


class Router(Protocol):
    async def acquire(
        self, app: str, *, pinned: str | None = None, exclude: frozenset[str] = frozenset()
    ) -> Backend:
        """A backend for one request, counted as in flight until `release`.

        Waits (bounded) while a stopped machine is started or a slot under the hard limit
        frees up. Raises proxy.errors.UnknownApp (404) or NoBackend (503, with the reason).
        `pinned` asks for one machine id; `exclude` skips machines already tried.
        """
        ...

    def release(self, backend: Backend, *, ok: bool, connect_failed: bool = False) -> None:
        """The request on `backend` is over. `connect_failed`: the machine did not accept the
        connection (the router may mark it unhealthy); `ok`: a response came back."""
        ...
