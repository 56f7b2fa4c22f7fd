"""The route table's rows and the router's settings: what proxy.router keeps per machine,
per worker and per app, and how long any of its waits may last.

`Route` is one machine as the edge sees it (the registry's row plus requests in flight,
readiness, penalties, autostop and start state); `WorkerState` what this proxy decided of a
worker (dead, draining); `AppState` an app's routes and the event its waiting requests sleep
on. `RouterConfig` bounds every wait; `RegistryView` is what the router reads of the replica.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Literal, Protocol

from flyd.v1 import machine_pb2 as pb
from model import slots
from proxy.errors import ProxyError
from proxy.routing import Backend
from registry.replica import ReplicaEvent, Subscription, WorkerView

S = pb.MachineState
STARTED = S.MACHINE_STATE_STARTED
STARTABLE = frozenset({S.MACHINE_STATE_STOPPED, S.MACHINE_STATE_CREATED})
"""States a machine can be started from."""
_STATE_NAMES: dict[int, str] = {
    int(value): name.removeprefix("MACHINE_STATE_").lower() for name, value in S.items() if value
}


class UnknownWorker(ProxyError):
    """DrainWorker named a worker the registry does not know."""

    status = 404


class RegistryView(Protocol):
    """The reads the router needs from the registry replica (registry.replica.Replica)."""

    def workers(self, region: str | None = None) -> list[WorkerView]: ...

    def worker(self, worker_id: str) -> WorkerView | None: ...

    def machine(self, machine_id: str) -> pb.Machine | None: ...

    def machines(
        self, *, app: str | None = None, region: str | None = None, worker_id: str | None = None
    ) -> list[pb.Machine]: ...

    def subscribe(
        self, maxsize: int = 1024, *, coalesce: bool = False
    ) -> Subscription[ReplicaEvent]: ...


@dataclass(frozen=True)
class RouterConfig:
    """How the router behaves; every wait it does is bounded by one of these (seconds)."""

    region: str = "local"
    """The proxy's own region: its machines are preferred."""
    queue_wait: float = 2.0
    """Longest a request waits for a slot when every machine is at its hard limit."""
    cold_start_timeout: float = 10.0
    """Longest a request waits for a machine to start and accept connections."""
    idle_timeout: float = 300.0
    """An autostop machine without a request for this long is stopped."""
    autostop_interval: float = 1.0
    """How often idle machines are looked for."""
    unhealthy_for: float = 2.0
    """A machine that refused a connection gets no traffic for this long."""
    probe_timeout: float = 0.3
    """Deadline of the direct probe of a worker the registry finds silent."""
    probe_interval: float = 0.5
    """A silent worker that answered its probe is probed again after this."""
    check_concurrency: int = 64
    """Health checks running at once, proxy-wide."""
    start_retry_after: float = 5.0
    """A machine whose start failed is not tried again for this long."""
    failover_attempts: int = 5
    """flaps calls tried per lost primary before giving up."""
    supersede_retry: float = 2.0
    """An outranked copy still running on a live worker is reported to it again after this."""

    def __post_init__(self) -> None:
        for name in (
            "queue_wait",
            "cold_start_timeout",
            "idle_timeout",
            "autostop_interval",
            "unhealthy_for",
            "probe_timeout",
            "probe_interval",
            "start_retry_after",
            "supersede_retry",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.check_concurrency < 1 or self.failover_attempts < 1:
            raise ValueError("check_concurrency and failover_attempts must be at least 1")


@dataclass(eq=False)
class Route:
    """One machine as the router sees it: the registry's row plus what the edge knows."""

    machine: pb.Machine
    host: str = ""
    port: int = 0
    backend: Backend | None = None
    in_flight: int = 0
    ready: bool = False
    """Its checks pass (without checks: its port accepted) since it last became started."""
    was_ready: bool = False
    """It passed its checks at least once since it last became started."""
    warm_until: float = 0.0
    """Until then an unready started machine is warming up (requests wait for it)."""
    penalty_until: float = 0.0
    """It refused a connection: no traffic until then."""
    last_active: float = 0.0
    """Clock time of the last request begun or ended on it, or of it starting."""
    stopping: bool = False
    """Autostop asked flaps to stop it (no new requests)."""
    start_requested: float | None = None
    """When this proxy asked flaps to start it (until the registry shows it started)."""
    start_error: tuple[float, str] | None = None
    """(until when it is not tried again, why its last start failed)."""
    watcher: asyncio.Task[None] | None = None
    slot: slots.SlotKey | None = None
    """(app, slot id): the slot it is a member of (proxy.fencing.SlotIndex keeps it)."""
    serving: bool = True
    """Its row holds its slot's top claim: the only member of the slot that gets requests."""
    peers: int = 0
    """How many other members its slot has (0: it stands alone)."""
    supersede_after: float = 0.0
    """Its worker was told it is outranked; not again before this."""

    @property
    def id(self) -> str:
        return self.machine.id

    @property
    def app(self) -> str:
        return self.machine.app

    @property
    def worker_id(self) -> str:
        return self.machine.worker_id

    @property
    def region(self) -> str:
        return self.machine.region

    @property
    def state(self) -> pb.MachineState.ValueType:
        return self.machine.state

    @property
    def service(self) -> pb.ServiceConfig:
        return self.machine.config.services[0]

    @property
    def soft_limit(self) -> int:
        return self.service.concurrency.soft_limit

    @property
    def hard_limit(self) -> int:
        return self.service.concurrency.hard_limit

    @property
    def autostart(self) -> bool:
        return any(s.autostart for s in self.machine.config.services)

    @property
    def autostop(self) -> bool:
        return any(s.autostop for s in self.machine.config.services)

    @property
    def min_running(self) -> int:
        return max(s.min_machines_running for s in self.machine.config.services)

    @property
    def is_standby(self) -> bool:
        """Standbys start only when promoted (their primary's worker is lost), never on demand."""
        return not slots.is_primary(self.machine)

    @property
    def fenced(self) -> bool:
        """Its worker came back and has not confirmed its claim yet (flyd.fencing), and its
        slot has another member that may have taken over: a machine alone in its slot has
        nobody to be superseded by, so its fence does not keep requests from it."""
        return self.machine.slot.fenced and self.peers > 0

    def refresh(self, machine: pb.Machine, fallback_host: str) -> None:
        """Take a new row of the machine: the address may change with its config."""
        self.machine = machine
        internal = self.service.internal_port
        mapping = next((p for p in machine.ports if p.internal_port == internal), None)
        if machine.address and mapping is not None:
            # Its worker routes machines: the machine itself, on its own address, from any
            # host that routes the worker's prefix (no hop through the worker's host port).
            self.host, self.port = machine.address, internal
        else:
            self.host = (mapping.host if mapping is not None else "") or fallback_host
            self.port = mapping.host_port if mapping is not None else 0
        backend = Backend(
            machine_id=machine.id,
            app=machine.app,
            worker_id=machine.worker_id,
            region=machine.region,
            host=self.host,
            port=self.port,
        )
        if backend != self.backend:
            self.backend = backend


@dataclass(eq=False)
class WorkerState:
    id: str
    dead: bool = False
    """Declared dead by this proxy: heartbeats stopped and a direct probe failed."""
    draining: bool = False
    """An operator asked (DrainWorker) for no new requests to its machines."""
    probe: asyncio.Task[None] | None = None
    status: int = 0
    """Its registry status when the router last looked (registry.v1 MemberStatus)."""


@dataclass(eq=False)
class AppState:
    routes: dict[str, Route] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    waiters: int = 0
    starting: str | None = None
    """The machine this proxy is starting for the app right now (one at a time)."""

    def pulse(self) -> None:
        """Wake every request waiting on the app to look again."""
        self.changed.set()
        self.changed = asyncio.Event()


@dataclass(frozen=True)
class Wait:
    """Why a request must wait: for a slot under a hard limit, or for a machine to start."""

    kind: Literal["hard", "start"]
    reason: str


@dataclass(frozen=True)
class RouteInfo:
    """One machine as ListRoutes shows it."""

    machine_id: str
    worker_id: str
    region: str
    state: pb.MachineState.ValueType
    address: str
    in_flight: int
    healthy: bool
    draining: bool
    generation: int = 0
    superseded: bool = False
    fenced: bool = False


def state_name(state: int) -> str:
    return _STATE_NAMES.get(state, "unknown")


def under_hard(r: Route) -> bool:
    return not r.hard_limit or r.in_flight < r.hard_limit


def under_soft(r: Route) -> bool:
    """Under the soft limit (and so under the hard one, whichever is lower)."""
    return under_hard(r) and (not r.soft_limit or r.in_flight < r.soft_limit)
