"""Whether each started machine serves: flyd probes it and keeps the answer in its row.

A started machine is ready once every service's host port accepts a TCP connection and every
configured check passes (flyd.checks: the same checks the proxy runs); a machine with neither
is ready once its process has kept running for `settle` seconds. Until then its condition
(Machine.ready, set by flyd.conditions as it starts) says what it waits for; a probe that still
fails `grace` seconds after the start says why ("nothing listening on 8080 after 10s"). Once
ready, configured checks go on at their interval and a failing one turns it not ready again.

One loop per worker (`run`, until its shutdown event) finds the started machines and starts
their probes when due, at most `concurrency` at a time and at most one round per machine in
flight, each probe within its own deadline, only to loopback ports; time is the injected
clock's. A change of the condition is committed to the machine's row like any other change
(the worker is the row's one writer), so WatchEvents, the registry and flaps' ListMachines
carry it. It is not kept across a flyd restart as such: the probes start over and commit only
what changed.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import structlog

from flyd import checks, conditions, fsm
from flyd.checks import CheckSpec
from flyd.runner import Runner
from flyd.stream import EventStream
from flyd.v1 import machine_pb2 as pb
from runtime.clock import Clock

log = structlog.get_logger("flyd.readiness")
S = pb.MachineState
# While a machine has not passed yet, its probes run this often, doubling up to the max.
WARM_MIN = 0.05
WARM_MAX = 1.0
# The loop looks at the rows again at most this often when changes come quickly.
SCAN_EVERY = 0.05
# How long the loop sleeps at most with nothing due (a change or a finished probe wakes it).
IDLE = 30.0
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
    """Where to probe machines whose ports are on `machine_host`: itself when it is a loopback
    address, else 127.0.0.1 (probes go to loopback only)."""
    try:
        return machine_host if ipaddress.ip_address(machine_host).is_loopback else "127.0.0.1"
    except ValueError:  # a name
        return "127.0.0.1"


class Readiness:
    """Probes the worker's started machines and commits their readiness condition."""

    def __init__(
        self,
        *,
        rows: dict[str, fsm.Row],
        runner: Runner,
        stream: EventStream,
        clock: Clock,
        grace: float = 10.0,
        settle: float = 1.0,
        concurrency: int = 16,
        host: str = "127.0.0.1",
        probe: Probe = checks.run,
    ) -> None:
        """`rows`: the worker's rows (read only: changes go through `runner`); `stream`: its
        changes, to wake on; `grace`: seconds after a start before a failing probe is reported;
        `settle`: seconds a machine with nothing to probe must keep running; `host`: where the
        machines' host ports are (a loopback address); `probe`: runs one check (flyd.checks.run;
        tests give a fake)."""
        if not ipaddress.ip_address(host).is_loopback:
            raise ValueError(f"readiness probes only loopback addresses, not {host}")
        if grace < 0 or settle < 0 or concurrency < 1:
            raise ValueError("grace and settle must be >= 0 and concurrency >= 1")
        self.rows = rows
        self.runner = runner
        self.stream = stream
        self.clock = clock
        self.grace = grace
        self.settle = settle
        self.host = host
        self._probe = probe
        self._slots = asyncio.Semaphore(concurrency)
        self._tracks: dict[str, _Track] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._woken = asyncio.Event()

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
        try:
            while not shutdown.is_set():
                self._scan()
                now = self.clock.now()
                for mid, track in self._tracks.items():
                    if track.due is not None and track.due <= now and not track.busy:
                        track.busy = True
                        self._spawn(self._round(mid, track))
                await self._sleep(shutdown)
        finally:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._woken.set()
        if not task.cancelled() and task.exception() is not None:
            log.error("readiness_probe_failed", exc_info=task.exception())

    async def _sleep(self, shutdown: asyncio.Event) -> None:
        """Until a probe is due, a row changes (no sooner than SCAN_EVERY), a probe round
        ends, or shutdown."""
        dues = [t.due for t in self._tracks.values() if t.due is not None and not t.busy]
        now = self.clock.now()
        wake = min(dues, default=now + IDLE)
        waits = [
            asyncio.ensure_future(self.clock.sleep_until(max(wake, now))),
            asyncio.ensure_future(self.stream.changed(IDLE)),
            asyncio.ensure_future(self._woken.wait()),
            asyncio.ensure_future(shutdown.wait()),
        ]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        self._woken.clear()
        if not waits[0].done() and not shutdown.is_set():
            # A burst of changes (a deploy starting many machines) is looked at in one scan.
            await asyncio.sleep(SCAN_EVERY)

    def _scan(self) -> None:
        """Track every started machine (a new run of its process: a new track); forget the
        rest."""
        for mid in [m for m, t in self._tracks.items() if not self._current(m, t)]:
            del self._tracks[mid]
        now = self.clock.now()
        for mid, row in self.rows.items():
            if mid in self._tracks or row.state != S.MACHINE_STATE_STARTED or row.handle is None:
                continue
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
            self._tracks[mid] = _Track(
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
