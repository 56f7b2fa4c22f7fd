"""Exactly one serving copy, with real processes (docs/fencing.md): a primary's worker fails,
its standby takes over, the worker comes back, and the history says who answered.

One cluster serves every fault: workers w1 (side a) and w2 (side b) announcing to flaps, and
two proxies following the same workers. Each fault gets an app of its own, its primary on the
worker the fault hits and its standby on the other, and GETs through both proxies from before
the fault until after the return has settled. Then, over the whole history: no GET failed;
from the first answer of the standby on, the superseded machine answered none; exactly one
promotion happened; and exactly one machine of the slot is STARTED, the other its standby.
The faults: flyd SIGKILL (its machine runs on), the host's SIGKILL, a short SIGSTOP, a long
one (until every proxy gave its stream from the worker up as silent), and a network-namespace
partition with two proxies of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from flaps.v1 import machines_pb2 as m
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from nonomad.security import provision
from tests.conftest import DEMO_APP
from tests.harness import REPO_ROOT, clean_env
from tests.proxy.support import (
    DEADLINE,
    Netns,
    ProxyFleet,
    T,
    eventually,
    get,
    netns_unavailable,
    two_sides,
)

S = pb.MachineState
STARTED = S.MACHINE_STATE_STARTED
STOPPED = S.MACHINE_STATE_STOPPED
# GETs per second through each proxy while a fault plays out.
RATE = 25.0
# The load stops after this many answers (or DEADLINE * 3 seconds), whatever happens.
MAX_ANSWERS = 4000


@dataclass(frozen=True)
class Answer:
    proxy: int
    sent: float
    got: float
    status: int
    machine: str


@dataclass
class Load:
    """GETs for one app through every proxy, one at a time per proxy, each answer recorded."""

    fleet: ProxyFleet
    app: str
    answers: list[Answer] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def start(self) -> None:
        for i in range(len(self.fleet.proxies)):
            self._tasks.append(asyncio.create_task(self._loop(i)))

    async def _loop(self, i: int) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + 3 * DEADLINE
        address = self.fleet.proxies[i].http
        while not self._stop.is_set() and loop.time() < end and len(self.answers) < MAX_ANSWERS:
            sent = time.monotonic()
            try:
                reply = await get(address, self.app)
                status, machine = reply.status, reply.headers.get("nonomad-machine-id", "")
            except (OSError, TimeoutError) as err:
                status, machine = 0, repr(err)
            self.answers.append(Answer(i, sent, time.monotonic(), status, machine))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1 / RATE):
                    await self._stop.wait()

    async def stop(self) -> list[Answer]:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        # (shown when the test fails: who answered what, through which proxy, in order)
        t0 = self.answers[0].sent if self.answers else 0.0
        for a in self.answers:
            print(f"{a.sent - t0:8.3f} {a.got - t0:8.3f} proxy {a.proxy} {a.status} {a.machine}")
        return self.answers

    def served_by(self, machine_id: str) -> bool:
        return any(a.machine == machine_id and a.status == 200 for a in self.answers)


def check_history(answers: list[Answer], primary: str, standby: str) -> None:
    """No GET failed; none was answered by `primary` after `standby` first answered one."""
    failed = [a for a in answers if a.status != 200]
    assert not failed, f"{len(failed)} of {len(answers)} GETs failed: {failed[:5]}"
    first = min(a.got for a in answers if a.machine == standby)
    late = [a for a in answers if a.machine == primary and a.got > first]
    assert not late, f"the superseded {primary} answered after the standby did: {late[:5]}"
    assert {a.machine for a in answers} == {primary, standby}
    assert {a.proxy for a in answers if a.machine == standby} == {0, 1}  # through both proxies


async def promotions(fleet: ProxyFleet, machine: pb.Machine) -> list[pb.MachineEvent]:
    resp = await fleet.worker(machine.worker_id).ListMachineEvents(
        w.ListMachineEventsRequest(machine_id=machine.id), timeout=T
    )
    return [e for e in resp.events if e.type == "promote"]


async def starts(fleet: ProxyFleet, machine: pb.Machine) -> int:
    """How many times the machine's worker recorded it becoming started (from another state:
    a readiness change of a started machine is not a start)."""
    resp = await fleet.worker(machine.worker_id).ListMachineEvents(
        w.ListMachineEventsRequest(machine_id=machine.id), timeout=T
    )
    return sum(1 for e in resp.events if e.to_state == STARTED and e.from_state != STARTED)


async def settled(fleet: ProxyFleet, primary: str, standby: str) -> bool:
    """The slot is back to one primary (the promoted standby) and one standby (the old primary),
    and every proxy routes to the promoted one only."""
    old, new = await fleet.machine(primary), await fleet.machine(standby)
    if not (
        new.state == STARTED
        and new.slot.primary == standby
        and old.state == STOPPED
        and old.slot.primary == standby
        and old.slot.generation == new.slot.generation
        and not new.slot.fenced
    ):
        return False
    for i in range(len(fleet.proxies)):
        routes = {r.machine_id: r for r in await fleet.routes(new.app, i)}
        if not routes[standby].healthy or routes[primary].healthy:
            return False
    return True


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, image_source: Path) -> Iterator[ProxyFleet]:
    """w1 (side a) and w2 (side b) announcing to flaps, and two proxies following both; secure
    as `nonomad up` runs it (mutual TLS between the parts: a returning worker asks flaps and
    the other worker over it)."""
    import uuid

    tmp = tmp_path_factory.mktemp("fencing")
    security = provision(tmp / "security", ["flaps", "proxy", "registry"])
    prefix = f"nonomad-test-{uuid.uuid4().hex[:8]}"
    fleet = ProxyFleet(tmp, image_source, prefix=prefix, security=security)
    try:
        two_sides(fleet, proxies=2)
        yield fleet
    finally:
        asyncio.run(fleet.close())


def _flyd_killed(fleet: ProxyFleet, worker_id: str) -> Callable[[], object]:
    fleet.workers[worker_id].kill()  # its machine keeps running
    return lambda: fleet.restart(worker_id)


def _host_killed(fleet: ProxyFleet, worker_id: str) -> Callable[[], object]:
    fleet.kill_host(worker_id)  # flyd and its machines
    return lambda: fleet.restart(worker_id)


def _frozen(fleet: ProxyFleet, worker_id: str) -> Callable[[], object]:
    proc = fleet.workers[worker_id]
    proc.freeze()  # its connections stay open; probes time out
    return proc.thaw


def _silent_streams(fleet: ProxyFleet, worker_id: str) -> list[int]:
    """How many times each proxy tore its stream from the worker down for silence."""
    counts = []
    for i in range(len(fleet.proxies)):
        text = (fleet.tmp / f"proxy-{i}.log").read_text(errors="replace")
        counts.append(
            sum(
                1
                for line in text.splitlines()
                if '"stream_silent"' in line and f'"worker": "{worker_id}"' in line
            )
        )
    return counts


def _frozen_long(fleet: ProxyFleet, worker_id: str) -> Callable[[], object]:
    """Frozen until every proxy gave its stream from the worker up as silent (after
    max(2 s, 2 x dead_after)) and so follows it on a new one after the thaw."""
    before = _silent_streams(fleet, worker_id)
    proc = fleet.workers[worker_id]
    proc.freeze()

    def thaw() -> None:
        deadline = time.monotonic() + DEADLINE
        while not all(
            now > then for now, then in zip(_silent_streams(fleet, worker_id), before, strict=True)
        ):
            assert time.monotonic() < deadline, "the proxies never gave the stream up"
            time.sleep(0.05)
        proc.thaw()

    return thaw


FAULTS = {
    "flyd SIGKILL": _flyd_killed,
    "host SIGKILL": _host_killed,
    "SIGSTOP": _frozen,
    "SIGSTOP long": _frozen_long,
}


@pytest.mark.parametrize("fault", FAULTS)
async def test_the_superseded_copy_never_serves_again(cluster: ProxyFleet, fault: str) -> None:
    fleet = cluster
    app = "f" + "".join(c for c in fault.lower() if c.isalnum())
    await eventually(lambda: _alive(fleet), "every worker alive in flaps")
    primary = await fleet.create(app, labels={"side": "a"})
    standby = await fleet.create(app, standby_for=[primary.id])
    assert (primary.worker_id, standby.worker_id) == ("w1", "w2")
    for i in (0, 1):
        await eventually(lambda i=i: _healthy(fleet, app, primary.id, i), f"{app} routed by {i}")
    load = Load(fleet, app)
    load.start()
    try:
        await eventually(lambda: load.served_by(primary.id), "the primary serving")
        back = FAULTS[fault](fleet, primary.worker_id)
        await eventually(lambda: load.served_by(standby.id), "the standby serving")
        # The return: the worker restarts on its data dir, or thaws.
        await asyncio.to_thread(back)
        await eventually(
            lambda: settled(fleet, primary.id, standby.id), "one primary and its standby"
        )
        # The proxies keep sending to the promoted machine alone for a while after.
        count = len(load.answers)
        await eventually(lambda: len(load.answers) >= count + 10, "more answers")
    finally:
        answers = await load.stop()
    check_history(answers, primary.id, standby.id)
    promoted = await fleet.machine(standby.id)
    assert len(await promotions(fleet, promoted)) == 1  # however many proxies noticed
    assert promoted.slot.generation == 1
    old = await fleet.machine(primary.id)
    assert (old.state, old.slot.primary, old.slot.generation) == (STOPPED, standby.id, 1)
    assert await starts(fleet, promoted) == 1
    # A plain start of the old primary, now a standby, is refused: only a promotion starts it.
    stub = fleet.worker(primary.worker_id)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.StartMachine(w.StartMachineRequest(machine_id=primary.id), timeout=T)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "stands by for" in (err.value.details() or "")
    # Done with this slot: its machines leave room for the next fault's.
    for machine_id in (primary.id, standby.id):
        await fleet.machines().DestroyMachine(
            m.DestroyMachineRequest(machine_id=machine_id, force=True), timeout=T
        )


async def _alive(fleet: ProxyFleet) -> bool:
    from flaps.v1 import platform_pb2, platform_pb2_grpc

    stub = platform_pb2_grpc.PlatformServiceStub(fleet._channel(fleet.flaps_address, flaps=True))
    resp = await stub.ListWorkers(platform_pb2.ListWorkersRequest(), timeout=T)
    up = {x.info.id for x in resp.workers if x.status == platform_pb2.WORKER_STATUS_ALIVE}
    return up == set(fleet.workers)


async def _healthy(fleet: ProxyFleet, app: str, machine_id: str, i: int) -> bool:
    routes = {r.machine_id: r for r in await fleet.routes(app, i)}
    return machine_id in routes and routes[machine_id].healthy and len(routes) == 2


async def test_a_worker_told_it_is_outranked_stops_its_copy(cluster: ProxyFleet) -> None:
    """SupersedeMachine, straight to a worker: a claim that outranks the row stops the copy and
    makes it a standby; one that does not changes nothing; bad input changes nothing."""
    fleet = cluster
    primary = await fleet.create("told", labels={"side": "a"})
    stub = fleet.worker(primary.worker_id)
    for generation, who, app, field_name in [
        (0, "x", "told", "generation"),
        (1, "Not An Id", "told", "primary"),
        (1, "zzz", "", "primary_app"),
        (1, "zzz", "another", "primary_app"),  # a slot is one app's
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.SupersedeMachine(
                w.SupersedeMachineRequest(
                    machine_id=primary.id, generation=generation, primary=who, primary_app=app
                ),
                timeout=T,
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_name in (err.value.details() or "")
    # Generation 1 outranks generation 0, whoever claims it: the copy stops and stands by.
    told = await stub.SupersedeMachine(
        w.SupersedeMachineRequest(
            machine_id=primary.id, generation=1, primary="zzz", primary_app="told"
        ),
        timeout=T,
    )
    assert (told.machine.slot.generation, told.machine.slot.primary) == (1, "zzz")

    async def stopped() -> bool:
        return (await fleet.machine(primary.id)).state == STOPPED

    await eventually(stopped, "the outranked copy stopped")
    # A claim that does not outrank the row's changes nothing.
    again = await stub.SupersedeMachine(
        w.SupersedeMachineRequest(
            machine_id=primary.id, generation=1, primary="zzzz", primary_app="told"
        ),
        timeout=T,
    )
    assert (again.machine.slot.primary, again.machine.state) == ("zzz", STOPPED)
    await fleet.machines().DestroyMachine(
        m.DestroyMachineRequest(machine_id=primary.id, force=True), timeout=T
    )


# Runs inside namespace b: creates a primary on side a and its standby on side b, sends GETs
# through the two proxies in turn, cuts b's end of the link once the primary serves, heals it
# once the standby serves, and stops a few GETs after the slot has settled. Prints the history
# (proxy, sent, got, status, machine) and the standby's promote events as JSON.
PARTITION_CLIENT = r"""
import http.client, json, subprocess, sys, time
from pathlib import Path
import grpc
from flaps.v1 import machines_pb2 as m, machines_pb2_grpc
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w, worker_pb2_grpc
from nonomad.security import ClusterSecurity
from proxy.v1 import proxy_pb2 as p, proxy_pb2_grpc
from runtime import CLUSTER_NAME

flaps, proxies_grpc, proxies_http, worker_b, dev, app_code, security_dir = sys.argv[1:8]
proxies_grpc, proxies_http = proxies_grpc.split(","), proxies_http.split(",")
security = ClusterSecurity(Path(security_dir))
ca = security.ca.read_bytes()
cli = security.cert("cli")
token = security.admin_token.read_text().strip()
flaps_tls = grpc.composite_channel_credentials(
    grpc.ssl_channel_credentials(ca), grpc.access_token_call_credentials(token))
member_tls = grpc.ssl_channel_credentials(ca, cli.key.read_bytes(), cli.cert.read_bytes())
# A worker's events are for flaps' certificate only (flyd.access).
as_flaps = security.cert("flaps")
flaps_tls_member = grpc.ssl_channel_credentials(
    ca, as_flaps.key.read_bytes(), as_flaps.cert.read_bytes())

def config(side, code=""):
    c = pb.MachineConfig(
        image="demo:v1",
        guest=pb.GuestConfig(cpu_millicores=100, memory_mib=64),
        services=[pb.ServiceConfig(internal_port=8080, autostart=True)],
        placement=pb.PlacementConfig(required_labels={"side": side}),
    )
    if code:
        c.entrypoint[:] = ["python3", "-u", "-c", code]
    return c

def get(i):
    host, port = proxies_http[i].rsplit(":", 1)
    sent = time.monotonic()
    try:
        conn = http.client.HTTPConnection(host, int(port), timeout=15)
        conn.request("GET", "/", headers={"Host": "part.nonomad.test"})
        r = conn.getresponse()
        r.read()
        conn.close()
        return [i, sent, time.monotonic(), r.status, r.getheader("nonomad-machine-id")]
    except OSError as err:
        return [i, sent, time.monotonic(), 0, repr(err)]

def member(address, credentials=member_tls):
    return grpc.secure_channel(
        address, credentials, options=[("grpc.ssl_target_name_override", CLUSTER_NAME)])

out = {"history": []}
with grpc.secure_channel(flaps, flaps_tls) as ch, member(worker_b, flaps_tls_member) as wch:
    machines = machines_pb2_grpc.MachinesServiceStub(ch)
    admins = [proxy_pb2_grpc.ProxyServiceStub(member(a)) for a in proxies_grpc]
    primary = machines.CreateMachine(m.CreateMachineRequest(
        app="part", region="ams", config=config("a", app_code)), timeout=10).machine
    standby = machines.CreateMachine(m.CreateMachineRequest(
        app="part", region="ams", config=config("b"), standby_for=[primary.id]),
        timeout=10).machine
    out.update(primary=primary.id, standby=standby.id,
               workers=[primary.worker_id, standby.worker_id])
    for admin in admins:
        end = time.monotonic() + 15
        while time.monotonic() < end:
            resp = admin.ListRoutes(p.ListRoutesRequest(app="part"), timeout=5)
            routes = {r.machine_id: r for a in resp.apps for r in a.machines}
            if primary.id in routes and routes[primary.id].healthy and standby.id in routes:
                break
            time.sleep(0.05)
    phase, end, after = "before", time.monotonic() + 45, 0
    while time.monotonic() < end and len(out["history"]) < 3000:
        reply = get(len(out["history"]) % len(proxies_http))
        out["history"].append(reply)
        if "settled" in out:
            after += 1
            if after >= 20:  # both proxies keep sending to the promoted machine alone
                break
        elif phase == "before" and reply[4] == primary.id:
            subprocess.run(["ip", "link", "set", dev, "down"], check=True)
            phase, out["cut"] = "cut", time.monotonic()
        elif phase == "cut" and reply[4] == standby.id:
            subprocess.run(["ip", "link", "set", dev, "up"], check=True)
            phase, out["healed"] = "healed", time.monotonic()
        elif phase == "healed":
            old = machines.GetMachine(m.GetMachineRequest(machine_id=primary.id), timeout=5).machine
            new = machines.GetMachine(m.GetMachineRequest(machine_id=standby.id), timeout=5).machine
            if old.state == pb.MACHINE_STATE_STOPPED and old.slot.primary == standby.id:
                out.update(settled=time.monotonic(), old=old.slot.generation,
                           new=[new.state, new.slot.generation, new.slot.primary])
        time.sleep(0.02)
    out["phase"] = phase
    events = worker_pb2_grpc.WorkerServiceStub(wch).ListMachineEvents(
        w.ListMachineEventsRequest(machine_id=standby.id), timeout=5).events
    out["promotions"] = [e.reason for e in events if e.type == "promote"]
print(json.dumps(out))
"""


async def test_a_partitioned_primary_is_superseded_when_the_link_heals(
    tmp_path: Path, image_source: Path
) -> None:
    reason = netns_unavailable()
    if reason is not None:
        pytest.skip(f"the partition needs network namespaces: {reason}")
    from tests.proxy.support import proxy_fleet

    ns = Netns.create()
    try:
        async with proxy_fleet(tmp_path, image_source) as fleet:
            # Side a: the primary's worker alone. Side b: the standby's, flaps, two proxies
            # and the client (all traffic to the namespaces comes from inside them).
            side_a = fleet._worker(
                "wa",
                "--listen",
                f"{ns.a_ip}:0",
                "--machine-host",
                ns.a_ip,
                "--labels",
                "side=a",
                netns=ns.a,
            )
            side_b = fleet._worker("wb", "--labels", "side=b", netns=ns.b)
            await asyncio.gather(asyncio.to_thread(side_a.start), asyncio.to_thread(side_b.start))
            fleet.workers.update(wa=side_a, wb=side_b)
            fleet.start_flaps(netns=ns.b)
            proxies = [fleet.add_proxy(netns=ns.b) for _ in range(2)]
            app_code = DEMO_APP  # (it binds 0.0.0.0, as the shipped demo does)
            client = await asyncio.create_subprocess_exec(
                "nsenter",
                f"--net=/var/run/netns/{ns.b}",
                "--",
                sys.executable,
                "-c",
                PARTITION_CLIENT,
                fleet.flaps_address,
                ",".join(proxy.address for proxy in proxies),
                ",".join(proxy.http for proxy in proxies),
                side_b.address,
                ns.b_dev,
                app_code,
                str(fleet.tmp / "security"),
                cwd=REPO_ROOT,
                env=clean_env(),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            try:
                async with asyncio.timeout(90):
                    out, err = await client.communicate()
            finally:
                if client.returncode is None:
                    client.kill()
                    await client.wait()
            assert client.returncode == 0, err.decode()[-2000:]
            result = json.loads(out)
            assert result["workers"] == ["wa", "wb"]
            assert result["phase"] == "healed", result["phase"]
            assert "settled" in result
            primary, standby = result["primary"], result["standby"]
            answers = [Answer(*reply) for reply in result["history"]]
            check_history(answers, primary, standby)  # (the standby through both proxies)
            assert result["new"] == [STARTED, 1, standby]
            assert result["old"] == 1
            # However many proxies noticed: one promotion, recorded by the standby's worker.
            assert len(result["promotions"]) == 1, result["promotions"]
    finally:
        ns.remove()


def test_history_checks_catch_what_they_should() -> None:
    """The history check fails on a failed GET and on a late answer of the old primary."""
    ok = [Answer(0, 0, 1, 200, "p"), Answer(1, 1, 2, 200, "s"), Answer(0, 2, 3, 200, "s")]
    check_history(ok, "p", "s")
    with pytest.raises(AssertionError, match="failed"):
        check_history([*ok, Answer(0, 3, 4, 503, "")], "p", "s")
    with pytest.raises(AssertionError, match="answered after"):
        check_history([*ok, Answer(1, 3, 4, 200, "p")], "p", "s")
    assert DEADLINE > 0
