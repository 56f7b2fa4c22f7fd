"""The machine state machine: (row, event) -> (new row, effects). No I/O here.

A runner (flyd.runner) commits each new row to the machine log together with
a log record, and only then performs the effects, feeding their outcome back
in as the next event. Because a row names the operation in progress and its
step, a flyd that restarts can resume every unfinished operation from the
last committed step; every effect is safe to perform twice.

Operations and their steps:

    start           begin -> spawn -> release -> (STARTED)
    stop            kill -> (STOPPED)
    restart         kill -> spawn -> release -> (STARTED)
    update          [kill ->] spawn -> release -> (STARTED)  new config, same id
    policy_restart  backoff -> spawn -> release -> (STARTED)   after a crash
    signal          send -> (unchanged)
    destroy         [kill ->] cleanup [-> retry after a backoff ...] -> (DESTROYED)
    promote         a start naming a generation: the slot claim, then as start
    supersede       the slot claim, then as stop                 (outranked by another member)
    fence           (unchanged) fenced / unfenced                (its worker came back)

Spawning is two-phase (spawn holds the process before it runs anything,
release lets it go) so that the process handle is committed before the
machine's command runs: a crash in between can never start a machine twice.
The spawned step already declares the machine STARTED, with the release
still pending in its row; once released, the row only drops the pending
step. That last change is `lazy`: a runner may make it durable with a later
commit, because recovering from the row before it reaches the same state (a
live process is re-attached as running, a dead one is spawned again).
"""

from __future__ import annotations

import base64
import json
import signal as signals
import struct
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from google.protobuf.timestamp_pb2 import Timestamp

from flyd import conditions
from flyd.v1 import machine_pb2 as pb
from model import slots
from model.errors import (
    BUSY,
    DESTROYED,
    LEASED,
    STANDBY,
    WRONG_STATE,
    CorruptLog,
    FailedPrecondition,
)

S = pb.MachineState
STATE_NAMES: dict[int, str] = {
    value: name.removeprefix("MACHINE_STATE_").lower() for name, value in pb.MachineState.items()
}
# How many recent state changes a machine row carries for GetMachine.
EVENT_TAIL = 10
# Attempts to spawn before a start is given up as FAILED.
MAX_SPAWN_ATTEMPTS = 3
# Attempts to clean up after a destroy (backing off between them, as the restart policy does)
# before the machine is declared destroyed anyway, with what was left behind in its reason.
MAX_CLEANUP_ATTEMPTS = 10

OpKind = Literal["start", "stop", "restart", "policy_restart", "signal", "destroy", "update"]


def state_name(state: int) -> str:
    return STATE_NAMES.get(state, str(state))


@dataclass(frozen=True)
class Op:
    """The operation in progress on a machine and the step it has reached."""

    kind: OpKind
    step: str
    signal: int = int(signals.SIGTERM)
    timeout: float = 10.0
    not_before: float = 0.0  # backoff: do not spawn before this time
    attempts: int = 0
    launch: bool = True  # update: start the machine again afterwards


@dataclass(frozen=True)
class Row:
    """Everything flyd keeps about one machine: the public view plus internals."""

    machine: pb.Machine
    image_digest: str
    op: Op | None = None
    handle: dict[str, Any] | None = None  # the driver's process handle
    restarts: tuple[float, ...] = ()  # times of policy restarts, for the retry window
    lease: dict[str, Any] | None = None  # nonce, expires_at, owner, description
    # The config's secrets by name, sealed with the worker's key (flyd.secrets); the
    # machine's config has each one's name only.
    secrets: dict[str, str] = field(default_factory=dict)
    # flaps' placement decision (a serialized pb.PlacementDecision), kept from the create on;
    # b"" when the machine was created without one. Not part of the public row: it is read
    # with GetPlacement, and no stream or snapshot carries it.
    placement: bytes = b""

    @property
    def state(self) -> int:
        return self.machine.state

    @property
    def running(self) -> bool:
        return self.handle is not None


# --- events (inputs) ---------------------------------------------------------


@dataclass(frozen=True)
class StartRequested:
    generation: int = 0  # > 0: a promotion to this slot generation (see model.slots)


@dataclass(frozen=True)
class Fence:
    """The worker came back: not routable until it confirms its slot claim (docs/fencing.md)."""

    reason: str


@dataclass(frozen=True)
class Confirm:
    """No other member of the slot outranks the claim at `generation`: routable again."""

    generation: int


@dataclass(frozen=True)
class Supersede:
    """`primary` serves the slot at `generation`; when that outranks this row's claim, the
    machine stops (with its stop signal and timeout) and stands by for `primary`."""

    generation: int
    primary: str
    signal: int = int(signals.SIGTERM)
    timeout: float = 10.0


@dataclass(frozen=True)
class StopRequested:
    signal: int
    timeout: float


@dataclass(frozen=True)
class RestartRequested:
    signal: int
    timeout: float


@dataclass(frozen=True)
class SignalRequested:
    signal: int


@dataclass(frozen=True)
class DestroyRequested:
    force: bool


@dataclass(frozen=True)
class UpdateRequested:
    """Replace the config in place; the worker has already pulled the image and mapped ports."""

    config: pb.MachineConfig
    instance_id: str
    image_digest: str
    ports: tuple[pb.PortMapping, ...]
    launch: bool
    stop_signal: int
    stop_timeout: float
    secrets: dict[str, str] = field(default_factory=dict)  # sealed, as Row.secrets


@dataclass(frozen=True)
class Spawned:
    handle: dict[str, Any]
    address: str = ""  # the machine's own, when its worker routes machines (Machine.address)


@dataclass(frozen=True)
class SpawnFailed:
    error: str


@dataclass(frozen=True)
class Released:
    pass


@dataclass(frozen=True)
class Signalled:
    pass


@dataclass(frozen=True)
class CleanedUp:
    pass


@dataclass(frozen=True)
class CleanupFailed:
    error: str


@dataclass(frozen=True)
class TimerFired:
    pass


@dataclass(frozen=True)
class Exited:
    """The process behind `handle` ended (reported by the driver)."""

    handle: dict[str, Any]
    exit_code: int | None
    signal: int | None
    oom_killed: bool
    log_tail: tuple[str, ...] = ()
    released: bool = True  # False: it was held and ran nothing of the machine's


@dataclass(frozen=True)
class Resume:
    """flyd restarted; `alive` says whether the row's process is still running."""

    alive: bool


Event = (
    StartRequested
    | StopRequested
    | RestartRequested
    | SignalRequested
    | DestroyRequested
    | UpdateRequested
    | Spawned
    | SpawnFailed
    | Released
    | Signalled
    | CleanedUp
    | CleanupFailed
    | TimerFired
    | Exited
    | Resume
    | Fence
    | Confirm
    | Supersede
)

# --- effects (outputs) ------------------------------------------------------


@dataclass(frozen=True)
class Spawn:
    """Create the machine's process, held before it runs; answer Spawned or SpawnFailed."""


@dataclass(frozen=True)
class Release:
    """Let the held process run; answer Released."""


@dataclass(frozen=True)
class Kill:
    """Send `signal`, SIGKILL the tree after `timeout`; the driver reports Exited."""

    signal: int
    timeout: float


@dataclass(frozen=True)
class SendSignal:
    signal: int


@dataclass(frozen=True)
class Cleanup:
    """Remove the machine's process resources (cgroups, run dir); answer CleanedUp."""


@dataclass(frozen=True)
class StartTimer:
    at: float


Effect = Spawn | Release | Kill | SendSignal | Cleanup | StartTimer


@dataclass(frozen=True)
class Policy:
    """Restart policy settings that come from the worker, not the machine."""

    window: float = 300.0  # restarts are counted within this many seconds
    default_max_retries: int = 10
    backoff_base: float = 0.5
    backoff_max: float = 30.0


@dataclass(frozen=True)
class Transition:
    """A step to commit: the new row, what happened, and what to do next."""

    row: Row
    type: str
    reason: str
    from_state: int
    effects: tuple[Effect, ...] = ()
    # Nothing to log: only flyd's internals changed (the public Machine did not), and losing
    # the change in a crash is safe. The runner may commit it later, with another transaction.
    lazy: bool = False

    @property
    def to_state(self) -> int:
        return self.row.state


@dataclass
class _Builder:
    """Accumulates a transition from a row; keeps the step functions short."""

    row: Row
    now: float
    type: str
    effects: list[Effect] = field(default_factory=list)

    def to(self, state: int, reason: str, **changes: Any) -> Transition:
        machine = pb.Machine()
        machine.CopyFrom(self.row.machine)
        from_state = machine.state
        machine.state = state  # type: ignore[assignment]
        machine.updated_at.CopyFrom(timestamp(self.now))
        conditions.after_step(machine, from_state, self.type, reason)
        new = replace(self.row, machine=machine, **changes)
        return Transition(new, self.type, reason, from_state, tuple(self.effects))


def timestamp(now: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(now * 1e9))
    return ts


def signal_name(sig: int) -> str:
    try:
        return signals.Signals(sig).name
    except ValueError:
        return str(sig)


def describe_exit(ev: Exited) -> str:
    if not ev.released:
        return "ended before it was released"
    if ev.exit_code is not None:
        return f"exited with code {ev.exit_code}"
    text = f"killed by {signal_name(ev.signal or 0)}"
    return text + " (out of memory)" if ev.oom_killed else text


# --- the transition function -----------------------------------------------


def step(row: Row, event: Event, *, now: float, policy: Policy) -> Transition | None:
    """Apply one event. None means nothing changes (an idempotent repeat or a stale event).

    Raises FailedPrecondition when the event is not allowed in the current state.
    """
    match event:
        case StartRequested(generation=generation):
            return _start(row, now, generation)
        case Fence(reason=why):
            return _slot_change(row, now, slots.fenced(row.machine), f"fenced: {why}")
        case Confirm(generation=generation):
            why = f"fence lifted: no member of its slot outranks generation {generation}"
            return _slot_change(row, now, slots.lifted(row.machine, generation), why)
        case Supersede():
            return _supersede(row, event, now)
        case StopRequested(signal=sig, timeout=timeout):
            return _stop(row, now, sig, timeout)
        case RestartRequested(signal=sig, timeout=timeout):
            if row.state != S.MACHINE_STATE_STARTED or row.op is not None:
                raise FailedPrecondition(
                    f"restart needs a started machine; it is {state_name(row.state)}",
                    BUSY if row.op is not None else WRONG_STATE,
                )
            op = Op("restart", "kill", signal=sig, timeout=timeout)
            b = _Builder(row, now, "restart", [Kill(sig, timeout)])
            return b.to(S.MACHINE_STATE_RESTARTING, "restart requested", op=op)
        case SignalRequested(signal=sig):
            if row.state != S.MACHINE_STATE_STARTED or row.handle is None:
                raise FailedPrecondition(
                    f"signal needs a started machine; it is {state_name(row.state)}",
                    BUSY if row.op is not None else WRONG_STATE,
                )
            b = _Builder(row, now, "signal", [SendSignal(sig)])
            return b.to(row.state, f"{signal_name(sig)} requested", op=Op("signal", "send", sig))
        case DestroyRequested(force=force):
            return _destroy(row, now, force)
        case UpdateRequested():
            return _update(row, event, now)
        case Spawned(handle=handle, address=address):
            if row.op is None or row.op.step != "spawn":
                return None
            # Committed before the release: declared started, with the release still pending.
            b = _Builder(row, now, row.op.kind, [Release()])
            spawned = b.to(
                S.MACHINE_STATE_STARTED,
                f"running (pid {handle.get('pid')})",
                op=replace(row.op, step="release"),
                handle=handle,
            )
            spawned.row.machine.address = address  # (a copy of the row's: b.to made it)
            return spawned
        case SpawnFailed(error=error):
            if row.op is None or row.op.step != "spawn":
                return None
            return _retry_spawn(row, now, f"could not spawn: {error}")
        case Released():
            if row.op is None or row.op.step != "release":
                return None
            return Transition(
                replace(row, op=None), row.op.kind, "released", row.state, (), lazy=True
            )
        case Signalled():
            if row.op is None or row.op.kind != "signal":
                return None
            return _Builder(row, now, "signal").to(row.state, "signal delivered", op=None)
        case CleanedUp():
            if row.op is None or row.op.step != "cleanup":
                return None
            b = _Builder(tombstone(row), now, "destroy")
            return b.to(S.MACHINE_STATE_DESTROYED, "destroyed", op=None)
        case CleanupFailed(error=error):
            if row.op is None or row.op.step != "cleanup":
                return None
            return _retry_cleanup(row, now, policy, error)
        case TimerFired():
            if row.op is None or row.op.step not in ("backoff", "cleanup"):
                return None
            if not row.op.not_before or now < row.op.not_before:
                return None
            if row.op.step == "cleanup":
                b = _Builder(row, now, "destroy", [Cleanup()])
                return b.to(row.state, "retrying cleanup", op=replace(row.op, not_before=0.0))
            b = _Builder(row, now, row.op.kind, [Spawn()])
            return b.to(row.state, "backoff elapsed", op=replace(row.op, step="spawn"))
        case Exited():
            return _exited(row, event, now, policy)
        case Resume(alive=alive):
            return _resume(row, now, alive)
    raise TypeError(f"unknown event {event!r}")


def _start(row: Row, now: float, generation: int) -> Transition | None:
    """A plain start, or a promotion naming a generation (model.slots.promotion)."""
    promoted = slots.promotion(row.machine, generation)
    if promoted is None:
        return _start_plain(row, now)
    row = _in_slot(row, promoted)
    why = f"promoted to generation {generation} of slot {promoted.id}"
    started = _start_plain(row, now)  # (refuses a destroyed or stopping machine)
    if started is None:  # running already (a fenced primary): the claim is the whole change
        return _Builder(row, now, "promote").to(row.state, why)
    return replace(started, type="promote", reason=f"{why}; {started.reason}")


def _in_slot(row: Row, slot: pb.SlotState) -> Row:
    return replace(row, machine=slots.with_slot(row.machine, slot))


def _slot_change(row: Row, now: float, slot: pb.SlotState | None, why: str) -> Transition | None:
    """Only the slot's claim or fence changes (None: nothing does)."""
    if slot is None:
        return None
    return _Builder(_in_slot(row, slot), now, "fence").to(row.state, why)


def _supersede(row: Row, ev: Supersede, now: float) -> Transition | None:
    new = slots.superseded(row.machine, ev.generation, ev.primary)
    if new is None or row.state == S.MACHINE_STATE_DESTROYED:
        return None
    was_primary = slots.is_primary(row.machine)
    row = _in_slot(row, new)
    why = f"{ev.primary} serves slot {new.id} at generation {ev.generation}"
    stop = None
    if was_primary and row.state != S.MACHINE_STATE_DESTROYING:
        stop = _stop(row, now, ev.signal, ev.timeout)  # the superseded copy stands by
    if stop is None:
        return _Builder(row, now, "supersede").to(row.state, why)
    return replace(stop, type="supersede", reason=f"superseded: {why}; {stop.reason}")


def _start_plain(row: Row, now: float) -> Transition | None:
    state = row.state
    if state in (S.MACHINE_STATE_DESTROYING, S.MACHINE_STATE_DESTROYED):
        raise FailedPrecondition(f"cannot start a {state_name(state)} machine", DESTROYED)
    if state == S.MACHINE_STATE_STOPPING:
        raise FailedPrecondition("machine is stopping; wait for stopped, then start", BUSY)
    if row.op is not None and row.op.kind == "policy_restart" and row.op.step == "backoff":
        # A user start during a restart backoff starts now instead of later.
        b = _Builder(row, now, "start", [Spawn()])
        return b.to(row.state, "start requested during backoff", op=replace(row.op, step="spawn"))
    if row.running or row.op is not None or state == S.MACHINE_STATE_STARTED:
        return None  # already started or starting
    b = _Builder(row, now, "start", [Spawn()])
    restarts: tuple[float, ...] = () if state == S.MACHINE_STATE_FAILED else row.restarts
    return b.to(
        S.MACHINE_STATE_STARTING, "start requested", op=Op("start", "spawn"), restarts=restarts
    )


def _stop(row: Row, now: float, sig: int, timeout: float) -> Transition | None:
    state = row.state
    if state in (S.MACHINE_STATE_DESTROYING, S.MACHINE_STATE_DESTROYED):
        raise FailedPrecondition(f"cannot stop a {state_name(state)} machine", DESTROYED)
    if row.op is not None and row.op.kind in ("stop", "destroy"):
        return None  # already stopping
    if row.running:
        b = _Builder(row, now, "stop", [Kill(sig, timeout)])
        return b.to(
            S.MACHINE_STATE_STOPPING,
            f"stop requested ({signal_name(sig)})",
            op=Op("stop", "kill", signal=sig, timeout=timeout),
        )
    if row.op is not None:
        # Nothing runs yet (a pending start or a restart backoff): cancel it.
        return _Builder(row, now, "stop").to(S.MACHINE_STATE_STOPPED, "stop requested", op=None)
    return None  # created, stopped or failed: nothing to stop


def _destroy(row: Row, now: float, force: bool) -> Transition | None:
    if row.state in (S.MACHINE_STATE_DESTROYING, S.MACHINE_STATE_DESTROYED):
        return None
    if row.running:
        if not force and row.state != S.MACHINE_STATE_STOPPING:
            raise FailedPrecondition(
                f"machine is {state_name(row.state)}; stop it first or destroy with force"
            )
        b = _Builder(row, now, "destroy", [Kill(int(signals.SIGKILL), 0.0)])
        return b.to(
            S.MACHINE_STATE_DESTROYING,
            "destroy requested",
            op=Op("destroy", "kill", signal=int(signals.SIGKILL), timeout=0.0),
        )
    b = _Builder(row, now, "destroy", [Cleanup()])
    return b.to(S.MACHINE_STATE_DESTROYING, "destroy requested", op=Op("destroy", "cleanup"))


def _update(row: Row, ev: UpdateRequested, now: float) -> Transition:
    if row.state in (S.MACHINE_STATE_DESTROYING, S.MACHINE_STATE_DESTROYED):
        raise FailedPrecondition(f"cannot update a {state_name(row.state)} machine", DESTROYED)
    if ev.launch and not slots.is_primary(row.machine):
        raise FailedPrecondition(
            f"machine {row.machine.id} stands by in slot {slots.slot_of(row.machine).id}: "
            "update it with skip_launch (only a promotion starts a standby)",
            STANDBY,
        )
    if row.op is not None and row.op.kind != "policy_restart":
        raise FailedPrecondition(f"machine is busy ({row.op.kind}); retry when it settles", BUSY)
    machine = pb.Machine()
    machine.CopyFrom(row.machine)
    machine.config.CopyFrom(ev.config)
    machine.instance_id = ev.instance_id
    machine.restart_count = 0
    del machine.ports[:]
    machine.ports.extend(ev.ports)
    del machine.log_tail[:]
    row = replace(
        row, machine=machine, image_digest=ev.image_digest, restarts=(), secrets=ev.secrets
    )
    reason = f"update to instance {ev.instance_id}"
    if row.running:
        op = Op("update", "kill", signal=ev.stop_signal, timeout=ev.stop_timeout, launch=ev.launch)
        b = _Builder(row, now, "update", [Kill(ev.stop_signal, ev.stop_timeout)])
        return b.to(S.MACHINE_STATE_STOPPING, f"{reason}: stopping the old one", op=op)
    if not ev.launch:
        state = S.MACHINE_STATE_STOPPED if row.op is not None else row.state
        return _Builder(row, now, "update").to(state, reason, op=None)
    b = _Builder(row, now, "update", [Spawn()])
    return b.to(S.MACHINE_STATE_STARTING, reason, op=Op("update", "spawn"))


def tombstone(row: Row) -> Row:
    """What a destroyed machine's row keeps while it stays readable: who it was, its image and
    size, its events; not the rest of its config, its log tail, its lease, its secrets nor its
    placement decision, so the rows a worker keeps (and sends in snapshots) stay small whatever
    the machines held."""
    machine = row.machine
    out = pb.Machine()
    out.CopyFrom(machine)
    out.config.Clear()
    out.config.image = machine.config.image
    out.config.guest.CopyFrom(machine.config.guest)
    out.ClearField("lease")
    del out.log_tail[:]
    return replace(row, machine=out, secrets={}, placement=b"")


def lease_held(row: Row, now: float) -> bool:
    return row.lease is not None and float(row.lease["expires_at"]) > now


def check_lease(row: Row, nonce: str, now: float) -> None:
    """Changes to a leased machine need the lease's nonce."""
    lease = row.lease
    if lease is not None and lease_held(row, now) and nonce != lease["nonce"]:
        raise FailedPrecondition(
            f"machine {row.machine.id} is leased by {lease['owner'] or 'someone'} for "
            f"{float(lease['expires_at']) - now:.0f}s more; pass its lease_nonce",
            LEASED,
        )


def _with_lease(row: Row, lease: dict[str, Any] | None, now: float, reason: str) -> Transition:
    machine = pb.Machine()
    machine.CopyFrom(row.machine)
    machine.ClearField("lease")
    if lease is not None:
        machine.lease.owner = lease["owner"]
        machine.lease.description = lease["description"]
        machine.lease.expires_at.CopyFrom(timestamp(float(lease["expires_at"])))
    b = _Builder(replace(row, machine=machine, lease=lease), now, "lease")
    return b.to(row.state, reason)


def acquire_lease(
    row: Row,
    *,
    new_nonce: str,
    nonce: str,
    ttl: float,
    owner: str,
    description: str,
    now: float,
) -> Transition:
    """Take the lease, or refresh it when `nonce` is the current one (keeping the nonce)."""
    if row.state in (S.MACHINE_STATE_DESTROYING, S.MACHINE_STATE_DESTROYED):
        raise FailedPrecondition(f"cannot lease a {state_name(row.state)} machine", DESTROYED)
    current = row.lease
    if current is not None and lease_held(row, now):
        if nonce != current["nonce"]:
            raise FailedPrecondition(
                f"machine {row.machine.id} is leased by {current['owner'] or 'someone'}",
                LEASED,
            )
        new_nonce = current["nonce"]
    lease = {
        "nonce": new_nonce,
        "expires_at": now + ttl,
        "owner": owner,
        "description": description,
    }
    return _with_lease(row, lease, now, f"lease held by {owner or 'someone'} for {ttl:g}s")


def release_lease(row: Row, nonce: str, now: float) -> Transition | None:
    """Drop the lease; an expired one goes whatever the nonce."""
    if row.lease is None:
        return None
    if lease_held(row, now) and nonce != row.lease["nonce"]:
        raise FailedPrecondition("that is not the nonce of the lease held on the machine", LEASED)
    return _with_lease(row, None, now, "lease released")


def _retry_spawn(row: Row, now: float, why: str) -> Transition:
    assert row.op is not None
    attempts = row.op.attempts + 1
    if attempts >= MAX_SPAWN_ATTEMPTS:
        return _Builder(row, now, row.op.kind).to(
            S.MACHINE_STATE_FAILED,
            f"{why}; gave up after {attempts} attempts",
            op=None,
            handle=None,
        )
    state = row.state
    if state == S.MACHINE_STATE_STARTED:  # its process died before it was released
        state = (
            S.MACHINE_STATE_RESTARTING
            if row.op.kind in ("restart", "policy_restart")
            else S.MACHINE_STATE_STARTING
        )
    b = _Builder(row, now, row.op.kind, [Spawn()])
    return b.to(
        state,
        f"{why}; retrying",
        op=replace(row.op, step="spawn", attempts=attempts),
        handle=None,
    )


def _retry_cleanup(row: Row, now: float, policy: Policy, error: str) -> Transition:
    """A cleanup failed: try again after a backoff, or after the last attempt declare the
    machine destroyed, naming what may be left behind (it never stays DESTROYING)."""
    assert row.op is not None
    attempts = row.op.attempts + 1
    if attempts >= MAX_CLEANUP_ATTEMPTS:
        b = _Builder(tombstone(row), now, "destroy")
        return b.to(
            S.MACHINE_STATE_DESTROYED,
            f"destroyed; cleanup failed {attempts} times, its resources may be left behind: "
            f"{error}",
            op=None,
        )
    delay = min(policy.backoff_max, policy.backoff_base * (2 ** (attempts - 1)))
    op = replace(row.op, attempts=attempts, not_before=now + delay)
    b = _Builder(row, now, "destroy", [StartTimer(now + delay)])
    return b.to(row.state, f"cleanup failed: {error}; retrying in {delay:g}s", op=op)


def _with_exit(machine: pb.Machine, ev: Exited, now: float) -> None:
    last = machine.last_exit
    last.Clear()
    if ev.exit_code is not None:
        last.exit_code = ev.exit_code
        last.has_exit_code = True
    if ev.signal is not None:
        last.signal = signal_name(ev.signal)
    last.oom_killed = ev.oom_killed
    last.exited_at.CopyFrom(timestamp(now))


def _exited(row: Row, ev: Exited, now: float, policy: Policy) -> Transition | None:
    if row.handle is None or row.handle != ev.handle:
        return None  # an old process, or one already accounted for
    what = describe_exit(ev)
    op = row.op
    machine = pb.Machine()
    machine.CopyFrom(row.machine)
    _with_exit(machine, ev, now)
    row = replace(row, machine=machine)
    if op is not None and op.step == "kill":
        if op.kind == "stop":
            return _Builder(row, now, "stop").to(
                S.MACHINE_STATE_STOPPED, what, op=None, handle=None
            )
        if op.kind == "restart":
            b = _Builder(row, now, "restart", [Spawn()])
            return b.to(row.state, what, op=replace(op, step="spawn"), handle=None)
        if op.kind == "destroy":
            b = _Builder(row, now, "destroy", [Cleanup()])
            return b.to(row.state, what, op=replace(op, step="cleanup"), handle=None)
        if op.kind == "update":
            if not op.launch:
                b = _Builder(row, now, "update")
                return b.to(S.MACHINE_STATE_STOPPED, f"{what}; updated", op=None, handle=None)
            b = _Builder(row, now, "update", [Spawn()])
            return b.to(
                S.MACHINE_STATE_STARTING,
                f"{what}; starting the new config",
                op=replace(op, step="spawn"),
                handle=None,
            )
    if not ev.released and (op is None or op.step == "release"):
        # It ran nothing (its flyd died before releasing it): spawn it again.
        return _retry_spawn(replace(row, op=op or Op("start", "release")), now, what)
    if op is not None and op.step == "release":
        # Released, and it ran: flyd restarted before it had recorded the release.
        row = replace(row, op=None)
    return _apply_restart_policy(row, ev, now, policy, what)


def _apply_restart_policy(
    row: Row, ev: Exited, now: float, policy: Policy, what: str
) -> Transition:
    restart = row.machine.config.restart
    mode = restart.mode or pb.RESTART_MODE_ON_FAILURE
    failed = ev.exit_code != 0 or ev.oom_killed
    b = _Builder(row, now, "exit")
    if mode == pb.RESTART_MODE_NO or (mode == pb.RESTART_MODE_ON_FAILURE and not failed):
        return b.to(S.MACHINE_STATE_STOPPED, what, op=None, handle=None)
    recent = tuple(t for t in row.restarts if now - t < policy.window)
    limit = restart.max_retries or (
        0 if mode == pb.RESTART_MODE_ALWAYS else policy.default_max_retries
    )
    if limit and len(recent) >= limit:
        machine = pb.Machine()
        machine.CopyFrom(row.machine)
        del machine.log_tail[:]
        machine.log_tail.extend(ev.log_tail)
        b = _Builder(replace(row, machine=machine), now, "exit")
        reason = f"{what}; restart policy gave up after {len(recent)} restarts"
        return b.to(S.MACHINE_STATE_FAILED, reason, op=None, handle=None, restarts=recent)
    delay = min(policy.backoff_max, policy.backoff_base * (2 ** len(recent)))
    machine = pb.Machine()
    machine.CopyFrom(row.machine)
    machine.restart_count = len(recent) + 1
    del machine.log_tail[:]  # what it said before it crashed, for its crash-loop condition
    machine.log_tail.extend(ev.log_tail[-conditions.RESTART_TAIL :])
    b = _Builder(replace(row, machine=machine), now, "exit", [StartTimer(now + delay)])
    return b.to(
        S.MACHINE_STATE_RESTARTING,
        f"{what}; restarting in {delay:g}s (restart {len(recent) + 1})",
        op=Op("policy_restart", "backoff", not_before=now + delay),
        handle=None,
        restarts=(*recent, now),
    )


def _resume(row: Row, now: float, alive: bool) -> Transition | None:
    """Re-derive the effects of the last committed step after a flyd restart."""
    op = row.op
    if op is None:
        return None
    b = _Builder(row, now, op.kind)
    if row.running and not alive:
        return None  # the driver reports the exit; that event moves the row on
    match op.step:
        case "begin":
            b.effects.append(Spawn())
            return b.to(S.MACHINE_STATE_STARTING, "start requested", op=replace(op, step="spawn"))
        case "spawn":
            b.effects.append(Spawn())
        case "release":
            # The held process dies with the flyd that held it, so a live one was released.
            return b.to(S.MACHINE_STATE_STARTED, "running (re-attached)", op=None)
        case "kill":
            b.effects.append(Kill(op.signal, op.timeout))
        case "send":
            b.effects.append(SendSignal(op.signal))
        case "cleanup":
            b.effects.append(Cleanup())
            op = replace(op, not_before=0.0)  # a backoff that was under way ends now
            return b.to(row.state, f"resumed {op.kind} at step {op.step}", op=op)
        case "backoff":
            b.effects.append(StartTimer(op.not_before))
        case _:
            raise CorruptLog(f"machine {row.machine.id}: unknown step {op.step!r} of {op.kind}")
    return b.to(row.state, f"resumed {op.kind} at step {op.step}")


# --- row encoding -----------------------------------------------------------

ROW_VERSION = 1
_ROW_HEADER = struct.Struct(">HI")


def encode_row(row: Row) -> bytes:
    """A versioned row: the Machine protobuf followed by flyd's internals as JSON."""
    machine = row.machine.SerializeToString()
    internals = {
        "image_digest": row.image_digest,
        "op": None if row.op is None else row.op.__dict__,
        "handle": row.handle,
        "restarts": list(row.restarts),
        "lease": row.lease,
        "secrets": row.secrets,
    }
    if row.placement:
        internals["placement"] = base64.b64encode(row.placement).decode()
    return _ROW_HEADER.pack(ROW_VERSION, len(machine)) + machine + json.dumps(internals).encode()


def decode_row(raw: bytes) -> Row:
    version, size = _ROW_HEADER.unpack_from(raw)
    if version != ROW_VERSION:
        raise CorruptLog(f"machine row version {version}; this flyd reads {ROW_VERSION}")
    start = _ROW_HEADER.size
    machine = pb.Machine.FromString(raw[start : start + size])
    internals = json.loads(raw[start + size :])
    op = internals["op"]
    return Row(
        machine=machine,
        image_digest=internals["image_digest"],
        op=None if op is None else Op(**op),
        handle=internals["handle"],
        restarts=tuple(internals["restarts"]),
        lease=internals.get("lease"),
        secrets=internals.get("secrets") or {},
        placement=base64.b64decode(internals.get("placement") or ""),
    )


def create(
    machine: pb.Machine,
    *,
    image_digest: str,
    skip_launch: bool,
    now: float,
    secrets: dict[str, str] | None = None,
    placement: bytes = b"",
) -> Transition:
    """The first step of a machine: CREATED, with its start pending unless skip_launch (a
    standby is always created stopped: only a promotion starts it); `secrets` sealed
    (flyd.secrets); `placement`: flaps' decision, serialized (Row.placement)."""
    m = pb.Machine()
    m.CopyFrom(machine)
    m.state = S.MACHINE_STATE_CREATED
    m.created_at.CopyFrom(timestamp(now))
    m.updated_at.CopyFrom(timestamp(now))
    m.slot.CopyFrom(slots.new_slot(m.id, m.config))
    op = None if skip_launch or not slots.is_primary(m) else Op("start", "begin")
    row = Row(m, image_digest, op=op, secrets=dict(secrets or {}), placement=placement)
    return Transition(row, "create", "created", S.MACHINE_STATE_UNSPECIFIED)
