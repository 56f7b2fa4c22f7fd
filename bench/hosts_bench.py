"""A cluster across hosts next to one on a single host, in the same run.

Single host: a plain fleet on 127.0.0.1 (flaps, a proxy and three flyd workers as processes, as
the proxy control-plane benchmark builds it). Across hosts: nonomad.hosts, flaps, the registry,
the proxy and three workers each on a network-namespace host of its own, each running its
deploy/ unit's command line (TLS, tokens, `--route-machines`: the proxy dials machines at their
own addresses across the hosts' link). Both with flyd's default driver and detection settings.
The same three measurements on each:

1. create -> started: CreateMachine through flaps until WaitMachine says started (p50, p99).
2. cold request through the edge: an app whose one machine is created but not started; one
   HTTP request through the proxy (it starts the machine and holds the request). Beyond the
   app's own boot: minus (the machine's port first accepting - its started event), the port
   polled every 2 ms from where the proxy dials it.
3. worker death -> standby serving: a primary and its standby on two workers; the primary's
   worker dies with its machines (SIGKILL of flyd and the machine); requests one after another
   through the edge until the standby answers one (p50, max, and the requests that failed).

Traffic goes only to 127.0.0.1 and, across hosts, inside the namespaces the harness made (the
edge and flaps are reached through ports it forwards on 127.0.0.1; the port polls run in a
thread inside the proxy's host). Bounded: a few runs each, every wait has a deadline, each side
is cut off after RUN_DEADLINE. `python -m bench --only hosts [--quick]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import procs, report
from bench.fencing_bench import _restarted
from bench.procs import progress
from bench.proxy_control_bench import DOMAIN, Fleet, _get, proxy_args, run_on_demo
from bench.report import Results, percentile
from flyd.drivers.rundir import kill_all
from flyd.v1 import machine_pb2 as pb
from nonomad.client import Client
from nonomad.hosts import HTTP_PORT, PORTS, Hosts, netns_unavailable

STARTED = pb.MachineState.MACHINE_STATE_STARTED
RUN_DEADLINE = 300.0
WAIT = 20.0  # any single wait
WORKERS = ("w1", "w2", "w3")


@dataclass
class Side:
    """One cluster as the measurements see it."""

    client: Client
    edge: str  # the proxy's HTTP port on 127.0.0.1
    first_accept: Callable[[pb.Machine], Coroutine[Any, Any, float]]
    """Poll the machine's port, from where the proxy dials it, until it accepts: the time."""
    kill: Callable[[str], None]  # the worker dies with its machines
    revive: Callable[[str], Awaitable[None]]  # its flyd again, on its data dir and address


def _poll(host: str, port: int) -> float:
    """Every 2 ms until host:port accepts (at most WAIT); the wall-clock time it first did."""
    end = time.monotonic() + WAIT
    while time.monotonic() < end:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
            return time.time()
        time.sleep(0.002)
    raise TimeoutError(f"{host}:{port} never accepted")


def _config() -> pb.MachineConfig:
    # A whole core, as the proxy control-plane benchmark gives it (the app's start-up).
    return pb.MachineConfig(
        image="demo:v1",
        guest=pb.GuestConfig(cpu_millicores=1000, memory_mib=64),
        services=[pb.ServiceConfig(internal_port=8080, autostart=True)],
    )


async def _alive(client: Client, count: int) -> None:
    end = time.monotonic() + WAIT
    while time.monotonic() < end:
        with contextlib.suppress(Exception):
            if sum(w.status == 1 for w in await client.list_workers()) >= count:
                return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"flaps did not see {count} workers alive")


@contextlib.asynccontextmanager
async def single_host(root: Path) -> AsyncIterator[Side]:
    """flaps, a proxy and three workers as processes on 127.0.0.1."""
    prefix = f"nonomad-bench-{secrets.token_hex(4)}"
    fleet = Fleet(root, prefix, procs.clean_env(root / "pycache"), driver="auto")
    try:
        flaps = fleet.add("flaps", ["--listen", "127.0.0.1:0", "--grace-period", "2"])
        proxy = fleet.add("proxy", proxy_args(flaps.address))
        workers = [fleet.worker(w, flaps.address, proxy.address) for w in WORKERS]
        await asyncio.gather(*(asyncio.to_thread(w.start) for w in workers))

        def kill(worker_id: str) -> None:
            fleet.workers[worker_id].kill()
            kill_all(root / worker_id / "machines")

        async def first_accept(machine: pb.Machine) -> float:
            return await asyncio.to_thread(_poll, "127.0.0.1", machine.ports[0].host_port)

        async def revive(worker_id: str) -> None:
            await asyncio.to_thread(_restarted, fleet, worker_id)

        async with Client(flaps.address, timeout=WAIT) as client:
            yield Side(client, proxy.http, first_accept, kill, revive)
    finally:
        await fleet.close()


@contextlib.asynccontextmanager
async def across_hosts(root: Path) -> AsyncIterator[Side]:
    """nonomad.hosts: every part on a network-namespace host of its own."""
    hosts = Hosts(root, [(w, "ams") for w in WORKERS], image_source=root / "images", domain=DOMAIN)
    try:
        # (pyroute2's calls run a loop of their own: from a thread of their own)
        await asyncio.to_thread(hosts.up)
        sec = hosts.security
        assert sec is not None
        flaps = hosts.forward("flaps", PORTS["flaps"])
        edge = hosts.forward("proxy", HTTP_PORT)

        async def first_accept(machine: pb.Machine) -> float:
            target = (machine.address, machine.ports[0].internal_port)
            if not machine.address:  # a worker that does not route machines
                target = (machine.ports[0].host, machine.ports[0].host_port)
            return float(await asyncio.to_thread(hosts.in_host, "proxy", lambda: _poll(*target)))

        def kill(worker_id: str) -> None:
            hosts.kill(worker_id, machines=True)

        async def revive(worker_id: str) -> None:
            await asyncio.to_thread(hosts.start, worker_id)

        async with Client(
            flaps, tls=sec.client_tls(), token_file=sec.admin_token, timeout=WAIT
        ) as client:
            yield Side(client, edge, first_accept, kill, revive)
    finally:
        await asyncio.to_thread(hosts.close)


async def _measure(side: Side, res: Results, creates: int, colds: int, failovers: int) -> None:
    client = side.client
    await _alive(client, len(WORKERS))

    # 1. create -> started
    create_ms = []
    for i in range(creates):
        t0 = time.perf_counter()
        made = await client.create_machine(f"create{i}", _config(), region="ams")
        await client.wait_machine(made.id, "started", wait=WAIT)
        create_ms.append((time.perf_counter() - t0) * 1000)
        await client.destroy_machine(made.id, force=True)
    progress(f"create -> started: {', '.join(f'{v:.0f}' for v in create_ms)} ms")
    res.add("create -> started p50", percentile(create_ms, 50), "ms", note=f"{creates} creates")
    res.add("create -> started p99", percentile(create_ms, 99), "ms")

    # 2. a cold request through the edge
    cold_ms, beyond_ms = [], []
    for i in range(colds):
        app = f"cold{i}"
        made = await client.create_machine(app, _config(), region="ams", skip_launch=True)
        poller = asyncio.create_task(side.first_accept(made))
        end = time.monotonic() + WAIT
        while True:  # until the edge knows the app (a 404 starts nothing)
            t0 = time.perf_counter()
            status, served = await _get(side.edge, app)
            took = (time.perf_counter() - t0) * 1000
            if status == 200 and served == made.id:
                break
            if status != 404 or time.monotonic() > end:
                poller.cancel()
                raise RuntimeError(f"cold request {i}: {status} from {served!r}")
            await asyncio.sleep(0.02)
        accepted = await poller
        row = await client.get_machine(made.id)
        started = max(e.time.ToNanoseconds() / 1e9 for e in row.events if e.to_state == STARTED)
        cold_ms.append(took)
        beyond_ms.append(took - (accepted - started) * 1000)
        await client.destroy_machine(made.id, force=True)
    pairs = zip(cold_ms, beyond_ms, strict=True)
    progress(f"cold (beyond the boot): {', '.join(f'{c:.0f} ({b:.0f})' for c, b in pairs)} ms")
    res.add("cold request through the edge p50", percentile(cold_ms, 50), "ms", note=f"{colds}")
    res.add("  beyond the app's boot p50", percentile(beyond_ms, 50), "ms")

    # 3. worker death -> standby serving
    failover_s, failed = [], 0
    for i in range(failovers):
        app = f"fail{i}"
        primary = await client.create_machine(app, _config(), region="ams")
        standby = await client.create_machine(
            app, _config(), region="ams", skip_launch=True, standby_for=[primary.id]
        )
        end = time.monotonic() + WAIT
        while (await _get(side.edge, app))[1] != primary.id:
            if time.monotonic() > end:
                raise RuntimeError(f"failover run {i}: the primary never served")
            await asyncio.sleep(0.02)
        killed = time.perf_counter()
        side.kill(primary.worker_id)
        statuses = []
        while True:
            status, served = await _get(side.edge, app)
            statuses.append(status)
            if status == 200 and served == standby.id:
                break
            if time.perf_counter() - killed > WAIT:
                raise RuntimeError(f"failover run {i}: the standby never served ({statuses})")
            await asyncio.sleep(0.005)
        failover_s.append(time.perf_counter() - killed)
        failed += sum(s != 200 for s in statuses)
        progress(f"failover {i}: {failover_s[-1]:.3f} s, {len(statuses)} requests")
        await side.revive(primary.worker_id)
        await _alive(client, len(WORKERS))
        for machine_id in (primary.id, standby.id):
            await client.destroy_machine(machine_id, force=True)
    res.add("worker death -> standby serving p50", percentile(failover_s, 50), "s")
    res.add("  worker death -> standby serving max", max(failover_s), "s")
    res.add("  requests not answered 200 meanwhile", failed, "", note=f"{failovers} deaths")
    res.details.update(create_ms=create_ms, cold_ms=cold_ms, beyond_ms=beyond_ms)
    res.details["failover_s"] = failover_s


def _run_side(
    results: Results,
    cluster: Callable[[Path], contextlib.AbstractAsyncContextManager[Side]],
    counts: tuple[int, int, int],
) -> None:
    root = Path(tempfile.mkdtemp(prefix="nonomad-hosts-bench-"))

    async def bounded() -> None:
        async with asyncio.timeout(RUN_DEADLINE), cluster(root) as side:
            await _measure(side, results, *counts)

    run_on_demo(root, results, bounded)


def run(*, quick: bool = False, out: Path | None = None, strict: bool = False) -> int:
    """Both sides, one after the other, printed side by side; JSON to `out` when given.
    Returns 0, or 1 on an error (there are no targets: the figures are to compare)."""
    counts = (5, 3, 2) if quick else (20, 7, 5)
    title = f"across hosts next to one host{' (quick)' if quick else ''}"
    runs = {"single host": Results(f"{title}: single host")}
    runs["across hosts"] = Results(f"{title}: across hosts")
    progress("== single host")
    _run_side(runs["single host"], single_host, counts)
    problem = netns_unavailable()
    if problem is not None:
        runs["across hosts"].errors.append(f"hosts need: {problem}")
    else:
        progress("== across hosts")
        _run_side(runs["across hosts"], across_hosts, counts)
    print(report.side_by_side(title, runs))
    if out is not None:
        report.write_runs(out, title, runs)
    return 1 if any(r.errors for r in runs.values()) else 0


def main(argv: list[str] | None = None) -> int:
    return report.main(run, "hosts_bench", __doc__, "5 creates, 3 cold starts, 2 deaths", argv)


if __name__ == "__main__":
    sys.exit(main())
