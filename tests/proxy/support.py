"""Test support for the proxy's control plane.

Unit tests: `FakeRegistry` (the replica reads and events the router uses, set by the test),
`FakeFlaps` (starts and stops machines by rewriting the fake registry's rows, the way flyd's
stream would), `FakeProbes` (answers the test chooses), `machine()` to build rows, and `World`,
which runs a `Router` over them on a ManualClock.

Process tests: `ProxyFleet`, real flyd workers, flaps and proxies (see the second half).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.duration_pb2 import Duration
from opentelemetry.trace import Tracer

from flaps.auth import TokenVerifier
from flaps.v1 import machines_pb2 as m
from flaps.v1 import machines_pb2_grpc, platform_pb2, platform_pb2_grpc, tokens_pb2
from flaps.verify import TokenServicer
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from flyd.v1 import worker_pb2_grpc
from model import slots
from model.tokens import Keyring, read_token
from nonomad.security import ClusterSecurity, provision
from proxy.control import Flaps, FlapsFailed
from proxy.router import Router
from proxy.routes import RouterConfig
from proxy.stats import Stats
from proxy.v1 import proxy_pb2, proxy_pb2_grpc
from registry.replica import RESYNC, ReplicaEvent, Subscription, WorkerView, event_key
from registry.view import ALIVE, Status
from runtime.clock import ManualClock
from tests import host_ports
from tests.conftest import _kill_machines, remove_cgroups
from tests.harness import ServiceProcess, channel, clean_env, flyd_args

S = pb.MachineState
STARTED = S.MACHINE_STATE_STARTED
STOPPED = S.MACHINE_STATE_STOPPED

# -- unit-test fakes -----------------------------------------------------------------------------


def machine(
    machine_id: str,
    *,
    app: str = "web",
    worker: str = "w1",
    region: str = "ams",
    state: pb.MachineState.ValueType = STARTED,
    port: int = 0,
    autostart: bool = True,
    autostop: bool = False,
    min_running: int = 0,
    soft: int = 0,
    hard: int = 0,
    checks: Iterable[pb.CheckConfig] = (),
    standbys: Iterable[str] = (),
    services: bool = True,
) -> pb.Machine:
    """A registry row: one HTTP service on internal port 8080, mapped to `port` on 127.0.0.1
    (default: a port derived from the id, so every machine has its own)."""
    config = pb.MachineConfig(image="demo:v1", checks=list(checks), standbys=list(standbys))
    row = pb.Machine(
        id=machine_id, name=machine_id, app=app, region=region, worker_id=worker, state=state
    )
    if services:
        config.services.add(
            internal_port=8080,
            autostart=autostart,
            autostop=autostop,
            min_machines_running=min_running,
            concurrency=pb.ConcurrencyConfig(soft_limit=soft, hard_limit=hard),
        )
        row.ports.add(
            internal_port=8080,
            host="127.0.0.1",
            host_port=port or 20000 + sum(map(ord, machine_id)) % 10000,
        )
    row.config.CopyFrom(config)
    row.instance_id = "i1"
    return row


def http_check(
    path: str = "/healthz", interval: float = 5.0, timeout: float = 1.0
) -> pb.CheckConfig:
    return pb.CheckConfig(
        name="http",
        http=pb.HttpCheck(path=path),
        interval=Duration(seconds=int(interval), nanos=int(interval % 1 * 1e9)),
        timeout=Duration(seconds=int(timeout), nanos=int(timeout % 1 * 1e9)),
    )


class FakeRegistry:
    """`proxy.routes.RegistryView` over rows and worker statuses a test sets directly."""

    def __init__(self) -> None:
        self._workers: dict[str, WorkerView] = {}
        self._machines: dict[str, pb.Machine] = {}
        self._subs: set[Subscription[ReplicaEvent]] = set()

    # -- the test's side
    def add_worker(self, worker_id: str, region: str = "ams", status: Status = ALIVE) -> None:
        info = pb.WorkerInfo(id=worker_id, region=region, address=f"{worker_id}.test:7000")
        self._workers[worker_id] = WorkerView(
            info=info,
            status=status,
            last_heartbeat=1.0,
            capacity=pb.Capacity(),
            seq=0,
            connected=True,
        )
        self._publish(ReplicaEvent("worker", worker_id, None, status))

    def set_status(self, worker_id: str, status: Status) -> None:
        old = self._workers[worker_id]
        self._workers[worker_id] = WorkerView(
            info=old.info,
            status=status,
            last_heartbeat=old.last_heartbeat,
            capacity=old.capacity,
            seq=old.seq,
            connected=status == ALIVE,
        )
        self._publish(ReplicaEvent("worker", worker_id, None, status))

    def put(self, row: pb.Machine) -> None:
        self._machines[row.id] = row
        status = self._workers[row.worker_id].status
        self._publish(ReplicaEvent("machine", row.worker_id, row, status, row.id))

    def set_state(self, machine_id: str, state: pb.MachineState.ValueType) -> pb.Machine:
        row = pb.Machine()
        row.CopyFrom(self._machines[machine_id])
        row.state = state
        self.put(row)
        return row

    def drop(self, machine_id: str) -> None:
        row = self._machines.pop(machine_id)
        self._publish(ReplicaEvent("machine", row.worker_id, None, ALIVE, machine_id))

    def resync(self) -> None:
        self._publish(RESYNC)

    def _publish(self, event: ReplicaEvent) -> None:
        for sub in list(self._subs):
            sub.put(event)

    # -- RegistryView
    def workers(self, region: str | None = None) -> list[WorkerView]:
        return [v for v in self._workers.values() if region is None or v.info.region == region]

    def worker(self, worker_id: str) -> WorkerView | None:
        return self._workers.get(worker_id)

    def machines(
        self, *, app: str | None = None, region: str | None = None, worker_id: str | None = None
    ) -> list[pb.Machine]:
        return [
            row
            for row in self._machines.values()
            if (app is None or row.app == app)
            and (region is None or row.region == region)
            and (worker_id is None or row.worker_id == worker_id)
        ]

    def machine(self, machine_id: str) -> pb.Machine | None:
        return self._machines.get(machine_id)

    def subscribe(
        self, maxsize: int = 1024, *, coalesce: bool = False
    ) -> Subscription[ReplicaEvent]:
        sub: Subscription[ReplicaEvent] = Subscription(
            maxsize, RESYNC, self._subs.discard, event_key if coalesce else None
        )
        self._subs.add(sub)
        return sub


def fleet(*rows: pb.Machine, workers: dict[str, str] | None = None) -> FakeRegistry:
    """A fake registry with workers w1, w2 (ams) and s1 (syd) unless given, and `rows`."""
    registry = FakeRegistry()
    for worker_id, region in (workers or {"w1": "ams", "w2": "ams", "s1": "syd"}).items():
        registry.add_worker(worker_id, region)
    for row in rows:
        registry.put(row)
    return registry


class FakeFlaps:
    """`proxy.control.Flaps` that changes the fake registry's rows, like a real worker would.

    `gate` (set by default) holds every start until the test sets it; `fail` makes the start of
    a machine raise. Every call is recorded in order.
    """

    def __init__(self, registry: FakeRegistry) -> None:
        self.registry = registry
        self.starts: list[str] = []
        self.generations: list[int] = []
        self.stops: list[str] = []
        self.supersedes: list[tuple[str, int, str]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail: dict[str, FlapsFailed] = {}

    async def start(self, machine_id: str, generation: int = 0) -> pb.Machine:
        self.starts.append(machine_id)
        self.generations.append(generation)
        await self.gate.wait()
        if machine_id in self.fail:
            raise self.fail[machine_id]
        row = self.registry.machine(machine_id)
        assert row is not None
        slot = slots.slot_of(row)
        if generation > slot.generation:  # a promotion, as flyd records it before starting
            row = slots.with_slot(
                row, pb.SlotState(id=slot.id, generation=generation, primary=row.id)
            )
            self.registry.put(row)
        if row.state == STARTED:
            return row  # idempotent, as flyd's start is
        return self.registry.set_state(machine_id, STARTED)

    async def stop(self, machine_id: str) -> pb.Machine:
        self.stops.append(machine_id)
        return self.registry.set_state(machine_id, STOPPED)

    async def supersede(self, machine_id: str, generation: int, primary: str) -> pb.Machine:
        self.supersedes.append((machine_id, generation, primary))
        row = self.registry.machine(machine_id)
        assert row is not None
        slot = slots.slot_of(row)
        if not slots.outranks((generation, primary), (slot.generation, slot.primary)):
            return row
        row = slots.with_slot(row, pb.SlotState(id=slot.id, generation=generation, primary=primary))
        self.registry.put(row)
        return self.registry.set_state(machine_id, STOPPED)

    @property
    def started(self) -> set[str]:
        """Machines the fake registry shows started because of a start call."""
        return {
            mid
            for mid in self.starts
            if (row := self.registry.machine(mid)) is not None and row.state == STARTED
        }


class FakeProbes:
    """`proxy.control.Probes` whose answers the test sets; every probe is counted."""

    def __init__(self) -> None:
        self.dead_workers: set[str] = set()
        """Addresses whose health probe fails."""
        self.refusing: set[int] = set()
        """Ports that refuse connections (TCP checks fail)."""
        self.failing_http: set[int] = set()
        """Ports whose HTTP check answers 500."""
        self.worker_probes: list[str] = []
        self.checks: list[tuple[str, int]] = []

    async def worker(self, address: str, timeout: float) -> bool:
        self.worker_probes.append(address)
        return address not in self.dead_workers

    async def tcp(self, host: str, port: int, timeout: float) -> bool:
        self.checks.append(("tcp", port))
        return port not in self.refusing

    async def http(self, host: str, port: int, path: str, method: str, timeout: float) -> bool:
        self.checks.append(("http", port))
        return port not in self.refusing and port not in self.failing_http


async def settle(rounds: int = 30) -> None:
    """Let every task that can run without time passing run."""
    for _ in range(rounds):
        await asyncio.sleep(0)


@dataclass
class World:
    """A Router over fakes on a ManualClock, running until the test ends."""

    registry: FakeRegistry
    flaps: Any
    probes: FakeProbes
    stats: Stats
    clock: ManualClock
    router: Router

    async def advance(self, seconds: float, steps: int = 1) -> None:
        """Move the clock in `steps` equal steps, letting tasks run after each."""
        for _ in range(steps):
            await settle()  # whatever is about to sleep has started its sleep
            self.clock.advance(seconds / steps)
        await settle()


@contextlib.asynccontextmanager
async def world(
    registry: FakeRegistry | None = None,
    flaps: Flaps | None = None,
    *,
    seed: int = 7,
    tracer: Tracer | None = None,
    **config: object,
) -> AsyncIterator[World]:
    """Run a Router (region "ams") over fakes (or the `flaps` given); `config` overrides
    RouterConfig fields."""
    import random

    registry = registry if registry is not None else FakeRegistry()
    flaps = flaps if flaps is not None else FakeFlaps(registry)
    probes = FakeProbes()
    clock = ManualClock()
    stats = Stats()
    router = Router(
        registry,
        flaps,
        stats,
        config=RouterConfig(region="ams", **config),  # type: ignore[arg-type]
        probes=probes,
        clock=clock,
        rng=random.Random(seed),
        tracer=tracer,
    )
    shutdown = asyncio.Event()
    task = asyncio.create_task(router.run(shutdown))
    await settle()
    try:
        yield World(registry, flaps, probes, stats, clock, router)
    finally:
        shutdown.set()
        async with asyncio.timeout(5):
            await task


# -- process tests -------------------------------------------------------------------------------

DEADLINE = 20.0  # any single wait in the process tests; never reached when things work
T = 10.0  # gRPC deadline
DOMAIN = "nonomad.test"


# A tiny app that boots fast: answers every GET (and /healthz) with who served it.
class ProxyProcess(ServiceProcess):
    """The proxy as a process: `address` is its gRPC address, `http` its HTTP address."""

    @property
    def http(self) -> str:
        return self.announced["NONOMAD_HTTP"]


@dataclass
class ProxyFleet:
    """flyd workers, one flaps, proxies: real processes on 127.0.0.1. With `security` (the
    default of `proxy_fleet`), as `nonomad up` runs them: mutual TLS between the parts (the
    proxy calls flaps' cluster port), tokens at flaps; the stubs here hold the admin token and
    the cluster's CLI certificate."""

    tmp: Path
    image_source: Path
    prefix: str
    security: ClusterSecurity | None = None
    workers: dict[str, ServiceProcess] = field(default_factory=dict)
    flaps: ServiceProcess | None = None
    proxies: list[ProxyProcess] = field(default_factory=list)
    channels: list[grpc.aio.Channel] = field(default_factory=list)
    frozen: list[ServiceProcess] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    """Added to the environment of every process (e.g. OTEL_* to export spans)."""

    def _worker(self, worker_id: str, *extra: str, netns: str = "") -> ServiceProcess:
        args = flyd_args(
            self.tmp / worker_id,
            self.image_source,
            worker_id,
            "ams",
            "--ports",
            host_ports.flag(host_ports.block()),
            "--cgroup-prefix",
            self.prefix,
            "--heartbeat-interval",
            "0.1",
            *(self.security.worker_args(worker_id) if self.security else ()),
            *extra,
        )
        return ServiceProcess(
            "flyd", args, self.tmp / f"{worker_id}.log", env=clean_env(**self.env), netns=netns
        )

    def add_worker(self, worker_id: str, *extra: str, netns: str = "") -> ServiceProcess:
        """Spawn a worker: reading its `address` waits until it is ready, so workers added
        one after another boot side by side."""
        proc = self._worker(worker_id, *extra, netns=netns)
        self.workers[worker_id] = proc.spawn()
        return proc

    def restart(self, worker_id: str) -> ServiceProcess:
        """Start the worker's flyd again on its data dir and address (a crashed or killed one;
        a running one is killed first)."""
        old = self.workers[worker_id]
        old.kill()
        args = list(old.args)
        args[args.index("--listen") + 1] = old.address
        proc = ServiceProcess(old.name, args, old.stderr_path, env=old.env, netns=old.netns)
        self.workers[worker_id] = proc.start()
        return proc

    def kill_host(self, worker_id: str) -> None:
        """SIGKILL the worker's flyd and every machine it ran: the host died."""
        self.workers[worker_id].kill()
        _kill_machines(self.tmp / worker_id)

    async def add_workers(self, *worker_ids: str) -> None:
        """Start workers side by side (each takes a second or so to boot)."""
        procs = [self._worker(worker_id).spawn() for worker_id in worker_ids]
        await asyncio.gather(*(asyncio.to_thread(proc.wait_ready) for proc in procs))
        for worker_id, proc in zip(worker_ids, procs, strict=True):
            self.workers[worker_id] = proc

    def _follow_args(self) -> list[str]:
        args = []
        for worker in self.workers.values():
            args += ["--workers", worker.address]
        return args

    def start_flaps(self, netns: str = "") -> ServiceProcess:
        args = ["--listen", "127.0.0.1:0", "--grace-period", "2", *self._follow_args()]
        if self.security is not None:
            args += self.security.flaps_args()
        proc = ServiceProcess(
            "flaps", args, self.tmp / "flaps.log", env=clean_env(**self.env), netns=netns
        )
        self.flaps = proc.start()
        return proc

    def add_proxy(
        self,
        *extra: str,
        region: str = "ams",
        netns: str = "",
        env: dict[str, str] | None = None,
    ) -> ProxyProcess:
        assert self.flaps is not None
        args = [
            "--listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
            "--domain",
            DOMAIN,
            "--region",
            region,
            "--flaps",
            self.flaps.cluster_address if self.security else self.flaps.address,
            "--grace-period",
            "2",
            *self._follow_args(),
            *(self.security.proxy_args() if self.security else ()),
            *extra,
        ]
        n = len(self.proxies)
        proc = ProxyProcess(
            "proxy",
            args,
            self.tmp / f"proxy-{n}.log",
            env={**clean_env(**self.env), **(env or {})},
            netns=netns,
        )
        proc.start()
        self.proxies.append(proc)
        return proc

    def _channel(self, address: str, *, flaps: bool = False, part: str = "cli") -> grpc.aio.Channel:
        """A channel to flaps (TLS, the admin token) or to another part (mutual TLS, with the
        certificate of `part`: the operator's by default)."""
        security = self.security
        if security is None:
            made = channel(address)
        elif flaps:
            made = channel(address, security.client_tls(), read_token(security.admin_token))
        else:
            made = channel(address, security.member_tls(part))
        self.channels.append(made)
        return made

    async def until_alive(self) -> None:
        """Wait until flaps sees every worker alive (it can place on them)."""

        async def alive() -> bool:
            stub = platform_pb2_grpc.PlatformServiceStub(
                self._channel(self.flaps_address, flaps=True)
            )
            resp = await stub.ListWorkers(platform_pb2.ListWorkersRequest(), timeout=T)
            up = {x.info.id for x in resp.workers if x.status == platform_pb2.WORKER_STATUS_ALIVE}
            return up == set(self.workers)

        await eventually(alive, "every worker alive in flaps")

    @property
    def flaps_address(self) -> str:
        assert self.flaps is not None
        return self.flaps.address

    def machines(self) -> machines_pb2_grpc.MachinesServiceStub:
        assert self.flaps is not None
        return machines_pb2_grpc.MachinesServiceStub(self._channel(self.flaps.address, flaps=True))

    def worker(self, worker_id: str) -> worker_pb2_grpc.WorkerServiceStub:
        """A worker, called as flaps calls it: only flaps' certificate may (flyd.access)."""
        address = self.workers[worker_id].address
        return worker_pb2_grpc.WorkerServiceStub(self._channel(address, part="flaps"))

    def admin(self, i: int = 0) -> proxy_pb2_grpc.ProxyServiceStub:
        return proxy_pb2_grpc.ProxyServiceStub(self._channel(self.proxies[i].address))

    def freeze(self, worker_id: str) -> None:
        proc = self.workers[worker_id]
        proc.freeze()
        self.frozen.append(proc)

    async def create(
        self,
        app: str,
        *,
        skip_launch: bool = False,
        standby_for: Iterable[str] = (),
        service: pb.ServiceConfig | None = None,
        entrypoint: Iterable[str] = (),
        labels: dict[str, str] | None = None,
    ) -> pb.Machine:
        config = pb.MachineConfig(
            image="demo:v1",
            guest=pb.GuestConfig(cpu_millicores=100, memory_mib=64),
            services=[service or pb.ServiceConfig(internal_port=8080, autostart=True)],
            entrypoint=list(entrypoint),
            placement=pb.PlacementConfig(required_labels=labels or {}),
        )
        resp = await self.machines().CreateMachine(
            m.CreateMachineRequest(
                app=app,
                region="ams",
                config=config,
                skip_launch=skip_launch,
                standby_for=list(standby_for),
            ),
            timeout=T,
        )
        return resp.machine

    async def machine(self, machine_id: str) -> pb.Machine:
        resp = await self.machines().GetMachine(
            m.GetMachineRequest(machine_id=machine_id), timeout=T
        )
        return resp.machine

    async def starts(self, machine_id: str) -> int:
        """How many times the machine's worker recorded it becoming started (a move into
        STARTED from another state: a started machine's readiness changes are events too)."""
        worker = machine_id.rpartition("-")[0]
        resp = await self.worker(worker).ListMachineEvents(
            w.ListMachineEventsRequest(machine_id=machine_id), timeout=T
        )
        return sum(1 for e in resp.events if e.to_state == STARTED and e.from_state != STARTED)

    async def routes(self, app: str, i: int = 0) -> list[proxy_pb2.RouteMachine]:
        resp = await self.admin(i).ListRoutes(proxy_pb2.ListRoutesRequest(app=app), timeout=T)
        return [mm for a in resp.apps for mm in a.machines]

    async def until_routed(self, app: str, count: int, i: int = 0) -> None:
        """Wait until proxy i knows `count` machines of the app."""
        await eventually(lambda: _has(self.routes(app, i), count), f"{count} routes of {app}")

    async def close(self) -> None:
        for proc in self.frozen:
            with contextlib.suppress(Exception):
                proc.thaw()
        for open_channel in self.channels:
            await open_channel.close()
        for proc in [*self.proxies, *([self.flaps] if self.flaps else []), *self.workers.values()]:
            proc.kill()
        for worker_id in self.workers:
            _kill_machines(self.tmp / worker_id)
        remove_cgroups(self.prefix)


def two_sides(fleet: ProxyFleet, proxies: int) -> ServiceProcess:
    """Start flaps, workers w1 (label side=a) and w2 (side=b) announcing to it, and `proxies`
    proxies following both; returns flaps."""
    flaps = fleet.start_flaps()
    for worker_id, side in (("w1", "a"), ("w2", "b")):
        fleet.add_worker(
            worker_id,
            "--labels",
            f"side={side}",
            "--announce",
            flaps.cluster_address,
            "--announce-interval",
            "0.5",
        )
    follow = [arg for wp in fleet.workers.values() for arg in ("--workers", wp.address)]
    for _ in range(proxies):
        fleet.add_proxy(*follow, "--peers", flaps.cluster_address)
    return flaps


async def _has(routes: object, count: int) -> bool:
    assert asyncio.iscoroutine(routes)
    return len(await routes) == count


async def eventually(check: Callable[[], object], what: str, deadline: float = DEADLINE) -> None:
    """Poll `check()` (plain or async) every 20 ms until true; fail after `deadline`."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline
    while True:
        with contextlib.suppress(grpc.aio.AioRpcError, OSError):
            got = check()
            if asyncio.iscoroutine(got):
                got = await got
            if got:
                return
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def proxy_fleet(
    tmp: Path, image_source: Path, env: dict[str, str] | None = None, *, secure: bool = True
) -> AsyncIterator[ProxyFleet]:
    """A ProxyFleet under `tmp`; `secure`: with a CA, certificates and keys of its own."""
    import uuid

    parts = ["flaps", "proxy", "registry", "console"]  # each worker's: when it starts
    security = provision(tmp / "security", parts) if secure else None
    fleet = ProxyFleet(
        tmp,
        image_source,
        prefix=f"nonomad-test-{uuid.uuid4().hex[:8]}",
        env=dict(env or {}),
        security=security,
    )
    try:
        yield fleet
    finally:
        await fleet.close()


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes


async def get(
    address: str,
    app: str,
    path: str = "/",
    *,
    headers: dict[str, str] | None = None,
    method: str = "GET",
) -> Reply:
    """One HTTP/1.1 request (a GET unless told) through the proxy at `address` for
    `<app>.<DOMAIN>`, on a new connection (Connection: close), bounded by DEADLINE."""
    host, _, port = address.rpartition(":")
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    async with asyncio.timeout(DEADLINE):
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(
                f"{method} {path} HTTP/1.1\r\nHost: {app}.{DOMAIN}\r\n{extra}"
                "Connection: close\r\n\r\n".encode()
            )
            await writer.drain()
            raw = await reader.read()
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    hdrs = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        hdrs[k.strip().lower()] = v.strip()
    if hdrs.get("transfer-encoding", "").lower() == "chunked":
        body = _dechunk(body)
    return Reply(status, hdrs, body)


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += data[:size]
        data = data[size + 2 :]
    return out


def port_accepts(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0


# -- network namespaces ----------------------------------------------------------------------------


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=False)


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"nnm-probe-{secrets.token_hex(3)}"
    made = _ip("netns", "add", name)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "del", name)
    return None


@dataclass
class Netns:
    """Two network namespaces this test made, `a` and `b`, joined by a veth pair: `a_ip` in
    a, `b_ip` in b. Nothing outside them talks to their addresses."""

    a: str
    b: str
    a_ip: str
    b_ip: str
    b_dev: str

    @classmethod
    def create(cls) -> Netns:
        tag = secrets.token_hex(3)
        octet = int(tag[:2], 16)
        ns = cls(
            a=f"nnm-{tag}-a",
            b=f"nnm-{tag}-b",
            a_ip=f"10.213.{octet}.1",
            b_ip=f"10.213.{octet}.2",
            b_dev=f"vb{tag}",
        )
        a_dev = f"va{tag}"
        steps = [
            ("netns", "add", ns.a),
            ("netns", "add", ns.b),
            (
                "link",
                "add",
                a_dev,
                "netns",
                ns.a,
                "type",
                "veth",
                "peer",
                "name",
                ns.b_dev,
                "netns",
                ns.b,
            ),
            ("-n", ns.a, "addr", "add", f"{ns.a_ip}/30", "dev", a_dev),
            ("-n", ns.b, "addr", "add", f"{ns.b_ip}/30", "dev", ns.b_dev),
            ("-n", ns.a, "link", "set", a_dev, "up"),
            ("-n", ns.b, "link", "set", ns.b_dev, "up"),
            ("-n", ns.a, "link", "set", "lo", "up"),
            ("-n", ns.b, "link", "set", "lo", "up"),
        ]
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                ns.remove()
                raise RuntimeError(f"ip {' '.join(step)}: {done.stderr.strip()}")
        return ns

    def remove(self) -> None:
        for name in (self.a, self.b):
            _ip("netns", "del", name)


def flaps_verifies(
    keys: Keyring, revoked: Callable[[], frozenset[str]] = frozenset
) -> Callable[[str], Awaitable[tokens_pb2.VerifyTokenResponse]]:
    """What the proxy's FlapsClient.verify_token gets from a flaps holding `keys`: flaps' own
    TokenServicer, called in process (tests/flaps/test_auth.py calls it over gRPC)."""
    servicer = TokenServicer(TokenVerifier(lambda: keys, revoked))

    async def verify(token: str) -> tokens_pb2.VerifyTokenResponse:
        return await servicer.VerifyToken(tokens_pb2.VerifyTokenRequest(token=token), None)  # type: ignore[arg-type]

    return verify
