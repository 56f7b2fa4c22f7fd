"""Egress: a machine reaches beyond its worker only when its config asks and the worker has an
uplink (`flyd --egress-via`), and then only through it, masqueraded to the hub's address.

Real flyd processes with the OCI driver (skipped, with the reason, where crun cannot run or a
network namespace cannot be made). The uplink is a network namespace this test makes (`ip
netns add`), with a listener on an address of its own; nothing is routed to the host's
interfaces. The probe machine serves on its published port (127.0.0.1 on the host): each
question ("ask") there has it try the uplink's listener and the loopback ports, and answer what it
could reach. Traffic goes only to 127.0.0.1 and, from inside the machine, to the uplink.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from flyd.drivers.namespaces import CLONE_NEWNET, setns
from flyd.images.build import build_image
from flyd.settings import FlydSettings
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from flyd.v1 import worker_pb2_grpc
from model.images.owners import PUBLIC
from model.validate import EGRESS_LABEL
from runtime import SettingsError, load_settings
from tests.flyd.driver_support import OCI_UNAVAILABLE
from tests.flyd.process_support import machine_address
from tests.harness import ServiceProcess

S = pb.MachineState
Stub = worker_pb2_grpc.WorkerServiceStub
DEADLINE = 30.0
HUB_UPLINK_ADDRESS = "10.87.0.1"  # the default --network 10.87.0.0/20, + 1
LISTENER_ADDRESS = "10.250.0.1"  # the uplink namespace's own, on its loopback

PROBE = """\
import json, os, socket, sys

args = json.loads(sys.argv[1])
me = os.environ["MACHINE_ID"] + " " + os.environ["INSTANCE_ID"]


def connect(host, port):
    try:
        with socket.create_connection((host, port), timeout=2) as s:
            s.sendall(me.encode())
            return "connected"
    except OSError as e:
        return type(e).__name__


server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("0.0.0.0", int(os.environ["PORT"])))
server.listen()
while True:
    conn, _ = server.accept()
    with conn:
        conn.settimeout(5)
        try:
            if conn.recv(3) != b"ask":  # flyd's readiness check connects too: not a question
                continue
        except OSError:
            continue
        seen = {
            "uplink": connect(args["uplink"], args["uplink_port"]),
            "loopback": {str(p): connect("127.0.0.1", p) for p in args["host_ports"]},
            "others": {f"{a}:{p}": connect(a, p) for a, p in args.get("others", [])},
        }
        conn.sendall(json.dumps(seen).encode())
"""


def _netns_unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) to make the uplink namespace"
    name = f"nonomad-probe-{uuid.uuid4().hex[:8]}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], check=False)
    return None


NETNS_UNAVAILABLE = _netns_unavailable()
needs_netns = pytest.mark.skipif(NETNS_UNAVAILABLE is not None, reason=str(NETNS_UNAVAILABLE))
needs_oci = pytest.mark.skipif(
    OCI_UNAVAILABLE is not None, reason=f"crun cannot run here: {OCI_UNAVAILABLE}"
)


@dataclass
class Uplink:
    """A network namespace the test made, standing in for the operator's uplink."""

    name: str
    path: Path
    listener: socket.socket  # in the namespace, on LISTENER_ADDRESS

    @property
    def port(self) -> int:
        return int(self.listener.getsockname()[1])

    async def accepted(self) -> tuple[str, str]:
        """The next connection's source address and what it sent (waited for, with a
        deadline)."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(DEADLINE):
            conn, (source, _) = await loop.sock_accept(self.listener)
            with conn:
                data = await loop.sock_recv(conn, 256)
        return source, data.decode()

    def pending(self) -> bool:
        """Whether a connection waits to be accepted."""
        try:
            conn, _ = self.listener.accept()
        except BlockingIOError:
            return False
        conn.close()
        return True


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def uplink() -> Iterator[Uplink]:
    name = f"nonomad-up-{uuid.uuid4().hex[:8]}"
    ip("netns", "add", name)
    try:
        ip("-n", name, "link", "set", "lo", "up")
        ip("-n", name, "address", "add", f"{LISTENER_ADDRESS}/32", "dev", "lo")
        path = Path("/run/netns") / name
        listener = socket_in(path)
        try:
            yield Uplink(name, path, listener)
        finally:
            listener.close()
    finally:
        ip("netns", "del", name)


def socket_in(netns: Path) -> socket.socket:
    """A listening socket made inside `netns` (a socket stays in the namespace it was made
    in; this thread goes back to its own at once)."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    target = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns(target, CLONE_NEWNET)
        try:
            sock = socket.socket()
        finally:
            setns(own, CLONE_NEWNET)
    finally:
        os.close(own)
        os.close(target)
    sock.bind((LISTENER_ADDRESS, 0))
    sock.listen()
    sock.setblocking(False)
    return sock


@pytest.fixture(scope="module")
def image_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("egress-images")
    src = tmp_path_factory.mktemp("egress-src")
    (src / "probe.py").write_text(PROBE)
    build_image(
        src, root, name="probe", tag="v1", entrypoint=["python3", "-u", "probe.py"], owners=PUBLIC
    )
    return root


def probe_config(
    uplink: Uplink, host_ports: list[int], *, egress: bool, others: tuple[str, ...] = ()
) -> pb.MachineConfig:
    """The probe; `others`: addresses in flyd's own namespaces it tries (port 8080) too."""
    args = {
        "uplink": LISTENER_ADDRESS,
        "uplink_port": uplink.port,
        "host_ports": host_ports,
        "others": [[address, 8080] for address in others],
    }
    return pb.MachineConfig(
        image="probe:v1",
        guest=pb.GuestConfig(cpu_millicores=100, memory_mib=64),
        cmd=[json.dumps(args)],
        services=[pb.ServiceConfig(internal_port=8080)],
        network=pb.NetworkConfig(egress=egress),
    )


async def ask(machine: pb.Machine) -> dict[str, Any]:
    """Have the probe try everything once (through its published port); what it reached."""

    def once() -> bytes:
        with socket.create_connection(("127.0.0.1", machine.ports[0].host_port), timeout=15) as s:
            s.settimeout(15)
            s.sendall(b"ask")
            chunks = []
            while chunk := s.recv(4096):
                chunks.append(chunk)
            return b"".join(chunks)

    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while True:
        try:
            answer = await asyncio.to_thread(once)
            if answer:
                return dict(json.loads(answer))
        except OSError:
            pass  # its service is not listening yet (netd refuses until it does)
        assert loop.time() < deadline, f"{machine.id} never answered"
        await asyncio.sleep(0.05)


def egress_set(machines: Path) -> list[str]:
    """The addresses in netd's hub egress set, read from inside the hub."""
    pid = json.loads((machines / ".netd.json").read_text())["pid"]
    listed = subprocess.run(
        [
            "nsenter",
            f"--net=/proc/{pid}/ns/net",
            "nft",
            "-j",
            "list",
            "set",
            "ip",
            "nonomad",
            "egress",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    (found,) = [item["set"] for item in json.loads(listed.stdout)["nftables"] if "set" in item]
    return sorted(element["concat"][1] for element in found.get("elem", []))


async def create(stub: Stub, config: pb.MachineConfig) -> pb.Machine:
    resp = await stub.CreateMachine(
        w.CreateMachineRequest(app="egress", config=config), timeout=DEADLINE
    )
    assert resp.machine.state == S.MACHINE_STATE_STARTED
    return resp.machine


@needs_oci
@needs_netns
async def test_only_a_machine_that_asks_reaches_the_uplink_and_only_as_the_hub(
    uplink: Uplink,
    flyd_factory: Callable[..., ServiceProcess],
    stub_for: Callable[[str], Stub],
    tmp_path: Path,
    host_listener: int,
) -> None:
    flyd = flyd_factory("--driver", "oci", "--egress-via", str(uplink.path))
    stub = stub_for(flyd.address)
    machines = tmp_path / "flyd-w1" / "machines"
    host_ports = [int(flyd.address.rsplit(":", 1)[1]), host_listener]
    shut = await create(stub, probe_config(uplink, host_ports, egress=False))
    neighbour = machine_address(machines, shut.id)
    others = (neighbour, HUB_UPLINK_ADDRESS)
    out = await create(stub, probe_config(uplink, host_ports, egress=True, others=others))

    seen = await ask(out)
    assert seen["uplink"] == "connected"
    # The connection arrived from the hub's uplink address: the machine's own never left it.
    source, sent = await uplink.accepted()
    assert source == HUB_UPLINK_ADDRESS
    assert source != machine_address(machines, out.id)
    assert sent == f"{out.id} {out.instance_id}"
    # Its loopback is its own: flyd's port and the host's service are not there.
    assert set(seen["loopback"].values()) == {"ConnectionRefusedError"}
    # Egress is the uplink alone: the hub forwards nothing to another machine (which serves
    # on 8080) and answers nothing itself; both dropped, so the probe's connects time out.
    assert seen["others"] == {f"{a}:8080": "TimeoutError" for a in others}
    assert egress_set(machines) == [machine_address(machines, out.id)]
    # The worker says so, for flaps to send only such machines here.
    info = (await stub.GetCapacity(w.GetCapacityRequest(), timeout=DEADLINE)).worker
    assert info.labels[EGRESS_LABEL] == "true"

    # The machine that did not ask has no route beyond itself: nothing ever leaves it.
    seen = await ask(shut)
    assert seen["uplink"] == "OSError"  # ENETUNREACH
    assert set(seen["loopback"].values()) == {"ConnectionRefusedError"}
    assert not uplink.pending()

    # Egress turned off by an update: the new instance reaches nothing, its element is gone.
    updated = (
        await stub.UpdateMachine(
            w.UpdateMachineRequest(
                machine_id=out.id, config=probe_config(uplink, host_ports, egress=False)
            ),
            timeout=DEADLINE,
        )
    ).machine
    updated = (
        await stub.WaitMachine(
            w.WaitMachineRequest(
                machine_id=out.id,
                state=S.MACHINE_STATE_STARTED,
                instance_id=updated.instance_id,
            ),
            timeout=DEADLINE,
        )
    ).machine
    assert (await ask(updated))["uplink"] == "OSError"
    assert not uplink.pending()
    assert egress_set(machines) == []


@needs_oci
@needs_netns
async def test_egress_outlives_a_flyd_restart_and_netd_s_and_goes_with_the_machine(
    uplink: Uplink,
    flyd_factory: Callable[..., ServiceProcess],
    stub_for: Callable[[str], Stub],
    tmp_path: Path,
) -> None:
    flyd = flyd_factory("--driver", "oci", "--egress-via", str(uplink.path))
    stub = stub_for(flyd.address)
    machines = tmp_path / "flyd-w1" / "machines"
    out = await create(stub, probe_config(uplink, [], egress=True))
    shut = await create(stub, probe_config(uplink, [], egress=False))
    assert (await ask(out))["uplink"] == "connected"
    assert (await uplink.accepted())[0] == HUB_UPLINK_ADDRESS

    # flyd dies and comes back; netd (and with it the hub's rules) went on meanwhile.
    flyd.kill()
    flyd = flyd_factory(
        "--driver", "oci", "--egress-via", str(uplink.path), data_dir=tmp_path / "flyd-w1"
    )
    stub = stub_for(flyd.address)
    assert egress_set(machines) == [machine_address(machines, out.id)]
    assert (await ask(out))["uplink"] == "connected"
    assert (await uplink.accepted())[0] == HUB_UPLINK_ADDRESS
    assert (await ask(shut))["uplink"] == "OSError"
    assert not uplink.pending()

    # netd itself dies (its hub, uplink veth and rules with it): the next request flyd makes
    # starts a new one, which makes the uplink again and gives the running machines back their
    # network, egress as each asked.
    os.kill(json.loads((machines / ".netd.json").read_text())["pid"], signal.SIGKILL)
    await create(stub, probe_config(uplink, [], egress=False))
    assert (await ask(out))["uplink"] == "connected"
    assert (await uplink.accepted())[0] == HUB_UPLINK_ADDRESS
    assert (await ask(shut))["uplink"] == "OSError"
    assert not uplink.pending()
    assert egress_set(machines) == [machine_address(machines, out.id)]

    await stub.DestroyMachine(w.DestroyMachineRequest(machine_id=out.id, force=True))
    await stub.WaitMachine(
        w.WaitMachineRequest(machine_id=out.id, state=S.MACHINE_STATE_DESTROYED),
        timeout=DEADLINE,
    )
    assert egress_set(machines) == []


@needs_oci
async def test_egress_on_a_worker_without_an_uplink_is_refused_and_nothing_is_made(
    flyd_factory: Callable[..., ServiceProcess], stub_for: Callable[[str], Stub], tmp_path: Path
) -> None:
    flyd = flyd_factory("--driver", "oci")
    stub = stub_for(flyd.address)
    asks = pb.MachineConfig(
        image="probe:v1",
        guest=pb.GuestConfig(cpu_millicores=100, memory_mib=64),
        entrypoint=["sleep", "1000"],
        network=pb.NetworkConfig(egress=True),
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.CreateMachine(
            w.CreateMachineRequest(machine_id="m-egress", app="e", config=asks), timeout=DEADLINE
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "config.network.egress" in str(err.value.details())
    assert "no uplink" in str(err.value.details())
    listed = await stub.ListMachines(w.ListMachinesRequest(), timeout=DEADLINE)
    assert list(listed.machines) == []
    assert not (tmp_path / "flyd-w1" / "machines" / "m-egress").exists()
    # It does not claim what it cannot give: flaps sends egress machines elsewhere.
    info = (await stub.GetCapacity(w.GetCapacityRequest(), timeout=DEADLINE)).worker
    assert EGRESS_LABEL not in info.labels

    # Nor can an update turn it on: the machine stays as it was.
    plain = pb.MachineConfig()
    plain.CopyFrom(asks)
    plain.network.egress = False
    machine = (
        await stub.CreateMachine(w.CreateMachineRequest(app="e", config=plain), timeout=DEADLINE)
    ).machine
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.UpdateMachine(
            w.UpdateMachineRequest(machine_id=machine.id, config=asks), timeout=DEADLINE
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "config.network.egress" in str(err.value.details())
    now = (await stub.GetMachine(w.GetMachineRequest(machine_id=machine.id))).machine
    assert now.instance_id == machine.instance_id
    assert not now.config.network.egress


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("/nonexistent/netns", "cannot open"),
        ("/etc/hostname", "not a namespace"),
        ("/proc/self/ns/user", "not a network namespace"),
        # The host's own: nothing is ever added to it.
        ("/proc/self/ns/net", "own network namespace"),
    ],
)
def test_egress_via_must_name_another_network_namespace(path: str, says: str) -> None:
    with pytest.raises(SettingsError, match=says):
        load_settings(FlydSettings, ["--egress-via", path], prog="flyd")


def test_the_egress_label_is_flyd_s_own() -> None:
    with pytest.raises(SettingsError, match=f"{EGRESS_LABEL} is flyd's own"):
        load_settings(FlydSettings, ["--labels", f'{{"{EGRESS_LABEL}": "true"}}'], prog="flyd")


@needs_netns
def test_egress_via_takes_a_network_namespace_of_the_operator_s() -> None:
    name = f"nonomad-up-{uuid.uuid4().hex[:8]}"
    ip("netns", "add", name)
    try:
        path = Path("/run/netns") / name
        settings = load_settings(FlydSettings, ["--egress-via", str(path)], prog="flyd")
        assert settings.egress_via == path
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            ip("netns", "del", name)
