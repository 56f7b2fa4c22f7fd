"""The machine state machine as tables: (row, event) -> new state, effects, operation in progress.

No runner and no I/O: every row here is built by hand, every event applied with `fsm.step`.
"""

from __future__ import annotations

import dataclasses
import signal
from typing import Any

import pytest

from flyd import fsm
from flyd.fsm import (
    CleanedUp,
    Cleanup,
    DestroyRequested,
    Exited,
    Kill,
    Op,
    Release,
    Released,
    RestartRequested,
    Resume,
    SendSignal,
    Signalled,
    SignalRequested,
    Spawn,
    Spawned,
    SpawnFailed,
    StartRequested,
    StartTimer,
    StopRequested,
    TimerFired,
    UpdateRequested,
)
from flyd.v1 import machine_pb2 as pb
from model.errors import BUSY, WRONG_STATE, CorruptLog, FailedPrecondition
from model.errors import DESTROYED as GONE

S = pb.MachineState
CREATED = S.MACHINE_STATE_CREATED
STARTING = S.MACHINE_STATE_STARTING
STARTED = S.MACHINE_STATE_STARTED
STOPPING = S.MACHINE_STATE_STOPPING
STOPPED = S.MACHINE_STATE_STOPPED
RESTARTING = S.MACHINE_STATE_RESTARTING
DESTROYING = S.MACHINE_STATE_DESTROYING
DESTROYED = S.MACHINE_STATE_DESTROYED
FAILED = S.MACHINE_STATE_FAILED
NO, ALWAYS = pb.RESTART_MODE_NO, pb.RESTART_MODE_ALWAYS
ON_FAILURE, DEFAULT = pb.RESTART_MODE_ON_FAILURE, pb.RESTART_MODE_UNSPECIFIED

TERM, KILL, USR1 = int(signal.SIGTERM), int(signal.SIGKILL), int(signal.SIGUSR1)
INT = int(signal.SIGINT)
NOW = 1_000.0
POLICY = fsm.Policy(window=300.0, default_max_retries=10, backoff_base=0.5, backoff_max=30.0)
H = {"pid": 7, "start_time": 1, "boot_id": "b"}
H2 = {"pid": 8, "start_time": 2, "boot_id": "b"}

START_SPAWN = Op("start", "spawn")
START_RELEASE = Op("start", "release")
STOP_KILL = Op("stop", "kill", signal=TERM, timeout=10.0)
RESTART_KILL = Op("restart", "kill", signal=TERM, timeout=10.0)
SIGNAL_SEND = Op("signal", "send", signal=USR1)
DESTROY_KILL = Op("destroy", "kill", signal=KILL, timeout=0.0)
DESTROY_CLEANUP = Op("destroy", "cleanup")
BACKOFF = Op("policy_restart", "backoff", not_before=NOW + 1)


def row(
    state: int,
    op: Op | None = None,
    handle: dict[str, Any] | None = None,
    *,
    mode: int = NO,
    max_retries: int = 0,
    restarts: tuple[float, ...] = (),
) -> fsm.Row:
    machine = pb.Machine(
        id="m1",
        app="app",
        state=state,  # type: ignore[arg-type]
        config=pb.MachineConfig(
            image="app:v1",
            restart=pb.RestartPolicy(mode=mode, max_retries=max_retries),  # type: ignore[arg-type]
        ),
    )
    return fsm.Row(machine, "sha256:ab", op=op, handle=handle, restarts=restarts)


def exited(
    handle: dict[str, Any] = H,
    code: int | None = None,
    sig: int | None = None,
    *,
    oom: bool = False,
    tail: tuple[str, ...] = (),
) -> Exited:
    return Exited(handle, code, sig, oom, tail)


# A held process whose flyd let go of it unreleased: it ran nothing.
HELD_EXIT = Exited(H, 125, None, False, released=False)


def step(r: fsm.Row, event: fsm.Event, now: float = NOW, policy: fsm.Policy = POLICY) -> Any:
    return fsm.step(r, event, now=now, policy=policy)


def apply(r: fsm.Row, event: fsm.Event, now: float = NOW) -> fsm.Transition:
    t = step(r, event, now)
    assert t is not None, f"{event} changed nothing"
    assert isinstance(t, fsm.Transition)
    return t


# --- allowed transitions -----------------------------------------------------------------


START, SIGNAL = StartRequested(), SignalRequested(USR1)
STOP, RESTART = StopRequested(TERM, 10.0), RestartRequested(TERM, 10.0)
DESTROY, FORCE = DestroyRequested(False), DestroyRequested(True)
KILL_TERM, KILL_NOW = Kill(TERM, 10.0), Kill(KILL, 0.0)
RESTART_SPAWN = dataclasses.replace(RESTART_KILL, step="spawn")
BACKOFF_SPAWN = dataclasses.replace(BACKOFF, step="spawn")
DESTROY_KILLED = dataclasses.replace(DESTROY_KILL, step="cleanup")
RETRY = Op("start", "spawn", attempts=1)

# Rows in the middle of something.
RUNNING = row(STARTED, None, H)
SPAWNING = row(STARTING, START_SPAWN)
HELD = row(STARTED, START_RELEASE, H)  # declared started, its release pending
IN_STOP = row(STOPPING, STOP_KILL, H)
IN_RESTART = row(RESTARTING, RESTART_KILL, H)
IN_SIGNAL = row(STARTED, SIGNAL_SEND, H)
IN_DESTROY = row(DESTROYING, DESTROY_KILL, H)
IN_CLEANUP = row(DESTROYING, DESTROY_CLEANUP)
IN_BACKOFF = row(RESTARTING, BACKOFF)
RESPAWNING = row(RESTARTING, RESTART_SPAWN)

# An update: the worker has pulled the new image and mapped its ports; the old process is
# stopped with the old config's stop signal and timeout (here SIGINT and 3s).
NEW_CONFIG = pb.MachineConfig(image="app:v2", env={"GREETING": "hi"}, cmd=["serve"])
NEW_PORTS = (pb.PortMapping(internal_port=9090, host="127.0.0.1", host_port=20005),)


def update(*, launch: bool = True) -> UpdateRequested:
    return UpdateRequested(
        config=NEW_CONFIG,
        instance_id="i2",
        image_digest="sha256:cd",
        ports=NEW_PORTS,
        launch=launch,
        stop_signal=INT,
        stop_timeout=3.0,
    )


UPDATE, UPDATE_STOPPED = update(), update(launch=False)
UPDATE_KILL = Op("update", "kill", signal=INT, timeout=3.0)
UPDATE_KILL_STOPPED = dataclasses.replace(UPDATE_KILL, launch=False)
UPDATE_KILLED = dataclasses.replace(UPDATE_KILL, step="spawn")  # the old process is gone
UPDATE_SPAWN = Op("update", "spawn")
UPDATE_RELEASE = Op("update", "release")
IN_UPDATE = row(STOPPING, UPDATE_KILL, H)
IN_UPDATE_STOPPED = row(STOPPING, UPDATE_KILL_STOPPED, H)
UPDATE_SPAWNING = row(STARTING, UPDATE_SPAWN)
UPDATE_HELD = row(STARTED, UPDATE_RELEASE, H2)

ALLOWED = [
    # (id, before, event, new state, effects, op after, handle after)
    ("start created", row(CREATED), START, STARTING, [Spawn()], START_SPAWN, None),
    ("start stopped", row(STOPPED), START, STARTING, [Spawn()], START_SPAWN, None),
    ("start failed", row(FAILED), START, STARTING, [Spawn()], START_SPAWN, None),
    ("spawned: started, release", SPAWNING, Spawned(H), STARTED, [Release()], START_RELEASE, H),
    ("stop started", RUNNING, STOP, STOPPING, [KILL_TERM], STOP_KILL, H),
    ("stopping: exited", IN_STOP, exited(sig=TERM), STOPPED, [], None, None),
    ("stop a pending start", SPAWNING, STOP, STOPPED, [], None, None),
    ("stop in a backoff", IN_BACKOFF, STOP, STOPPED, [], None, None),
    ("restart", RUNNING, RESTART, RESTARTING, [KILL_TERM], RESTART_KILL, H),
    ("restart: exited", IN_RESTART, exited(sig=TERM), RESTARTING, [Spawn()], RESTART_SPAWN, None),
    ("signal", RUNNING, SIGNAL, STARTED, [SendSignal(USR1)], SIGNAL_SEND, H),
    ("signal: delivered", IN_SIGNAL, Signalled(), STARTED, [], None, H),
    ("destroy created", row(CREATED), DESTROY, DESTROYING, [Cleanup()], DESTROY_CLEANUP, None),
    ("destroy stopped", row(STOPPED), DESTROY, DESTROYING, [Cleanup()], DESTROY_CLEANUP, None),
    ("destroy failed", row(FAILED), DESTROY, DESTROYING, [Cleanup()], DESTROY_CLEANUP, None),
    ("destroy in a backoff", IN_BACKOFF, DESTROY, DESTROYING, [Cleanup()], DESTROY_CLEANUP, None),
    ("destroy started, force", RUNNING, FORCE, DESTROYING, [KILL_NOW], DESTROY_KILL, H),
    ("destroy stopping", IN_STOP, DESTROY, DESTROYING, [KILL_NOW], DESTROY_KILL, H),
    (
        "destroy: exited",
        IN_DESTROY,
        exited(sig=KILL),
        DESTROYING,
        [Cleanup()],
        DESTROY_KILLED,
        None,
    ),
    ("destroy: cleaned up", IN_CLEANUP, CleanedUp(), DESTROYED, [], None, None),
    ("backoff elapsed", IN_BACKOFF, TimerFired(), RESTARTING, [Spawn()], BACKOFF_SPAWN, None),
    ("start in a backoff", IN_BACKOFF, START, RESTARTING, [Spawn()], BACKOFF_SPAWN, None),
    ("spawn failed: retry", SPAWNING, SpawnFailed("boom"), STARTING, [Spawn()], RETRY, None),
    ("died held: retry", HELD, HELD_EXIT, STARTING, [Spawn()], RETRY, None),
    ("re-attached, but it was held: retry", RUNNING, HELD_EXIT, STARTING, [Spawn()], RETRY, None),
    # Released and ran, but flyd restarted before it recorded the release: its policy (no).
    ("released, exited: restart policy", HELD, exited(code=1), STOPPED, [], None, None),
    # update: stop the old process (with the given signal and timeout), then start the new one
    ("update started", RUNNING, UPDATE, STOPPING, [Kill(INT, 3.0)], UPDATE_KILL, H),
    (
        "update started, skip launch",
        RUNNING,
        UPDATE_STOPPED,
        STOPPING,
        [Kill(INT, 3.0)],
        UPDATE_KILL_STOPPED,
        H,
    ),
    ("update: exited", IN_UPDATE, exited(sig=INT), STARTING, [Spawn()], UPDATE_KILLED, None),
    ("update skip launch: exited", IN_UPDATE_STOPPED, exited(sig=INT), STOPPED, [], None, None),
    ("update: spawned", UPDATE_SPAWNING, Spawned(H2), STARTED, [Release()], UPDATE_RELEASE, H2),
    (
        "update spawn failed: retry",
        UPDATE_SPAWNING,
        SpawnFailed("x"),
        STARTING,
        [Spawn()],
        dataclasses.replace(UPDATE_SPAWN, attempts=1),
        None,
    ),
    ("update stopped", row(STOPPED), UPDATE, STARTING, [Spawn()], UPDATE_SPAWN, None),
    ("update stopped, skip launch", row(STOPPED), UPDATE_STOPPED, STOPPED, [], None, None),
    ("update created", row(CREATED), UPDATE, STARTING, [Spawn()], UPDATE_SPAWN, None),
    ("update created, skip launch", row(CREATED), UPDATE_STOPPED, CREATED, [], None, None),
    ("update failed", row(FAILED), UPDATE, STARTING, [Spawn()], UPDATE_SPAWN, None),
    ("update failed, skip launch", row(FAILED), UPDATE_STOPPED, FAILED, [], None, None),
    # during a restart backoff nothing runs: the update cancels the backoff
    ("update in a backoff", IN_BACKOFF, UPDATE, STARTING, [Spawn()], UPDATE_SPAWN, None),
    ("update in a backoff, skip launch", IN_BACKOFF, UPDATE_STOPPED, STOPPED, [], None, None),
]


@pytest.mark.parametrize(
    ("before", "event", "state", "effects", "op", "handle"),
    [c[1:] for c in ALLOWED],
    ids=[c[0] for c in ALLOWED],
)
def test_allowed_transition(
    before: fsm.Row,
    event: fsm.Event,
    state: int,
    effects: list[fsm.Effect],
    op: Op | None,
    handle: dict[str, Any] | None,
) -> None:
    t = apply(before, event, now=NOW + 1)
    assert (fsm.state_name(t.to_state), list(t.effects)) == (fsm.state_name(state), effects)
    assert (t.row.op, t.row.handle) == (op, handle)
    assert t.from_state == before.state
    assert t.row.machine.updated_at.ToNanoseconds() == int((NOW + 1) * 1e9)
    assert before.machine.state == before.state  # the old row is never changed in place


TYPES = [
    # (before, event, the type its log record gets)
    (row(STOPPED), START, "start"),
    (row(STARTING, START_SPAWN), Spawned(H), "start"),
    (row(STARTED, None, H), STOP, "stop"),
    (row(RESTARTING, RESTART_KILL, H), exited(sig=TERM), "restart"),
    (row(STARTED, None, H, mode=ALWAYS), exited(code=0), "exit"),
    (row(RESTARTING, BACKOFF), TimerFired(), "policy_restart"),
    (row(RESTARTING, BACKOFF), START, "start"),
    (row(STARTED, None, H), FORCE, "destroy"),
    (row(STARTED, None, H), SIGNAL, "signal"),
    (row(STARTED, None, H), UPDATE, "update"),
    (row(STOPPED), UPDATE_STOPPED, "update"),
    (IN_UPDATE, exited(sig=INT), "update"),
    (UPDATE_HELD, Released(), "update"),
]


@pytest.mark.parametrize(("before", "event", "type_"), TYPES)
def test_transition_type(before: fsm.Row, event: fsm.Event, type_: str) -> None:
    assert apply(before, event, now=NOW + 1).type == type_


# --- nothing to do: idempotent repeats and stale events -------------------------------------

UNCHANGED = [
    ("start a started machine", RUNNING, START),
    ("start a starting machine", SPAWNING, START),
    ("start a restarting machine", IN_RESTART, START),
    ("stop a stopped machine", row(STOPPED), STOP),
    ("stop a created machine", row(CREATED), STOP),
    ("stop a failed machine", row(FAILED), STOP),
    ("stop a stopping machine", IN_STOP, StopRequested(KILL, 0.0)),
    ("destroy a destroying machine", IN_CLEANUP, FORCE),
    ("destroy a destroyed machine", row(DESTROYED), DESTROY),
    ("spawned with no start in progress", RUNNING, Spawned(H2)),
    ("spawned twice", HELD, Spawned(H2)),
    ("spawn failed with no start in progress", row(STOPPED), SpawnFailed("late")),
    ("released when not holding", RUNNING, Released()),
    ("signalled with no signal in progress", RUNNING, Signalled()),
    ("cleaned up when not cleaning", row(STOPPED), CleanedUp()),
    ("timer before not_before", IN_BACKOFF, TimerFired()),
    ("timer after the backoff was cancelled", row(STOPPED), TimerFired()),
    ("exited: another handle", RUNNING, exited(H2, code=1)),
    ("exited: no process", row(STOPPED), exited(code=1)),
    ("exited: restart already spawning", RESPAWNING, exited(sig=TERM)),
    ("resume with nothing in progress", RUNNING, Resume(alive=True)),
    ("resume a dead process: its exit moves on", IN_STOP, Resume(alive=False)),
    ("resume a dead update's kill: its exit moves on", IN_UPDATE, Resume(alive=False)),
    ("exited: update already spawning", row(STARTING, UPDATE_KILLED), exited(sig=INT)),
    ("timer after an update cancelled the backoff", UPDATE_SPAWNING, TimerFired()),
]


@pytest.mark.parametrize(
    ("before", "event"), [c[1:] for c in UNCHANGED], ids=[c[0] for c in UNCHANGED]
)
def test_nothing_changes(before: fsm.Row, event: fsm.Event) -> None:
    assert step(before, event) is None


# --- refused ---------------------------------------------------------------------------------

REFUSED = [
    ("start a destroyed machine", row(DESTROYED), START, "destroyed", GONE),
    ("start a destroying machine", IN_CLEANUP, START, "destroying", GONE),
    ("start a stopping machine", IN_STOP, START, "stopping", BUSY),
    (
        "stop a destroyed machine",
        row(DESTROYED),
        StopRequested(TERM, 1.0),
        "destroyed",
        GONE,
    ),
    ("stop a destroying machine", IN_DESTROY, StopRequested(TERM, 1.0), "destroying", GONE),
    ("destroy started without force", RUNNING, DESTROY, "force", WRONG_STATE),
    ("destroy starting without force", HELD, DESTROY, "force", WRONG_STATE),
    ("destroy restarting without force", IN_RESTART, DESTROY, "force", WRONG_STATE),
    (
        "restart a stopped machine",
        row(STOPPED),
        RestartRequested(TERM, 1.0),
        "stopped",
        WRONG_STATE,
    ),
    (
        "restart a created machine",
        row(CREATED),
        RestartRequested(TERM, 1.0),
        "created",
        WRONG_STATE,
    ),
    ("restart during a signal", IN_SIGNAL, RestartRequested(TERM, 1.0), "started", BUSY),
    ("signal a stopped machine", row(STOPPED), SIGNAL, "stopped", WRONG_STATE),
    ("signal a starting machine", SPAWNING, SIGNAL, "starting", BUSY),
    ("update a destroyed machine", row(DESTROYED), UPDATE, "destroyed", GONE),
    ("update a destroying machine", IN_CLEANUP, UPDATE, "destroying", GONE),
    ("update a machine being destroyed", IN_DESTROY, UPDATE_STOPPED, "destroying", GONE),
    ("update during a stop", IN_STOP, UPDATE, r"busy \(stop\)", BUSY),
    ("update during a start", SPAWNING, UPDATE, r"busy \(start\)", BUSY),
    ("update during a restart", IN_RESTART, UPDATE, r"busy \(restart\)", BUSY),
    ("update during a signal", IN_SIGNAL, UPDATE, r"busy \(signal\)", BUSY),
    ("update during an update", IN_UPDATE, UPDATE, r"busy \(update\)", BUSY),
    ("start during an update's stop", IN_UPDATE, START, "stopping", BUSY),
    ("restart during an update", IN_UPDATE, RESTART, "stopping", BUSY),
]


@pytest.mark.parametrize(
    ("before", "event", "says", "reason"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED]
)
def test_refused(before: fsm.Row, event: fsm.Event, says: str, reason: str) -> None:
    with pytest.raises(FailedPrecondition, match=says) as refused:
        step(before, event)
    assert refused.value.reason == reason


# --- the restart policy -------------------------------------------------------------------


def ago(*seconds: float) -> tuple[float, ...]:
    return tuple(NOW - s for s in seconds)


POLICY_CASES = [
    # (id, mode, max_retries, exit, earlier restarts, new state, backoff delay)
    ("no: failure stops", NO, 0, exited(code=1), (), STOPPED, None),
    ("on-failure: exit 0 stops", ON_FAILURE, 0, exited(code=0), (), STOPPED, None),
    ("default is on-failure: exit 0", DEFAULT, 0, exited(code=0), (), STOPPED, None),
    ("default is on-failure: exit 1", DEFAULT, 0, exited(code=1), (), RESTARTING, 0.5),
    ("on-failure: exit 3", ON_FAILURE, 0, exited(code=3), (), RESTARTING, 0.5),
    ("on-failure: killed", ON_FAILURE, 0, exited(sig=KILL), (), RESTARTING, 0.5),
    ("on-failure: out of memory", ON_FAILURE, 0, exited(sig=KILL, oom=True), (), RESTARTING, 0.5),
    ("always: exit 0", ALWAYS, 0, exited(code=0), (), RESTARTING, 0.5),
    ("backoff doubles: 2nd", ON_FAILURE, 5, exited(code=1), ago(9), RESTARTING, 1.0),
    ("backoff doubles: 3rd", ON_FAILURE, 5, exited(code=1), ago(9, 5), RESTARTING, 2.0),
    ("backoff doubles: 4th", ON_FAILURE, 5, exited(code=1), ago(9, 5, 2), RESTARTING, 4.0),
    ("backoff is capped", ALWAYS, 0, exited(code=0), ago(9, 8, 7, 6, 5, 4), RESTARTING, 30.0),
    ("always without a limit", ALWAYS, 0, exited(code=1), ago(*range(1, 20)), RESTARTING, 30.0),
    ("restarts outside the window", ON_FAILURE, 2, exited(code=1), ago(400, 301), RESTARTING, 0.5),
    ("restarts inside the window", ON_FAILURE, 3, exited(code=1), ago(400, 299), RESTARTING, 1.0),
    ("retries exhausted", ON_FAILURE, 2, exited(code=1), ago(5, 2), FAILED, None),
    ("always: retries exhausted", ALWAYS, 1, exited(code=0), ago(5), FAILED, None),
    ("default retries exhausted", ON_FAILURE, 0, exited(code=1), ago(*range(1, 11)), FAILED, None),
]


@pytest.mark.parametrize(
    ("mode", "max_retries", "event", "restarts", "state", "delay"),
    [c[1:] for c in POLICY_CASES],
    ids=[c[0] for c in POLICY_CASES],
)
def test_restart_policy(
    mode: int,
    max_retries: int,
    event: Exited,
    restarts: tuple[float, ...],
    state: int,
    delay: float | None,
) -> None:
    before = row(STARTED, None, H, mode=mode, max_retries=max_retries, restarts=restarts)
    t = apply(before, event)
    assert fsm.state_name(t.to_state) == fsm.state_name(state)
    assert t.row.handle is None
    assert t.row.machine.last_exit.exited_at.ToNanoseconds() == int(NOW * 1e9)
    recent = tuple(r for r in restarts if NOW - r < POLICY.window)
    if delay is None:
        assert (t.row.op, t.effects) == (None, ())
    else:
        assert t.effects == (StartTimer(NOW + delay),)
        assert t.row.op == Op("policy_restart", "backoff", not_before=NOW + delay)
        assert t.row.restarts == (*recent, NOW)
        assert t.row.machine.restart_count == len(recent) + 1


def test_exhausted_retries_fail_with_exit_and_log_tail() -> None:
    before = row(STARTED, None, H, mode=ON_FAILURE, max_retries=2, restarts=ago(5, 2))
    t = apply(before, exited(code=3, tail=("starting", "panic: no config")))
    machine = t.row.machine
    assert fsm.state_name(t.to_state) == "failed"
    assert (machine.last_exit.exit_code, machine.last_exit.has_exit_code) == (3, True)
    assert list(machine.log_tail) == ["starting", "panic: no config"]
    assert t.reason == "exited with code 3; restart policy gave up after 2 restarts"


def test_a_killed_exit_records_the_signal() -> None:
    t = apply(row(STARTED, None, H, mode=NO), exited(sig=KILL, oom=True))
    last = t.row.machine.last_exit
    assert (last.has_exit_code, last.signal, last.oom_killed) == (False, "SIGKILL", True)
    assert t.reason == "killed by SIGKILL (out of memory)"


def test_crash_loop_story() -> None:
    """An on-failure machine with 3 retries crashes 4 times: backoff 0.5, 1, 2, then FAILED."""
    r = row(STARTED, None, H, mode=ON_FAILURE, max_retries=3)
    now = NOW
    delays = []
    for pid in range(100, 103):
        t = apply(r, exited(r.handle or {}, code=1), now)
        assert t.row.op is not None
        delays.append(t.row.op.not_before - now)
        assert step(t.row, TimerFired(), t.row.op.not_before - 0.01) is None  # too early
        now = t.row.op.not_before
        r = apply(t.row, TimerFired(), now).row
        handle = {"pid": pid, "start_time": int(now), "boot_id": "b"}
        r = apply(apply(r, Spawned(handle), now).row, Released(), now).row
        assert (fsm.state_name(r.state), r.op) == ("started", None)
        now += 1
    failed = apply(r, exited(r.handle or {}, code=1, tail=("bye",)), now)
    assert delays == [0.5, 1.0, 2.0]
    assert fsm.state_name(failed.to_state) == "failed"
    assert list(failed.row.machine.log_tail) == ["bye"]
    # A user start after FAILED gets a fresh retry budget.
    started = apply(failed.row, START, now)
    assert started.row.restarts == ()


def test_stop_keeps_the_restart_history() -> None:
    before = row(STARTED, None, H, mode=ON_FAILURE, restarts=ago(5))
    stopped = apply(apply(before, StopRequested(TERM, 1.0)).row, exited(sig=TERM)).row
    assert apply(stopped, START).row.restarts == ago(5)


def test_spawn_failing_max_attempts_fails_the_start() -> None:
    r = apply(row(CREATED), START).row
    for attempt in range(1, fsm.MAX_SPAWN_ATTEMPTS):
        t = apply(r, SpawnFailed("no room"))
        assert (t.effects, t.row.op) == ((Spawn(),), Op("start", "spawn", attempts=attempt))
        r = t.row
    t = apply(r, SpawnFailed("no room"))
    assert (fsm.state_name(t.to_state), t.effects, t.row.op) == ("failed", (), None)
    assert t.reason == f"could not spawn: no room; gave up after {fsm.MAX_SPAWN_ATTEMPTS} attempts"


# --- resuming after a flyd restart ----------------------------------------------------------

RESUME = [
    # (id, before, alive, new state, effects, op after)
    ("begin", row(CREATED, Op("start", "begin")), False, STARTING, [Spawn()], START_SPAWN),
    ("spawn", SPAWNING, False, STARTING, [Spawn()], START_SPAWN),
    ("release, still alive", HELD, True, STARTED, [], None),
    ("stop's kill", IN_STOP, True, STOPPING, [Kill(TERM, 10.0)], STOP_KILL),
    ("restart's kill", IN_RESTART, True, RESTARTING, [Kill(TERM, 10.0)], RESTART_KILL),
    ("restart's spawn", RESPAWNING, False, RESTARTING, [Spawn()], RESTART_SPAWN),
    ("destroy's kill", IN_DESTROY, True, DESTROYING, [Kill(KILL, 0.0)], DESTROY_KILL),
    ("send", IN_SIGNAL, True, STARTED, [SendSignal(USR1)], SIGNAL_SEND),
    ("cleanup", IN_CLEANUP, False, DESTROYING, [Cleanup()], DESTROY_CLEANUP),
    ("backoff", IN_BACKOFF, False, RESTARTING, [StartTimer(NOW + 1)], BACKOFF),
    ("update's kill", IN_UPDATE, True, STOPPING, [Kill(INT, 3.0)], UPDATE_KILL),
    (
        "update's kill, skip launch",
        IN_UPDATE_STOPPED,
        True,
        STOPPING,
        [Kill(INT, 3.0)],
        UPDATE_KILL_STOPPED,
    ),
    (
        "update's spawn after the kill",
        row(STARTING, UPDATE_KILLED),
        False,
        STARTING,
        [Spawn()],
        UPDATE_KILLED,
    ),
    ("update's spawn", UPDATE_SPAWNING, False, STARTING, [Spawn()], UPDATE_SPAWN),
    ("update's release, still alive", UPDATE_HELD, True, STARTED, [], None),
]


@pytest.mark.parametrize(
    ("before", "alive", "state", "effects", "op"),
    [c[1:] for c in RESUME],
    ids=[c[0] for c in RESUME],
)
def test_resume_re_emits_the_step_effect(
    before: fsm.Row, alive: bool, state: int, effects: list[fsm.Effect], op: Op | None
) -> None:
    t = apply(before, Resume(alive=alive))
    assert fsm.state_name(t.to_state) == fsm.state_name(state)
    assert (list(t.effects), t.row.op, t.row.handle) == (effects, op, before.handle)


def test_resume_of_an_unknown_step_is_corrupt() -> None:
    with pytest.raises(CorruptLog, match="unknown step 'teleport'"):
        step(row(STARTED, Op("start", "teleport"), H), Resume(alive=True))


# --- creating and encoding ------------------------------------------------------------------


@pytest.mark.parametrize(("skip_launch", "op"), [(True, None), (False, Op("start", "begin"))])
def test_create(skip_launch: bool, op: Op | None) -> None:
    t = fsm.create(pb.Machine(id="m1"), image_digest="sha256:ab", skip_launch=skip_launch, now=NOW)
    assert (t.from_state, t.to_state, t.row.op, t.effects) == (0, CREATED, op, ())
    assert t.row.machine.created_at == t.row.machine.updated_at


def test_row_round_trip() -> None:
    r = row(RESTARTING, BACKOFF, None, mode=ON_FAILURE, max_retries=4, restarts=ago(3, 1))
    r.machine.ports.add(internal_port=8080, host="127.0.0.1", host_port=20001)
    r.machine.log_tail.append("last words")
    for each in (r, IN_SIGNAL, row(STOPPED)):
        assert fsm.decode_row(fsm.encode_row(each)) == each


def test_the_placement_decision_is_kept_until_the_machine_is_destroyed() -> None:
    why = pb.PlacementDecision(worker_id="w1", regions=[pb.RegionPlacement(region="ams")])
    t = fsm.create(
        pb.Machine(id="m1"),
        image_digest="sha256:ab",
        skip_launch=True,
        now=NOW,
        placement=why.SerializeToString(),
    )
    kept = fsm.decode_row(fsm.encode_row(t.row))
    assert pb.PlacementDecision.FromString(kept.placement) == why
    stopped = dataclasses.replace(row(STOPPED), placement=kept.placement)
    destroyed = step(stopped, FORCE)
    assert destroyed.to_state == fsm.S.MACHINE_STATE_DESTROYING
    gone = step(destroyed.row, fsm.CleanedUp())
    assert (gone.to_state, gone.row.placement) == (fsm.S.MACHINE_STATE_DESTROYED, b"")


def test_row_of_an_unknown_version_is_corrupt() -> None:
    raw = fsm.encode_row(row(STOPPED))
    newer = (fsm.ROW_VERSION + 1).to_bytes(2, "big") + raw[2:]
    with pytest.raises(CorruptLog, match=f"version {fsm.ROW_VERSION + 1}"):
        fsm.decode_row(newer)


def test_unknown_event_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        step(row(STARTED), object())  # type: ignore[arg-type]


# --- update in place ---------------------------------------------------------------------------

UPDATE_FROM = [
    # (id, before, event): every update that is accepted
    ("started", RUNNING, UPDATE),
    ("started, skip launch", RUNNING, UPDATE_STOPPED),
    ("stopped", row(STOPPED), UPDATE),
    ("stopped, skip launch", row(STOPPED), UPDATE_STOPPED),
    ("failed", row(FAILED, mode=ON_FAILURE, restarts=ago(5, 2)), UPDATE),
    ("in a backoff", IN_BACKOFF, UPDATE),
]


@pytest.mark.parametrize(
    ("before", "event"), [c[1:] for c in UPDATE_FROM], ids=[c[0] for c in UPDATE_FROM]
)
def test_update_puts_the_new_config_in_the_row_at_once(
    before: fsm.Row, event: UpdateRequested
) -> None:
    """The first committed step already carries everything new: a crash then resumes it."""
    machine = pb.Machine()
    machine.CopyFrom(before.machine)
    machine.restart_count = 2
    machine.log_tail.append("old words")
    machine.ports.add(internal_port=8080, host="127.0.0.1", host_port=20001)
    before = dataclasses.replace(before, machine=machine)
    kept = fsm.encode_row(before)
    t = apply(before, event)
    m = t.row.machine
    assert (m.config, m.instance_id, t.row.image_digest) == (NEW_CONFIG, "i2", "sha256:cd")
    assert tuple(m.ports) == NEW_PORTS
    assert (m.id, m.app) == ("m1", "app")  # same machine
    assert (m.restart_count, list(m.log_tail), t.row.restarts) == (0, [], ())
    assert t.reason.startswith("update to instance i2")
    assert t.type == "update"
    assert fsm.encode_row(before) == kept  # the row given in is not touched


@pytest.mark.parametrize("held", [HELD, UPDATE_HELD], ids=["start", "update"])
def test_released_is_lazy_and_changes_only_the_pending_step(held: fsm.Row) -> None:
    t = apply(held, Released(), now=NOW + 1)
    assert (t.lazy, t.effects, t.reason) == (True, (), "released")
    assert (t.to_state, t.from_state, t.row.op, t.row.handle) == (
        STARTED,
        STARTED,
        None,
        held.handle,
    )
    assert t.row.machine is held.machine  # the public machine is untouched: nothing to log


def test_update_story_from_started_to_started() -> None:
    """Kill the old process, spawn and release the new one: four steps, the last one lazy."""
    r = RUNNING
    states = []
    events: list[fsm.Event] = [UPDATE, exited(sig=INT), Spawned(H2), Released()]
    for event in events:
        t = apply(r, event)
        states.append((fsm.state_name(t.to_state), t.row.op and t.row.op.step))
        r = t.row
    assert states == [
        ("stopping", "kill"),
        ("starting", "spawn"),
        ("started", "release"),
        ("started", None),
    ]
    assert (r.handle, r.machine.config, r.machine.instance_id) == (H2, NEW_CONFIG, "i2")
    assert r.machine.last_exit.signal == "SIGINT"  # the old process' exit is recorded


def test_update_in_a_backoff_then_the_old_timer_fires() -> None:
    t = apply(IN_BACKOFF, UPDATE, now=NOW)
    assert step(t.row, TimerFired(), now=NOW + 10) is None  # the backoff is gone
    assert t.row.restarts == ()


def test_stop_during_an_updates_kill_wins() -> None:
    """A user stop while the update stops the old process leaves it stopped (with new config)."""
    t = apply(IN_UPDATE, StopRequested(TERM, 1.0))
    assert (fsm.state_name(t.to_state), t.row.op) == ("stopping", Op("stop", "kill", TERM, 1.0))
    assert fsm.state_name(apply(t.row, exited(sig=TERM)).to_state) == "stopped"


# --- leases ------------------------------------------------------------------------------------

NONCE, OTHER = "n" * 32, "o" * 32


def acquire(
    r: fsm.Row,
    *,
    nonce: str = "",
    ttl: float = 60.0,
    now: float = NOW,
    owner: str = "deployer",
    new_nonce: str = NONCE,
) -> fsm.Transition:
    """Acquire as the worker does: `new_nonce` is the random nonce a new lease would get."""
    return fsm.acquire_lease(
        r,
        new_nonce=new_nonce,
        nonce=nonce,
        ttl=ttl,
        owner=owner,
        description="rolling out v2",
        now=now,
    )


LEASED = acquire(RUNNING).row  # held by "deployer" until NOW + 60


def test_acquire_a_lease() -> None:
    t = acquire(RUNNING)
    assert t.row.lease == {
        "nonce": NONCE,
        "expires_at": NOW + 60,
        "owner": "deployer",
        "description": "rolling out v2",
    }
    assert (t.type, t.from_state, t.to_state, t.effects) == ("lease", STARTED, STARTED, ())
    assert (t.row.op, t.row.handle) == (None, H)
    assert fsm.lease_held(t.row, NOW + 59.9)
    assert not fsm.lease_held(t.row, NOW + 60)


def test_the_machine_shows_the_lease_but_never_its_nonce() -> None:
    m = LEASED.machine
    assert (m.lease.owner, m.lease.description) == ("deployer", "rolling out v2")
    assert m.lease.expires_at.ToNanoseconds() == int((NOW + 60) * 1e9)
    assert m.lease.nonce == ""
    assert NONCE.encode() not in m.SerializeToString()


def test_refresh_keeps_the_nonce_and_moves_the_expiry() -> None:
    t = acquire(LEASED, nonce=NONCE, ttl=600, now=NOW + 30, new_nonce=OTHER)
    assert t.row.lease is not None
    assert (t.row.lease["nonce"], t.row.lease["expires_at"]) == (NONCE, NOW + 630)
    assert t.row.machine.lease.expires_at.ToNanoseconds() == int((NOW + 630) * 1e9)


@pytest.mark.parametrize("nonce", ["", OTHER], ids=["none", "another"])
def test_another_holder_is_refused_while_the_lease_is_held(nonce: str) -> None:
    with pytest.raises(FailedPrecondition, match="leased by deployer"):
        acquire(LEASED, nonce=nonce, now=NOW + 59, owner="intruder", new_nonce=OTHER)


@pytest.mark.parametrize("nonce", ["", NONCE, OTHER], ids=["none", "the old one", "another"])
def test_an_expired_lease_can_be_taken_by_anyone(nonce: str) -> None:
    t = acquire(LEASED, nonce=nonce, now=NOW + 60, owner="next", new_nonce=OTHER)
    assert t.row.lease is not None
    assert (t.row.lease["owner"], t.row.lease["expires_at"]) == ("next", NOW + 120)
    assert t.row.lease["nonce"] == OTHER  # a new nonce: the old holder's is worthless now
    assert t.row.machine.lease.owner == "next"


@pytest.mark.parametrize("state", [DESTROYED, DESTROYING])
def test_a_destroyed_machine_cannot_be_leased(state: int) -> None:
    with pytest.raises(FailedPrecondition, match="cannot lease"):
        acquire(row(state))


def test_release_with_the_nonce() -> None:
    t = fsm.release_lease(LEASED, NONCE, NOW + 1)
    assert t is not None
    assert (t.row.lease, t.row.machine.HasField("lease")) == (None, False)
    assert (t.type, t.reason, t.to_state) == ("lease", "lease released", STARTED)


@pytest.mark.parametrize("nonce", ["", OTHER], ids=["none", "another"])
def test_release_with_a_wrong_nonce_is_refused(nonce: str) -> None:
    with pytest.raises(FailedPrecondition, match="not the nonce"):
        fsm.release_lease(LEASED, nonce, NOW + 1)


@pytest.mark.parametrize("nonce", ["", OTHER, NONCE], ids=["none", "another", "the old one"])
def test_release_of_an_expired_lease_with_any_nonce(nonce: str) -> None:
    t = fsm.release_lease(LEASED, nonce, NOW + 61)
    assert t is not None
    assert t.row.lease is None


def test_release_without_a_lease_changes_nothing() -> None:
    assert fsm.release_lease(RUNNING, "", NOW) is None


CHECKS = [
    # (id, row, nonce, now, allowed)
    ("no lease, no nonce", RUNNING, "", NOW, True),
    ("no lease, any nonce", RUNNING, OTHER, NOW, True),
    ("held, its nonce", LEASED, NONCE, NOW + 59, True),
    ("held, no nonce", LEASED, "", NOW + 59, False),
    ("held, another nonce", LEASED, OTHER, NOW + 59, False),
    ("expired, no nonce", LEASED, "", NOW + 60, True),
    ("expired, the old nonce", LEASED, NONCE, NOW + 61, True),
]


@pytest.mark.parametrize(
    ("r", "nonce", "now", "allowed"), [c[1:] for c in CHECKS], ids=[c[0] for c in CHECKS]
)
def test_check_lease(r: fsm.Row, nonce: str, now: float, allowed: bool) -> None:
    if allowed:
        fsm.check_lease(r, nonce, now)
    else:
        with pytest.raises(FailedPrecondition, match=r"m1 is leased by deployer for 1s more"):
            fsm.check_lease(r, nonce, now)


def test_a_lease_does_not_change_operations_in_progress() -> None:
    t = acquire(IN_UPDATE)
    assert (t.row.op, t.row.handle, t.effects) == (UPDATE_KILL, H, ())


def test_row_round_trip_keeps_the_lease() -> None:
    decoded = fsm.decode_row(fsm.encode_row(LEASED))
    assert decoded == LEASED
    assert decoded.lease is not None
    assert decoded.lease["nonce"] == NONCE
    for each in (IN_UPDATE, IN_UPDATE_STOPPED, UPDATE_HELD):
        assert fsm.decode_row(fsm.encode_row(each)) == each
