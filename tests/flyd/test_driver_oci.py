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
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from flyd.drivers.base import ExitStatus, PortMapping
from flyd.drivers.bundle import CAPABILITIES, Bundle, hold_hook
from flyd.drivers.crun import hybrid_cgroups
from flyd.drivers.namespaces import CLONE_NEWNET, unshare
from flyd.drivers.netclient import kill_netd
from flyd.drivers.oci import UIDS_PER_MACHINE, OciDriver
from flyd.drivers.oci import probe as oci_probe
from flyd.drivers.ports import local_address
from flyd.drivers.rundir import kill_all
from flyd.main import make_driver as make_flyd_driver
from flyd.settings import FlydSettings
from model.errors import InvalidArgument, Unavailable
from runtime import load_settings
from tests import host_ports
from tests.flyd.driver_support import (
    DEADLINE,
    OCI_UNAVAILABLE,
    Exits,
    answers_http,
    cgroup_pids,
    host_address,
    log_lines,
    logged,
    run_machine,
    sh,
    spec,
    upper_layer,
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
    """A writable layer is made holding the mount points crun would make in the upper layer of
    an image that names no base: they become the machine's, owned by its root (it writes /etc as
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
    await logged(driver, "m-own", "mine")  # printed after "wrote": it may come later
    plain_lines = log_lines(driver, "m-plain", 5)
    assert plain_lines[0] == "0 755"  # the machine's root owns its /etc
    own_lines = log_lines(driver, "m-own", 5)
    assert own_lines[0] == "0 750"  # the image's own /etc, not one made ahead
    assert "mine" in own_lines
    upper = upper_layer(driver._run_dirs.path("m-plain"))
    # Made ahead, in its disk file (crun makes its mount points 0700).
    assert (upper / "etc" / "hostname").stat().st_mode & 0o777 == 0o644
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
    # "top:" is printed just before `exec sleep`: wait for the exec to have happened.
    await wait_until(
        lambda: any(_comm(pid) == "sleep" for pid in cgroup_pids(prefix, "m1")),
        "the machine's shell to exec sleep",
    )
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
    (port,) = driver.hold_ports("m1", host_ports.block(100), 1)
    ports = (PortMapping(port, 8080),)
    await driver.publish("m1", ports)
    serve = "echo ready; exec python3 -m http.server 8080 --bind 127.0.0.1"
    await run_machine(driver, spec("m1", sh(serve), image, ports=ports))
    await logged(driver, "m1", "ready")
    await wait_until(lambda: answers_http(port), "the machine to serve")

    assert kill_netd(run_root)  # its hub, the machine's veth and the held port go with it
    await wait_until(lambda: not answers_http(port), "netd to be gone")
    # The next thing flyd asks of netd starts a new one, which gets the ports back and the
    # running machine its network.
    await driver.publish("m1", ports)
    await wait_until(lambda: answers_http(port), "the machine to serve again")
    await driver.stop("m1", signal.SIGTERM, timeout=DEADLINE)


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


# -- what a machine sees of its host (issue 27, attack 10) -------------------------------------


async def test_a_machine_s_sysfs_is_its_own_and_read_only(make_driver, image: Path) -> None:
    """/sys is a sysfs of the machine's own network namespace, mounted read-only, not a bind
    of the host's (read-write, with every host device in /sys/class/net)."""
    exits = Exits()
    driver = make_driver(exits)
    script = (
        "while read -r _ _ _ root point options _; do "
        '[ "$point" = /sys ] && echo "sys: $root $options"; done < /proc/self/mountinfo; '
        "echo net: $(ls /sys/class/net); "
        "echo x > /sys/kernel/uevent_helper 2>/dev/null && echo sys written; "
        "touch /sys/planted 2>/dev/null && echo sys planted; echo done"
    )
    await run_machine(driver, spec("m1", sh(script), image))
    assert await exits.wait("m1") == ExitStatus(0, None)
    lines = log_lines(driver, "m1", 40)
    (sys_mount,) = [line for line in lines if line.startswith("sys: ")]
    root, options = sys_mount.removeprefix("sys: ").split()
    assert root == "/"  # a filesystem of its own, not a bind of part of one
    assert "ro" in options.split(",")
    assert "net: eth0 lo" in lines
    assert "sys written" not in lines
    assert "sys planted" not in lines
    assert lines[-1] == "done"


async def test_a_machine_s_cgroups_are_the_root_of_its_cgroup_namespace(
    make_driver, image: Path
) -> None:
    """/proc/self/cgroup names the machine's own cgroups `/` in every hierarchy, not the host's
    paths (crun's own cgroup namespace would be rooted where crun runs)."""
    exits = Exits()
    driver = make_driver(exits)
    await run_machine(driver, spec("m1", sh("sed 's/^/cgroup: /' /proc/self/cgroup"), image))
    assert await exits.wait("m1") == ExitStatus(0, None)
    lines = [line for line in log_lines(driver, "m1", 40) if line.startswith("cgroup: ")]
    paths = {line.split(":", 3)[2]: line.split(":", 3)[3] for line in lines}
    assert {"memory", "cpu", "pids"} <= paths.keys(), lines
    assert set(paths.values()) == {"/"}, paths  # those, and every other hierarchy


async def test_a_first_start_joins_the_cgroup_namespace_made_with_its_spare_cgroups(
    make_driver, image: Path, prefix: str
) -> None:
    """Made ahead with the spare cgroups (off the start's way), the namespace stays rooted at
    them once they are renamed into the machine's: a first start from a spare joins it."""
    exits = Exits()
    driver = make_driver(exits)
    await run_machine(driver, spec("warm", sh("exec sleep 600"), image))
    await wait_until(lambda: driver._spares.ready > 0, "a spare set")
    made = {os.fstat(fd).st_ino for fd, _ in driver._spares._namespaces.values()}
    assert made
    script = "sed 's/^/cgroup: /' /proc/self/cgroup; exec sleep 600"
    await run_machine(driver, spec("m1", sh(script), image))
    await wait_until(  # (sed writes it all as it ends)
        lambda: any(":pids:" in line for line in log_lines(driver, "m1", 40)), "m1's cgroups"
    )
    (pid, *_) = cgroup_pids(prefix, "m1")
    joined = int(os.readlink(f"/proc/{pid}/ns/cgroup").removeprefix("cgroup:[").rstrip("]"))
    assert joined in made
    lines = [line for line in log_lines(driver, "m1", 40) if line.startswith("cgroup: ")]
    assert {line.split(":", 3)[3] for line in lines} == {"/"}
    for mid in ("warm", "m1"):
        await driver.stop(mid, signal.SIGTERM, DEADLINE)


UEVENT_LISTENER = """\
import select, signal, socket, sys
sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 15)  # NETLINK_KOBJECT_UEVENT
sock.bind((0, 1))
got = []
def report(*_):
    sock.setblocking(False)
    while select.select([sock], [], [], 0)[0]:  # what came before the signal, read or not
        got.append(sock.recv(65536))
    print("uevents:", [part for g in got for part in g.split(b"\\0") if b"SYNTH_UUID" in part])
    sys.exit(0)
signal.signal(signal.SIGTERM, report)
print("listening", flush=True)
while True:
    got.append(sock.recv(65536))
"""


def _uevent_socket() -> socket.socket:
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_KOBJECT_UEVENT)
    sock.bind((0, 1))
    sock.setblocking(False)
    return sock


def _in_a_new_network_namespace(make: Callable[[], socket.socket]) -> socket.socket:
    """`make()` run in a network namespace of the host's users (as machines' were before),
    by a thread that ends there: the socket keeps the namespace."""
    made: list[socket.socket] = []

    def run() -> None:
        unshare(CLONE_NEWNET)
        made.append(make())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return made[0]


def _uuids(sock: socket.socket) -> set[str]:
    found = set()
    with contextlib.suppress(BlockingIOError):
        while True:
            for part in sock.recv(65536).split(b"\0"):
                if part.startswith(b"SYNTH_UUID="):
                    found.add(part.removeprefix(b"SYNTH_UUID=").decode())
    return found


async def test_no_host_uevent_reaches_a_machine(make_driver, image: Path) -> None:
    """The host's kernel uevents go to every network namespace the initial user namespace
    owns (the test's own, and one it makes as machines' were), never to a machine's, whose
    own user namespace owns it. The uevents are synthetic `change` events of /dev/null,
    each with a UUID of the test's: nothing on the host is added or removed (a veth made in
    a namespace of the test's would not do: a network device's uevents stay in its
    namespace)."""
    if not Path(NULL_UEVENT).is_file():
        pytest.skip(f"no {NULL_UEVENT} to trigger a uevent with")
    host = _uevent_socket()
    owned_by_host = _in_a_new_network_namespace(_uevent_socket)
    exits = Exits()
    driver = make_driver(exits)
    try:
        await run_machine(driver, spec("m1", ["python3", "-c", UEVENT_LISTENER], image))
        await logged(driver, "m1", "listening")
        sent = set()
        for _ in range(3):
            event = str(uuid.uuid4())
            Path(NULL_UEVENT).write_text(f"change {event} NONOMAD=test")
            sent.add(event)
        seen: set[str] = set()
        elsewhere: set[str] = set()

        def all_arrived() -> bool:
            seen.update(_uuids(host))
            elsewhere.update(_uuids(owned_by_host))
            return sent <= seen and sent <= elsewhere

        # Broadcast at once to every listener it goes to: once these have them, the machine
        # would have too.
        await wait_until(all_arrived, "the host's listeners to receive the uevents")
        await driver.stop("m1", signal.SIGTERM, timeout=DEADLINE)
        (report,) = [line for line in log_lines(driver, "m1", 20) if line.startswith("uevents:")]
        assert report == "uevents: []"
    finally:
        host.close()
        owned_by_host.close()


NULL_UEVENT = "/sys/devices/virtual/mem/null/uevent"
NETLINK_KOBJECT_UEVENT = 15  # (the socket module has no name for it)


# -- where published ports are bound (issue 27) --------------------------------------------------


def _listeners(port: int) -> list[str]:
    """The addresses TCP sockets listen on for `port` in this (the host's) namespace."""
    found = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, _, state = line.split()[1:4]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:
            found.append(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


async def test_a_published_port_is_bound_on_machine_host_alone(make_driver, image: Path) -> None:
    """On a worker whose machine_host is not a loopback address, netd listens on that address
    alone, not on 0.0.0.0 (every other interface of the host, a public one included): the port
    stays free on loopback for anyone. Nothing is sent to that address: the test reads the
    host's socket table."""
    address = host_address()
    if address is None:
        pytest.skip("this host has no address but loopback ones")
    exits = Exits()
    driver = make_driver(exits, machine_host=address)
    (port,) = driver.hold_ports("m1", host_ports.block(100), 1)
    ports = (PortMapping(port, 8080),)
    await driver.publish("m1", ports)
    serve = "exec python3 -m http.server 8080 --bind 127.0.0.1"
    await run_machine(driver, spec("m1", sh(serve), image, ports=ports))
    await wait_until(lambda: bool(_listeners(port)), "netd to listen for the machine")
    assert _listeners(port) == [address]
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))  # free there: nobody took every address
    await driver.stop("m1", signal.SIGTERM, timeout=DEADLINE)


def test_a_machine_host_that_is_not_of_this_host_is_refused(run_root: Path, prefix: str) -> None:
    elsewhere = "203.0.113.7"  # TEST-NET-3: documentation only
    if local_address(elsewhere) is not None:
        pytest.skip(f"{elsewhere} is an address of this host")
    with pytest.raises(InvalidArgument, match="machine_host"):
        OciDriver(run_root, on_exit=Exits(), cgroup_prefix=prefix, machine_host=elsewhere)
    assert not (run_root / ".netd.sock").exists()  # nothing started


def test_flyd_with_a_machine_host_not_of_this_host_exits_saying_so(
    tmp_path: Path, prefix: str
) -> None:
    elsewhere = "203.0.113.7"  # TEST-NET-3: documentation only
    if local_address(elsewhere) is not None:
        pytest.skip(f"{elsewhere} is an address of this host")
    argv = ["--driver", "oci", "--cgroup-prefix", prefix, "--data-dir", str(tmp_path / "data")]
    settings = load_settings(FlydSettings, [*argv, "--machine-host", elsewhere], prog="flyd")
    with pytest.raises(SystemExit, match=r"machine_host: 203\.0\.113\.7 is not an address"):
        make_flyd_driver(settings, Exits())
