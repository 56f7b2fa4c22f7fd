"""flaps benchmarks: what a placement costs as the fleet grows, and with real workers.

1. A simulated fleet (bench/flaps_fleet.py, a child process) of 100, 1,000 and 10,000 workers
   in ten regions, 20 demo machines each (100 with `--full`), seen by a real flaps process
   through the registry's real Follow protocol (flaps runs with `--upstream`), with one fake
   worker that answers every claim at once. For each size: the time flaps takes to load the
   view, its RSS, create latency (one client), placements per second (16 clients), refusal
   latency (a guest no worker can hold: NO_CAPACITY; and one whose memory and CPU fit every
   worker but whose disk fits none), and how late flaps' event loop ran (flaps measures it with
   a 1 ms timer, `--loop-lag-interval`), held against 1 ms while loading, with one client and
   with 16. RSS per row is the growth of flaps' RSS from the smallest fleet to the largest, per
   machine row added. (A proxy following the same fleet is not measured here: starting one
   against the simulated upstream needs a proxy fleet the bench does not build yet.)
2. Ten real flyd processes (one region) followed directly by a real flaps: create latency (a
   machine that starts), create -> started as a client sees it (CreateMachine, then WaitMachine
   STARTED through flaps), and placements per second with 16 clients (creates with
   skip_launch, so what is timed is placement and flyd's durable create, not process spawns).
   Then the same load again under py-spy, which writes flame graphs of flaps and of one flyd
   to bench/results/ (flaps-profile.svg, flyd-profile.svg); so is flaps placing on the largest
   simulated fleet, after its timed phases (flaps-<workers>-profile.svg).

Every load loop is bounded in count and in time; every process the run starts is stopped, and
the machines and cgroups of the real flyds are removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench import procs
from bench.flaps_fleet import DEMO, REGIONS
from bench.procs import FlydProcess, progress
from bench.report import Results, percentile
from flaps.v1 import machines_pb2 as m
from flaps.v1 import machines_pb2_grpc, platform_pb2, platform_pb2_grpc
from flyd.images.build import build_image
from flyd.v1 import machine_pb2 as pb
from model.images.owners import PUBLIC
from model.validate import DEFAULT_DISK_MIB, MAX_DISK_MIB
from nonomad.spec import load_spec
from runtime import METRICS_PREFIX, READY_PREFIX, read_announcements

RESULTS = Path(__file__).resolve().parent / "results"
FLAPS_BIN = procs.VENV_BIN / "flaps"
PY_SPY = procs.VENV_BIN / "py-spy"
RPC_TIMEOUT = 30.0
CLIENTS = 16
LAG_INTERVAL = 0.001
# The simulated fleet sends this many heartbeats per second at most, in all: each worker beats
# every max(0.2 s, workers / HEARTBEATS_PER_SECOND) seconds, and flaps judges liveness by that.
HEARTBEATS_PER_SECOND = 5_000
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]


@dataclass(frozen=True)
class Config:
    sizes: tuple[int, ...] = (100, 1_000, 10_000)
    machines_each: int = 20
    creates: int = 300
    throughput_creates: int = 4_000
    refusals: int = 200
    phase_seconds: float = 15.0
    load_timeout: float = 300.0
    real_flyds: int = 10
    real_creates: int = 100
    real_throughput: int = 4_000
    profile_seconds: float = 8.0


FULL = Config()
QUICK = Config(
    sizes=(100, 1_000),
    creates=50,
    throughput_creates=500,
    refusals=50,
    phase_seconds=5.0,
    real_flyds=3,
    real_creates=20,
    real_throughput=300,
    profile_seconds=2.0,
)


# -- processes ---------------------------------------------------------------------------------


@dataclass
class Child:
    """A child process this run started; `stop` ends it (SIGTERM, then SIGKILL)."""

    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        return self.proc.returncode

    def rss_kib(self) -> int:
        value = procs.status_kib(self.pid, "VmRSS")
        if value is None:
            raise RuntimeError(f"process {self.pid} is not running; log {self.log}")
        return value


def start_fleet(
    workers: int, machines_each: int, heartbeat: float, logs: Path
) -> tuple[Child, str]:
    """The simulated fleet; (its process, the registry address)."""
    log = logs / f"fleet-{workers}.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.flaps_fleet",
                str(workers),
                str(machines_each),
                str(heartbeat),
            ],
            cwd=procs.REPO_ROOT,
            env=procs.clean_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
        )
    child = Child(proc, log)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the fleet is built before it answers: rows take a while
    if not line:
        child.stop()
        raise RuntimeError(f"the simulated fleet did not start; see {log}")
    return child, json.loads(line)["registry"]


def start_flaps(args: list[str], logs: Path, name: str) -> tuple[Child, str, str]:
    """A flaps process; (it, its gRPC address, its metrics address)."""
    log = logs / f"{name}.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [
                str(FLAPS_BIN),
                "--listen",
                "127.0.0.1:0",
                "--metrics-listen",
                "127.0.0.1:0",
                "--loop-lag-interval",
                str(LAG_INTERVAL),
                "--log-level",
                "warning",
                "--max-message-bytes",
                str(64 << 20),
                *args,
            ],
            cwd=procs.REPO_ROOT,
            env=procs.clean_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
        )
    child = Child(proc, log)
    try:
        lines = read_announcements(proc, 60)
    except RuntimeError as error:
        child.stop()
        raise RuntimeError(f"flaps {error}; see {log}") from None
    return child, lines[READY_PREFIX], lines[METRICS_PREFIX]


# -- reading flaps' metrics ----------------------------------------------------------------------


def scrape(address: str, *names: str) -> dict[str, float]:
    """Samples from flaps' /metrics by sample name as exposed (`..._total`, `..._bucket`)."""
    query = "&".join(f"name[]={n}" for n in names)
    with urllib.request.urlopen(f"http://{address}/metrics?{query}", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


LAG_FAMILY = (
    "nonomad_event_loop_lag_seconds_bucket",
    "nonomad_event_loop_held_seconds_bucket",
    "nonomad_event_loop_lag_max_seconds",
)


@dataclass(frozen=True)
class Lag:
    """flaps' loop-lag histograms at one moment; subtract two to judge the time between.

    `lag`: how late each 1 ms timer woke. `held`: of that, the time flaps' loop thread spent
    running (a step holding the loop) rather than waiting for a CPU on this shared host."""

    lag: dict[float, float]
    held: dict[float, float]
    worst: float

    @classmethod
    async def read(cls, address: str) -> Lag:
        samples = await asyncio.to_thread(scrape, address, *LAG_FAMILY)
        found: dict[str, dict[float, float]] = {"lag": {}, "held": {}}
        for key, value in samples.items():
            name, _, labels = key.partition("{")
            kind = name.removeprefix("nonomad_event_loop_").removesuffix("_seconds_bucket")
            if kind in found:
                bound = labels.partition('le="')[2].partition('"')[0]
                found[kind][float(bound)] = value
        return cls(
            found["lag"],
            found["held"],
            samples.get("nonomad_event_loop_lag_max_seconds", float("nan")),
        )

    def since(self, earlier: Lag, *, held: bool = False) -> tuple[float, int, int]:
        """(the smallest bucket bound every sample since `earlier` fits under, samples over
        1 ms, wake-ups)."""
        now, then = (self.held, earlier.held) if held else (self.lag, earlier.lag)
        diff = {b: now[b] - then.get(b, 0.0) for b in now}
        total = diff.get(float("inf"), 0.0)
        bound = min((b for b, n in diff.items() if n >= total), default=float("nan"))
        over_1ms = total - diff.get(0.001, 0.0)
        return bound, int(over_1ms), int(total)


# -- load ----------------------------------------------------------------------------------------


def demo_config() -> pb.MachineConfig:
    return load_spec(DEMO).machine_config("ams", "bench")


class Flaps:
    """Stubs of one flaps."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.machines = machines_pb2_grpc.MachinesServiceStub(self.channel)
        self.platform = platform_pb2_grpc.PlatformServiceStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def create(
        self, config: pb.MachineConfig, region: str, *, skip_launch: bool = False
    ) -> m.CreateMachineResponse:
        return await self.machines.CreateMachine(
            m.CreateMachineRequest(
                app="bench",
                region=region,
                config=config,
                idempotency_key=secrets.token_hex(8),
                skip_launch=skip_launch,
            ),
            timeout=RPC_TIMEOUT,
        )


async def timed(count: int, seconds: float, call: Callable[[int], Awaitable[None]]) -> list[float]:
    """Run call(0), call(1), ... one after another until `count` or `seconds`; each in ms."""
    out = []
    end = time.perf_counter() + seconds
    for i in range(count):
        t0 = time.perf_counter()
        await call(i)
        out.append((time.perf_counter() - t0) * 1000)
        if time.perf_counter() > end:
            break
    return out


async def throughput(
    count: int, seconds: float, clients: int, call: Callable[[int], Awaitable[None]]
) -> tuple[float, int]:
    """`clients` loops calling call(i) until `count` calls or `seconds`; (calls/s, calls)."""
    items = iter(range(count))
    done = 0
    end = time.perf_counter() + seconds

    async def client() -> None:
        nonlocal done
        for i in items:
            if time.perf_counter() > end:
                return
            await call(i)
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return done / (time.perf_counter() - t0), done


def _ms(values: list[float], pct: float) -> float:
    return percentile(values, pct)


# -- 1. the simulated fleet ----------------------------------------------------------------------


@dataclass
class SizeResult:
    workers: int
    rows: int
    rss_kib: int
    load_s: float
    create_ms: list[float]
    per_second: float
    cpu_ms: float
    refusal_ms: list[float]
    disk_refusal_ms: list[float]
    """Refusals of a guest whose memory and CPU fit everywhere but no worker has its disk."""
    lag_load: tuple[float, int, int]
    held_load: tuple[float, int, int]
    lag_place: tuple[float, int, int]
    held_place: tuple[float, int, int]
    lag_busy: tuple[float, int, int]
    held_busy: tuple[float, int, int]
    worst_lag: float


async def simulated(size: int, cfg: Config, logs: Path) -> SizeResult:
    heartbeat = max(0.2, size / HEARTBEATS_PER_SECOND)
    fleet, registry = await asyncio.to_thread(start_fleet, size, cfg.machines_each, heartbeat, logs)
    flaps_proc = None
    try:
        progress(f"{size} workers: fleet up (heartbeat every {heartbeat:g}s); starting flaps")
        flaps_proc, address, metrics = await asyncio.to_thread(
            start_flaps,
            [
                "--upstream",
                registry,
                # Generous: a flaps whose loop is held up by placements would otherwise
                # apply heartbeats late and count live workers dead (the old flaps did at
                # 1,000 workers); the loop lag is measured instead.
                "--suspect-after",
                str(max(5.0, 10 * heartbeat)),
                "--dead-after",
                str(max(10.0, 20 * heartbeat)),
                # A worker's heartbeat vouches for the keys it holds for longer than it takes
                # the next to come (the creates here are under keys: docs/simulator.md).
                "--key-vouch-margin",
                str(max(1.0, 3 * heartbeat + 1.0)),
            ],
            logs,
            f"flaps-{size}",
        )
        t0 = time.perf_counter()
        lag0 = await Lag.read(metrics)
        snapshots = 'nonomad_registry_events_applied_total{kind="snapshot"}'
        while True:
            applied = await asyncio.to_thread(scrape, metrics, snapshots.partition("{")[0])
            if applied.get(snapshots, 0) >= size:
                break
            if time.perf_counter() - t0 > cfg.load_timeout:
                raise RuntimeError(f"flaps loaded {applied.get(snapshots)} of {size} workers")
            await asyncio.sleep(0.05)
        load_s = time.perf_counter() - t0
        lag1 = await Lag.read(metrics)
        rss = flaps_proc.rss_kib()
        progress(f"{size} workers: loaded in {load_s:.1f}s, flaps RSS {rss / 1024:.0f} MiB")
        client = Flaps(address)
        config = demo_config()
        rng = random.Random(size)
        try:
            # Every region must be alive before timing: the view is complete.
            regions = await client.platform.ListRegions(
                platform_pb2.ListRegionsRequest(), timeout=RPC_TIMEOUT
            )
            alive = sum(r.alive_workers for r in regions.regions)
            if alive != size:
                raise RuntimeError(f"{alive} of {size} workers alive in flaps' view")

            async def create(_: int) -> None:
                await client.create(config, rng.choice(REGIONS))

            await timed(10, cfg.phase_seconds, create)  # warm-up: channels, caches
            huge = pb.MachineConfig()
            huge.CopyFrom(config)
            huge.guest.memory_mib = 262_144  # the most a guest may ask for; more than any host has

            async def refuse(_: int) -> None:
                try:
                    await client.create(huge, rng.choice(REGIONS))
                except grpc.aio.AioRpcError as err:
                    if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                        raise
                else:
                    raise RuntimeError("a guest no worker can hold was placed")

            # Memory and CPU fit on every worker, the disk on none (the simulated hosts have
            # a default disk per slot, far from the most a guest may ask): the refusal the
            # index answers from its disk dimension, not a scan.
            diskful = pb.MachineConfig()
            diskful.CopyFrom(config)
            diskful.guest.disk_mib = MAX_DISK_MIB

            async def refuse_disk(_: int) -> None:
                try:
                    await client.create(diskful, rng.choice(REGIONS))
                except grpc.aio.AioRpcError as err:
                    if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                        raise
                else:
                    raise RuntimeError("a guest no worker has the disk for was placed")

            # One client at a time: the loop is never saturated, so a late wake-up is a step
            # that held it. Then 16 clients, which keep it busy all the time.
            lag2 = await Lag.read(metrics)
            create_ms = await timed(cfg.creates, cfg.phase_seconds, create)
            refusal_ms = await timed(cfg.refusals, cfg.phase_seconds, refuse)
            disk_refusal_ms = await timed(cfg.refusals, cfg.phase_seconds, refuse_disk)
            lag3 = await Lag.read(metrics)
            cpu0 = procs.cpu_seconds(flaps_proc.pid)
            per_second, placed = await throughput(
                cfg.throughput_creates, cfg.phase_seconds, CLIENTS, create
            )
            cpu_ms = 1000 * (procs.cpu_seconds(flaps_proc.pid) - cpu0) / max(1, placed)
            lag4 = await Lag.read(metrics)
            if size == max(cfg.sizes):
                # The largest fleet's placements again, under py-spy (after the timed phases).
                await profiled(cfg, {f"flaps-{size}": flaps_proc.pid}, create)
        finally:
            await client.close()
        progress(
            f"{size} workers: create p50 {_ms(create_ms, 50):.2f} ms, "
            f"{per_second:.0f}/s with {CLIENTS} clients, refusal p50 {_ms(refusal_ms, 50):.2f} ms"
        )
        return SizeResult(
            workers=size,
            rows=size * cfg.machines_each,
            rss_kib=rss,
            load_s=load_s,
            create_ms=create_ms,
            per_second=per_second,
            cpu_ms=cpu_ms,
            refusal_ms=refusal_ms,
            disk_refusal_ms=disk_refusal_ms,
            lag_load=lag1.since(lag0),
            held_load=lag1.since(lag0, held=True),
            lag_place=lag3.since(lag2),
            held_place=lag3.since(lag2, held=True),
            lag_busy=lag4.since(lag3),
            held_busy=lag4.since(lag3, held=True),
            worst_lag=lag4.worst,
        )
    finally:
        if flaps_proc is not None:
            flaps_proc.stop()
        fleet.stop()


def report_sizes(res: Results, sizes: list[SizeResult], machines_each: int) -> None:
    base = sizes[0]
    for s in sizes:
        big = s is sizes[-1] and s.workers >= 10_000
        label = f"{s.workers:,} workers ({s.rows:,} rows)"
        res.add(f"{label}: load the view", s.load_s, "s")
        res.add(f"{label}: flaps RSS", s.rss_kib / 1024, "MiB")
        res.add(
            f"{label}: create p50", _ms(s.create_ms, 50), "ms", note=f"{len(s.create_ms)} creates"
        )
        res.add(f"{label}: create p99", _ms(s.create_ms, 99), "ms", ("<=", 5.0) if big else None)
        res.add(
            f"{label}: placements/s, {CLIENTS} clients",
            s.per_second,
            "/s",
            (">=", round(0.9 * base.per_second)) if big else None,
        )
        res.add(
            f"{label}: flaps CPU per placement, {CLIENTS} clients",
            s.cpu_ms,
            "ms",
            note="heartbeats included",
        )
        res.add(f"{label}: refusal p50", _ms(s.refusal_ms, 50), "ms")
        res.add(f"{label}: refusal p99", _ms(s.refusal_ms, 99), "ms", ("<=", 2.0))
        res.add(f"{label}: refusal by disk p50", _ms(s.disk_refusal_ms, 50), "ms")
        res.add(
            f"{label}: refusal by disk p99",
            _ms(s.disk_refusal_ms, 99),
            "ms",
            ("<=", 2.0),
            note="memory and CPU fit on every worker, the disk on none",
        )
        res.add(
            f"{label}: loop lag while loading, worst under",
            s.lag_load[0] * 1000,
            "ms",
            note=f"{s.lag_load[1]} of {s.lag_load[2]} wake-ups over 1 ms",
        )
        for what, held in (("loading", s.held_load), (f"{CLIENTS} clients placing", s.held_busy)):
            res.add(
                f"{label}: loop held, {what}, wake-ups over 1 ms",
                held[1],
                "",
                ("==", 0) if big else None,
                note=f"of {held[2]}; all under {held[0] * 1000:g} ms",
            )
        res.add(
            f"{label}: loop held, one client placing, wake-ups over 1 ms",
            s.held_place[1],
            "",
            ("==", 0) if big else None,
            note=f"of {s.held_place[2]}; all under {s.held_place[0] * 1000:g} ms",
        )
        res.add(
            f"{label}: loop lag, one client placing, wake-ups over 1 ms",
            s.lag_place[1],
            "",
            note=f"of {s.lag_place[2]}; all under {s.lag_place[0] * 1000:g} ms (held or waiting "
            "for a CPU)",
        )
        res.add(
            f"{label}: loop lag, {CLIENTS} clients placing, worst under",
            s.lag_busy[0] * 1000,
            "ms",
            note=f"{s.lag_busy[1]} of {s.lag_busy[2]} wake-ups over 1 ms",
        )
        res.add(f"{label}: worst loop lag since flaps started", s.worst_lag * 1000, "ms")
    if len(sizes) > 1:
        last = sizes[-1]
        per_row = (last.rss_kib - base.rss_kib) * 1024 / (last.rows - base.rows)
        res.add(
            f"flaps RSS per machine row ({machines_each} demo rows per worker)",
            per_row,
            "B",
            ("<=", 1536.0),
        )


# -- 2. ten real flyd ------------------------------------------------------------------------------


def build_sleeper(root: Path) -> None:
    src = root / "image-src"
    src.mkdir(parents=True)
    (src / "README").write_text("nonomad benchmark image: sleeps\n")
    build_image(
        src,
        root / "images",
        name="sleeper",
        tag="v1",
        entrypoint=["sleep", "100000"],
        owners=PUBLIC,
    )


def real_config() -> pb.MachineConfig:
    return pb.MachineConfig(
        image="sleeper:v1", guest=pb.GuestConfig(cpu_millicores=10, memory_mib=16)
    )


async def real(cfg: Config, res: Results, tmp: Path, logs: Path) -> None:
    prefix = f"nonomad-flapsbench-{secrets.token_hex(4)}"
    build_sleeper(tmp)
    flyds = [
        FlydProcess(
            data_dir=tmp / f"flyd-{i}",
            image_source=tmp / "images",
            cgroup_prefix=prefix,
            log_dir=logs,
            capacity={
                "cpu_millicores": 1_000_000,
                "memory_mib": 1_000_000,
                "disk_mib": 20_000 * DEFAULT_DISK_MIB,  # what each machine's 0 reserves
                "machines": 20_000,
            },
            pycache_prefix=tmp / "pycache",
            worker_id=f"f{i}",
            region="ams",
            extra_args=["--log-level", "warning"],
        )
        for i in range(cfg.real_flyds)
    ]
    flaps_proc = None
    try:
        for f in flyds:
            f.start()
        addresses = [await asyncio.to_thread(f.wait_ready) for f in flyds]
        flaps_proc, address, metrics = await asyncio.to_thread(
            start_flaps, [arg for a in addresses for arg in ("--workers", a)], logs, "flaps-real"
        )
        client = Flaps(address)
        try:
            await _until_alive(client, len(flyds))
            config = real_config()
            lag0 = await Lag.read(metrics)

            async def create(_: int) -> None:
                await client.create(config, "ams")

            await timed(5, cfg.phase_seconds, create)
            create_ms = await timed(cfg.real_creates, cfg.phase_seconds, create)

            async def create_started(_: int) -> None:
                made = await client.create(config, "ams")
                await client.machines.WaitMachine(
                    m.WaitMachineRequest(
                        machine_id=made.machine.id, state=pb.MACHINE_STATE_STARTED
                    ),
                    timeout=RPC_TIMEOUT,
                )

            started_ms = await timed(cfg.real_creates, cfg.phase_seconds, create_started)

            async def place(_: int) -> None:
                await client.create(config, "ams", skip_launch=True)

            pids = {"flaps": flaps_proc.pid, **{f"flyd {i}": f.pid for i, f in enumerate(flyds)}}
            cpu0, host0 = CpuTimes.now(pids), procs.HostCpu.now()
            per_second, placed = await throughput(
                cfg.real_throughput, cfg.phase_seconds, CLIENTS, place
            )
            cpu, host = CpuTimes.now(pids).since(cpu0), procs.HostCpu.now().since(host0)
            lag1 = await Lag.read(metrics)
            n = len(flyds)
            res.add(f"{n} real flyd: create p50", _ms(create_ms, 50), "ms")
            res.add(f"{n} real flyd: create p99", _ms(create_ms, 99), "ms", ("<=", 10.0))
            res.add(f"{n} real flyd: create -> started p50", _ms(started_ms, 50), "ms")
            res.add(f"{n} real flyd: create -> started p99", _ms(started_ms, 99), "ms")
            res.add(
                f"{n} real flyd: placements/s, {CLIENTS} clients (skip_launch)",
                per_second,
                "/s",
                (">=", 1000.0),
                note=f"{placed} placements",
            )
            report_cpu(res, f"{n} real flyd", cpu, placed, host)
            bound, over, total = lag1.since(lag0, held=True)
            res.add(
                f"{n} real flyd: flaps loop held, wake-ups over 1 ms",
                over,
                "",
                note=f"of {total}; all under {bound * 1000:g} ms",
            )
            progress(f"real flyd: {per_second:.0f} placements/s; profiling flaps and one flyd")
            res.details["profile"] = await profiled(
                cfg, {"flaps": flaps_proc.pid, "flyd": flyds[0].pid}, place
            )
        finally:
            await client.close()
    finally:
        if flaps_proc is not None:
            flaps_proc.stop()
        for f in flyds:
            f.terminate(timeout=15)
        # Machines outlive their flyd by design: end them, then check none is left.
        procs.kill_all(procs.processes_under(tmp))
        problems = procs.remove_cgroups(prefix)
        res.errors.extend(f"cgroup cleanup: {p}" for p in problems)
        end = time.monotonic() + 5
        while procs.processes_under(tmp) and time.monotonic() < end:
            procs.reap_adopted(set())
            await asyncio.sleep(0.05)
        left = procs.processes_under(tmp)
        if left:
            res.errors.append(f"machine processes left after the run: {left}")


@dataclass(frozen=True)
class CpuTimes:
    """CPU seconds (user + system) each process has used, and this one (the load client)."""

    seconds: dict[str, float]

    @classmethod
    def now(cls, pids: dict[str, int]) -> CpuTimes:
        me = os.times()
        out = {name: procs.cpu_seconds(pid) for name, pid in pids.items()}
        out["client"] = me.user + me.system
        return cls(out)

    def since(self, earlier: CpuTimes) -> CpuTimes:
        return CpuTimes({k: v - earlier.seconds[k] for k, v in self.seconds.items()})


def report_cpu(
    res: Results, label: str, cpu: CpuTimes, placements: int, host: dict[str, float]
) -> None:
    """CPU per placement of each part: what bounds placements/s on this host's 2 cores."""
    if not placements:
        return
    each = {k: 1000 * v / placements for k, v in cpu.seconds.items()}
    flyd = sum(v for k, v in each.items() if k.startswith("flyd"))
    total = each["flaps"] + flyd + each["client"]
    cores = os.cpu_count() or 1
    res.add(f"{label}: CPU per placement, flaps", each["flaps"], "ms")
    res.add(f"{label}: CPU per placement, flyd (all)", flyd, "ms")
    res.add(f"{label}: CPU per placement, load client", each["client"], "ms")
    res.add(
        f"{label}: CPU per placement, all three",
        total,
        "ms",
        note=f"at most {1000 * cores / total:,.0f}/s on {cores} cores with the host to "
        f"themselves; the host was {host['busy_pct']:.0f}% busy",
    )


async def _until_alive(client: Flaps, workers: int, timeout: float = 30.0) -> None:
    end = time.perf_counter() + timeout
    while True:
        regions = await client.platform.ListRegions(
            platform_pb2.ListRegionsRequest(), timeout=RPC_TIMEOUT
        )
        if sum(r.alive_workers for r in regions.regions) >= workers:
            return
        if time.perf_counter() > end:
            raise RuntimeError(f"not all {workers} flyd are alive in flaps' view")
        await asyncio.sleep(0.05)


def spy(pid: int, svg: Path, seconds: float) -> subprocess.Popen[bytes]:
    """py-spy recording `pid` for `seconds` into the flame graph `svg`, without pausing it."""
    return subprocess.Popen(
        [
            str(PY_SPY),
            "record",
            "--pid",
            str(pid),
            "--output",
            str(svg),
            "--duration",
            str(max(1, int(seconds))),
            "--rate",
            "250",
            "--nonblocking",
            "--format",
            "flamegraph",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


async def profiled(
    cfg: Config, pids: dict[str, int], call: Callable[[int], Awaitable[None]]
) -> dict[str, str]:
    """`call` from CLIENTS clients for `profile_seconds` while py-spy records each of `pids`
    into RESULTS/<name>-profile.svg; name -> the SVG's path, or why there is none."""
    if not PY_SPY.exists():
        return dict.fromkeys(pids, "py-spy is not installed")
    RESULTS.mkdir(parents=True, exist_ok=True)
    svgs = {name: RESULTS / f"{name}-profile.svg" for name in pids}
    spies = {name: spy(pid, svgs[name], cfg.profile_seconds) for name, pid in pids.items()}
    await throughput(10**6, cfg.profile_seconds, CLIENTS, call)
    out = {}
    for name, recorder in spies.items():
        try:
            _, err = await asyncio.to_thread(recorder.communicate, None, 60)
        except subprocess.TimeoutExpired:
            recorder.kill()
            err = b"timed out"
        svg = svgs[name]
        out[name] = str(svg) if svg.exists() else f"py-spy failed: {err.decode()[-300:]}"
    return out


# -- the run ---------------------------------------------------------------------------------------


async def _run(cfg: Config, res: Results) -> None:
    procs.raise_fd_limit()
    procs.become_subreaper()
    tmp = Path(tempfile.mkdtemp(prefix="nonomad-flaps-bench-"))
    logs = tmp / "logs"
    logs.mkdir()
    res.details["config"] = dataclasses.asdict(cfg)
    res.details["loadavg_at_start"] = os.getloadavg()
    try:
        sizes = []
        for size in cfg.sizes:
            sizes.append(await simulated(size, cfg, logs))
        report_sizes(res, sizes, cfg.machines_each)
        res.details["sizes"] = [dataclasses.asdict(s) for s in sizes]
        if cfg.real_flyds:
            await real(cfg, res, tmp, logs)
    except Exception as err:
        traceback.print_exc()
        res.errors.append(f"{type(err).__name__}: {err}")
        saved = RESULTS / "flaps-logs"
        shutil.rmtree(saved, ignore_errors=True)
        shutil.copytree(logs, saved)
        res.details["logs_kept_in"] = str(saved)
    finally:
        res.details["loadavg_at_end"] = os.getloadavg()
        shutil.rmtree(tmp, ignore_errors=True)


def run(
    *,
    quick: bool = False,
    full: bool = False,
    out: Path | None = None,
    strict: bool = False,
    sizes: tuple[int, ...] = (),
    simulated_only: bool = False,
) -> int:
    cfg = QUICK if quick else FULL
    if full:
        cfg = dataclasses.replace(cfg, machines_each=100)
    if sizes:
        cfg = dataclasses.replace(cfg, sizes=sizes)
    if simulated_only:
        cfg = dataclasses.replace(cfg, real_flyds=0)
    res = Results(title=f"flaps benchmarks{' (quick)' if quick else ''}")
    t0 = time.perf_counter()
    asyncio.run(_run(cfg, res))
    res.details["total_seconds"] = time.perf_counter() - t0
    print(res.table())
    if out is not None:
        res.write(out)
    if res.errors:
        return 2
    return 1 if strict and res.missed else 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m bench.flaps_bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="two small fleets, short loops")
    parser.add_argument("--full", action="store_true", help="100 machines per worker")
    parser.add_argument("--out", type=Path, default=RESULTS / "flaps.json")
    parser.add_argument("--strict", action="store_true")
    parser.add_argument(
        "--sizes",
        type=_sizes,
        default=(),
        help="simulated fleet sizes, comma-separated (default: 100,1000,10000)",
    )
    parser.add_argument(
        "--simulated-only", action="store_true", help="skip the real flyd runs and the profile"
    )
    args = parser.parse_args(argv)
    return run(
        quick=args.quick,
        full=args.full,
        out=args.out,
        strict=args.strict,
        sizes=args.sizes,
        simulated_only=args.simulated_only,
    )


def _sizes(text: str) -> tuple[int, ...]:
    import argparse

    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated worker counts") from None
    if not sizes or any(n < 1 for n in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: each size must be at least 1")
    return sizes


if __name__ == "__main__":
    sys.exit(main())
