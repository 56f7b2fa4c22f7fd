"""What the driver tests share: real drivers of either kind, their machines and waits.

`make_driver` (a fixture in tests/flyd/conftest.py) builds a `process` or an `oci` driver on
one run root; the tests written against it run for both (the OCI ones skip, with the reason,
where crun cannot run). A machine's "image" is a plain directory (`image`); what a machine
writes in its working directory is read back with `machine_wrote`, which knows where each
driver keeps it (the image directory itself for the process driver, the machine's upper
layer for OCI, inside its disk file: `upper_layer`). Nothing waits on wall-clock time: tests
wait on conditions with deadlines.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import socket
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from flyd.drivers.base import Driver, ExitStatus, Handle, Limits, ProcessSpec
from flyd.drivers.oci import probe as oci_probe
from flyd.drivers.procfs import read_proc_stat
from flyd.drivers.writable import DISK_FILE
from flyd.storage import diskfile

CGROUP_ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("memory", "cpu", "pids")
PATH = "/usr/local/bin:/usr/bin:/bin"
DEADLINE = 10.0
LIMITS = Limits(cpu_millicores=500, memory_mib=256, pids=256)
KINDS = ("process", "oci")


def _cgroups_unavailable() -> str | None:
    """Why cgroup v1 tests cannot run here, or None."""
    probe = f"nonomad-probe-{uuid.uuid4().hex[:8]}"
    for controller in CONTROLLERS:
        path = CGROUP_ROOT / controller / probe
        try:
            path.mkdir()
            path.rmdir()
        except OSError as e:
            return f"cgroup v1 {controller} controller not writable at {path.parent}: {e.strerror}"
    return None


CGROUPS_UNAVAILABLE = _cgroups_unavailable()
OCI_UNAVAILABLE = oci_probe()


def needs_cgroups(test: Callable[..., object]) -> Callable[..., object]:
    skip = pytest.mark.skipif(CGROUPS_UNAVAILABLE is not None, reason=str(CGROUPS_UNAVAILABLE))
    return pytest.mark.cgroups(skip(test))


needs_oci = pytest.mark.skipif(
    OCI_UNAVAILABLE is not None, reason=f"crun cannot run here: {OCI_UNAVAILABLE}"
)


class Exits:
    """Collects on_exit calls; `wait` returns a machine's next one."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ExitStatus]] = []
        self._changed = asyncio.Event()

    def __call__(self, machine_id: str, handle: Handle, status: ExitStatus) -> None:
        self.calls.append((machine_id, status))
        self._changed.set()

    def of(self, machine_id: str) -> list[ExitStatus]:
        return [status for mid, status in self.calls if mid == machine_id]

    async def wait(self, machine_id: str, count: int = 1) -> ExitStatus:
        async def reached() -> None:
            while len(self.of(machine_id)) < count:
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(reached(), DEADLINE)
        return self.of(machine_id)[count - 1]


async def run_machine(driver: Driver, process: ProcessSpec) -> Handle:
    """Start and release: the machine runs its command."""
    handle = await driver.start(process)
    driver.release(process.machine_id)
    return handle


async def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Poll a condition until a deadline (for effects no callback announces)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while not condition():
        if loop.time() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def log_lines(driver: Driver, machine_id: str, tail_lines: int) -> list[str]:
    """The machine's last `tail_lines` log lines (a blocking read, a short one in tests)."""
    return driver.read_logs(machine_id, tail_lines, 1 << 20).lines


async def logged(driver: Driver, machine_id: str, line: str) -> None:
    """Wait until the machine has printed `line`."""
    await wait_until(lambda: line in log_lines(driver, machine_id, 100), f"{machine_id}: {line}")


def gone(pid: int) -> bool:
    """The process no longer runs (or is a zombie nobody reaped yet). Read as flyd reads it
    (`read_proc_stat`): a process that dies while its stat is read fails the read with ESRCH,
    not ENOENT."""
    stat = read_proc_stat(pid)
    return stat is None or stat.state == "Z"


def pids_running(token: str) -> list[int]:
    """Host pids of the processes whose command line holds `token` (a machine's marker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if token.encode() in (entry / "cmdline").read_bytes() and not gone(int(entry.name)):
                    found.append(int(entry.name))
    return found


def cgroup_pids(prefix: str, machine_id: str) -> list[int]:
    """Host pids in the machine's pids cgroup."""
    procs = CGROUP_ROOT / "pids" / prefix / machine_id / "cgroup.procs"
    with contextlib.suppress(FileNotFoundError):
        return [int(p) for p in procs.read_text().split()]
    return []


def spec(machine_id: str, argv: list[str], rootfs: Path, /, **changes: object) -> ProcessSpec:
    base = ProcessSpec(
        machine_id=machine_id,
        argv=argv,
        rootfs=rootfs,
        env={"PATH": PATH},
        limits=LIMITS,
        host_runtime=True,
    )
    return dataclasses.replace(base, **changes)


def sh(script: str) -> list[str]:
    return ["sh", "-c", script]


def machine_wrote(driver: Driver, machine_id: str, name: str) -> bool:
    """Whether the machine wrote file `name` in its working directory (/): for OCI, in its
    upper layer (through its wrapper while it lives, else by mounting its disk file)."""
    if driver.name != "oci":
        return (driver._run_dirs.root.parent / "image" / name).exists()  # type: ignore[attr-defined]
    run_dir = driver._run_dirs.path(machine_id)  # type: ignore[attr-defined]
    with contextlib.suppress(OSError):  # its wrapper is gone, or was never spawned
        return (upper_layer(run_dir) / name).exists()
    if not (run_dir / DISK_FILE).exists():
        return False
    fd = diskfile.mount(run_dir / DISK_FILE)
    try:
        return os.path.lexists(f"/proc/self/fd/{fd}/upper/{name}")
    finally:
        os.close(fd)


def loops_under(root: Path) -> list[str]:
    """Every loop device bound to a file under `root` (removed ones too: "... (deleted)"),
    but the spare run dirs' (their disks are mounted ahead, by the driver that made them).
    None of them: nothing has a disk file of `root` mounted, in any mount namespace."""
    found = []
    for entry in Path("/sys/block").iterdir():
        try:
            backing = (entry / "loop" / "backing_file").read_text().strip()
        except OSError:
            continue
        under = backing.startswith(str(root.resolve()) + "/")
        if under and "/.spare/" not in backing:
            found.append(f"{entry.name}: {backing}")
    return found


def upper_layer(run_dir: Path) -> Path:
    """An OCI machine's upper layer as its live wrapper holds it (OSError if there is none):
    through the descriptor of its disk's mount, named in the overlay's options in the run
    dir's fstab, from the host."""
    pid = json.loads((run_dir / "handle.json").read_text())["pid"]
    if gone(pid):
        raise FileNotFoundError(f"machine {run_dir.name} has no live wrapper")
    found = re.search(r"upperdir=/proc/self/fd/(\d+)/upper", (run_dir / "fstab").read_text())
    assert found is not None, "the fstab names no upper layer"
    upper = Path(f"/proc/{pid}/fd/{found[1]}/upper")
    upper.stat()  # raises if the wrapper went meanwhile
    return upper


def answers_http(port: int) -> bool:
    """Whether an HTTP server answers 200 on 127.0.0.1:`port`."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
            conn.sendall(b"GET / HTTP/1.0\r\n\r\n")
            return conn.recv(12).startswith(b"HTTP/1.0 200")
    except OSError:
        return False


def netd_hello(run_root: Path) -> dict[str, Any]:
    """What the run root's netd says it holds, asked on a connection of the test's own."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(DEADLINE)
        s.connect(str(run_root / ".netd.sock"))
        s.send(b'{"op": "hello"}')
        answer: dict[str, Any] = json.loads(s.recv(1 << 16))["ok"]
    return answer


def host_address() -> str | None:
    """An IPv4 address of this host that is not a loopback one (read from its interfaces,
    nothing is sent), or None if it has none."""
    import subprocess

    try:
        shown = subprocess.run(
            ["ip", "-4", "-o", "addr", "show", "scope", "global"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in shown.splitlines():
        fields = line.split()
        if "inet" in fields:
            return fields[fields.index("inet") + 1].split("/")[0]
    return None
