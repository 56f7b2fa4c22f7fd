"""A driver's run dirs: what it keeps on disk for each machine, so that a later flyd (after a
crash or a restart) finds the machine's process again and learns how it ended.

Layout of `<run_root>/<machine_id>/`:

- `handle.json`: the `Handle` of the machine's wrapper process
- `status/`: writable by the machine's user; the wrapper records its exit in `status/exit`
- `exit`: the driver's record of an exit the wrapper could not record
- `oom.base`: the memory cgroup's counters when the run started, if that cgroup was not new
- `machine.log[.N]`: the machine's output, and `log.json` the handle of the copier that writes
  it (`flyd.drivers.logs`)
- OCI only: `config.json` (the bundle's runtime spec), `etc/` (its /etc files), `disk.ext4`
  (its disk: the overlay's own layer, `upper/` and `work/`, on a filesystem of its own; see
  `flyd.drivers.writable`), `rootfs/` (the overlay's mount point), `slot` (its uid range and
  address)

Entries of the run root whose names start with a dot are not machines' (`.spare/` holds the
spare run dirs of `flyd.drivers.spares`; OCI: `.crun/` crun's state, `.netd.*` netd's socket,
handle and log, `.layer/` what each disk is made holding).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import stat
from pathlib import Path

from flyd.drivers.base import ExitStatus, Handle
from flyd.drivers.cgroups import OomCounters
from flyd.drivers.procfs import read_boot_id, read_proc_stat
from flyd.drivers.wrapper import exit_record, read_exit_file
from model.errors import CorruptLog, InvalidArgument, NotFound

__all__ = ["RunDirs", "kill_all", "validate_machine_id"]

_MACHINE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def validate_machine_id(machine_id: str) -> None:
    """Raise InvalidArgument unless `machine_id` can name a run dir (and a cgroup)."""
    if not _MACHINE_ID.fullmatch(machine_id) or machine_id in (".", ".."):
        raise InvalidArgument("machine_id", f"{machine_id!r} is not a valid machine id")


class RunDirs:
    """The run dirs under `run_root`, which is created if missing.

    `user` (uid, gid, groups): who machines run as, or None for the driver's own user. Its
    wrapper must reach `status/`, so every ancestor of the run root must let it in.
    """

    def __init__(self, run_root: Path, user: tuple[int, int, list[int]] | None) -> None:
        self.root = run_root.absolute()
        self._user = user
        self.root.mkdir(parents=True, exist_ok=True)
        if user is not None:
            _check_traversable(self.root, *user)

    def path(self, machine_id: str) -> Path:
        """The machine's run dir, whether it exists or not."""
        validate_machine_id(machine_id)
        return self.root / machine_id

    def existing(self, machine_id: str) -> Path:
        """The machine's run dir; NotFound if it has none."""
        run_dir = self.path(machine_id)
        if not run_dir.is_dir():
            raise NotFound(f"machine {machine_id} has no process state on this worker")
        return run_dir

    def machines(self) -> list[str]:
        """The machines that have a run dir."""
        try:
            return sorted(
                entry.name
                for entry in os.scandir(self.root)
                if entry.is_dir(follow_symlinks=False) and not entry.name.startswith(".")
            )
        except FileNotFoundError:
            return []

    def status_dir(self, machine_id: str) -> Path:
        """Where the machine's wrapper records its exit."""
        return self.path(machine_id) / "status"

    def prepare(self, machine_id: str, *, from_spare: bool) -> bool:
        """Make the machine's run dir ready for a new process; returns whether it is new.

        A run dir just taken from the spares (`from_spare`) is new and ready. An existing one
        loses the exit records of its previous process.
        """
        if from_spare:
            return True
        run_dir = self.path(machine_id)
        status_dir = run_dir / "status"
        fresh = False
        with contextlib.suppress(FileExistsError):
            os.mkdir(run_dir, 0o755)
            fresh = True
        if fresh or not status_dir.is_dir():
            status_dir.mkdir(mode=0o700, exist_ok=True)
        if self._user is not None:
            os.chown(status_dir, self._user[0], self._user[1])
        if not fresh:
            for stale in (status_dir / "exit", status_dir / "exit.tmp", run_dir / "exit"):
                with contextlib.suppress(FileNotFoundError):
                    stale.unlink()
        return fresh

    def write_handle(self, machine_id: str, handle: Handle) -> None:
        """Record the handle of the machine's new process."""
        # Not written atomically: an empty or torn file (flyd died mid-write) reads as no
        # handle, and the process it would name is held and exits on its own when flyd dies.
        _write_file(self.path(machine_id) / "handle.json", json.dumps(handle.to_dict()).encode())

    def read_handle(self, machine_id: str) -> Handle | None:
        """The handle last recorded for the machine, or None if none can be read."""
        try:
            data = json.loads((self.path(machine_id) / "handle.json").read_bytes())
            return Handle.from_dict(data)
        except (OSError, ValueError, CorruptLog):
            return None

    def read_exit(self, machine_id: str) -> ExitStatus | None:
        """How the machine's last process ended: the wrapper's record, else the driver's."""
        run_dir = self.path(machine_id)
        return read_exit_file(run_dir / "status" / "exit") or read_exit_file(run_dir / "exit")

    def record_exit(self, machine_id: str, status: ExitStatus) -> bool:
        """Record an exit the wrapper could not record; False if the run dir is gone."""
        run_dir = self.path(machine_id)
        if not run_dir.is_dir():
            return False
        _write_atomic(run_dir / "exit", exit_record(status))
        return True

    def write_oom_base(self, machine_id: str, counters: OomCounters | None) -> None:
        """Keep the memory cgroup's counters at the start of a run.

        None: the memory cgroup is new and counts from zero, which is what a missing file means.
        """
        path = self.path(machine_id) / "oom.base"
        if counters is not None:
            _write_atomic(path, f"{counters.oom_kill} {counters.failcnt}\n".encode())
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def read_oom_base(self, machine_id: str) -> OomCounters:
        """The counters kept by `write_oom_base`. Raises OSError or ValueError if unreadable."""
        try:
            text = (self.path(machine_id) / "oom.base").read_text()
        except FileNotFoundError:
            return OomCounters(0, 0)  # the run started in a new memory cgroup
        oom_kill, failcnt = (int(v) for v in text.split())
        return OomCounters(oom_kill, failcnt)

    def remove(self, machine_id: str) -> None:
        """Remove the machine's run dir, if it has one."""
        shutil.rmtree(self.path(machine_id), ignore_errors=True)


def kill_all(run_root: Path) -> int:
    """SIGKILL every machine recorded under a driver's run root, and its netd (OCI).

    For tearing down a whole worker (a local cluster, a test) when flyd can no longer be asked
    to. Handles are checked against /proc, so a recycled pid is left alone: each wrapper's
    process group, each container's init (its pid namespace dies with it), each log copier,
    then netd (the worker's network and held ports go with it). Returns how many machines
    were killed.
    """
    from flyd.drivers.crun import CRUN_ROOT, delete_container
    from flyd.drivers.logs import COPIER_HANDLE, kill_copier
    from flyd.drivers.netclient import kill_netd

    killed = 0
    boot_id = read_boot_id()
    for handle_file in run_root.glob("*/handle.json"):
        try:
            handle = Handle.from_dict(json.loads(handle_file.read_bytes()))
        except (OSError, ValueError, CorruptLog):
            continue
        proc = read_proc_stat(handle.pid)
        if handle.boot_id != boot_id or proc is None or proc.start_time != handle.start_time:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.killpg(handle.pid, signal.SIGKILL)
            killed += 1
    crun_root = run_root / CRUN_ROOT
    if crun_root.is_dir():
        for state in crun_root.iterdir():
            delete_container(crun_root, state.name)
    for copier_file in run_root.glob(f"*/{COPIER_HANDLE}"):
        kill_copier(copier_file.parent, boot_id)
    kill_netd(run_root)
    return killed


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
