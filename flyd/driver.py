"""The process driver: runs each machine as a host process group under cgroup v1 limits.

flyd can be SIGKILLed at any moment and restarted; the machines must keep running meanwhile and
flyd re-attaches to them when it comes back. So nothing about a machine lives only in flyd:

- Each machine runs under a tiny `/bin/sh` wrapper (a session and process-group leader). The
  wrapper joins the machine's cgroups, `cd`s to the workdir, runs the machine's argv in the
  foreground and, when it exits, writes the exit status to `<run_dir>/status/exit` (atomically)
  before exiting with the same status. It traps the usual stop signals with a no-op, so a signal
  sent to the process group reaches the machine while the wrapper survives to record the status.
  No Python process per machine: the wrapper costs a few hundred KiB of RSS.
- stdout and stderr go to one `machine.log` opened O_APPEND, so a machine never blocks on flyd.
  flyd bounds it by copy-truncate rotation (`rotate_logs`).
- A `Handle` (pid, process start time, boot id) identifies the wrapper across flyd restarts; a
  recycled pid or a reboot cannot pass for the machine. The driver also keeps the handle in the
  run dir, so `start` stays idempotent even if flyd dies before recording it.
- Exits are noticed without a thread per process: a pidfd per machine, watched by the event loop.
- A wrapper let go of before it was released (its flyd died) writes `held` as its exit status,
  so a later flyd tells "never ran" from "ran and exited".

Run dir layout (`<run_root>/<machine_id>/`): `handle.json`, `oom.base` (cgroup counters at start,
when the memory cgroup was not a new one), `machine.log[.N]` (owned by flyd) and `status/`
(writable by the machine's user; holds `exit`). `<run_root>/.spare/` holds run dirs made ahead
of need (and `.spare-*` cgroups sit beside the machines'), so a first start only renames them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import pwd
import re
import secrets
import select
import shlex
import shutil
import signal
import stat
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import structlog

from flyd.errors import (
    CorruptLog,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)

__all__ = [
    "Driver",
    "ExitStatus",
    "Handle",
    "Limits",
    "ProcessDriver",
    "ProcessSpec",
]

log = structlog.get_logger(__name__)

LOG_NAME = "machine.log"
# Signals a stop or a signal request commonly uses: the wrapper survives them (see module doc).
FORWARDED_SIGNALS = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
# Exit code of the wrapper when it could not set the machine up (join cgroups, cd): like
# `docker run`'s 125, distinct from the shell's 126 (not executable) and 127 (not found).
SETUP_FAILED_EXIT_CODE = 125
# Names the wrapper uses (its function and its variable): reserved in machine environments.
_WRAPPER_PREFIX = "__nonomad_"
_WRAPPER_VAR = "__nonomad_signal"
# Spare run dirs (under the run root) and cgroups (beside the machines'), made ahead of need.
_SPARE_DIR = ".spare"
_SPARE_CGROUP = ".spare-"
SPARES = 8
# What the exit file holds when the wrapper ended without being released.
_HELD = "held"

_MACHINE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_CONTROLLERS = ("memory", "cpu", "pids")
_CPU_PERIOD_US = 100_000
_CPU_MIN_QUOTA_US = 1_000  # the kernel refuses smaller quotas
_KILL_GRACE_S = 5.0  # after SIGKILL, how long the kernel may take before we call it stuck
_RMDIR_TIMEOUT_S = 2.0
_EXEC_WAIT_S = 1.0  # how long signal/stop wait for a just-started machine to be exec'd
_FOLLOW_MAX_READ = 1 << 20
_FOLLOW_MAX_LINE = 64 << 10


@dataclass(frozen=True)
class Limits:
    """Resources reserved for a machine: enforced with cgroups when `limits_enforced`."""

    cpu_millicores: int
    memory_mib: int
    pids: int = 1024


@dataclass(frozen=True)
class ProcessSpec:
    """What to run for a machine.

    `argv` is already resolved (entrypoint + cmd, or the override). `cwd` is an absolute host
    path (the image rootfs plus its workdir): the driver does not chroot.
    """

    machine_id: str
    argv: list[str]
    cwd: Path
    env: dict[str, str]
    limits: Limits


@dataclass(frozen=True)
class Handle:
    """Identifies a machine's wrapper process across flyd restarts; flyd stores it in its log.

    A pid alone is not an identity: pids are recycled. The start time (in clock ticks since
    boot, field 22 of /proc/<pid>/stat) and the boot id pin down one process.
    """

    pid: int
    start_time: int
    boot_id: str

    def to_dict(self) -> dict[str, int | str]:
        """The JSON-ready form `from_dict` reads back."""
        return {"pid": self.pid, "start_time": self.start_time, "boot_id": self.boot_id}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Handle:
        """Reads `to_dict`'s form; anything else is a `CorruptLog`, never a guess."""
        pid, start_time, boot_id = data.get("pid"), data.get("start_time"), data.get("boot_id")
        if (
            not isinstance(pid, int)
            or not isinstance(start_time, int)
            or not isinstance(boot_id, str)
            or pid <= 0
        ):
            raise CorruptLog(f"not a process handle: {data!r}")
        return cls(pid=pid, start_time=start_time, boot_id=boot_id)


@dataclass(frozen=True)
class ExitStatus:
    """How a machine's process ended: exactly one of `exit_code` and `signal` is set."""

    exit_code: int | None
    signal: int | None
    oom_killed: bool = False
    # False: the process was held and never released, so it ran nothing of the machine's.
    released: bool = True

    def __post_init__(self) -> None:
        if (self.exit_code is None) == (self.signal is None):
            raise ValueError("exactly one of exit_code and signal must be set")

    def describe(self) -> str:
        """A phrase for humans: "exited with code 3", "killed by SIGKILL (out of memory)"."""
        if not self.released:
            return "ended before it was released"
        if self.exit_code is not None:
            text = f"exited with code {self.exit_code}"
        else:
            assert self.signal is not None
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = f"signal {self.signal}"
            text = f"killed by {name}"
        return text + " (out of memory)" if self.oom_killed else text


class Driver(Protocol):
    """What flyd needs from a process driver: `ProcessDriver`, or `flyd.fakes.FakeDriver`."""

    limits_enforced: bool

    async def start(self, spec: ProcessSpec) -> Handle: ...
    def release(self, machine_id: str) -> None: ...
    def discard(self, machine_id: str) -> None: ...
    def attach(self, machine_id: str, handle: Handle) -> bool: ...
    def is_running(self, machine_id: str) -> bool: ...
    async def signal(self, machine_id: str, sig: int) -> None: ...
    async def stop(self, machine_id: str, sig: int, timeout: float) -> ExitStatus: ...
    def last_exit(self, machine_id: str) -> ExitStatus | None: ...
    async def cleanup(self, machine_id: str) -> None: ...
    def rotate_logs(self) -> None: ...
    def read_logs(self, machine_id: str, tail_lines: int) -> list[str]: ...
    def follow_logs(
        self,
        machine_id: str,
        *,
        shutdown: asyncio.Event,
        poll_interval: float = 0.1,
        from_offset: int | None = None,
    ) -> AsyncIterator[str]: ...
    async def close(self) -> None: ...


# Popen objects of machines still running when their driver closed. Dropping a running Popen
# warns (ResourceWarning); keeping it costs nothing, and a later driver in the same process
# reaps the exit through its pidfd. Pruned on every start.
_detached_children: list[subprocess.Popen[bytes]] = []


@dataclass(frozen=True)
class _Rotation:
    """The last rotation of a log: machine.log.1 holds bytes [copied_from, copied_to) of it."""

    generation: int
    copied_from: int
    copied_to: int


_NO_ROTATION = _Rotation(0, 0, 0)


@dataclass
class _LogCursor:
    """Where a follower is: an offset in the log as of rotation `generation`."""

    path: Path
    offset: int
    generation: int


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


class _Spares:
    """Run dirs and cgroups made ahead of need, so a machine's first start renames a set into
    place instead of making five directories while its caller waits (each a journalled or
    cgroup-locked operation that takes long on a busy host).

    A worker thread makes them, up to `SPARES` at a time. Their names say which run root they
    belong to, so a driver on the same run root removes what a dead one left (in that thread,
    before it makes any: not while flyd starts); `close` removes the rest. Taking one is a
    rename, which fails harmlessly onto anything that exists.
    """

    def __init__(
        self,
        run_root: Path,
        cgroup_parents: list[Path],
        user: tuple[int, int, list[int]] | None,
    ) -> None:
        self._root = run_root / _SPARE_DIR
        self._cgroup_parents = cgroup_parents  # one per controller, in _CONTROLLERS order
        self._user = user
        self._tag = hashlib.blake2s(str(run_root).encode(), digest_size=4).hexdigest()
        self._ready: collections.deque[str] = collections.deque()
        self._making: asyncio.Future[None] | None = None
        # Set here, cleared by the thread as it ends: back-to-back starts that never yield to
        # the event loop (which would run the future's callbacks) must still see it is done.
        self._busy = False
        self._closed = False
        self._swept = False  # what a driver on this run root left when it died is gone

    def take(self, run_dir: Path, cgroups: list[Path]) -> list[bool] | None:
        """Move a spare set to `run_dir` and `cgroups`; None if none was ready (or `run_dir`
        exists). Else, per cgroup, whether it is a new one (False: it existed, left as it was).
        """
        self._refill()
        if not self._ready:
            return None
        token = self._ready.popleft()
        try:
            os.rename(self._root / token, run_dir)
        except OSError:
            self._ready.appendleft(token)  # the machine has a run dir: not a first start
            return None
        fresh = []
        for parent, cg in zip(self._cgroup_parents, cgroups, strict=True):
            spare = parent / f"{_SPARE_CGROUP}{self._tag}-{token}"
            try:
                os.rename(spare, cg)
                fresh.append(True)
            except OSError:
                with contextlib.suppress(OSError):
                    spare.rmdir()
                fresh.append(False)
        self._refill()
        return fresh

    def _refill(self) -> None:
        if self._closed or self._busy or len(self._ready) >= SPARES:
            return
        self._busy = True
        loop = asyncio.get_running_loop()
        self._making = loop.run_in_executor(None, self._make, SPARES - len(self._ready))
        self._making.add_done_callback(self._made)

    def _made(self, future: asyncio.Future[None]) -> None:
        if not future.cancelled() and future.exception() is not None:
            log.warning("spare_run_dirs_failed", error=str(future.exception()))
            return  # the next start tries again
        self._refill()  # some were taken meanwhile

    def _make(self, count: int) -> None:
        """In a worker thread: make `count` spare sets."""
        try:
            if not self._swept:
                self._remove_all()
                self._swept = True
            self._root.mkdir(mode=0o755, exist_ok=True)
            for _ in range(count):
                if self._closed:
                    return
                token = secrets.token_hex(6)
                run_dir = self._root / token
                os.mkdir(run_dir, 0o755)
                os.mkdir(run_dir / "status", 0o700)
                if self._user is not None:
                    os.chown(run_dir / "status", self._user[0], self._user[1])
                for parent in self._cgroup_parents:
                    os.mkdir(parent / f"{_SPARE_CGROUP}{self._tag}-{token}", 0o755)
                self._ready.append(token)
        finally:
            self._busy = False

    async def close(self) -> None:
        self._closed = True
        if self._making is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._making)
        self._remove_all()

    def _remove_all(self) -> None:
        self._ready.clear()
        shutil.rmtree(self._root, ignore_errors=True)
        ours = f"{_SPARE_CGROUP}{self._tag}-"
        for parent in self._cgroup_parents:
            with contextlib.suppress(OSError), os.scandir(parent) as entries:
                for entry in entries:
                    if entry.name.startswith(ours):
                        with contextlib.suppress(OSError):
                            os.rmdir(entry.path)


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
        self._run_root = run_root.absolute()
        self._on_exit = on_exit
        self._cgroup_root = cgroup_root
        self._cgroup_prefix = cgroup_prefix
        self._max_log_bytes = max_log_bytes
        self._log_backups = log_backups
        self._sleep = sleep
        self._watched: dict[str, _Watched] = {}
        # The last handle whose exit was reported per machine: on_exit fires once per exit.
        self._reported: dict[str, Handle] = {}
        # The last rotation of each log, so followers can catch up from machine.log.1.
        self._rotations: dict[Path, _Rotation] = {}
        self._closed = False
        self._boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        self._mv = shutil.which("mv") or "/bin/mv"

        self._user: tuple[int, int, list[int]] | None = None
        if run_as is not None:
            self._user = _resolve_user(run_as)
        self._run_root.mkdir(parents=True, exist_ok=True)
        if self._user is not None:
            _check_traversable(self._run_root, *self._user)

        self.limits_problem = self._probe_cgroups()
        self.limits_enforced = self.limits_problem is None
        # Whether the kernel accounts swap (memory.memsw.*): then memory+swap is limited too.
        self._memsw = (
            self.limits_enforced
            and (cgroup_root / "memory" / cgroup_prefix / "memory.memsw.limit_in_bytes").is_file()
        )
        if self.limits_problem is not None:
            log.warning(
                "cgroup_limits_not_enforced",
                reason=self.limits_problem,
                message=f"cgroup limits are not enforced: {self.limits_problem}",
            )
        self._spares = _Spares(
            self._run_root,
            [cgroup_root / c / cgroup_prefix for c in _CONTROLLERS] if self.limits_enforced else [],
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
        previous = self._read_handle_file(mid)
        if previous is not None:
            self._kill_unreleased(previous)

        _prune_detached_children()
        run_dir = self._run_dir(mid)
        status_dir = run_dir / "status"
        cgroups = self._cgroup_dirs(mid) if self.limits_enforced else []
        try:
            # A first start takes a spare run dir and cgroups; a new run dir has no stale files.
            new_cgroups = self._spares.take(run_dir, cgroups)
            fresh = new_cgroups is not None
            if not fresh:
                fresh = _mkdir_new(run_dir, 0o755)
                if fresh or not status_dir.is_dir():
                    status_dir.mkdir(mode=0o700, exist_ok=True)
                if self._user is not None:
                    os.chown(status_dir, self._user[0], self._user[1])
            if not fresh:
                for stale in (status_dir / "exit", status_dir / "exit.tmp", run_dir / "exit"):
                    with contextlib.suppress(FileNotFoundError):
                        stale.unlink()
            cgroup_procs = (
                self._setup_cgroups(mid, spec.limits, fresh, new_cgroups)
                if self.limits_enforced
                else []
            )
            log_fd = os.open(
                run_dir / LOG_NAME,
                os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                0o640,
            )
        except OSError as e:
            raise Unavailable(f"cannot prepare machine {mid}: {e}") from e

        script = _wrapper_script(status_dir, spec.cwd, spec.env, cgroup_procs, self._mv)
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
        proc = _read_proc_stat(popen.pid)
        assert proc is not None, "an unreaped child always has a /proc entry"
        handle = Handle(pid=popen.pid, start_time=proc.start_time, boot_id=self._boot_id)
        # Not written atomically: an empty or torn file (flyd died mid-write) reads as no
        # handle, and the process it would name is held and exits on its own when flyd dies.
        _write_file(run_dir / "handle.json", json.dumps(handle.to_dict()).encode())
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
        pidfd = self._open_pidfd(handle)
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
        pidfd = self._open_pidfd(handle)
        if pidfd is not None:
            w = self._watch(loop, machine_id, handle, pidfd, popen=None)
            if not _readable(pidfd):
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
        if a cgroup stays busy.
        """
        self._check_open()
        _validate_machine_id(machine_id)
        if machine_id in self._watched:
            raise FailedPrecondition(f"machine {machine_id} is running; stop it first")
        if self.limits_enforced:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + _RMDIR_TIMEOUT_S
            for cg in self._cgroup_dirs(machine_id):
                while True:
                    self._kill_cgroup(machine_id)
                    try:
                        cg.rmdir()
                        break
                    except FileNotFoundError:
                        break
                    except OSError as e:
                        # EBUSY until the killed processes are fully gone.
                        if e.errno != errno.EBUSY or loop.time() > deadline:
                            raise Unavailable(f"cannot remove cgroup {cg}: {e}") from e
                    await self._sleep(0.01)
        shutil.rmtree(self._run_dir(machine_id), ignore_errors=True)
        self._reported.pop(machine_id, None)
        self._rotations.pop(self._run_dir(machine_id) / LOG_NAME, None)

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
        """Copy-truncate every machine log larger than `max_log_bytes`.

        The log moves to `machine.log.1` (at most its last `max_log_bytes`, from a line start),
        older copies shift up to `log_backups`. Lines a machine writes between the copy and the
        truncate are lost, the usual price of copy-truncate; machines never notice rotation.
        """
        try:
            run_dirs = list(self._run_root.iterdir())
        except FileNotFoundError:
            return
        for run_dir in run_dirs:
            if run_dir.name.startswith("."):  # spares
                continue
            try:
                self._rotate(run_dir / LOG_NAME)
            except OSError as e:
                log.warning("log_rotation_failed", path=str(run_dir / LOG_NAME), error=str(e))

    def read_logs(self, machine_id: str, tail_lines: int) -> list[str]:
        """The last `tail_lines` lines of the machine's output, across rotated files."""
        if tail_lines < 0:
            raise InvalidArgument("tail_lines", "must not be negative")
        run_dir = self._existing_run_dir(machine_id)
        if tail_lines == 0:
            return []
        base = run_dir / LOG_NAME
        newest_first = [base] + [Path(f"{base}.{k}") for k in range(1, self._log_backups + 1)]
        chunks: list[bytes] = []  # newest last once reversed
        newlines = 0
        for path in newest_first:
            try:
                with open(path, "rb") as f:
                    end = f.seek(0, os.SEEK_END)
                    while end > 0 and newlines <= tail_lines:
                        start = max(0, end - 65536)
                        f.seek(start)
                        chunk = f.read(end - start)
                        chunks.append(chunk)
                        newlines += chunk.count(b"\n")
                        end = start
            except FileNotFoundError:
                continue
            if newlines > tail_lines:
                break
        data = b"".join(reversed(chunks))
        lines = data.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        return [line.decode("utf-8", "replace") for line in lines[-tail_lines:]]

    def follow_logs(
        self,
        machine_id: str,
        *,
        shutdown: asyncio.Event,
        poll_interval: float = 0.1,
        from_offset: int | None = None,
    ) -> AsyncIterator[str]:
        """Yield the machine's output lines as they are written, until `shutdown` is set.

        Starts at `from_offset` in the current `machine.log` (default: its end, so only new
        lines) and polls every `poll_interval` seconds (on the injected sleep). Across a
        rotation by this driver it picks up what it had not read yet from `machine.log.1`;
        after several rotations between two polls, or one by another driver, it goes on from
        the start of the truncated log, and lines in between are missed (as with `tail -F`).
        Ends when the run dir is removed.
        """
        run_dir = self._existing_run_dir(machine_id)
        if poll_interval <= 0:
            raise InvalidArgument("poll_interval", "must be positive")
        if from_offset is not None and from_offset < 0:
            raise InvalidArgument("from_offset", "must not be negative")
        path = run_dir / LOG_NAME
        if from_offset is None:
            try:
                from_offset = path.stat().st_size
            except FileNotFoundError:
                from_offset = 0
        cursor = _LogCursor(path, from_offset, self._rotations.get(path, _NO_ROTATION).generation)
        return self._follow(cursor, shutdown, poll_interval)

    async def _follow(
        self, cursor: _LogCursor, shutdown: asyncio.Event, poll_interval: float
    ) -> AsyncIterator[str]:
        pending = b""
        while not shutdown.is_set():
            chunk = self._read_more(cursor)
            if chunk is None:
                return  # the machine was cleaned up
            data, gap = chunk
            if gap and pending:  # the rest of that line is lost: do not glue it to another
                yield pending.decode("utf-8", "replace")
                pending = b""
            pending += data
            *lines, pending = pending.split(b"\n")
            if len(pending) > _FOLLOW_MAX_LINE:  # no newline in sight: do not buffer forever
                lines.append(pending)
                pending = b""
            for line in lines:
                yield line.decode("utf-8", "replace")
            if len(data) < _FOLLOW_MAX_READ:
                await self._sleep(poll_interval)

    def _read_more(self, cursor: _LogCursor) -> tuple[bytes, bool] | None:
        """New bytes of the log after `cursor` (which it advances) and whether some were lost.

        None when the run dir is gone.
        """
        data, gap = b"", False
        rotation = self._rotations.get(cursor.path, _NO_ROTATION)
        if rotation.generation != cursor.generation:
            recoverable = (
                rotation.generation == cursor.generation + 1
                and rotation.copied_to > 0  # zero: no backups kept
                and rotation.copied_from <= cursor.offset <= rotation.copied_to
            )
            if recoverable:
                data = _read_range(
                    Path(f"{cursor.path}.1"),
                    cursor.offset - rotation.copied_from,
                    rotation.copied_to - rotation.copied_from,
                )
            gap = not recoverable
            cursor.generation, cursor.offset = rotation.generation, 0
        try:
            with open(cursor.path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                if size < cursor.offset:  # truncated by someone else
                    gap, cursor.offset = True, 0
                f.seek(cursor.offset)
                more = f.read(min(size - cursor.offset, _FOLLOW_MAX_READ))
        except FileNotFoundError:
            if not cursor.path.parent.exists():
                return None
            more = b""
        cursor.offset += len(more)
        return data + more, gap

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
        ours = w.popen is not None or _unreaped_child(w.pidfd)
        if ours:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.handle.pid, signal.SIGKILL)
        self._kill_cgroup(w.machine_id)
        fallback: ExitStatus | None = None
        if w.popen is not None:
            code = w.popen.poll()
            if code is not None:
                fallback = _from_wait_status(code)
        elif ours:
            with contextlib.suppress(ChildProcessError):
                result = os.waitid(os.P_PIDFD, w.pidfd, os.WEXITED | os.WNOHANG)
                if result is not None:
                    fallback = _from_waitid(result)
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
            fd = _open_child_pidfd(w.handle.pid)
            if fd is not None or w.done or _readable(w.pidfd) or loop.time() >= deadline:
                return fd
            await self._sleep(0.002)

    def _open_pidfd(self, handle: Handle) -> int | None:
        """A pidfd for the handle's process if it is still that process, else None."""
        if handle.boot_id != self._boot_id:
            return None
        try:
            pidfd = os.pidfd_open(handle.pid)
        except ProcessLookupError:
            return None
        # Checked after opening: the pidfd now pins the process the start time belongs to.
        proc = _read_proc_stat(handle.pid)
        if proc is None or proc.start_time != handle.start_time:
            os.close(pidfd)
            return None
        return pidfd

    def _killpg(self, w: _Watched, sig: int) -> None:
        # An exited wrapper may already be reaped (by init after a restart): its pid is free.
        if w.done or _readable(w.pidfd):
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

    # -- internals: files --------------------------------------------------------------------

    def _run_dir(self, machine_id: str) -> Path:
        _validate_machine_id(machine_id)
        return self._run_root / machine_id

    def _existing_run_dir(self, machine_id: str) -> Path:
        run_dir = self._run_dir(machine_id)
        if not run_dir.is_dir():
            raise NotFound(f"machine {machine_id} has no process state on this worker")
        return run_dir

    def _read_handle_file(self, machine_id: str) -> Handle | None:
        try:
            data = json.loads((self._run_dir(machine_id) / "handle.json").read_bytes())
            return Handle.from_dict(data)
        except (OSError, ValueError, CorruptLog):
            return None

    def _status_from_files(
        self, machine_id: str, fallback: ExitStatus | None, killed_by_us: bool
    ) -> ExitStatus | None:
        """The recorded exit status (else `fallback`, then recorded), with the OOM verdict.

        The wrapper's record is `status/exit`. When the wrapper could not write one (killed by
        SIGKILL, or by a signal before its traps were set) the driver records what it learnt
        in `exit`, so the status survives a flyd restart.
        """
        run_dir = self._run_dir(machine_id)
        status = _read_exit_file(run_dir / "status" / "exit") or _read_exit_file(run_dir / "exit")
        if status is None and fallback is not None and run_dir.is_dir():
            status = fallback
            code = status.exit_code if status.signal is None else 128 + status.signal
            _write_atomic(run_dir / "exit", f"{code}\n".encode())
        if status is None:
            return None
        if self._oom_killed(machine_id, status, killed_by_us):
            return ExitStatus(status.exit_code, status.signal, oom_killed=True)
        return status

    def _rotate(self, log_path: Path) -> None:
        try:
            st = os.lstat(log_path)
        except FileNotFoundError:
            return
        if not stat.S_ISREG(st.st_mode) or st.st_size <= self._max_log_bytes:
            return
        copied_from = copied_to = 0
        if self._log_backups > 0:
            for k in range(self._log_backups, 1, -1):
                with contextlib.suppress(FileNotFoundError):
                    os.replace(f"{log_path}.{k - 1}", f"{log_path}.{k}")
            tmp = Path(f"{log_path}.1.tmp")
            with open(log_path, "rb") as src, open(tmp, "wb") as dst:
                copied_to = src.seek(0, os.SEEK_END)
                copied_from = max(0, copied_to - self._max_log_bytes)
                if copied_from > 0:
                    # Start at a line start: read one byte early, drop up to the first newline.
                    src.seek(copied_from - 1)
                    data = src.read(copied_to - copied_from + 1)
                    cut = data.find(b"\n") + 1 or len(data)
                    data, copied_from = data[cut:], copied_from - 1 + cut
                else:
                    src.seek(0)
                    data = src.read(copied_to)
                dst.write(data)
            os.replace(tmp, f"{log_path}.1")
        os.truncate(log_path, 0)
        generation = self._rotations.get(log_path, _NO_ROTATION).generation + 1
        self._rotations[log_path] = _Rotation(generation, copied_from, copied_to)

    # -- internals: cgroups ------------------------------------------------------------------

    def _probe_cgroups(self) -> str | None:
        """None if the v1 memory, cpu and pids controllers are usable, else why not."""
        needs = {
            "memory": ("memory.limit_in_bytes", "memory.oom_control", "memory.failcnt"),
            "cpu": ("cpu.cfs_period_us", "cpu.cfs_quota_us"),
            "pids": ("pids.max",),
        }
        for controller, files in needs.items():
            mount = self._cgroup_root / controller
            if not (mount / "cgroup.procs").is_file():
                return f"no cgroup v1 {controller} controller mounted at {mount}"
            parent = mount / self._cgroup_prefix
            try:
                parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                return f"cannot create {parent}: {e.strerror}"
            missing = [name for name in files if not (parent / name).is_file()]
            if missing:
                return f"{parent} has no {', '.join(missing)}"
            if not os.access(parent, os.W_OK) or not os.access(parent / files[0], os.W_OK):
                return f"{parent} is not writable"
        return None

    def _cgroup_dirs(self, machine_id: str) -> list[Path]:
        return [self._cgroup_root / c / self._cgroup_prefix / machine_id for c in _CONTROLLERS]

    def _setup_cgroups(
        self, machine_id: str, limits: Limits, fresh_run_dir: bool, new: list[bool] | None
    ) -> list[Path]:
        """Create (or reuse) the machine's cgroups with `limits`; returns their cgroup.procs.

        `new`: which of them were just put in place from spares (None: none were).
        """
        memory, cpu, pids = self._cgroup_dirs(machine_id)
        created = [
            (new is not None and new[i]) or _mkdir_new(cg, 0o755)
            for i, cg in enumerate((memory, cpu, pids))
        ]
        if not all(created):
            self._kill_cgroup(machine_id)  # leftovers of a previous run, if flyd missed its end
        _set_memory_limit(memory, limits.memory_mib << 20, memsw=self._memsw)
        if not created[1]:  # a new cgroup has the kernel's default period, which is ours
            _write(cpu / "cpu.cfs_period_us", _CPU_PERIOD_US)
        _write(cpu / "cpu.cfs_quota_us", max(_CPU_MIN_QUOTA_US, limits.cpu_millicores * 100))
        _write(pids / "pids.max", limits.pids)
        # Counters outlive a run: keep their value at start so an exit can be judged on its own.
        # A new memory cgroup counts from zero, which is what a missing oom.base means.
        oom_base = self._run_dir(machine_id) / "oom.base"
        if not created[0]:
            oom_kill = _read_oom_kill(memory) or 0
            failcnt = int((memory / "memory.failcnt").read_text())
            _write_atomic(oom_base, f"{oom_kill} {failcnt}\n".encode())
        elif not fresh_run_dir:
            with contextlib.suppress(FileNotFoundError):
                oom_base.unlink()
        procs = [cg / "cgroup.procs" for cg in (memory, cpu, pids)]
        if self._user is not None:
            for p in procs:  # the wrapper joins as the machine's user
                os.chown(p, self._user[0], -1)
        return procs

    def _kill_cgroup(self, machine_id: str) -> None:
        """SIGKILL every process in the machine's cgroups (a few rounds, to catch forks)."""
        if not self.limits_enforced:
            return
        for _ in range(5):
            pids: set[int] = set()
            for cg in self._cgroup_dirs(machine_id):
                with contextlib.suppress(OSError, ValueError):
                    pids.update(int(p) for p in (cg / "cgroup.procs").read_text().split())
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def _oom_killed(self, machine_id: str, status: ExitStatus, killed_by_us: bool) -> bool:
        if not self.limits_enforced:
            return False
        memory = self._cgroup_dirs(machine_id)[0]
        try:
            try:
                base = (self._run_dir(machine_id) / "oom.base").read_text()
            except FileNotFoundError:
                base = "0 0"  # the run started in a new memory cgroup (see _setup_cgroups)
            base_oom, base_failcnt = (int(v) for v in base.split())
            oom_kill = _read_oom_kill(memory)
            if oom_kill is not None:
                return oom_kill > base_oom
            # Older kernels do not count OOM kills: hitting the limit plus a SIGKILL we did not
            # send is the best evidence left.
            failcnt = int((memory / "memory.failcnt").read_text())
        except (OSError, ValueError):
            return False
        return failcnt > base_failcnt and status.signal == signal.SIGKILL and not killed_by_us


# -- helpers ---------------------------------------------------------------------------------


def _wrapper_script(
    status_dir: Path, cwd: Path, env: dict[str, str], cgroup_procs: list[Path], mv: str
) -> str:
    """The sh program every machine runs under; the machine's argv follows as "$@".

    Traps do not use '': ignored dispositions would be inherited by the machine. The machine
    runs in the foreground (in a non-interactive sh, `&` would make it ignore SIGINT and
    SIGQUIT). A trapped signal arriving meanwhile reaches the machine through the process
    group; the trap runs only after the machine exits, and `$?` is then the machine's own
    status (128+signo if a signal killed it). A signal that arrives before the machine is
    started ends the wrapper as if it had killed the machine, so a stop right after a start is
    not lost. Its one variable is unset first, so it is never exported to the machine.
    """
    q = shlex.quote
    tmp, final = q(str(status_dir / "exit.tmp")), q(str(status_dir / "exit"))
    lines = [f"unset {_WRAPPER_VAR}"]
    lines += [
        f"trap '{_WRAPPER_VAR}={int(s)}' {s.name.removeprefix('SIG')}" for s in FORWARDED_SIGNALS
    ]
    lines += [
        "__nonomad_record() {",
        f"  {{ printf '%s\\n' \"$1\" > {tmp} && {q(mv)} -f {tmp} {final}; }} ||",
        f"    printf '%s\\n' \"$1\" > {final}",
        "}",
        "__nonomad_exit() {",
        '  __nonomad_record "$1"',
        '  exit "$1"',
        "}",
    ]
    lines += [
        f"echo $$ > {q(str(p))} || __nonomad_exit {SETUP_FAILED_EXIT_CODE}" for p in cgroup_procs
    ]
    lines.append(f"cd {q(str(cwd))} || __nonomad_exit {SETUP_FAILED_EXIT_CODE}")
    # `cd` exported these; the machine gets exactly the environment flyd passed.
    lines += [f"unset {name}" for name in ("PWD", "OLDPWD") if name not in env]
    # Held until flyd has recorded the handle: EOF (flyd died first) means never run, and the
    # exit file says so ("held"), so a later flyd knows this process ran nothing.
    lines += [
        f"IFS= read -r {_WRAPPER_PREFIX}go || {{ __nonomad_record {_HELD}; "
        f"exit {SETUP_FAILED_EXIT_CODE}; }}",
        f"unset {_WRAPPER_PREFIX}go",
        "exec </dev/null",
    ]
    lines += [
        f'[ -z "${{{_WRAPPER_VAR}-}}" ] || __nonomad_exit $((128 + {_WRAPPER_VAR}))',
        'command "$@"',  # `command`: never our function, whatever argv[0] is
        "__nonomad_exit $?",
    ]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class _ProcStat:
    state: str
    ppid: int
    start_time: int


def _read_proc_stat(pid: int) -> _ProcStat | None:
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # comm (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = data[data.rindex(b")") + 2 :].split()
    return _ProcStat(state=fields[0].decode(), ppid=int(fields[1]), start_time=int(fields[19]))


def _open_child_pidfd(wrapper_pid: int) -> int | None:
    """A pidfd for the wrapper's child (the machine's main process) once it is exec'd, or None.

    Until its exec the child is a copy of the wrapper, with the same command line.
    """
    try:
        children = Path(f"/proc/{wrapper_pid}/task/{wrapper_pid}/children").read_text().split()
        wrapper_cmdline = Path(f"/proc/{wrapper_pid}/cmdline").read_bytes()
    except OSError:
        return None
    for child in children:
        try:
            fd = os.pidfd_open(int(child))
        except ProcessLookupError:
            continue
        # Checked after the open, which pins the process: the pid may have been recycled.
        proc = _read_proc_stat(int(child))
        try:
            execd = Path(f"/proc/{child}/cmdline").read_bytes() != wrapper_cmdline
        except OSError:
            execd = False
        if proc is not None and proc.ppid == wrapper_pid and execd:
            return fd
        os.close(fd)
    return None


def _read_exit_file(path: Path) -> ExitStatus | None:
    try:
        # O_NOFOLLOW: the status dir is writable by the machine's user.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            text = f.read(32).strip()
        if text == _HELD.encode():
            return ExitStatus(exit_code=SETUP_FAILED_EXIT_CODE, signal=None, released=False)
        return _from_shell_status(int(text))
    except (OSError, ValueError):
        return None


def _read_range(path: Path, start: int, end: int) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(max(0, end - start))
    except FileNotFoundError:
        return b""


def _unreaped_child(pidfd: int) -> bool:
    """Whether the pidfd's process is our child, exited and not reaped yet."""
    try:
        flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
        return os.waitid(os.P_PIDFD, pidfd, flags) is not None
    except ChildProcessError:
        return False


def _readable(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def _from_shell_status(code: int) -> ExitStatus:
    # sh reports a death by signal N as 128+N; an explicit `exit 137` looks the same (as with
    # Docker), which is the price of a shell wrapper.
    if 128 < code <= 128 + signal.SIGRTMAX:
        return ExitStatus(exit_code=None, signal=code - 128)
    return ExitStatus(exit_code=code, signal=None)


def _from_wait_status(returncode: int) -> ExitStatus:
    """From Popen's returncode: negative for a signal death (of the wrapper itself)."""
    if returncode < 0:
        return ExitStatus(exit_code=None, signal=-returncode)
    return _from_shell_status(returncode)


def _from_waitid(result: os.waitid_result) -> ExitStatus:
    if result.si_code == os.CLD_EXITED:
        return _from_shell_status(result.si_status)
    return ExitStatus(exit_code=None, signal=result.si_status)


def _prune_detached_children() -> None:
    _detached_children[:] = [p for p in _detached_children if p.poll() is None]


def _read_oom_kill(memory_cgroup: Path) -> int | None:
    for line in (memory_cgroup / "memory.oom_control").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return None


def _set_memory_limit(memory_cgroup: Path, limit: int, *, memsw: bool) -> None:
    """Set the memory limit, and memory+swap to the same where the kernel accounts swap."""
    memsw_path = memory_cgroup / "memory.memsw.limit_in_bytes"
    try:
        _write(memory_cgroup / "memory.limit_in_bytes", limit)
    except OSError as e:
        # The memory limit may not exceed memory+swap: raise that one first.
        if e.errno != errno.EINVAL or not memsw:
            raise
        _write(memsw_path, limit)
        _write(memory_cgroup / "memory.limit_in_bytes", limit)
    if memsw:
        try:  # no swap beyond the limit either, where the kernel accounts for swap
            _write(memsw_path, limit)
        except OSError as e:
            log.debug("memsw_limit_not_set", cgroup=str(memory_cgroup), error=str(e))


def _write(path: Path, value: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, b"%d\n" % value)
    finally:
        os.close(fd)


def _mkdir_new(path: Path, mode: int) -> bool:
    """Create the directory; False if it already existed."""
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        return False
    return True


def _write_file(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _resolve_user(name: str) -> tuple[int, int, list[int]]:
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise InvalidArgument("run_as", f"no user named {name!r}") from None
    if os.geteuid() != 0:
        raise InvalidArgument("run_as", "running machines as another user needs root")
    return entry.pw_uid, entry.pw_gid, os.getgrouplist(name, entry.pw_gid)


def _check_traversable(path: Path, uid: int, gid: int, groups: list[int]) -> None:
    """The wrapper writes its exit file under `path` as `uid`: every ancestor must let it in."""
    for directory in [path, *path.parents]:
        st = directory.stat()
        if st.st_uid == uid:
            bit = stat.S_IXUSR
        elif st.st_gid == gid or st.st_gid in groups:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not st.st_mode & bit:
            raise InvalidArgument(
                "run_root", f"{directory} is not searchable by uid {uid} (machines run as it)"
            )


def _validate_machine_id(machine_id: str) -> None:
    if not _MACHINE_ID.fullmatch(machine_id) or machine_id in (".", ".."):
        raise InvalidArgument("machine_id", f"{machine_id!r} is not a valid machine id")


def _validate_signal(sig: int) -> int:
    try:
        return int(signal.Signals(sig))
    except ValueError:
        raise InvalidArgument("signal", f"{sig} is not a signal") from None


def _validate_spec(spec: ProcessSpec) -> None:
    _validate_machine_id(spec.machine_id)
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
        if key.startswith(_WRAPPER_PREFIX):
            raise InvalidArgument("env", f"{key!r}: names starting {_WRAPPER_PREFIX} are reserved")
    limits = spec.limits
    for name in ("cpu_millicores", "memory_mib", "pids"):
        if getattr(limits, name) <= 0:
            raise InvalidArgument(f"limits.{name}", "must be positive")


# ProcessDriver keeps the contract flyd is written against (checked by mypy).
_: type[Driver] = ProcessDriver


def kill_all(run_root: Path) -> int:
    """SIGKILL every machine process tree recorded under a driver's run root.

    For tearing down a whole worker (a local cluster, a test) when flyd can no longer be asked
    to. Handles are checked against /proc, so a recycled pid is left alone. Returns how many
    machines were killed.
    """
    killed = 0
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    for handle_file in run_root.glob("*/handle.json"):
        try:
            handle = Handle.from_dict(json.loads(handle_file.read_bytes()))
        except (OSError, ValueError, CorruptLog):
            continue
        proc = _read_proc_stat(handle.pid)
        if handle.boot_id != boot_id or proc is None or proc.start_time != handle.start_time:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.killpg(handle.pid, signal.SIGKILL)
            killed += 1
    return killed
