"""A simulated fleet for the flaps benchmark, run as a child process (`python -m bench.flaps_fleet
WORKERS MACHINES_EACH HEARTBEAT_SECONDS`).

It is what a flaps in upstream mode sees of a real fleet, through the real protocols: a
registry serving `registry.v1.RegistryService.Follow` (per worker a snapshot of its machine
rows and a heartbeat with its capacity, then live changes and heartbeats), and ONE fake worker
serving `flyd.v1.WorkerService.CreateMachine` and `GetMachine` for every simulated worker (every
worker's address is its port). A create that fits is accepted at once, its row is sent on the
Follow stream as a change, and the worker's free capacity in its next heartbeat shrinks; one
that does not fit is refused with RESOURCE_EXHAUSTED, as flyd would. So what the benchmark times
is flaps' own work, plus two loopback hops.

Rows look like flyd's for the demo app (`nonomad/demo/app.toml`: its config, a service port, a
tail of three events). Workers are spread over ten regions and three host sizes. The
simulation keeps rows as bytes, so a million of them fit. Like a registry, it sends a follower
that asks for batches (`FollowRequest.max_batch`) up to that many items in one message when as
many are ready. Heartbeats go out in slices, 100 a second (a registry relays them as they come,
in batches of what came meanwhile; slices of 250 every 50 ms made bursts no fleet sends).

It prints one JSON line, `{"registry": ADDR, "worker": ADDR}`, and runs until stdin closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import grpc.aio

from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from model.validate import DEFAULT_DISK_MIB, guest_disk_mib
from nonomad.spec import load_spec
from registry.v1 import registry_pb2 as r

S = pb.MachineState
REGIONS = ("ams", "syd", "ord", "iad", "fra", "sin", "nrt", "gru", "jnb", "lhr")
# Host sizes: (millicores, MiB, machines); the demo guest is 250 millicores and 128 MiB.
HOSTS = ((32_000, 65_536, 512), (48_000, 98_304, 512), (64_000, 131_072, 768))
DEMO = Path(__file__).resolve().parents[1] / "nonomad" / "demo" / "app.toml"
# Items queued for the follower before the simulation waits for it to read.
FOLLOW_QUEUE = 8192
# Snapshot items sent between two yields to the simulation's own loop.
SNAPSHOT_CHUNK = 50
# Follow items in one message at most (a follower asks for up to this many: max_batch), and
# about the most bytes of them (a registry's bound: model.pages.PAGE_BYTES).
MAX_BATCH = 256
BATCH_BYTES = 1 << 20
# FollowResponse.batch (field 5, length-delimited): the tag before each item of a batch.
_BATCH_TAG = bytes([5 << 3 | 2])


@dataclass
class SimWorker:
    info: pb.WorkerInfo
    total: pb.Resources
    used: pb.Resources
    rows: dict[str, bytes] = field(default_factory=dict)
    seq: int = 0

    def capacity(self) -> pb.Capacity:
        t, u = self.total, self.used
        cap = pb.Capacity(
            total=t,
            free=pb.Resources(
                cpu_millicores=t.cpu_millicores - u.cpu_millicores,
                memory_mib=t.memory_mib - u.memory_mib,
                disk_mib=t.disk_mib - u.disk_mib,
                machines=t.machines - u.machines,
            ),
        )
        cap.machines_by_state["started"] = len(self.rows)
        cap.images.add(ref="demo:v1", digest="sha256:" + "d" * 64, size_bytes=4 << 20)
        return cap


class Fleet:
    """The simulated workers, their rows, and the Follow streams that watch them."""

    def __init__(self, workers: int, machines_each: int, heartbeat: float, seed: int = 7) -> None:
        rng = random.Random(seed)
        self.heartbeat = heartbeat
        self.template = load_spec(DEMO).machine_config("ams", "demo-0")
        self.workers: dict[str, SimWorker] = {}
        self.address = ""
        self._followers: set[asyncio.Queue[bytes]] = set()
        for i in range(workers):
            cpu, mem, slots = rng.choice(HOSTS)
            info = pb.WorkerInfo(
                id=f"w{i:05d}", region=REGIONS[i % len(REGIONS)], boot_id=f"boot{i}"
            )
            sim = SimWorker(
                info=info,
                # Disk for every slot at the default size, as a worker reserves it.
                total=pb.Resources(
                    cpu_millicores=cpu,
                    memory_mib=mem,
                    disk_mib=slots * DEFAULT_DISK_MIB,
                    machines=slots,
                ),
                used=pb.Resources(),
            )
            for j in range(machines_each):
                machine = self._row(
                    sim, f"{info.id}-{j:012x}", self.template, S.MACHINE_STATE_STARTED
                )
                self._put(sim, machine)
            self.workers[info.id] = sim

    def _row(
        self, sim: SimWorker, machine_id: str, config: pb.MachineConfig, state: int
    ) -> pb.Machine:
        now = time.time_ns()
        machine = pb.Machine(
            id=machine_id,
            name=machine_id,
            app="demo",
            region=sim.info.region,
            worker_id=sim.info.id,
            state=state,  # type: ignore[arg-type]
            config=config,
            instance_id=f"{len(sim.rows):016x}",
        )
        machine.created_at.FromNanoseconds(now)
        machine.updated_at.FromNanoseconds(now)
        machine.ports.add(internal_port=8080, host="127.0.0.1", host_port=20000 + len(sim.rows))
        steps = [(S.MACHINE_STATE_UNSPECIFIED, S.MACHINE_STATE_CREATED, "create", "created")]
        if state == S.MACHINE_STATE_STARTED:
            steps += [
                (S.MACHINE_STATE_CREATED, S.MACHINE_STATE_STARTING, "start", "requested by client"),
                (S.MACHINE_STATE_STARTING, S.MACHINE_STATE_STARTED, "start", "process running"),
            ]
        for k, (a, b, kind, reason) in enumerate(steps):
            machine.events.add(
                seq=sim.seq + k + 1,
                machine_id=machine_id,
                type=kind,
                from_state=a,
                to_state=b,
                reason=reason,
                time=machine.updated_at,
            )
        return machine

    def _put(self, sim: SimWorker, machine: pb.Machine) -> None:
        guest = machine.config.guest
        sim.used.cpu_millicores += guest.cpu_millicores
        sim.used.memory_mib += guest.memory_mib
        sim.used.disk_mib += guest_disk_mib(guest)
        sim.used.machines += 1
        sim.seq += len(machine.events) or 1
        sim.rows[machine.id] = machine.SerializeToString()

    # -- the worker side ------------------------------------------------------------------------

    def create(self, request: w.CreateMachineRequest) -> pb.Machine | str:
        """The new (or existing) machine, or why it does not fit."""
        worker_id = request.machine_id[: request.machine_id.rfind("-")]
        sim = self.workers.get(worker_id)
        if sim is None:
            return f"no worker {worker_id}"
        old = sim.rows.get(request.machine_id)
        if old is not None:
            return pb.Machine.FromString(old)
        guest, t, u = request.config.guest, sim.total, sim.used
        for name, need, free in (
            ("cpu", guest.cpu_millicores, t.cpu_millicores - u.cpu_millicores),
            ("memory", guest.memory_mib, t.memory_mib - u.memory_mib),
            ("disk", guest_disk_mib(guest), t.disk_mib - u.disk_mib),
            ("machines", 1, t.machines - u.machines),
        ):
            if need > free:
                return f"worker {worker_id} has {free} of {name} free; the machine needs {need}"
        state = S.MACHINE_STATE_CREATED if request.skip_launch else S.MACHINE_STATE_STARTED
        machine = self._row(sim, request.machine_id, request.config, state)
        machine.app = request.app
        self._put(sim, machine)
        # One change per step, each with its own seq, as flyd's log has them (a create that
        # starts is three: created, starting, started), the row as it was after the step.
        for event in machine.events:
            row = pb.Machine()
            row.CopyFrom(machine)
            row.state = event.to_state
            self._send(sim, w.WatchEventsResponse(change=w.MachineChange(event=event, machine=row)))
        return machine

    async def CreateMachine(
        self, request: w.CreateMachineRequest, context: grpc.aio.ServicerContext
    ) -> w.CreateMachineResponse:
        got = self.create(request)
        if isinstance(got, str):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, got)
        assert isinstance(got, pb.Machine)
        return w.CreateMachineResponse(machine=got)

    async def GetMachine(
        self, request: w.GetMachineRequest, context: grpc.aio.ServicerContext
    ) -> w.GetMachineResponse:
        sim = self.workers.get(request.machine_id[: request.machine_id.rfind("-")])
        row = None if sim is None else sim.rows.get(request.machine_id)
        if row is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"machine {request.machine_id}")
        assert row is not None
        return w.GetMachineResponse(machine=pb.Machine.FromString(row))

    # -- the registry side ----------------------------------------------------------------------

    def _follow_item(self, sim: SimWorker, item: w.WatchEventsResponse) -> bytes:
        return r.FollowResponse(
            worker_id=sim.info.id, status=r.MEMBER_STATUS_ALIVE, worker=sim.info, item=item
        ).SerializeToString()

    def _heartbeat(self, sim: SimWorker) -> bytes:
        hb = w.Heartbeat(seq=sim.seq, worker=sim.info, capacity=sim.capacity())
        hb.time.FromNanoseconds(time.time_ns())
        return self._follow_item(sim, w.WatchEventsResponse(heartbeat=hb))

    def _snapshot(self, sim: SimWorker) -> bytes:
        snap = w.Snapshot(seq=sim.seq, reason="requested")
        for row in sim.rows.values():
            snap.machines.add().MergeFromString(row)
        return self._follow_item(sim, w.WatchEventsResponse(snapshot=snap))

    def _send(self, sim: SimWorker, item: w.WatchEventsResponse) -> None:
        data = self._follow_item(sim, item)
        for queue in self._followers:
            with contextlib.suppress(asyncio.QueueFull):  # a follower that far behind resyncs
                queue.put_nowait(data)

    async def Follow(
        self, request: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        # As a registry serves it: up to max_batch items a message, when that many are ready.
        most = max(1, min(r.FollowRequest.FromString(request).max_batch, MAX_BATCH))
        queue: asyncio.Queue[bytes] = asyncio.Queue(FOLLOW_QUEUE)
        self._followers.add(queue)
        try:
            workers = list(self.workers.values())
            for i in range(0, len(workers), SNAPSHOT_CHUNK):
                items = []
                for sim in workers[i : i + SNAPSHOT_CHUNK]:
                    items += [self._snapshot(sim), self._heartbeat(sim)]
                for message in _batches(items, most):
                    yield message
                await asyncio.sleep(0)
            # Heartbeats go out in slices so that each worker beats every `heartbeat` seconds: at
            # 10,000 workers beating every 2 s, 50 every 10 ms.
            loop = asyncio.get_running_loop()
            tick = 0.01
            per_tick = max(1, round(len(workers) * tick / self.heartbeat))
            cursor = 0
            next_tick = loop.time() + tick
            while True:
                try:
                    data = await asyncio.wait_for(queue.get(), max(0.0, next_tick - loop.time()))
                except TimeoutError:
                    beats = []
                    for _ in range(per_tick):
                        beats.append(self._heartbeat(workers[cursor]))
                        cursor = (cursor + 1) % len(workers)
                    for message in _batches(beats, most):
                        yield message
                    next_tick += tick
                else:
                    ready = [data]
                    while len(ready) < most and not queue.empty():
                        ready.append(queue.get_nowait())
                    for message in _batches(ready, most):
                        yield message
        finally:
            self._followers.discard(queue)


def _batches(items: list[bytes], most: int) -> Iterator[bytes]:
    """Serialized FollowResponses as messages of up to `most` of them (and about a MiB): one
    alone as itself, several as the repeated field `batch` (5), encoded by hand."""
    i = 0
    while i < len(items):
        group = [items[i]]
        size = len(items[i])
        i += 1
        while i < len(items) and len(group) < most and size + len(items[i]) <= BATCH_BYTES:
            group.append(items[i])
            size += len(items[i])
            i += 1
        if len(group) == 1:
            yield group[0]
        else:
            yield b"".join(_BATCH_TAG + _varint(len(d)) + d for d in group)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _identity(data: bytes) -> bytes:
    return data


async def serve(fleet: Fleet) -> tuple[grpc.aio.Server, grpc.aio.Server, str]:
    """Serve the registry and the worker, each on its own port; (registry, worker, the
    registry's address). Every worker's address is the worker server's."""
    registry = grpc.aio.server()
    registry.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                r.DESCRIPTOR.services_by_name["RegistryService"].full_name,
                {
                    "Follow": grpc.unary_stream_rpc_method_handler(
                        fleet.Follow,
                        request_deserializer=_identity,
                        response_serializer=_identity,
                    )
                },
            ),
        )
    )
    reg_port = registry.add_insecure_port("127.0.0.1:0")
    worker = grpc.aio.server()
    worker.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                w.DESCRIPTOR.services_by_name["WorkerService"].full_name,
                {
                    "CreateMachine": grpc.unary_unary_rpc_method_handler(
                        fleet.CreateMachine,
                        request_deserializer=w.CreateMachineRequest.FromString,
                        response_serializer=w.CreateMachineResponse.SerializeToString,
                    ),
                    "GetMachine": grpc.unary_unary_rpc_method_handler(
                        fleet.GetMachine,
                        request_deserializer=w.GetMachineRequest.FromString,
                        response_serializer=w.GetMachineResponse.SerializeToString,
                    ),
                },
            ),
        )
    )
    worker_port = worker.add_insecure_port("127.0.0.1:0")
    await registry.start()
    await worker.start()
    fleet.address = f"127.0.0.1:{worker_port}"
    for sim in fleet.workers.values():
        sim.info.address = fleet.address
    return registry, worker, f"127.0.0.1:{reg_port}"


async def _main(workers: int, machines_each: int, heartbeat: float) -> None:
    fleet = Fleet(workers, machines_each, heartbeat)
    registry, worker, registry_address = await serve(fleet)
    print(json.dumps({"registry": registry_address, "worker": fleet.address}), flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # until the bench closes our stdin
    await registry.stop(None)
    await worker.stop(None)


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    asyncio.run(_main(int(args[0]), int(args[1]), float(args[2])))


if __name__ == "__main__":
    main()
