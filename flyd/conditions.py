"""A machine's readiness condition (Machine.ready) as its state changes: pure, no I/O.

flyd.fsm calls `after_step` on every change of state, so the condition is committed in the same
step as the state: "starting" once a start begins, a crash loop with its exit and last log line
when the restart policy restarts it, the failure when it gives up. What the condition says while
a machine is started (its ports accept, its checks pass, or not) is flyd.readiness's, which
probes it and commits the change with `condition`.
"""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from flyd.v1 import machine_pb2 as pb

S = pb.MachineState
CRASH_LOOP = "crash-looping"
# The last log line a reason quotes is cut to this many characters.
QUOTE_CHARS = 200
# Log lines a crash-looping machine's row keeps (a failed one keeps what the runner read).
RESTART_TAIL = 5


def condition(ready: bool, reason: str, since: Timestamp) -> pb.MachineCondition:
    cond = pb.MachineCondition(ready=ready, reason=reason)
    cond.since.CopyFrom(since)
    return cond


def after_step(machine: pb.Machine, from_state: int, op: str, reason: str) -> None:
    """Set `machine.ready` for the state it just reached (from `from_state`, by operation
    `op`, for `reason`); `machine.updated_at` is the time of the step."""
    state = machine.state
    if state == from_state:
        return
    now = machine.updated_at
    if state == S.MACHINE_STATE_STARTED:
        if not machine.ready.reason.startswith(CRASH_LOOP):
            machine.ready.CopyFrom(condition(False, waiting(machine), now))
        # A crash loop's restart keeps saying so until its probes pass.
    elif state == S.MACHINE_STATE_STARTING:
        machine.ready.CopyFrom(condition(False, "starting", now))
    elif state == S.MACHINE_STATE_RESTARTING:
        why = crash_loop(machine) if op == "exit" else "restarting"
        machine.ready.CopyFrom(condition(False, why, now))
    elif state == S.MACHINE_STATE_FAILED:
        machine.ready.CopyFrom(condition(False, with_last_line(f"failed: {reason}", machine), now))
    else:
        machine.ClearField("ready")


def waiting(machine: pb.Machine) -> str:
    """What a machine that just started waits for before it is ready."""
    checks = machine.config.checks
    if checks:
        names = ", ".join(c.name or f"check-{i}" for i, c in enumerate(checks))
        return f"starting: waiting for {'check' if len(checks) == 1 else 'checks'} {names}"
    if machine.config.services:
        return f"starting: waiting for {port_list(machine)} to accept connections"
    return "starting: no services; ready once it keeps running"


def port_list(machine: pb.Machine) -> str:
    ports = [str(s.internal_port) for s in machine.config.services]
    return ("port " if len(ports) == 1 else "ports ") + ", ".join(ports)


def exit_text(machine: pb.Machine) -> str:
    last = machine.last_exit
    if last.oom_killed:
        return "out of memory"
    if last.has_exit_code:
        return f"exit {last.exit_code}"
    return f"killed by {last.signal}" if last.signal else "exited"


def crash_loop(machine: pb.Machine) -> str:
    """`crash-looping: exit 1, 3 restarts; last log: KeyError: 'PORT'`."""
    n = machine.restart_count
    text = f"{CRASH_LOOP}: {exit_text(machine)}, {n} restart{'' if n == 1 else 's'}"
    return with_last_line(text, machine)


def with_last_line(text: str, machine: pb.Machine) -> str:
    """`text`, with the last line the machine logged that is not blank, if any."""
    last = next((line.strip() for line in reversed(machine.log_tail) if line.strip()), "")
    return f"{text}; last log: {last[:QUOTE_CHARS]}" if last else text
