"""What the process and OCI drivers share: machines that run under a `/bin/sh` wrapper.

flyd can be SIGKILLed at any moment and restarted; the machines must keep running meanwhile and
flyd re-attaches to them when it comes back. So nothing about a machine lives only in flyd:

- Each machine runs under a tiny `/bin/sh` wrapper (a session leader) that records the
  machine's exit status in the run dir (see `flyd.drivers.wrapper`); the process driver's
  wrapper runs the machine's command, the OCI driver's runs `crun run`.
- stdout and stderr go to a pipe whose other end is the machine's copier, a small process
  beside the wrapper that appends to `machine.log` within its size bound and rotates it, so a
  machine never blocks on flyd and can do nothing to the file (see `flyd.drivers.logs`). An
  exit is reported once the copier has written everything the machine printed.
- A `Handle` (pid, process start time, boot id) identifies the wrapper across flyd restarts; a
  recycled pid or a reboot cannot pass for the machine (see `flyd.drivers.procfs`). The driver
  also keeps the handle in the machine's run dir (`flyd.drivers.rundir`), so a start after a
  flyd crash finds (and ends) a process an earlier start left held.
- A machine is started *held*: it runs nothing of its own until flyd has committed its handle
  and `release`s it; a wrapper let go of before that (its flyd died, or `discard`) records
  `held` as its exit, so a later flyd tells "never ran" from "ran and exited".
- Exits are noticed without a thread per process: a pidfd per machine, watched by the event loop.
- Limits are cgroup v1 memory, cpu and pids cgroups the wrapper joins (`flyd.drivers.cgroups`);
  without them machines still run, unlimited, and `limits_enforced` says so.
- Run dirs and cgroups are made ahead of need, so a first start only renames them into place
  (`flyd.drivers.spares`).
- Published host ports are held (`flyd.drivers.ports`) from the moment they are handed out.

`WrappedDriver` implements all of that; a subclass says how to start a machine, how to signal
it, and how to kill all of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import pwd
import signal
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from flyd.drivers.base import ExitStatus, Handle, Limits, PortMapping, ProcessSpec
from flyd.drivers.cgroups import Cgroups, probe
from flyd.drivers.logs import Copier, LogTail, MachineLogs, find_copier, start_copier
from flyd.drivers.ports import HeldPorts, bind_address
from flyd.drivers.procfs import open_pidfd, read_boot_id, readable, signal_and_close, unreaped_child
from flyd.drivers.rundir import RunDirs, validate_machine_id
from flyd.drivers.spares import Spares
from flyd.drivers.wrapper import WRAPPER_PREFIX, from_wait_status, from_waitid
from model.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable

__all__ = ["KILL_GRACE_S", "Watched", "WrappedDriver", "resolve_user", "validate_signal"]

log = structlog.get_logger(__name__)

KILL_GRACE_S = 5.0  # after SIGKILL, how long the kernel may take before we call it stuck
# After a machine's wrapper exits and what it left is killed, how long its copier may take to
# write the rest of the pipe and exit; past it, something that escaped the kill holds the pipe
# open, and the copier is killed (the exit is reported without what it had not written).
COPIER_GRACE_S = 2.0

# Popen objects of machines still running when their driver closed. Dropping a running Popen
# warns (ResourceWarning); keeping it costs nothing, and a later driver in the same process
# reaps the exit through its pidfd. Pruned on every start.
_detached_children: list[subprocess.Popen[bytes]] = []


@dataclass(eq=False)
class Watched:
    """A live machine wrapper this driver watches through a pidfd."""

    machine_id: str
    handle: Handle
    pidfd: int
    popen: subprocess.Popen[bytes] | None  # None when attached after a restart
    exited: asyncio.Future[ExitStatus]
    killed_by_us: bool = False
    done: bool = field(default=False)
    go_fd: int | None = None  # what release() writes to, until it does
    discarded: bool = False  # let go of unreleased (discard)
    starting: bool = False  # start() has not returned it yet: an exit now is start's failure
    copier: Copier | None = None  # what writes its output to its log


class WrappedDriver:
    """The common machinery; see the module docstring. Subclasses implement `start`,
    `_deliver` (a signal to the machine's main process), `_kill_all` (SIGKILL everything of
    the machine) and may extend `_forget` (what cleanup removes besides run dir and cgroups).

    `on_exit(machine_id, handle, status)` is called from the event loop exactly once for every
    exit this driver sees, including the ones `stop` causes. Methods are meant to be called
    from the event loop thread.
    """

    limits_enforced: bool
    """False when cgroups are unavailable: machines still run, without limits."""

    limits_problem: str | None
    """Why limits are not enforced, or None."""

    name = "wrapped"
    cgroup_namespaces = False  # its machines join a cgroup namespace rooted at their cgroups
    # A host process shares the host's network: it reaches everything whatever it asks, so
    # egress is never refused (the OCI driver, which confines it, says otherwise).
    egress_refusal: str | None = None
    # And its filesystem: it writes wherever its user may, unbounded (the OCI driver gives
    # each machine a filesystem of its own).
    disk_limited = False

    def __init__(
        self,
        run_root: Path,
        *,
        on_exit: Callable[[str, Handle, ExitStatus], None],
        cgroup_root: Path,
        cgroup_prefix: str,
        user: tuple[int, int, list[int]] | None,
        max_log_bytes: int,
        log_backups: int,
        sleep: Callable[[float], Awaitable[None]],
        machine_host: str,
    ) -> None:
        if max_log_bytes <= 0:
            raise InvalidArgument("max_log_bytes", "must be positive")
        if log_backups < 0:
            raise InvalidArgument("log_backups", "must not be negative")
        if not cgroup_prefix or ".." in cgroup_prefix.split("/") or cgroup_prefix.startswith("/"):
            raise InvalidArgument("cgroup_prefix", f"{cgroup_prefix!r} is not a relative path")
        self._on_exit = on_exit
        self._sleep = sleep
        self._logs = MachineLogs(max_bytes=max_log_bytes, backups=log_backups, sleep=sleep)
        self._watched: dict[str, Watched] = {}
        # Machines whose exit waits for their copier to finish (see `_when_copied`).
        self._copying: dict[Copier, asyncio.TimerHandle] = {}
        # The last handle whose exit was reported per machine: on_exit fires once per exit.
        self._reported: dict[str, Handle] = {}
        self._closed = False
        self._boot_id = read_boot_id()
        self._user = user
        self._run_dirs = RunDirs(run_root, user)
        self._ports = HeldPorts()
        # Each machine's published services, as `publish` or its last start said.
        self._published: dict[str, tuple[PortMapping, ...]] = {}
        self.machine_host = machine_host
        self._port_host = self._bind_host(machine_host)  # where its held ports are bound

        self.limits_problem = probe(cgroup_root, cgroup_prefix)
        self.limits_enforced = self.limits_problem is None
        self._cgroups: Cgroups | None = None
        if self.limits_problem is None:
            owner_uid = user[0] if user is not None else None
            self._cgroups = Cgroups(cgroup_root, cgroup_prefix, owner_uid=owner_uid, sleep=sleep)
        else:
            log.warning(
                "cgroup_limits_not_enforced",
                reason=self.limits_problem,
                message=f"cgroup limits are not enforced: {self.limits_problem}",
            )
        self._spares = Spares(
            self._run_dirs.root,
            self._cgroups.parents if self._cgroups is not None else [],
            user,
            self._spare_layout,
            self._spare_cgroup_namespace if self.cgroup_namespaces else None,
        )

    # -- what a subclass provides ------------------------------------------------------------

    def _bind_host(self, machine_host: str) -> str:
        """Where the machines' host ports are bound, for ports published on `machine_host`
        (`ports.bind_address`: a host process binds the port itself, on what it likes)."""
        return bind_address(machine_host)

    def _spare_layout(self, run_dir: Path) -> None:
        """Make, in a spare run dir (in a worker thread), what a first start would make."""

    def _spare_cgroup_namespace(self, cgroups: list[Path]) -> int:
        """A cgroup namespace rooted at a spare set's cgroups, made ahead (in a worker
        thread) for a driver whose machines join one (`cgroup_namespaces`)."""
        raise NotImplementedError

    async def start(self, spec: ProcessSpec) -> Handle:
        raise NotImplementedError

    async def _deliver(self, w: Watched, sig: int, *, stopping: bool) -> None:
        """Send `sig` to the machine's main process (for a stop when `stopping`)."""
        raise NotImplementedError

    def _kill_all(self, w: Watched) -> None:
        """SIGKILL every process of the machine."""
        raise NotImplementedError

    async def _forget(self, machine_id: str) -> None:
        """What else cleanup removes (the machine is not running)."""

    # -- lifecycle ---------------------------------------------------------------------------

    def release(self, machine_id: str) -> None:
        """Let a held machine run its command. A no-op for a running one."""
        w = self._watched.get(machine_id)
        if w is None or w.go_fd is None:
            return
        fd, w.go_fd = w.go_fd, None
        try:
            os.write(fd, b"go\n")
        except BrokenPipeError:
            pass  # it already exited; its exit is reported as usual
        finally:
            os.close(fd)

    def discard(self, machine_id: str) -> None:
        """End a held machine that will never be released: it exits without running anything.

        For a start whose handle flyd could not record. A no-op for a released one. The exit is
        reported through `on_exit` as usual.
        """
        w = self._watched.get(machine_id)
        if w is None or w.go_fd is None:
            return
        fd, w.go_fd = w.go_fd, None
        w.discarded = True
        os.close(fd)  # EOF on the hold: the wrapper exits before the machine's command

    def attach(self, machine_id: str, handle: Handle) -> bool:
        """Watch the machine's wrapper again after a flyd restart.

        True: it is alive and the same process (not a recycled pid), and is now watched. False:
        it is gone, and `on_exit` is called soon with the status from the exit file, or
        `ExitStatus(None, SIGKILL)` when there is none (e.g. the host rebooted).
        """
        self._check_open()
        loop = asyncio.get_running_loop()
        watched = self._watched.get(machine_id)
        if watched is not None:
            if watched.handle == handle:
                return True
            raise FailedPrecondition(
                f"machine {machine_id} already runs another process (pid {watched.handle.pid})"
            )
        if self._reported.get(machine_id) == handle:
            return False
        pidfd = open_pidfd(handle, self._boot_id)
        copier = find_copier(self._run_dirs.path(machine_id), self._boot_id)
        if pidfd is not None:
            w = self._watch(loop, machine_id, handle, pidfd, popen=None, copier=copier)
            if not readable(pidfd):
                log.info("machine_process_attached", machine_id=machine_id, pid=handle.pid)
                return True
            # It exited a moment ago and nobody reaped it yet (it may be our own child).
            self._finish(w, defer_on_exit=True)
            return False

        # No record at all: it died with the host, or was SIGKILLed while flyd was away.
        killed = ExitStatus(exit_code=None, signal=signal.SIGKILL)
        status = self._status_from_files(machine_id, killed, killed_by_us=False) or killed
        self._ended(machine_id)
        self._reported[machine_id] = handle
        log.info("machine_process_gone", machine_id=machine_id, status=status.describe())

        def report() -> None:
            loop.call_soon(self._call_on_exit, machine_id, handle, status)

        self._when_copied(machine_id, copier, report)
        return False

    def is_running(self, machine_id: str) -> bool:
        """Whether this driver watches a live process of the machine."""
        return machine_id in self._watched

    async def signal(self, machine_id: str, sig: int) -> None:
        """Send `sig` to the machine's main process."""
        w = self._running(machine_id)
        await self._deliver(w, validate_signal(sig), stopping=False)

    async def stop(self, machine_id: str, sig: int, timeout: float) -> ExitStatus:
        """Send `sig` to the machine, wait up to `timeout`, then SIGKILL all of it.

        Returns how the machine ended. For a machine that is not running, returns its last exit
        status if there is one; raises `FailedPrecondition` otherwise, and `DeadlineExceeded`
        if even SIGKILL did not end it in time.
        """
        sig = validate_signal(sig)
        w = self._watched.get(machine_id)
        if w is None:
            self._check_open()
            last = self.last_exit(machine_id)
            if last is not None:
                return last
            raise FailedPrecondition(f"machine {machine_id} has no process to stop")
        if sig == signal.SIGKILL:
            w.killed_by_us = True
        await self._deliver(w, sig, stopping=True)
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(asyncio.shield(w.exited), max(timeout, 0.0))
        log.info("machine_stop_escalated", machine_id=machine_id, signal=sig, timeout=timeout)
        w.killed_by_us = True
        self._kill_all(w)
        try:
            return await asyncio.wait_for(asyncio.shield(w.exited), KILL_GRACE_S)
        except TimeoutError:
            raise DeadlineExceeded(
                f"machine {machine_id} (pid {w.handle.pid}) survived SIGKILL for {KILL_GRACE_S}s"
            ) from None

    def last_exit(self, machine_id: str) -> ExitStatus | None:
        """How the machine's last run ended, from its exit file; None while it runs."""
        if machine_id in self._watched:
            return None
        return self._status_from_files(machine_id, fallback=None, killed_by_us=False)

    async def cleanup(self, machine_id: str) -> None:
        """Remove everything the machine had on this host (after destroy): its cgroups, run
        dir and held ports, and what the driver adds (`_forget`). Idempotent.

        Raises `FailedPrecondition` while it runs (stop it first) and `Unavailable` if a
        cgroup stays busy. An id that cannot name a run dir never had one (nor a cgroup), so
        there is nothing to remove: a row accepted before ids were checked fully is destroyed
        like any other.
        """
        self._check_open()
        try:
            validate_machine_id(machine_id)
        except InvalidArgument:
            return
        if machine_id in self._watched:
            raise FailedPrecondition(f"machine {machine_id} is running; stop it first")
        await self._forget(machine_id)
        self._ports.release(machine_id)
        self._published.pop(machine_id, None)
        if self._cgroups is not None:
            await self._cgroups.remove(machine_id)
        self._run_dirs.remove(machine_id)
        self._reported.pop(machine_id, None)

    async def close(self) -> None:
        """Stop watching; the machines keep running. A new driver can `attach` to them.

        Machines still held (started, never released) exit without running anything.
        """
        if self._closed:
            return
        self._closed = True
        await self._spares.close()
        loop = asyncio.get_running_loop()
        for copier, timer in self._copying.items():  # their exits are a later flyd's to report
            timer.cancel()
            loop.remove_reader(copier.pidfd)
            copier.close()
        self._copying.clear()
        for w in list(self._watched.values()):
            if not w.done:  # else it exited, and only its copier was waited for
                loop.remove_reader(w.pidfd)
                os.close(w.pidfd)
            if w.copier is not None:
                w.copier.close()
                w.copier = None
            if w.go_fd is not None:
                # Never released: like a dying flyd, let it exit without running anything.
                os.close(w.go_fd)
                w.go_fd = None
            w.done = True
            if w.popen is not None and w.popen.poll() is None:
                _detached_children.append(w.popen)
            if not w.exited.done():
                w.exited.set_exception(Unavailable(f"the {self.name} driver closed"))
                w.exited.exception()  # retrieved: nobody may be waiting on it
        self._watched.clear()
        self._ports.close()

    # -- ports -------------------------------------------------------------------------------

    def hold_ports(self, machine_id: str, candidates: Iterable[int], count: int) -> list[int]:
        """Bind and hold `count` more host ports for the machine, the first free `candidates`.

        Raises ResourceExhausted ("ports") when there are not enough.
        """
        validate_machine_id(machine_id)
        return self._ports.take(machine_id, self._port_host, candidates, count)

    def machine_address(self, machine_id: str) -> str:
        """ "": a machine is reached at its host ports (an OCI worker that routes machines
        says otherwise)."""
        return ""

    async def publish(self, machine_id: str, ports: Sequence[PortMapping]) -> None:
        """The machine's published services are exactly `ports`: keep their host ports held
        (binding any that is not), let go of any other. The process driver holds them while
        the machine is not running (a running one has bound them itself).
        """
        validate_machine_id(machine_id)
        self._published[machine_id] = tuple(ports)
        if machine_id in self._watched:
            wanted = {p.host_port for p in ports}
            stale = [p for p in self._ports.holds(machine_id) if p not in wanted]
            self._ports.release(machine_id, stale)
            return
        self._hold_published(machine_id)

    def leftovers(self) -> list[str]:
        """The machines this driver keeps anything for (a run dir): after a crash, flyd
        cleans up those it has no row for (a create that died before its first commit).
        """
        return self._run_dirs.machines()

    async def reconcile(self, machines: Mapping[str, Sequence[PortMapping]]) -> None:
        """After flyd's recovery: these are the machines there are, with their services.
        Their ports are held again; ports held for anything else are let go of.
        """
        for machine_id in set(self._published) - machines.keys():
            self._published.pop(machine_id, None)
            self._ports.release(machine_id)
        for machine_id, ports in machines.items():
            try:
                await self.publish(machine_id, ports)
            except Exception as e:  # one machine's trouble is not the others'
                log.error("machine_ports_not_held", machine_id=machine_id, error=str(e))

    def _hold_published(self, machine_id: str) -> None:
        published = self._published.get(machine_id, ())
        lost = self._ports.keep(machine_id, self._port_host, [p.host_port for p in published])
        if lost:
            log.error("machine_ports_taken", machine_id=machine_id, ports=lost)

    # -- logs --------------------------------------------------------------------------------

    def rotate_logs(self) -> None:
        """Copy-truncate every machine log larger than `max_log_bytes` that no copier writes,
        keeping `log_backups` older copies (see `MachineLogs.rotate_all`). Blocking.
        """
        self._logs.rotate_all(self._run_dirs.root)

    def read_logs(self, machine_id: str, tail_lines: int, max_bytes: int) -> LogTail:
        """The last `tail_lines` lines of the machine's output, across rotated files, reading
        at most `max_bytes` of them (see `flyd.drivers.logs.read_tail`). Blocking: call it off
        the event loop.
        """
        if tail_lines < 0:
            raise InvalidArgument("tail_lines", "must not be negative")
        if max_bytes <= 0:
            raise InvalidArgument("max_bytes", "must be positive")
        return self._logs.read(self._run_dirs.existing(machine_id), tail_lines, max_bytes)

    def follow_logs(
        self,
        machine_id: str,
        *,
        shutdown: asyncio.Event,
        poll_interval: float = 0.1,
        from_offset: int | None = None,
    ) -> AsyncIterator[str]:
        """Yield the machine's output lines as they are written, until `shutdown` is set.

        From `from_offset` in the current `machine.log` (default: its end), polling every
        `poll_interval` seconds on the injected sleep; across rotations as
        `MachineLogs.follow` says. Ends when the run dir is removed.
        """
        run_dir = self._run_dirs.existing(machine_id)
        if poll_interval <= 0:
            raise InvalidArgument("poll_interval", "must be positive")
        if from_offset is not None and from_offset < 0:
            raise InvalidArgument("from_offset", "must not be negative")
        return self._logs.follow(
            run_dir, shutdown=shutdown, poll_interval=poll_interval, from_offset=from_offset
        )

    # -- internals: processes ----------------------------------------------------------------

    def _begin_start(self, spec: ProcessSpec) -> Handle | None:
        """The checks every start makes first: the handle of a machine already watched, else
        None, after ending what an earlier, never released start may have left.
        """
        self._check_open()
        validate_spec(spec)
        watched = self._watched.get(spec.machine_id)
        if watched is not None:
            return watched.handle
        # A process of an earlier start that flyd never released cannot have run anything:
        # make sure it is gone (it normally exits on its own when its flyd dies).
        previous = self._run_dirs.read_handle(spec.machine_id)
        if previous is not None:
            pidfd = open_pidfd(previous, self._boot_id)
            if pidfd is not None:
                signal_and_close(pidfd, signal.SIGKILL)
        _detached_children[:] = [p for p in _detached_children if p.poll() is None]
        return None

    def _watch(
        self,
        loop: asyncio.AbstractEventLoop,
        machine_id: str,
        handle: Handle,
        pidfd: int,
        popen: subprocess.Popen[bytes] | None,
        copier: Copier | None,
    ) -> Watched:
        w = Watched(machine_id, handle, pidfd, popen, loop.create_future(), copier=copier)
        self._watched[machine_id] = w
        loop.add_reader(pidfd, self._finish, w)
        return w

    def _finish(self, w: Watched, *, defer_on_exit: bool = False) -> None:
        """The wrapper exited: reap it, kill what it left behind, work out the status, and
        report it once the copier has written all the machine printed (`_reported_exit`)."""
        if w.done:
            return
        w.done = True
        loop = asyncio.get_running_loop()
        loop.remove_reader(w.pidfd)
        # What the machine left behind dies with it. The process group only while the wrapper
        # is our unreaped child: its zombie keeps the group id from being reused. Otherwise
        # (attached after a restart, reaped by init) only the cgroup is a safe handle.
        ours = w.popen is not None or unreaped_child(w.pidfd)
        if ours:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.handle.pid, signal.SIGKILL)
        self._ended(w.machine_id)
        fallback: ExitStatus | None = None
        if w.popen is not None:
            code = w.popen.poll()
            if code is not None:
                fallback = from_wait_status(code)
        elif ours:
            with contextlib.suppress(ChildProcessError):
                result = os.waitid(os.P_PIDFD, w.pidfd, os.WEXITED | os.WNOHANG)
                if result is not None:
                    fallback = from_waitid(result)
        os.close(w.pidfd)
        held = w.go_fd is not None or w.discarded  # never released by this driver
        if w.go_fd is not None:
            os.close(w.go_fd)
            w.go_fd = None
        # No wait status when init reaped it; then only SIGKILL ends a wrapper without a record.
        fallback = fallback or ExitStatus(exit_code=None, signal=signal.SIGKILL)
        status = self._status_from_files(w.machine_id, fallback, w.killed_by_us) or fallback
        if held and status.released:
            status = dataclasses.replace(status, released=False)
        copier, w.copier = w.copier, None
        report = functools.partial(self._reported_exit, w, status, defer_on_exit)
        self._when_copied(w.machine_id, copier, report)

    def _reported_exit(self, w: Watched, status: ExitStatus, defer_on_exit: bool) -> None:
        """The rest of `_finish`, once the machine's log is complete."""
        del self._watched[w.machine_id]
        self._reported[w.machine_id] = w.handle
        w.exited.set_result(status)
        log.info("machine_process_exited", machine_id=w.machine_id, status=status.describe())
        if w.starting:
            return  # start raises instead: flyd never saw this handle
        if defer_on_exit:
            asyncio.get_running_loop().call_soon(self._call_on_exit, w.machine_id, w.handle, status)
        else:
            self._call_on_exit(w.machine_id, w.handle, status)

    def _ended(self, machine_id: str) -> None:
        """The machine's wrapper is gone: kill what is left in its cgroups."""
        self._kill_cgroup(machine_id)

    def _start_copier(self, machine_id: str) -> tuple[int, Copier]:
        """The machine's new copier and the pipe end for its stdout and stderr, which the
        caller closes once the wrapper has it. Raises OSError."""
        return start_copier(
            self._run_dirs.path(machine_id),
            max_bytes=self._logs.max_bytes,
            backups=self._logs.backups,
            boot_id=self._boot_id,
        )

    def _when_copied(
        self, machine_id: str, copier: Copier | None, then: Callable[[], None]
    ) -> None:
        """Call `then` once `copier` has exited (at once when there is none, or it is gone):
        everything the machine wrote is in its log. Past `COPIER_GRACE_S` the copier is
        killed instead (something that escaped the machine's end holds its pipe open).
        """
        if copier is None:
            then()
            return
        if readable(copier.pidfd):
            copier.close()
            then()
            return
        loop = asyncio.get_running_loop()

        def done() -> None:
            if self._copying.pop(copier, None) is None:
                return  # the driver closed
            timer.cancel()
            loop.remove_reader(copier.pidfd)
            copier.close()
            then()

        def overdue() -> None:
            log.warning("machine_log_copier_killed", machine_id=machine_id, pid=copier.handle.pid)
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(copier.pidfd, signal.SIGKILL)
            done()

        timer = loop.call_later(COPIER_GRACE_S, overdue)
        self._copying[copier] = timer
        loop.add_reader(copier.pidfd, done)

    def _call_on_exit(self, machine_id: str, handle: Handle, status: ExitStatus) -> None:
        try:
            self._on_exit(machine_id, handle, status)
        except Exception:
            log.exception("on_exit_failed", machine_id=machine_id)

    def _killpg(self, w: Watched, sig: int) -> None:
        # An exited wrapper may already be reaped (by init after a restart): its pid is free.
        if w.done or readable(w.pidfd):
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(w.handle.pid, sig)

    def _running(self, machine_id: str) -> Watched:
        self._check_open()
        w = self._watched.get(machine_id)
        if w is None:
            raise FailedPrecondition(f"machine {machine_id} has no running process")
        return w

    def _check_open(self) -> None:
        if self._closed:
            raise Unavailable(f"the {self.name} driver is closed")

    # -- internals: exits -------------------------------------------------------------------

    def _status_from_files(
        self, machine_id: str, fallback: ExitStatus | None, killed_by_us: bool
    ) -> ExitStatus | None:
        """The recorded exit status (else `fallback`, then recorded), with the OOM verdict.

        The wrapper's record is `status/exit`. When the wrapper could not write one (killed by
        SIGKILL, or by a signal before its traps were set) the driver records what it learnt
        in `exit`, so the status survives a flyd restart.
        """
        status = self._run_dirs.read_exit(machine_id)
        if (
            status is None
            and fallback is not None
            and self._run_dirs.record_exit(machine_id, fallback)
        ):
            status = fallback
        if status is None:
            return None
        if self._oom_killed(machine_id, status, killed_by_us):
            return ExitStatus(status.exit_code, status.signal, oom_killed=True)
        return status

    # -- internals: cgroups ------------------------------------------------------------------

    def _prepare_run(self, spec: ProcessSpec, spare: str | None) -> list[Path]:
        """A run dir and cgroups ready for a new run (a first start takes the `spare` set the
        caller claimed, if any); returns the cgroup.procs files the wrapper joins (none without
        cgroups). Raises OSError. It only touches the disk and cgroups: any thread may run it.
        """
        mid = spec.machine_id
        run_dir = self._run_dirs.path(mid)
        cgroups = self._cgroups.dirs(mid) if self._cgroups is not None else []
        # A first start takes a spare run dir and cgroups; a new run dir has no stale files.
        new_cgroups = None if spare is None else self._spares.take(spare, run_dir, cgroups)
        fresh = self._run_dirs.prepare(mid, from_spare=new_cgroups is not None)
        if self._cgroups is None:
            return []
        procs, counters = self._cgroups.setup(mid, spec.limits, new_cgroups)
        # Counters outlive a run: keep their value at start so an exit can be judged on its own.
        if counters is not None or not fresh:  # a new run dir has no stale oom.base
            self._run_dirs.write_oom_base(mid, counters)
        return procs

    def _kill_cgroup(self, machine_id: str) -> None:
        """SIGKILL every process in the machine's cgroups, if there are cgroups."""
        if self._cgroups is not None:
            self._cgroups.kill(machine_id)

    def _oom_killed(self, machine_id: str, status: ExitStatus, killed_by_us: bool) -> bool:
        if self._cgroups is None:
            return False
        try:
            base = self._run_dirs.read_oom_base(machine_id)
        except (OSError, ValueError):
            return False
        return self._cgroups.oom_killed(machine_id, base, status, killed_by_us)


def resolve_user(name: str) -> tuple[int, int, list[int]]:
    """uid, gid and groups of the host user machines run as; InvalidArgument if there is none."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise InvalidArgument("run_as", f"no user named {name!r}") from None
    if os.geteuid() != 0:
        raise InvalidArgument("run_as", "running machines as another user needs root")
    return entry.pw_uid, entry.pw_gid, os.getgrouplist(name, entry.pw_gid)


def validate_signal(sig: int) -> int:
    try:
        return int(signal.Signals(sig))
    except ValueError:
        raise InvalidArgument("signal", f"{sig} is not a signal") from None


def validate_spec(spec: ProcessSpec) -> None:
    """InvalidArgument naming the field for a spec no driver can run."""
    validate_machine_id(spec.machine_id)
    if not spec.argv or not spec.argv[0]:
        raise InvalidArgument("argv", "no command to run")
    if any("\0" in a for a in spec.argv):
        raise InvalidArgument("argv", "arguments may not contain NUL")
    if not spec.rootfs.is_absolute():
        raise InvalidArgument("rootfs", f"{spec.rootfs} is not absolute")
    if not spec.rootfs.is_dir():
        raise InvalidArgument("rootfs", f"{spec.rootfs} is not a directory")
    if not spec.workdir.startswith("/") or "\0" in spec.workdir:
        raise InvalidArgument("workdir", f"{spec.workdir!r} is not an absolute path")
    if "\0" in spec.user:
        raise InvalidArgument("user", "may not contain NUL")
    for key, value in spec.env.items():
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise InvalidArgument("env", f"{key!r} is not a valid environment variable")
        if key.startswith(WRAPPER_PREFIX):
            raise InvalidArgument("env", f"{key!r}: names starting {WRAPPER_PREFIX} are reserved")
    limits: Limits = spec.limits
    for name in ("cpu_millicores", "memory_mib", "pids", "disk_mib"):
        if getattr(limits, name) <= 0:
            raise InvalidArgument(f"limits.{name}", "must be positive")
