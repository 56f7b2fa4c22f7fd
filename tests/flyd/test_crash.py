"""Crash injection: flyd dies at each commit of each operation, then restarts.

For every operation and every commit index k within it, the machine log lets the operation's
commits through until the k-th and then raises `Crash`: either right after the k-th commit
(it is durable, nothing after it happens) or right before it (the effects of the step before
happened, unrecorded). The test then restarts flyd the way a host would: the old driver goes
away (a held process dies with it), the LMDB store is reopened from its directory, a new
Worker and FakeDriver come up on the same FakeHost, and `recover()` resumes what was in
progress.

Whatever the crash point, the operation must complete, no machine may be lost or run twice,
the reservations must match the machines, and the log must have no gaps.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import pytest

from flyd import fsm
from flyd.drivers.base import ExitStatus
from flyd.v1 import machine_pb2 as pb
from model.images.source import ImageSource
from model.validate import guest_disk_mib
from runtime.clock import ManualClock
from tests.flyd.support import (
    DEADLINE,
    Crash,
    CrashingLog,
    Flyd,
    Node,
    config,
    image_source,
    log_changes,
    settled,
    until,
    until_past_backoffs,
)

S = pb.MachineState
CREATED = S.MACHINE_STATE_CREATED
STARTED = S.MACHINE_STATE_STARTED
STOPPED = S.MACHINE_STATE_STOPPED
RESTARTING = S.MACHINE_STATE_RESTARTING
DESTROYED = S.MACHINE_STATE_DESTROYED
FAILED = S.MACHINE_STATE_FAILED

# m0 runs beside every operation and must come through each crash untouched; b1..b3 are
# created together, their commits in one transaction of the log's writer.
CONFIGS = {
    "m0": config(cpu=200, memory=256, services=1),
    "m1": config(cpu=300, memory=128, services=1, restart=pb.RESTART_MODE_ON_FAILURE),
    **{f"b{i}": config(cpu=50, memory=32, services=1) for i in (1, 2, 3)},
}
BATCH = ["b1", "b2", "b3"]
# Longer than any restart backoff an operation here waits through.
LATER = 60.0
# What an update gives m1: the same size and service (so reservations and ports stay put),
# another command and environment.
UPDATED = pb.MachineConfig()
UPDATED.CopyFrom(CONFIGS["m1"])
UPDATED.cmd.append("v2")
UPDATED.env["GREETING"] = "v2"


class World:
    """What outlives flyd: its node (the host and its machines, the clock, the disk)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.clock = node.clock
        self.host = node.host
        self.flyds = node.booted
        # m1 as the operation found it
        self.m1_instance = ""
        self.m1_port = 0
        self.m1_was_running = False

    def boot(self) -> Flyd:
        """A flyd process: the store reopened from disk, a new image cache, driver and worker."""
        return self.node.boot(store=CrashingLog(self.node.open_log()), recover=False)

    def crashing_log(self, flyd: Flyd) -> CrashingLog:
        assert isinstance(flyd.store, CrashingLog)
        return flyd.store

    def signals(self) -> list[tuple[str, int]]:
        return [s for f in self.flyds for s in f.driver.signals]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> ImageSource:
    """One image source for the module's many worlds."""
    return image_source(tmp_path_factory.mktemp("images"))


@pytest.fixture
def world(node: Node) -> World:
    return World(node)


async def create(flyd: Flyd, machine_id: str) -> pb.Machine:
    return await flyd.worker.create(
        machine_id=machine_id,
        name="",
        app="web",
        config=CONFIGS[machine_id],
        skip_launch=False,
    )


# --- the operations --------------------------------------------------------------------------


async def create_and_start(flyd: Flyd, clock: ManualClock) -> None:
    await create(flyd, "m1")


async def stop(flyd: Flyd, clock: ManualClock) -> None:
    await flyd.worker.stop("m1", None, None)
    await until(flyd.worker, settled(flyd.worker, "m1", STOPPED))


async def restart(flyd: Flyd, clock: ManualClock) -> None:
    await flyd.worker.restart("m1", None, None)
    await until(flyd.worker, settled(flyd.worker, "m1", STARTED))


async def destroy_with_force(flyd: Flyd, clock: ManualClock) -> None:
    await flyd.worker.destroy("m1", force=True)
    await until(flyd.worker, settled(flyd.worker, "m1", DESTROYED))


async def send_signal(flyd: Flyd, clock: ManualClock) -> None:
    await flyd.worker.signal("m1", signal.SIGUSR1)


async def policy_restart(flyd: Flyd, clock: ManualClock) -> None:
    flyd.driver.exit("m1", ExitStatus(exit_code=1, signal=None))  # the machine crashes
    await flyd.worker.wait("m1", RESTARTING, DEADLINE)
    await until_past_backoffs(clock, settled(flyd.worker, "m1", STARTED))


async def update(flyd: Flyd, clock: ManualClock) -> None:
    await flyd.worker.update("m1", UPDATED, skip_launch=False)
    await until(flyd.worker, settled(flyd.worker, "m1", STARTED))


def runs_the_update(world: World, flyd: Flyd) -> None:
    """m1 runs the new config, in exactly one process: the one its row names."""
    row = flyd.worker.get("m1")
    assert row.machine.config == UPDATED
    assert [p.host_port for p in row.machine.ports] == [world.m1_port]
    assert row.machine.instance_id != world.m1_instance
    m1_starts = [spec for f in world.flyds for spec in f.driver.starts if spec.machine_id == "m1"]
    last = m1_starts[-1]  # the spec of the process m1 runs now
    assert (last.env["INSTANCE_ID"], last.env["GREETING"]) == (row.machine.instance_id, "v2")
    assert last.argv[-1] == "v2"
    assert world.host.spawned[-1][0] == "m1"
    assert dict(world.host.spawned[-1][1].handle.to_dict()) == row.handle
    if world.m1_was_running:  # the old process was stopped the old config's way
        assert ("m1", signal.SIGTERM) in world.signals()


@dataclass(frozen=True)
class Operation:
    act: Callable[[Flyd, ManualClock], Awaitable[None]]  # does it, and waits for its end
    commits: int  # how many commits it makes when nothing crashes
    final: int  # the state m1 ends in
    runs: int  # how many processes of m1 ever run its command, in all
    needs_m1: bool = True  # m1 is created and started before it
    prepare: Callable[[Flyd, ManualClock], Awaitable[None]] | None = None  # more setup
    check: Callable[[World, Flyd], None] | None = None  # more checks, once it is over


# A step that spawns is committed together with the spawned (still held) process, which that
# commit already declares started; the release is recorded lazily (with a later commit). So
# each spawn-and-release costs one commit.
OPERATIONS = {
    "create+start": Operation(create_and_start, 1, STARTED, 1, needs_m1=False),
    "stop": Operation(stop, 2, STOPPED, 1),
    "restart": Operation(restart, 2, STARTED, 2),
    "destroy --force": Operation(destroy_with_force, 3, DESTROYED, 1),
    "signal": Operation(send_signal, 2, STARTED, 1),
    "policy restart": Operation(policy_restart, 2, STARTED, 2),
    "update started": Operation(update, 2, STARTED, 2, check=runs_the_update),
    "update stopped": Operation(update, 1, STARTED, 2, prepare=stop, check=runs_the_update),
}


CRASH_POINTS = [
    pytest.param(op, k, True, id=f"{name}, dies after commit {k}")
    for name, op in OPERATIONS.items()
    for k in range(1, op.commits + 1)
] + [
    # Dying before commit 1 is an operation that never happened; later, the step before
    # has had its effects (spawned, released, killed, signalled, cleaned up) unrecorded.
    pytest.param(op, k, False, id=f"{name}, dies before commit {k}")
    for name, op in OPERATIONS.items()
    for k in range(2, op.commits + 1)
]


async def setup(world: World, flyd: Flyd, op: Operation) -> None:
    flyd.worker.recover()
    await create(flyd, "m0")
    if op.needs_m1:
        m1 = await create(flyd, "m1")
        world.m1_instance, world.m1_port = m1.instance_id, m1.ports[0].host_port
    if op.prepare is not None:
        await op.prepare(flyd, world.clock)
    m1_row = flyd.worker.rows.get("m1")
    world.m1_was_running = m1_row is not None and m1_row.running


async def run_or_crash(act: Awaitable[None], log: CrashingLog) -> bool:
    """Run `act` until it ends or flyd dies, in it or in a background task. True if flyd died."""
    task = asyncio.ensure_future(act)
    crashed = asyncio.ensure_future(log.crashed.wait())
    try:
        async with asyncio.timeout(DEADLINE):
            await asyncio.wait({task, crashed}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, crashed):
            t.cancel()
        await asyncio.wait({task, crashed})
    if task.cancelled() or isinstance(task.exception(), Crash):
        assert log.crashed.is_set()
        return True
    task.result()  # a real failure raises here
    return log.crashed.is_set()


def check_invariants(
    world: World, flyd: Flyd, expected: dict[str, int], runs: dict[str, int]
) -> None:
    w, host = flyd.worker, world.host
    # No machine is lost, and each has finished what it was doing.
    assert set(flyd.store.rows()) == set(w.rows) == set(expected)
    for mid, state in expected.items():
        row = w.rows[mid]
        assert (fsm.state_name(row.state), row.op) == (fsm.state_name(state), None), mid
        # A started machine runs exactly the process its row names; any other runs nothing.
        assert host.live_handle(mid) == (row.handle if state == STARTED else None), mid
        assert (row.handle is not None) == (state == STARTED), mid
    # None ran twice: each process that ran was one the operation meant to run, and no
    # driver released a process that had already been released.
    assert {mid: host.ran(mid) for mid in expected} == runs
    releases = [mid for f in world.flyds for mid in f.driver.released]
    assert {mid: releases.count(mid) for mid in expected} == runs
    # Reservations are exactly the machines that are not destroyed.
    live = [CONFIGS[mid] for mid, state in expected.items() if state != DESTROYED]
    assert w.reserved() == pb.Resources(
        cpu_millicores=sum(c.guest.cpu_millicores for c in live),
        memory_mib=sum(c.guest.memory_mib for c in live),
        disk_mib=sum(guest_disk_mib(c.guest) for c in live),  # what their disks are made at
        machines=len(live),
    )
    ports = [p.host_port for r in w.rows.values() if r.state != DESTROYED for p in r.machine.ports]
    assert len(ports) == len(set(ports)) == len(live)
    assert sum(img.refs for img in w.images.cached()) == len(live)
    # The log has no gaps, and each machine's last record is its row.
    last: dict[str, pb.Machine] = {}
    for change in log_changes(flyd.store):
        last[change.event.machine_id] = change.machine
    for mid in expected:
        raw = flyd.store.row(mid)
        assert raw is not None
        assert last[mid] == fsm.decode_row(raw).machine, mid


@pytest.mark.parametrize(("op", "k", "durable"), CRASH_POINTS)
async def test_flyd_dies_at_commit_k(world: World, op: Operation, k: int, durable: bool) -> None:
    flyd = world.boot()
    await setup(world, flyd, op)
    m0 = flyd.worker.get("m0").handle

    world.crashing_log(flyd).arm(k, durable=durable)
    assert await run_or_crash(op.act(flyd, world.clock), world.crashing_log(flyd))
    # flyd is dead: its tasks stop, its driver goes, its store closes.
    await flyd.kill()

    flyd = world.boot()
    flyd.worker.recover()
    # Whatever backoff it was in, or recovery put it in, is over.
    await until_past_backoffs(world.clock, settled(flyd.worker, "m1", op.final))

    check_invariants(world, flyd, {"m0": STARTED, "m1": op.final}, {"m0": 1, "m1": op.runs})
    assert flyd.worker.get("m0").handle == m0
    if op.check is not None:
        op.check(world, flyd)
    if op.act is send_signal:
        assert ("m1", signal.SIGUSR1) in world.signals()


@pytest.mark.parametrize("name", OPERATIONS)
async def test_the_table_counts_every_commit_of_each_operation(world: World, name: str) -> None:
    """The table above names every commit: without a crash each operation makes that many."""
    op = OPERATIONS[name]
    flyd = world.boot()
    await setup(world, flyd, op)
    log = world.crashing_log(flyd)
    log.arm(None)
    await op.act(flyd, world.clock)
    await until(flyd.worker, settled(flyd.worker, "m1", op.final))
    assert log.commits == op.commits
    check_invariants(world, flyd, {"m0": STARTED, "m1": op.final}, {"m0": 1, "m1": op.runs})
    if op.check is not None:
        op.check(world, flyd)


@pytest.mark.parametrize("name", OPERATIONS)
async def test_flyd_dies_before_a_lazy_step_is_committed(world: World, name: str) -> None:
    """The operation is over but the release of its process is not durable yet (it rides along
    with a later commit): flyd dies now. The machine is re-attached, not started again."""
    op = OPERATIONS[name]
    flyd = world.boot()
    await setup(world, flyd, op)
    await op.act(flyd, world.clock)
    await until(flyd.worker, settled(flyd.worker, "m1", op.final))
    lagging = {mid: fsm.decode_row(raw).op for mid, raw in flyd.store.rows().items()}
    await flyd.kill()

    flyd = world.boot()
    flyd.worker.recover()
    await until_past_backoffs(world.clock, settled(flyd.worker, "m1", op.final))
    check_invariants(world, flyd, {"m0": STARTED, "m1": op.final}, {"m0": 1, "m1": op.runs})
    if op.final == STARTED and op.act is not send_signal:  # it ended with a release
        m1_op = lagging["m1"]
        assert m1_op is not None
        assert m1_op.step == "release"
    # Once flushed, the durable rows are the ones in memory.
    await flyd.worker.flush()
    assert {mid: fsm.decode_row(raw) for mid, raw in flyd.store.rows().items()} == flyd.worker.rows


@pytest.mark.parametrize(("op", "k", "durable"), CRASH_POINTS)
async def test_flyd_dies_again_while_recovering(
    world: World, op: Operation, k: int, durable: bool
) -> None:
    """A second crash, right after the first commit of the recovery, changes nothing either."""
    flyd = world.boot()
    await setup(world, flyd, op)
    world.crashing_log(flyd).arm(k, durable=durable)
    assert await run_or_crash(op.act(flyd, world.clock), world.crashing_log(flyd))
    await flyd.kill()

    flyd = world.boot()
    log = world.crashing_log(flyd)
    log.arm(1)
    flyd.worker.recover()
    # Recovery may have nothing left to commit (the first crash came after the last commit).
    await run_or_crash(until_past_backoffs(world.clock, settled(flyd.worker, "m1", op.final)), log)
    await flyd.kill()

    flyd = world.boot()
    flyd.worker.recover()
    await until_past_backoffs(world.clock, settled(flyd.worker, "m1", op.final))
    check_invariants(world, flyd, {"m0": STARTED, "m1": op.final}, {"m0": 1, "m1": op.runs})
    if op.check is not None:
        op.check(world, flyd)


# --- stories -------------------------------------------------------------------------------


@pytest.mark.parametrize("skip_launch", [False, True])
async def test_a_create_that_dies_before_its_first_commit_leaves_nothing(
    world: World, skip_launch: bool
) -> None:
    """A create spawns (held) before its first commit: dying in between, the machine never
    existed, its process never ran, and nothing stays reserved."""
    flyd = world.boot()
    flyd.worker.recover()
    await create(flyd, "m0")
    log = world.crashing_log(flyd)
    log.arm(1, durable=False)
    act = flyd.worker.create(
        machine_id="m1", name="", app="web", config=CONFIGS["m1"], skip_launch=skip_launch
    )
    assert await run_or_crash(act, log)
    # the worker dies here, with m1's process (if any) spawned and held
    assert [mid for mid, _ in world.host.spawned].count("m1") == (0 if skip_launch else 1)
    await flyd.kill()

    flyd = world.boot()
    flyd.worker.recover()
    await until(flyd.worker, settled(flyd.worker, "m0", STARTED))
    check_invariants(world, flyd, {"m0": STARTED}, {"m0": 1})
    assert world.host.ran("m1") == 0
    assert world.host.live_handle("m1") is None


async def test_machines_that_exit_while_flyd_is_down(world: World) -> None:
    flyd = world.boot()
    flyd.worker.recover()
    await create(flyd, "m0")  # on-failure by default
    await create(flyd, "m1")
    await flyd.kill()
    # While no flyd watches, both machines end: m0 fails, m1 is done.
    world.host.exit("m0", ExitStatus(exit_code=2, signal=None))
    world.host.exit("m1", ExitStatus(exit_code=0, signal=None))

    flyd = world.boot()
    flyd.worker.recover()
    await until(flyd.worker, settled(flyd.worker, "m1", STOPPED))
    await flyd.worker.wait("m0", RESTARTING, DEADLINE)
    assert flyd.worker.get("m0").machine.last_exit.exit_code == 2
    await until_past_backoffs(world.clock, settled(flyd.worker, "m0", STARTED))
    check_invariants(world, flyd, {"m0": STARTED, "m1": STOPPED}, {"m0": 2, "m1": 1})


async def test_real_lmdb_closed_and_reopened_keeps_every_machine(world: World) -> None:
    flyd = world.boot()
    w = flyd.worker
    w.recover()
    await create(flyd, "m0")
    await create(flyd, "m1")
    for mid, cmd in {"m2": [], "m3": [], "m4": ["fake:start_error=broken"]}.items():
        await w.create(
            machine_id=mid,
            name="",
            app="web",
            config=config(*cmd, restart=pb.RESTART_MODE_NO),
            skip_launch=mid == "m2",
        )
    await w.stop("m1", None, None)
    await w.wait("m1", STOPPED, DEADLINE)
    await w.destroy("m3", force=True)
    await w.wait("m3", DESTROYED, DEADLINE)
    before = {mid: (row.state, row.handle) for mid, row in w.rows.items()}
    reserved, last_seq = w.reserved(), flyd.store.last_seq()
    await flyd.kill()  # closes the LMDB environment

    flyd = world.boot()
    assert flyd.worker.recover() == 0
    w = flyd.worker
    assert {mid: (row.state, row.handle) for mid, row in w.rows.items()} == before
    assert before["m2"][0] == CREATED
    assert before["m4"][0] == FAILED
    assert (w.reserved(), flyd.store.last_seq()) == (reserved, last_seq)
    assert world.host.live_handle("m0") == before["m0"][1]
    # The reopened log carries on where it was.
    await w.start("m2")
    assert log_changes(flyd.store)[-1].event.seq == last_seq + 2
    assert w.get("m2").state == STARTED


# --- several operations in one transaction ---------------------------------------------------


async def queue_a_batch(world: World, flyd: Flyd) -> tuple[asyncio.Future[pb.Machine], ...]:
    """m1's create is written while b1..b3's creates come in: theirs wait for the writer and
    go together in the next transaction. Returns the creates (m1's first), under way."""
    log, commits = world.crashing_log(flyd), flyd.worker.runner.commits
    gate = threading.Event()
    log.before_commit = lambda: gate.wait(DEADLINE)  # the writer (its own thread) waits here
    written = commits.batches
    m1 = asyncio.ensure_future(create(flyd, "m1"))
    await until_true(lambda: commits.batches == written + 1)  # m1's is being written
    batch = [asyncio.ensure_future(create(flyd, mid)) for mid in BATCH]
    await until_true(lambda: commits.queued == len(BATCH))
    # Nobody is answered before the transaction holding their commit is written.
    assert not any(t.done() for t in (m1, *batch))
    log.before_commit = None
    gate.set()
    return m1, *batch


async def until_true(done: Callable[[], bool]) -> None:
    async with asyncio.timeout(DEADLINE):
        while not done():  # noqa: ASYNC110 - the writer's queue announces nothing
            await asyncio.sleep(0.001)


async def test_concurrent_creates_share_a_transaction_and_are_answered_after_it(
    world: World,
) -> None:
    flyd = world.boot()
    flyd.worker.recover()
    await create(flyd, "m0")
    log = world.crashing_log(flyd)
    log.arm(None)
    made = await asyncio.gather(*await queue_a_batch(world, flyd))
    assert log.commits == 2  # m1's transaction, then b1..b3's
    assert [m.id for m in made] == ["m1", *BATCH]
    last = {c.event.machine_id for c in log_changes(flyd.store) if c.event.seq in log.batches[-1]}
    assert last == set(BATCH)
    expected = dict.fromkeys(["m0", "m1", *BATCH], STARTED)
    check_invariants(world, flyd, expected, dict.fromkeys(expected, 1))


@pytest.mark.parametrize("durable", [True, False], ids=["after", "before"])
async def test_flyd_dies_at_a_transaction_of_several_creates(world: World, durable: bool) -> None:
    """flyd dies right after (or just before) the transaction holding b1..b3's creates: none of
    their callers hears of a machine; after the restart all three exist and run once (or
    none ever ran), and m1's create, one transaction earlier, stands."""
    flyd = world.boot()
    flyd.worker.recover()
    await create(flyd, "m0")
    log = world.crashing_log(flyd)
    log.arm(2, durable=durable)
    m1, *batch = await queue_a_batch(world, flyd)
    assert (await m1).id == "m1"
    for task in batch:
        with pytest.raises(Crash):
            await task
    assert log.crashed.is_set()
    await flyd.kill()

    flyd = world.boot()
    flyd.worker.recover()
    survivors = ["m0", "m1", *(BATCH if durable else [])]
    for mid in survivors:
        await until_past_backoffs(world.clock, settled(flyd.worker, mid, STARTED))
    check_invariants(world, flyd, dict.fromkeys(survivors, STARTED), dict.fromkeys(survivors, 1))
    if not durable:
        assert all(world.host.ran(mid) == 0 for mid in BATCH)
