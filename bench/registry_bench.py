"""Registry benchmark: how soon a state change on a worker is visible in a replica.

The fleet is 100 workers: ONE real flyd process plus 99 FAKE workers (`registry.fakes.FakeWorker`,
which serve only WatchEvents and GetCapacity from an in-memory log, with flyd's 200 ms
heartbeats). The fakes all live in one helper process, each on its own gRPC port on 127.0.0.1,
and commit a change when told to over the helper's stdin. A `Replica` in this process follows
all 100 directly, as a flaps or proxy would.

Latency is measured from the change's own timestamp to the moment the replica applies it (the
replica's subscription sees it): for the real flyd the commit time flyd writes into the machine
row (`updated_at`, before the RPC even returns), for a fake the time it emitted the change. Both
clocks are this host's wall clock.

1. sequential: one change at a time (80% on fakes, 20% on the real flyd), each waited for.
2. burst: one change on every fake worker at once.

The same changes are also timed in a second, downstream replica that follows the first one's
Follow stream (upstream mode), as a proxy would follow a standalone registry.

`python -c "from bench.registry_bench import main; main()" [--quick]`. Bounded: 200 changes
(50 with --quick), every wait has a deadline, the whole run is cut off after 90 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench import procs, report
from bench.procs import FlydProcess, progress
from bench.report import Results, percentile
from flyd.images.build import build_image
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from flyd.v1 import worker_pb2_grpc
from model.images.owners import PUBLIC
from registry.replica import Replica, ReplicaEvent, Subscription
from registry.service import RegistryServicer
from registry.v1 import registry_pb2_grpc
from registry.view import ALIVE
from runtime import configure_logging

S = pb.MachineState
WORKERS = 100  # in all: WORKERS - 1 fakes and one real flyd
HEARTBEAT_INTERVAL = 0.2
TARGET_P99_MS = 50.0
RUN_DEADLINE = 90.0
WAIT = 10.0
RPC_TIMEOUT = 30.0
REAL_SHARE = 0.2


# -- the fake worker host (a child process) ----------------------------------------------------


def fake_host_main(argv: Sequence[str] | None = None) -> None:
    """Serve `count` fake workers; print their addresses as one JSON line; obey stdin.

    Each stdin line `INDEX MACHINE_ID` commits a change on fake worker INDEX (time-stamped at
    emission). EOF stops everything.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    count, interval = int(args[0]), float(args[1])
    asyncio.run(_fake_host(count, interval))


async def _fake_host(count: int, interval: float) -> None:
    from registry.fakes import FakeWorker

    workers = [
        FakeWorker(f"fake-{i:03d}", "ams", heartbeat_interval=interval) for i in range(count)
    ]
    for worker in workers:
        await worker.serve()
    print(json.dumps([worker.address for worker in workers]), flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while line := await reader.readline():
            index, machine_id = line.decode().split()
            workers[int(index)].change(machine_id, S.MACHINE_STATE_STARTED, app="bench")
    finally:
        for worker in workers:
            await worker.stop()


@dataclass
class FakeHost:
    proc: subprocess.Popen[bytes]
    addresses: list[str]

    @classmethod
    def start(cls, count: int, log: Path) -> FakeHost:
        with open(log, "wb") as err:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "from bench.registry_bench import fake_host_main; fake_host_main()",
                    str(count),
                    str(HEARTBEAT_INTERVAL),
                ],
                cwd=procs.REPO_ROOT,
                env=procs.clean_env(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
            )
        assert proc.stdout is not None
        line = proc.stdout.readline()  # bounded: the host prints or dies
        if not line:
            raise RuntimeError(f"fake worker host failed; see {log}")
        return cls(proc, json.loads(line))

    def change(self, changes: Sequence[tuple[int, str]]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("".join(f"{i} {mid}\n" for i, mid in changes).encode())
        self.proc.stdin.flush()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


# -- measuring -----------------------------------------------------------------------------------


@dataclass
class Seen:
    """When the replica applied each (machine id, state, updated_at) it was told of."""

    at: dict[tuple[str, int, int], float] = field(default_factory=dict)
    ids: set[str] = field(default_factory=set)
    waiting: set[str] = field(default_factory=set)
    all_seen: asyncio.Event = field(default_factory=asyncio.Event)

    def expect(self, machine_ids: set[str]) -> asyncio.Event:
        """An event set once the recorder has stamped every one of `machine_ids`."""
        self.waiting = machine_ids - self.ids
        self.all_seen = asyncio.Event()
        if not self.waiting:
            self.all_seen.set()
        return self.all_seen

    async def record(self, sub: Subscription[ReplicaEvent]) -> None:
        async for event in sub:
            now = time.time()
            machine = event.machine
            if event.kind != "machine" or machine is None:
                continue
            key = (machine.id, int(machine.state), machine.updated_at.ToNanoseconds())
            self.at.setdefault(key, now)
            self.ids.add(machine.id)
            if machine.id in self.waiting:
                self.waiting.discard(machine.id)
                if not self.waiting:
                    self.all_seen.set()

    def latencies_ms(self, machine_ids: set[str]) -> list[float]:
        return [
            (seen - updated_ns / 1e9) * 1000
            for (mid, _, updated_ns), seen in self.at.items()
            if mid in machine_ids
        ]


def _build_image(root: Path) -> None:
    src = root / "src"
    src.mkdir(parents=True)
    (src / "README").write_text("an image whose machines are never started\n")
    build_image(
        src, root / "images", name="idle", tag="v1", entrypoint=["sleep", "1000"], owners=PUBLIC
    )


async def _wait(replica: Replica, check: Callable[[], bool], what: str) -> None:
    if not await replica.wait_for(check, WAIT):
        raise RuntimeError(f"timed out waiting for {what}")


async def _real_change(stub: worker_pb2_grpc.WorkerServiceStub, replica: Replica) -> str:
    """Create a machine on the real flyd (one commit) and wait until the replica has it."""
    machine_id = f"real-{secrets.token_hex(5)}"
    config = pb.MachineConfig(
        image="idle:v1", guest=pb.GuestConfig(cpu_millicores=10, memory_mib=16)
    )
    await stub.CreateMachine(
        w.CreateMachineRequest(machine_id=machine_id, app="bench", config=config, skip_launch=True),
        timeout=RPC_TIMEOUT,
    )
    await _wait(replica, _has(replica, machine_id), machine_id)
    return machine_id


def _has(replica: Replica, machine_id: str) -> Callable[[], bool]:
    return lambda: replica.machine(machine_id) is not None


async def _destroy_all(stub: worker_pb2_grpc.WorkerServiceStub, ids: list[str]) -> None:
    for machine_id in ids:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await stub.DestroyMachine(
                w.DestroyMachineRequest(machine_id=machine_id, force=True), timeout=RPC_TIMEOUT
            )


async def _serve(replica: Replica) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    registry_pb2_grpc.add_RegistryServiceServicer_to_server(RegistryServicer(replica), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _measure(
    results: Results, flyd_address: str, fakes: FakeHost, changes: int, rng: random.Random
) -> None:
    replica = Replica(suspect_after=0.6, dead_after=1.0)
    for i, address in enumerate(fakes.addresses):
        replica.add_worker(pb.WorkerInfo(id=f"fake-{i:03d}", region="ams", address=address))
    replica.add_address(flyd_address)
    shutdown = asyncio.Event()
    runner = asyncio.create_task(replica.run(shutdown))
    server, registry_address = await _serve(replica)
    downstream = Replica(suspect_after=0.6, dead_after=1.0, upstream=registry_address)
    down_runner = asyncio.create_task(downstream.run(shutdown))
    channel = grpc.aio.insecure_channel(flyd_address)
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    real_ids: list[str] = []
    try:
        total = len(fakes.addresses) + 1

        def all_alive() -> bool:
            views = replica.workers()
            return len(views) == total and all(v.status == ALIVE for v in views)

        if not await replica.wait_for(all_alive, 30):
            raise RuntimeError("not every worker became alive in the replica")
        if not await downstream.wait_for(lambda: len(downstream.workers()) == total, 30):
            raise RuntimeError("the downstream replica did not learn every worker")
        progress(f"replica follows {total} workers; all alive; the downstream knows them all")

        seen, down_seen = Seen(), Seen()
        sub = replica.subscribe(maxsize=100_000)
        down_sub = downstream.subscribe(maxsize=100_000)
        recorder = asyncio.create_task(seen.record(sub))
        down_recorder = asyncio.create_task(down_seen.record(down_sub))
        fake_ids: set[str] = set()
        started = time.perf_counter()
        for n in range(changes):
            if rng.random() < REAL_SHARE:
                real_ids.append(await _real_change(stub, replica))
            else:
                machine_id = f"fake-m{n}"
                fakes.change([(rng.randrange(len(fakes.addresses)), machine_id)])
                fake_ids.add(machine_id)
                await _wait(replica, _has(replica, machine_id), machine_id)
            # Spread the changes out a little, as a real fleet's would be.
            await asyncio.sleep(rng.uniform(0.0, 0.02))
        sequential_s = time.perf_counter() - started
        progress(f"{changes} sequential changes in {sequential_s:.1f}s")

        burst_ids = {f"burst-{i}" for i in range(len(fakes.addresses))}
        stamped = seen.expect(burst_ids)
        fakes.change([(i, f"burst-{i}") for i in range(len(fakes.addresses))])
        await asyncio.wait_for(stamped.wait(), WAIT)
        sub.close()
        await recorder
        # everything, burst included, has reached the downstream too
        await asyncio.wait_for(down_seen.expect(fake_ids | set(real_ids) | burst_ids).wait(), WAIT)
        down_sub.close()
        await down_recorder

        fake_ms = seen.latencies_ms(fake_ids)
        real_ms = seen.latencies_ms(set(real_ids))
        burst_ms = seen.latencies_ms(burst_ids)
        both = fake_ms + real_ms
        n_fake = len(fakes.addresses)
        for label, values in [
            (f"all {len(both)} sequential changes", both),
            (f"{len(fake_ms)} changes on the {n_fake} FAKE workers", fake_ms),
            (f"{len(real_ms)} changes on the 1 real flyd", real_ms),
        ]:
            results.add(f"{label}, p50", percentile(values, 50), "ms")
            results.add(f"{label}, p99", percentile(values, 99), "ms", target=("<=", TARGET_P99_MS))
        results.add(
            f"burst: 1 change on each of the {n_fake} FAKE workers at once, p50",
            percentile(burst_ms, 50),
            "ms",
        )
        results.add(
            f"burst: 1 change on each of the {n_fake} FAKE workers at once, p99",
            percentile(burst_ms, 99),
            "ms",
        )
        down = down_seen.latencies_ms(fake_ids | set(real_ids))
        results.add(
            f"via a downstream replica (upstream mode): all {len(down)}, p50",
            percentile(down, 50),
            "ms",
        )
        results.add(
            f"via a downstream replica (upstream mode): all {len(down)}, p99",
            percentile(down, 99),
            "ms",
            target=("<=", TARGET_P99_MS),
        )
        results.details.update(
            workers=total,
            fake_workers=n_fake,
            real_workers=1,
            heartbeat_interval_s=HEARTBEAT_INTERVAL,
            sequential_seconds=round(sequential_s, 2),
            subscription_overflows=sub.overflows,
        )
    finally:
        await _destroy_all(stub, real_ids)
        await channel.close()
        shutdown.set()
        await server.stop(None)
        await asyncio.wait_for(asyncio.gather(runner, down_runner), 10)


def run(*, quick: bool = False, out: Path | None = None, strict: bool = False) -> int:
    """Run the benchmark, print its table; write JSON to `out` when given."""
    changes = 50 if quick else 200
    title = (
        f"registry: state change on a worker visible in a replica, {WORKERS} workers "
        f"(1 real flyd + {WORKERS - 1} FAKE workers in one helper process; "
        f"heartbeats every {HEARTBEAT_INTERVAL * 1000:.0f} ms)"
    )
    results = Results(title)
    configure_logging("registry-bench", "warning")
    procs.raise_fd_limit()
    root = Path(tempfile.mkdtemp(prefix="nonomad-registry-bench-"))
    prefix = f"nonomad-bench-{secrets.token_hex(4)}"
    flyd = FlydProcess(
        data_dir=root / "flyd",
        image_source=root / "images",
        cgroup_prefix=prefix,
        log_dir=root / "logs",
        capacity={"cpu_millicores": 1_000_000, "memory_mib": 1_000_000, "machines": 5_000},
    )
    fakes: FakeHost | None = None
    try:
        _build_image(root)
        flyd.start()
        address = flyd.wait_ready()
        (root / "logs").mkdir(parents=True, exist_ok=True)
        fakes = FakeHost.start(WORKERS - 1, root / "logs" / "fakes.log")
        progress(f"flyd at {address}; {len(fakes.addresses)} fake workers up")
        rng = random.Random(1)

        async def bounded() -> None:
            assert fakes is not None
            async with asyncio.timeout(RUN_DEADLINE):
                await _measure(results, address, fakes, changes, rng)

        asyncio.run(bounded())
    except Exception as err:
        results.errors.append(f"{type(err).__name__}: {err}")
    finally:
        if fakes is not None:
            fakes.stop()
        flyd.terminate()
        procs.remove_cgroups(prefix)
        shutil.rmtree(root, ignore_errors=True)
    return report.finish(results, out, strict)


def main(argv: list[str] | None = None) -> int:
    return report.main(run, "registry_bench", __doc__, "50 changes instead of 200", argv)


if __name__ == "__main__":
    sys.exit(main())
