"""A machine is a sandbox: each boundary of an OCI machine, proved by a probe inside one.

Real flyd processes with the OCI driver (skipped, with the reason, where crun cannot run). The
probe is a program run as a machine: it tries what a hostile tenant would and prints what it
could do; the test checks that from the host too (its uid in the host's /proc, the host's
ports, the image cache). Traffic stays on 127.0.0.1 and inside namespaces flyd made.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import socket
import stat
import subprocess
import tarfile
import uuid
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration

from flyd.images.build import build_image
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from flyd.v1 import worker_pb2_grpc
from model.images.owners import PUBLIC
from tests.conftest import DEMO_APP
from tests.flyd.driver_support import OCI_UNAVAILABLE, gone, loops_under, upper_layer
from tests.flyd.process_support import http_get, machine_address, wait_state
from tests.harness import ServiceProcess

pytestmark = pytest.mark.skipif(
    OCI_UNAVAILABLE is not None, reason=f"crun cannot run here: {OCI_UNAVAILABLE}"
)

S = pb.MachineState
Stub = worker_pb2_grpc.WorkerServiceStub
DEADLINE = 30.0
UID_BASE = 1 << 30

PROBE = """\
import json, os, socket, sys

args = json.loads(sys.argv[1])
seen = {"uid": os.getuid(), "hostname": socket.gethostname()}
seen["pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
try:
    open(args["host_file"]).read()
    seen["host_file"] = "read"
except OSError as e:
    seen["host_file"] = type(e).__name__


def connect(host, port):
    try:
        with socket.create_connection((host, port), timeout=2):
            return "connected"
    except OSError as e:
        return type(e).__name__


seen["loopback"] = {str(p): connect("127.0.0.1", p) for p in args["host_ports"]}
seen["other_machine"] = connect(args["other_address"], args["other_port"])
listener = socket.socket()
listener.bind(("0.0.0.0", args["bind_port"]))
listener.listen()
seen["bound"] = args["bind_port"]

# Its image's files and directories are its own to change (in its own upper layer).
written = 0
for path in ("/app.py", "/probe.py", "/data/config.txt"):
    with open(path, "a") as f:
        f.write("tampered")
    written += 1
for directory in ("/", "/data"):
    with open(os.path.join(directory, "planted"), "w") as f:
        f.write("planted")
    written += 1
seen["written"] = written
print("PROBE " + json.dumps(seen), flush=True)
listener.accept()  # holds the port until stopped
"""


@pytest.fixture(scope="module")
def image_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`probe:v1` (the probe above) and `demo:v1`, both with no base (the host's runtime),
    and `based:v1`, a script on a base of its own: a shell and its libc, nothing else.
    """
    root = tmp_path_factory.mktemp("sandbox-images")
    src = tmp_path_factory.mktemp("probe-src")
    (src / "probe.py").write_text(PROBE)
    (src / "app.py").write_text(DEMO_APP)
    (src / "data").mkdir()
    (src / "data" / "config.txt").write_text("the image's own file\n")
    build_image(
        src, root, name="probe", tag="v1", entrypoint=["python3", "-u", "probe.py"], owners=PUBLIC
    )
    build_image(
        src, root, name="demo", tag="v1", entrypoint=["python3", "-u", "app.py"], owners=PUBLIC
    )
    base = tmp_path_factory.mktemp("base") / "shell.tar"
    with tarfile.open(base, "w") as tf:
        tf.add("/bin/dash", "bin/sh")
        for lib in ("/lib/x86_64-linux-gnu/libc.so.6", "/lib64/ld-linux-x86-64.so.2"):
            tf.add(os.path.realpath(lib), lib.lstrip("/"))
    script = tmp_path_factory.mktemp("script")
    (script / "hello.sh").write_text("echo own rootfs: /*\n")
    build_image(
        script,
        root,
        name="based",
        tag="v1",
        entrypoint=["/bin/sh", "/hello.sh"],
        base=base,
        owners=PUBLIC,
    )
    return root


def guest(memory_mib: int = 64) -> pb.GuestConfig:
    return pb.GuestConfig(cpu_millicores=200, memory_mib=memory_mib)


async def log_line(stub: Stub, machine_id: str, prefix: str) -> str:
    """The first line the machine printed that starts with `prefix` (waiting for it)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while True:
        stream = stub.GetMachineLogs(
            w.GetMachineLogsRequest(machine_id=machine_id, tail_lines=200), timeout=DEADLINE
        )
        for line in [item.line async for item in stream]:
            if line.startswith(prefix):
                return line.removeprefix(prefix)
        assert loop.time() < deadline, f"{machine_id} never printed {prefix!r}"
        await asyncio.sleep(0.05)


def tree_digest(root: Path) -> str:
    """Every path, mode, owner and byte under `root`."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            path = Path(dirpath) / name
            st = path.lstat()
            h.update(f"{path.relative_to(root)} {st.st_mode:o} {st.st_uid} {st.st_gid}\n".encode())
            if stat.S_ISREG(st.st_mode):
                h.update(path.read_bytes())
    return h.hexdigest()


def host_pid(token: str) -> int:
    """The host pid of the machine's process whose command line holds `token`."""
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if token.encode() in cmdline and b"python3" in cmdline.split(b"\0")[0]:
            return int(entry.name)
    raise AssertionError(f"no process with {token!r}")


def host_uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[2])  # effective
    raise AssertionError("no Uid line")


def port_free_on_host(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


async def test_a_probe_machine_reaches_nothing_of_the_host(
    flyd_factory: Callable[..., ServiceProcess],
    stub_for: Callable[[str], Stub],
    tmp_path: Path,
    host_listener: int,
) -> None:
    flyd = flyd_factory("--driver", "oci")
    stub = stub_for(flyd.address)
    secret = tmp_path / "host-secret"
    secret.write_text("only for the host\n")
    os.chmod(secret, 0o644)  # readable by anyone on the host: the namespace is what hides it

    # Another app's machine, serving on its own port in its own namespace.
    other = (
        await stub.CreateMachine(
            w.CreateMachineRequest(
                app="other",
                config=pb.MachineConfig(
                    image="demo:v1", guest=guest(), services=[pb.ServiceConfig(internal_port=8080)]
                ),
            ),
            timeout=DEADLINE,
        )
    ).machine
    other_address = machine_address(flyd_dir(tmp_path) / "machines", other.id)
    flyd_port = int(flyd.address.rsplit(":", 1)[1])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        bind_port = s.getsockname()[1]  # free on the host now; the probe binds it inside
    token = f"probe-{uuid.uuid4().hex}"
    args = {
        "token": token,
        "host_file": str(secret),
        "host_ports": [flyd_port, host_listener, other.ports[0].host_port],
        "other_address": other_address,
        "other_port": 8080,
        "bind_port": bind_port,
    }
    probe = (
        await stub.CreateMachine(
            w.CreateMachineRequest(
                app="probe",
                config=pb.MachineConfig(image="probe:v1", guest=guest(), cmd=[json.dumps(args)]),
            ),
            timeout=DEADLINE,
        )
    ).machine
    seen = json.loads(await log_line(stub, probe.id, "PROBE "))

    # Root in its own user namespace, a host uid of its own range on the host.
    pid = host_pid(token)
    assert seen["uid"] == 0
    assert host_uid(pid) >= UID_BASE
    assert host_uid(pid) != 0
    assert seen["hostname"] == probe.id
    # Its own processes only: tini (1) and the probe.
    assert seen["pids"] == [1, 2]
    assert seen["host_file"] == "FileNotFoundError"
    # The host's loopback (flyd, another service, the other machine's published port) is not
    # its loopback; the other machine's address is not routed to it.
    assert set(seen["loopback"].values()) == {"ConnectionRefusedError"}
    assert seen["other_machine"] in ("OSError", "TimeoutError", "ConnectionRefusedError")
    # It listens on a port in its own namespace: the host's port stays free.
    assert port_free_on_host(bind_port)
    assert seen["written"] == 5  # it wrote (into its own upper layer)...
    for entry in (flyd_dir(tmp_path) / "images" / "images").iterdir():  # ... not the cache
        assert not (entry / "rootfs" / "planted").exists()
        assert (entry / "rootfs" / "data" / "config.txt").read_text() == "the image's own file\n"
    assert not gone(pid)


def flyd_dir(tmp_path: Path, worker_id: str = "w1") -> Path:
    return tmp_path / f"flyd-{worker_id}"


async def test_the_image_cache_is_byte_identical_after_a_machine_wrote_everywhere(
    flyd_factory: Callable[..., ServiceProcess], stub_for: Callable[[str], Stub], tmp_path: Path
) -> None:
    flyd = flyd_factory("--driver", "oci")
    stub = stub_for(flyd.address)
    scribble = (
        "for f in $(find / -xdev \\( -path /proc -o -path /sys -o -path /dev \\) -prune "
        "-o -print 2>/dev/null | head -2000); do "
        '[ -f "$f" ] && echo x >> "$f"; [ -d "$f" ] && touch "$f/planted"; '
        'chmod 777 "$f"; done 2>/dev/null; echo done scribbling; exec sleep 1000'
    )
    # The image pulled by a machine that writes nothing (it is never started), then its digest
    # taken before any machine that writes has run.
    inert = pb.MachineConfig(image="probe:v1", guest=guest(), entrypoint=["true"])
    await stub.CreateMachine(w.CreateMachineRequest(app="a", config=inert, skip_launch=True))
    images = flyd_dir(tmp_path) / "images" / "images"
    (entry,) = list(images.iterdir())
    before = tree_digest(entry / "rootfs")
    cfg = pb.MachineConfig(image="probe:v1", guest=guest(), entrypoint=["sh", "-c", scribble])
    first = (await stub.CreateMachine(w.CreateMachineRequest(app="a", config=cfg))).machine
    await log_line(stub, first.id, "done scribbling")
    second = (await stub.CreateMachine(w.CreateMachineRequest(app="a", config=cfg))).machine
    await log_line(stub, second.id, "done scribbling")

    assert tree_digest(entry / "rootfs") == before
    # What they wrote is theirs: each in its own upper layer (in its own disk file).
    upper = upper_layer(flyd_dir(tmp_path) / "machines" / first.id)
    assert (upper / "planted").exists()
    assert (upper / "data" / "config.txt").read_text() == "the image's own file\nx\n"
    for machine in (first, second):
        await stub.DestroyMachine(w.DestroyMachineRequest(machine_id=machine.id, force=True))
        await wait_state(stub, machine.id, S.MACHINE_STATE_DESTROYED)
    assert not (flyd_dir(tmp_path) / "machines" / first.id).exists()  # upper layer and all


@pytest.mark.skipif(
    not Path("/lib64/ld-linux-x86-64.so.2").exists(), reason="the test base is x86_64 Debian's"
)
async def test_an_image_with_a_base_runs_on_its_own_rootfs_alone(
    flyd_factory: Callable[..., ServiceProcess], stub_for: Callable[[str], Stub]
) -> None:
    flyd = flyd_factory("--driver", "oci")
    stub = stub_for(flyd.address)
    cfg = pb.MachineConfig(
        image="based:v1", guest=guest(), restart=pb.RestartPolicy(mode=pb.RESTART_MODE_NO)
    )
    machine = (await stub.CreateMachine(w.CreateMachineRequest(app="b", config=cfg))).machine
    stopped = await wait_state(stub, machine.id, S.MACHINE_STATE_STOPPED)
    assert stopped.last_exit.exit_code == 0
    top = (await log_line(stub, machine.id, "own rootfs: ")).split()
    # Its base's directories and the ones every machine gets: no /usr, nothing of the host.
    assert set(top) == {
        "/bin",
        "/dev",
        "/etc",
        "/hello.sh",
        "/lib",
        "/lib64",
        "/proc",
        "/sys",
        "/tmp",
    }


REPO = Path(__file__).resolve().parents[2]
DEBIAN = """\
import os, sys
print("debian", open("/etc/debian_version").read().strip(), sys.executable, flush=True)
print("host files", [path for path in sys.argv[1:] if os.path.exists(path)], flush=True)
"""


@pytest.fixture(scope="session")
def debian_base() -> Path:
    """The Debian base `make base-image` builds with mmdebstrap (kept in the repo's .nonomad/,
    ignored by git, so it is built once); skipped where it cannot be built here."""
    path = REPO / ".nonomad" / "base" / "debian.tar"
    try:
        done = subprocess.run(
            ["make", "-s", "base-image", f"BASE_IMAGE={path}"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=540,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"make base-image cannot run here: {e}")
    if done.returncode != 0:
        pytest.skip(
            "make base-image could not build a Debian base here (mmdebstrap needs apt and "
            f"Debian's package mirror): {done.stderr.strip()[-300:]}"
        )
    return path


@pytest.mark.timeout(600)  # a first `make base-image` downloads and unpacks ~60 packages
async def test_a_directory_image_on_the_debian_base_make_builds_runs_on_it_alone(
    flyd_factory: Callable[..., ServiceProcess],
    stub_for: Callable[[str], Stub],
    image_source: Path,
    debian_base: Path,
    tmp_path: Path,
) -> None:
    src = tmp_path / "debian-src"
    src.mkdir()
    (src / "hello.py").write_text(DEBIAN)
    build_image(
        src,
        image_source,
        name="debian-hello",
        tag="v1",
        entrypoint=["python3", "-u", "/hello.py"],
        base=debian_base,
        owners=PUBLIC,
    )
    flyd = flyd_factory("--driver", "oci")
    stub = stub_for(flyd.address)
    host_files = [str(src / "hello.py"), str(REPO / "README.md")]
    cfg = pb.MachineConfig(
        image="debian-hello:v1",
        guest=guest(),
        cmd=host_files,
        restart=pb.RestartPolicy(mode=pb.RESTART_MODE_NO),
    )
    machine = (await stub.CreateMachine(w.CreateMachineRequest(app="d", config=cfg))).machine
    stopped = await wait_state(stub, machine.id, S.MACHINE_STATE_STOPPED)
    assert stopped.last_exit.exit_code == 0, await log_line(stub, machine.id, "")
    # Debian 12's own python3, from the base's /usr (nothing of the host's is lent)...
    version, executable = (await log_line(stub, machine.id, "debian ")).split()
    assert version.startswith("12.")
    assert executable == "/usr/bin/python3"
    # ... and none of the host's files.
    assert await log_line(stub, machine.id, "host files ") == "[]"


@pytest.mark.skipif(
    not (Path("/sys/fs/cgroup/pids") / "cgroup.procs").is_file(),
    reason="no cgroup v1 pids controller at /sys/fs/cgroup/pids: nothing would stop the bomb",
)
async def test_a_fork_bomb_stops_at_the_pids_limit_and_the_worker_stays_healthy(
    flyd_factory: Callable[..., ServiceProcess], stub_for: Callable[[str], Stub], tmp_path: Path
) -> None:
    flyd = flyd_factory("--driver", "oci")
    stub = stub_for(flyd.address)
    bomb = "echo bombing; b() { b | b & }; b; exec sleep 1000"
    cfg = pb.MachineConfig(
        image="probe:v1",
        # The pids limit comes first (its own, from the config), well before the memory's.
        guest=pb.GuestConfig(cpu_millicores=500, memory_mib=512, pids_max=300),
        entrypoint=["sh", "-c", bomb],
    )
    machine = (await stub.CreateMachine(w.CreateMachineRequest(app="bomb", config=cfg))).machine
    await log_line(stub, machine.id, "bombing")
    prefix = next(a for a in flyd.args if a.startswith("nonomad-test-"))
    procs = Path("/sys/fs/cgroup/pids") / prefix / machine.id
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    assert int((procs / "pids.max").read_text()) == 300
    cpu = Path("/sys/fs/cgroup/cpu") / prefix / machine.id
    assert int((cpu / "cpu.shares").read_text()) == 512  # half a core's weight
    assert int((cpu / "cpu.cfs_quota_us").read_text()) == 50_000  # and at most half a core
    # The kernel refused forks at the limit (pids.events counts them).
    while (procs / "pids.events").read_text().split() == ["max", "0"]:
        assert loop.time() < deadline, "the bomb never reached its limit"
        await asyncio.sleep(0.05)
    assert int((procs / "pids.current").read_text()) <= 300

    # flyd answers and starts other machines as usual meanwhile.
    t0 = loop.time()
    await stub.GetCapacity(w.GetCapacityRequest(), timeout=5)
    demo = pb.MachineConfig(
        image="demo:v1", guest=guest(), services=[pb.ServiceConfig(internal_port=8080)]
    )
    healthy = (await stub.CreateMachine(w.CreateMachineRequest(app="d", config=demo))).machine
    assert healthy.state == S.MACHINE_STATE_STARTED
    assert loop.time() - t0 < DEADLINE

    await stub.DestroyMachine(w.DestroyMachineRequest(machine_id=machine.id, force=True))
    await wait_state(stub, machine.id, S.MACHINE_STATE_DESTROYED)
    assert not procs.exists()  # every process of it gone, its cgroups removed


async def test_a_machine_s_pids_limit_is_its_config_s_or_the_default_and_bounded(
    flyd_factory: Callable[..., ServiceProcess], stub_for: Callable[[str], Stub]
) -> None:
    flyd = flyd_factory("--driver", "oci")
    stub = stub_for(flyd.address)
    prefix = next(a for a in flyd.args if a.startswith("nonomad-test-"))
    for bad in (5, 40000, -1):
        cfg = pb.MachineConfig(
            image="demo:v1", guest=pb.GuestConfig(cpu_millicores=100, memory_mib=64, pids_max=bad)
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.CreateMachine(w.CreateMachineRequest(app="p", config=cfg), timeout=DEADLINE)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "config.guest.pids_max" in str(err.value.details())
    cfg = pb.MachineConfig(image="demo:v1", guest=pb.GuestConfig(cpu_millicores=100, memory_mib=64))
    machine = (await stub.CreateMachine(w.CreateMachineRequest(app="p", config=cfg))).machine
    cgroup = Path("/sys/fs/cgroup")
    assert (cgroup / "pids" / prefix / machine.id / "pids.max").read_text() == "1024\n"
    assert (cgroup / "cpu" / prefix / machine.id / "cpu.shares").read_text() == "102\n"


async def test_a_machine_over_its_memory_is_oom_killed_and_reported(
    flyd_factory: Callable[..., ServiceProcess], stub_for: Callable[[str], Stub]
) -> None:
    flyd = flyd_factory("--driver", "oci")
    stub = stub_for(flyd.address)
    hog = "b = bytearray(128 << 20); print(len(b))"  # twice its 64 MiB
    cfg = pb.MachineConfig(
        image="probe:v1",
        guest=guest(64),
        entrypoint=["python3", "-c", hog],
        restart=pb.RestartPolicy(mode=pb.RESTART_MODE_NO),
    )
    machine = (await stub.CreateMachine(w.CreateMachineRequest(app="hog", config=cfg))).machine
    stopped = await wait_state(stub, machine.id, S.MACHINE_STATE_STOPPED)
    assert stopped.last_exit.oom_killed
    assert stopped.last_exit.signal == "SIGKILL"


async def test_no_machine_can_hold_a_host_port_it_was_not_given(
    flyd_factory: Callable[..., ServiceProcess], stub_for: Callable[[str], Stub]
) -> None:
    flyd = flyd_factory("--driver", "oci")
    stub = stub_for(flyd.address)
    # A stopped standby: its port is held all the same, by netd.
    demo = pb.MachineConfig(
        image="demo:v1", guest=guest(), services=[pb.ServiceConfig(internal_port=8080)]
    )
    standby = (
        await stub.CreateMachine(
            w.CreateMachineRequest(app="d", config=demo, skip_launch=True), timeout=DEADLINE
        )
    ).machine
    port = standby.ports[0].host_port
    assert not port_free_on_host(port)
    # A machine serving `python3 -m http.server` on that very number binds it in its own
    # namespace only; the standby's port stays the standby's.
    squatter = pb.MachineConfig(
        image="probe:v1",
        guest=guest(),
        entrypoint=["python3", "-m", "http.server", str(port)],
    )
    await stub.CreateMachine(w.CreateMachineRequest(app="s", config=squatter), timeout=DEADLINE)
    started = (await stub.StartMachine(w.StartMachineRequest(machine_id=standby.id))).machine
    assert started.state == S.MACHINE_STATE_STARTED
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while True:
        try:
            body = await asyncio.to_thread(http_get, port)
            break
        except OSError:
            assert loop.time() < deadline
            await asyncio.sleep(0.05)
    assert body == f"hello from {standby.id}\n"


# -- flyd killed mid-operation -------------------------------------------------------------------


def netd_namespaces(machines: Path) -> int:
    """How many machines' network namespaces netd holds: not its hub's nor the host's, nor
    the spares it makes ahead (a spare has no link but its loopback until a machine's eth0)."""
    pid = json.loads((machines / ".netd.json").read_text())["pid"]
    own = {os.readlink(f"/proc/{pid}/ns/net"), os.readlink("/proc/self/ns/net")}
    held = {}
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # a descriptor closed meanwhile
            link = os.readlink(fd)
            if link.startswith("net:") and link not in own:
                held[link] = fd
    plumbed = 0
    for fd in held.values():
        links = subprocess.run(
            ["nsenter", f"--net={fd}", "cat", "/proc/net/dev"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        plumbed += links.returncode != 0 or "eth0:" in links.stdout
    return plumbed


def machine_processes(run_dir: Path) -> list[int]:
    """Host pids whose command line names the machine's run dir (wrapper, crun, hook)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if str(run_dir).encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return [pid for pid in found if not gone(pid)]


async def nothing_left(machines: Path, machine_id: str, prefix: str) -> None:
    """No run dir (bundle, upper layer), container, cgroup or network namespace of it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while True:
        left = {
            "run dir": (machines / machine_id).exists(),
            "processes": bool(machine_processes(machines / machine_id)),
            "crun state": (machines / ".crun" / machine_id).exists(),
            "cgroups": any(
                (Path("/sys/fs/cgroup") / c / prefix / machine_id).exists()
                for c in ("memory", "cpu", "pids")
            ),
            "netns": netd_namespaces(machines) > 0,
            "loop devices": bool(loops_under(machines)),  # so no mount of its disk, anywhere
        }
        if not any(left.values()):
            return
        assert loop.time() < deadline, f"left behind: {[k for k, v in left.items() if v]}"
        await asyncio.sleep(0.05)


async def test_flyd_killed_mid_create_leaves_nothing_behind(
    flyd_factory: Callable[..., ServiceProcess], stub_for: Callable[[str], Stub], tmp_path: Path
) -> None:
    flyd = flyd_factory("--driver", "oci")
    stub = stub_for(flyd.address)
    prefix = next(a for a in flyd.args if a.startswith("nonomad-test-"))
    machines = flyd_dir(tmp_path) / "machines"
    # Warm: netd runs, the image is cached, spares are made.
    warm = pb.MachineConfig(image="demo:v1", guest=guest())
    first = (await stub.CreateMachine(w.CreateMachineRequest(app="d", config=warm))).machine
    await stub.DestroyMachine(w.DestroyMachineRequest(machine_id=first.id, force=True))
    await wait_state(stub, first.id, S.MACHINE_STATE_DESTROYED)

    # flyd dies while crun holds the machine's container (made, in its cgroups, not running),
    # before anything is committed: frozen the moment the wrapper is spawned (its handle file
    # appears; no commit can come before crun has made the container and said so), killed
    # once the container is in the machine's pids cgroup.
    assert flyd.proc is not None
    killer = asyncio.ensure_future(
        asyncio.to_thread(
            kill_when_held,
            machines / "m-crash" / "handle.json",
            Path("/sys/fs/cgroup/pids") / prefix / "m-crash" / "cgroup.procs",
            flyd.proc.pid,
        )
    )
    create = stub.CreateMachine(
        w.CreateMachineRequest(machine_id="m-crash", app="d", config=warm), timeout=DEADLINE
    )
    with pytest.raises(grpc.aio.AioRpcError):
        await create
    assert await killer == "killed while crun held the container"
    flyd.kill()

    flyd = flyd_factory("--driver", "oci", data_dir=flyd_dir(tmp_path))
    stub = stub_for(flyd.address)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.GetMachine(w.GetMachineRequest(machine_id="m-crash"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    await nothing_left(machines, "m-crash", prefix)
    # The id is free for the client's retry, which makes a machine like any other.
    again = (
        await stub.CreateMachine(
            w.CreateMachineRequest(machine_id="m-crash", app="d", config=warm), timeout=DEADLINE
        )
    ).machine
    assert again.state == S.MACHINE_STATE_STARTED


def kill_when_held(spawned: Path, held: Path, pid: int) -> str:
    """SIGSTOP `pid` (flyd) the moment `spawned` appears, then SIGKILL it once `held` (the
    machine's cgroup.procs) lists a process; each waited for at most DEADLINE. What happened.
    """
    import signal
    import time

    end = time.monotonic() + DEADLINE
    while not spawned.exists():
        if time.monotonic() > end:
            return "the wrapper was never spawned"
        time.sleep(0.0002)
    os.kill(pid, signal.SIGSTOP)
    try:
        while not _lists_a_process(held):
            if time.monotonic() > end:
                return "crun never held the container"
            time.sleep(0.001)
    finally:
        os.kill(pid, signal.SIGKILL)
    return "killed while crun held the container"


def _lists_a_process(procs: Path) -> bool:
    try:
        return bool(procs.read_text().split())
    except OSError:
        return False


async def test_flyd_killed_mid_stop_leaves_nothing_behind(
    flyd_factory: Callable[..., ServiceProcess], stub_for: Callable[[str], Stub], tmp_path: Path
) -> None:
    flyd = flyd_factory("--driver", "oci")
    stub = stub_for(flyd.address)
    prefix = next(a for a in flyd.args if a.startswith("nonomad-test-"))
    machines = flyd_dir(tmp_path) / "machines"
    stubborn = pb.MachineConfig(
        image="probe:v1",
        guest=guest(),
        entrypoint=["sh", "-c", "trap '' TERM; echo trapping; while :; do sleep 0.05; done"],
        services=[pb.ServiceConfig(internal_port=8080)],
        stop=pb.StopConfig(timeout=Duration(seconds=2)),
    )
    machine = (await stub.CreateMachine(w.CreateMachineRequest(app="s", config=stubborn))).machine
    await log_line(stub, machine.id, "trapping")
    stopping = (await stub.StopMachine(w.StopMachineRequest(machine_id=machine.id))).machine
    assert stopping.state == S.MACHINE_STATE_STOPPING
    flyd.kill()  # while it waits out the machine's stop timeout

    flyd = flyd_factory("--driver", "oci", data_dir=flyd_dir(tmp_path))
    stub = stub_for(flyd.address)
    stopped = await wait_state(stub, machine.id, S.MACHINE_STATE_STOPPED)
    assert stopped.last_exit.signal == "SIGKILL"  # it ignored SIGTERM: the whole of it died
    assert not machine_processes(machines / machine.id)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while netd_namespaces(machines) > 0:  # its network namespace goes as it stops
        assert loop.time() < deadline, "netd still holds the stopped machine's namespace"
        await asyncio.sleep(0.02)
    await stub.DestroyMachine(w.DestroyMachineRequest(machine_id=machine.id, force=True))
    await wait_state(stub, machine.id, S.MACHINE_STATE_DESTROYED)
    await nothing_left(machines, machine.id, prefix)
