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

The benchmarks live in bench.flyd_profile (0), bench.flyd_latency (1, 2) and bench.flyd_fleet
(3, 4), over what bench.flyd_client shares; this module runs them in order and cleans up, once
per driver (process, then oci: the same machines as host processes and as crun containers),
and prints the two side by side, each against its own targets (bench.flyd_client.TARGETS).

flyd's bytecode is cached in the run's temp dir (PYTHONPYCACHEPREFIX), as an installed flyd
would have it; without a cache (PYTHONDONTWRITEBYTECODE=1 and a venv installed without
.pyc files) every flyd start compiles its imports again, about 0.5 s here. The first flyd
start of a run shows that cost; `--no-bytecode-cache` measures everything that way.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import platform
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from bench import procs
from bench.flyd_client import (
    CAPACITY,
    FULL,
    QUICK,
    Client,
    Config,
    build_sleeper,
)
from bench.flyd_fleet import bench_fleet
from bench.flyd_latency import bench_create_latency, bench_transitions
from bench.flyd_profile import bench_create_profile
from bench.procs import FlydProcess, progress
from bench.report import Results, side_by_side, write_runs
from flyd.drivers.oci import probe as oci_probe
from flyd.drivers.rundir import kill_all

DRIVERS = ("process", "oci")


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
        # An OCI worker's netd outlives flyd, as the machines do: it goes with the worker.
        kill_all(f.data_dir / "machines")
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
    """Run one benchmark, noting how busy the host was meanwhile (others share the CPUs).

    It starts with the disk settled: the phase before may have destroyed hundreds of machines,
    and their deleted files (with the journal and the device's discards behind them) would
    make every file a start makes in this one cost several times more for a while.
    """
    t0 = time.perf_counter()
    await asyncio.to_thread(os.sync)
    res.details.setdefault("settle_s", {})[name] = time.perf_counter() - t0
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
    """Every flyd benchmark with one driver (`cfg.driver`)."""
    soft, hard = procs.raise_fd_limit()
    subreaper = procs.become_subreaper()
    tmp = Path(tempfile.mkdtemp(prefix="nonomad-bench-"))
    os.chmod(tmp, 0o711)  # as a data dir under /var/lib is: searchable, not listable
    prefix = f"nonomad-bench-{secrets.token_hex(4)}"
    res.details["environment"] = {
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "fd_limit": [soft, hard],
        "subreaper": subreaper,
        "cgroup_prefix": prefix,
        "driver": cfg.driver,
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
            driver=cfg.driver,
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


def run(
    *,
    quick: bool,
    out: Path,
    strict: bool = False,
    bytecode_cache: bool = True,
    drivers: tuple[str, ...] = DRIVERS,
) -> int:
    """Run every flyd benchmark once per driver, print them side by side, write the JSON."""
    title = f"flyd benchmarks{' (quick)' if quick else ''}"
    runs: dict[str, Results] = {}
    t0 = time.perf_counter()
    for driver in drivers:
        res = Results(title=f"{title}: {driver} driver")
        runs[driver] = res
        problem = oci_probe() if driver == "oci" else None
        if problem is not None:
            res.errors.append(f"the oci driver cannot run here: {problem}")
            continue
        progress(f"== {driver} driver")
        cfg = dataclasses.replace(QUICK if quick else FULL, driver=driver)
        started = time.perf_counter()
        asyncio.run(_run(cfg, res, bytecode_cache))
        res.details["total_seconds"] = time.perf_counter() - started
        res.details["quick"] = quick
    write_runs(out, title, runs)
    print(side_by_side(title, runs))
    print(f"\n(total {time.perf_counter() - t0:.1f} s; JSON in {out})")
    if any(r.errors for r in runs.values()):
        return 2
    return 1 if strict and any(r.missed for r in runs.values()) else 0
