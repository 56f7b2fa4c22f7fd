"""flyd benchmarks against real flyd processes on 127.0.0.1.

0. where a create's time goes: the same creates in this process (a Worker on the real LMDB
   store and process driver, no gRPC), with timers around the store, the driver and the log
   handler, then under cProfile; the breakdown and the top functions go in the JSON.
1. create+start latency: sequential CreateMachine of a cached image until STARTED.
2. durable state transitions per second: concurrent stop/start cycles on a set of machines,
   counted from the worker's own log (WatchEvents replay between two log heads).
3. restart-to-ready with a fleet of running machines: SIGKILL flyd, start it again on the
   same data dir, time the `recovered` log line and the first GetCapacity, check none was lost.
4. memory: flyd's RSS with the fleet running, its growth per machine, and what each machine's
   `/bin/sh` wrapper costs (PSS from smaps_rollup).

Every load loop is bounded in count and time. Everything the run creates (flyd data dirs,
machines, cgroups under a per-run prefix) is removed at the end, and the run checks that no
machine process is left behind. The bench makes itself a child subreaper so the machine
processes orphaned by the SIGKILL (and by destroys after it) are reaped here.

flyd's bytecode is cached in the run's temp dir (PYTHONPYCACHEPREFIX), as an installed flyd
would have it; without a cache (PYTHONDONTWRITEBYTECODE=1 and a venv installed without
.pyc files) every flyd start compiles its imports again, about 0.5 s here. The first flyd
start of a run shows that cost; `--no-bytecode-cache` measures everything that way.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import cProfile
import dataclasses
import io
import json
import logging
import os
import platform
import pstats
import random
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.duration_pb2 import Duration

from bench import procs
from bench.procs import FlydProcess, progress
from bench.report import Results, percentile
from flyd import fsm
from flyd.drivers.process import ProcessDriver
from flyd.images.build import build_image
from flyd.images.cache import ImageCache
from flyd.images.source import ImageSource
from flyd.settings import CapacitySettings
from flyd.store import LmdbMachineLog
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from flyd.v1 import worker_pb2_grpc
from flyd.worker import Identity, Worker
from runtime import configure_logging
from runtime.clock import SystemClock

S = pb.MachineState
STARTED = S.MACHINE_STATE_STARTED
STOPPED = S.MACHINE_STATE_STOPPED
DESTROYED = S.MACHINE_STATE_DESTROYED
FAILED = S.MACHINE_STATE_FAILED
CREATED = S.MACHINE_STATE_CREATED

RPC_TIMEOUT = 30.0
WAIT_TIMEOUT = 30
IMAGE = "sleeper:v1"
GUEST = pb.GuestConfig(cpu_millicores=10, memory_mib=16)
# Room for every machine the run creates (destroyed ones release theirs).
CAPACITY = {"cpu_millicores": 1_000_000, "memory_mib": 1_000_000, "machines": 5_000}
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]


@dataclass(frozen=True)
class Config:
    latency_n: int = 200
    latency_warmup: int = 5
    churn_machines: int = 20
    churn_seconds: float = 10.0
    churn_transitions: int = 2_000
    fleet: int = 1_000
    create_concurrency: int = 8
    destroy_concurrency: int = 8
    wrapper_sample: int = 20


FULL = Config()
QUICK = Config(
    latency_n=30,
    latency_warmup=2,
    churn_machines=10,
    churn_seconds=3.0,
    churn_transitions=400,
    fleet=100,
    wrapper_sample=10,
)


# -- client ----------------------------------------------------------------------------------


class BenchError(Exception):
    pass


def _wait_timeout() -> Duration:
    return Duration(seconds=WAIT_TIMEOUT)


class Client:
    """A WorkerService stub with the few compound calls the benchmarks need."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self.stub = worker_pb2_grpc.WorkerServiceStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def wait(self, machine_id: str, state: pb.MachineState.ValueType) -> pb.Machine:
        resp = await self.stub.WaitMachine(
            w.WaitMachineRequest(machine_id=machine_id, state=state, timeout=_wait_timeout()),
            timeout=WAIT_TIMEOUT + 5,
        )
        return resp.machine

    async def settle_started(self, machine: pb.Machine) -> pb.Machine:
        """The machine once STARTED (waiting if it is not yet); raises if it failed."""
        if machine.state == STARTED:
            return machine
        if machine.state == FAILED:
            raise BenchError(f"machine {machine.id} FAILED: {list(machine.log_tail)[-5:]}")
        return await self.wait(machine.id, STARTED)

    async def create(self, app: str, config: pb.MachineConfig) -> pb.Machine:
        resp = await self.stub.CreateMachine(
            w.CreateMachineRequest(app=app, config=config), timeout=RPC_TIMEOUT
        )
        return await self.settle_started(resp.machine)

    async def destroy(self, machine_id: str) -> None:
        try:
            await self.stub.DestroyMachine(
                w.DestroyMachineRequest(machine_id=machine_id, force=True), timeout=RPC_TIMEOUT
            )
            await self.wait(machine_id, DESTROYED)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:  # destroyed rows may be dropped
                raise

    async def list_machines(self, app: str) -> list[pb.Machine]:
        resp = await self.stub.ListMachines(w.ListMachinesRequest(app=app), timeout=RPC_TIMEOUT)
        return list(resp.machines)

    async def log_head(self) -> int:
        """The worker's log head: the seq of the snapshot WatchEvents(from_seq=0) sends first."""
        call = self.stub.WatchEvents(w.WatchEventsRequest(from_seq=0), timeout=RPC_TIMEOUT)
        try:
            async for item in call:
                if item.HasField("snapshot"):
                    return int(item.snapshot.seq)
                if item.HasField("heartbeat"):
                    return int(item.heartbeat.seq)
        finally:
            call.cancel()
        raise BenchError("WatchEvents ended without a snapshot")

    async def replay(self, after: int, upto: int) -> list[w.MachineChange]:
        """The committed changes with after < seq <= upto, read back from the worker's log."""
        changes: list[w.MachineChange] = []
        if upto <= after:
            return changes
        call = self.stub.WatchEvents(w.WatchEventsRequest(from_seq=after), timeout=RPC_TIMEOUT)
        try:
            async for item in call:
                if item.HasField("snapshot"):
                    raise BenchError("the log was compacted during the measurement")
                if item.HasField("change"):
                    changes.append(item.change)
                    if item.change.event.seq >= upto:
                        break
        finally:
            call.cancel()
        return changes


async def _bounded(
    count: int, concurrency: int, job: Callable[[int], Awaitable[None]], label: str
) -> None:
    """Run job(0..count-1) with at most `concurrency` in flight, logging progress."""
    items = iter(range(count))
    done = 0
    step = max(1, count // 4)

    async def worker() -> None:
        nonlocal done
        for i in items:
            await job(i)
            done += 1
            if done % step == 0 and done < count:
                progress(f"{label}: {done}/{count}")

    await asyncio.gather(*(worker() for _ in range(min(concurrency, count))))


async def create_many(
    client: Client, app: str, config: pb.MachineConfig, count: int, concurrency: int
) -> list[str]:
    ids: list[str] = []

    async def one(_: int) -> None:
        ids.append((await client.create(app, config)).id)

    await _bounded(count, concurrency, one, f"create {app}")
    return ids


async def destroy_many(client: Client, ids: list[str], concurrency: int) -> float:
    """Force-destroy every machine and wait for DESTROYED; returns seconds taken."""
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        await client.destroy(ids[i])

    await _bounded(len(ids), concurrency, one, "destroy")
    return time.perf_counter() - t0


def machine_config() -> pb.MachineConfig:
    return pb.MachineConfig(image=IMAGE, guest=GUEST)


def build_sleeper(root: Path) -> tuple[Path, str]:
    """A one-file image whose entrypoint is the host's `sleep` (flyd does not chroot)."""
    src = root / "image-src"
    src.mkdir(parents=True)
    (src / "README").write_text("nonomad benchmark image: sleeps\n")
    source = root / "images"
    digest = build_image(src, source, name="sleeper", tag="v1", entrypoint=["sleep", "100000"])
    return source, digest


def _event_ms(
    machine: pb.Machine, to_state: pb.MachineState.ValueType, from_type: str = "create"
) -> float | None:
    """Milliseconds between the machine's `from_type` event and its first `to_state` event."""
    start = next((e for e in machine.events if e.type == from_type), None)
    end = next((e for e in machine.events if e.to_state == to_state), None)
    if start is None or end is None:
        return None
    return (end.time.ToNanoseconds() - start.time.ToNanoseconds()) / 1e6


# -- 0. where a create's time goes ------------------------------------------------------------


class _Timers:
    """Wall time spent inside chosen methods of chosen objects, replaced on the instances."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter[str] = collections.Counter()

    def wrap(self, label: str, obj: object, name: str) -> None:
        inner = getattr(obj, name)
        seconds, calls = self.seconds, self.calls
        if asyncio.iscoroutinefunction(inner):

            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return await inner(*args, **kwargs)
                finally:
                    seconds[label] += time.perf_counter() - t0
                    calls[label] += 1

            setattr(obj, name, timed_async)
            return

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[label] += time.perf_counter() - t0
                calls[label] += 1

        setattr(obj, name, timed)


def _cprofile_top(prof: cProfile.Profile, n: int, per: int) -> list[dict[str, Any]]:
    """The `n` functions with the most own time, in ms per create."""
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (filename, line, func), (_cc, ncalls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = filename.replace(str(procs.REPO_ROOT) + "/", "")
        if "site-packages/" in where:
            where = where.split("site-packages/", 1)[1]
        rows.append(
            {
                "function": f"{where}:{line}({func})",
                "calls_per_create": round(ncalls / per, 2),
                "own_ms_per_create": round(tottime * 1000 / per, 4),
                "cumulative_ms_per_create": round(cumtime * 1000 / per, 4),
            }
        )
    rows.sort(key=lambda r: -r["own_ms_per_create"])
    return rows[:n]


async def bench_create_profile(tmp: Path, prefix: str, cfg: Config, res: Results) -> None:
    """Creates in this process on flyd's real store and driver: a breakdown without gRPC."""
    root = tmp / "profile"
    log_path = root / "flyd.log"
    root.mkdir()
    worker: Worker | None = None

    def on_exit(machine_id: str, handle: Any, status: Any) -> None:
        if worker is not None:
            worker.on_exit(machine_id, handle, status)

    driver = ProcessDriver(root / "machines", on_exit=on_exit, cgroup_prefix=prefix)
    store = LmdbMachineLog(root / "log")
    worker = Worker(
        identity=Identity("bench", "local", "127.0.0.1:1", {}, "bench"),
        store=store,
        driver=driver,
        images=ImageCache(root / "cache", ImageSource(tmp / "images"), max_bytes=1 << 30),
        capacity=CapacitySettings(**CAPACITY),
        ports=range(20000, 20100),
        machine_host="127.0.0.1",
        clock=SystemClock(),
        policy=fsm.Policy(),
    )
    config = machine_config()
    timers = _Timers()
    n = cfg.latency_n
    wall: list[float] = []
    ids: list[str] = []

    async def create() -> None:
        assert worker is not None
        machine = await worker.create(
            machine_id="", name="", app="bench-profile", config=config, skip_launch=False
        )
        if machine.state != STARTED:
            raise BenchError(f"in-process create ended {S.Name(machine.state)}")
        ids.append(machine.id)

    progress(f"create profile: {n} creates in-process, then {n // 2} under cProfile")
    saved_level = logging.getLogger().level
    try:
        with log_path.open("w") as log_file, contextlib.redirect_stderr(log_file):
            configure_logging("flyd", "info")  # flyd's own log lines, to a file as flyd's go
            worker.recover()
            for _ in range(cfg.latency_warmup):
                await create()
            timers.wrap("lmdb commit (fsynced)", store, "commit")
            timers.wrap("driver.start (run dir, cgroups, fork+exec)", driver, "start")
            timers.wrap("driver.release", driver, "release")
            for handler in logging.getLogger().handlers:
                timers.wrap("log lines", handler, "handle")
            cpu0 = time.process_time()
            for _ in range(n):
                t0 = time.perf_counter()
                await create()
                wall.append((time.perf_counter() - t0) * 1000)
            cpu_ms = (time.process_time() - cpu0) * 1000 / max(1, n)
            spent, calls = dict(timers.seconds), dict(timers.calls)
            prof = cProfile.Profile()
            profiled = max(1, n // 2)
            prof.enable()
            for _ in range(profiled):
                await create()
            prof.disable()
            for mid in ids:
                await worker.destroy(mid, force=True)
            for mid in ids:
                with contextlib.suppress(Exception):  # destroyed rows may be dropped
                    await worker.wait(mid, DESTROYED, WAIT_TIMEOUT)
    finally:
        logging.getLogger().setLevel(saved_level)
        await worker.close()
        await driver.close()
        store.close()

    total_ms = sum(wall) / max(1, n)
    breakdown = {
        label: {"ms_per_create": spent[label] * 1000 / n, "calls_per_create": calls[label] / n}
        for label in sorted(spent)
    }
    accounted = sum(v["ms_per_create"] for v in breakdown.values())
    breakdown["other (fsm, protobuf, asyncio, validation)"] = {
        "ms_per_create": total_ms - accounted,
        "calls_per_create": 1.0,
    }
    res.add(f"in-process create→STARTED p50 (n={n}, no gRPC)", percentile(wall, 50), "ms")
    res.add("  in-process CPU per create", cpu_ms, "ms")
    for label, part in breakdown.items():
        res.add(
            f"    {label}",
            part["ms_per_create"],
            "ms",
            note=f"{part['calls_per_create']:g} calls per create",
        )
    res.details["create_profile"] = {
        "n": n,
        "wall_ms": {"p50": percentile(wall, 50), "p99": percentile(wall, 99), "mean": total_ms},
        "cpu_ms_per_create": cpu_ms,
        "breakdown_ms_per_create": breakdown,
        "cprofile_creates": profiled,
        "cprofile_top_by_own_time": _cprofile_top(prof, 30, profiled),
    }


# -- 1. create+start latency -----------------------------------------------------------------


async def bench_rpc_floor(client: Client, machine_id: str, count: int) -> list[float]:
    """Round trips of GetMachine (an O(1) read): what any RPC costs, in ms."""
    samples = []
    for _ in range(count):
        t0 = time.perf_counter()
        await client.stub.GetMachine(w.GetMachineRequest(machine_id=machine_id), timeout=5)
        samples.append((time.perf_counter() - t0) * 1000)
    return samples


async def bench_create_latency(
    flyd: FlydProcess, client: Client, cfg: Config, res: Results
) -> None:
    config = machine_config()
    progress(f"create latency: warming up with {cfg.latency_warmup} machines")
    warm = [(await client.create("bench-warm", config)).id for _ in range(cfg.latency_warmup)]
    floor = await bench_rpc_floor(client, warm[0], cfg.latency_n)
    await destroy_many(client, warm, cfg.destroy_concurrency)

    progress(f"create latency: {cfg.latency_n} sequential CreateMachine calls")
    latencies: list[float] = []
    server: list[float] = []
    returned_started = 0
    ids: list[str] = []
    deadline = time.perf_counter() + 120
    cpu0 = procs.cpu_seconds(flyd.pid)
    for _ in range(cfg.latency_n):
        if time.perf_counter() > deadline:
            res.errors.append("create latency loop hit its 120 s bound")
            break
        t0 = time.perf_counter()
        resp = await client.stub.CreateMachine(
            w.CreateMachineRequest(app="bench-latency", config=config), timeout=RPC_TIMEOUT
        )
        returned_started += resp.machine.state == STARTED
        machine = await client.settle_started(resp.machine)
        latencies.append((time.perf_counter() - t0) * 1000)
        ids.append(machine.id)
        ms = _event_ms(machine, STARTED)
        if ms is not None:
            server.append(ms)

    cpu_ms = (procs.cpu_seconds(flyd.pid) - cpu0) * 1000 / max(1, len(ids))
    progress(f"create latency: destroying {len(ids)} machines")
    destroy_s = await destroy_many(client, ids, cfg.destroy_concurrency)

    n = len(latencies)
    res.add(f"create→STARTED p50 (n={n})", percentile(latencies, 50), "ms", ("<=", 10))
    res.add(f"create→STARTED p99 (n={n})", percentile(latencies, 99), "ms", ("<=", 30))
    res.add("create→STARTED max", max(latencies, default=float("nan")), "ms")
    res.add(
        "  of which flyd create-commit→STARTED p50",
        percentile(server, 50),
        "ms",
        note="server-side, from the machine's own event timestamps",
    )
    res.add("  flyd CPU per create", cpu_ms, "ms")
    res.add(
        "  gRPC round trip floor (GetMachine) p50",
        percentile(floor, 50),
        "ms",
        note="an O(1) read: what any call costs",
    )
    quarter = max(1, n // 4)
    res.details["create_latency"] = {
        "n": n,
        "returned_started": returned_started,
        "client_ms": {
            "p50": percentile(latencies, 50),
            "p90": percentile(latencies, 90),
            "p99": percentile(latencies, 99),
            "mean": statistics.fmean(latencies) if latencies else None,
            "max": max(latencies, default=None),
            "min": min(latencies, default=None),
            "p50_first_quarter": percentile(latencies[:quarter], 50),
            "p50_last_quarter": percentile(latencies[-quarter:], 50),
        },
        "flyd_cpu_ms_per_create": cpu_ms,
        "get_machine_ms": {"p50": percentile(floor, 50), "p99": percentile(floor, 99)},
        "samples_ms": [round(x, 3) for x in latencies],
        "server_commit_to_started_ms": {
            "p50": percentile(server, 50),
            "p99": percentile(server, 99),
        },
        "destroy_seconds": destroy_s,
    }


# -- 2. durable state transitions per second -------------------------------------------------


async def bench_transitions(flyd: FlydProcess, client: Client, cfg: Config, res: Results) -> None:
    config = machine_config()
    progress(f"transitions: creating {cfg.churn_machines} machines")
    ids = [(await client.create("bench-churn", config)).id for _ in range(cfg.churn_machines)]
    head0 = await client.log_head()
    cpu0 = procs.cpu_seconds(flyd.pid)
    counted = 0
    cycles = 0
    t0 = time.perf_counter()
    deadline = t0 + cfg.churn_seconds
    stop_timeout = Duration(seconds=5)

    def budget_left() -> bool:
        return time.perf_counter() < deadline and counted < cfg.churn_transitions

    async def churn(machine_id: str) -> None:
        nonlocal counted, cycles
        while budget_left():
            resp = await client.stub.StopMachine(
                w.StopMachineRequest(machine_id=machine_id, timeout=stop_timeout),
                timeout=RPC_TIMEOUT,
            )
            if resp.machine.state != STOPPED:
                await client.wait(machine_id, STOPPED)
            counted += 2  # STOPPING, STOPPED
            if not budget_left():
                break
            start = await client.stub.StartMachine(
                w.StartMachineRequest(machine_id=machine_id), timeout=RPC_TIMEOUT
            )
            await client.settle_started(start.machine)
            counted += 2  # STARTING, STARTED
            cycles += 1

    progress(
        f"transitions: stop/start cycles on {len(ids)} machines "
        f"(at most {cfg.churn_seconds:g} s or {cfg.churn_transitions} transitions)"
    )
    await asyncio.wait_for(
        asyncio.gather(*(churn(mid) for mid in ids)), cfg.churn_seconds + RPC_TIMEOUT * 2
    )
    elapsed = time.perf_counter() - t0
    cpu_s = procs.cpu_seconds(flyd.pid) - cpu0
    head1 = await client.log_head()
    changes = await client.replay(head0, head1)
    kinds = collections.Counter(
        f"{S.Name(c.event.from_state)}->{S.Name(c.event.to_state)}".replace("MACHINE_STATE_", "")
        for c in changes
    )
    state_changes = sum(1 for c in changes if c.event.from_state != c.event.to_state)
    records = head1 - head0

    progress(f"transitions: {state_changes} state changes in {elapsed:.2f} s; destroying")
    await destroy_many(client, ids, cfg.destroy_concurrency)

    res.add(
        "durable state transitions/s",
        state_changes / elapsed,
        "/s",
        note=f"{state_changes} committed state changes from the log in {elapsed:.2f} s",
    )
    res.add("  log records committed/s", records / elapsed, "/s")
    res.add("  flyd CPU per state transition", cpu_s * 1000 / max(1, state_changes), "ms")
    res.details["transitions"] = {
        "machines": len(ids),
        "seconds": elapsed,
        "log_head_before": head0,
        "log_head_after": head1,
        "log_records": records,
        "state_changes_from_log": state_changes,
        "state_changes_counted_by_client": counted,
        "start_stop_cycles": cycles,
        "flyd_cpu_seconds": cpu_s,
        "by_kind": dict(kinds),
    }


# -- 3 and 4. a fleet: memory, then restart-to-ready -------------------------------------------


@dataclass(frozen=True)
class Handle:
    pid: int
    start_time: int


def read_handles(data_dir: Path, ids: list[str]) -> dict[str, Handle]:
    """Each machine's wrapper process, from the handle.json flyd's driver keeps in its run dir."""
    out: dict[str, Handle] = {}
    for mid in ids:
        with contextlib.suppress(OSError, ValueError, KeyError):
            data = json.loads((data_dir / "machines" / mid / "handle.json").read_bytes())
            out[mid] = Handle(int(data["pid"]), int(data["start_time"]))
    return out


def main_process(wrapper_pid: int) -> int | None:
    """The machine's main process: the wrapper's (only) child."""
    kids = procs.child_pids(wrapper_pid)
    return kids[0] if kids else None


def machine_alive(handle: Handle | None) -> bool:
    if handle is None or not procs.alive(handle.pid, handle.start_time):
        return False
    child = main_process(handle.pid)
    return child is not None and procs.alive(child)


def sample_wrappers(handles: dict[str, Handle], k: int) -> dict[str, Any]:
    """Mean smaps_rollup figures (KiB) of a sample of wrappers and of their machines."""
    sample = random.Random(0).sample(sorted(handles), min(k, len(handles)))
    wrap_pss, wrap_rss, wrap_private, main_pss, comms = [], [], [], [], set()
    for mid in sample:
        pid = handles[mid].pid
        sm = procs.smaps_rollup_kib(pid)
        if not sm:
            continue
        with contextlib.suppress(OSError):
            comms.add(Path(f"/proc/{pid}/comm").read_text().strip())
        wrap_pss.append(sm.get("Pss", 0))
        wrap_rss.append(sm.get("Rss", 0))
        wrap_private.append(sm.get("Private_Clean", 0) + sm.get("Private_Dirty", 0))
        child = main_process(pid)
        if child is not None:
            main_pss.append(procs.smaps_rollup_kib(child).get("Pss", 0))
    mean = statistics.fmean
    return {
        "sampled": len(wrap_pss),
        "wrapper_pss_kib": mean(wrap_pss) if wrap_pss else float("nan"),
        "wrapper_rss_kib": mean(wrap_rss) if wrap_rss else float("nan"),
        "wrapper_private_kib": mean(wrap_private) if wrap_private else float("nan"),
        "main_process_pss_kib": mean(main_pss) if main_pss else float("nan"),
        "wrapper_comm": ",".join(sorted(comms)),
    }


async def bench_fleet(flyd: FlydProcess, cfg: Config, res: Results) -> None:
    n = cfg.fleet
    config = machine_config()
    client = Client(flyd.address)
    ids: list[str] = []
    try:
        warm = await client.create("bench-warm", config)
        await destroy_many(client, [warm.id], 1)
        await asyncio.sleep(0.5)
        rss0 = flyd.rss_kib()
        avail0 = procs.mem_available_kib()

        progress(f"fleet: creating {n} machines ({cfg.create_concurrency} at a time)")
        t0 = time.perf_counter()
        ids = await create_many(client, "bench-fleet", config, n, cfg.create_concurrency)
        create_s = time.perf_counter() - t0
        listed = await client.list_machines("bench-fleet")
        started = sum(m.state == STARTED for m in listed)
        if started != n:
            raise BenchError(f"only {started} of {n} machines are STARTED after creation")
        await asyncio.sleep(0.5)
        rss1 = flyd.rss_kib()
        avail1 = procs.mem_available_kib()
        handles = read_handles(flyd.data_dir, ids)
        wrappers = sample_wrappers(handles, cfg.wrapper_sample)
        progress(
            f"fleet: {n} started in {create_s:.1f} s; flyd RSS {rss0 / 1024:.1f} -> "
            f"{rss1 / 1024:.1f} MiB"
        )

        res.add(f"flyd RSS with {n} machines", rss1 * 1024 / 1e6, "MB", ("<=", 200))
        res.add("  flyd RSS with 0 machines", rss0 * 1024 / 1e6, "MB")
        res.add("  flyd RSS growth per machine", (rss1 - rss0) / n, "KiB")
        res.add(
            "  wrapper /bin/sh PSS per machine",
            wrappers["wrapper_pss_kib"],
            "KiB",
            note=f"mean of {wrappers['sampled']} wrappers (smaps_rollup)",
        )
        res.add("  wrapper /bin/sh RSS per machine", wrappers["wrapper_rss_kib"], "KiB")
        res.add(
            "  host MemAvailable drop per machine",
            (avail0 - avail1) / n,
            "KiB",
            note="system-wide: machine + wrapper + cgroups + kernel; noisy",
        )

        # -- restart-to-ready --------------------------------------------------------------
        await client.close()
        progress(f"restart: SIGKILL flyd (pid {flyd.pid}) with {n} machines running")
        flyd.kill()
        alive_while_down = sum(machine_alive(handles.get(mid)) for mid in ids)
        flyd.start()
        flyd.wait_ready()
        to_ready = flyd.ready_mono - flyd.spawned_mono
        client = Client(flyd.address)
        first_cap: float | None = None
        first_cap_started = -1
        all_started: float | None = None
        give_up = time.perf_counter() + 60
        while time.perf_counter() < give_up:
            try:
                cap = await client.stub.GetCapacity(w.GetCapacityRequest(), timeout=5)
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.002)
                continue
            now = time.perf_counter() - flyd.spawned_mono
            count = cap.capacity.machines_by_state.get("started", 0)
            if first_cap is None:
                first_cap, first_cap_started = now, count
            if count >= n:
                all_started = now
                break
            await asyncio.sleep(0.002)
        recovered_wall = flyd.log_event_time("recovered")
        ready_wall = flyd.log_event_time("ready")
        to_recovered = None if recovered_wall is None else recovered_wall - flyd.spawned_wall

        listed_after = {m.id: m for m in await client.list_machines("bench-fleet")}
        handles_after = read_handles(flyd.data_dir, ids)
        lost = [
            mid
            for mid in ids
            if (m := listed_after.get(mid)) is None
            or m.state != STARTED
            or handles_after.get(mid) != handles.get(mid)
            or not machine_alive(handles_after.get(mid))
        ]
        await asyncio.sleep(0.5)
        rss_restarted = flyd.rss_kib()
        progress(
            f"restart: READY after {to_ready:.3f} s, recovered after "
            f"{to_recovered if to_recovered is None else round(to_recovered, 3)} s, "
            f"{len(lost)} lost"
        )

        res.add(f"restart spawn→recovered ({n} machines)", to_recovered, "s", ("<=", 1.0))
        res.add(f"restart spawn→first GetCapacity ({n} machines)", first_cap, "s", ("<=", 1.0))
        res.add("  spawn→READY line", to_ready, "s")
        if ready_wall is not None and recovered_wall is not None:
            res.add("  ready→recovered (recovery itself)", recovered_wall - ready_wall, "s")
        res.add(f"  spawn→GetCapacity shows {n} started", all_started, "s")
        res.add(f"machines lost across restart (of {n})", len(lost), "", ("==", 0))
        res.add(f"flyd RSS after restart with {n} machines", rss_restarted * 1024 / 1e6, "MB")

        res.details["fleet"] = {
            "machines": n,
            "create_seconds": create_s,
            "creates_per_second": n / create_s,
            "flyd_rss_kib": {"empty": rss0, "fleet": rss1, "after_restart": rss_restarted},
            "mem_available_kib": {"before": avail0, "after": avail1},
            "wrappers": wrappers,
        }
        res.details["restart"] = {
            "alive_while_flyd_down": alive_while_down,
            "spawn_to_ready_line_s": to_ready,
            "spawn_to_ready_log_s": None if ready_wall is None else ready_wall - flyd.spawned_wall,
            "spawn_to_recovered_s": to_recovered,
            "spawn_to_first_get_capacity_s": first_cap,
            "first_get_capacity_started": first_cap_started,
            "spawn_to_all_started_s": all_started,
            "lost": lost[:20],
            "lost_count": len(lost),
        }

        progress(f"fleet: destroying {len(ids)} machines")
        res.details["fleet"]["destroy_seconds"] = await destroy_many(
            client, ids, cfg.destroy_concurrency
        )
        ids = []
    finally:
        if ids:  # failed midway: try to destroy through flyd before the hard cleanup
            with contextlib.suppress(Exception):
                await asyncio.wait_for(destroy_many(client, ids, cfg.destroy_concurrency), 60)
        await client.close()


# -- the run ---------------------------------------------------------------------------------


async def _reap_loop(flyds: list[FlydProcess], reaped: list[int]) -> None:
    while True:
        keep = {f.proc.pid for f in flyds if f.proc is not None and f.proc.returncode is None}
        reaped[0] += procs.reap_adopted(keep)
        await asyncio.sleep(0.2)


def _cleanup(
    flyds: list[FlydProcess], tmp: Path, prefix: str, res: Results, reaped: list[int]
) -> None:
    for f in flyds:
        code = f.terminate(timeout=15)
        if code not in (0, None, -9):
            res.errors.append(f"flyd exited with {code}; log {f.log_path}")
    strays = procs.processes_under(tmp)
    left_cgroups = procs.remaining_cgroups(prefix)
    res.add("stray machine processes after flyd stopped", len(strays), "", ("==", 0))
    res.add("machine cgroups left after destroy", len(left_cgroups), "", ("==", 0))
    if strays:
        progress(f"cleanup: killing {len(strays)} stray processes")
        procs.kill_all(strays)
    problems = procs.remove_cgroups(prefix)
    res.errors.extend(f"cgroup cleanup: {p}" for p in problems)
    end = time.monotonic() + 3
    while time.monotonic() < end:
        reaped[0] += procs.reap_adopted(set())
        if not procs.processes_under(tmp) and not procs.child_pids(os.getpid()):
            break
        time.sleep(0.05)
    still = procs.processes_under(tmp)
    if still:
        res.errors.append(f"processes still running after cleanup: {still}")
    res.details["cleanup"] = {
        "stray_pids": strays,
        "cgroups_left": [str(p) for p in left_cgroups],
        "orphans_reaped_by_bench": reaped[0],
        "zombie_children_left": [
            p for p in procs.child_pids(os.getpid()) if (s := procs.proc_stat(p)) and s.state == "Z"
        ],
    }
    # flyd's logs of a failed run are kept for a post-mortem; a good run clears old ones.
    saved = Path(__file__).resolve().parent / "results" / "flyd-logs"
    shutil.rmtree(saved, ignore_errors=True)
    if res.errors:
        saved.mkdir(parents=True, exist_ok=True)
        for f in flyds:
            with contextlib.suppress(OSError):
                shutil.copy(f.log_path, saved / f.log_path.name)
        res.details["cleanup"]["logs_kept_in"] = str(saved)
    shutil.rmtree(tmp, ignore_errors=True)


async def _phase(res: Results, name: str, work: Awaitable[None]) -> None:
    """Run one benchmark, noting how busy the host was meanwhile (others share the CPUs)."""
    before = procs.HostCpu.now()
    try:
        await work
    finally:
        host = procs.HostCpu.now().since(before)
        res.details.setdefault("host_cpu", {})[name] = host
        progress(
            f"{name}: host CPU busy {host['busy_pct']:.0f}%, iowait {host['iowait_pct']:.0f}%, "
            f"steal {host['steal_pct']:.0f}% (of all {os.cpu_count()} CPUs)"
        )


def _source_state() -> dict[str, Any]:
    """Which code was measured: HEAD and whether flyd's or the runtime's files differ from it."""
    out: dict[str, Any] = {}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=procs.REPO_ROOT, capture_output=True, text=True
        )
        out["head"] = head.stdout.strip() or None
        diff = subprocess.run(
            ["git", "diff", "--quiet", "HEAD", "--", "flyd", "nonomad"],
            cwd=procs.REPO_ROOT,
            capture_output=True,
        )
        out["flyd_or_runtime_modified"] = diff.returncode == 1
    return out


async def _run(cfg: Config, res: Results, bytecode_cache: bool) -> None:
    soft, hard = procs.raise_fd_limit()
    subreaper = procs.become_subreaper()
    tmp = Path(tempfile.mkdtemp(prefix="nonomad-bench-"))
    prefix = f"nonomad-bench-{secrets.token_hex(4)}"
    res.details["environment"] = {
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "fd_limit": [soft, hard],
        "subreaper": subreaper,
        "cgroup_prefix": prefix,
        "bytecode_cache": bytecode_cache,
        "PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE"),
    }
    res.details["config"] = dataclasses.asdict(cfg)
    res.details["source"] = _source_state()
    load = os.getloadavg()
    res.details["loadavg_at_start"] = load
    progress(f"workdir {tmp}, cgroup prefix {prefix}, fd limit {soft}")
    if load[0] > 0.5:
        progress(f"warning: load average {load[0]:.2f} at start: other work may skew timings")
    flyds: list[FlydProcess] = []
    reaped = [0]
    reaper = asyncio.create_task(_reap_loop(flyds, reaped))

    def new_flyd(name: str) -> FlydProcess:
        f = FlydProcess(
            data_dir=tmp / name,
            image_source=tmp / "images",
            cgroup_prefix=prefix,
            log_dir=tmp / "logs",
            capacity=CAPACITY,
            pycache_prefix=tmp / "pycache" if bytecode_cache else None,
        )
        flyds.append(f)
        return f

    try:
        build_sleeper(tmp)

        await _phase(res, "create_profile", bench_create_profile(tmp, prefix, cfg, res))

        # A fresh flyd for latency and churn.
        a = new_flyd("flyd-a")
        a.start()
        a.wait_ready()
        res.add(
            "flyd spawn→READY, first start (empty)"
            + (", compiling bytecode" if bytecode_cache else ", no bytecode cache"),
            a.ready_mono - a.spawned_mono,
            "s",
        )
        client = Client(a.address)
        try:
            await _phase(res, "create_latency", bench_create_latency(a, client, cfg, res))
            await _phase(res, "transitions", bench_transitions(a, client, cfg, res))
        finally:
            await client.close()
        a.terminate()

        # Another fresh flyd for the fleet, so its memory is not that of the first runs.
        b = new_flyd("flyd-b")
        b.start()
        b.wait_ready()
        res.add(
            "flyd spawn→READY (empty)" + (", bytecode cached" if bytecode_cache else ""),
            b.ready_mono - b.spawned_mono,
            "s",
        )
        await _phase(res, "fleet", bench_fleet(b, cfg, res))
        b.terminate()
    except Exception as e:
        traceback.print_exc()
        res.errors.append(f"{type(e).__name__}: {e}")
        for f in flyds:
            if f.proc is not None:
                print(f"--- {f.log_path.name} (tail)\n{f.log_tail()}", file=sys.stderr)
    finally:
        reaper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reaper
        _cleanup(flyds, tmp, prefix, res, reaped)
        res.details["loadavg_at_end"] = os.getloadavg()


def run(*, quick: bool, out: Path, strict: bool = False, bytecode_cache: bool = True) -> int:
    cfg = QUICK if quick else FULL
    res = Results(title=f"flyd benchmarks{' (quick)' if quick else ''}")
    t0 = time.perf_counter()
    asyncio.run(_run(cfg, res, bytecode_cache))
    res.details["total_seconds"] = time.perf_counter() - t0
    res.details["quick"] = quick
    res.write(out)
    print(res.table())
    print(f"\n(total {res.details['total_seconds']:.1f} s; JSON in {out})")
    if res.errors:
        return 2
    return 1 if strict and res.missed else 0
