"""The process driver: runs each machine as a host process group under cgroup v1 limits.

For hosts without crun: no namespaces, no rootfs of its own. The machine's command runs in the
image's unpacked rootfs as its working directory, as flyd's user (or `run_as`), on the host's
network: its services bind their host ports themselves. What it shares with the OCI driver
(wrapper, held starts, re-attaching, exits, cgroups, logs, spares, held ports) is
`flyd.drivers.wrapped`; this module adds how a machine starts and how it is signalled:

- the wrapper runs the machine's argv in the foreground after the hold, so it is the
  wrapper's child; the usual stop signals reach it through the process group while the
  wrapper survives them to record the status (see `flyd.drivers.wrapper`);
- the machine's published host ports are held by flyd while it is not running (a stopped
  standby's port cannot be taken by anyone) and let go of just before it starts, since the
  machine binds them itself: between that and its bind the port is free, a window only a
  namespace of its own (the OCI driver) closes;
- its disk is not limited (`disk_limited` False, so its worker carries no `nonomad.disk`
  label and `nonomad machines run` says so): it writes to the host's filesystem, wherever its
  user may, and its working directory is the image's rootfs, shared by every machine of the
  image. `guest.disk_mib` is reserved all the same. A filesystem of its own under its working
  directory would bound what it writes there and nothing else (/tmp, its user's home), so it
  is not offered as a limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path

import structlog

from flyd.drivers.base import Driver, ExitStatus, Handle, ProcessSpec, port_env
from flyd.drivers.procfs import open_child_pidfd, read_proc_stat, readable, signal_and_close
from flyd.drivers.wrapped import Watched, WrappedDriver, resolve_user
from flyd.drivers.wrapper import FORWARDED_SIGNALS, wrapper_script
from flyd.images import confine
from model.errors import InvalidArgument, Unavailable, UnsafeImage

__all__ = ["ProcessDriver"]

log = structlog.get_logger(__name__)

_EXEC_WAIT_S = 1.0  # how long signal/stop wait for a just-started machine to be exec'd


class ProcessDriver(WrappedDriver):
    """Runs machines as host processes; see the module docstring for the design."""

    name = "process"

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
        machine_host: str = "127.0.0.1",
    ) -> None:
        super().__init__(
            run_root,
            on_exit=on_exit,
            cgroup_root=cgroup_root,
            cgroup_prefix=cgroup_prefix,
            user=resolve_user(run_as) if run_as is not None else None,
            max_log_bytes=max_log_bytes,
            log_backups=log_backups,
            sleep=sleep,
            machine_host=machine_host,
        )
        self._mv = shutil.which("mv") or "/bin/mv"
        ignored = [s.name for s in FORWARDED_SIGNALS if signal.getsignal(s) == signal.SIG_IGN]
        if ignored:
            # Ignored dispositions survive exec and a non-interactive sh cannot reset them.
            log.warning("machines_inherit_ignored_signals", signals=ignored)

    async def start(self, spec: ProcessSpec) -> Handle:
        """Create the machine's process, held before it runs anything; `release` lets it run.

        The hold lets flyd commit the handle before the machine's command runs. A held process
        whose flyd dies reads EOF from the hold pipe and exits without running anything, so a
        crash between start and release can never leave an unrecorded machine running. Returns
        the handle of the process already watched for the machine, if any. Raises
        `InvalidArgument` for a bad spec and `Unavailable` when the host cannot start it now.
        """
        running = self._begin_start(spec)
        if running is not None:
            return running
        mid = spec.machine_id
        # No chroot: paths of the image are resolved inside its rootfs, and a machine the
        # host would lead elsewhere is refused (UnsafeImage: the start fails).
        cwd = confine.host_path(spec.rootfs, spec.workdir, "WorkingDir")
        if not cwd.is_dir():
            raise InvalidArgument("workdir", f"{spec.workdir} is not a directory of the image")
        argv = list(spec.argv)
        search_path = spec.env.get("PATH", confine.DEFAULT_PATH)
        program = confine.host_program(spec.rootfs, argv[0], spec.workdir, search_path)
        if program is not None:
            argv[0] = str(program)
        elif not spec.host_runtime:
            # Not in the image: the host's program of that name would run. Only an image that
            # names no base (built to use the host's runtime) may do that.
            raise UnsafeImage(
                f"image has no program {argv[0][:200]!r} (on its PATH {search_path[:200]!r}); "
                "the process driver would run the host's"
            )
        env = {**spec.env, **port_env(spec.ports, inside=False)}
        loop = asyncio.get_running_loop()
        try:
            cgroup_procs = self._prepare_run(spec, self._spares.claim())
            log_fd, copier = self._start_copier(mid)
        except OSError as e:
            raise Unavailable(f"cannot prepare machine {mid}: {e}") from e

        status_dir = self._run_dirs.status_dir(mid)
        script = wrapper_script(status_dir, cwd, env, cgroup_procs, self._mv)
        try:
            hold_r, hold_w = os.pipe2(os.O_CLOEXEC)
        except OSError as e:
            os.close(log_fd)
            copier.close()
            raise Unavailable(f"cannot start machine {mid}: {e}") from e
        uid, gid, groups = self._user if self._user is not None else (None, None, None)
        # The machine binds its host ports itself.
        self._published[mid] = spec.ports
        self._ports.release(mid, [p.host_port for p in spec.ports])
        try:
            # Blocking, but only for the fork/exec: we never wait on the child here.
            popen = subprocess.Popen(  # noqa: ASYNC220
                ["/bin/sh", "-c", script, "nonomad-wrapper", *argv],
                stdin=hold_r,
                stdout=log_fd,
                stderr=log_fd,
                env=env,
                start_new_session=True,
                # Without preexec_fn Python can vfork; a user switch makes it fork instead.
                user=uid,
                group=gid,
                extra_groups=groups,  # else the machine would keep flyd's (root's) groups
            )
        except OSError as e:
            os.close(hold_w)
            copier.close()  # with log_fd closed below, it reads the end of its pipe and exits
            self._hold_published(mid)
            raise Unavailable(f"cannot start machine {mid}: {e}") from e
        finally:
            os.close(log_fd)
            os.close(hold_r)

        # Our child cannot be reaped before we poll it, so its pid is stable until then.
        proc = read_proc_stat(popen.pid)
        assert proc is not None, "an unreaped child always has a /proc entry"
        handle = Handle(pid=popen.pid, start_time=proc.start_time, boot_id=self._boot_id)
        self._run_dirs.write_handle(mid, handle)
        w = self._watch(loop, mid, handle, os.pidfd_open(popen.pid), popen, copier)
        w.go_fd = hold_w
        log.debug("machine_process_started", machine_id=mid, pid=popen.pid)
        return handle

    async def _deliver(self, w: Watched, sig: int, *, stopping: bool) -> None:
        """To the wrapper's child (the machine), once exec'd; a stop goes to the whole group.

        Right after a start, waits (briefly) for the machine to be exec'd: a signal the wrapper
        catches while it forks the machine would reach neither. Falls back to the process group
        when the machine cannot be found.
        """
        if stopping and sig == signal.SIGKILL:
            self._killpg(w, sig)
            return
        child_fd = await self._main_process(w, _EXEC_WAIT_S)
        if child_fd is not None:
            try:
                if not stopping:
                    signal.pidfd_send_signal(child_fd, sig)
                    return
            except ProcessLookupError:
                pass
            finally:
                os.close(child_fd)
        self._killpg(w, sig)

    def _kill_all(self, w: Watched) -> None:
        # The main process first: killed after its children, it could reap them and exit 0
        # before its own SIGKILL landed (a stop that escalated would report a clean exit).
        child_fd = open_child_pidfd(w.handle.pid)
        if child_fd is not None:
            signal_and_close(child_fd, signal.SIGKILL)
        self._kill_cgroup(w.machine_id)
        self._killpg(w, signal.SIGKILL)

    def _ended(self, machine_id: str) -> None:
        super()._ended(machine_id)
        with contextlib.suppress(OSError):
            self._hold_published(machine_id)  # its ports are flyd's to hold again

    async def _main_process(self, w: Watched, wait: float) -> int | None:
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


# ProcessDriver keeps the contract flyd is written against (checked by mypy).
_: type[Driver] = ProcessDriver
