"""The proxy's control plane: which machine serves each request (proxy.routing's `Router`).

`Router` keeps a table of each app's machines, fed by the embedded registry replica's events,
and adds what only the edge knows: requests in flight per machine, health, recent connection
failures, drained workers and workers this proxy declared dead. The data plane calls
`acquire`/`release` for every request; the fast path is a few dict lookups and a
power-of-two-choices pick, with no await.

The slow paths wait, always bounded and on the injected clock: for a slot under a machine's
hard limit (`queue_wait`), and for a machine being started (`cold_start_timeout`: scale from
zero, one start per app however many requests wait for it). The loops that change machines
(health checks, autostop, worker death and failover) are in proxy.control; `run` runs them.

An app is known while the registry has a machine of it (not destroyed) with a service.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import structlog
from opentelemetry.trace import Tracer

from flyd.v1 import machine_pb2 as pb
from proxy.control import (
    Counters,
    Flaps,
    FlapsFailed,
    HealthChecks,
    NetProbes,
    Probes,
    WorkerWatch,
    autostop_victims,
    sleep_until,
)
from proxy.errors import NoBackend, ProxyError, UnknownApp
from proxy.routing import Backend
from registry.replica import RESYNC, ReplicaEvent, Subscription, WorkerView
from registry.view import ALIVE, DEAD, SUSPECT, Status
from runtime.clock import Clock, SystemClock

log = structlog.get_logger("proxy.router")
S = pb.MachineState
STARTED = S.MACHINE_STATE_STARTED
_STARTABLE = frozenset({S.MACHINE_STATE_STOPPED, S.MACHINE_STATE_CREATED})
_STATE_NAMES: dict[int, str] = {
    int(value): name.removeprefix("MACHINE_STATE_").lower() for name, value in S.items() if value
}
# At most this many autostop calls to flaps at once.
STOP_CONCURRENCY = 8


class UnknownWorker(ProxyError):
    """DrainWorker named a worker the registry does not know."""

    status = 404


class RegistryView(Protocol):
    """The reads the router needs from the registry replica (registry.replica.Replica)."""

    def workers(self, region: str | None = None) -> list[WorkerView]: ...

    def worker(self, worker_id: str) -> WorkerView | None: ...

    def machines(
        self, *, app: str | None = None, region: str | None = None, worker_id: str | None = None
    ) -> list[pb.Machine]: ...

    def subscribe(self, maxsize: int = 1024) -> Subscription[ReplicaEvent]: ...


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
        """Standbys start only when their primary's worker is lost, never on demand."""
        return len(self.machine.config.standbys) > 0

    def refresh(self, machine: pb.Machine, fallback_host: str) -> None:
        """Take a new row of the machine: the address may change with its config."""
        self.machine = machine
        internal = self.service.internal_port
        mapping = next((p for p in machine.ports if p.internal_port == internal), None)
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
class _Wait:
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


def state_name(state: int) -> str:
    return _STATE_NAMES.get(state, "unknown")


class Router:
    """proxy.routing.Router over the registry replica; see the module docstring.

    `flaps` starts and stops machines (None: no autostart, autostop or failover). `probes`
    looks at workers and machines directly (default: real sockets). `rng` makes the random
    choices of tests repeatable. `tracer` (tracing on) traces failovers.
    """

    def __init__(
        self,
        registry: RegistryView,
        flaps: Flaps | None,
        stats: Counters,
        *,
        config: RouterConfig | None = None,
        probes: Probes | None = None,
        clock: Clock | None = None,
        rng: random.Random | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.registry = registry
        self.flaps = flaps
        self.stats = stats
        self.config = config if config is not None else RouterConfig()
        self.probes: Probes = probes if probes is not None else NetProbes()
        self.clock: Clock = clock if clock is not None else SystemClock()
        self._rng = rng if rng is not None else random.Random()
        self._apps: dict[str, AppState] = {}
        self._routes: dict[str, Route] = {}
        # Worker id -> its routes: losing a worker costs its machines, not the fleet's.
        self._by_worker: dict[str, dict[str, Route]] = {}
        self._workers: dict[str, WorkerState] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._stop_slots = asyncio.Semaphore(STOP_CONCURRENCY)
        self._lost_listeners: list[Callable[[frozenset[str], str], object]] = []
        self._shutdown = asyncio.Event()
        self._running = False
        self._closed = False
        self.checks = HealthChecks(
            self.probes,
            self.clock,
            self._report_check,
            concurrency=self.config.check_concurrency,
            warm_for=self.config.cold_start_timeout,
        )
        self.watch = WorkerWatch(
            self,
            self.probes,
            flaps,
            stats,
            self.clock,
            probe_timeout=self.config.probe_timeout,
            probe_interval=self.config.probe_interval,
            attempts=self.config.failover_attempts,
            tracer=tracer,
        )

    # -- the data plane's side (proxy.routing.Router) -----------------------------------------

    async def acquire(
        self, app: str, *, pinned: str | None = None, exclude: frozenset[str] = frozenset()
    ) -> Backend:
        deadline = first = 0.0
        kinds: set[str] = set()
        while True:
            state = self._apps.get(app)
            if state is None:
                raise UnknownApp(f"no app named {app!r}")
            if self._closed:
                raise NoBackend("the proxy is shutting down")
            got = self._choose(app, state, pinned, exclude)
            if isinstance(got, Route):
                return self._take(got)
            now = self.clock.now()
            if not kinds:
                first = now
            if got.kind not in kinds:
                kinds.add(got.kind)
                budget = (
                    self.config.queue_wait if got.kind == "hard" else self.config.cold_start_timeout
                )
                deadline = max(deadline, now + budget)
            if now >= deadline:
                raise NoBackend(f"{got.reason} (waited {now - first:.3g}s)")
            await self._wait(state, deadline)

    def try_acquire(
        self, app: str, *, pinned: str | None = None, exclude: frozenset[str] = frozenset()
    ) -> Backend | None:
        """What `acquire` returns when it need not wait, else None (then call `acquire`).

        Lets the data plane send a request from its parser callback without a task switch.
        """
        state = self._apps.get(app)
        if state is None or self._closed:
            return None
        got = self._choose(app, state, pinned, exclude)
        return self._take(got) if isinstance(got, Route) else None

    def _take(self, route: Route) -> Backend:
        route.in_flight += 1
        route.last_active = self.clock.now()
        assert route.backend is not None
        return route.backend

    def release(self, backend: Backend, *, ok: bool, connect_failed: bool = False) -> None:
        r = self._routes.get(backend.machine_id)
        if r is None:
            return  # destroyed while the request ran
        if r.in_flight > 0:
            r.in_flight -= 1
        now = self.clock.now()
        r.last_active = now
        if connect_failed:
            r.penalty_until = now + self.config.unhealthy_for
            log.info("machine_refused_connection", machine_id=r.id, for_s=self.config.unhealthy_for)
        state = self._apps.get(r.app)
        if state is not None and state.waiters:
            state.pulse()

    # -- choosing ------------------------------------------------------------------------------

    def _choose(
        self, app: str, state: AppState, pinned: str | None, exclude: frozenset[str]
    ) -> Route | _Wait:
        now = self.clock.now()
        if pinned is not None:
            return self._choose_pinned(app, state, pinned, now)
        ready: list[Route] = []
        why: Counter[str] = Counter()
        for r in state.routes.values():
            if r.id in exclude:
                why["already tried"] += 1
                continue
            reason = self._unroutable(r, now)
            if reason is None:
                ready.append(r)
            else:
                why[reason] += 1
        if ready:
            choice, over_soft = self._balance(ready)
            if over_soft:
                # Every machine is past its soft limit: bring another up for what comes next.
                self._start_one(app, state, now, cold=False)
            if choice is None:
                return _Wait(
                    "hard", f"all {len(ready)} machines of app {app} are at their hard limit"
                )
            return choice
        warming = self._warming(state, now)
        if warming is not None:
            return _Wait("start", f"machine {warming} of app {app} did not become ready in time")
        started = self._start_one(app, state, now, cold=True)
        if started is not None:
            return _Wait("start", f"machine {started} of app {app} did not become ready in time")
        raise NoBackend(self._explain(app, state, why, now))

    def _choose_pinned(self, app: str, state: AppState, pinned: str, now: float) -> Route | _Wait:
        r = state.routes.get(pinned)
        if r is None:
            raise NoBackend(f"app {app} has no machine {pinned}")
        reason = self._unroutable(r, now)
        if reason is None:
            if not _under_hard(r):
                return _Wait("hard", f"machine {pinned} is at its hard limit")
            return r
        if self._is_warming(r, now):
            return _Wait("start", f"machine {pinned} did not become ready in time")
        if self._startable(r, now) and self.flaps is not None:
            self._begin_start(state, r, now, cold=True)
            return _Wait("start", f"machine {pinned} did not become ready in time")
        raise NoBackend(f"machine {pinned} of app {app} cannot serve: {reason}")

    def _balance(self, ready: list[Route]) -> tuple[Route | None, bool]:
        """The least loaded of two random choices, from the best tier that has any: own region
        under the soft limit, any region under the soft limit, own region under the hard
        limit, any under the hard limit. Also whether every machine is past its soft limit."""
        region = self.config.region
        local = [r for r in ready if r.region == region]
        soft = [r for r in local if _under_soft(r)]
        if not soft:
            soft = [r for r in ready if _under_soft(r)]
        if soft:
            return self._two_choices(soft), False
        hard = [r for r in local if _under_hard(r)]
        if not hard:
            hard = [r for r in ready if _under_hard(r)]
        return (self._two_choices(hard) if hard else None), True

    def _two_choices(self, pool: list[Route]) -> Route:
        if len(pool) == 1:
            return pool[0]
        a, b = self._rng.sample(pool, 2)
        return a if a.in_flight <= b.in_flight else b

    def _unroutable(self, r: Route, now: float) -> str | None:
        """Why `r` cannot take a request now, or None when it can."""
        if r.state != STARTED:
            name = state_name(r.state)
            if r.state in _STARTABLE and r.is_standby:
                return f"{name} standby"
            if r.state in _STARTABLE and not r.autostart:
                return f"{name} without autostart"
            return name
        w = self._workers.get(r.worker_id)
        if w is not None and w.dead:
            return "on a dead worker"
        if w is not None and w.draining:
            return "on a draining worker"
        if r.stopping:
            return "being stopped (idle)"
        if not r.port:
            return "without a service port"
        if not r.ready:
            if now < r.warm_until:
                return "warming up"
            return "failing health checks" if r.was_ready else "never became ready"
        if now < r.penalty_until:
            return "refused a connection recently"
        return None

    def _worker_usable(self, worker_id: str) -> bool:
        w = self._workers.get(worker_id)
        return w is None or not (w.dead or w.draining)

    def _is_warming(self, r: Route, now: float) -> bool:
        """Whether `r` will (probably) be routable soon without anyone doing anything."""
        if not self._worker_usable(r.worker_id):
            return False
        if r.state == STARTED:
            return not r.ready and now < r.warm_until and not r.stopping
        if r.state in (S.MACHINE_STATE_STARTING, S.MACHINE_STATE_RESTARTING):
            return True
        return (
            r.start_requested is not None
            and now < r.start_requested + self.config.cold_start_timeout
        )

    def _warming(self, state: AppState, now: float) -> str | None:
        if state.starting is not None:
            return state.starting
        for r in state.routes.values():
            if self._is_warming(r, now):
                return r.id
            if (r.stopping or r.state == S.MACHINE_STATE_STOPPING) and self._can_autostart(r):
                return r.id  # stopping for idleness: startable again in a moment
        return None

    def _can_autostart(self, r: Route) -> bool:
        return r.autostart and not r.is_standby and self._worker_usable(r.worker_id)

    def _startable(self, r: Route, now: float) -> bool:
        if r.state not in _STARTABLE or not self._can_autostart(r):
            return False
        view = self.registry.worker(r.worker_id)
        if view is None or view.status == DEAD:
            return False
        return r.start_error is None or now >= r.start_error[0]

    def _start_one(self, app: str, state: AppState, now: float, *, cold: bool) -> str | None:
        """Start one stopped autostart machine of the app in the background (own region
        first, then by id), unless one is starting already; the machine starting, or None."""
        if state.starting is not None:
            return state.starting
        if self.flaps is None:
            return None
        if not cold and any(self._is_warming(r, now) for r in state.routes.values()):
            return None  # one is coming up already
        region = self.config.region
        candidates = [r for r in state.routes.values() if self._startable(r, now)]
        if not candidates:
            return None
        r = min(candidates, key=lambda r: (r.region != region, r.id))
        self._begin_start(state, r, now, cold=cold)
        return r.id

    def _begin_start(self, state: AppState, r: Route, now: float, *, cold: bool) -> None:
        state.starting = r.id
        r.start_requested = now
        r.start_error = None
        self._spawn(self._start(state, r, cold), f"start {r.id}")

    async def _start(self, state: AppState, r: Route, cold: bool) -> None:
        assert self.flaps is not None
        log.info("starting_machine", machine_id=r.id, app=r.app, cold=cold)
        try:
            await self.flaps.start(r.id)
        except FlapsFailed as err:
            r.start_requested = None
            r.start_error = (self.clock.now() + self.config.start_retry_after, str(err))
            log.warning("start_failed", machine_id=r.id, error=str(err))
        else:
            if cold:
                self.stats.cold_start()
        finally:
            if state.starting == r.id:
                state.starting = None
            state.pulse()

    def _explain(self, app: str, state: AppState, why: Counter[str], now: float) -> str:
        """Why nothing of the app can serve, for the 503 body."""
        parts = ", ".join(f"{n} {reason}" for reason, n in sorted(why.items()))
        message = f"no machine of app {app} can serve ({parts})"
        errors = [
            r.start_error[1]
            for r in state.routes.values()
            if r.start_error is not None and now < r.start_error[0]
        ]
        if errors:
            return f"{message}; starting one failed: {errors[0]}"
        if self.flaps is None and any(r.state in _STARTABLE for r in state.routes.values()):
            return f"{message}; this proxy has no flaps to start machines"
        return message

    async def _wait(self, state: AppState, deadline: float) -> None:
        state.waiters += 1
        changed = asyncio.ensure_future(state.changed.wait())
        timer = asyncio.ensure_future(self.clock.sleep_until(deadline))
        try:
            await asyncio.wait({changed, timer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            state.waiters -= 1
            changed.cancel()
            timer.cancel()

    # -- admin -----------------------------------------------------------------------------

    def routes(self, app: str | None = None) -> list[tuple[str, list[RouteInfo]]]:
        """Each app's machines (one app when named), sorted by app and machine id."""
        names = sorted(self._apps) if app is None else [app] if app in self._apps else []
        now = self.clock.now()
        out = []
        for name in names:
            infos = []
            for r in sorted(self._apps[name].routes.values(), key=lambda r: r.id):
                w = self._workers.get(r.worker_id)
                infos.append(
                    RouteInfo(
                        machine_id=r.id,
                        worker_id=r.worker_id,
                        region=r.region,
                        state=r.state,
                        address=f"{r.host}:{r.port}" if r.port else "",
                        in_flight=r.in_flight,
                        healthy=r.state == STARTED
                        and r.ready
                        and now >= r.penalty_until
                        and not self.is_dead(r.worker_id),
                        draining=w is not None and w.draining,
                    )
                )
            out.append((name, infos))
        return out

    def drain(self, worker_id: str, draining: bool = True) -> bool:
        """Stop (or resume) routing new requests to a worker's machines; its new state.

        Raises UnknownWorker when the registry does not know the worker.
        """
        if self.registry.worker(worker_id) is None and worker_id not in self._workers:
            raise UnknownWorker(f"worker {worker_id} not found")
        w = self._workers.setdefault(worker_id, WorkerState(worker_id))
        if w.draining != draining:
            w.draining = draining
            log.info("worker_drain", worker=worker_id, draining=draining)
            self._pulse_worker(worker_id)
        return w.draining

    def in_flight_by_app(self) -> dict[str, int]:
        """Requests in flight now, by app (for metrics)."""
        return {
            app: sum(r.in_flight for r in state.routes.values())
            for app, state in self._apps.items()
        }

    def is_dead(self, worker_id: str) -> bool:
        w = self._workers.get(worker_id)
        return w is not None and w.dead

    # -- for the control loops (proxy.control.RouteTable) ---------------------------------------

    @staticmethod
    def silent(status: Status) -> bool:
        """Whether the registry says a worker stopped sending heartbeats."""
        return status in (SUSPECT, DEAD)

    def standby_usable(self, worker_id: str) -> bool:
        """Whether a standby on this worker may be started: alive and not drained."""
        view = self.registry.worker(worker_id)
        return view is not None and view.status == ALIVE and self._worker_usable(worker_id)

    def on_machines_lost(self, listener: Callable[[frozenset[str], str], object]) -> None:
        """Call `listener(machine_ids, reason)` when machines are lost with their worker (it
        is declared dead): the data plane ends the requests in flight to them at once
        instead of waiting out the upstream timeout. Called after the router stopped routing
        to them and marked the standbys starting, so a request sent again waits for those."""
        self._lost_listeners.append(listener)

    def declare_dead(self, worker_id: str, reason: str) -> None:
        """Stop routing to the worker's machines now and start standbys for them."""
        w = self._workers.setdefault(worker_id, WorkerState(worker_id))
        if w.dead or self._closed:
            return
        w.dead = True
        self.stats.worker_dead()
        log.warning("worker_declared_dead", worker=worker_id, reason=reason)
        lost = []
        for r in self._by_worker.get(worker_id, {}).values():
            self._stop_watching(r)
            r.ready = False
            lost.append(r.id)
        plan = self.watch.plan(worker_id)
        now = self.clock.now()
        for _, standbys in plan:
            # Requests wait for the standby about to start instead of failing meanwhile.
            standby = self._routes.get(standbys[0])
            if standby is not None and self.flaps is not None:
                standby.start_requested = now
        self._pulse_worker(worker_id)
        if plan or self.watch.tracer is not None:  # (traced even when there is nothing to start)
            self._spawn(
                self.watch.failover(worker_id, plan, self._shutdown), f"failover {worker_id}"
            )
        if lost:
            machines = frozenset(lost)
            why = f"its worker {worker_id} was declared dead ({reason})"
            for listener in self._lost_listeners:
                try:
                    listener(machines, why)
                except Exception:
                    log.exception("machines_lost_listener_failed", worker=worker_id)

    def standby_failed(self, machine_id: str) -> None:
        """A standby could not be started: requests stop waiting for it."""
        r = self._routes.get(machine_id)
        if r is not None and r.state != STARTED:
            r.start_requested = None
            state = self._apps.get(r.app)
            if state is not None:
                state.pulse()

    def autostop_once(self) -> list[str]:
        """Begin stopping the machines idle past `idle_timeout`; their ids."""
        if self.flaps is None:
            return []
        victims = autostop_victims(
            self._routes.values(),
            now=self.clock.now(),
            idle_timeout=self.config.idle_timeout,
            usable=self._worker_usable,
        )
        for r in victims:
            r.stopping = True
            self._spawn(self._stop(r), f"autostop {r.id}")
        return [r.id for r in victims]

    async def _stop(self, r: Route) -> None:
        assert self.flaps is not None
        async with self._stop_slots:
            log.info("autostop", machine_id=r.id, app=r.app, idle_for=self.config.idle_timeout)
            try:
                await self.flaps.stop(r.id)
            except FlapsFailed as err:
                r.stopping = False
                log.warning("autostop_failed", machine_id=r.id, error=str(err))
        state = self._apps.get(r.app)
        if state is not None:
            state.pulse()

    def _report_check(self, r: Route, ok: bool) -> None:
        if self._routes.get(r.id) is not r:
            return
        if ok and not r.ready:
            log.info("machine_ready", machine_id=r.id, app=r.app)
        elif not ok and r.ready:
            log.warning("machine_unhealthy", machine_id=r.id, app=r.app)
        r.ready = ok
        if ok:
            r.warm_until = 0.0
            r.was_ready = True
        state = self._apps.get(r.app)
        if state is not None:
            state.pulse()

    # -- following the registry ----------------------------------------------------------------

    async def run(self, shutdown: asyncio.Event) -> None:
        """Follow the registry and run the control loops until `shutdown` is set."""
        if self._running:
            raise RuntimeError("a Router runs only once")
        self._running = True
        self._shutdown = shutdown
        sub = self.registry.subscribe(maxsize=4096)
        self._resync()  # no await since subscribing: nothing is missed
        loops = [
            asyncio.create_task(self._follow(sub), name="proxy/follow"),
            asyncio.create_task(self._autostop_loop(shutdown), name="proxy/autostop"),
        ]
        waiter = asyncio.create_task(shutdown.wait())
        try:
            done, _ = await asyncio.wait({waiter, *loops}, return_when=asyncio.FIRST_COMPLETED)
            for task in loops:
                if task in done:
                    task.result()  # a loop never ends on its own: raise why it did
        finally:
            self._closed = True
            sub.close()
            tasks: list[asyncio.Task[Any]] = [waiter, *loops, *self._tasks]
            for r in self._routes.values():
                if r.watcher is not None:
                    tasks.append(r.watcher)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for state in self._apps.values():
                state.pulse()
            log.info("router_stopped")

    async def _follow(self, sub: Subscription[ReplicaEvent]) -> None:
        async for event in sub:
            if event is RESYNC or event.kind == "resync":
                sub.clear()
                self._resync()
            elif event.kind == "machine":
                self._on_machine(event.machine_id, event.machine)
            else:
                self._on_worker(event.worker_id)

    async def _autostop_loop(self, shutdown: asyncio.Event) -> None:
        while await sleep_until(
            self.clock, self.clock.now() + self.config.autostop_interval, shutdown
        ):
            self.autostop_once()

    def _resync(self) -> None:
        """Make the table match the registry view in full."""
        seen = set()
        for machine in self.registry.machines():
            seen.add(machine.id)
            self._on_machine(machine.id, machine)
        for machine_id in [mid for mid in self._routes if mid not in seen]:
            self._on_machine(machine_id, None)
        for view in self.registry.workers():
            self._on_worker(view.info.id)

    def _on_machine(self, machine_id: str, machine: pb.Machine | None) -> None:
        r = self._routes.get(machine_id)
        if (
            machine is None
            or machine.state == S.MACHINE_STATE_DESTROYED
            or not (machine.config.services)
        ):
            if r is not None:
                self._remove(r)
            return
        now = self.clock.now()
        if r is None:
            r = Route(machine=machine, last_active=now)
            state = self._apps.get(machine.app)
            if state is None:
                state = self._apps[machine.app] = AppState()
                log.info("app_known", app=machine.app)
            state.routes[machine_id] = r
            self._routes[machine_id] = r
            self._by_worker.setdefault(r.worker_id, {})[machine_id] = r
            was, old_instance = None, ""
        else:
            # Never happens with flyd; keep the indexes right anyway.
            if r.app != machine.app or r.worker_id != machine.worker_id:
                self._remove(r)
                self._on_machine(machine_id, machine)
                return
            was, old_instance = r.state, r.machine.instance_id
        r.refresh(machine, self._worker_host(machine.worker_id))
        if machine.state == STARTED:
            r.start_requested = None
            r.start_error = None
            if was != STARTED or old_instance != machine.instance_id:
                r.last_active = now
                self._watch(r, now)
        else:
            self._stop_watching(r)
            r.ready = False
            if machine.state != S.MACHINE_STATE_STOPPING:
                r.stopping = False
        state = self._apps.get(machine.app)
        if state is not None:
            state.pulse()

    def _worker_host(self, worker_id: str) -> str:
        view = self.registry.worker(worker_id)
        if view is None:
            return "127.0.0.1"
        host = view.info.address.rpartition(":")[0]
        return host.strip("[]") or "127.0.0.1"

    def _remove(self, r: Route) -> None:
        self._stop_watching(r)
        self._routes.pop(r.id, None)
        held = self._by_worker.get(r.worker_id)
        if held is not None:
            held.pop(r.id, None)
            if not held:
                del self._by_worker[r.worker_id]
        state = self._apps.get(r.app)
        if state is None:
            return
        state.routes.pop(r.id, None)
        state.pulse()
        if not state.routes:
            del self._apps[r.app]
            log.info("app_gone", app=r.app)

    def _watch(self, r: Route, now: float) -> None:
        """(Re)verify a started machine: no traffic until its checks pass."""
        self._stop_watching(r)
        r.ready = r.was_ready = False
        if not self._running or self._closed or self.is_dead(r.worker_id):
            return
        r.warm_until = now + self.config.cold_start_timeout
        r.watcher = asyncio.create_task(
            self.checks.watch(r, self._shutdown), name=f"proxy/check {r.id}"
        )
        r.watcher.add_done_callback(_log_crash)

    def _stop_watching(self, r: Route) -> None:
        if r.watcher is not None:
            r.watcher.cancel()
            r.watcher = None

    def _on_worker(self, worker_id: str) -> None:
        view = self.registry.worker(worker_id)
        if view is None:
            return
        w = self._workers.setdefault(worker_id, WorkerState(worker_id))
        if self.silent(view.status):
            if not w.dead and (w.probe is None or w.probe.done()) and not self._closed:
                log.info("worker_silent", worker=worker_id, status=int(view.status))
                w.probe = self._spawn(
                    self.watch.probe(worker_id, self._shutdown), f"probe {worker_id}"
                )
        elif view.status == ALIVE and w.dead:
            # Back after it was declared dead: its machines get traffic again once their
            # checks pass.
            w.dead = False
            log.info("worker_back", worker=worker_id)
            now = self.clock.now()
            for r in self._by_worker.get(worker_id, {}).values():
                if r.state == STARTED:
                    self._watch(r, now)
            self._pulse_worker(worker_id)

    def _pulse_worker(self, worker_id: str) -> None:
        for app in {r.app for r in self._by_worker.get(worker_id, {}).values()}:
            self._apps[app].pulse()

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=f"proxy/{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_crash)
        return task


def _under_hard(r: Route) -> bool:
    return not r.hard_limit or r.in_flight < r.hard_limit


def _under_soft(r: Route) -> bool:
    """Under the soft limit (and so under the hard one, whichever is lower)."""
    return _under_hard(r) and (not r.soft_limit or r.in_flight < r.soft_limit)


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("task_crashed", task=task.get_name(), exc_info=task.exception())
