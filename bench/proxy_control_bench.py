"""Proxy control-plane benchmark: scale from zero, and failover after a worker dies.

Real processes on 127.0.0.1: flyd workers (default 200 ms heartbeats), one flaps and one proxy
(default detection settings: suspect after 0.5 s, probe deadline 0.3 s). Workers announce
themselves to flaps and to the proxy, so a fresh worker can join for each failover run.

1. cold start: an app whose only machine is created but not started; the time of one HTTP
   request through the proxy (it starts the machine through flaps and holds the request until
   the port accepts). Measured against the app's own boot on the same machine afterwards:
   stopped again, started straight through flaps, and polled every 2 ms until its port
   accepts (from StartMachine returning), and the StartMachine call itself.
2. failover: a primary on a worker of its own and a standby on another; SIGKILL the
   primary's flyd (its machine keeps running: the edge cannot know that), then send requests
   one after another until the standby answers one. The time from the kill to that answer.

Both flyd drivers, side by side: the same fleet with machines as host processes, then as crun
containers (whose published ports netd serves once the app listens in its namespace).

`python -c "from bench.proxy_control_bench import main; main()" [--quick]`. Bounded: a few
runs each, every wait has a deadline, each driver's run is cut off after RUN_DEADLINE.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import grpc

from bench import procs, report
from bench.procs import progress
from bench.report import Results, percentile
from flaps.v1 import machines_pb2 as m
from flaps.v1 import machines_pb2_grpc
from flyd.drivers.oci import probe as oci_probe
from flyd.drivers.rundir import kill_all
from flyd.v1 import machine_pb2 as pb
from model.images.owners import PUBLIC
from nonomad.cli_local import build_demo
from proxy.v1 import proxy_pb2, proxy_pb2_grpc
from runtime import READY_PREFIX, read_announcements

S = pb.MachineState
STARTED = S.MACHINE_STATE_STARTED
DOMAIN = "nonomad.bench"
RUN_DEADLINE = 240.0
WAIT = 20.0  # any single wait
RPC_TIMEOUT = 15.0
COLD_TARGET_MS = 50.0
FAILOVER_TARGET_S = 1.5


@dataclass
class Service:
    """One nonomad service process; `address` (gRPC) and `http` (proxy only) from stdout."""

    module: str
    args: list[str]
    log: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    address: str = ""
    http: str = ""
    announced: dict[str, str] = field(default_factory=dict)

    def start(self) -> Service:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", f"from {self.module}.main import main; main()", *self.args],
                cwd=procs.REPO_ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
            )
        try:
            announced = read_announcements(self.proc, 30)
        except RuntimeError:
            self.kill()
            raise RuntimeError(f"{self.module} did not become ready; see {self.log}") from None
        self.address = announced[READY_PREFIX]
        self.http = announced.get("NONOMAD_HTTP", "")
        self.announced = announced
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()


@dataclass
class Fleet:
    root: Path
    prefix: str
    env: dict[str, str]
    driver: str = "process"
    services: list[Service] = field(default_factory=list)
    workers: dict[str, Service] = field(default_factory=dict)
    channels: list[grpc.aio.Channel] = field(default_factory=list)
    ports: int = 0

    def worker(self, worker_id: str, *announce: str, label: str = "") -> Service:
        low = 30000 + 100 * self.ports
        self.ports += 1
        args = [
            "--listen", "127.0.0.1:0",
            "--data-dir", str(self.root / worker_id),
            "--image-source", str(self.root / "images"),
            "--worker-id", worker_id,
            "--region", "ams",
            "--ports", f"{low}-{low + 99}",
            "--cgroup-prefix", self.prefix,
            "--grace-period", "2",
            "--driver", self.driver,
        ]  # fmt: skip
        for target in announce:
            args += ["--announce", target]
        if label:
            args += ["--labels", f"role={label}"]
        service = Service("flyd", args, self.root / "logs" / f"{worker_id}.log", self.env)
        self.services.append(service)
        self.workers[worker_id] = service
        return service

    def add(self, module: str, args: list[str]) -> Service:
        service = Service(module, args, self.root / "logs" / f"{module}.log", self.env)
        self.services.append(service)
        return service.start()

    def channel(self, address: str) -> grpc.aio.Channel:
        channel = grpc.aio.insecure_channel(address)
        self.channels.append(channel)
        return channel

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()
        for service in self.services:
            service.kill()
        for worker_id in self.workers:
            kill_all(self.root / worker_id / "machines")
        procs.remove_cgroups(self.prefix)


def proxy_args(flaps: str, *extra: str) -> list[str]:
    """A bench proxy's command line: ports the kernel picks on 127.0.0.1, the bench's domain,
    region ams, `flaps` to start machines through; `extra` after."""
    return [
        "--listen", "127.0.0.1:0",
        "--http-listen", "127.0.0.1:0",
        "--domain", DOMAIN,
        "--region", "ams",
        "--flaps", flaps,
        "--grace-period", "2",
        *extra,
    ]  # fmt: skip


def run_on_demo(
    root: Path, results: Results, body: Callable[[], Coroutine[Any, Any, None]]
) -> None:
    """Build the demo app `make up` deploys into `root`/images, run `body`, and note in
    `results` its error (if any) and how long it all took; `root` is removed after."""
    t0 = time.perf_counter()
    try:
        build_demo(root / "images", owners=PUBLIC)
        asyncio.run(body())
    except Exception as err:
        results.errors.append(f"{type(err).__name__}: {err}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results.details["total_seconds"] = round(time.perf_counter() - t0, 1)


async def _until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    end = time.monotonic() + WAIT
    while time.monotonic() < end:
        with contextlib.suppress(grpc.aio.AioRpcError, OSError):
            if await check():
                return
        await asyncio.sleep(0.01)
    raise TimeoutError(f"timed out waiting for {what}")


async def _get(address: str, app: str) -> tuple[int, str]:
    """One GET through the proxy on a new connection: (status, machine that answered)."""
    host, _, port = address.rpartition(":")
    async with asyncio.timeout(WAIT):
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(
                f"GET / HTTP/1.1\r\nHost: {app}.{DOMAIN}\r\nConnection: close\r\n\r\n".encode()
            )
            raw = await reader.read()
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    head = raw.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
    machine = next(
        (h.split(":", 1)[1].strip() for h in head if h.lower().startswith("nonomad-machine-id:")),
        "",
    )
    return int(head[0].split()[1]), machine


async def _accepts(host: str, port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection(host, port)
    except OSError:
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def _first_accept(host: str, port: int) -> float:
    """Poll every 2 ms until host:port accepts; the wall-clock time it first did."""
    end = time.monotonic() + WAIT
    while not await _accepts(host, port):
        if time.monotonic() > end:
            raise TimeoutError(f"{host}:{port} never accepted")
        await asyncio.sleep(0.002)
    return time.time()


def _config(label: str) -> pb.MachineConfig:
    # A whole core: at a tenth of one, the app's Python start-up alone takes ~0.6 s.
    return pb.MachineConfig(
        image="demo:v1",
        guest=pb.GuestConfig(cpu_millicores=1000, memory_mib=64),
        services=[pb.ServiceConfig(internal_port=8080, autostart=True)],
        placement=pb.PlacementConfig(required_labels={"role": label}),
    )


async def _routed(admin: proxy_pb2_grpc.ProxyServiceStub, app: str, healthy: set[str]) -> bool:
    resp = await admin.ListRoutes(proxy_pb2.ListRoutesRequest(app=app), timeout=RPC_TIMEOUT)
    routes = {r.machine_id: r for a in resp.apps for r in a.machines}
    return all(mid in routes and routes[mid].healthy for mid in healthy) and bool(routes)


async def _measure(fleet: Fleet, res: Results, cold_runs: int, failover_runs: int) -> None:
    # Workers: one for cold starts, one for standbys; primaries get a fresh worker each run.
    base, standby_worker = fleet.worker("cold", label="cold"), fleet.worker("spare", label="spare")
    await asyncio.gather(asyncio.to_thread(base.start), asyncio.to_thread(standby_worker.start))
    follow = ["--workers", base.address, "--workers", standby_worker.address]
    flaps = fleet.add("flaps", ["--listen", "127.0.0.1:0", "--grace-period", "2", *follow])
    proxy = fleet.add("proxy", proxy_args(flaps.address, *follow))
    machines = machines_pb2_grpc.MachinesServiceStub(fleet.channel(flaps.address))
    admin = proxy_pb2_grpc.ProxyServiceStub(fleet.channel(proxy.address))
    progress(f"flaps at {flaps.address}, proxy at {proxy.address} (http {proxy.http})")

    async def create(app: str, label: str, standby_for: list[str] | None = None) -> pb.Machine:
        request = m.CreateMachineRequest(
            app=app,
            region="ams",
            config=_config(label),
            skip_launch=True,
            standby_for=standby_for or [],
        )
        end = time.monotonic() + WAIT
        while True:  # flaps may not have seen a new worker yet
            try:
                return (await machines.CreateMachine(request, timeout=RPC_TIMEOUT)).machine
            except grpc.aio.AioRpcError:
                if time.monotonic() > end:
                    raise
            await asyncio.sleep(0.05)

    async def routed(app: str, healthy: set[str]) -> None:
        await _until(partial(_routed, admin, app, healthy), f"{app} routed")

    # 1. scale from zero
    cold_ms, boot_ms, overhead_ms, direct_ms, rpc_ms = [], [], [], [], []
    for i in range(cold_runs):
        app = f"cold{i}"
        machine = await create(app, "cold")
        await routed(app, set())
        port = machine.ports[0]
        # A poller notes when the app's port first accepts: the end of its own boot.
        poller = asyncio.create_task(_first_accept(port.host, port.host_port))
        t0 = time.perf_counter()
        status, served = await _get(proxy.http, app)
        cold_ms.append((time.perf_counter() - t0) * 1000)
        if status != 200 or served != machine.id:
            raise RuntimeError(f"cold request {i}: {status} from {served!r}")
        accepted = await poller
        row = (
            await machines.GetMachine(m.GetMachineRequest(machine_id=machine.id), timeout=30)
        ).machine
        started = max(e.time.ToNanoseconds() / 1e9 for e in row.events if e.to_state == STARTED)
        boot_ms.append((accepted - started) * 1000)
        overhead_ms.append(cold_ms[-1] - boot_ms[-1])
        # The same machine's start and boot straight through flaps, without the proxy.
        await machines.StopMachine(m.StopMachineRequest(machine_id=machine.id), timeout=30)
        await machines.WaitMachine(
            m.WaitMachineRequest(machine_id=machine.id, state=S.MACHINE_STATE_STOPPED), timeout=30
        )
        t0 = time.perf_counter()
        await machines.StartMachine(m.StartMachineRequest(machine_id=machine.id), timeout=30)
        rpc_ms.append((time.perf_counter() - t0) * 1000)
        await _first_accept(port.host, port.host_port)
        direct_ms.append((time.perf_counter() - t0) * 1000)
        await machines.DestroyMachine(
            m.DestroyMachineRequest(machine_id=machine.id, force=True), timeout=30
        )
        progress(
            f"cold {i}: {cold_ms[-1]:.0f} ms through the proxy (app boot {boot_ms[-1]:.0f} ms); "
            f"{direct_ms[-1]:.0f} ms straight through flaps"
        )
    res.add("cold-start request p50", percentile(cold_ms, 50), "ms", note=f"{cold_runs} runs")
    res.add("  the app's own boot p50 (started -> port accepts)", percentile(boot_ms, 50), "ms")
    res.add(
        "  cold start beyond the app's boot p50",
        percentile(overhead_ms, 50),
        "ms",
        target=("<=", COLD_TARGET_MS),
        note="StartMachine via flaps + noticing the port + the request",
    )
    res.add("  cold-start request max", max(cold_ms), "ms")
    res.add("StartMachine + boot straight through flaps p50", percentile(direct_ms, 50), "ms")
    res.add("  StartMachine through flaps p50", percentile(rpc_ms, 50), "ms")

    # 2. failover on SIGKILL
    failover_s = []
    for i in range(failover_runs):
        worker_id = f"prim{i}"
        primary_worker = fleet.worker(worker_id, flaps.address, proxy.address, label=worker_id)
        await asyncio.to_thread(primary_worker.start)
        app = f"db{i}"
        primary = await create(app, worker_id)
        await machines.StartMachine(m.StartMachineRequest(machine_id=primary.id), timeout=30)
        standby = await create(app, "spare", standby_for=[primary.id])
        await routed(app, {primary.id})
        status, served = await _get(proxy.http, app)
        if (status, served) != (200, primary.id):
            raise RuntimeError(f"failover run {i}: before the kill {status} from {served!r}")
        killed = time.perf_counter()
        primary_worker.kill()
        statuses = []
        while time.perf_counter() - killed < WAIT:
            status, served = await _get(proxy.http, app)
            statuses.append(status)
            if served == standby.id:
                break
            await asyncio.sleep(0.005)
        else:
            raise RuntimeError(f"failover run {i}: the standby never answered ({statuses})")
        failover_s.append(time.perf_counter() - killed)
        res.details.setdefault("failover_statuses", []).append(statuses)
        progress(f"failover {i}: {failover_s[-1]:.3f} s, {len(statuses)} requests")
        # The standby worker keeps capacity for the next run.
        await machines.DestroyMachine(
            m.DestroyMachineRequest(machine_id=standby.id, force=True), timeout=30
        )
    res.add(
        "worker SIGKILL -> first request served by the standby p50",
        percentile(failover_s, 50),
        "s",
        target=("<=", FAILOVER_TARGET_S),
        note=f"{failover_runs} runs; suspect 0.5 s + probe, flyd heartbeat 0.2 s",
    )
    res.add("  worker SIGKILL -> standby serving, max", max(failover_s), "s")
    dropped = sum(1 for run in res.details["failover_statuses"] for s in run if s != 200)
    res.add("  requests not answered 200 during failovers", dropped, "", target=("==", 0))
    stats = await admin.GetStats(proxy_pb2.GetStatsRequest(), timeout=RPC_TIMEOUT)
    res.details.update(
        cold_ms=cold_ms,
        boot_ms=boot_ms,
        overhead_ms=overhead_ms,
        direct_ms=direct_ms,
        failover_s=failover_s,
        proxy_cold_starts=stats.cold_starts,
        proxy_failovers=stats.failovers,
    )


def run(
    *,
    quick: bool = False,
    out: Path | None = None,
    strict: bool = False,
    drivers: tuple[str, ...] = ("process", "oci"),
) -> int:
    """Run the benchmark once per flyd driver and print them side by side; write JSON to `out`
    when given. Returns 0, or 1 on an error (or, with `strict`, a missed target)."""
    cold_runs, failover_runs = (3, 2) if quick else (7, 5)
    title = f"proxy control plane: scale from zero and failover{' (quick)' if quick else ''}"
    runs: dict[str, Results] = {}
    for driver in drivers:
        results = Results(f"{title}: {driver} driver")
        runs[driver] = results
        problem = oci_probe() if driver == "oci" else None
        if problem is not None:
            results.errors.append(f"the oci driver cannot run here: {problem}")
            continue
        progress(f"== {driver} driver")
        _run_one(results, driver, cold_runs, failover_runs, quick)
    print(report.side_by_side(title, runs))
    if out is not None:
        report.write_runs(out, title, runs)
    failed = any(r.errors for r in runs.values())
    return 1 if failed or (strict and any(r.missed for r in runs.values())) else 0


def _run_one(
    results: Results, driver: str, cold_runs: int, failover_runs: int, quick: bool
) -> None:
    root = Path(tempfile.mkdtemp(prefix="nonomad-proxy-bench-"))
    prefix = f"nonomad-bench-{secrets.token_hex(4)}"
    fleet = Fleet(root, prefix, procs.clean_env(root / "pycache"), driver=driver)

    async def bounded() -> None:
        try:
            async with asyncio.timeout(RUN_DEADLINE):
                await _measure(fleet, results, cold_runs, failover_runs)
        finally:
            await fleet.close()

    run_on_demo(root, results, bounded)
    results.details["quick"] = quick


def main(argv: list[str] | None = None) -> int:
    return report.main(run, "proxy_control_bench", __doc__, "3 cold starts and 2 failovers", argv)


if __name__ == "__main__":
    sys.exit(main())
