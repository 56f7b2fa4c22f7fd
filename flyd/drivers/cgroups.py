"""cgroup v1 limits for a driver's machines: one memory, one cpu and one pids cgroup
per machine, under `<cgroup root>/<controller>/<prefix>/<machine id>`.

This module probes whether the controllers are usable, sets a machine's cgroups up with its
limits, kills what runs in them, removes them, and tells from the memory cgroup's counters
whether a run was killed for want of memory. It knows nothing of run dirs: the driver keeps the
counters a run started with.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from flyd.drivers import namespaces
from flyd.drivers.base import ExitStatus, Limits
from model.errors import Unavailable

__all__ = [
    "CONTROLLERS",
    "Cgroups",
    "OomCounters",
    "cpu_shares",
    "joining",
    "limit_memory",
    "namespace_at",
    "probe",
    "remove_tree",
    "v1_missing",
]

log = structlog.get_logger(__name__)

CONTROLLERS = ("memory", "cpu", "pids")
_CPU_PERIOD_US = 100_000
_CPU_MIN_QUOTA_US = 1_000  # the kernel refuses smaller quotas
_CPU_SHARES_PER_CORE = 1024  # the kernel's default weight: one core's worth
_CPU_MIN_SHARES, _CPU_MAX_SHARES = 2, 262_144  # the kernel's bounds
_RMDIR_TIMEOUT_S = 2.0


def v1_missing(cgroup_root: Path) -> str | None:
    """None if the v1 memory, cpu and pids controllers are mounted under `cgroup_root`, else
    which is not (on a cgroup v2-only host, none is). Reads only; creates nothing.
    """
    for controller in CONTROLLERS:
        mount = cgroup_root / controller
        if not (mount / "cgroup.procs").is_file():
            v2 = (cgroup_root / "cgroup.controllers").is_file()
            return f"no cgroup v1 {controller} controller mounted at {mount}" + (
                f" ({cgroup_root} is cgroup v2 alone, which flyd's limits do not support)"
                if v2
                else ""
            )
    return None


def probe(cgroup_root: Path, prefix: str) -> str | None:
    """None if the v1 memory, cpu and pids controllers are usable, else why not.

    Creates `<controller>/<prefix>` under `cgroup_root` where it is missing.
    """
    needs = {
        "memory": ("memory.limit_in_bytes", "memory.oom_control", "memory.failcnt"),
        "cpu": ("cpu.cfs_period_us", "cpu.cfs_quota_us", "cpu.shares"),
        "pids": ("pids.max",),
    }
    missing_v1 = v1_missing(cgroup_root)
    if missing_v1 is not None:
        return missing_v1
    for controller, files in needs.items():
        mount = cgroup_root / controller
        parent = mount / prefix
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


@dataclass(frozen=True)
class OomCounters:
    """A memory cgroup's OOM kills and limit hits (memory.failcnt).

    They outlive a run, so an exit is judged against their values when the run started.
    """

    oom_kill: int
    failcnt: int


class Cgroups:
    """The machines' cgroups under `cgroup_root`; make one only where `probe` found no problem.

    `owner_uid`: the user machines run as, who must be able to join their cgroups (None: the
    driver's own).
    """

    def __init__(
        self,
        cgroup_root: Path,
        prefix: str,
        *,
        owner_uid: int | None,
        sleep: Callable[[float], Awaitable[None]],
    ) -> None:
        self._root = cgroup_root
        self._prefix = prefix
        self._owner_uid = owner_uid
        self._sleep = sleep
        self.parents = [cgroup_root / c / prefix for c in CONTROLLERS]
        """The directories the machines' cgroups live in, one per controller."""
        # Whether the kernel accounts swap (memory.memsw.*): then memory+swap is limited too.
        self._memsw = (cgroup_root / "memory" / prefix / "memory.memsw.limit_in_bytes").is_file()

    def dirs(self, machine_id: str) -> list[Path]:
        """The machine's cgroup directories, in `CONTROLLERS` order."""
        return [self._root / c / self._prefix / machine_id for c in CONTROLLERS]

    def setup(
        self, machine_id: str, limits: Limits, new: list[bool] | None
    ) -> tuple[list[Path], OomCounters | None]:
        """Create (or reuse) the machine's cgroups with `limits`.

        `new`: which of them were just put in place from spares (None: none were). Returns
        their cgroup.procs files and, when the memory cgroup already existed, its counters now
        (None: a new one, which counts from zero).
        """
        memory, cpu, pids = self.dirs(machine_id)
        created = [
            (new is not None and new[i]) or _mkdir_new(cg, 0o755)
            for i, cg in enumerate((memory, cpu, pids))
        ]
        if not all(created):
            self.kill(machine_id)  # leftovers of a previous run, if flyd missed its end
        _set_memory_limit(memory, limits.memory_mib << 20, memsw=self._memsw)
        if not created[1]:  # a new cgroup has the kernel's default period, which is ours
            _write(cpu / "cpu.cfs_period_us", _CPU_PERIOD_US)
        _write(cpu / "cpu.cfs_quota_us", max(_CPU_MIN_QUOTA_US, limits.cpu_millicores * 100))
        # The quota caps it; its shares weigh it against the others when the CPUs are busy.
        _write(cpu / "cpu.shares", cpu_shares(limits.cpu_millicores))
        _write(pids / "pids.max", limits.pids)
        counters = None
        if not created[0]:
            oom_kill = _read_oom_kill(memory) or 0
            failcnt = int((memory / "memory.failcnt").read_text())
            counters = OomCounters(oom_kill, failcnt)
        procs = [cg / "cgroup.procs" for cg in (memory, cpu, pids)]
        if self._owner_uid is not None:
            for p in procs:  # the wrapper joins as the machine's user
                os.chown(p, self._owner_uid, -1)
        return procs, counters

    def kill(self, machine_id: str) -> None:
        """SIGKILL every process in the machine's cgroups (a few rounds, to catch forks)."""
        for _ in range(5):
            pids: set[int] = set()
            for cg in self.dirs(machine_id):
                with contextlib.suppress(OSError, ValueError):
                    pids.update(int(p) for p in (cg / "cgroup.procs").read_text().split())
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def oom_killed(
        self, machine_id: str, base: OomCounters, status: ExitStatus, killed_by_us: bool
    ) -> bool:
        """Whether the run that started with counters `base` and ended with `status` was
        killed for want of memory. False when the counters cannot be read.
        """
        memory = self.dirs(machine_id)[0]
        try:
            oom_kill = _read_oom_kill(memory)
            if oom_kill is not None:
                return oom_kill > base.oom_kill
            # Older kernels do not count OOM kills: hitting the limit plus a SIGKILL we did not
            # send is the best evidence left.
            failcnt = int((memory / "memory.failcnt").read_text())
        except (OSError, ValueError):
            return False
        return failcnt > base.failcnt and status.signal == signal.SIGKILL and not killed_by_us

    async def remove(self, machine_id: str) -> None:
        """Kill what runs in the machine's cgroups and remove them. Idempotent.

        Raises `Unavailable` if one cannot be removed: still busy after a short wait, or any
        other error.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _RMDIR_TIMEOUT_S
        for controller, cg in zip(CONTROLLERS, self.dirs(machine_id), strict=True):
            while True:
                self.kill(machine_id)
                try:
                    if controller == "memory":
                        await asyncio.to_thread(force_empty, cg)  # it reclaims: not on the loop
                    cg.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    # EBUSY until the killed processes are fully gone.
                    if e.errno != errno.EBUSY or loop.time() > deadline:
                        raise Unavailable(f"cannot remove cgroup {cg}: {e}") from e
                await self._sleep(0.01)


def limit_memory(memory_cgroup: Path, limit: int) -> None:
    """Make the v1 memory cgroup `memory_cgroup` (or keep it) and limit it to `limit` bytes,
    memory+swap too where the kernel accounts swap: a process of nonomad's own that joins it
    (a local worker's flyd, and what it starts) can use no more. Raises OSError."""
    memory_cgroup.mkdir(mode=0o755, exist_ok=True)
    memsw = (memory_cgroup / "memory.memsw.limit_in_bytes").is_file()
    _set_memory_limit(memory_cgroup, limit, memsw=memsw)


def joining(memory_cgroup: Path, argv: Sequence[str]) -> list[str]:
    """`argv` as a command that joins `memory_cgroup` before anything of it runs: a shell writes
    its own pid to the cgroup's `cgroup.procs` and execs `argv` (same pid), so all the program
    and what it starts ever take is charged there; where it cannot join, it does not start.
    Not a Popen preexec_fn, which runs Python in the forked child of a parent that may have
    threads (`nonomad.hosts` starts hosts from a pool)."""
    join = 'echo $$ > "$0" && exec "$@"'
    return ["/bin/sh", "-c", join, str(memory_cgroup / "cgroup.procs"), *argv]


def force_empty(memory_cgroup: Path) -> None:
    """Reclaim what is still charged to an empty memory cgroup about to be removed: the page
    cache of the files its processes read or wrote first. Without it the removed cgroup lives
    on, offline ("dying"), for as long as any of those pages stays cached; a worker that runs
    many machines gathers hundreds, and every cgroup operation after slows down (here flyd's
    CPU per OCI create doubled at ~300). Nothing while a process is left in it (it would
    reclaim theirs too): the caller's rmdir fails busy and it tries again. Raises
    FileNotFoundError when the cgroup is gone. Blocking.
    """
    if _populated(memory_cgroup):
        return
    try:
        fd = os.open(memory_cgroup / "memory.force_empty", os.O_WRONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        if memory_cgroup.exists():
            return  # no such file: not a v1 memory cgroup
        raise
    try:
        os.write(fd, b"0")
    except OSError as e:  # it could not reclaim everything: the removal still goes ahead
        log.debug("cgroup_not_emptied", cgroup=str(memory_cgroup), error=str(e))
    finally:
        os.close(fd)


def _populated(cg: Path) -> bool:
    with contextlib.suppress(FileNotFoundError):
        return bool((cg / "cgroup.procs").read_text().split())
    return False


def remove_tree(cg: Path, attempts: int = 200) -> bool:
    """Remove cgroup `cg` and those below it, killing (SIGKILL) what still runs in them and
    waiting for it to leave, up to `attempts` tries of 10 ms each; False when one stays busy.
    Blocking: for harnesses and tests cleaning up after a run, not for a driver's loop."""
    with contextlib.suppress(FileNotFoundError):
        for child in [p for p in cg.iterdir() if p.is_dir()]:
            remove_tree(child, attempts)
    for _ in range(attempts):
        with contextlib.suppress(OSError):
            for pid in (cg / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        try:
            force_empty(cg)  # (a memory cgroup's: see force_empty)
            cg.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
        time.sleep(0.01)  # killed processes take a moment to leave
    return False


def namespace_at(cgroups: list[Path]) -> int:
    """A cgroup namespace rooted at `cgroups` (one directory per v1 hierarchy); returns an
    O_CLOEXEC descriptor for it. Inside, those cgroups are `/` and nothing above them shows.

    A namespace's root is where its maker stood when it unshared, so a thread of its own
    makes it: it joins the cgroups (v1 moves a single thread through `tasks`), unshares,
    opens the namespace and ends there; no other thread of the caller ever moves. Blocking:
    a move waits for cgroup v1's lock, up to an RCU grace period. Raises OSError.
    """
    made: list[int] = []
    failed: list[OSError] = []

    def make() -> None:
        try:
            tid = b"%d\n" % threading.get_native_id()
            for cg in cgroups:
                fd = os.open(cg / "tasks", os.O_WRONLY | os.O_CLOEXEC)
                try:
                    os.write(fd, tid)
                finally:
                    os.close(fd)
            namespaces.unshare(namespaces.CLONE_NEWCGROUP)
            made.append(os.open("/proc/thread-self/ns/cgroup", os.O_RDONLY | os.O_CLOEXEC))
        except OSError as e:
            failed.append(e)

    maker = threading.Thread(target=make, name="cgroup-namespace", daemon=True)
    maker.start()
    maker.join()
    if failed:
        raise failed[0]
    return made[0]


def cpu_shares(cpu_millicores: int) -> int:
    """A machine's cpu.shares: its CPU in proportion, 1024 to a core, within the kernel's bounds."""
    shares = cpu_millicores * _CPU_SHARES_PER_CORE // 1000
    return min(_CPU_MAX_SHARES, max(_CPU_MIN_SHARES, shares))


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
