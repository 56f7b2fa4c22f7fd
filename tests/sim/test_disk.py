"""The simulated disk: a batch is pending until its drawn sync time and lost if its node dies
first; a sync can stall or fail with EIO; what was synced is what a restarted flyd recovers.
Against both durable backends (the in-memory log and LMDB on tmpfs), with flyd's real group
commit and a real Worker on top."""

from __future__ import annotations

import asyncio
import errno
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from flyd import fsm
from flyd.commits import GroupCommit
from flyd.drivers.base import ExitStatus, Handle
from flyd.fakes import FakeDriver, FakeHost
from flyd.images.build import build_image
from flyd.images.cache import ImageCache
from flyd.settings import CapacitySettings
from flyd.store import NewRecord, RecordType
from flyd.v1 import machine_pb2 as pb
from flyd.worker import Identity, Worker
from model.errors import NotFound, Unavailable
from model.images.owners import PUBLIC
from model.images.source import ImageSource
from model.validate import DEFAULT_DISK_MIB
from sim.disk import DiskFaults, SimDisk
from sim.world import Node, World

TMPFS = Path("/dev/shm")


@pytest.fixture
def world() -> Iterator[World]:
    world = World(seed=11)
    yield world
    world.close()


@pytest.fixture(params=["memory", "lmdb"])
def disk(request: pytest.FixtureRequest, world: World) -> Iterator[SimDisk]:
    """The host's disk, over each durable backend (LMDB on tmpfs when there is one)."""
    if request.param == "memory":
        disk = SimDisk("w1", world.entropy.child("disk").rng(), world.entropy.child("epoch"))
        yield disk
        disk.crash()
        disk.release()  # (the writes a crash lost fail now, so their dead writers unwind)
        return
    root = TMPFS if TMPFS.is_dir() else None
    with tempfile.TemporaryDirectory(prefix="nonomad-sim-", dir=root) as tmp:
        disk = SimDisk(
            "w1",
            world.entropy.child("disk").rng(),
            world.entropy.child("epoch"),
            lmdb_dir=Path(tmp) / "log",
        )
        yield disk
        disk.crash()  # its LMDB environment is closed before the directory goes
        disk.release()


def record(n: int) -> NewRecord:
    return NewRecord(RecordType.MACHINE_CHANGE, f"body {n}".encode())


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"eio_p": 1.5}, "eio_p must be within 0..1"),
        ({"stall_p": -0.1}, "stall_p must be within 0..1"),
        ({"latency": (0.2, 0.1)}, "latency must be"),
        ({"stall": (-1.0, 1.0)}, "stall must be"),
    ],
)
def test_faults_out_of_range_are_refused_naming_the_field(fields: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=message):
        DiskFaults(**fields)


def test_a_batch_is_pending_until_synced_and_a_crash_loses_it(world: World, disk: SimDisk) -> None:
    disk.faults = DiskFaults(latency=(0.5, 0.5))
    node = world.add("flyd")
    commits = GroupCommit(disk.open_log(), disk.writer(node.loop))

    async def first() -> int:
        return await commits.submit([record(1)], {"m1": b"row 1"})

    assert world.run(node, first()) == 1
    assert world.now == 0.5
    assert disk.synced().rows == {"m1": b"row 1"}

    async def second() -> int:
        return await commits.submit([record(2)], {"m2": b"row 2"})

    node.spawn(second())
    world.run_for(0.25)
    assert disk.pending == 1  # handed to the disk, not synced
    world.kill("flyd")
    disk.crash()
    assert disk.pending == 0
    assert disk.stats.lost == 1
    # What the next flyd reads: the synced batch, not the lost one.
    log = disk.open_log()
    assert log.last_seq() == 1
    assert log.rows() == {"m1": b"row 1"}
    log.close()


def test_a_dead_nodes_handle_reaches_nothing(world: World, disk: SimDisk) -> None:
    log = disk.open_log()
    with pytest.raises(RuntimeError, match="open already"):
        disk.open_log()
    disk.crash()
    with pytest.raises(OSError, match="closed by a crash") as caught:
        log.commit([record(1)], {"m1": b"x"})
    assert caught.value.errno == errno.EBADF


def test_a_sync_that_fails_with_eio_fails_every_commit_of_its_batch_and_writes_nothing(
    world: World, disk: SimDisk
) -> None:
    disk.faults = DiskFaults(eio_p=1.0)
    node = world.add("flyd")
    commits = GroupCommit(disk.open_log(), disk.writer(node.loop))

    async def two() -> list[BaseException | int]:
        return await asyncio.gather(
            commits.submit([record(1)], {"m1": b"a"}),
            commits.submit([record(2)], {"m2": b"b"}),
            return_exceptions=True,
        )

    outcomes = world.run(node, two())
    assert all(isinstance(o, OSError) and o.errno == errno.EIO for o in outcomes), outcomes
    assert disk.stats.eio == 1
    assert disk.synced().rows == {}
    assert commits.assigned == 0
    disk.faults = DiskFaults()

    async def again() -> int:
        return await commits.submit([record(1)], {"m1": b"a"})

    assert world.run(node, again()) == 1  # the numbers were handed back: no gap


def test_a_stalled_sync_holds_its_commit_until_the_stall_ends(world: World, disk: SimDisk) -> None:
    disk.faults = DiskFaults(stall_p=1.0, stall=(5.0, 5.0))
    node = world.add("flyd")
    commits = GroupCommit(disk.open_log(), disk.writer(node.loop))

    async def commit() -> int:
        return await commits.submit([record(1)], {"m1": b"a"})

    done = node.spawn(commit())
    world.run_until(4.9)
    assert not done.done()
    assert disk.pending == 1
    world.run_until(5.1)
    assert done.result() == 1
    assert disk.stats.stalls == 1


# -- a real Worker on the simulated disk ----------------------------------------------------

CAPACITY = CapacitySettings(
    cpu_millicores=1000, memory_mib=1024, disk_mib=10 * DEFAULT_DISK_MIB, machines=10
)
CONFIG = pb.MachineConfig(image="app:v1", guest=pb.GuestConfig(cpu_millicores=100, memory_mib=64))


@pytest.fixture(scope="module")
def images_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sim-images")
    (root / "src").mkdir()
    (root / "src" / "app").write_text("#!/bin/sh\n")
    build_image(
        root / "src", root / "source", name="app", tag="v1", entrypoint=["app"], owners=PUBLIC
    )
    return root


@dataclass
class Host:
    """What outlives a flyd on one simulated host: its disk and its machines."""

    disk: SimDisk
    machines: FakeHost
    images: Path


def boot(world: World, host: Host, cache: Path) -> tuple[Node, Worker]:
    """A flyd on the host, as a new process: a node of its own, the log opened again."""
    node = world.add("flyd-w1")
    worker: Worker | None = None

    def on_exit(machine_id: str, handle: Handle, status: ExitStatus) -> None:
        if worker is not None:
            worker.on_exit(machine_id, handle, status)

    async def start() -> Worker:
        started = Worker(
            identity=Identity("w1", "ams", "sim:w1", {}, "boot"),
            store=host.disk.open_log(),
            driver=FakeDriver(on_exit=on_exit, host=host.machines),
            images=ImageCache(cache, ImageSource(host.images / "source"), max_bytes=1 << 30),
            capacity=CAPACITY,
            ports=range(20000, 20010),
            machine_host="127.0.0.1",
            clock=node.clock,
            policy=fsm.Policy(),
            monotonic=node.loop.time,
            entropy=node.entropy,
            commit_writer=host.disk.writer(node.loop),
        )
        started.recover()  # (on the node: what it resumes are the node's tasks)
        return started

    worker = world.run(node, start())
    return node, worker


def create(worker: Worker, machine_id: str):  # type: ignore[no-untyped-def]
    return worker.create(machine_id=machine_id, name="", app="a", config=CONFIG, skip_launch=True)


def test_a_flyd_killed_while_a_create_is_pending_on_disk_recovers_what_it_acknowledged(
    world: World, disk: SimDisk, images_root: Path, tmp_path: Path
) -> None:
    host = Host(disk, FakeHost(), images_root)
    node, worker = boot(world, host, tmp_path / "cache")
    acknowledged = world.run(node, create(worker, "w1-acked"))
    assert acknowledged.state == pb.MACHINE_STATE_CREATED
    # The next create's commit stalls on the disk; flyd dies meanwhile.
    disk.faults = DiskFaults(stall_p=1.0, stall=(30.0, 30.0))
    pending = node.spawn(create(worker, "w1-pending"))
    world.run_for(1.0)
    assert not pending.done()
    assert disk.pending == 1
    world.kill("flyd-w1")
    disk.crash()
    disk.faults = DiskFaults()

    node, worker = boot(world, host, tmp_path / "cache")
    assert sorted(worker.rows) == ["w1-acked"]
    assert worker.get("w1-acked").machine.state == pb.MACHINE_STATE_CREATED
    # The reservation of the lost create is gone with it: the worker has room for it again.
    again = world.run(node, create(worker, "w1-pending"))
    assert again.state == pb.MACHINE_STATE_CREATED


def test_a_create_whose_sync_fails_with_eio_leaves_no_machine_and_the_next_one_works(
    world: World, disk: SimDisk, images_root: Path, tmp_path: Path
) -> None:
    host = Host(disk, FakeHost(), images_root)
    node, worker = boot(world, host, tmp_path / "cache")
    disk.faults = DiskFaults(eio_p=1.0)
    with pytest.raises(OSError, match="input/output error"):
        world.run(node, create(worker, "w1-a"))
    assert "w1-a" not in worker.rows
    assert disk.synced().rows == {}
    disk.faults = DiskFaults()
    assert world.run(node, create(worker, "w1-b")).state == pb.MACHINE_STATE_CREATED
    assert sorted(disk.synced().rows) == ["w1-b"]


def run_once(seed: int, images_root: Path, cache: Path) -> tuple[str, list[str]]:
    """A run of `seed` from nothing (a new image cache: one left by an earlier run would
    spare this one a pull, and its steps)."""
    world = World(seed)
    try:
        disk = SimDisk("w1", world.entropy.child("disk").rng(), world.entropy.child("epoch"))
        disk.faults = DiskFaults(latency=(0.001, 0.5))
        node, worker = boot(world, Host(disk, FakeHost(), images_root), cache)

        async def many() -> list[str]:
            made = await asyncio.gather(
                *(
                    worker.create(name="", machine_id="", app="a", config=CONFIG, skip_launch=True)
                    for _ in range(5)
                )
            )
            return [m.id for m in made]

        ids = world.run(node, many())
        world.record("flyd-w1", f"epoch {disk.synced().seq} {sorted(disk.synced().rows)}")
        return world.trace_hash(), ids
    finally:
        world.close()


def test_the_same_seed_draws_the_same_ids_sync_times_and_trace(
    images_root: Path, tmp_path: Path
) -> None:
    first = run_once(5, images_root, tmp_path / "first")
    assert run_once(5, images_root, tmp_path / "again") == first
    assert run_once(6, images_root, tmp_path / "other")[1] != first[1]


def create_keyed(worker: Worker) -> Any:
    """A create of w1-k1 under key k1 (as flaps sends it: the id derived from the key)."""
    return worker.create(
        machine_id="w1-k1", name="", app="a", config=CONFIG, skip_launch=True,
        idempotency_key="k1",
    )  # fmt: skip


def stalled_create(
    world: World, disk: SimDisk, images_root: Path, cache: Path
) -> tuple[Node, Worker, asyncio.Task[Any]]:
    """A worker whose disk stalls every sync for 3 s, and a create of w1-k1 under way on it."""
    node, worker = boot(world, Host(disk, FakeHost(), images_root), cache)
    disk.faults = DiskFaults(stall_p=1.0, stall=(3.0, 3.0))
    return node, worker, node.spawn(create_keyed(worker))


def test_a_retry_told_of_a_create_keeps_it_when_the_first_caller_gives_up(
    world: World, disk: SimDisk, images_root: Path, tmp_path: Path
) -> None:
    """Found by the simulator (seed 3 of the first runs): a create under a key stalls on the
    disk, a retry under the same key waits for it and is answered with the machine, then the
    first caller gives up, and its roll back destroyed the machine the retry was told of."""
    node, worker, first = stalled_create(world, disk, images_root, tmp_path / "cache")
    world.run_for(0.5)
    retry = node.spawn(create_keyed(worker))
    world.run_for(0.5)
    first.cancel()  # its caller is gone: its deadline passed while the commit stalled
    disk.faults = DiskFaults()
    world.run_for(30.0)
    assert first.cancelled()
    assert retry.result().id == "w1-k1"
    assert worker.get("w1-k1").machine.state == pb.MACHINE_STATE_CREATED
    assert "w1-k1" in disk.synced().rows


def test_a_machine_being_rolled_back_is_answered_to_nobody(
    world: World, disk: SimDisk, images_root: Path, tmp_path: Path
) -> None:
    """Found by the simulator: flaps answers a create under a key with GetMachine of the
    key's machine; one whose maker gave up and that is being rolled back was answered, then
    destroyed. Now it is UNAVAILABLE (try again) until it is gone, then NOT_FOUND."""
    node, worker, first = stalled_create(world, disk, images_root, tmp_path / "cache")
    world.run_for(1.0)
    first.cancel()
    disk.faults = DiskFaults(stall_p=1.0, stall=(5.0, 5.0))  # the roll back's commits stall
    world.run_until(world.now + 2.5, lambda: "w1-k1" in worker._rolling_back)
    assert "w1-k1" in worker.rows
    with pytest.raises(Unavailable, match="being rolled back"):
        worker.answer("w1-k1")
    with pytest.raises(Unavailable, match="being rolled back"):
        world.run(node, create_keyed(worker))
    disk.faults = DiskFaults()
    world.run_for(30.0)
    with pytest.raises(NotFound):
        worker.answer("w1-k1")


def test_a_create_rolled_back_lets_a_retry_under_its_key_create_it_anew(
    world: World, disk: SimDisk, images_root: Path, tmp_path: Path
) -> None:
    """Nobody else was told of it: the abandoned create is rolled back, its key freed."""
    node, worker, first = stalled_create(world, disk, images_root, tmp_path / "cache")
    world.run_for(1.0)
    first.cancel()
    disk.faults = DiskFaults()
    world.run_for(30.0)
    assert "w1-k1" not in worker.rows
    assert "w1-k1" not in disk.synced().rows
    again = world.run(node, create_keyed(worker))
    assert again.id == "w1-k1"
    assert again.state == pb.MACHINE_STATE_CREATED
