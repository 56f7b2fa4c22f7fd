"""The proxy's control plane: which machine serves each request (proxy.routing's `Router`).

`Router` keeps a table of each app's machines (proxy.routes), fed by the embedded registry
replica's events, and adds what only the edge knows: requests in flight per machine, health,
recent connection failures, drained workers and workers this proxy declared dead. The data
plane calls `acquire`/`release` for every request; the fast path is a few dict lookups and a
power-of-two-choices pick (proxy.picking), with no await.

The slow paths wait, always bounded and on the injected clock: for a slot under a machine's
hard limit (`queue_wait`), and for a machine being started (`cold_start_timeout`: scale from
zero, one start per app however many requests wait for it; proxy.picking starts it). The
loops that change machines (health checks, autostop, worker death and failover) are in
proxy.control; `run` runs them, and the hooks they call back (`declare_dead`,
`standby_failed`, `autostop_once`) are here. Of each slot (a primary and its standbys) only the
member holding the top claim is routed to (proxy.fencing); a copy that stops serving has its
requests in flight ended, and one outranked but still running is reported to its worker.

An app is known while the registry has a machine of it (not destroyed) with a service.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import random
from collections.abc import Callable, Coroutine
from typing import Any

import structlog
from opentelemetry.trace import Tracer

from flyd.v1 import machine_pb2 as pb
from model import slots as slot_rules
from model.slots import SlotKey
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
from proxy.errors import NoBackend, UnknownApp
from proxy.fencing import Judged, SlotIndex
from proxy.picking import Picker
from proxy.routes import (
    STARTED,
    AppState,
    RegistryView,
    Route,
    RouteInfo,
    RouterConfig,
    UnknownWorker,
    WorkerState,
)
from proxy.routing import Backend
from registry.replica import RESYNC, ReplicaEvent, Subscription
from registry.view import ALIVE, DEAD, SUSPECT, Status
from runtime.clock import Clock, SystemClock
from runtime.entropy import SYSTEM

log = structlog.get_logger("proxy.router")
S = pb.MachineState
# At most this many autostop calls to flaps at once.
STOP_CONCURRENCY = 8


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
        self._apps: dict[str, AppState] = {}
        self._routes: dict[str, Route] = {}
        # Worker id -> its routes: losing a worker costs its machines, not the fleet's.
        self._by_worker: dict[str, dict[str, Route]] = {}
        self._workers: dict[str, WorkerState] = {}
        # Each route once, by when it could first have been idle for idle_timeout: a pass of
        # autostop looks at the apps of the routes due, not at the fleet.
        self._idle_due: list[tuple[float, int, Route]] = []
        self._idle_order = itertools.count()
        self.slots = SlotIndex()
        self.picker = Picker(
            workers=self._workers,
            registry=registry,
            flaps=flaps,
            stats=stats,
            config=self.config,
            clock=self.clock,
            rng=rng if rng is not None else SYSTEM.rng(),
            spawn=self._spawn,
            members=self.slots.members,
        )
        self._tasks: set[asyncio.Task[None]] = set()
        self._stop_slots = asyncio.Semaphore(STOP_CONCURRENCY)
        self._lost_listeners: list[Callable[[frozenset[str], str], object]] = []
        self._shutdown = asyncio.Event()
        self._running = False
        self._closed = False
        # Slot members routed nothing (no services) told they are outranked: id -> when the
        # next telling may be (`_judge_unrouted`).
        self._unrouted_told: dict[str, float] = {}
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
            got = self.picker.choose(app, state, pinned, exclude)
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
        got = self.picker.choose(app, state, pinned, exclude)
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
                        and r.serving
                        and not r.fenced
                        and now >= r.penalty_until
                        and not self.is_dead(r.worker_id),
                        draining=w is not None and w.draining,
                        generation=r.machine.slot.generation,
                        superseded=not r.serving and not r.is_standby,
                        fenced=r.machine.slot.fenced,
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
        return view is not None and view.status == ALIVE and self.picker.worker_usable(worker_id)

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
        for takeover in plan:
            # Requests wait for the standby about to start instead of failing meanwhile.
            standby = self._routes.get(takeover.standbys[0])
            if standby is not None and self.flaps is not None:
                standby.start_requested = now
        self._pulse_worker(worker_id)
        for slot in self.slots.slots_of(list(self._by_worker.get(worker_id, {}).values())):
            self._judge(slot)  # a fenced member elsewhere may now have nobody to confirm with
        if plan or self.watch.tracer is not None:  # (traced even when there is nothing to start)
            self._spawn(
                self.watch.failover(worker_id, plan, self._shutdown), f"failover {worker_id}"
            )
        if lost:
            self._lose(frozenset(lost), f"its worker {worker_id} was declared dead ({reason})")

    def _lose(self, machines: frozenset[str], why: str) -> None:
        """End the requests in flight to `machines` (the lost-machine listeners)."""
        for listener in self._lost_listeners:
            try:
                listener(machines, why)
            except Exception:
                log.exception("machines_lost_listener_failed", machines=sorted(machines))

    def standby_failed(self, machine_id: str) -> None:
        """A standby could not be started: requests stop waiting for it."""
        r = self._routes.get(machine_id)
        if r is not None and r.state != STARTED:
            r.start_requested = None
            state = self._apps.get(r.app)
            if state is not None:
                state.pulse()

    def autostop_once(self) -> list[str]:
        """Begin stopping the machines idle past `idle_timeout`; their ids.

        Only the apps with a route due are looked at (a route is due once it could have been
        idle that long: `idle_timeout` after it was last active, as of when it was queued);
        each due route goes back in the queue, for when it could be idle long enough again,
        the next pass if its app's floor (or its worker) kept it running; a machine that is
        not running, or is busy, is looked at again `idle_timeout` later (one that starts, or
        finishes a request, is active then)."""
        if self.flaps is None:
            return []
        now = self.clock.now()
        due: list[Route] = []
        while self._idle_due and self._idle_due[0][0] <= now:
            r = heapq.heappop(self._idle_due)[2]
            if self._routes.get(r.id) is r:  # (else it is gone)
                due.append(r)
        apps = {r.app for r in due}
        victims = autostop_victims(
            (r for app in apps for r in self._apps[app].routes.values()),
            now=now,
            idle_timeout=self.config.idle_timeout,
            usable=self.picker.worker_usable,
        )
        for r in victims:
            r.stopping = True
            self._spawn(self._stop(r), f"autostop {r.id}")
        for r in due:
            idle_enough = r.last_active + self.config.idle_timeout
            if idle_enough > now:
                self._idle_again(r, idle_enough)
            elif r.autostop and r.state == STARTED and r.in_flight == 0 and not r.stopping:
                self._idle_again(r, now)  # idle, kept by its app's floor: the next pass
            else:
                self._idle_again(r, now + self.config.idle_timeout)  # not running, or busy
        return [r.id for r in victims]

    def _idle_again(self, r: Route, at: float) -> None:
        """Look at `r` in the first autostop pass after `at`."""
        heapq.heappush(self._idle_due, (at, next(self._idle_order), r))

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
        # Behind by more than 4096 events, it keeps the latest of each machine and worker: the
        # router reads what changed, never the whole view again.
        sub = self.registry.subscribe(maxsize=4096, coalesce=True)
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
            if machine is not None and machine.state != S.MACHINE_STATE_DESTROYED:
                self._judge_unrouted(machine)
            else:
                self._unrouted_told.pop(machine_id, None)
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
            self._idle_again(r, now + self.config.idle_timeout)
            was, old_instance = None, ""
        else:
            # Never happens with flyd; keep the indexes right anyway.
            if r.app != machine.app or r.worker_id != machine.worker_id:
                self._remove(r)
                self._on_machine(machine_id, machine)
                return
            was, old_instance = r.state, r.machine.instance_id
        r.refresh(machine, self._worker_host(machine.worker_id))
        left = self.slots.place(r)
        if left is not None:
            self._judge(left)
        assert r.slot is not None  # (placed)
        self._judge(r.slot)
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

    def _judge(self, slot: SlotKey) -> None:
        """Re-judge who serves `slot` (app, slot id): end the requests of a member that stopped
        serving, and tell the workers of outranked copies that still run."""
        judged = self.slots.judge(slot)
        for r in judged.demoted:
            top = judged.top
            log.warning(
                "machine_outranked",
                machine_id=r.id,
                slot=slot[1],
                generation=top[0] if top else 0,
                primary=top[1] if top else "",
            )
            why = f"slot {slot[1]} moved on to {top[1] if top else '?'}"
            self._lose(frozenset({r.id}), why)
            state = self._apps.get(r.app)
            if state is not None:
                state.pulse()
        if judged.outranked:
            self._tell_outranked(judged)
        if judged.serving is not None and judged.serving.fenced:
            self._promote_fenced(judged.serving, judged)

    def _promote_fenced(self, r: Route, judged: Judged) -> None:
        """A fenced primary whose worker cannot reach the other members, all on workers this
        proxy declared dead: promote it (its claim rises, the fence goes), or nothing serves."""
        if (
            self.flaps is None
            or judged.top is None
            or not r.peers
            or r.state != STARTED
            or not self._running
            or self._closed
        ):
            return
        view = self.registry.worker(r.worker_id)
        if view is None or view.status != ALIVE or self.is_dead(r.worker_id):
            return
        others = [o for o in self.slots.members(r.slot) if o is not r]
        if not all(self.is_dead(o.worker_id) for o in others):
            return  # they can answer its worker: let it confirm
        now = self.clock.now()
        if now < r.supersede_after:
            return
        r.supersede_after = now + self.config.supersede_retry
        generation = self.slots.promotion_generation(r)
        slot = r.slot[1] if r.slot else ""
        log.warning("promoting_fenced", machine_id=r.id, slot=slot, generation=generation)
        self._spawn(self._start_fenced(r.id, generation), f"promote {r.id}")

    async def _start_fenced(self, machine_id: str, generation: int) -> None:
        assert self.flaps is not None
        try:
            await self.flaps.start(machine_id, generation)
        except FlapsFailed as err:
            log.warning("promotion_failed", machine_id=machine_id, error=str(err))

    def _tell_outranked(self, judged: Judged) -> None:
        """Ask flaps to supersede each outranked copy running on a live worker (flyd stops it
        and makes it a standby): after a partition heals, nobody else would."""
        if self.flaps is None or judged.top is None or self._closed or not self._running:
            return
        generation, primary = judged.top
        now = self.clock.now()
        for r in judged.outranked:
            view = self.registry.worker(r.worker_id)
            if view is None or view.status != ALIVE or self.is_dead(r.worker_id):
                continue  # its worker hears nothing now; it fences itself when it comes back
            if now < r.supersede_after:
                continue
            r.supersede_after = now + self.config.supersede_retry
            self._spawn(self._supersede(r.id, generation, primary), f"supersede {r.id}")

    async def _supersede(self, machine_id: str, generation: int, primary: str) -> None:
        """Tell the machine's worker (through flaps) that the slot moved on; if that fails
        (its disk, say), look at the slot again once `supersede_retry` has passed: nothing
        else may change in it to make the router look."""
        assert self.flaps is not None
        log.info("superseding", machine_id=machine_id, generation=generation, primary=primary)
        try:
            await self.flaps.supersede(machine_id, generation, primary)
        except FlapsFailed as err:
            log.warning("supersede_failed", machine_id=machine_id, error=str(err))
        else:
            return
        retry = self.clock.now() + self.config.supersede_retry
        if not await sleep_until(self.clock, retry, self._shutdown):
            return
        r = self._routes.get(machine_id)
        if r is not None and r.slot is not None:
            self._judge(r.slot)
        elif (machine := self.registry.machine(machine_id)) is not None:
            self._judge_unrouted(machine)

    def _judge_unrouted(self, machine: pb.Machine) -> None:
        """`_tell_outranked` for the slot of a machine routed nothing (it has no services):
        such a slot fails over all the same (`WorkerWatch.plan` reads the registry), so a copy
        of it that runs outranked (back on a worker this proxy had declared dead, after its
        fence was lifted) is told to stand down as a routed one is. Read from the registry:
        the cost is the app's machines."""
        if self.flaps is None or self._closed or not self._running:
            return
        if machine.state not in RUNNING_STATES and slot_rules.slot_of(machine).generation == 0:
            return  # neither a copy that could be outranked nor a claim above the others'
        key = slot_rules.key(machine)
        members = [
            m
            for m in self.registry.machines(app=machine.app)
            if m.state != S.MACHINE_STATE_DESTROYED and slot_rules.key(m) == key
        ]
        top = slot_rules.top(members) if len(members) > 1 else None
        if top is None:
            return
        now = self.clock.now()
        for m in members:
            if (
                m.config.services
                or m.state not in RUNNING_STATES
                or not slot_rules.outranks(top, slot_rules.claim(m))
            ):
                continue
            view = self.registry.worker(m.worker_id)
            if view is None or view.status != ALIVE or self.is_dead(m.worker_id):
                continue  # it hears nothing now; it fences itself when it comes back
            if now < self._unrouted_told.get(m.id, 0.0):
                continue
            self._unrouted_told[m.id] = now + self.config.supersede_retry
            self._spawn(self._supersede(m.id, *top), f"supersede {m.id}")

    def _remove(self, r: Route) -> None:
        self._stop_watching(r)
        self.slots.remove(r)
        if r.slot:
            self._judge(r.slot)
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
        was, w.status = w.status, view.status
        if self.silent(view.status):
            if not w.dead and (w.probe is None or w.probe.done()) and not self._closed:
                log.info("worker_silent", worker=worker_id, status=int(view.status))
                w.probe = self._spawn(
                    self.watch.probe(worker_id, self._shutdown), f"probe {worker_id}"
                )
        elif view.status == ALIVE and (w.dead or was != ALIVE):
            mine = list(self._by_worker.get(worker_id, {}).values())
            if w.dead:
                # Back after it was declared dead: its machines get traffic again once their
                # checks pass (and only a member that still serves its slot: proxy.fencing).
                w.dead = False
                log.info("worker_back", worker=worker_id)
                now = self.clock.now()
                for r in mine:
                    if r.state == STARTED:
                        self._watch(r, now)
            for slot in self.slots.slots_of(mine):
                self._judge(slot)  # a copy outranked while it was away: tell it now
            for machine in self.registry.machines(worker_id=worker_id):
                if not machine.config.services and machine.state in RUNNING_STATES:
                    self._judge_unrouted(machine)  # the same, for one routed nothing
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


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("task_crashed", task=task.get_name(), exc_info=task.exception())


RUNNING_STATES = (S.MACHINE_STATE_STARTING, S.MACHINE_STATE_STARTED)
