"""What only the OCI driver does: hardening, an image's own rootfs and user, netd dying under it,
and the pieces it parses (hybrid cgroups, crun's state on the hold hook's stdin).

Real containers (skipped, with the reason, where crun cannot run), on a run root of the test's
own; nothing waits on wall-clock time.
"""

from __future__ import annotations

import contextlib
import json
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
from flyd.drivers.oci import UIDS_PER_MACHINE, OciDriver
from flyd.drivers.oci import probe as oci_probe
from flyd.drivers.rundir import kill_all
from flyd.errors import Unavailable
from flyd.main import make_driver as make_flyd_driver
from flyd.settings import FlydSettings
from runtime import load_settings
from tests.flyd.driver_support import (
    DEADLINE,
    OCI_UNAVAILABLE,
    Exits,
    cgroup_pids,
    log_lines,
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
    lines = log_lines(driver, "m1", 20)
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


async def test_the_crun_running_a_machine_is_read_only_where_it_runs(
    make_driver, image: Path
) -> None:
    """crun's guard against a container rewriting its binary (CVE-2019-5736), which lets crun
    skip copying itself: the crun that runs a machine is the host's binary, on a read-only
    bind in the wrapper's mount namespace, and the host's own mount of it is left as it was."""
    exits = Exits()
    driver = make_driver(exits)
    handle = await run_machine(driver, spec("m1", sh("echo up; exec sleep 600"), image))
    await logged(driver, "m1", "up")
    children = Path(f"/proc/{handle.pid}/task/{handle.pid}/children").read_text().split()
    crun = shutil.which("crun")
    assert crun is not None
    crun = os.path.realpath(crun)
    runs_crun = [pid for pid in children if os.readlink(f"/proc/{pid}/exe") == crun]
    assert len(runs_crun) == 1, [os.readlink(f"/proc/{pid}/exe") for pid in children]
    assert os.statvfs(f"/proc/{runs_crun[0]}/exe").f_flag & os.ST_RDONLY
    binds = [
        line.split()
        for line in Path(f"/proc/{runs_crun[0]}/mountinfo").read_text().splitlines()
        if line.split()[4] == crun
    ]
    assert binds, "no bind of crun where it runs"
    assert "ro" in binds[-1][5].split(",")
    assert not os.statvfs(crun).f_flag & os.ST_RDONLY
    await driver.stop("m1", signal.SIGTERM, 5.0)


async def test_a_start_gets_the_namespaces_netd_made_ahead_for_it(
    make_driver, image: Path, prefix: str, run_root: Path
) -> None:
    """After answering a start, netd makes spare network namespaces and the user namespace of
    the uid range flyd said comes next; the next new machine runs in that one, mapped to its
    own range (netd never hands out a user namespace a machine has used)."""
    exits = Exits()
    driver = make_driver(exits)
    await run_machine(driver, spec("m1", sh("echo up; exec sleep 600"), image))
    await logged(driver, "m1", "up")
    netd = json.loads((run_root / ".netd.json").read_text())["pid"]

    def held_user_namespaces() -> set[str]:
        links = set()
        for fd in Path(f"/proc/{netd}/fd").iterdir():
            with contextlib.suppress(OSError):
                links.add(os.readlink(fd))
        return {link for link in links if link.startswith("user:")}

    def init_user_namespace(machine_id: str) -> str:
        pids = cgroup_pids(prefix, machine_id)
        return os.readlink(f"/proc/{pids[0]}/ns/user")

    m1_userns = init_user_namespace("m1")
    await wait_until(lambda: len(held_user_namespaces() - {m1_userns}) == 1, "a spare userns")
    (spare,) = held_user_namespaces() - {m1_userns}
    await run_machine(driver, spec("m2", sh("echo up; exec sleep 600"), image))
    await logged(driver, "m2", "up")
    assert init_user_namespace("m2") == spare
    pid = cgroup_pids(prefix, "m2")[0]
    first, host, count = Path(f"/proc/{pid}/uid_map").read_text().split()
    assert (first, int(count)) == ("0", UIDS_PER_MACHINE)
    m1_host = Path(f"/proc/{cgroup_pids(prefix, 'm1')[0]}/uid_map").read_text().split()[1]
    assert int(host) == int(m1_host) + UIDS_PER_MACHINE  # the next slot's range
    for mid in ("m1", "m2"):
        await driver.stop(mid, signal.SIGTERM, 5.0)


async def test_a_first_start_from_a_spare_gets_its_mount_points_made_ahead_as_its_own(
    make_driver, tmp_path: Path
) -> None:
    """A spare run dir holds the mount points crun would make in the upper layer of an image
    that names no base: they become the machine's, owned by its root (it writes /etc as
    before), except where the image has its own, which stays as the image has it."""
    exits = Exits()
    driver = make_driver(exits)
    plain = tmp_path / "plain"
    plain.mkdir()
    own_etc = tmp_path / "own-etc"
    (own_etc / "etc").mkdir(parents=True)
    (own_etc / "etc" / "app.conf").write_text("mine\n")
    os.chmod(own_etc / "etc", 0o750)
    script = "stat -c '%u %a' /etc; touch /etc/new && echo wrote; cat /etc/app.conf; exec sleep 600"
    await run_machine(driver, spec("warm", sh("exec sleep 600"), plain, host_runtime=True))
    for mid, image in (("m-plain", plain), ("m-own", own_etc)):
        await wait_until(lambda: driver._spares.ready > 0, "a spare run dir")
        await run_machine(driver, spec(mid, sh(script), image, host_runtime=True))
        await logged(driver, mid, "wrote")
    plain_lines = log_lines(driver, "m-plain", 5)
    assert plain_lines[0] == "0 755"  # the machine's root owns its /etc
    own_lines = log_lines(driver, "m-own", 5)
    assert own_lines[0] == "0 750"  # the image's own /etc, not one made ahead
    assert "mine" in own_lines
    upper = driver._run_dirs.path("m-plain") / "upper"
    # Made ahead (crun makes its mount points 0700), and taken: none is left to take again.
    assert (upper / "etc" / "hostname").stat().st_mode & 0o777 == 0o644
    assert not (driver._run_dirs.path("m-plain") / "mountpoints").exists()
    for mid in ("warm", "m-plain", "m-own"):
        await driver.stop(mid, signal.SIGTERM, 5.0)


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
    make_driver, tmp_path: Path, prefix: str
) -> None:
    """A rootfs of its own (Debian's dash, sleep and libc, copied in), no host directory lent,
    and the image's user by name from its own /etc/passwd: uid 1000 inside, the 1000th uid of
    the machine's range on the host."""
    rootfs = tmp_path / "own"
    (rootfs / "etc").mkdir(parents=True)
    files = {
        "/bin/dash": "bin/sh",
        "/usr/bin/sleep": "bin/sleep",
        "/lib/x86_64-linux-gnu/libc.so.6": "lib/x86_64-linux-gnu/libc.so.6",
        "/lib64/ld-linux-x86-64.so.2": "lib64/ld-linux-x86-64.so.2",
    }
    for source, target in files.items():
        if not Path(source).exists():
            pytest.skip("the test copies Debian x86_64's dash, sleep and libc")
        (rootfs / target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.realpath(source), rootfs / target)
    (rootfs / "etc" / "passwd").write_text("root:x:0:0::/:/bin/sh\napp:x:1000:1000::/:/bin/sh\n")
    exits = Exits()
    driver = make_driver(exits)
    script = (
        "while read -r key real effective rest; do "
        '[ "$key" = Uid: ] && echo "uid: $real $effective"; done < /proc/self/status; '
        "echo top: /*; exec sleep 1000"
    )
    machine = spec("m1", ["/bin/sh", "-c", script], rootfs, host_runtime=False, user="app")
    await run_machine(driver, machine)
    await wait_until(lambda: _line(driver, "top: ") is not None, "the machine to list /")
    top = set(str(_line(driver, "top: ")).split())
    assert "/usr" not in top  # nothing of the host
    assert {"/bin", "/etc", "/proc", "/dev", "/tmp"} <= top
    assert _line(driver, "uid: ") == "1000 1000"  # real and effective: the image's "app"
    # On the host, the same process is uid 1000 of the machine's own range.
    slot = int((driver._run_dirs.path("m1") / "slot").read_text())
    expected = (1 << 30) + slot * UIDS_PER_MACHINE + 1000
    (sleeper,) = [pid for pid in cgroup_pids(prefix, "m1") if _comm(pid) == "sleep"]
    uid_line = next(
        line.split()
        for line in Path(f"/proc/{sleeper}/status").read_text().splitlines()
        if line.startswith("Uid:")
    )
    assert [int(u) for u in uid_line[1:]] == [expected] * 4  # real, effective, saved, fs
    await driver.stop("m1", signal.SIGTERM, timeout=DEADLINE)


def _line(driver: OciDriver, prefix: str) -> str | None:
    """The rest of m1's first log line that starts with `prefix`, if it printed one."""
    lines = [line for line in log_lines(driver, "m1", 20) if line.startswith(prefix)]
    return lines[0].removeprefix(prefix) if lines else None


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


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
        assert log_lines(driver, "m1", 1) == ["hello"]
        # The bundle's spec holds its environment: it was root's alone, and is gone once read.
        assert not (base / "run" / "m1" / "config.json").exists()
    finally:
        await driver.close()
        kill_all(base / "run")
        shutil.rmtree(base)


@pytest.mark.skipif(OCI_UNAVAILABLE is not None, reason=f"crun cannot run here: {OCI_UNAVAILABLE}")
async def test_a_cgroup_v2_only_host_gets_no_oci_machines_without_limits(
    tmp_path: Path, prefix: str
) -> None:
    """The OCI driver limits machines with cgroup v1 alone: on a host with only cgroup v2
    (a directory laid out as one here) `--driver oci` stops flyd saying so, and `auto` runs
    the process driver, with the reason logged, rather than OCI machines without limits."""
    v2 = tmp_path / "cgroup"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("cpu memory pids\n")
    (v2 / "cgroup.procs").write_text("")
    problem = oci_probe(v2)
    assert problem is not None
    assert "cgroup v2" in problem
    with pytest.raises(Unavailable, match="cgroup v2"):
        OciDriver(tmp_path / "run", on_exit=Exits(), cgroup_root=v2, cgroup_prefix=prefix)

    def settings(driver: str) -> FlydSettings:
        argv = ["--driver", driver, "--cgroup-root", str(v2), "--cgroup-prefix", prefix]
        argv += ["--data-dir", str(tmp_path / "data")]
        return load_settings(FlydSettings, argv, prog="flyd")

    with pytest.raises(SystemExit, match="cgroup v2"):
        make_flyd_driver(settings("oci"), Exits())
    fallback = make_flyd_driver(settings("auto"), Exits())
    try:
        assert fallback.name == "process"
    finally:
        await fallback.close()
