"""A scripted fake of the process driver, shipped beside the real one (like Nomad's mock driver).

No processes: a `FakeHost` holds the fake machines and their exit statuses, so they outlive a
`FakeDriver` the way real machines outlive a killed flyd; a new `FakeDriver` on the same host
re-attaches. Time is the host's injected `runtime.clock.Clock` (a `ManualClock` by default): a
machine's `run_for` ends when the test advances that clock; nothing sleeps.

Behaviour comes from a `FakeScript` per machine id, or from argv markers, so a test can script a
machine through the normal create path:

    "fake:start_error=no room"   start raises Unavailable("no room")
    "fake:run_for=2.5"           exits 2.5 clock seconds after start (default: until stopped)
    "fake:exit_code=3"           the code it exits with when its run_for is over (default 0)
    "fake:ignore_stop"           ignores the stop signal: stop escalates to SIGKILL

Signals sent with `signal` are recorded in `signals` and otherwise ignored; a test models a
reaction with `exit`. Log lines come from `write_log`. A log read blocks like the real one:
called on the event loop it raises, and `FakeHost.hold_log_reads` keeps reads in flight (in
their threads) until the test lets them go.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from flyd.drivers.base import Driver, ExitStatus, Handle, LogTail, PortMapping, ProcessSpec
from model.errors import (
    FailedPrecondition,
    FlydError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from runtime.clock import Clock, ManualClock

__all__ = ["FakeDriver", "FakeHost", "FakeScript", "LogReadHold"]

FAKE_BOOT_ID = "fake-boot"
_HOLD_LIMIT_S = 30.0  # a held read that nobody lets go of ends with an error, not a hang


class LogReadHold:
    """Log reads in flight: each waits in its own thread until `let_go`."""

    def __init__(self) -> None:
        self.waiting = threading.Semaphore(0)
        """Released once for each read that is waiting now."""
        self._go = threading.Event()

    def let_go(self) -> None:
        self._go.set()

    def wait(self) -> None:
        self.waiting.release()
        if not self._go.wait(_HOLD_LIMIT_S):
            raise TimeoutError("a held log read was never let go of")


@dataclass(frozen=True)
class FakeScript:
    """How a fake machine process behaves."""

    start_error: FlydError | None = None
    run_for: float | None = None  # clock seconds; None: until stopped
    exit_code: int = 0
    ignore_stop: bool = False

    @classmethod
    def from_argv(cls, argv: list[str]) -> FakeScript:
        """The script the `fake:` markers in argv describe (see the module docstring)."""
        script = cls()
        for arg in argv:
            if not arg.startswith("fake:"):
                continue
            key, _, value = arg.removeprefix("fake:").partition("=")
            if key == "start_error":
                script = replace(script, start_error=Unavailable(value or "scripted failure"))
            elif key == "run_for":
                script = replace(script, run_for=float(value))
            elif key == "exit_code":
                script = replace(script, exit_code=int(value))
            elif key == "ignore_stop":
                script = replace(script, ignore_stop=True)
            else:
                raise InvalidArgument("argv", f"unknown fake marker {arg!r}")
        return script


@dataclass
class _FakeProcess:
    handle: Handle
    script: FakeScript
    timer: asyncio.Task[None] | None = None  # ends the run_for
    released: bool = False  # a held process that is never released never runs


class FakeHost:
    """The fake machines of one host; they outlive the drivers attached to them."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock: Clock = clock if clock is not None else ManualClock()
        self.processes: dict[str, _FakeProcess] = {}
        self.exits: dict[str, ExitStatus] = {}  # the "exit files"
        self.logs: dict[str, list[str]] = {}
        self.watchers: dict[str, FakeDriver] = {}
        # Host ports: held for machines (they outlive a driver, as netd's do), and taken by
        # other programs (a test adds to `busy_ports`).
        self.held_ports: dict[str, set[int]] = {}
        self.busy_ports: set[int] = set()
        self.log_hold: LogReadHold | None = None
        self._next_pid = 1000

    def hold_log_reads(self) -> LogReadHold:
        """From now on, log reads wait in their threads until the hold's `let_go`."""
        self.log_hold = LogReadHold()
        return self.log_hold

    def spawn(self, machine_id: str, script: FakeScript) -> Handle:
        """A new fake process for the machine, ending on its own after `script.run_for`."""
        self._next_pid += 1
        handle = Handle(pid=self._next_pid, start_time=int(self.clock.now()), boot_id=FAKE_BOOT_ID)
        process = _FakeProcess(handle, script)
        if script.run_for is not None:
            ends = self.clock.now() + script.run_for
            process.timer = asyncio.get_running_loop().create_task(
                self._run_out(machine_id, handle, ends, script.exit_code)
            )
        self.processes[machine_id] = process
        self.exits.pop(machine_id, None)
        self.logs.setdefault(machine_id, [])
        return handle

    def exit(self, machine_id: str, status: ExitStatus) -> None:
        """The machine's process ends now with `status`; a watching driver reports it."""
        process = self.processes.pop(machine_id, None)
        if process is None:
            raise FailedPrecondition(f"fake machine {machine_id} is not running")
        if process.timer is not None and process.timer is not asyncio.current_task():
            process.timer.cancel()
        self.exits[machine_id] = status
        watcher = self.watchers.pop(machine_id, None)
        if watcher is not None:
            watcher._exited(machine_id, process.handle, status)

    async def _run_out(self, machine_id: str, handle: Handle, ends: float, code: int) -> None:
        await self.clock.sleep_until(ends)
        process = self.processes.get(machine_id)
        if process is not None and process.handle == handle:
            self.exit(machine_id, ExitStatus(exit_code=code, signal=None))


class FakeDriver:
    """The `Driver` contract without processes. `starts` and `signals` record the calls."""

    name = "fake"
    egress_refusal: str | None = None
    disk_limited = True  # as the OCI driver: what a machine writes is its disk's, no more

    def __init__(
        self,
        *,
        on_exit: Callable[[str, Handle, ExitStatus], None],
        host: FakeHost | None = None,
        scripts: dict[str, FakeScript] | None = None,
        limits_enforced: bool = True,
    ) -> None:
        self.host = host if host is not None else FakeHost()
        self.limits_enforced = limits_enforced
        self.starts: list[ProcessSpec] = []
        self.signals: list[tuple[str, int]] = []
        self.released: list[str] = []
        self._on_exit = on_exit
        self._scripts = dict(scripts or {})
        self._closed = False
        self._log_written: dict[str, asyncio.Event] = {}

    # -- scripting ---------------------------------------------------------------------------

    def script(self, machine_id: str, script: FakeScript) -> None:
        """Set how the machine's next starts behave (wins over argv markers)."""
        self._scripts[machine_id] = script

    def exit(self, machine_id: str, status: ExitStatus) -> None:
        """The machine's process ends now with `status` (a crash, an OOM kill, ...)."""
        self.host.exit(machine_id, status)

    def write_log(self, machine_id: str, line: str) -> None:
        """The machine prints a line."""
        self.host.logs.setdefault(machine_id, []).append(line)
        event = self._log_written.pop(machine_id, None)
        if event is not None:
            event.set()

    # -- the Driver contract -----------------------------------------------------------------

    async def start(self, spec: ProcessSpec) -> Handle:
        """Start a fake process, or return the running one's handle."""
        self._check_open()
        running = self.host.processes.get(spec.machine_id)
        if running is not None:
            self.host.watchers[spec.machine_id] = self
            return running.handle
        if not spec.argv:
            raise InvalidArgument("argv", "no command to run")
        script = self._scripts.get(spec.machine_id) or FakeScript.from_argv(spec.argv)
        self.starts.append(spec)
        if script.start_error is not None:
            raise script.start_error
        handle = self.host.spawn(spec.machine_id, script)
        self.host.watchers[spec.machine_id] = self
        return handle

    def machine_address(self, machine_id: str) -> str:
        """ "": the fake's machines are reached at their host ports."""
        return ""

    def hold_ports(self, machine_id: str, candidates: Iterable[int], count: int) -> list[int]:
        """Take `count` of `candidates` that no machine holds and no other program has."""
        self._check_open()
        taken = set(self.host.busy_ports).union(*self.host.held_ports.values())
        found = [port for port in candidates if port not in taken][:count]
        if len(found) < count:
            raise ResourceExhausted("ports", f"no free host port among the {count} needed")
        self.host.held_ports.setdefault(machine_id, set()).update(found)
        return found

    async def publish(self, machine_id: str, ports: Sequence[PortMapping]) -> None:
        """Hold exactly these host ports for the machine."""
        self._check_open()
        self.host.held_ports[machine_id] = {p.host_port for p in ports}

    async def reconcile(self, machines: Mapping[str, Sequence[PortMapping]]) -> None:
        """Hold exactly the ports of `machines`."""
        self._check_open()
        held = {mid: {p.host_port for p in ports} for mid, ports in machines.items()}
        self.host.held_ports = held

    def leftovers(self) -> list[str]:
        """The machines the host keeps anything for (logs, an exit, a process)."""
        return sorted(self.host.logs.keys() | self.host.exits.keys() | self.host.processes.keys())

    def release(self, machine_id: str) -> None:
        """Let the held fake process run (until then it has run nothing)."""
        process = self.host.processes.get(machine_id)
        if process is not None:
            process.released = True
        self.released.append(machine_id)

    def discard(self, machine_id: str) -> None:
        """A held fake process that is never released ends without having run anything."""
        process = self.host.processes.get(machine_id)
        if process is not None and not process.released and self.is_running(machine_id):
            self.host.exit(machine_id, ExitStatus(exit_code=125, signal=None, released=False))

    def attach(self, machine_id: str, handle: Handle) -> bool:
        """True if the same fake process still runs (now watched); else on_exit comes soon."""
        self._check_open()
        running = self.host.processes.get(machine_id)
        if running is not None and running.handle == handle:
            self.host.watchers[machine_id] = self
            return True
        status = self.host.exits.get(machine_id) or ExitStatus(None, signal.SIGKILL)
        asyncio.get_running_loop().call_soon(self._on_exit, machine_id, handle, status)
        return False

    def is_running(self, machine_id: str) -> bool:
        """Whether this driver watches a running fake process of the machine."""
        return self.host.watchers.get(machine_id) is self

    async def signal(self, machine_id: str, sig: int) -> None:
        """Record the signal; the fake process ignores it."""
        self._running(machine_id)
        self.signals.append((machine_id, sig))

    async def stop(self, machine_id: str, sig: int, timeout: float) -> ExitStatus:
        """End the process: killed by `sig`, or by SIGKILL if it ignores stops (no waiting)."""
        if not self.is_running(machine_id):
            self._check_open()
            last = self.host.exits.get(machine_id)
            if last is not None:
                return last
            raise FailedPrecondition(f"machine {machine_id} has no process to stop")
        process = self.host.processes[machine_id]
        self.signals.append((machine_id, sig))
        if process.script.ignore_stop and sig != signal.SIGKILL:
            sig = signal.SIGKILL  # the timeout ran out
        status = ExitStatus(exit_code=None, signal=int(sig))
        self.host.exit(machine_id, status)
        return status

    def last_exit(self, machine_id: str) -> ExitStatus | None:
        """The last recorded exit; None while it runs."""
        if machine_id in self.host.processes:
            return None
        return self.host.exits.get(machine_id)

    async def cleanup(self, machine_id: str) -> None:
        """Forget the machine (its exit and logs)."""
        self._check_open()
        if machine_id in self.host.processes:
            raise FailedPrecondition(f"machine {machine_id} is running; stop it first")
        self.host.exits.pop(machine_id, None)
        self.host.logs.pop(machine_id, None)
        self.host.held_ports.pop(machine_id, None)

    def rotate_logs(self) -> None:
        """Nothing to bound: fake logs live in memory."""

    def read_logs(self, machine_id: str, tail_lines: int, max_bytes: int) -> LogTail:
        """The last `tail_lines` lines written with `write_log`, as many as fit `max_bytes`
        (a line and its newline, UTF-8). Blocking, as a real read: refused on the loop."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError("read_logs blocks: call it off the event loop (a thread)")
        if tail_lines < 0:
            raise InvalidArgument("tail_lines", "must not be negative")
        if max_bytes <= 0:
            raise InvalidArgument("max_bytes", "must be positive")
        lines = list(self._logs(machine_id))
        if self.host.log_hold is not None:
            self.host.log_hold.wait()
        wanted = lines[max(0, len(lines) - tail_lines) :] if tail_lines else []
        taken: list[str] = []  # newest first
        used = 0
        for line in reversed(wanted):
            cost = len(line.encode()) + 1
            if used + cost > max_bytes:
                break
            taken.append(line)
            used += cost
        truncated = 0
        if len(taken) < len(wanted):  # the budget ran out first
            truncated = sum(len(line.encode()) + 1 for line in lines[: len(lines) - len(taken)])
        return LogTail(taken[::-1], truncated_bytes=truncated, follow_from=len(lines))

    def follow_logs(
        self,
        machine_id: str,
        *,
        shutdown: asyncio.Event,
        poll_interval: float = 0.1,
        from_offset: int | None = None,
    ) -> AsyncIterator[str]:
        """Lines written from now on (or from line index `from_offset`) until `shutdown`."""
        lines = self._logs(machine_id)
        return self._follow(
            machine_id, len(lines) if from_offset is None else from_offset, shutdown
        )

    async def _follow(
        self, machine_id: str, pos: int, shutdown: asyncio.Event
    ) -> AsyncIterator[str]:
        while not shutdown.is_set():
            lines = self.host.logs.get(machine_id)
            if lines is None:
                return  # cleaned up
            while pos < len(lines):
                pos += 1
                yield lines[pos - 1]
            written = self._log_written.setdefault(machine_id, asyncio.Event())
            waits = [asyncio.ensure_future(written.wait()), asyncio.ensure_future(shutdown.wait())]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()

    async def close(self) -> None:
        """Stop watching; the fake machines keep running on the host.

        Like the real hold pipe, a process that was never released dies with its driver
        without having run anything.
        """
        self._closed = True
        for mid, watcher in list(self.host.watchers.items()):
            if watcher is self:
                del self.host.watchers[mid]
                process = self.host.processes.get(mid)
                if process is not None and not process.released:
                    self.host.exit(mid, ExitStatus(exit_code=125, signal=None, released=False))

    # -- internals ---------------------------------------------------------------------------

    def _exited(self, machine_id: str, handle: Handle, status: ExitStatus) -> None:
        self._on_exit(machine_id, handle, status)

    def _running(self, machine_id: str) -> None:
        self._check_open()
        if not self.is_running(machine_id):
            raise FailedPrecondition(f"machine {machine_id} has no running process")

    def _logs(self, machine_id: str) -> list[str]:
        lines = self.host.logs.get(machine_id)
        if lines is None:
            raise NotFound(f"machine {machine_id} has no process state on this worker")
        return lines

    def _check_open(self) -> None:
        if self._closed:
            raise Unavailable("the fake driver is closed")


# FakeDriver keeps the real driver's contract (checked by mypy).
_: type[Driver] = FakeDriver
