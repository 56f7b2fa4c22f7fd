"""What the OCI driver needs from the host: crun, a static init, and a kernel that can do it.

`find_tools` locates the binaries (Debian packages `crun` and `tini`; the project's set-up
installs them, see `.ci/system-packages`), `probe` says why this host cannot run OCI machines
(None when it can), `hybrid_cgroups` detects the cgroup layout crun refuses ("cgroups in
hybrid mode not supported": v1 controllers plus a cgroup2 mount at
/sys/fs/cgroup/unified). The driver never reconfigures the host for it: each machine's
wrapper runs in a private mount namespace, where that mount is detached before crun runs.

`container_pidfd` reads crun's own record of a container's init process (pid and start time),
so a signal reaches that process and never one that reused its pid; `init_pidfd` waits for
that init (tini) to be ready for the signals it passes on.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from flyd.drivers.procfs import read_proc_stat, signal_and_close

__all__ = [
    "CRUN_ROOT",
    "Tools",
    "container_pidfd",
    "delete_container",
    "find_tools",
    "hybrid_cgroups",
    "init_pidfd",
    "probe",
]

_INIT = "tini-static"
CRUN_ROOT = ".crun"  # crun's state, under a driver's run root


@dataclass(frozen=True)
class Tools:
    """Absolute paths of the programs the OCI driver runs."""

    crun: str
    init: str  # statically linked: it runs inside images that have no libc
    unshare: str
    mount: str
    umount: str
    sh: str = "/bin/sh"
    mv: str = "/bin/mv"


def _which(name: str) -> str | None:
    found = shutil.which(name) or shutil.which(name, path="/usr/local/sbin:/usr/sbin:/sbin")
    return os.path.realpath(found) if found else None


def find_tools() -> Tools | str:
    """The tools, or a sentence naming what is missing."""
    found = {name: _which(name) for name in ("crun", "unshare", "mount", "umount", "mv")}
    init = _which(_INIT)
    missing = [name for name, path in found.items() if path is None]
    if init is None:
        missing.append("tini-static (Debian package tini)")
    if missing or init is None:
        return f"missing {', '.join(missing)}"
    return Tools(
        crun=str(found["crun"]),
        init=init,
        unshare=str(found["unshare"]),
        mount=str(found["mount"]),
        umount=str(found["umount"]),
        mv=str(found["mv"]),
    )


def probe() -> str | None:
    """None when this host can run OCI machines, else why not."""
    tools = find_tools()
    if isinstance(tools, str):
        return tools
    if os.geteuid() != 0:
        return "the OCI driver needs root (it makes namespaces, mounts and cgroups)"
    try:
        if int(Path("/proc/sys/user/max_user_namespaces").read_text()) == 0:
            return "user namespaces are disabled (user.max_user_namespaces = 0)"
        if "overlay" not in Path("/proc/filesystems").read_text():
            return "the kernel has no overlay filesystem"
    except (OSError, ValueError) as e:
        return f"cannot read the kernel's features: {e}"
    release = os.uname().release.split(".")
    try:
        if (int(release[0]), int(release[1].split("-")[0])) < (5, 19):
            return f"kernel {os.uname().release} is older than 5.19 (ID-mapped overlay layers)"
    except (IndexError, ValueError):
        pass
    return None


def hybrid_cgroups(mountinfo: str | None = None) -> bool:
    """Whether cgroup v1 controllers sit beside a cgroup2 mount at /sys/fs/cgroup/unified."""
    if mountinfo is None:
        mountinfo = Path("/proc/self/mountinfo").read_text()
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) < 5 or fields[4] != "/sys/fs/cgroup/unified":
            continue
        try:
            fstype = fields[fields.index("-") + 1]
        except (ValueError, IndexError):
            continue
        if fstype == "cgroup2":
            return True
    return False


def container_pidfd(crun_root: Path, container_id: str) -> int | None:
    """A pidfd for the container's init process as crun recorded it (pid and start time),
    if crun has a record and that very process still runs; else None.
    """
    try:
        status = json.loads((crun_root / container_id / "status").read_bytes())
        pid, start = int(status["pid"]), int(status["process-start-time"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    # Checked after opening: the pidfd now pins the process the start time belongs to.
    proc = read_proc_stat(pid)
    if proc is None or proc.start_time != start:
        os.close(pidfd)
        return None
    return pidfd


def delete_container(crun_root: Path, container_id: str) -> None:
    """Forget what crun kept of a container whose crun is gone (it was killed): SIGKILL its
    init if that still runs (the pid namespace dies with it), then remove crun's state.
    `crun delete` would do the same, but crun refuses to run at all outside the wrapper's
    mount namespace on a hybrid-cgroup host. Idempotent.
    """
    state = crun_root / container_id
    if not state.exists():
        return
    pidfd = container_pidfd(crun_root, container_id)
    if pidfd is not None:
        signal_and_close(pidfd, signal.SIGKILL)
    shutil.rmtree(state, ignore_errors=True)


async def init_pidfd(
    crun_root: Path,
    container_id: str,
    sig: int,
    *,
    wait: float,
    ended: Callable[[], bool],
    sleep: Callable[[float], Awaitable[None]],
) -> int | None:
    """A pidfd for the container's init once tini is ready for `sig` (or after `wait` seconds,
    or once `ended()`, whatever it does then); None if there is no container.

    Right after a start, the kernel drops a signal sent to a pid namespace's init that neither
    handles nor blocks it, so one sent before tini blocked the signals it passes on is lost.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    while True:
        pidfd = container_pidfd(crun_root, container_id)
        late = ended() or loop.time() >= deadline
        # SIGKILL (and SIGSTOP) always reach it: nothing can block them.
        uncatchable = sig in (signal.SIGKILL, signal.SIGSTOP)
        if pidfd is not None and (late or uncatchable or _tini_ready(pidfd)):
            return pidfd
        if pidfd is not None:
            os.close(pidfd)
        if late:
            return None
        await sleep(0.002)


def _tini_ready(pidfd: int) -> bool:
    """Whether the pidfd's process is a tini that has blocked the signals it passes on.

    tini blocks them first, then ignores SIGTTIN; it waits for them in sigtimedwait, during
    which /proc shows them unblocked, so the SIGTTIN disposition is what tells.
    """
    try:
        pid = next(
            int(line.split()[1])
            for line in Path(f"/proc/self/fdinfo/{pidfd}").read_text().splitlines()
            if line.startswith("Pid:")
        )
        status = Path(f"/proc/{pid}/status").read_text()
    except (OSError, StopIteration, ValueError):
        return False
    for line in status.splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTTIN - 1) & 1)
    return False
