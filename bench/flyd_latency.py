"""flyd benchmarks 1 and 2, over gRPC against a real flyd process.

1. create+start latency: sequential CreateMachine of a cached image until STARTED (and the
   round trip of a GetMachine, the floor under any RPC).
2. durable state transitions per second: concurrent stop/start cycles on a set of machines,
   counted from the worker's own log (WatchEvents replay between two log heads).
"""

from __future__ import annotations

import asyncio
import collections
import os
import shutil
import statistics
import time
from pathlib import Path

from google.protobuf.duration_pb2 import Duration

from bench import procs
from bench.flyd_client import (
    RPC_TIMEOUT,
    STARTED,
    STOPPED,
    TARGETS,
    Client,
    Config,
    S,
    destroy_many,
    machine_config,
)
from bench.procs import FlydProcess, progress
from bench.report import Results, percentile
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w


def _event_ms(
    machine: pb.Machine, to_state: pb.MachineState.ValueType, from_type: str = "create"
) -> float | None:
    """Milliseconds between the machine's `from_type` event and its first `to_state` event."""
    start = next((e for e in machine.events if e.type == from_type), None)
    end = next((e for e in machine.events if e.to_state == to_state), None)
    if start is None or end is None:
        return None
    return (end.time.ToNanoseconds() - start.time.ToNanoseconds()) / 1e6


async def bench_rpc_floor(client: Client, machine_id: str, count: int) -> list[float]:
    """Round trips of GetMachine (an O(1) read): what any RPC costs, in ms."""
    samples = []
    for _ in range(count):
        t0 = time.perf_counter()
        await client.stub.GetMachine(w.GetMachineRequest(machine_id=machine_id), timeout=5)
        samples.append((time.perf_counter() - t0) * 1000)
    return samples


def _file_create_us(data_dir: Path, count: int = 200) -> float:
    """CPU microseconds to make (and close) an empty file in a new directory in flyd's data
    dir: how costly the disk under a start is right now, which on a shared VM varies."""
    probe = data_dir / f".bench-probe-{os.getpid()}"
    probe.mkdir()
    try:
        cpu0 = time.thread_time()  # this thread's: gRPC's threads share the process
        for i in range(count):
            os.close(os.open(probe / str(i), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        return (time.thread_time() - cpu0) * 1e6 / count
    finally:
        shutil.rmtree(probe, ignore_errors=True)


async def bench_create_latency(
    flyd: FlydProcess, client: Client, cfg: Config, res: Results
) -> None:
    config = machine_config()
    progress(f"create latency: warming up with {cfg.latency_warmup} machines")
    warm = [(await client.create("bench-warm", config)).id for _ in range(cfg.latency_warmup)]
    floor = await bench_rpc_floor(client, warm[0], cfg.latency_n)
    await destroy_many(client, warm, cfg.destroy_concurrency)
    await asyncio.to_thread(os.sync)  # the warm-up's deleted files, settled before timing
    file_us = _file_create_us(flyd.data_dir)

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
    targets = TARGETS[cfg.driver]
    res.add(
        f"create→STARTED p50 (n={n})",
        percentile(latencies, 50),
        "ms",
        ("<=", targets.create_p50_ms),
    )
    res.add(
        f"create→STARTED p99 (n={n})",
        percentile(latencies, 99),
        "ms",
        ("<=", targets.create_p99_ms),
    )
    res.add("create→STARTED max", max(latencies, default=float("nan")), "ms")
    res.add(
        "  of which flyd create-commit→STARTED p50",
        percentile(server, 50),
        "ms",
        note="server-side, from the machine's own event timestamps",
    )
    res.add("  flyd CPU per create", cpu_ms, "ms")
    res.add(
        "  making a file in flyd's data dir, CPU",
        file_us,
        "us",
        note="the disk under a start (a spare set is ~35 files): 15-170 us seen on this VM",
    )
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
        "file_create_cpu_us": file_us,
        "get_machine_ms": {"p50": percentile(floor, 50), "p99": percentile(floor, 99)},
        "samples_ms": [round(x, 3) for x in latencies],
        "server_commit_to_started_ms": {
            "p50": percentile(server, 50),
            "p99": percentile(server, 99),
        },
        "destroy_seconds": destroy_s,
    }


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
