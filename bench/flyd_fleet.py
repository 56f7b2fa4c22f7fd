"""flyd benchmarks 3 and 4, with a fleet of running machines on a real flyd process.

3. restart-to-ready: SIGKILL flyd, start it again on the same data dir, time the `recovered`
   log line and the first GetCapacity, and check that no machine was lost.
4. memory: flyd's RSS with the fleet running, its growth per machine, and what each
   machine's `/bin/sh` wrapper costs (PSS from smaps_rollup).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from bench import procs
from bench.flyd_client import (
    STARTED,
    TARGETS,
    BenchError,
    Client,
    Config,
    create_many,
    destroy_many,
    machine_config,
)
from bench.procs import FlydProcess, progress
from bench.report import Results
from flyd.v1 import worker_pb2 as w


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


def tree(pid: int) -> list[int]:
    """The process and all its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(procs.child_pids(p))
    return out


def sample_wrappers(handles: dict[str, Handle], k: int) -> dict[str, Any]:
    """Mean smaps_rollup figures (KiB) of a sample of machines: what flyd runs beside each
    (the `/bin/sh` wrapper; with OCI also crun, which waits on the container, and tini, its
    pid 1) and the machine's own process (`sleep`).
    """
    sample = random.Random(0).sample(sorted(handles), min(k, len(handles)))
    wrap_pss, wrap_rss, over_pss, over_private, main_pss, comms = [], [], [], [], [], set()
    for mid in sample:
        pid = handles[mid].pid
        sm = procs.smaps_rollup_kib(pid)
        if not sm:
            continue
        wrap_pss.append(sm.get("Pss", 0))
        wrap_rss.append(sm.get("Rss", 0))
        pss = private = 0
        for p in tree(pid):
            comm = ""
            with contextlib.suppress(OSError):
                comm = Path(f"/proc/{p}/comm").read_text().strip()
            rollup = procs.smaps_rollup_kib(p)
            if comm == "sleep":  # the machine's own command
                main_pss.append(rollup.get("Pss", 0))
                continue
            comms.add(comm)
            pss += rollup.get("Pss", 0)
            private += rollup.get("Private_Clean", 0) + rollup.get("Private_Dirty", 0)
        over_pss.append(pss)
        over_private.append(private)
    mean = statistics.fmean
    nan = float("nan")
    return {
        "sampled": len(wrap_pss),
        "wrapper_pss_kib": mean(wrap_pss) if wrap_pss else nan,
        "wrapper_rss_kib": mean(wrap_rss) if wrap_rss else nan,
        "overhead_pss_kib": mean(over_pss) if over_pss else nan,
        "overhead_private_kib": mean(over_private) if over_private else nan,
        "main_process_pss_kib": mean(main_pss) if main_pss else nan,
        "overhead_comm": ",".join(sorted(comms)),
    }


def netd_rss_kib(data_dir: Path) -> float | None:
    """netd's RSS (OCI), from the handle it records; None without one."""
    with contextlib.suppress(OSError, ValueError, KeyError):
        pid = int(json.loads((data_dir / "machines" / ".netd.json").read_bytes())["pid"])
        return float(procs.smaps_rollup_kib(pid).get("Rss", 0))
    return None


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
        res.add(
            "  all flyd runs beside a machine, PSS",
            wrappers["overhead_pss_kib"],
            "KiB",
            note=wrappers["overhead_comm"],
        )
        res.add("    of which private", wrappers["overhead_private_kib"], "KiB")
        netd = netd_rss_kib(flyd.data_dir)
        if netd is not None:
            res.add(f"  netd RSS with {n} machines", netd * 1024 / 1e6, "MB")
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

        limit = TARGETS[cfg.driver].restart_s
        res.add(f"restart spawn→recovered ({n} machines)", to_recovered, "s", ("<=", limit))
        res.add(f"restart spawn→first GetCapacity ({n} machines)", first_cap, "s", ("<=", limit))
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
