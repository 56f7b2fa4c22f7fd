"""Failover and the return, per fault: how fast the standby serves, what clients saw, and how
fast the slot settles back to one copy (docs/fencing.md).

Real processes on 127.0.0.1: flaps, workers w1 and w2 announcing to it (200 ms heartbeats),
two proxies following both (default detection: suspect after 0.5 s, probe deadline 0.3 s). Each
run: a primary on w1 and its standby on w2, GETs through both proxies (about 25 a second each,
one at a time per proxy), then a fault on w1:

- flyd SIGKILL: w1's flyd dies, its machine runs on (a daemon crash); w1 restarts on its data dir
- host SIGKILL: w1's flyd and its machine die (a host death); w1 restarts on its data dir
- SIGSTOP: w1's flyd is stopped until the standby serves, then continued (a hang)

Measured per fault: from the fault to the first GET the standby answered (p50 and max), GETs
not answered 200, GETs the superseded primary answered after the standby's first, promotions
recorded (one per run, however many proxies noticed), and from the return (restart or SIGCONT)
to the slot settled: the old primary stopped and standing by for the promoted one, and both
proxies routing to the promoted one only.

`python -m bench --only fencing [--quick]`. Bounded: a few runs per fault, every wait has a
deadline, the whole run is cut off after RUN_DEADLINE.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench import procs, report
from bench.procs import progress
from bench.proxy_control_bench import (
    Fleet,
    Service,
    _get,
    _until,
    proxy_args,
    run_on_demo,
)
from bench.report import Results, percentile
from flaps.v1 import machines_pb2 as m
from flaps.v1 import machines_pb2_grpc
from flyd.drivers.rundir import kill_all
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from flyd.v1 import worker_pb2_grpc
from proxy.v1 import proxy_pb2, proxy_pb2_grpc

S = pb.MachineState
RUN_DEADLINE = 420.0
RPC_TIMEOUT = 15.0
RATE = 25.0  # GETs a second through each proxy
SERVING_TARGET_S = 1.0
FAULTS = ("flyd SIGKILL", "host SIGKILL", "SIGSTOP")


@dataclass
class Answer:
    proxy: int
    got: float
    status: int
    machine: str


@dataclass
class Load:
    """GETs for one app through each proxy, one at a time, every answer recorded."""

    proxies: list[str]
    app: str
    answers: list[Answer] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        await asyncio.gather(*(self._one(i, address) for i, address in enumerate(self.proxies)))

    async def _one(self, i: int, address: str) -> None:
        end = time.perf_counter() + 120  # bounded whatever happens
        while not self.stop.is_set() and time.perf_counter() < end:
            try:
                status, machine = await _get(address, self.app)
            except (OSError, TimeoutError) as err:
                status, machine = 0, repr(err)
            self.answers.append(Answer(i, time.perf_counter(), status, machine))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1 / RATE):
                    await self.stop.wait()

    def first(self, machine_id: str) -> float | None:
        return min((a.got for a in self.answers if a.machine == machine_id), default=None)


@dataclass
class Run:
    serving_s: float
    failed: int
    superseded: int
    promotions: int
    settled_s: float
    answers: int


def _restarted(fleet: Fleet, worker_id: str) -> Service:
    """w's flyd again, on its data dir and address."""
    old = fleet.workers[worker_id]
    old.kill()
    args = list(old.args)
    args[args.index("--listen") + 1] = old.address
    new = Service("flyd", args, old.log, old.env)
    fleet.services.append(new)
    fleet.workers[worker_id] = new
    return new.start()


async def _measure(fleet: Fleet, res: Results, runs: int) -> None:
    flaps = fleet.add("flaps", ["--listen", "127.0.0.1:0", "--grace-period", "2"])
    for worker_id, side in (("w1", "a"), ("w2", "b")):
        fleet.worker(worker_id, flaps.address, label=side)
        fleet.workers[worker_id].args += ["--announce-interval", "0.5"]
    await asyncio.gather(*(asyncio.to_thread(s.start) for s in fleet.workers.values()))
    follow = [arg for s in fleet.workers.values() for arg in ("--workers", s.address)]
    args = proxy_args(flaps.address, "--peers", flaps.address, *follow)
    proxies = [fleet.add("proxy", args) for _ in range(2)]
    machines = machines_pb2_grpc.MachinesServiceStub(fleet.channel(flaps.address))
    admins = [proxy_pb2_grpc.ProxyServiceStub(fleet.channel(p.address)) for p in proxies]
    progress(f"flaps at {flaps.address}, proxies at {[p.http for p in proxies]}")

    async def create(app: str, side: str, standby_for: str = "") -> pb.Machine:
        config = pb.MachineConfig(
            image="demo:v1",
            guest=pb.GuestConfig(cpu_millicores=500, memory_mib=64),
            services=[pb.ServiceConfig(internal_port=8080, autostart=True)],
            placement=pb.PlacementConfig(required_labels={"role": side}),
        )
        request = m.CreateMachineRequest(
            app=app, region="ams", config=config, standby_for=[standby_for] if standby_for else []
        )
        end = time.monotonic() + 20
        while True:  # flaps may not see both workers alive yet (at start, after a return)
            try:
                return (await machines.CreateMachine(request, timeout=RPC_TIMEOUT)).machine
            except Exception:
                if time.monotonic() > end:
                    raise
            await asyncio.sleep(0.05)

    async def row(machine_id: str) -> pb.Machine:
        req = m.GetMachineRequest(machine_id=machine_id)
        return (await machines.GetMachine(req, timeout=RPC_TIMEOUT)).machine

    async def routes(i: int, app: str) -> dict[str, proxy_pb2.RouteMachine]:
        resp = await admins[i].ListRoutes(proxy_pb2.ListRoutesRequest(app=app), timeout=5)
        return {r.machine_id: r for a in resp.apps for r in a.machines}

    async def settled(app: str, primary: str, standby: str) -> bool:
        old, new = await row(primary), await row(standby)
        if not (
            old.state == S.MACHINE_STATE_STOPPED
            and old.slot.primary == standby
            and new.state == S.MACHINE_STATE_STARTED
            and not new.slot.fenced
        ):
            return False
        for i in range(len(admins)):
            got = await routes(i, app)
            if not got[standby].healthy or got[primary].healthy:
                return False
        return True

    async def one(fault: str, n: int) -> Run:
        app = f"{fault.split()[0].lower()}{n}"
        primary = await create(app, "a")
        standby = await create(app, "b", primary.id)

        async def routed() -> bool:
            for i in range(len(admins)):
                got = await routes(i, app)
                if primary.id not in got or not got[primary.id].healthy or len(got) != 2:
                    return False
            return True

        await _until(routed, f"{app} routed by both proxies")
        load = Load([p.http for p in proxies], app)
        task = asyncio.create_task(load.run())
        try:
            await _until(_check(lambda: load.first(primary.id) is not None), "the primary serving")
            t_fault = time.perf_counter()
            back = _fault(fleet, fault)
            await _until(_check(lambda: load.first(standby.id) is not None), "the standby serving")
            serving = (load.first(standby.id) or 0) - t_fault
            t_back = time.perf_counter()
            await asyncio.to_thread(back)
            await _until(lambda: settled(app, primary.id, standby.id), "one copy settled")
            settled_s = time.perf_counter() - t_back
        finally:
            load.stop.set()
            await task
        first = load.first(standby.id) or 0
        events = await worker_pb2_grpc.WorkerServiceStub(
            fleet.channel(fleet.workers["w2"].address)
        ).ListMachineEvents(w.ListMachineEventsRequest(machine_id=standby.id), timeout=5)
        for machine_id in (primary.id, standby.id):
            await machines.DestroyMachine(
                m.DestroyMachineRequest(machine_id=machine_id, force=True), timeout=30
            )
        return Run(
            serving_s=serving,
            failed=sum(1 for a in load.answers if a.status != 200),
            superseded=sum(1 for a in load.answers if a.machine == primary.id and a.got > first),
            promotions=sum(1 for e in events.events if e.type == "promote"),
            settled_s=settled_s,
            answers=len(load.answers),
        )

    for fault in FAULTS:
        done: list[Run] = []
        for n in range(runs):
            done.append(await one(fault, n))
            r = done[-1]
            progress(
                f"{fault} {n}: standby serving after {r.serving_s:.3f} s, settled "
                f"{r.settled_s:.3f} s after the return; {r.failed} failed of {r.answers}, "
                f"{r.superseded} from the superseded copy, {r.promotions} promotion(s)"
            )
        serving = [r.serving_s for r in done]
        res.add(
            f"{fault}: fault -> standby serving p50",
            percentile(serving, 50),
            "s",
            target=("<=", SERVING_TARGET_S),
            note=f"{runs} runs",
        )
        res.add(f"{fault}: fault -> standby serving max", max(serving), "s")
        res.add(
            f"{fault}: GETs not answered 200",
            sum(r.failed for r in done),
            "",
            target=("==", 0),
            note=f"of {sum(r.answers for r in done)}",
        )
        res.add(
            f"{fault}: answers by the superseded copy",
            sum(r.superseded for r in done),
            "",
            target=("==", 0),
            note="after the standby's first",
        )
        res.add(
            f"{fault}: promotions per run",
            max(r.promotions for r in done),
            "",
            target=("==", 1),
            note="two proxies noticing",
        )
        res.add(
            f"{fault}: return -> one copy settled p50",
            percentile([r.settled_s for r in done], 50),
            "s",
        )
        res.add(f"{fault}: return -> one copy settled max", max(r.settled_s for r in done), "s")
        res.details[fault] = [r.__dict__ for r in done]


def _fault(fleet: Fleet, fault: str) -> Callable[[], object]:
    """Do `fault` to w1; returns how it comes back."""
    w1 = fleet.workers["w1"]
    assert w1.proc is not None
    if fault == "SIGSTOP":
        w1.proc.send_signal(signal.SIGSTOP)
        return lambda: w1.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
    w1.kill()
    if fault == "host SIGKILL":
        kill_all(fleet.root / "w1" / "machines")
    return lambda: _restarted(fleet, "w1")


def _check(predicate: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return predicate()

    return check


def run(*, quick: bool = False, out: Path | None = None, strict: bool = False) -> int:
    """Run the benchmark and print its table; write JSON to `out` when given. Returns 0, or
    1 on an error (or, with `strict`, a missed target)."""
    runs = 2 if quick else 5
    results = Results(f"fencing: failover and the return, per fault{' (quick)' if quick else ''}")
    root = Path(tempfile.mkdtemp(prefix="nonomad-fencing-bench-"))
    prefix = f"nonomad-bench-{secrets.token_hex(4)}"
    fleet = Fleet(root, prefix, procs.clean_env(root / "pycache"))

    async def bounded() -> None:
        try:
            async with asyncio.timeout(RUN_DEADLINE):
                await _measure(fleet, results, runs)
        finally:
            for service in fleet.services:
                if service.proc is not None and service.proc.poll() is None:
                    service.proc.send_signal(signal.SIGCONT)  # a stopped one dies too
            await fleet.close()

    run_on_demo(root, results, bounded)
    results.details["quick"] = quick
    return report.finish(results, out, strict)


def main(argv: list[str] | None = None) -> int:
    return report.main(run, "fencing_bench", __doc__, "2 runs per fault", argv)


if __name__ == "__main__":
    sys.exit(main())
