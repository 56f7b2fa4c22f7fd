"""Which machine takes a request, and the cold starts when none can.

`Picker.choose` is the router's decision for one request: among an app's routable machines,
the least loaded of two random choices from the best tier (own region under the soft limit,
then any region; then the same under the hard limit), or why the request must wait (every
machine at its hard limit, a machine warming up or being started), or NoBackend with the
reasons counted. When every machine is past its soft limit, or none is up, it starts one
stopped autostart machine through flaps, one at a time per app (scale from zero). When the one
to start serves a slot and sits stopped on a dead worker (autostopped, then its worker died),
a standby of its slot is promoted instead (docs/fencing.md).
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import structlog

from flyd.v1 import machine_pb2 as pb
from model import slots
from proxy.control import Counters, Flaps, FlapsFailed
from proxy.errors import NoBackend
from proxy.routes import (
    STARTABLE,
    STARTED,
    AppState,
    RegistryView,
    Route,
    RouterConfig,
    Wait,
    WorkerState,
    state_name,
    under_hard,
    under_soft,
)
from registry.view import ALIVE, DEAD, SUSPECT
from runtime.clock import Clock

log = structlog.get_logger("proxy.router")
S = pb.MachineState
Spawn = Callable[[Coroutine[Any, Any, None], str], asyncio.Task[None]]
"""Runs a coroutine as one of the router's tasks (named for the logs); returns the task."""


class Picker:
    """The choices of proxy.router.Router: a machine per request, and which one to start."""

    def __init__(
        self,
        *,
        workers: Mapping[str, WorkerState],
        registry: RegistryView,
        flaps: Flaps | None,
        stats: Counters,
        config: RouterConfig,
        clock: Clock,
        rng: random.Random,
        spawn: Spawn,
        members: Callable[[slots.SlotKey | None], list[Route]] = lambda slot: [],
    ) -> None:
        """`workers`: the router's view of workers, read only. `spawn` runs the starts.
        `members(slot)`: the routes of a slot, (app, slot id) (proxy.fencing.SlotIndex)."""
        self.workers = workers
        self.registry = registry
        self.flaps = flaps
        self.stats = stats
        self.config = config
        self.clock = clock
        self._rng = rng
        self._spawn = spawn
        self.members = members

    def choose(
        self, app: str, state: AppState, pinned: str | None, exclude: frozenset[str]
    ) -> Route | Wait:
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
                return Wait(
                    "hard", f"all {len(ready)} machines of app {app} are at their hard limit"
                )
            return choice
        warming = self._warming(state, now)
        if warming is not None:
            return Wait("start", f"machine {warming} of app {app} did not become ready in time")
        started = self._start_one(app, state, now, cold=True)
        if started is not None:
            return Wait("start", f"machine {started} of app {app} did not become ready in time")
        raise NoBackend(self._explain(app, state, why, now))

    def _choose_pinned(self, app: str, state: AppState, pinned: str, now: float) -> Route | Wait:
        r = state.routes.get(pinned)
        if r is None:
            raise NoBackend(f"app {app} has no machine {pinned}")
        reason = self._unroutable(r, now)
        if reason is None:
            if not under_hard(r):
                return Wait("hard", f"machine {pinned} is at its hard limit")
            return r
        if self._is_warming(r, now):
            return Wait("start", f"machine {pinned} did not become ready in time")
        if self._startable(r, now) and self.flaps is not None:
            self._begin_start(state, r, now, cold=True)
            return Wait("start", f"machine {pinned} did not become ready in time")
        raise NoBackend(f"machine {pinned} of app {app} cannot serve: {reason}")

    def _balance(self, ready: list[Route]) -> tuple[Route | None, bool]:
        """The least loaded of two random choices, from the best tier that has any: own region
        under the soft limit, any region under the soft limit, own region under the hard
        limit, any under the hard limit. Also whether every machine is past its soft limit."""
        region = self.config.region
        local = [r for r in ready if r.region == region]
        soft = [r for r in local if under_soft(r)]
        if not soft:
            soft = [r for r in ready if under_soft(r)]
        if soft:
            return self._two_choices(soft), False
        hard = [r for r in local if under_hard(r)]
        if not hard:
            hard = [r for r in ready if under_hard(r)]
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
            if r.state in STARTABLE and r.is_standby:
                return f"{name} standby"
            if r.state in STARTABLE and not r.autostart:
                return f"{name} without autostart"
            return name
        w = self.workers.get(r.worker_id)
        if w is not None and w.dead:
            return "on a dead worker"
        if w is not None and w.draining:
            return "on a draining worker"
        if r.fenced:
            return "fenced (its worker is confirming its slot)"
        if not r.serving:
            return "outranked in its slot"
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

    def worker_usable(self, worker_id: str) -> bool:
        w = self.workers.get(worker_id)
        return w is None or not (w.dead or w.draining)

    def _is_warming(self, r: Route, now: float) -> bool:
        """Whether `r` will (probably) be routable soon without anyone doing anything."""
        if not self.worker_usable(r.worker_id):
            return False
        if r.state == STARTED:
            return not r.ready and now < r.warm_until and not r.stopping
        if r.state in (S.MACHINE_STATE_STARTING, S.MACHINE_STATE_RESTARTING):
            return True
        return (
            r.start_requested is not None
            and now < r.start_requested + self.config.cold_start_timeout
        )

    def _failing_over(self, r: Route, now: float) -> bool:
        """Whether `r` serves a slot with standbys and cannot take requests for a reason that
        its worker's fence check or a failover resolves (it is fenced, or it refused
        connections or its worker went silent and a standby can take over): requests wait for
        that, as for a cold start."""
        if not r.peers or not r.serving or r.state != STARTED:
            return False
        if r.fenced:
            return True
        view = self.registry.worker(r.worker_id)
        silent = view is not None and view.status in (SUSPECT, DEAD)
        if not silent and now >= r.penalty_until:
            return False
        return any(
            o is not r
            and (o.state in STARTABLE or o.state in (S.MACHINE_STATE_STARTING, STARTED))
            and self.worker_usable(o.worker_id)
            and self._alive(o.worker_id)
            for o in self.members(r.slot)
        )

    def _alive(self, worker_id: str) -> bool:
        view = self.registry.worker(worker_id)
        return view is not None and view.status == ALIVE

    def _warming(self, state: AppState, now: float) -> str | None:
        if state.starting is not None:
            return state.starting
        for r in state.routes.values():
            if self._is_warming(r, now) or self._failing_over(r, now):
                return r.id
            if (r.stopping or r.state == S.MACHINE_STATE_STOPPING) and self._can_autostart(r):
                return r.id  # stopping for idleness: startable again in a moment
        return None

    def _can_autostart(self, r: Route) -> bool:
        return (
            r.autostart
            and r.serving
            and not r.is_standby
            and not r.fenced
            and self.worker_usable(r.worker_id)
        )

    def _startable(self, r: Route, now: float) -> bool:
        if r.state not in STARTABLE or not self._can_autostart(r):
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
            return self._take_over(state, now, cold=cold)
        r = min(candidates, key=lambda r: (r.region != region, r.id))
        self._begin_start(state, r, now, cold=cold)
        return r.id

    def _take_over(self, state: AppState, now: float, *, cold: bool) -> str | None:
        """Promote a standby of a slot whose serving member is stopped on a dead worker: the
        failover on worker death looks only at running primaries, and this one was stopped
        (idle) when its worker died, so nobody else will. The same standby and generation as
        a failover would pick (proxy.control.standby_candidates); the machine starting, or
        None."""
        for r in sorted(state.routes.values(), key=lambda r: r.id):
            if not (r.serving and r.peers and r.state in STARTABLE and r.autostart):
                continue
            if not self._on_dead_worker(r.worker_id):
                continue
            members = self.members(r.slot)
            standbys = sorted(
                (
                    o
                    for o in members
                    if o is not r
                    and o.worker_id != r.worker_id
                    and o.state in STARTABLE
                    and self.worker_usable(o.worker_id)
                    and self._alive(o.worker_id)
                    and (o.start_error is None or now >= o.start_error[0])
                ),
                key=lambda o: o.id,
            )
            if not standbys:
                continue
            standby = standbys[0]
            generation = slots.promotion_generation(standby.machine, [o.machine for o in members])
            log.warning(
                "promoting_for_stopped_primary",
                primary=r.id,
                worker=r.worker_id,
                standby=standby.id,
                generation=generation,
            )
            self._begin_start(state, standby, now, cold=cold, generation=generation)
            return standby.id
        return None

    def _on_dead_worker(self, worker_id: str) -> bool:
        w = self.workers.get(worker_id)
        if w is not None and w.dead:
            return True
        view = self.registry.worker(worker_id)
        return view is not None and view.status == DEAD

    def _begin_start(
        self, state: AppState, r: Route, now: float, *, cold: bool, generation: int = 0
    ) -> None:
        state.starting = r.id
        r.start_requested = now
        r.start_error = None
        self._spawn(self._start(state, r, cold, generation), f"start {r.id}")

    async def _start(self, state: AppState, r: Route, cold: bool, generation: int = 0) -> None:
        assert self.flaps is not None
        log.info("starting_machine", machine_id=r.id, app=r.app, cold=cold, generation=generation)
        try:
            await self.flaps.start(r.id, generation)
        except FlapsFailed as err:
            r.start_requested = None
            r.start_error = (self.clock.now() + self.config.start_retry_after, str(err))
            log.warning("start_failed", machine_id=r.id, error=str(err))
        else:
            if generation:
                self.stats.failover()
            elif cold:
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
        if self.flaps is None and any(r.state in STARTABLE for r in state.routes.values()):
            return f"{message}; this proxy has no flaps to start machines"
        return message
