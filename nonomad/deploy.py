"""Declarative deploys: make an app's machines match its spec, one safe step at a time.

The platform offers primitives (create, update, start, stop, destroy, wait, list, standby_for,
idempotency keys, leases); the policy lives here, in the client:

1. plan: list the app's machines and match them to the spec's slots by the metadata every
   deployed machine carries (`<app>-<region>-<n>` and its `-standby`). A slot is unchanged
   when its machine carries the spec's config digest, to update when it carries another, to
   create when it has no machine; machines in no slot of the spec are destroyed.
2. rolling update: changed machines are replaced in place (same id, new instance) one at a
   time, each holding a lease, each gated on its readiness: the spec's checks travel in its
   config and its worker runs them (flyd.readiness); the deploy waits for WaitMachine's
   `ready` and never dials a machine itself (its address may be private to the workers). It
   waits up to a check's grace_period + timeout after the start for the check flyd names as
   failing. A standby gets the new config (kept stopped) after its primary passed. When a
   machine fails, every machine this deploy updated goes back to its previous config and the
   deploy stops with `ok=False` and the reason flyd gave.
3. create: missing machines, region by region, each primary gated by its checks, then its
   standby on another worker of the region. Before the first create, each region is asked
   (ListRegions' `fits` for the spec's guest) whether it has room for everything the plan
   creates there: a region without it fails the deploy before anything changes. When a
   create fails anyway (another tenant took the room meanwhile, a check fails), what this run
   created is destroyed again, unless the caller asked to keep it (`keep_created`), and the
   report says which. Idempotency keys are derived from app, slot and config digest, so a
   retried deploy cannot create twice.
4. destroy: machines beyond the spec (a count lowered, a region dropped), standbys first,
   once everything new is healthy.
5. settle: wait until the fleet's view lists the result, so the next plan sees it.

Every wait has a deadline; progress goes to `on_event` as `DeployEvent`s.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import structlog

from flyd.v1 import machine_pb2 as pb
from model import checks, slots
from model.validate import REDACTED
from nonomad.client import (
    MAX_WAIT,
    ApiError,
    Client,
    DeadlineExceeded,
    FailedPrecondition,
    Machine,
    MachineConfig,
    ResourceExhausted,
    Unavailable,
    state_name,
)
from nonomad.spec import META_APP, META_DIGEST, META_SLOT, AppSpec

__all__ = [
    "DeployEvent",
    "DeployReport",
    "Failure",
    "Plan",
    "SlotPlan",
    "check_budgets",
    "deploy",
    "make_plan",
    "plan",
    "room",
]

log = structlog.get_logger("nonomad.deploy")

S = pb.MachineState
RUNNING = frozenset({S.MACHINE_STATE_STARTED, S.MACHINE_STATE_STARTING, S.MACHINE_STATE_RESTARTING})
GONE = frozenset({S.MACHINE_STATE_DESTROYING, S.MACHINE_STATE_DESTROYED})

CREATE, UPDATE, UNCHANGED, DESTROY, REPLACE = "create", "update", "unchanged", "destroy", "replace"
PRIMARY, STANDBY = "primary", "standby"

UPDATE_TIMEOUT = 45.0  # flaps gives an update 40 s (it may stop the old process first)
WAIT_CHUNK = 5.0  # a long wait is cut into chunks, so a machine that FAILED ends it early
# A wait for ready asks again at least this much later (a check's budget just short of spent).
MIN_READY_CHUNK = 0.05
MAX_LEASE = 3600.0
MAX_KEY_GENERATIONS = 8
CREATE_ATTEMPTS = 3
# Where flyd's reason starts in a WaitMachine(ready) error: "... not ready after 5s: <reason>",
# "... it will not be ready: <reason>".
_NOT_READY = re.compile(r"not (?:be )?ready(?: after [^:]*)?: ")

EventHandler = Callable[["DeployEvent"], None]


# -- plan --------------------------------------------------------------------------------------


@dataclass
class SlotPlan:
    """One slot of the spec (or one machine outside it) and what the deploy does with it."""

    slot: str
    region: str
    index: int
    role: str
    action: str
    reason: str = ""
    machine: Machine | None = None

    @property
    def machine_id(self) -> str:
        return self.machine.id if self.machine is not None else ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "slot": self.slot,
            "region": self.region,
            "role": self.role,
            "action": self.action,
            "reason": self.reason,
            "machine_id": self.machine_id,
        }


@dataclass
class Plan:
    app: str
    digest: str
    slots: list[SlotPlan]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.slots:
            out[s.action] = out.get(s.action, 0) + 1
        return out


def _digest(machine: Machine) -> str:
    return machine.config.metadata.get(META_DIGEST, "")


def _pick(spec: AppSpec, found: list[Machine]) -> tuple[Machine | None, list[Machine]]:
    """The machine to keep for a slot (one with the spec's digest first, then the oldest) and
    any duplicates (left by an interrupted deploy run elsewhere)."""
    if not found:
        return None, []
    ordered = sorted(
        found,
        key=lambda m: (_digest(m) != spec.digest, m.created_at.ToNanoseconds(), m.id),
    )
    return ordered[0], ordered[1:]


def _primary_action(spec: AppSpec, machine: Machine | None) -> tuple[str, str]:
    if machine is None:
        return CREATE, "no machine in this slot"
    if _digest(machine) != spec.digest:
        return UPDATE, f"config {_digest(machine) or '(none)'} -> {spec.digest}"
    if machine.state == S.MACHINE_STATE_FAILED:
        return UPDATE, "failed; start it again with the spec's config"
    return UNCHANGED, ""


def _standby_action(
    spec: AppSpec, standby: Machine | None, primary: Machine | None
) -> tuple[str, str]:
    if standby is None:
        return CREATE, "no standby in this slot"
    if primary is None:
        return REPLACE, "its primary will be new"
    if list(standby.config.standbys) != [primary.id]:
        return REPLACE, f"stands by for {list(standby.config.standbys)}, not {primary.id}"
    if _digest(standby) != spec.digest:
        return UPDATE, f"config {_digest(standby) or '(none)'} -> {spec.digest}"
    return UNCHANGED, ""


def _why_extra(spec: AppSpec, machine: Machine) -> str:
    region = machine.region
    if region not in spec.regions:
        return f"region {region} is not in the spec"
    if machine.config.standbys and not spec.standbys:
        return "the spec asks for no standbys"
    return f"the spec asks for {spec.regions[region]} in {region}"


def make_plan(spec: AppSpec, machines: list[Machine]) -> Plan:
    """What a deploy of `spec` does to an app that has `machines` (no I/O)."""
    by_slot: dict[str, list[Machine]] = {}
    for m in machines:
        meta = m.config.metadata
        if m.state in GONE or meta.get(META_APP) != spec.app or not meta.get(META_SLOT):
            continue  # not made by a deploy: left alone
        by_slot.setdefault(meta[META_SLOT], []).append(m)
    slots: list[SlotPlan] = []
    extras: list[SlotPlan] = []

    def take(slot: str, region: str, index: int, role: str) -> Machine | None:
        keep, duplicates = _pick(spec, by_slot.pop(slot, []))
        for dup in duplicates:
            assert keep is not None
            extras.append(
                SlotPlan(slot, region, index, role, DESTROY, f"duplicate of {keep.id}", dup)
            )
        return keep

    for region, count in spec.regions.items():
        for n in range(1, count + 1):
            name = spec.slot(region, n)
            primary = take(name, region, n, PRIMARY)
            action, reason = _primary_action(spec, primary)
            slots.append(SlotPlan(name, region, n, PRIMARY, action, reason, primary))
            if not spec.standbys:
                continue
            name = spec.slot(region, n, standby=True)
            standby = take(name, region, n, STANDBY)
            action, reason = _standby_action(
                spec, standby, primary if slots[-1].action != CREATE else None
            )
            slots.append(SlotPlan(name, region, n, STANDBY, action, reason, standby))
    for slot, found in sorted(by_slot.items()):
        for m in found:
            role = STANDBY if m.config.standbys else PRIMARY
            extras.append(SlotPlan(slot, m.region, 0, role, DESTROY, _why_extra(spec, m), m))
    return Plan(spec.app, spec.digest, slots + extras)


async def plan(client: Client, spec: AppSpec) -> Plan:
    """The plan against the app's machines as flaps lists them now."""
    return make_plan(spec, await client.list_machines(spec.app))


@dataclass(frozen=True)
class Room:
    """What a plan creates in a region against what fits there now."""

    region: str
    creates: int
    fits: int

    @property
    def short(self) -> bool:
        return self.creates > self.fits

    def __str__(self) -> str:
        return f"region {self.region} has room for {self.fits}, the plan creates {self.creates}"


async def room(client: Client, spec: AppSpec, the_plan: Plan) -> list[Room]:
    """Each region the plan creates machines in, with how many of the spec's size fit there
    (SimulatePlacement's `fits`: summed over the region's alive, open workers). One question
    per region: asked slot by slot, a region says yes forty times to forty machines when
    thirty fit."""
    creates: dict[str, int] = {}
    for p in the_plan.slots:
        if p.action == CREATE:
            creates[p.region] = creates.get(p.region, 0) + 1
    out = []
    for region, n in sorted(creates.items()):
        config = spec.machine_config(region, spec.slot(region, 1))
        sim = await client.simulate_placement(spec.app, config, region=region)
        out.append(Room(region, n, sim.fits))
    return out


# -- events and the report ---------------------------------------------------------------------


@dataclass(frozen=True)
class DeployEvent:
    """One step of a deploy, as it happens.

    kind: planned, creating, created, updating, updated, checking, passed, failed, warning,
    rolling_back, rolled_back, undoing, undone, destroying, destroyed, done.
    """

    kind: str
    slot: str = ""
    machine_id: str = ""
    region: str = ""
    detail: str = ""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass
class Failure:
    """Why a deploy stopped: the machine and check involved and what was seen."""

    reason: str
    slot: str = ""
    machine_id: str = ""
    region: str = ""
    check: str = ""
    observed: str = ""
    rejections: dict[str, int] = field(default_factory=dict)


@dataclass
class MachineRow:
    slot: str
    role: str
    machine_id: str
    region: str
    worker_id: str
    state: str
    instance_id: str


@dataclass
class DeployReport:
    app: str
    digest: str
    ok: bool = True
    reason: str = ""
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    destroyed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    rolled_back: list[str] = field(default_factory=list)
    # Machines this run created and destroyed again when it failed (see keep_created).
    undone: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    failure: Failure | None = None
    machines: list[MachineRow] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Failed(Exception):
    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.reason)
        self.failure = failure


@dataclass
class _Change:
    """A machine this deploy updated, and how to put it back."""

    plan: SlotPlan
    previous: MachineConfig
    was_running: bool


# -- readiness ---------------------------------------------------------------------------------


def check_budgets(config: MachineConfig, grace: float) -> dict[str, float]:
    """How long each of a config's checks may fail after the machine started before a deploy
    gives up on it: `grace` plus the check's timeout, by the name flyd's reasons give it."""
    return {
        c.name or f"check-{i}": grace + checks.seconds(c.timeout, checks.DEFAULT_CHECK_TIMEOUT)
        for i, c in enumerate(config.checks)
    }


def _why(message: str) -> str:
    """flyd's reason in a WaitMachine error ("machine m1 is started, not ready after 5s:
    check root: answered 500" -> "check root: answered 500"); the message when it has none."""
    found = _NOT_READY.search(message)
    return message[found.end() :] if found else message


def _named(reason: str, names: list[str]) -> str:
    """The check a reason of flyd's is about ("check admin: nothing listening on port 9090"),
    or "" when it names none of `names` (a crash loop, a port nobody checks)."""
    # Longest first: of checks "web" and "web-2", "check web-2: ..." is about the second.
    return next((n for n in sorted(names, key=len, reverse=True) if f"check {n}:" in reason), "")


@dataclass(frozen=True)
class _NotReady:
    """Why a machine did not become ready within its budget: flyd's reason and the check it
    names, if any."""

    check: str
    reason: str


# -- the deploy --------------------------------------------------------------------------------


async def deploy(
    client: Client,
    spec: AppSpec,
    *,
    on_event: EventHandler | None = None,
    wait_timeout: float = 60.0,
    keep_created: bool = False,
) -> DeployReport:
    """Make the app's machines match `spec`; see the module docstring for the steps.

    `wait_timeout` bounds each wait for a machine to reach a state. Never raises ApiError: a
    deploy that could not finish returns `ok=False` with the reason and what it changed. A
    deploy that fails after creating machines destroys them again unless `keep_created`.
    """
    if wait_timeout <= 0:
        raise ValueError(f"wait_timeout must be > 0, got {wait_timeout}")
    deployer = _Deployer(client, spec, on_event, wait_timeout)
    deployer.keep_created = keep_created
    return await deployer.run()


class _Deployer:
    def __init__(
        self, client: Client, spec: AppSpec, on_event: EventHandler | None, wait_timeout: float
    ) -> None:
        self.client = client
        self.spec = spec
        self.on_event = on_event
        self.wait_timeout = wait_timeout
        # Each of the spec's checks by the name flyd gives it: its grace period and timeout.
        self.budgets = {c.label(i): c.grace_period + c.timeout for i, c in enumerate(spec.checks)}
        # A previous config's checks have no grace period of their own (configs carry none).
        self.rollback_grace = max((c.grace_period for c in spec.checks), default=10.0)
        grace = max((c.grace_period + c.timeout for c in spec.checks), default=0.0)
        self.lease_ttl = min(MAX_LEASE, 2 * wait_timeout + grace + 60)
        self.report = DeployReport(spec.app, spec.digest)
        self.changes: list[_Change] = []
        self.current: dict[str, Machine] = {}  # slot -> the machine as last seen
        self.secrets_from = ""  # a machine whose secrets the machines this deploy creates get
        self.keep_created = False

    # -- plumbing --------------------------------------------------------------------------

    def emit(self, kind: str, p: SlotPlan | None = None, machine_id: str = "", **kw: str) -> None:
        event = DeployEvent(
            kind,
            slot=p.slot if p else "",
            machine_id=machine_id or (p.machine_id if p else ""),
            region=p.region if p else "",
            detail=kw.get("detail", ""),
        )
        log.info(
            f"deploy_{kind}",
            app=self.spec.app,
            slot=event.slot,
            machine_id=event.machine_id,
            detail=event.detail,
        )
        if self.on_event is not None:
            self.on_event(event)

    def fail(self, p: SlotPlan, machine_id: str, reason: str, **kw: Any) -> _Failed:
        return _Failed(Failure(reason, slot=p.slot, machine_id=machine_id, region=p.region, **kw))

    @contextlib.asynccontextmanager
    async def lease(self, p: SlotPlan, machine_id: str) -> AsyncIterator[str]:
        """Hold the machine's lease while changing it, so no one else (another deploy, the
        edge's autostop) acts on it meanwhile."""
        try:
            lease = await self.client.acquire_lease(
                machine_id,
                self.lease_ttl,
                owner="nonomad deploy",
                description=f"deploy of {self.spec.app} ({self.spec.digest})",
            )
        except FailedPrecondition as err:
            if err.reason == "LEASE_HELD":
                message = f"{machine_id} is leased by someone else: {err.message}"
            else:  # destroyed meanwhile
                message = err.message
            raise self.fail(p, machine_id, message) from None
        try:
            yield lease.nonce
        finally:
            with contextlib.suppress(ApiError):  # destroyed, or the lease already lapsed
                await self.client.release_lease(machine_id, lease.nonce)

    async def wait_state(self, p: SlotPlan, machine: Machine, state: str) -> Machine:
        """Wait until the machine (this instance of it) is in `state`; fail at the deadline or
        as soon as it FAILED."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_timeout
        seen = machine
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise self.fail(
                    p,
                    machine.id,
                    f"{machine.id} is {state_name(seen.state)}, not {state}, "
                    f"after {self.wait_timeout:g}s",
                    observed=_exit_of(seen),
                )
            try:
                return await self.client.wait_machine(
                    machine.id,
                    state,
                    wait=min(remaining, WAIT_CHUNK),
                    instance_id=machine.instance_id,
                )
            except DeadlineExceeded:
                pass
            except FailedPrecondition as err:  # replaced by someone else, or destroyed
                raise self.fail(p, machine.id, err.message) from None
            seen = await self.client.get_machine(machine.id)
            if seen.state == S.MACHINE_STATE_FAILED and state != "failed":
                raise self.fail(
                    p, machine.id, f"{machine.id} failed to start", observed=_exit_of(seen)
                )

    async def update(
        self, machine_id: str, config: MachineConfig, *, launch: bool, nonce: str
    ) -> Machine:
        """UpdateMachine, retried while the worker says the machine is busy (mid-start, say,
        or mid-restart after a crash) until the wait deadline."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_timeout
        while True:
            try:
                return await self.client.update_machine(
                    machine_id,
                    config,
                    skip_launch=not launch,
                    lease_nonce=nonce,
                    timeout=UPDATE_TIMEOUT,
                )
            except FailedPrecondition as err:
                # Anything but busy (destroyed, leased by another) will not change by waiting.
                if err.reason != "MACHINE_BUSY" or loop.time() > deadline:
                    raise
                await asyncio.sleep(0.2)

    async def wait_ready(
        self, p: SlotPlan, machine: Machine, budgets: dict[str, float]
    ) -> tuple[Machine, _NotReady | None]:
        """Wait until flyd says this started instance serves (WaitMachine with ready: its
        checks pass on its worker; without checks, its ports accept). (the machine, None) when
        it does, else (the machine as last seen, why not). flyd runs the checks and keeps
        probing; the deploy only decides how long to wait: a reason naming a check ends the
        wait once that check's budget (`budgets`: seconds since the start) is spent, any other
        reason once the largest is (or `wait_timeout`, when there are no checks)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        total = max(budgets.values(), default=self.wait_timeout)
        while True:
            elapsed = loop.time() - start
            # Ask again when the next budget runs out, within the SDK's limit on one wait.
            until = min((b for b in budgets.values() if b > elapsed), default=total)
            chunk = max(MIN_READY_CHUNK, min(until - elapsed, MAX_WAIT))
            try:
                ready = await self.client.wait_machine(
                    machine.id, "started", wait=chunk, instance_id=machine.instance_id, ready=True
                )
                return ready, None
            except DeadlineExceeded as err:
                reason = _why(err.message)
            except FailedPrecondition as err:
                if err.reason:  # replaced by someone else, or destroyed
                    raise self.fail(p, machine.id, err.message) from None
                return machine, _NotReady("", _why(err.message))  # failed: never ready
            check = _named(reason, list(budgets))
            elapsed = loop.time() - start
            if elapsed >= (budgets[check] if check else total):
                return machine, _NotReady(check, reason)

    async def gate(self, p: SlotPlan, machine: Machine) -> Machine:
        """Wait for this instance to start, then for flyd to say it serves (its checks pass)."""
        self.emit("checking", p, machine.id)
        started = await self.wait_state(p, machine, "started")
        self.current[p.slot] = started
        ready, bad = await self.wait_ready(p, started, self.budgets)
        if bad is not None:
            seen = bad.reason + await self.exit_note(started)
            self.emit("failed", p, machine.id, detail=seen)
            raise self.fail(
                p,
                machine.id,
                f"{p.slot} ({machine.id}) is not ready: {seen}",
                check=bad.check,
                observed=seen,
            )
        self.current[p.slot] = ready
        self.emit("passed", p, machine.id, detail=", ".join(self.budgets) or "ready")
        return ready

    async def exit_note(self, machine: Machine) -> str:
        """When the machine's process exited since it started (a crash loop, a config that
        kills it), how it ended and its last log lines: often the real reason a check failed."""
        try:
            now = await self.client.get_machine(machine.id)
            if now.instance_id != machine.instance_id or not (
                now.state != S.MACHINE_STATE_STARTED
                or now.restart_count
                or now.last_exit.ByteSize()
            ):
                return ""
            lines = [line async for line in self.client.machine_logs(machine.id, tail_lines=10)]
        except ApiError:
            return ""
        note = _exit_of(now)
        lines = [line for line in lines if line.strip()]
        if lines and not now.log_tail:
            note += "; log: " + " | ".join(lines[-3:])
        return f" (the machine: {note})"

    def config_for(self, p: SlotPlan) -> MachineConfig:
        if p.role == PRIMARY:
            return self.spec.machine_config(p.region, p.slot)
        primary = self.current.get(self.spec.slot(p.region, p.index))
        assert primary is not None, f"standby {p.slot} planned without its primary"
        return self.spec.machine_config(p.region, p.slot, standby_for=primary.id)

    # -- the steps -------------------------------------------------------------------------

    async def run(self) -> DeployReport:
        try:
            the_plan = await plan(self.client, self.spec)
        except ApiError as err:
            return self.finish(Failure(f"cannot plan the deploy: {err}"))
        counts = the_plan.counts()
        self.emit("planned", detail=", ".join(f"{n} {a}" for a, n in sorted(counts.items())))
        for p in the_plan.slots:
            if p.machine is not None and p.action != DESTROY:
                self.current[p.slot] = p.machine
            if p.action == UNCHANGED:
                self.report.unchanged.append(p.machine_id)
        try:
            await self.rolling_update(the_plan)
        except (_Failed, ApiError) as err:
            failure = _as_failure(err)
            await self.rollback()
            return self.finish(failure)
        try:
            short = [r for r in await room(self.client, self.spec, the_plan) if r.short]
        except ApiError as err:
            return self.finish(Failure(f"cannot ask flaps for room: {err}"))
        if short:
            return self.finish(
                Failure(
                    "no room: " + "; ".join(map(str, short)),
                    region=short[0].region,
                    rejections={"no_room": sum(r.creates - r.fits for r in short)},
                )
            )
        try:
            await self.create_missing(the_plan)
            await self.destroy_extras(the_plan)
        except (_Failed, ApiError) as err:
            failure = _as_failure(err)
            if not self.keep_created:
                await self.undo_creates()
            return self.finish(failure)
        await self.settle()
        return self.finish(None)

    def finish(self, failure: Failure | None) -> DeployReport:
        report = self.report
        if failure is not None:
            report.ok = False
            report.failure = failure
            report.reason = failure.reason
            if report.rolled_back:
                report.reason += f"; rolled back {', '.join(report.rolled_back)}"
            if report.undone:
                report.reason += f"; destroyed what it created: {', '.join(report.undone)}"
            created = [i for i in report.created if i not in report.undone]
            kept = [*created, *(i for i in report.updated if i not in report.rolled_back)]
            if kept:
                report.reason += f"; changed and kept: {', '.join(kept)}"
        self.emit("done", detail="ok" if report.ok else report.reason)
        return report

    async def rolling_update(self, the_plan: Plan) -> None:
        for p in the_plan.slots:
            if p.action != UPDATE:
                continue
            assert p.machine is not None
            machine = p.machine
            # The primary, and a standby in service; not a primary that stands by since its
            # standby took over (flyd starts a standby only when it is promoted).
            gated = machine.state in RUNNING or (p.role == PRIMARY and slots.is_primary(machine))
            config = self.config_for(p)
            for name in machine.config.secrets:  # `nonomad secrets set`'s: kept as they are
                config.secrets[name] = REDACTED
            self.emit("updating", p, detail=p.reason)
            async with self.lease(p, machine.id) as nonce:
                try:
                    new = await self.update(machine.id, config, launch=gated, nonce=nonce)
                except ResourceExhausted as err:
                    raise self.fail(
                        p,
                        machine.id,
                        f"worker {machine.worker_id} has no room for the new "
                        f"config of {machine.id}: {err.message}",
                        rejections=err.rejections,
                    ) from None
                previous = MachineConfig()
                previous.CopyFrom(machine.config)
                self.changes.append(_Change(p, previous, machine.state in RUNNING))
                self.report.updated.append(machine.id)
                self.current[p.slot] = new
                if gated:
                    await self.gate(p, new)
                else:
                    self.emit("updated", p, detail="kept stopped")

    async def rollback(self) -> None:
        """Put every machine this deploy updated back on its previous config, newest first."""
        for change in reversed(self.changes):
            p = change.plan
            self.emit("rolling_back", p)
            try:
                detail = await self._roll_back(change)
            except (_Failed, ApiError) as err:
                warning = f"rollback of {p.machine_id} failed: {err}"
                self.report.warnings.append(warning)
                self.emit("warning", p, detail=warning)
                continue
            self.report.rolled_back.append(p.machine_id)
            self.emit("rolled_back", p, detail=detail)

    async def _roll_back(self, change: _Change) -> str:
        p = change.plan
        async with self.lease(p, p.machine_id) as nonce:
            machine = await self.update(
                p.machine_id, change.previous, launch=change.was_running, nonce=nonce
            )
            self.current[p.slot] = machine
            if not change.was_running:
                return "previous config, kept stopped"
            machine = await self.wait_state(p, machine, "started")
            self.current[p.slot] = machine
        # flyd runs the previous config's own checks: the spec's may name ports it lacks.
        ready, bad = await self.wait_ready(
            p, machine, check_budgets(change.previous, self.rollback_grace)
        )
        self.current[p.slot] = ready
        if bad is None:
            return "previous config, started, checks pass"
        if bad.check:
            seen = bad.reason.removeprefix(f"check {bad.check}: ")
            return f"previous config, started, but check {bad.check} fails: {seen}"
        return f"previous config, started, but not ready: {bad.reason}"

    async def undo_creates(self) -> None:
        """Destroy what this run created, newest first (a standby before its primary)."""
        for machine_id in reversed(self.report.created):
            slot = next((s for s, m in self.current.items() if m.id == machine_id), "")
            self.emit("undoing", machine_id=machine_id, detail=slot)
            try:
                await self.client.destroy_machine(machine_id, force=True)
            except ApiError as err:
                warning = f"could not destroy {machine_id}, which this deploy created: {err}"
                self.report.warnings.append(warning)
                self.emit("warning", machine_id=machine_id, detail=warning)
                continue
            self.current.pop(slot, None)
            self.report.undone.append(machine_id)
            self.emit("undone", machine_id=machine_id, detail=slot)

    async def create_missing(self, the_plan: Plan) -> None:
        # The app's secrets live on its machines only: a new machine gets them from one that
        # stays up while this deploy creates (the one with the most of them).
        sources = [
            p.machine
            for p in the_plan.slots
            if p.machine and p.machine.config.secrets and p.action != REPLACE
        ]
        source = max(sources, key=lambda m: len(m.config.secrets), default=None)
        self.secrets_from = source.id if source else ""
        secrets = sorted({n for p in the_plan.slots if p.machine for n in p.machine.config.secrets})
        missing = [n for n in secrets if source is None or n not in source.config.secrets]
        if missing and any(p.action in (CREATE, REPLACE) for p in the_plan.slots):
            warning = (
                f"new machines start without the app's secrets ({', '.join(missing)}): "
                f"set them again with `nonomad secrets set {self.spec.app} NAME=VALUE ...`"
            )
            self.report.warnings.append(warning)
            self.emit("warning", detail=warning)
        for p in the_plan.slots:
            if p.action == CREATE and p.role == PRIMARY:
                config = self.config_for(p)
                self.emit("creating", p, detail=p.reason)
                machine = await self.create(p, config)
                self.report.created.append(machine.id)
                self.current[p.slot] = machine
                self.emit("created", p, machine.id, detail=f"on {machine.worker_id}")
                await self.gate(p, machine)
            elif p.action in (CREATE, REPLACE) and p.role == STANDBY:
                if p.action == REPLACE:
                    assert p.machine is not None
                    await self.destroy(p, p.machine)
                    self.current.pop(p.slot, None)
                await self.create_standby(p)

    async def create_standby(self, p: SlotPlan) -> None:
        config = self.config_for(p)
        primary = config.standbys[0]
        self.emit("creating", p, detail=f"standby for {primary}")
        try:
            machine = await self.create(p, config, standby_for=primary)
        except _Failed as failed:
            reasons = set(failed.failure.rejections)
            if reasons != {"standby_conflict"}:
                raise
            # Every worker of the region holds the primary: nowhere to stand by. Not fatal:
            # the app runs; it just has no failover there.
            warning = f"no standby for {primary} in {p.region}: no other worker"
            self.report.warnings.append(warning)
            self.emit("warning", p, detail=warning)
            return
        self.report.created.append(machine.id)
        self.current[p.slot] = machine
        state = state_name(machine.state)
        self.emit("created", p, machine.id, detail=f"on {machine.worker_id}, {state}, standing by")

    async def create(self, p: SlotPlan, config: MachineConfig, standby_for: str = "") -> Machine:
        """Create the slot's machine under a key derived from app, slot, digest (and primary):
        a retry, in this deploy or a rerun of it, returns the same machine. A key whose machine
        was destroyed since (a slot removed, then wanted again) moves to its next generation."""
        base = f"nonomad-deploy/{self.spec.app}/{p.slot}/{self.spec.digest}"
        if standby_for:
            base += f"/{standby_for}"
        for generation in range(MAX_KEY_GENERATIONS):
            key = base if generation == 0 else f"{base}/{generation}"
            machine = await self._create_once(p, config, key, standby_for)
            if machine.state not in GONE:
                return machine
        raise self.fail(p, "", f"every idempotency key of {p.slot} names a destroyed machine")

    async def _create_once(
        self, p: SlotPlan, config: MachineConfig, key: str, standby_for: str
    ) -> Machine:
        for attempt in range(1, CREATE_ATTEMPTS + 1):
            try:
                return await self.client.create_machine(
                    self.spec.app,
                    config,
                    region=p.region,
                    name=p.slot,
                    standby_for=[standby_for] if standby_for else [],
                    idempotency_key=key,
                    secrets_from=self.secrets_from,
                )
            except ResourceExhausted as err:
                reasons = ", ".join(f"{r}: {n}" for r, n in sorted(err.rejections.items()))
                raise self.fail(
                    p,
                    "",
                    f"no room in region {p.region} for {p.slot} ({reasons or err.message})",
                    rejections=err.rejections,
                ) from None
            except (Unavailable, DeadlineExceeded):
                if attempt == CREATE_ATTEMPTS:
                    raise
                await asyncio.sleep(0.2 * attempt)  # the same key: a retry cannot create twice
        raise AssertionError("unreachable")

    async def destroy_extras(self, the_plan: Plan) -> None:
        extras = [p for p in the_plan.slots if p.action == DESTROY]
        for p in sorted(extras, key=lambda p: p.role != STANDBY):  # standbys first
            assert p.machine is not None
            await self.destroy(p, p.machine)

    async def destroy(self, p: SlotPlan, machine: Machine) -> None:
        """Stop gracefully (the config's signal and timeout), then destroy."""
        self.emit("destroying", p, machine.id, detail=p.reason)
        async with self.lease(p, machine.id) as nonce:
            current = await self.client.get_machine(machine.id)
            if current.state in RUNNING:
                stopped = await self.client.stop_machine(machine.id, lease_nonce=nonce)
                with contextlib.suppress(_Failed):  # did not stop in time: destroy kills it
                    await self.wait_state(p, stopped, "stopped")
            await self.client.destroy_machine(machine.id, force=True, lease_nonce=nonce)
        self.report.destroyed.append(machine.id)
        self.emit("destroyed", p, machine.id)

    async def settle(self) -> None:
        """Wait until flaps lists the result (its view follows the workers), so that a plan
        made right after this deploy sees what it did."""
        want = {m.id: m.instance_id for m in self.current.values()}
        gone = set(self.report.destroyed)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_timeout
        while True:
            listed = {m.id: m for m in await self.client.list_machines(self.spec.app)}
            if all(listed.get(i) and listed[i].instance_id == v for i, v in want.items()) and not (
                gone & listed.keys()
            ):
                break
            if loop.time() > deadline:
                warning = f"flaps did not list the result within {self.wait_timeout:g}s"
                self.report.warnings.append(warning)
                self.emit("warning", detail=warning)
                break
            await asyncio.sleep(0.1)
        for slot, m in sorted(self.current.items()):
            m = listed.get(m.id, m)
            role = STANDBY if m.config.standbys else PRIMARY
            self.report.machines.append(
                MachineRow(
                    slot, role, m.id, m.region, m.worker_id, state_name(m.state), m.instance_id
                )
            )


def _as_failure(err: _Failed | ApiError) -> Failure:
    return err.failure if isinstance(err, _Failed) else Failure(str(err))


def _exit_of(machine: Machine) -> str:
    """What a machine's last exit and log say, for a report."""
    parts = [f"state {state_name(machine.state)}"]
    last = machine.last_exit
    if last.has_exit_code:
        parts.append(f"exit code {last.exit_code}")
    if last.signal:
        parts.append(f"killed by {last.signal}")
    if last.oom_killed:
        parts.append("out of memory")
    lines = [line for line in machine.log_tail if line.strip()]
    if lines:
        parts.append("log: " + " | ".join(lines[-3:]))
    return "; ".join(parts)
