"""Issue 27's attack table, against one real `nonomad up --demo` cluster.

Each attack is made as its attacker would make it: a tenant with a token for its own app
(`nonomad tokens create --app evil`), a part's stolen certificate (the console's, the proxy's,
another worker's), anyone on the internet at the edge or the console, a tenant's code inside
its own machine. Each is refused with the status the part's contract names, and nothing
changes: the demo's machines keep their state, slot and instance, and an edge client that
asks for the demo all along gets 200 every time. At the end, the demo's secret value is in no
machine's log, no service's log file and no console page.

The per-part tests pin each refusal in detail (tests/flaps/test_scope.py,
tests/flyd/test_scope.py, tests/test_access.py, tests/proxy/test_hostile.py,
tests/console/test_login.py, tests/flyd/test_netd.py, tests/flyd/test_logs*.py,
tests/flyd/test_driver_disk.py, tests/flaps/test_image_owners*.py); this file shows that the
cluster `nonomad up` runs is built from those parts, wired as they were tested.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration

from flaps.v1 import machines_pb2 as m
from flaps.v1 import machines_pb2_grpc, platform_pb2_grpc
from flaps.v1 import platform_pb2 as p
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from flyd.v1 import worker_pb2_grpc
from nonomad.security import ClusterSecurity
from proxy.v1 import proxy_pb2 as px
from proxy.v1 import proxy_pb2_grpc
from registry.v1 import registry_pb2 as r
from registry.v1 import registry_pb2_grpc
from tests.cli_support import NoRedirect, console_login, nonomad, stop_up, up_demo
from tests.harness import channel

T = 30.0  # a deadline for every call, long enough for a loaded machine
SECRET = "tenant-secret-" + uuid.uuid4().hex  # nothing else could print it by chance
DENIED = grpc.StatusCode.PERMISSION_DENIED
# Most edge requests the watch makes (one every 50 ms: ~3 minutes), so it stops by itself.
WATCH_MAX = 4000


@dataclass
class Watch:
    """GET / of the demo through the edge, again and again, until stopped: every status."""

    edge: str
    host: str
    statuses: list[int] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.is_set() and len(self.statuses) < WATCH_MAX:
            self.statuses.append(edge_get(self.edge, self.host)[0])
            self.stop.wait(0.05)


@dataclass
class Cluster:
    state: Path
    flaps: str
    proxy: str
    edge: str
    host: str
    console: str
    login: str
    workers: dict[str, str]  # worker id -> flyd's address
    demo: list[str]  # the demo's machine ids (primary first)
    watch: Watch
    # A test's channels: a stub does not keep its channel alive; closed after each test.
    channels: list[grpc.aio.Channel] = field(default_factory=list)

    def channel(self, address: str, part: str, token: str | None = None) -> grpc.aio.Channel:
        tls = (
            self.security.client_tls()
            if part == "cli" and token
            else self.security.member_tls(part)
        )
        self.channels.append(channel(address, tls, token))
        return self.channels[-1]

    @property
    def security(self) -> ClusterSecurity:
        return ClusterSecurity(self.state)

    def admin(self) -> str:
        return (self.state / "admin.token").read_text().strip()

    def token(self, app: str, ops: str) -> str:
        made = nonomad(
            "--state-dir", str(self.state), "tokens", "create", "--app", app, "--ops", ops
        )
        assert made.returncode == 0, made.stderr
        return made.stdout.strip()

    def machines(self, token: str) -> machines_pb2_grpc.MachinesServiceStub:
        return machines_pb2_grpc.MachinesServiceStub(self.channel(self.flaps, "cli", token))

    def platform(self, token: str) -> platform_pb2_grpc.PlatformServiceStub:
        return platform_pb2_grpc.PlatformServiceStub(self.channel(self.flaps, "cli", token))

    def worker(self, worker_id: str, part: str) -> worker_pb2_grpc.WorkerServiceStub:
        return worker_pb2_grpc.WorkerServiceStub(self.channel(self.workers[worker_id], part))

    async def demo_rows(self) -> list[tuple[object, ...]]:
        """What flaps says of the demo's machines: id, state, generation, instance, config."""
        listed = await self.machines(self.admin()).ListMachines(
            m.ListMachinesRequest(app="demo"), timeout=T
        )
        return sorted(
            (x.id, x.state, x.slot.generation, x.instance_id, x.config.SerializeToString())
            for x in listed.machines
        )


def edge_get(edge: str, host: str, path: str = "/") -> tuple[int, str]:
    conn = http.client.HTTPConnection(edge, timeout=T)
    try:
        conn.request("GET", path, headers={"Host": host})
        reply = conn.getresponse()
        return reply.status, reply.read().decode(errors="replace")
    except OSError:
        return 0, ""
    finally:
        conn.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    state = tmp_path_factory.mktemp("tenants") / "cluster"
    up, text = up_demo(state)
    assert up.stdout is not None
    reader = threading.Thread(target=lambda: [None for _ in up.stdout or ()], daemon=True)
    try:
        edge = re.search(r"-H 'Host: (demo\.[a-z.]+)' http://(127\.0\.0\.1:\d+)/", text)
        console = re.search(r"^the web console: (http://127\.0\.0\.1:\d+/)$", text, re.M)
        login = re.search(r"(http://127\.0\.0\.1:\d+/login\?code=\S+)$", text, re.M)
        assert edge, text
        assert console, text
        assert login, text
        # Read on up's output, so `up` never blocks on a full pipe.
        reader.start()
        info = json.loads((state / "cluster.json").read_text())
        workers = {
            x["worker_id"]: x["address"] for x in json.loads((state / "workers.json").read_text())
        }
        # The demo gets a secret before the watch starts (setting it restarts its machine).
        done = nonomad("--state-dir", str(state), "secrets", "set", "demo", f"PASSWORD={SECRET}")
        assert done.returncode == 0, done.stderr
        host, address = edge.group(1), edge.group(2)
        assert _until_serving(address, host), "the demo never answered again after its secret"
        listed = nonomad("--state-dir", str(state), "machines", "list", "demo", "--json")
        assert listed.returncode == 0, listed.stderr
        rows = json.loads(listed.stdout)
        demo = [x["id"] for x in sorted(rows, key=lambda x: x["state"] != "MACHINE_STATE_STARTED")]
        watch = Watch(address, host)
        thread = threading.Thread(target=watch.run, daemon=True)
        thread.start()
        yield Cluster(
            state=state,
            flaps=info["flaps"],
            proxy=info["proxy"],
            edge=address,
            host=host,
            console=console.group(1),
            login=login.group(1),
            workers=workers,
            demo=demo,
            watch=watch,
        )
        watch.stop.set()
        thread.join(T)
    finally:
        stop_up(up, reader)


@pytest.fixture(autouse=True)
async def _close_channels(cluster: Cluster) -> AsyncIterator[None]:
    yield
    for made in cluster.channels:
        await made.close()
    cluster.channels.clear()


def _until_serving(edge: str, host: str) -> bool:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if edge_get(edge, host)[0] == 200:
            return True
        time.sleep(0.1)
    return False


async def refused(call: object, code: grpc.StatusCode = DENIED) -> str:
    """Await the call; it must fail with `code`. Its details."""
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call  # type: ignore[misc]
    assert raised.value.code() == code, (raised.value.code(), raised.value.details())
    return raised.value.details() or ""


def demo_config(**fields: object) -> pb.MachineConfig:
    return pb.MachineConfig(
        image="demo:v1",
        guest=pb.GuestConfig(cpu_millicores=100, memory_mib=64),
        services=[pb.ServiceConfig(internal_port=8080, autostart=True)],
        **fields,  # type: ignore[arg-type]
    )


# -- 1: a tenant's token names another app's machine -----------------------------------------


async def test_1_a_tenant_cannot_make_its_machine_a_standby_or_rival_of_the_demos(
    cluster: Cluster,
) -> None:
    before = await cluster.demo_rows()
    evil = cluster.machines(cluster.token("evil", "write,read"))
    primary = cluster.demo[0]
    create = m.CreateMachineRequest(
        app="evil", region="ams", config=demo_config(standbys=[primary])
    )
    await refused(evil.CreateMachine(create, timeout=T))
    await refused(
        evil.CreateMachine(
            m.CreateMachineRequest(
                app="evil", region="ams", config=demo_config(), standby_for=[primary]
            ),
            timeout=T,
        )
    )
    await refused(evil.StartMachine(m.StartMachineRequest(machine_id=primary), timeout=T))
    await refused(evil.StopMachine(m.StopMachineRequest(machine_id=primary), timeout=T))
    assert await cluster.demo_rows() == before


# -- 2: a part's certificate calls a worker directly -----------------------------------------


@pytest.mark.parametrize("part", ["console", "proxy", "cli"])
async def test_2_no_certificate_but_flaps_changes_or_reads_a_worker(
    cluster: Cluster, part: str
) -> None:
    before = await cluster.demo_rows()
    primary = cluster.demo[0]
    owner = primary.rpartition("-")[0]
    stub = cluster.worker(owner, part)
    leaked = pb.MachineConfig(image="demo:v1", entrypoint=["sh", "-c", "env"])
    await refused(
        stub.UpdateMachine(w.UpdateMachineRequest(machine_id=primary, config=leaked), timeout=T)
    )
    await refused(
        _drain(stub.GetMachineLogs(w.GetMachineLogsRequest(machine_id=primary), timeout=T))
    )
    await refused(
        stub.CreateMachine(w.CreateMachineRequest(app="demo", config=demo_config()), timeout=T)
    )
    await refused(
        stub.DestroyMachine(w.DestroyMachineRequest(machine_id=primary, force=True), timeout=T)
    )
    assert await cluster.demo_rows() == before


async def _drain(stream: object) -> None:
    async for _ in stream:  # type: ignore[attr-defined]
        pass


# -- 3: a certificate announces a worker that is not its own ---------------------------------


@pytest.mark.parametrize("part", ["console", "flyd-ams-2"])
async def test_3_only_a_worker_announces_itself(cluster: Cluster, part: str) -> None:
    registry = registry_pb2_grpc.RegistryServiceStub(cluster.channel(cluster.proxy, part))
    spoof = r.AnnounceRequest(worker=pb.WorkerInfo(id="ams-1", region="ams", address="127.0.0.1:9"))
    await refused(registry.Announce(spoof, timeout=T))
    # The edge's replica (what it routes by) and flaps still have ams-1 where it is.
    edge = registry_pb2_grpc.RegistryServiceStub(cluster.channel(cluster.proxy, "console"))
    members = (await edge.ListMembers(r.ListMembersRequest(), timeout=T)).members
    assert {x.worker.id: x.worker.address for x in members}["ams-1"] == cluster.workers["ams-1"]
    listed = await cluster.platform(cluster.admin()).ListWorkers(p.ListWorkersRequest(), timeout=T)
    addresses = {x.info.id: x.info.address for x in listed.workers}
    assert addresses["ams-1"] == cluster.workers["ams-1"]


# -- 4: an app's token with every op does fleet operations -----------------------------------


async def test_4_an_apps_token_never_reaches_fleet_operations(cluster: Cluster) -> None:
    platform = cluster.platform(cluster.token("evil", "*"))
    await refused(
        platform.CordonWorker(p.CordonWorkerRequest(worker_id="ams-1", cordoned=True), timeout=T)
    )
    await refused(platform.ListWorkers(p.ListWorkersRequest(), timeout=T))
    listed = await cluster.platform(cluster.admin()).ListWorkers(p.ListWorkersRequest(), timeout=T)
    assert not any(x.capacity.cordoned for x in listed.workers)


# -- 5: a request smuggled inside another one's body -----------------------------------------


def test_5_the_edge_refuses_a_smuggled_request(cluster: Cluster) -> None:
    hidden = (
        f"GET /smuggled-{uuid.uuid4().hex[:8]} HTTP/1.1\r\nHost: {cluster.host}\r\n"
        "X-Forwarded-For: 203.0.113.66\r\n\r\n"
    )
    head = (
        f"POST / HTTP/1.1\r\nHost: {cluster.host}\r\nConnection: content-length\r\n"
        f"Content-Length: {len(hidden)}\r\n\r\n"
    )
    host, port = cluster.edge.split(":")
    with socket.create_connection((host, int(port)), timeout=T) as conn:
        conn.sendall(head.encode() + hidden.encode())
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = conn.recv(4096)
            if not chunk:
                break
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert b"Connection" in answer  # the reason names the header
    assert hidden.split()[1] not in _machine_logs(cluster)  # the machine never saw it


def _machine_logs(cluster: Cluster) -> str:
    """Every demo machine's log tail, as flaps serves it (a standby that never ran has none)."""
    out = []
    for mid in cluster.demo:
        shown = nonomad(
            "--state-dir", str(cluster.state), "machines", "logs", mid, "--tail", "1000"
        )
        if "has no process state" in shown.stderr:
            continue
        assert shown.returncode == 0, shown.stderr
        out.append(shown.stdout)
    assert out, "no demo machine has a log"
    return "\n".join(out)


# -- 6: the console asked under another name, or without a login -----------------------------


def test_6_the_console_answers_only_its_own_name_and_only_after_a_login(cluster: Cluster) -> None:
    refusals = [
        ({"Host": "evil.example"}, 421),  # DNS rebinding: a name the console does not serve
        ({}, 303),  # to the login page
        ({"Accept": "application/json"}, 401),
    ]
    for headers, status in refusals:
        opener = urllib.request.build_opener(NoRedirect)
        ask = urllib.request.Request(cluster.console, headers=headers)
        with pytest.raises(urllib.error.HTTPError) as refused_:
            opener.open(ask, timeout=T)
        with refused_.value as reply:
            body = reply.read().decode(errors="replace")
            assert reply.code == status, body
            assert not any(mid in body for mid in cluster.demo)


# -- 7: a certificate drains every worker at the edge ----------------------------------------


@pytest.mark.parametrize("part", ["console", "flyd-ams-1"])
async def test_7_no_part_but_an_operator_drains_the_edge(cluster: Cluster, part: str) -> None:
    edge = proxy_pb2_grpc.ProxyServiceStub(cluster.channel(cluster.proxy, part))
    for worker in cluster.workers:
        await refused(edge.DrainWorker(px.DrainWorkerRequest(worker_id=worker), timeout=T))
    assert edge_get(cluster.edge, cluster.host)[0] == 200


# -- a tenant's own machines: 8 (its log), 9 (its disk), 10 (what it sees), 11 (images) -----


@pytest.fixture(scope="module")
def evil_image(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> str:
    """An image of app evil's own: no base (the host's runtime, read-only), a shell."""
    src = tmp_path_factory.mktemp("evil-image")
    (src / "README").write_text("evil's\n")
    built = nonomad(
        "--state-dir",
        str(cluster.state),
        "image",
        "build",
        str(src),
        "--tag",
        "evil:v1",
        "--app",
        "evil",
        "--entrypoint",
        "sh",
    )
    assert built.returncode == 0, built.stderr
    return "evil:v1"


async def run_evil(
    cluster: Cluster, image: str, script: str, disk_mib: int = 0
) -> tuple[str, list[str]]:
    """Run `script` in a machine of app evil until it exits; its id and log lines."""
    token = cluster.token("evil", "write,read")
    evil = cluster.machines(token)
    config = pb.MachineConfig(
        image=image,
        guest=pb.GuestConfig(cpu_millicores=100, memory_mib=64, disk_mib=disk_mib),
        cmd=["-c", script],
        restart=pb.RestartPolicy(mode=pb.RESTART_MODE_NO),
    )
    made = await evil.CreateMachine(
        m.CreateMachineRequest(app="evil", region="ams", config=config), timeout=T
    )
    mid = made.machine.id
    await evil.WaitMachine(
        m.WaitMachineRequest(
            machine_id=mid, state=pb.MACHINE_STATE_STOPPED, timeout=Duration(seconds=60)
        ),
        timeout=90,
    )
    lines = [
        x.line
        async for x in evil.GetMachineLogs(
            m.GetMachineLogsRequest(machine_id=mid, tail_lines=50), timeout=T
        )
    ]
    return mid, lines


def _pid(cluster: Cluster, worker: str) -> int:
    rows = json.loads((cluster.state / "workers.json").read_text())
    return int(next(x["pid"] for x in rows if x["worker_id"] == worker))


async def test_8_a_machine_cannot_blow_up_its_workers_memory_through_its_log(
    cluster: Cluster, evil_image: str
) -> None:
    pids = {wid: _pid(cluster, wid) for wid in cluster.workers}
    script = "echo start; python3 -c 'import os; os.ftruncate(1, 1 << 42)'; echo end"
    _mid, lines = await run_evil(cluster, evil_image, script)
    # Its stdout is a pipe to the copier: the truncate fails, and what it printed is the log.
    assert (lines[0], lines[-1]) == ("start", "end"), lines
    for line in lines:
        assert len(line) <= 64 * 1024  # a bounded tail, not 4 TiB of NULs
    for wid, pid in pids.items():  # every worker's flyd is the one that was there
        assert _pid(cluster, wid) == pid
        assert Path(f"/proc/{pid}").exists()
        capacity = await cluster.worker(wid, "flaps").GetCapacity(w.GetCapacityRequest(), timeout=T)
        assert capacity.worker.id == wid


async def test_9_a_machine_writes_no_more_than_its_disk(cluster: Cluster, evil_image: str) -> None:
    script = (
        "dd if=/dev/zero of=/fill bs=1M count=300 2>/dev/null; "
        "echo wrote $(($(stat -c %s /fill) >> 20))"
    )
    _, lines = await run_evil(cluster, evil_image, script, disk_mib=16)
    (wrote,) = [line for line in lines if line.startswith("wrote ")]
    assert int(wrote.split()[1]) <= 16  # ENOSPC at its disk's size, not 300 MiB


async def test_10_a_machine_sees_its_own_sys_and_cgroups(cluster: Cluster, evil_image: str) -> None:
    script = (
        "echo net: $(ls /sys/class/net); "
        "touch /sys/x 2>/dev/null && echo sys: writable || echo sys: read-only; "
        "while read -r line; do echo cgroup: $line; done < /proc/self/cgroup"
    )
    _, lines = await run_evil(cluster, evil_image, script)
    (net,) = [line for line in lines if line.startswith("net:")]
    assert set(net.split()[1:]) <= {"lo", "eth0"}  # its own devices, none of the host's
    assert "sys: read-only" in lines
    cgroups = [line for line in lines if line.startswith("cgroup:")]
    assert cgroups
    assert all(line.endswith(":/") for line in cgroups), cgroups


async def test_11_an_app_runs_no_image_of_another_apps(cluster: Cluster) -> None:
    bapp = cluster.machines(cluster.token("bapp", "write,read"))
    create = m.CreateMachineRequest(app="bapp", region="ams", config=demo_config())
    details = await refused(bapp.CreateMachine(create, timeout=T))
    assert "demo" in details
    assert "bapp" in details
    listed = await cluster.machines(cluster.admin()).ListMachines(
        m.ListMachinesRequest(app="bapp"), timeout=T
    )
    assert list(listed.machines) == []


# -- 12: creates abandoned at a worker at any await ------------------------------------------


async def test_12_abandoned_creates_leave_a_worker_able_to_create(
    cluster: Cluster, evil_image: str
) -> None:
    flaps_cert = cluster.worker("ams-1", "flaps")
    config = pb.MachineConfig(
        image=evil_image,
        guest=pb.GuestConfig(cpu_millicores=100, memory_mib=64),
        cmd=["-c", "exec sleep 1000"],
    )
    for ms in (2, 3, 4, 5, 6):
        try:
            await flaps_cert.CreateMachine(
                w.CreateMachineRequest(app="evil", config=config), timeout=ms / 1000
            )
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err
    evil = cluster.machines(cluster.token("evil", "write,read"))
    for _ in range(3):
        made = await evil.CreateMachine(
            m.CreateMachineRequest(app="evil", region="ams", config=config), timeout=T
        )
        assert made.machine.state in (pb.MACHINE_STATE_STARTED, pb.MACHINE_STATE_CREATED)


# -- throughout: the demo served, its secret nowhere -----------------------------------------


def test_the_demo_answered_200_throughout(cluster: Cluster) -> None:
    statuses = cluster.watch.statuses
    assert len(statuses) > 10
    assert set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}


def test_the_demo_secret_is_in_no_log_and_no_page(cluster: Cluster) -> None:
    assert SECRET not in _machine_logs(cluster)
    for log in (cluster.state / "logs").glob("*.log"):
        assert SECRET not in log.read_text(errors="replace"), log
    cookie = console_login(cluster.login)
    for path in ["", "apps/demo", *(f"machines/{mid}" for mid in cluster.demo)]:
        for accept in ("text/html", "application/json"):
            ask = urllib.request.Request(
                cluster.console + path, headers={"Cookie": cookie, "Accept": accept}
            )
            with urllib.request.urlopen(ask, timeout=T) as reply:
                assert SECRET not in reply.read().decode(errors="replace"), path
    assert os.environ.get("PASSWORD") != SECRET
