"""Telling Linux processes apart for the drivers: /proc/<pid>/stat, the boot id, pidfds.

A pid alone is not an identity, since pids are recycled; a `Handle`'s start time and boot id
are checked against /proc after a pidfd pins the process, so a recycled pid or a reboot never
passes for a machine's process.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from dataclasses import dataclass
from pathlib import Path

from flyd.drivers.base import Handle

__all__ = [
    "ProcStat",
    "open_child_pidfd",
    "open_pidfd",
    "read_boot_id",
    "read_proc_stat",
    "readable",
    "unreaped_child",
]


@dataclass(frozen=True)
class ProcStat:
    """Fields of /proc/<pid>/stat the driver reads; `start_time` is in clock ticks since boot."""

    state: str
    ppid: int
    start_time: int


def read_proc_stat(pid: int) -> ProcStat | None:
    """The process's stat fields, or None when it is gone."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # comm (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = data[data.rindex(b")") + 2 :].split()
    return ProcStat(state=fields[0].decode(), ppid=int(fields[1]), start_time=int(fields[19]))


def read_boot_id() -> str:
    """This boot of the host: a handle from another boot names no live process."""
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def open_pidfd(handle: Handle, boot_id: str) -> int | None:
    """A pidfd for the handle's process if it is still that process, else None."""
    if handle.boot_id != boot_id:
        return None
    try:
        pidfd = os.pidfd_open(handle.pid)
    except ProcessLookupError:
        return None
    # Checked after opening: the pidfd now pins the process the start time belongs to.
    proc = read_proc_stat(handle.pid)
    if proc is None or proc.start_time != handle.start_time:
        os.close(pidfd)
        return None
    return pidfd


def open_child_pidfd(wrapper_pid: int) -> int | None:
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
        proc = read_proc_stat(int(child))
        try:
            execd = Path(f"/proc/{child}/cmdline").read_bytes() != wrapper_cmdline
        except OSError:
            execd = False
        if proc is not None and proc.ppid == wrapper_pid and execd:
            return fd
        os.close(fd)
    return None


def unreaped_child(pidfd: int) -> bool:
    """Whether the pidfd's process is our child, exited and not reaped yet."""
    try:
        flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
        return os.waitid(os.P_PIDFD, pidfd, flags) is not None
    except ChildProcessError:
        return False


def readable(fd: int) -> bool:
    """Whether `fd` polls readable now: a pidfd does once its process has exited."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def signal_and_close(pidfd: int, sig: int) -> None:
    """Send `sig` to the pidfd's process (one gone already is no error), then close the fd."""
    try:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, sig)
    finally:
        os.close(pidfd)
