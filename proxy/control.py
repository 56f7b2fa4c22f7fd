"""What the proxy's control plane does to machines, and the I/O it needs to do it.

`proxy.router.Router` owns the route table and decides; this module feeds it, and knows the
router only as the Protocols `RouteTable` and `MachineRoute` (it never imports proxy.router):

- the narrow edges to the outside, each a Protocol with one real implementation here and a
  fake in the tests: `Flaps` (start and stop machines, `FlapsClient` over gRPC) and `Probes`
  (is a worker's flyd answering, does a machine's port accept, does its HTTP check pass:
  `NetProbes`);
- the decisions, as pure functions over the table: `checks_of` (what to check on a machine:
  model.checks, which flyd's readiness runs too),
  `autostop_victims` (which idle machines to stop without going below min_machines_running),
  `standby_candidates` (which standby takes over a lost primary, at which generation: the same
  on every proxy, and each generation one member's own: `model.slots.promotion_generation`);
- the loops that act on them: `HealthChecks.watch` (one per started machine), `WorkerWatch`
  (probe a silent worker, declare it dead, promote one standby per lost primary).

Every loop takes the shutdown event and sleeps on the injected clock, so tests drive time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Generic, Protocol, TypeVar

import grpc
import grpc.aio
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.trace import SpanKind, Tracer

from flaps.v1 import machines_pb2, machines_pb2_grpc, tokens_pb2, tokens_pb2_grpc
from flyd.v1 import machine_pb2 as pb
from model import checks, slots
from model.checks import DEFAULT_CHECK_TIMEOUT, CheckSpec, checks_of
from proxy.errors import ProxyError
from registry.replica import WorkerView
from registry.view import Status
from runtime import ChannelTLS, aio_channel, error_info, transport
from runtime.clock import Clock

log = structlog.get_logger("proxy.control")
S = pb.MachineState

# While a machine warms up (just started, or its worker came back), its checks are polled this
# fast, doubling up to the max: the first request waits for the port, not for an interval.
READY_POLL_MIN = 0.005
READY_POLL_MAX = 0.02
# A machine without checks that did not accept within the warm-up window is polled this often.
SLOW_READY_POLL = 1.0
# flaps calls: deadline of one call, and the pause before retrying a retryable failure.
FLAPS_TIMEOUT = 10.0
FLAPS_RETRY = 0.2

# Codes after which another try of the same call may succeed.
_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
}


class FlapsFailed(ProxyError):
    """flaps (or the worker behind it) refused or failed a start or stop; 503 to a client.

    `superseded`: a promotion was refused because the slot moved on already (someone else
    promoted a member): nothing to retry, and no other standby to try."""

    status = 503

    def __init__(
        self, message: str, *, code: grpc.StatusCode | None = None, reason: str = ""
    ) -> None:
        super().__init__(message)
        self.code = code
        self.superseded = reason == "SUPERSEDED"
        self.retryable = (code is None or code in _RETRYABLE) and not self.superseded


# -- the edges ---------------------------------------------------------------------------------


class Flaps(Protocol):
    """The part of the Machines API the proxy uses. Every call is idempotent."""

    async def start(self, machine_id: str, generation: int = 0) -> pb.Machine:
        """Start a stopped or created machine (a started one: no-op); with a generation,
        promote it in its slot (model.slots). Raises FlapsFailed."""
        ...

    async def stop(self, machine_id: str) -> pb.Machine:
        """Stop a machine; raises FlapsFailed."""
        ...

    async def supersede(self, machine_id: str, generation: int, primary: str) -> pb.Machine:
        """Tell the machine's worker that `primary` serves its slot at `generation` (an
        outranked copy stops and stands by). Raises FlapsFailed."""
        ...


class FlapsClient:
    """`Flaps` over gRPC to one flaps instance (any will do: flaps holds no state)."""

    def __init__(
        self,
        address: str,
        *,
        timeout: float = FLAPS_TIMEOUT,
        channel: Callable[[str], grpc.aio.Channel] | None = None,
        tls: ChannelTLS | None = None,
    ) -> None:
        """`tls`: the cluster's mutual TLS, for flaps' cluster port."""
        self.address = address
        self.timeout = timeout
        self._channel = channel(address) if channel else _flaps_channel(address, tls)
        self._stub = machines_pb2_grpc.MachinesServiceStub(self._channel)
        self._tokens = tokens_pb2_grpc.TokenServiceStub(self._channel)

    async def start(self, machine_id: str, generation: int = 0) -> pb.Machine:
        try:
            resp = await self._stub.StartMachine(
                machines_pb2.StartMachineRequest(machine_id=machine_id, generation=generation),
                timeout=self.timeout,
            )
        except grpc.aio.AioRpcError as err:
            raise _failed("start", machine_id, err) from None
        return resp.machine

    async def supersede(self, machine_id: str, generation: int, primary: str) -> pb.Machine:
        try:
            resp = await self._stub.SupersedeMachine(
                machines_pb2.SupersedeMachineRequest(
                    machine_id=machine_id, generation=generation, primary=primary
                ),
                timeout=self.timeout,
            )
        except grpc.aio.AioRpcError as err:
            raise _failed("supersede", machine_id, err) from None
        return resp.machine

    async def stop(self, machine_id: str) -> pb.Machine:
        try:
            resp = await self._stub.StopMachine(
                machines_pb2.StopMachineRequest(machine_id=machine_id), timeout=self.timeout
            )
        except grpc.aio.AioRpcError as err:
            raise _failed("stop", machine_id, err) from None
        return resp.machine

    async def verify_token(self, token: str) -> tokens_pb2.VerifyTokenResponse:
        """What flaps says of a token (its grant, or why it is not valid): the proxy holds
        no root keys (proxy.pins). Raises FlapsFailed when flaps does not answer."""
        try:
            return await self._tokens.VerifyToken(
                tokens_pb2.VerifyTokenRequest(token=token), timeout=self.timeout
            )
        except grpc.aio.AioRpcError as err:
            code = err.code()
            raise FlapsFailed(f"flaps: {code.name}: {err.details() or ''}", code=code) from None

    async def close(self) -> None:
        await self._channel.close()


def _flaps_channel(address: str, tls: ChannelTLS | None) -> grpc.aio.Channel:
    # gRPC's reconnect backoff grows to two minutes by default: a flaps back after a restart
    # must be used again within a second, or scale from zero and failover wait for nothing.
    return aio_channel(
        address,
        tls=tls,
        options=[
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ],
    )


def _failed(verb: str, machine_id: str, err: grpc.aio.AioRpcError) -> FlapsFailed:
    code = err.code()
    info = error_info(err)
    return FlapsFailed(
        f"could not {verb} machine {machine_id}: {code.name}: {err.details() or ''}".rstrip(": "),
        code=code,
        reason=info.reason if info is not None else "",
    )


class Probes(Protocol):
    """Direct looks at workers and machines, each bounded by `timeout` (real seconds)."""

    async def worker(self, address: str, timeout: float) -> bool:
        """Whether the worker's gRPC health service answers SERVING."""
        ...

    async def tcp(self, host: str, port: int, timeout: float) -> bool:
        """Whether host:port accepts a connection."""
        ...

    async def http(self, host: str, port: int, path: str, method: str, timeout: float) -> bool:
        """Whether an HTTP request answers 2xx or 3xx."""
        ...


class NetProbes:
    """`Probes` over real sockets; `tls`: the cluster's mutual TLS, to reach workers."""

    def __init__(self, tls: ChannelTLS | None = None) -> None:
        self._credentials = tls.credentials() if tls is not None else None
        self._options = [("grpc.ssl_target_name_override", tls.server_name)] if tls else []

    async def worker(self, address: str, timeout: float) -> bool:
        # A fresh channel each time: a reused one may sit in reconnect backoff and fail a
        # worker that is back, or keep a half-open connection to one that is gone.
        channel = transport.current().channel(
            address, credentials=self._credentials, options=self._options, interceptors=None
        )
        try:
            resp = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
        except grpc.aio.AioRpcError as err:
            log.debug("worker_probe_failed", address=address, code=err.code().name)
            return False
        finally:
            await channel.close(grace=None)
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)

    async def tcp(self, host: str, port: int, timeout: float) -> bool:
        return await checks.tcp(host, port, timeout) is None

    async def http(self, host: str, port: int, path: str, method: str, timeout: float) -> bool:
        return await checks.http(host, port, path, method, timeout) is None


class Counters(Protocol):
    """What the router counts (proxy.stats.Stats)."""

    def cold_start(self) -> None: ...

    def failover(self) -> None: ...

    def standby_failed(self) -> None: ...

    def worker_dead(self) -> None: ...


# -- what the control loops know of the router -------------------------------------------------


class MachineRoute(Protocol):
    """One row of the route table as the checks and autostop read it (proxy.routes.Route)."""

    @property
    def machine(self) -> pb.Machine: ...

    @property
    def id(self) -> str: ...

    @property
    def app(self) -> str: ...

    @property
    def worker_id(self) -> str: ...

    @property
    def state(self) -> pb.MachineState.ValueType: ...

    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def last_active(self) -> float: ...

    @property
    def stopping(self) -> bool: ...

    @property
    def autostop(self) -> bool: ...

    @property
    def min_running(self) -> int: ...


R = TypeVar("R", bound=MachineRoute)


class RegistryReads(Protocol):
    """The registry reads `WorkerWatch` does (registry.replica.Replica)."""

    def worker(self, worker_id: str) -> WorkerView | None: ...

    def machines(
        self, *, app: str | None = None, worker_id: str | None = None
    ) -> list[pb.Machine]: ...


class RouteTable(Protocol):
    """What `WorkerWatch` needs of the router (proxy.router.Router): the registry the table is
    built from, the router's view of workers, and the two things the watch tells it."""

    @property
    def registry(self) -> RegistryReads: ...

    def silent(self, status: Status) -> bool:
        """Whether the registry's status says the worker stopped sending heartbeats."""
        ...

    def standby_usable(self, worker_id: str) -> bool: ...

    def is_dead(self, worker_id: str) -> bool: ...

    def declare_dead(self, worker_id: str, reason: str) -> None:
        """Stop routing to the worker's machines and start standbys for them."""
        ...

    def standby_failed(self, machine_id: str) -> None:
        """This standby could not be started: requests stop waiting for it."""
        ...


# -- decisions ---------------------------------------------------------------------------------


def autostop_victims(
    routes: Iterable[R], *, now: float, idle_timeout: float, usable: Callable[[str], bool]
) -> list[R]:
    """Machines to stop now: autostop, nothing in flight, idle for `idle_timeout`, and only as
    many per app as keep its started machines at or above min_machines_running (the highest
    any of its machines asks for). The longest idle go first."""
    by_app: dict[str, list[R]] = {}
    for r in routes:
        by_app.setdefault(r.app, []).append(r)
    victims = []
    for rs in by_app.values():
        running = [
            r
            for r in rs
            if r.state == S.MACHINE_STATE_STARTED and usable(r.worker_id) and not r.stopping
        ]
        floor = max((r.min_running for r in rs), default=0)
        spare = len(running) - floor
        for r in sorted(running, key=lambda r: (r.last_active, r.id)):
            if spare <= 0:
                break
            if r.autostop and r.in_flight == 0 and now - r.last_active >= idle_timeout:
                victims.append(r)
                spare -= 1
    return victims


# States in which a machine is (or is about to be) running: losing its worker loses it.
RUNNING = frozenset({S.MACHINE_STATE_STARTED, S.MACHINE_STATE_STARTING, S.MACHINE_STATE_RESTARTING})
_STARTABLE = frozenset({S.MACHINE_STATE_STOPPED, S.MACHINE_STATE_CREATED})


def standby_candidates(
    primary: pb.Machine, machines: Iterable[pb.Machine], usable: Callable[[str], bool]
) -> tuple[str | None, list[str]]:
    """For a lost primary: (another member of its slot already running, if any; the stopped
    members on usable workers, in the order to try them).

    The order is by machine id, and every proxy sees the same rows, so every proxy that
    notices the loss picks the same standby (and the same generation: `promotion_generation`);
    a repeated promotion is idempotent, so they converge on exactly one promoted standby. A
    proxy that skips a standby (its worker looks dead from here) promotes the next at that
    one's own generation, never at the generation of the one it skipped.
    """
    slot = slots.key(primary)
    running = None
    stopped = []
    for m in machines:
        if m.id == primary.id or slots.key(m) != slot or m.worker_id == primary.worker_id:
            continue
        if not usable(m.worker_id):
            continue
        if m.state in RUNNING:
            running = m.id if running is None else min(running, m.id)
        elif m.state in _STARTABLE:
            stopped.append(m.id)
    return running, sorted(stopped)


# -- loops -------------------------------------------------------------------------------------


async def sleep_until(clock: Clock, when: float, shutdown: asyncio.Event) -> bool:
    """Sleep on `clock` until `when`; False (at once) if `shutdown` is set first."""
    if shutdown.is_set():
        return False
    if when <= clock.now():
        return True
    sleeper = asyncio.ensure_future(clock.sleep_until(when))
    stopper = asyncio.ensure_future(shutdown.wait())
    try:
        await asyncio.wait({sleeper, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        sleeper.cancel()
        stopper.cancel()
    return not shutdown.is_set()


class HealthChecks(Generic[R]):
    """Runs each started machine's checks and reports the verdict to `report(route, ok)`.

    A machine starts unverified: its checks (or, without checks, a TCP connect to its service
    port) are polled fast until the first pass, bounded by `warm_for`; then configured checks
    run each at its own interval with its own timeout, and a machine without checks is left
    alone (healthy once it accepted). At most `concurrency` checks run at once, proxy-wide.
    """

    def __init__(
        self,
        probes: Probes,
        clock: Clock,
        report: Callable[[R, bool], None],
        *,
        concurrency: int,
        warm_for: float,
    ) -> None:
        self.probes = probes
        self.clock = clock
        self.report = report
        self.warm_for = warm_for
        self._slots = asyncio.Semaphore(concurrency)

    async def _run(self, check: CheckSpec) -> bool:
        if not check.port:
            return False
        async with self._slots:
            if check.kind == "http":
                return await self.probes.http(
                    check.host, check.port, check.path, check.method, check.timeout
                )
            return await self.probes.tcp(check.host, check.port, check.timeout)

    async def _all(self, checks: list[CheckSpec]) -> bool:
        results = await asyncio.gather(*(self._run(c) for c in checks))
        return all(results)

    async def watch(self, route: R, shutdown: asyncio.Event) -> None:
        """Check `route` until cancelled (it left STARTED) or shutdown."""
        configured = checks_of(route.machine, route.host)
        if route.machine.address:  # dialled on its own address: its checks are too
            configured = [replace(c, port=c.internal_port if c.port else 0) for c in configured]
        checks = configured or [
            CheckSpec(
                name="accept",
                kind="tcp",
                host=route.host,
                port=route.port,
                path="",
                method="",
                interval=SLOW_READY_POLL,
                timeout=DEFAULT_CHECK_TIMEOUT,
            )
        ]
        # Warm-up: poll fast until the first pass.
        delay = READY_POLL_MIN
        until = self.clock.now() + self.warm_for
        gave_up = False
        while True:
            if await self._all(checks):
                self.report(route, True)
                break
            now = self.clock.now()
            if now >= until and not gave_up:
                gave_up = True
                log.info("machine_not_ready", machine_id=route.id, waited=self.warm_for)
                self.report(route, False)
                delay = min(c.interval for c in checks)
            if not await sleep_until(self.clock, now + delay, shutdown):
                return
            if not gave_up:
                delay = min(delay * 2, READY_POLL_MAX)
        if not configured:
            return
        # Steady state: each check at its interval; the machine is healthy while all pass.
        now = self.clock.now()
        due = [now + c.interval for c in checks]
        passing = [True] * len(checks)
        healthy = True
        while not shutdown.is_set():
            if not await sleep_until(self.clock, min(due), shutdown):
                return
            now = self.clock.now()
            ready = [i for i, when in enumerate(due) if when <= now]
            results = await asyncio.gather(*(self._run(checks[i]) for i in ready))
            for i, ok in zip(ready, results, strict=True):
                passing[i] = ok
                due[i] = self.clock.now() + checks[i].interval
                if not ok:
                    log.info("check_failed", machine_id=route.id, check=checks[i].name)
            verdict = all(passing)
            if verdict != healthy:
                healthy = verdict
                self.report(route, verdict)


class WorkerWatch:
    """Worker death: probe a worker the registry finds silent; on failure declare it dead and
    start one standby for each machine that was running there."""

    def __init__(
        self,
        router: RouteTable,
        probes: Probes,
        flaps: Flaps | None,
        stats: Counters,
        clock: Clock,
        *,
        probe_timeout: float,
        probe_interval: float,
        attempts: int,
        tracer: Tracer | None = None,
    ) -> None:
        self.router = router
        self.tracer = tracer
        self.probes = probes
        self.flaps = flaps
        self.stats = stats
        self.clock = clock
        self.probe_timeout = probe_timeout
        self.probe_interval = probe_interval
        self.attempts = attempts

    async def probe(self, worker_id: str, shutdown: asyncio.Event) -> None:
        """Probe until the worker is heard from again (nothing happens) or a probe fails
        (it is declared dead)."""
        while not shutdown.is_set():
            view = self.router.registry.worker(worker_id)
            if view is None or not self.router.silent(view.status):
                return  # back within the window: nothing to do
            ok = await self.probes.worker(view.info.address, self.probe_timeout)
            view = self.router.registry.worker(worker_id)
            if view is None or not self.router.silent(view.status):
                return
            if not ok:
                self.router.declare_dead(worker_id, "heartbeats stopped and the probe failed")
                return
            log.info("worker_silent_but_answers", worker=worker_id)
            if not await sleep_until(self.clock, self.clock.now() + self.probe_interval, shutdown):
                return

    def plan(self, worker_id: str) -> list[Takeover]:
        """For each slot the lost worker served (a running member holding the slot's top claim)
        with no other member running: the stopped members to promote, best first, each with
        its own generation (model.slots.promotion_generation). Synchronous, so the router can
        mark the chosen standbys as starting before any request looks."""
        registry = self.router.registry
        # A slot's members are machines of one app: the cost is the app's, not the fleet's.
        apps: dict[str, dict[str, list[pb.Machine]]] = {}

        def members_of(m: pb.Machine) -> list[pb.Machine]:
            by_slot = apps.get(m.app)
            if by_slot is None:
                by_slot = apps[m.app] = {}
                for sibling in registry.machines(app=m.app):
                    by_slot.setdefault(slots.slot_of(sibling).id, []).append(sibling)
            return by_slot.get(slots.slot_of(m).id, [m])

        lost = sorted(
            (
                m
                for m in registry.machines(worker_id=worker_id)
                if m.state in RUNNING and _serves(m, members_of(m))
            ),
            key=lambda m: m.id,
        )
        out = []
        for primary in lost:
            members = members_of(primary)
            running, stopped = standby_candidates(primary, members, self.router.standby_usable)
            if running is not None:
                log.info("standby_already_running", primary=primary.id, standby=running)
            elif stopped:
                rows = {m.id: m for m in members}
                generations = {s: slots.promotion_generation(rows[s], members) for s in stopped}
                out.append(Takeover(primary, stopped, generations))
            elif len(members) > 1:
                log.warning("no_usable_standby", primary=primary.id)
        return out

    async def failover(self, worker_id: str, plan: list[Takeover], shutdown: asyncio.Event) -> None:
        """Promote one standby for each lost primary of `plan` (the machines of `worker_id`).

        With tracing on, this is the INTERNAL span `proxy.failover`, and the flaps calls that
        start the standbys are its children."""
        if self.tracer is None:
            await self._failover(plan, shutdown)
            return
        view = self.router.registry.worker(worker_id)
        region = view.info.region if view is not None else plan[0].primary.region if plan else ""
        with self.tracer.start_as_current_span(
            "proxy.failover",
            kind=SpanKind.INTERNAL,
            attributes={"nonomad.worker": worker_id, "nonomad.region": region},
        ) as span:
            started = await self._failover(plan, shutdown)
            span.set_attribute("nonomad.standbys_started", started)

    async def _failover(self, plan: list[Takeover], shutdown: asyncio.Event) -> int:
        started = 0
        for takeover in plan:
            if shutdown.is_set() or not self.router.is_dead(takeover.primary.worker_id):
                break  # stopping, or the worker came back meanwhile
            if await self._replace(takeover, shutdown):
                started += 1
        return started

    async def _replace(self, takeover: Takeover, shutdown: asyncio.Event) -> bool:
        """Promote one of the takeover's standbys in place of its primary; whether one was."""
        primary = takeover.primary
        if self.flaps is None:
            log.warning("failover_without_flaps", primary=primary.id, standby=takeover.standbys[0])
            return False
        tries = 0
        for standby in takeover.standbys:
            # Each standby at its own generation: after a failure that may have promoted the
            # one before (a timeout), the next is not a second promotion at the same one.
            generation = takeover.generations[standby]
            while tries < self.attempts:
                tries += 1
                try:
                    await self.flaps.start(standby, generation)
                except FlapsFailed as err:
                    self.stats.standby_failed()
                    log.warning(
                        "standby_start_failed", primary=primary.id, standby=standby, error=str(err)
                    )
                    if err.superseded:
                        # Promoted already (by a proxy that saw more): no second promotion.
                        self.router.standby_failed(standby)
                        return False
                    if not err.retryable:
                        break  # this one cannot start (destroyed, gone): the next one
                    if not await sleep_until(
                        self.clock, self.clock.now() + FLAPS_RETRY * tries, shutdown
                    ):
                        return False
                    continue
                self.stats.failover()
                log.info(
                    "failover",
                    primary=primary.id,
                    worker=primary.worker_id,
                    standby=standby,
                    generation=generation,
                )
                return True
            self.router.standby_failed(standby)
        log.error("failover_failed", primary=primary.id, tried=tries)
        return False


def _serves(machine: pb.Machine, members: list[pb.Machine]) -> bool:
    serving = slots.serving(members)
    return serving is not None and serving.id == machine.id


@dataclass(frozen=True)
class Takeover:
    """A lost primary, the members of its slot to promote in its place (best first), and the
    generation each is promoted to (its own: model.slots.promotion_generation)."""

    primary: pb.Machine
    standbys: list[str]
    generations: dict[str, int]
