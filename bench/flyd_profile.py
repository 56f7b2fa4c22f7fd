"""flyd benchmark 0: where a create's time goes.

The same creates as benchmark 1, in this process: a Worker on the real LMDB store and process
driver, no gRPC, with timers around the store, the driver and the log handler, then under
cProfile; the breakdown and the top functions go in the JSON.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import cProfile
import io
import logging
import pstats
import time
from pathlib import Path
from typing import Any

from bench import procs
from bench.flyd_client import (
    CAPACITY,
    DESTROYED,
    STARTED,
    WAIT_TIMEOUT,
    BenchError,
    Config,
    S,
    machine_config,
)
from bench.procs import progress
from bench.report import Results, percentile
from flyd import fsm
from flyd.drivers.oci import OciDriver
from flyd.drivers.process import ProcessDriver
from flyd.drivers.rundir import kill_all
from flyd.images.cache import ImageCache
from flyd.settings import CapacitySettings
from flyd.store import LmdbMachineLog
from flyd.worker import Identity, Worker
from model.images.source import ImageSource
from runtime import configure_logging
from runtime.clock import SystemClock

_PART = "  of which"  # a timer inside another: not added up again


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

    driver: ProcessDriver | OciDriver
    if cfg.driver == "oci":
        driver = OciDriver(root / "machines", on_exit=on_exit, cgroup_prefix=prefix)
    else:
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
            timers.wrap(f"{cfg.driver} driver.start (held, not yet released)", driver, "start")
            timers.wrap("driver.release", driver, "release")
            timers.wrap("driver.publish (the ports, after the commit)", driver, "publish")
            if isinstance(driver, OciDriver):  # the network's part, and crun's
                timers.wrap(
                    f"{_PART} netd up: user + network namespace, veth, address, ports",
                    driver,
                    "_publish_ports",
                )
                timers.wrap(
                    f"{_PART} the wrapper, mounts and crun until the hold",
                    driver,
                    "_until_ready",
                )
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
        kill_all(root / "machines")  # netd (OCI) outlives its driver, as it outlives flyd

    total_ms = sum(wall) / max(1, n)
    breakdown = {
        label: {"ms_per_create": spent[label] * 1000 / n, "calls_per_create": calls[label] / n}
        for label in sorted(spent)
    }
    accounted = sum(v["ms_per_create"] for k, v in breakdown.items() if not k.startswith(_PART))
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
