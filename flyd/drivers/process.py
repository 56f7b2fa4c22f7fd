"""The process driver: runs each machine as a host process group under cgroup v1 limits.

flyd can be SIGKILLed at any moment and restarted; the machines must keep running meanwhile and
flyd re-attaches to them when it comes back. So nothing about a machine lives only in flyd:

- Each machine runs under a tiny `/bin/sh` wrapper (a session and process-group leader) that
  records the machine's exit status in the run dir; the usual stop signals reach the machine
  while the wrapper survives them to do so (see `flyd.drivers.wrapper`).
- stdout and stderr go to one `machine.log` opened O_APPEND, so a machine never blocks on flyd.
  flyd bounds it by copy-truncate rotation (`rotate_logs`, see `flyd.drivers.logs`).
- A `Handle` (pid, process start time, boot id) identifies the wrapper across flyd restarts; a
  recycled pid or a reboot cannot pass for the machine (see `flyd.drivers.procfs`). The driver
  also keeps the handle in the machine's run dir (`flyd.drivers.rundir`), so a start after a
  flyd crash finds (and ends) a process an earlier start left held.
- Exits are noticed without a thread per process: a pidfd per machine, watched by the event loop.
- A wrapper let go of before it was released (its flyd died) writes `held` as its exit status,
  so a later flyd tells "never ran" from "ran and exited".
- Limits are cgroup v1 memory, cpu and pids cgroups (`flyd.drivers.cgroups`); without them
  machines still run, unlimited, and `limits_enforced` says so.
- Run dirs and cgroups are made ahead of need, so a first start only renames them into place
  (`flyd.drivers.spares`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import pwd
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from flyd.drivers.base import Driver, ExitStatus, Handle, Limits, ProcessSpec
from flyd.drivers.cgroups import Cgroups, probe
from flyd.drivers.logs import MachineLogs, open_output
from flyd.drivers.procfs import (
    open_child_pidfd,
    open_pidfd,
    read_boot_id,
    read_proc_stat,
    readable,
    unreaped_child,
)
from flyd.drivers.rundir import RunDirs, validate_machine_id
from flyd.drivers.spares import Spares
from flyd.drivers.wrapper import (
    FORWARDED_SIGNALS,
    WRAPPER_PREFIX,
    from_wait_status,
    from_waitid,
    wrapper_script,
)
from flyd.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable

__all__ = ["ProcessDriver"]

log = structlog.get_logger(__name__)

_KILL_GRACE_S = 5.0  # after SIGKILL, how long the kernel may take before we call it stuck
_EXEC_WAIT_S = 1.0  # how long signal/stop wait for a just-started machine to be exec'd


# Popen objects of machines still running when their driver closed. Dropping a running Popen
# warns (ResourceWarning); keeping it costs nothing, and a later driver in the same process
# reaps the exit through its pidfd. Pruned on every start.
_detached_children: list[subprocess.Popen[bytes]] = []


@dataclass(eq=False)
class _Watched:
    """A live machine process this driver watches through a pidfd."""

    machine_id: str
    handle: Handle
    pidfd: int
    popen: subprocess.Popen[bytes] | None  # None when attached after a restart
    exited: asyncio.Future[ExitStatus]
    killed_by_us: bool = False
    done: bool = field(default=False)
    go_fd: int | None = None  # write end of the hold pipe until release()
    discarded: bool = False  # let go of unreleased (discard)


class ProcessDriver:
    """Runs machines as host processes; see the module docstring for the design.

    `on_exit(machine_id, handle, status)` is called from the event loop exactly once for every
    process exit this driver sees, including the ones `stop` causes. Methods are meant to be
    called from the event loop thread.
    """

    limits_enforced: bool
    """False when cgroups are unavailable: machines still run, without limits."""

    limits_problem: str | None
    """Why limits are not enforced, or None."""

    def __init__(
        self,
        run_root: Path,
        *,
        on_exit: Callable[[str, Handle, ExitStatus], None],
        cgroup_root: Path = Path("/sys/fs/cgroup"),
        cgroup_prefix: str = "nonomad",
        run_as: str | None = None,
        max_log_bytes: int = 1 << 20,
        log_backups: int = 2,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
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
        self._watched: dict[str, _Watched] = {}
        # The last handle whose exit was reported per machine: on_exit fires once per exit.
        self._reported: dict[str, Handle] = {}
        self._closed = False
        self._boot_id = read_boot_id()
        self._mv = shutil.which("mv") or "/bin/mv"

        self._user: tuple[int, int, list[int]] | None = None
        if run_as is not None:
            self._user = _resolve_user(run_as)
        self._run_dirs = RunDirs(run_root, self._user)

        self.limits_problem = probe(cgroup_root, cgroup_prefix)
        self.limits_enforced = self.limits_problem is None
        self._cgroups: Cgroups | None = None
        if self.limits_problem is None:
            owner_uid = self._user[0] if self._user is not None else None
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
            self._user,
        )
        ignored = [s.name for s in FORWARDED_SIGNALS if signal.getsignal(s) == signal.SIG_IGN]
        if ignored:
            # Ignored dispositions survive exec and a non-interactive sh cannot reset them.
            log.warning("machines_inherit_ignored_signals", signals=ignored)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, spec: ProcessSpec) -> Handle:
        """Create the machine's process, held before it runs anything; `release` lets it run.

        The hold lets flyd commit the handle before the machine's command runs. A held process
        whose flyd dies reads EOF from the hold pipe and exits without running anything, so a
        crash between start and release can never leave an unrecorded machine running. Returns
        the handle of the process already watched for the machine, if any. Raises
        `InvalidArgument` for a bad spec and `Unavailable` when the host cannot start it now.
        """
        self._check_open()
        _validate_spec(spec)
        loop = asyncio.get_running_loop()
        mid = spec.machine_id
        watched = self._watched.get(mid)
        if watched is not None:
            return watched.handle
        # A process of an earlier start that flyd never released cannot have run anything:
        # make sure it is gone (it normally exits on its own when its flyd dies).
        previous = self._run_dirs.read_handle(mid)
        if previous is not None:
            self._kill_unreleased(previous)

        _prune_detached_children()
        run_dir = self._run_dirs.path(mid)
        cgroups = self._cgroups.dirs(mid) if self._cgroups is not None else []
        try:
            # A first start takes a spare run dir and cgroups; a new run dir has no stale files.
            new_cgroups = self._spares.take(run_dir, cgroups)
            fresh = self._run_dirs.prepare(mid, from_spare=new_cgroups is not None)
            cgroup_procs = self._setup_cgroups(mid, spec.limits, fresh, new_cgroups)
            log_fd = open_output(run_dir)
        except OSError as e:
            raise Unavailable(f"cannot prepare machine {mid}: {e}") from e

        status_dir = self._run_dirs.status_dir(mid)
        script = wrapper_script(status_dir, spec.cwd, spec.env, cgroup_procs, self._mv)
        hold_r, hold_w = os.pipe2(os.O_CLOEXEC)
        uid, gid, groups = self._user if self._user is not None else (None, None, None)
        try:
            # Blocking, but only for the fork/exec: we never wait on the child here.
            popen = subprocess.Popen(  # noqa: ASYNC220
                ["/bin/sh", "-c", script, "nonomad-wrapper", *spec.argv],
                stdin=hold_r,
                stdout=log_fd,
                stderr=log_fd,
                env=spec.env,
                start_new_session=True,
                # Without preexec_fn Python can vfork; a user switch makes it fork instead.
                user=uid,
                group=gid,
                extra_groups=groups,  # else the machine would keep flyd's (root's) groups
            )
        except OSError as e:
            os.close(hold_w)
            raise Unavailable(f"cannot start machine {mid}: {e}") from e
        finally:
            os.close(log_fd)
            os.close(hold_r)

        # Our child cannot be reaped before we poll it, so its pid is stable until then.
        proc = read_proc_stat(popen.pid)
        assert proc is not None, "an unreaped child always has a /proc entry"
        handle = Handle(pid=popen.pid, start_time=proc.start_time, boot_id=self._boot_id)
        self._run_dirs.write_handle(mid, handle)
        w = self._watch(loop, mid, handle, os.pidfd_open(popen.pid), popen)
        w.go_fd = hold_w
        log.debug("machine_process_started", machine_id=mid, pid=popen.pid)
        return handle

    def release(self, machine_id: str) -> None:
        """Let a held process run the machine's command. A no-op for a running one."""
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
        """End a held process that will never be released: it exits without running anything.

        For a start whose handle flyd could not record. A no-op for a released process. The
        exit is reported through `on_exit` as usual.
        """
        w = self._watched.get(machine_id)
        if w is None or w.go_fd is None:
            return
        fd, w.go_fd = w.go_fd, None
        w.discarded = True
        os.close(fd)  # EOF on the hold pipe: the wrapper exits before the machine's command

    def _kill_unreleased(self, handle: Handle) -> None:
        pidfd = open_pidfd(handle, self._boot_id)
        if pidfd is None:
            return
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        finally:
            os.close(pidfd)

    def attach(self, machine_id: str, handle: Handle) -> bool:
        """Watch the machine's process again after a flyd restart.

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
        if pidfd is not None:
            w = self._watch(loop, machine_id, handle, pidfd, popen=None)
            if not readable(pidfd):
                log.info("machine_process_attached", machine_id=machine_id, pid=handle.pid)
                return True
            # It exited a moment ago and nobody reaped it yet (it may be our own child).
            self._finish(w, defer_on_exit=True)
            return False

        # No record at all: it died with the host, or was SIGKILLed while flyd was away.
        killed = ExitStatus(exit_code=None, signal=signal.SIGKILL)
        status = self._status_from_files(machine_id, killed, killed_by_us=False) or killed
        # The wrapper is gone; whatever it left in the cgroup is not a machine any more.
        self._kill_cgroup(machine_id)
        self._reported[machine_id] = handle
        log.info("machine_process_gone", machine_id=machine_id, status=status.describe())
        loop.call_soon(self._call_on_exit, machine_id, handle, status)
        return False

    def is_running(self, machine_id: str) -> bool:
        """Whether this driver watches a live process of the machine."""
        return machine_id in self._watched

    async def signal(self, machine_id: str, sig: int) -> None:
        """Send `sig` to the machine's main process (the wrapper's child).

        Right after a start, waits (briefly) for the machine to be exec'd; falls back to the
        whole process group when it cannot be found.
        """
        w = self._running(machine_id)
        sig = _validate_signal(sig)
        child_fd = await self._main_process(w, _EXEC_WAIT_S)
        if child_fd is not None:
            try:
                signal.pidfd_send_signal(child_fd, sig)
                return
            except ProcessLookupError:
                pass
            finally:
                os.close(child_fd)
        self._killpg(w, sig)

    async def stop(self, machine_id: str, sig: int, timeout: float) -> ExitStatus:
        """Send `sig` to the process group, wait up to `timeout`, then SIGKILL the whole tree.

        Returns how the process ended. For a machine that is not running, returns its last exit
        status if there is one; raises `FailedPrecondition` otherwise, and `DeadlineExceeded`
        if even SIGKILL did not end the process in time.
        """
        sig = _validate_signal(sig)
        w = self._watched.get(machine_id)
        if w is None:
            self._check_open()
            last = self.last_exit(machine_id)
            if last is not None:
                return last
            raise FailedPrecondition(f"machine {machine_id} has no process to stop")
        if sig == signal.SIGKILL:
            w.killed_by_us = True
        else:
            # A signal caught by the wrapper while it forks the machine would reach neither.
            child_fd = await self._main_process(w, min(_EXEC_WAIT_S, timeout))
            if child_fd is not None:
                os.close(child_fd)
        self._killpg(w, sig)
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(asyncio.shield(w.exited), max(timeout, 0.0))
        log.info("machine_stop_escalated", machine_id=machine_id, signal=sig, timeout=timeout)
        w.killed_by_us = True
        self._kill_tree(w)
        try:
            return await asyncio.wait_for(asyncio.shield(w.exited), _KILL_GRACE_S)
        except TimeoutError:
            raise DeadlineExceeded(
                f"machine {machine_id} (pid {w.handle.pid}) survived SIGKILL for {_KILL_GRACE_S}s"
            ) from None

    def last_exit(self, machine_id: str) -> ExitStatus | None:
        """How the machine's last process ended, from its exit file; None while it runs."""
        if machine_id in self._watched:
            return None
        return self._status_from_files(machine_id, fallback=None, killed_by_us=False)

    async def cleanup(self, machine_id: str) -> None:
        """Remove the machine's cgroups and run dir (after destroy). Idempotent.

        Raises `FailedPrecondition` while its process runs (stop it first) and `Unavailable`
        if a cgroup stays busy. An id that cannot name a run dir never had one (nor a cgroup),
        so there is nothing to remove: a row accepted before ids were checked fully is
        destroyed like any other.
        """
        self._check_open()
        try:
            validate_machine_id(machine_id)
        except InvalidArgument:
            return
        if machine_id in self._watched:
            raise FailedPrecondition(f"machine {machine_id} is running; stop it first")
        if self._cgroups is not None:
            await self._cgroups.remove(machine_id)
        self._run_dirs.remove(machine_id)
        self._reported.pop(machine_id, None)
        self._logs.forget(self._run_dirs.path(machine_id))

    async def close(self) -> None:
        """Stop watching; the machines keep running. A new driver can `attach` to them.

        Processes still held (started, never released) exit without running anything.
        """
        if self._closed:
            return
        self._closed = True
        await self._spares.close()
        loop = asyncio.get_running_loop()
        for w in list(self._watched.values()):
            loop.remove_reader(w.pidfd)
            os.close(w.pidfd)
            if w.go_fd is not None:
                # Never released: like a dying flyd, let it exit without running anything.
                os.close(w.go_fd)
                w.go_fd = None
            w.done = True
            if w.popen is not None and w.popen.poll() is None:
                _detached_children.append(w.popen)
            if not w.exited.done():
                w.exited.set_exception(Unavailable("the process driver closed"))
                w.exited.exception()  # retrieved: nobody may be waiting on it
        self._watched.clear()

    # -- logs --------------------------------------------------------------------------------

    def rotate_logs(self) -> None:
        """Copy-truncate every machine log larger than `max_log_bytes`, keeping `log_backups`
        older copies (see `MachineLogs.rotate_all`).
        """
        self._logs.rotate_all(self._run_dirs.root)

    def read_logs(self, machine_id: str, tail_lines: int) -> list[str]:
        """The last `tail_lines` lines of the machine's output, across rotated files."""
        if tail_lines < 0:
            raise InvalidArgument("tail_lines", "must not be negative")
        return self._logs.read(self._run_dirs.existing(machine_id), tail_lines)

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

    def _watch(
        self,
        loop: asyncio.AbstractEventLoop,
        machine_id: str,
        handle: Handle,
        pidfd: int,
        popen: subprocess.Popen[bytes] | None,
    ) -> _Watched:
        w = _Watched(machine_id, handle, pidfd, popen, loop.create_future())
        self._watched[machine_id] = w
        loop.add_reader(pidfd, self._finish, w)
        return w

    def _finish(self, w: _Watched, *, defer_on_exit: bool = False) -> None:
        """The wrapper exited: reap it, kill what it left behind, work out and report the status."""
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
        self._kill_cgroup(w.machine_id)
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
        del self._watched[w.machine_id]
        self._reported[w.machine_id] = w.handle
        w.exited.set_result(status)
        log.info("machine_process_exited", machine_id=w.machine_id, status=status.describe())
        if defer_on_exit:
            loop.call_soon(self._call_on_exit, w.machine_id, w.handle, status)
        else:
            self._call_on_exit(w.machine_id, w.handle, status)

    def _call_on_exit(self, machine_id: str, handle: Handle, status: ExitStatus) -> None:
        try:
            self._on_exit(machine_id, handle, status)
        except Exception:
            log.exception("on_exit_failed", machine_id=machine_id)

    async def _main_process(self, w: _Watched, wait: float) -> int | None:
        """A pidfd for the machine's main process, waiting up to `wait` for its exec.

        None if the wrapper exits or has not exec'd the machine in time.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while True:
            fd = open_child_pidfd(w.handle.pid)
            if fd is not None or w.done or readable(w.pidfd) or loop.time() >= deadline:
                return fd
            await self._sleep(0.002)

    def _killpg(self, w: _Watched, sig: int) -> None:
        # An exited wrapper may already be reaped (by init after a restart): its pid is free.
        if w.done or readable(w.pidfd):
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(w.handle.pid, sig)

    def _kill_tree(self, w: _Watched) -> None:
        self._kill_cgroup(w.machine_id)
        self._killpg(w, signal.SIGKILL)

    def _running(self, machine_id: str) -> _Watched:
        self._check_open()
        w = self._watched.get(machine_id)
        if w is None:
            raise FailedPrecondition(f"machine {machine_id} has no running process")
        return w

    def _check_open(self) -> None:
        if self._closed:
            raise Unavailable("the process driver is closed")

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

    def _setup_cgroups(
        self, machine_id: str, limits: Limits, fresh_run_dir: bool, new: list[bool] | None
    ) -> list[Path]:
        """Set the machine's cgroups up (`Cgroups.setup`); returns their cgroup.procs files.

        An empty list without cgroups. `new`: which of them were just put in place from spares
        (None: none were).
        """
        if self._cgroups is None:
            return []
        procs, counters = self._cgroups.setup(machine_id, limits, new)
        # Counters outlive a run: keep their value at start so an exit can be judged on its own.
        if counters is not None or not fresh_run_dir:  # a new run dir has no stale oom.base
            self._run_dirs.write_oom_base(machine_id, counters)
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


def _prune_detached_children() -> None:
    _detached_children[:] = [p for p in _detached_children if p.poll() is None]


def _resolve_user(name: str) -> tuple[int, int, list[int]]:
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise InvalidArgument("run_as", f"no user named {name!r}") from None
    if os.geteuid() != 0:
        raise InvalidArgument("run_as", "running machines as another user needs root")
    return entry.pw_uid, entry.pw_gid, os.getgrouplist(name, entry.pw_gid)


def _validate_signal(sig: int) -> int:
    try:
        return int(signal.Signals(sig))
    except ValueError:
        raise InvalidArgument("signal", f"{sig} is not a signal") from None


def _validate_spec(spec: ProcessSpec) -> None:
    validate_machine_id(spec.machine_id)
    if not spec.argv or not spec.argv[0]:
        raise InvalidArgument("argv", "no command to run")
    if any("\0" in a for a in spec.argv):
        raise InvalidArgument("argv", "arguments may not contain NUL")
    if not spec.cwd.is_absolute():
        raise InvalidArgument("cwd", f"{spec.cwd} is not absolute")
    if not spec.cwd.is_dir():
        raise InvalidArgument("cwd", f"{spec.cwd} is not a directory")
    for key, value in spec.env.items():
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise InvalidArgument("env", f"{key!r} is not a valid environment variable")
        if key.startswith(WRAPPER_PREFIX):
            raise InvalidArgument("env", f"{key!r}: names starting {WRAPPER_PREFIX} are reserved")
    limits = spec.limits
    for name in ("cpu_millicores", "memory_mib", "pids"):
        if getattr(limits, name) <= 0:
            raise InvalidArgument(f"limits.{name}", "must be positive")


# ProcessDriver keeps the contract flyd is written against (checked by mypy).
_: type[Driver] = ProcessDriver
