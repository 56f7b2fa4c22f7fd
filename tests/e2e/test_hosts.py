"""The cluster across hosts (nonomad.hosts): flaps, the registry, the proxy and each worker on a
network-namespace host of its own, each running its deploy/ unit file's command line.

One harness serves the module: three worker hosts (w1, w2, w3) routing their machines'
addresses (`flyd --route-machines`), the proxy dialling those addresses across the private
link. The test reaches flaps, the edge and the workers only through 127.0.0.1 ports the harness
forwards into their hosts. Each scenario gets an app of its own: create and route, scale from
zero, a rolling deploy, a host's death and its standby's promotion, a partition and its heal
(the fencing rules: after the heal exactly one copy serves), and a worker that cannot reach
flaps but still runs and serves its machines.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from flyd.v1 import worker_pb2_grpc
from nonomad.client import Client
from nonomad.hosts import (
    DEPLOY,
    HTTP_PORT,
    PORTS,
    UNITS,
    Hosts,
    applicable,
    expand,
    netns_unavailable,
    read_limits,
    read_unit,
)
from runtime import aio_channel
from tests.proxy.support import DEADLINE, eventually, get

S = pb.MachineState
STARTED, STOPPED = S.MACHINE_STATE_STARTED, S.MACHINE_STATE_STOPPED
DOMAIN = "nonomad.test"
# The failover target across hosts: from the cut to the standby's first answer.
FAILOVER_TARGET = 10.0

UNAVAILABLE = netns_unavailable()
pytestmark = [
    pytest.mark.skipif(UNAVAILABLE is not None, reason=f"hosts need: {UNAVAILABLE}"),
    # Every test here on one worker, the crashed run's too (it shares no fixture): `Hosts.up()`
    # sweeps whatever run's harness is gone, so the cluster's start, beside it on the other
    # worker, would sweep the crashed run the test is about to look at.
    pytest.mark.xdist_group("tests/e2e/test_hosts.py"),
]


@dataclass
class Cluster:
    hosts: Hosts
    flaps: str  # 127.0.0.1 forwards
    http: str
    workers: dict[str, str] = field(default_factory=dict)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, image_source: Path) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("hosts")
    hosts = Hosts(
        root,
        [("w1", "ams"), ("w2", "ams"), ("w3", "ams")],
        image_source=image_source,
        domain=DOMAIN,
        options={
            "flyd": "--heartbeat-interval 0.1 --announce-interval 0.5 --grace-period 2",
            "proxy": "--grace-period 2",
            "flaps": "--grace-period 2",
            "registry": "--grace-period 2",
        },
    )
    hosts.up()
    try:
        c = Cluster(
            hosts, hosts.forward("flaps", PORTS["flaps"]), hosts.forward("proxy", HTTP_PORT)
        )
        for worker in hosts.workers:
            c.workers[worker.name] = hosts.forward(worker.name, PORTS["flyd"])
        yield c
    finally:
        hosts.close()


@contextlib.asynccontextmanager
async def client(c: Cluster) -> AsyncIterator[Client]:
    sec = c.hosts.security
    assert sec is not None
    async with Client(c.flaps, tls=sec.client_tls(), token_file=sec.admin_token, timeout=10) as cl:
        yield cl


async def alive(c: Cluster, count: int = 3) -> bool:
    async with client(c) as cl:
        return sum(x.status == 1 for x in await cl.list_workers()) == count


def config() -> pb.MachineConfig:
    return pb.MachineConfig(
        image="demo:v1",
        guest=pb.GuestConfig(cpu_millicores=100, memory_mib=64),
        services=[pb.ServiceConfig(internal_port=8080, autostart=True)],
    )


async def machine(c: Cluster, machine_id: str) -> pb.Machine:
    async with client(c) as cl:
        return await cl.get_machine(machine_id)


async def events(c: Cluster, m: pb.Machine) -> list[pb.MachineEvent]:
    sec = c.hosts.security
    assert sec is not None
    async with aio_channel(c.workers[m.worker_id], tls=sec.member_tls("flaps")) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        resp = await stub.ListMachineEvents(w.ListMachineEventsRequest(machine_id=m.id), timeout=10)
    return list(resp.events)


async def served_by(c: Cluster, app: str) -> str:
    reply = await get(c.http, app)
    assert reply.status == 200, reply
    return reply.headers["nonomad-machine-id"]


@dataclass
class Load:
    """GETs through the edge, one at a time, each answer recorded as (got, status, machine)."""

    c: Cluster
    app: str
    answers: list[tuple[float, int, str]] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while not self._stop.is_set() and len(self.answers) < 3000:
            try:
                reply = await get(self.c.http, self.app)
                got = (reply.status, reply.headers.get("nonomad-machine-id", ""))
            except (OSError, TimeoutError) as err:
                got = (0, repr(err))
            self.answers.append((time.monotonic(), *got))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.04):
                    await self._stop.wait()

    async def stop(self) -> list[tuple[float, int, str]]:
        self._stop.set()
        if self._task is not None:
            await self._task
        return self.answers

    def served(self, machine_id: str) -> bool:
        return any(m == machine_id and s == 200 for _, s, m in self.answers)


def test_every_host_runs_its_unit_file_s_command_line(cluster: Cluster) -> None:
    for host in cluster.hosts.hosts.values():
        unit = expand(read_unit(DEPLOY / UNITS[host.role]), host.env)
        assert Path(host.argv[0]).name == Path(unit[0]).name
        assert host.argv[1:] == unit[1:]
        assert host.grpc.startswith(host.address + ":")


def test_every_host_s_service_is_held_to_its_unit_s_limits(cluster: Cluster) -> None:
    # flyd's unit sets both (deploy/nonomad-flyd.service): its descriptors, and its memory
    # in a cgroup of its own, beside its machines' (issue 27, item 6).
    bounded = []
    for host in cluster.hosts.hosts.values():
        limits = host.limits
        # The unit's, or (a harness that may not raise its hard limit) as far as it could.
        assert limits == applicable(read_limits(DEPLOY / UNITS[host.role]))
        assert host.proc is not None
        proc = Path(f"/proc/{host.proc.pid}")
        assert (proc / "exe").resolve() == Path(sys.executable).resolve()  # the service itself
        if limits.nofile is not None:
            [line] = [x for x in (proc / "limits").read_text().splitlines() if "open files" in x]
            assert tuple(int(n) for n in line.split()[3:5]) == limits.nofile
        cgroups = dict(x.split(":", 2)[1:] for x in (proc / "cgroup").read_text().splitlines())
        if limits.memory_max is None:
            continue
        memory = cluster.hosts.memory_cgroup(host.name)
        assert cgroups["memory"] == f"/{memory.name}"
        assert int((memory / "memory.limit_in_bytes").read_text()) == limits.memory_max
        bounded.append(host.name)
    assert {w.name for w in cluster.hosts.workers} <= set(bounded)


async def test_create_route_and_scale_from_zero_across_hosts(cluster: Cluster) -> None:
    c = cluster
    await eventually(lambda: alive(c), "every worker host alive in flaps")
    async with client(c) as cl:
        m = await cl.create_machine("across", config(), region="ams")
    worker = c.hosts[m.worker_id]
    # Its own address, in its worker's prefix; its port mapping names the worker's address.
    assert ipaddress.ip_address(m.address) in ipaddress.ip_network(worker.network)
    assert m.ports[0].host == worker.address
    assert await served_by(c, "across") == m.id
    # Scale from zero: stopped, the next request through the edge starts it again.
    async with client(c) as cl:
        await cl.stop_machine(m.id)

    async def stopped() -> bool:
        return (await machine(c, m.id)).state == STOPPED

    await eventually(stopped, "the machine stopped")
    assert await served_by(c, "across") == m.id
    assert (await machine(c, m.id)).state == STARTED
    async with client(c) as cl:
        await cl.destroy_machine(m.id, force=True)


async def test_a_rolling_deploy_across_hosts_answers_every_request(cluster: Cluster) -> None:
    from nonomad.deploy import deploy
    from nonomad.spec import AppSpec

    c = cluster
    await eventually(lambda: alive(c), "every worker host alive in flaps")
    spec = AppSpec.model_validate(
        {
            "app": "roll",
            "image": "demo:v1",
            "regions": {"ams": 2},
            "services": [{"internal_port": 8080}],
            # Run by the worker hosts: this process could not reach the machines' addresses.
            "checks": [{"type": "http", "path": "/", "interval": "200ms", "grace_period": "30s"}],
        }
    )
    async with client(c) as cl:
        first = await deploy(cl, spec)
        assert first.ok, first.reason
        load = Load(c, "roll")
        load.start()
        try:
            await eventually(lambda: len(load.answers) >= 5, "answers before the deploy")
            again = await deploy(cl, spec.model_copy(update={"env": {"VERSION": "2"}}))
            assert again.ok, again.reason
        finally:
            answers = await load.stop()
        failed = [a for a in answers if a[1] != 200]
        assert not failed, failed[:5]
        for row in again.machines:
            got = await cl.get_machine(row.machine_id)
            assert got.config.env["VERSION"] == "2"
            assert got.address
            await cl.destroy_machine(row.machine_id, force=True)


async def _slot(c: Cluster, app: str) -> tuple[pb.Machine, pb.Machine]:
    await eventually(lambda: alive(c), "every worker host alive in flaps")
    async with client(c) as cl:
        primary = await cl.create_machine(app, config(), region="ams")
        standby = await cl.create_machine(
            app, config(), region="ams", skip_launch=True, standby_for=[primary.id]
        )
    assert primary.worker_id != standby.worker_id
    return primary, standby


async def _settled(c: Cluster, primary: str, standby: str) -> bool:
    old, new = await machine(c, primary), await machine(c, standby)
    return (
        new.state == STARTED
        and new.slot.primary == standby
        and old.state == STOPPED
        and old.slot.primary == standby
        and not new.slot.fenced
    )


async def _fault(c: Cluster, app: str, cut: str) -> None:
    """The primary's worker host is lost (`cut`: "death" or "partition"); the standby on
    another host serves within the failover target; the host returns; exactly one copy
    serves after, and the old primary never answered again once the standby had."""
    primary, standby = await _slot(c, app)
    hosts = c.hosts
    load = Load(c, app)
    load.start()
    try:
        await eventually(lambda: load.served(primary.id), "the primary serving")
        lost = time.monotonic()
        if cut == "death":
            hosts.kill(primary.worker_id, machines=True)
        else:
            # (pyroute2's calls run a loop of their own: from a thread of their own)
            await asyncio.to_thread(hosts.partition, primary.worker_id)
        await eventually(lambda: load.served(standby.id), "the standby serving")
        took = next(t for t, s, m in load.answers if m == standby.id and s == 200) - lost
        assert took < FAILOVER_TARGET, f"the standby served {took:.2f}s after the loss"
        if cut == "death":
            await asyncio.to_thread(hosts.start, primary.worker_id)
        else:
            await asyncio.to_thread(hosts.heal, primary.worker_id)
        await eventually(lambda: _settled(c, primary.id, standby.id), "one primary, one standby")
        count = len(load.answers)
        await eventually(lambda: len(load.answers) >= count + 10, "answers after the return")
    finally:
        answers = await load.stop()
    first = min(t for t, s, m in answers if m == standby.id and s == 200)
    late = [a for a in answers if a[2] == primary.id and a[0] > first]
    assert not late, f"the superseded {primary.id} answered after the standby did: {late[:3]}"
    tail = answers[-10:]
    assert {m for _, _, m in tail} == {standby.id}
    assert {s for _, s, _ in tail} == {200}
    promoted = [e for e in await events(c, await machine(c, standby.id)) if e.type == "promote"]
    assert len(promoted) == 1
    async with client(c) as cl:
        for machine_id in (primary.id, standby.id):
            await cl.destroy_machine(machine_id, force=True)


async def test_a_worker_host_dies_and_its_standby_on_another_host_serves(
    cluster: Cluster,
) -> None:
    await _fault(cluster, "hdeath", "death")


async def test_a_partitioned_worker_host_is_superseded_when_it_heals(cluster: Cluster) -> None:
    await _fault(cluster, "hpart", "partition")


async def test_a_worker_that_cannot_reach_flaps_still_runs_its_machines(
    cluster: Cluster,
) -> None:
    c = cluster
    await eventually(lambda: alive(c), "every worker host alive in flaps")
    async with client(c) as cl:
        m = await cl.create_machine("alone", config(), region="ams")
    assert await served_by(c, "alone") == m.id
    await asyncio.to_thread(c.hosts.block, m.worker_id, "flaps")
    try:

        async def unseen() -> bool:
            return not await alive(c, 3)

        await eventually(unseen, "flaps losing the worker")
        # The edge still reaches it: its machine runs on and answers every request.
        for _ in range(20):
            assert await served_by(c, "alone") == m.id
        assert [e.to_state for e in await events(c, m)][-1] == STARTED
    finally:
        await asyncio.to_thread(c.hosts.unblock, m.worker_id, "flaps")
    await eventually(lambda: alive(c), "flaps seeing the worker again")
    async with client(c) as cl:
        await cl.destroy_machine(m.id, force=True)


def test_what_a_crashed_run_left_is_swept_at_the_next_start(
    tmp_path: Path, image_source: Path
) -> None:
    """What a crashed harness left (namespaces, processes, cgroups) goes at the next start."""
    import subprocess
    import sys

    from pyroute2 import netns

    code = (
        "import os, sys; from pathlib import Path; from nonomad.hosts import Hosts\n"
        "h = Hosts(Path(sys.argv[1]), [('w1', 'ams')], image_source=Path(sys.argv[2]))\n"
        "h.up(); print(h.tag, flush=True); os._exit(0)\n"  # a crash: nothing torn down
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), str(image_source)],
        capture_output=True,
        text=True,
        timeout=DEADLINE * 3,
        check=True,
    )
    tag = out.stdout.split()[-1]
    left = [n for n in netns.listnetns() if n.startswith(f"nnh{tag}-")]
    assert len(left) == 5  # fabric, flaps, registry, proxy, w1
    from nonomad.hosts import _marked, sweep

    assert _marked(tag)  # its services run on, orphaned
    assert Path(f"/sys/fs/cgroup/memory/nnh{tag}-w1.service").is_dir()  # flyd's, of its unit
    assert tag in sweep()
    assert not [n for n in netns.listnetns() if n.startswith(f"nnh{tag}-")]
    assert not _marked(tag)
    assert not list(Path("/sys/fs/cgroup/memory").glob(f"nnh{tag}-*"))
