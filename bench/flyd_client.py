"""What the flyd benchmarks share: the run's sizes (`Config`: FULL and QUICK), the
WorkerService client with the compound calls they make (create until STARTED, destroy until
DESTROYED, the log head and a replay of it), bounded creates and destroys of many machines,
and the one-file image every machine runs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf.duration_pb2 import Duration

from bench.procs import progress
from flyd.images.build import build_image
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from flyd.v1 import worker_pb2_grpc
from model.images.owners import PUBLIC
from model.validate import DEFAULT_DISK_MIB

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
# Room for every machine the run creates (destroyed ones release theirs), each with the
# default disk (GUEST says 0) that a worker reserves.
CAPACITY = {
    "cpu_millicores": 1_000_000,
    "memory_mib": 1_000_000,
    "disk_mib": 4_000 * DEFAULT_DISK_MIB,
    "machines": 4_000,
}
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
    driver: str = "process"  # flyd --driver: process or oci


@dataclass(frozen=True)
class Targets:
    """What each driver is held to: an OCI machine also makes namespaces, mounts and a
    container (crun alone takes ~12 ms), and re-attaches to more per machine after a restart.
    """

    create_p50_ms: float
    create_p99_ms: float
    restart_s: float


TARGETS = {"process": Targets(10, 30, 1.0), "oci": Targets(25, 60, 2.0)}


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
        request = w.ListMachinesRequest(app=app)
        machines: list[pb.Machine] = []
        while True:
            resp = await self.stub.ListMachines(request, timeout=RPC_TIMEOUT)
            machines.extend(resp.machines)
            if not resp.next_page_token:
                return machines
            request.page_token = resp.next_page_token

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
    digest = build_image(
        src, source, name="sleeper", tag="v1", entrypoint=["sleep", "100000"], owners=PUBLIC
    )
    return source, digest
