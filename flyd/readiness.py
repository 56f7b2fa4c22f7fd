"""Whether each started machine serves: flyd probes it and keeps the answer in its row.

A started machine is ready once every service's host port accepts a TCP connection and every
configured check passes (model.checks: the same checks the proxy runs); a machine with neither
is ready once its process has kept running for `settle` seconds. Until then its condition
(Machine.ready, set by flyd.conditions as it starts) says what it waits for; a probe that still
fails `grace` seconds after the start says why ("nothing listening on 8080 after 10s"). Once
ready, configured checks go on at their interval and a failing one turns it not ready again.

One loop per worker (`run`, until its shutdown event) follows the started machines and starts
their probes when due, at most `concurrency` at a time and at most one round per machine in
flight, each probe within its own deadline, only to loopback ports; time is the injected
clock's. What it does per change or round does not grow with the worker's machines: the
runner tells it which rows changed (Runner.listen) and it looks at those only; the planned
rounds wait in a heap by due time, under one timer for the earliest.

A change of the condition is committed to the machine's row like any other change (the worker
is the row's one writer), so WatchEvents, the registry and flaps' ListMachines carry it. It is
not kept across a flyd restart as such: the probes start over and commit only what changed.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import structlog

from flyd import conditions, fsm
from flyd.drivers.ports import local_address
from flyd.runner import Runner
from flyd.v1 import machine_pb2 as pb
from model import checks
from model.checks import CheckSpec
from runtime.clock import Clock

log = structlog.get_logger("flyd.readiness")
S = pb.MachineState
# While a machine has not passed yet, its probes run this often, doubling up to the max.
WARM_MIN = 0.05
WARM_MAX = 1.0
# The loop looks at changed rows at most this often when changes come quickly (a deploy
# starting many machines is looked at in one go).
SCAN_EVERY = 0.05
# The due rounds' heap is rebuilt from the live tracks once it holds this many times as many
# entries (those of forgotten tracks are otherwise dropped only as they come due).
HEAP_SLACK = 2
# What a machine with no configured checks and no services says once it is ready.
NO_SERVICES = "no services: nothing to probe; it keeps running"

Probe = Callable[[CheckSpec], Awaitable[str | None]]


@dataclass
class _Track:
    """What the loop knows of one started machine (one run of its process)."""

    handle: dict[str, Any]
    started: float
    probes: list[CheckSpec]
    configured: bool  # configured checks (else: a connect to each service port)
    was_ready: bool  # its row said ready when the track began (flyd restarted)
    due: float | None
    delay: float = WARM_MIN
    passed: bool = False
    busy: bool = False
    detail: str = ""  # the last probe's failure, "" once they passed
    interval: float = field(default=WARM_MAX)


def probe_host(machine_host: str) -> str:
    """Where to probe machines whose ports are on `machine_host`: itself (resolved) when it is
    an address of this host, so probes see what the proxy sees (an OCI worker's ports are
    bound there alone); else 127.0.0.1. Probes never leave the host."""
    return local_address(machine_host) or "127.0.0.1"


class Readiness:
    """Probes the worker's started machines and commits their readiness condition."""

    def __init__(
        self,
        *,
        rows: dict[str, fsm.Row],
        runner: Runner,
        clock: Clock,
        grace: float = 10.0,
        settle: float = 1.0,
        concurrency: int = 16,
        host: str = "127.0.0.1",
        probe: Probe = checks.run,
    ) -> None:
        """`rows`: the worker's rows (read only: changes go through `runner`, which tells the
        loop which rows changed); `grace`: seconds after a start before a failing probe is
        reported; `settle`: seconds a machine with nothing to probe must keep running; `host`:
        where the machines' host ports are (an address of this host); `probe`: runs one check
        (model.checks.run; tests give a fake)."""
        if local_address(host) != host:
            raise ValueError(f"readiness probes only addresses of this host, not {host}")
        if grace < 0 or settle < 0 or concurrency < 1:
            raise ValueError("grace and settle must be >= 0 and concurrency >= 1")
        self.rows = rows
        self.runner = runner
        self.clock = clock
        self.grace = grace
        self.settle = settle
        self.host = host
        self._probe = probe
        self._slots = asyncio.Semaphore(concurrency)
        self._tracks: dict[str, _Track] = {}
        # The planned rounds, earliest first: (due, tie, machine, track), one entry per track
        # that waits for its next round. An entry whose track was forgotten is skipped.
        self._due: list[tuple[float, int, str, _Track]] = []
        self._ties = itertools.count()
        self._changed: set[str] = set()  # machines whose rows changed since the loop looked
        self._tasks: set[asyncio.Task[None]] = set()
        # Wakes the loop: a change, a finished round, the timer (`_rang`) or shutdown.
        self._wake = asyncio.Event()
        self._rang = False
        self._timer: asyncio.Task[None] | None = None  # the one timer, for the earliest round
        self._timer_at = 0.0
        self.examined = 0
        """Rows the loop has looked at since it started (each changed row once per look)."""

    @property
    def pending(self) -> int:
        """Machines whose rows changed since the loop last looked."""
        return len(self._changed)

    def detail(self, machine_id: str) -> str:
        """Why its probes fail right now ("" when they pass, or nothing was probed yet): a
        wait that times out says this, even before `grace` put it in the row."""
        track = self._tracks.get(machine_id)
        row = self.rows.get(machine_id)
        if track is None or row is None or row.handle != track.handle:
            return ""
        return track.detail

    async def run(self, shutdown: asyncio.Event) -> None:
        """Probe until `shutdown` is set; then cancel the probes in flight."""
        stop_listening = self.runner.listen(self._note)
        self._changed.update(self.rows)  # once: the rows as they are when it starts
        on_shutdown = asyncio.ensure_future(self._wake_on(shutdown))
        try:
            while not shutdown.is_set():
                self._look()
                self._start_due()
                self._arm()
                await self._wake.wait()
                if not self._rang and not shutdown.is_set():
                    # A burst of changes (a deploy starting many machines) is looked at in one go.
                    await asyncio.sleep(SCAN_EVERY)
                # What woke it meanwhile is in `_changed`, the heap or the timer's state.
                self._wake.clear()
                self._rang = False
        finally:
            stop_listening()
            waits = [on_shutdown, *([self._timer] if self._timer is not None else [])]
            for task in [*waits, *self._tasks]:
                task.cancel()
            await asyncio.gather(*waits, *self._tasks, return_exceptions=True)

    def _note(self, machine_id: str) -> None:
        """The runner's word that the machine's row changed."""
        self._changed.add(machine_id)
        self._wake.set()

    async def _wake_on(self, shutdown: asyncio.Event) -> None:
        await shutdown.wait()
        self._wake.set()

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._wake.set()
        if not task.cancelled() and task.exception() is not None:
            log.error("readiness_probe_failed", exc_info=task.exception())

    def _look(self) -> None:
        """Track each changed machine that is started (a new run of its process: a new track);
        forget the changed ones that no longer are."""
        changed, self._changed = self._changed, set()
        self.examined += len(changed)
        now = self.clock.now()
        for mid in changed:
            track = self._tracks.get(mid)
            if track is not None:
                if self._current(mid, track):
                    continue
                del self._tracks[mid]
            row = self.rows.get(mid)
            if row is None or row.state != S.MACHINE_STATE_STARTED or row.handle is None:
                continue
            track = self._tracks[mid] = self._track(row, now)
            self._plan(mid, track)

    def _track(self, row: fsm.Row, now: float) -> _Track:
        assert row.handle is not None
        configured = checks.checks_of(row.machine, self.host)
        probes = configured or [
            CheckSpec(
                name=f"port {p.internal_port}",
                kind="tcp",
                host=self.host,
                port=p.host_port,
                path="",
                method="",
                interval=WARM_MAX,
                timeout=checks.DEFAULT_CHECK_TIMEOUT,
                internal_port=p.internal_port,
            )
            for p in row.machine.ports
        ]
        return _Track(
            handle=row.handle,
            started=now,
            probes=probes,
            configured=bool(configured),
            was_ready=row.machine.ready.ready,
            due=now if probes else now + self.settle,
            interval=min((c.interval for c in configured), default=WARM_MAX),
        )

    def _current(self, machine_id: str, track: _Track) -> bool:
        row = self.rows.get(machine_id)
        return (
            row is not None and row.state == S.MACHINE_STATE_STARTED and row.handle == track.handle
        )

    def _plan(self, machine_id: str, track: _Track) -> None:
        """Put the track's next round (if it has one) in the heap."""
        if track.due is None:
            return
        heapq.heappush(self._due, (track.due, next(self._ties), machine_id, track))
        if len(self._due) > HEAP_SLACK * len(self._tracks) + 64:
            # Mostly forgotten tracks' entries: keep the heap as small as what it plans.
            self._due = [e for e in self._due if self._tracks.get(e[2]) is e[3]]
            heapq.heapify(self._due)

    def _start_due(self) -> None:
        """Start every round that is due."""
        now = self.clock.now()
        while self._due and self._due[0][0] <= now:
            due, _, mid, track = heapq.heappop(self._due)
            if self._tracks.get(mid) is track and track.due == due and not track.busy:
                track.busy = True
                self._spawn(self._round(mid, track))

    def _arm(self) -> None:
        """Keep one timer, for the earliest planned round: a new one only when that is sooner
        than the one set (or it rang)."""
        while self._due and self._tracks.get(self._due[0][2]) is not self._due[0][3]:
            heapq.heappop(self._due)  # forgotten
        if not self._due:
            return  # a change or a finished round wakes the loop
        at = self._due[0][0]
        if self._timer is not None and not self._timer.done():
            if self._timer_at <= at:
                return
            self._timer.cancel()
        self._timer_at = at
        self._timer = asyncio.ensure_future(self._ring(at))

    async def _ring(self, at: float) -> None:
        await self.clock.sleep_until(at)
        self._rang = True
        self._wake.set()

    async def _round(self, machine_id: str, track: _Track) -> None:
        """Run the machine's probes once, then commit what changed and plan the next round."""
        try:
            if not track.probes:
                want: tuple[bool, str] | None = (True, NO_SERVICES)
                track.due = None
            else:
                async with self._slots:
                    results = await asyncio.gather(*(self._probe(c) for c in track.probes))
                want = self._judge(track, results)
            if want is not None and self._current(machine_id, track):
                await self._commit(machine_id, track, *want)
        finally:
            track.busy = False
            if self._tracks.get(machine_id) is track:
                self._plan(machine_id, track)

    def _judge(self, track: _Track, results: list[str | None]) -> tuple[bool, str] | None:
        """The condition the results call for (None: leave the row's as it is); plans the
        next round."""
        now = self.clock.now()
        failures = [
            describe(c, r, track.configured)
            for c, r in zip(track.probes, results, strict=True)
            if r is not None
        ]
        if not failures:
            track.passed, track.detail = True, ""
            track.due = now + track.interval if track.configured else None
            return True, ""
        track.detail = failures[0] + (
            f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        )
        if track.passed:
            track.due = now + track.interval
            return False, track.detail
        track.delay = min(track.delay * 2, WARM_MAX)
        track.due = now + track.delay
        if track.was_ready:  # ready before flyd restarted, failing now
            return False, track.detail
        if now - track.started >= self.grace:
            return False, f"{track.detail} after {self.grace:g}s"
        return None  # still warming up: the row says what it waits for

    async def _commit(self, machine_id: str, track: _Track, ready: bool, reason: str) -> None:
        async with self.runner.lock(machine_id):
            row = self.rows.get(machine_id)
            if row is None or self.runner.closing or not self._current(machine_id, track):
                return
            current = row.machine.ready
            if current.ready == ready and current.reason == reason:
                return
            machine = pb.Machine()
            machine.CopyFrom(row.machine)
            now = fsm.timestamp(self.clock.now())
            machine.updated_at.CopyFrom(now)
            since = (
                now if current.ready != ready or not current.HasField("since") else current.since
            )
            machine.ready.CopyFrom(conditions.condition(ready, reason, since))
            words = "ready" if ready else f"not ready: {reason}"
            t = fsm.Transition(replace(row, machine=machine), "ready", words, row.state)
            await self.runner.commit(machine_id, [t])
        log.info("readiness", machine_id=machine_id, ready=ready, reason=reason)


def describe(check: CheckSpec, failure: str, configured: bool) -> str:
    """A probe's failure as the machine's reason: the port or the check it is about."""
    if not configured:
        if failure == "nothing listening":
            return f"nothing listening on {check.internal_port}"
        return f"port {check.internal_port}: {failure}"
    if check.kind == "tcp":
        return f"check {check.name}: {failure} on port {check.internal_port}"
    return f"check {check.name}: {failure}"
