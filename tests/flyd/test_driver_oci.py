"""What only the OCI driver does: hardening, an image's own rootfs and user, netd dying under it,
and the pieces it parses (hybrid cgroups, crun's state on the hold hook's stdin).

Real containers (skipped, with the reason, where crun cannot run), on a run root of the test's
own; nothing waits on wall-clock time.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

from flyd.drivers.base import ExitStatus, PortMapping
from flyd.drivers.bundle import CAPABILITIES, Bundle, hold_hook
from flyd.drivers.crun import hybrid_cgroups
from flyd.drivers.netclient import kill_netd
from flyd.drivers.oci import OciDriver
from flyd.drivers.rundir import kill_all
from tests.flyd.driver_support import (
    DEADLINE,
    OCI_UNAVAILABLE,
    Exits,
    logged,
    run_machine,
    sh,
    spec,
    wait_until,
)

HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
V1 = HYBRID.splitlines()[0] + "\n" + HYBRID.splitlines()[1] + "\n"


@pytest.mark.parametrize(("mountinfo", "hybrid"), [(HYBRID, True), (V1, False), ("", False)])
def test_hybrid_cgroups_are_told_from_the_mount_table(mountinfo: str, hybrid: bool) -> None:
    assert hybrid_cgroups(mountinfo) is hybrid


@pytest.mark.parametrize(
    "state",
    [
        '{"ociVersion":"1.0","id":"m1","pid":4242,"root":"/r","status":"created"}',
        '{"ociVersion": "1.0", "id": "m1", "pid":4242}\n',
    ],
)
def test_the_hold_hook_puts_crun_s_container_in_the_machine_s_cgroups(
    tmp_path: Path, state: str
) -> None:
    """Only the hook's first part: read crun's state from stdin, write the pid to each cgroup;
    the pipes it then waits on are the wrapper's, absent here, so it fails and marks itself."""
    procs = (tmp_path / "memory.procs", tmp_path / "pids.procs")
    marker = tmp_path / "held"
    hook = hold_hook(Bundle(tmp_path, tmp_path, "n", "u", tmp_path / "init", 98, 99, marker, procs))
    done = subprocess.run(hook["args"], input=state.encode(), capture_output=True, timeout=10)
    assert done.returncode == 1  # no wrapper behind it: it never says ready
    assert [p.read_text() for p in procs] == ["4242\n", "4242\n"]
    assert marker.exists()


async def test_a_machine_is_hardened(make_driver, image: Path) -> None:
    exits = Exits()
    driver = make_driver(exits)
    script = (
        "grep -E '^(NoNewPrivs|Seccomp|CapEff|CapBnd):' /proc/self/status; "
        "touch /sys/x 2>/dev/null && echo sys writable; "
        "[ -s /proc/kcore ] && echo kcore visible; "
        "echo test > /tmp/t && echo tmp writable; "
        "unshare -U true 2>/dev/null && echo unshare allowed; "
        "mount -t tmpfs t /mnt 2>/dev/null && echo mount allowed; "
        "ls /dev | tr '\\n' ' '; echo"
    )
    await run_machine(driver, spec("m1", sh(script), image))
    assert await exits.wait("m1") == ExitStatus(0, None)
    lines = driver.read_logs("m1", 20)
    fields = dict(line.split(":\t", 1) for line in lines if ":\t" in line)
    assert fields["NoNewPrivs"] == "1"
    assert fields["Seccomp"] == "2"  # a filter
    wanted = sum(1 << _cap_number(c) for c in CAPABILITIES)
    assert int(fields["CapBnd"], 16) == wanted
    assert int(fields["CapEff"], 16) == wanted
    assert "tmp writable" in lines
    for refused in ("sys writable", "kcore visible", "unshare allowed", "mount allowed"):
        assert refused not in lines
    devices = set(lines[-1].split())
    assert devices <= {"console", "core", "fd", "full", "init", "mqueue", "null", "ptmx", "pts"} | {
        "random", "shm", "stderr", "stdin", "stdout", "tty", "urandom", "zero"
    }  # fmt: skip


def _cap_number(name: str) -> int:
    numbers = {
        "CAP_CHOWN": 0,
        "CAP_DAC_OVERRIDE": 1,
        "CAP_FOWNER": 3,
        "CAP_FSETID": 4,
        "CAP_KILL": 5,
        "CAP_SETGID": 6,
        "CAP_SETUID": 7,
        "CAP_SETPCAP": 8,
        "CAP_NET_BIND_SERVICE": 10,
    }
    return numbers[name]


async def test_an_image_with_no_host_runtime_has_only_its_own_files_and_user(
    make_driver, tmp_path: Path
) -> None:
    """A rootfs of its own (a static shell here, copied in), no host directory lent, and the
    image's user by name from its own /etc/passwd."""
    rootfs = tmp_path / "own"
    (rootfs / "bin").mkdir(parents=True)
    (rootfs / "etc").mkdir()
    busybox = shutil.which("busybox")
    if busybox is None:
        shutil.copy("/bin/dash", rootfs / "bin" / "sh")
        for lib in ("/lib/x86_64-linux-gnu/libc.so.6", "/lib64/ld-linux-x86-64.so.2"):
            if not Path(lib).exists():
                pytest.skip("the test copies Debian x86_64's dash and libc")
            target = rootfs / lib.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(os.path.realpath(lib), target)
    else:
        shutil.copy(busybox, rootfs / "bin" / "sh")
    (rootfs / "etc" / "passwd").write_text("root:x:0:0::/:/bin/sh\napp:x:1000:1000::/:/bin/sh\n")
    exits = Exits()
    driver = make_driver(exits)
    machine = spec("m1", ["/bin/sh", "-c", "echo top: /*"], rootfs, host_runtime=False, user="app")
    await run_machine(driver, machine)
    assert await exits.wait("m1") == ExitStatus(0, None)
    top = set(driver.read_logs("m1", 1)[0].removeprefix("top: ").split())
    assert "/usr" not in top  # nothing of the host
    assert {"/bin", "/etc", "/proc", "/dev", "/tmp"} <= top
    # The machine's process ran as the image's user: uid 1000 of its range on the host.
    status = (driver._run_dirs.path("m1") / "status" / "exit").read_text()
    assert status == "0\n"


async def test_a_dead_netd_is_replaced_and_running_machines_get_their_network_back(
    make_driver, image: Path, run_root: Path
) -> None:
    exits = Exits()
    driver = make_driver(exits)
    (port,) = driver.hold_ports("m1", range(23200, 23300), 1)
    ports = (PortMapping(port, 8080),)
    await driver.publish("m1", ports)
    serve = "echo ready; exec python3 -m http.server 8080 --bind 127.0.0.1"
    await run_machine(driver, spec("m1", sh(serve), image, ports=ports))
    await logged(driver, "m1", "ready")
    await wait_until(lambda: _answers(port), "the machine to serve")

    assert kill_netd(run_root)  # its hub, the machine's veth and the held port go with it
    await wait_until(lambda: not _answers(port), "netd to be gone")
    # The next thing flyd asks of netd starts a new one, which gets the ports back and the
    # running machine its network.
    await driver.publish("m1", ports)
    await wait_until(lambda: _answers(port), "the machine to serve again")
    await driver.stop("m1", signal.SIGTERM, timeout=DEADLINE)


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
            conn.sendall(b"GET / HTTP/1.0\r\n\r\n")
            return conn.recv(12).startswith(b"HTTP/1.0 200")
    except OSError:
        return False


@pytest.fixture
def kind() -> str:
    """Only OCI drivers here (tests/flyd/conftest.py's `make_driver` builds what this says)."""
    if OCI_UNAVAILABLE is not None:
        pytest.skip(f"crun cannot run here: {OCI_UNAVAILABLE}")
    return "oci"


async def test_a_run_root_anyone_can_search_needs_no_bind_of_the_run_dir(prefix: str) -> None:
    """Under /var/lib-like directories crun reaches the run dir as it is; under a 0700 one
    (pytest's, every other test here) each wrapper binds it where crun can."""
    base = Path(tempfile.mkdtemp(prefix="nonomad-test-"))
    os.chmod(base, 0o711)
    (base / "image").mkdir()
    exits = Exits()
    driver = OciDriver(base / "run", on_exit=exits, cgroup_prefix=prefix)
    try:
        assert driver._bind_view is False
        await run_machine(driver, spec("m1", sh("echo hello"), base / "image"))
        assert await exits.wait("m1") == ExitStatus(0, None)
        assert driver.read_logs("m1", 1) == ["hello"]
        # The bundle's spec holds its environment: it was root's alone, and is gone once read.
        assert not (base / "run" / "m1" / "config.json").exists()
    finally:
        await driver.close()
        kill_all(base / "run")
        shutil.rmtree(base)
