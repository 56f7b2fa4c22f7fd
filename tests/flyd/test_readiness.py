"""Ready means ready: flyd's readiness condition of each machine, on a fake host and clock.

The probes are scripted (`Probes`): each check or port answers what the test says. The real
probes against real processes are in tests/cli/test_ready.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from google.protobuf.duration_pb2 import Duration

from flyd import conditions
from flyd.drivers.base import ExitStatus
from flyd.readiness import NO_SERVICES, Readiness, probe_host
from flyd.settings import CapacitySettings
from flyd.store import MemoryMachineLog
from flyd.v1 import machine_pb2 as pb
from model.checks import CheckSpec
from model.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from model.validate import DEFAULT_DISK_MIB
from runtime.clock import ManualClock
from tests.flyd.driver_support import host_address
from tests.flyd.support import (
    DEADLINE,
    STARTED,
    Flyd,
    Node,
    config,
    until,
)

GRACE = 10.0
RESTARTING = pb.MACHINE_STATE_RESTARTING
FAILED = pb.MACHINE_STATE_FAILED


class Probes:
    """Scripted probes: what each check answers (by internal port), None meaning it passes."""

    def __init__(self) -> None:
        self.answers: dict[int, str | None] = {}
        self.calls = 0

    async def __call__(self, check: CheckSpec) -> str | None:
        self.calls += 1
        assert check.host == "127.0.0.1"
        return self.answers.get(check.internal_port, "nothing listening")


@contextlib.asynccontextmanager
async def running(node: Node, **boot_args: Any) -> AsyncIterator[tuple[Flyd, ManualClock, Probes]]:
    """A recovered flyd on a fake host whose readiness loop runs with scripted probes."""
    clock = node.clock
    flyd = node.boot(store=MemoryMachineLog(), recover=False, **boot_args)
    probes = Probes()
    worker = flyd.worker
    worker.readiness = Readiness(
        rows=worker.rows,
        runner=worker.runner,
        clock=clock,
        grace=GRACE,
        settle=1.0,
        probe=probes,
    )
    worker.recover()
    shutdown = asyncio.Event()
    loop = asyncio.create_task(worker.readiness.run(shutdown))
    try:
        yield flyd, clock, probes
    finally:
        shutdown.set()
        await asyncio.wait_for(loop, DEADLINE)
        await flyd.kill()


@pytest.fixture
async def setup(node: Node) -> AsyncIterator[tuple[Flyd, ManualClock, Probes]]:
    async with running(node) as started:
        yield started


def ready_is(flyd: Flyd, mid: str, ready: bool, reason: str = "") -> Callable[[], bool]:
    def check() -> bool:
        row = flyd.worker.rows.get(mid)
        return (
            row is not None
            and row.machine.ready.ready == ready
            and reason in row.machine.ready.reason
        )

    return check


async def eventually(done: Callable[[], bool]) -> None:
    """Return once `done()` holds (the loop and its probes run meanwhile); fail at DEADLINE."""
    end = asyncio.get_running_loop().time() + DEADLINE
    while not done():
        assert asyncio.get_running_loop().time() < end, "timed out"
        await asyncio.sleep(0.005)


async def advance_until(flyd: Flyd, clock: ManualClock, done: Callable[[], bool]) -> None:
    """Move the clock a second at a time (a real moment between) until `done()`."""
    async with asyncio.timeout(DEADLINE):
        while not done():
            clock.advance(1.0)
            with contextlib.suppress(TimeoutError):
                await until(flyd.worker, done, timeout=0.05)


async def create(flyd: Flyd, cfg: pb.MachineConfig, mid: str = "m1") -> pb.Machine:
    return await flyd.worker.create(
        machine_id=mid, name="", app="app", config=cfg, skip_launch=False
    )


async def test_a_port_that_never_accepts_says_so_and_a_wait_for_ready_fails(
    setup: tuple[Flyd, ManualClock, Probes],
) -> None:
    flyd, clock, probes = setup
    machine = await create(flyd, config(services=1))
    # Started at once, and says what it waits for.
    assert machine.state == STARTED
    assert not machine.ready.ready
    assert machine.ready.reason == "starting: waiting for port 8080 to accept connections"
    # Before the grace runs out, a wait says what the probes say now.
    await eventually(lambda: flyd.worker.readiness.detail("m1") != "")
    with pytest.raises(
        DeadlineExceeded, match=r"not ready after 0\.01s: nothing listening on 8080"
    ):
        await flyd.worker.wait("m1", STARTED, 0.01, ready=True)
    # Past the grace, the row says it: what every reader of the row sees.
    await advance_until(flyd, clock, ready_is(flyd, "m1", False, "after 10s"))
    assert flyd.worker.rows["m1"].machine.ready.reason == "nothing listening on 8080 after 10s"
    # The service comes up late: ready, and a wait for it returns.
    probes.answers[8080] = None
    await advance_until(flyd, clock, ready_is(flyd, "m1", True))
    waited = await flyd.worker.wait("m1", STARTED, 1.0, ready=True)
    assert waited.ready.ready
    assert waited.ready.reason == ""


async def test_a_failing_check_shows_its_reason_after_it_passed(
    setup: tuple[Flyd, ManualClock, Probes],
) -> None:
    flyd, clock, probes = setup
    cfg = config(services=1)
    cfg.checks.add(
        name="web", port=8080, http=pb.HttpCheck(path="/healthz"), interval=Duration(seconds=5)
    )
    probes.answers[8080] = None
    machine = await create(flyd, cfg)
    assert machine.ready.reason == "starting: waiting for check web"
    await until(flyd.worker, ready_is(flyd, "m1", True))
    # The check fails at its next interval: not ready at once (it was ready), with its words.
    probes.answers[8080] = "GET /healthz answered 500"
    await advance_until(flyd, clock, ready_is(flyd, "m1", False))
    assert flyd.worker.rows["m1"].machine.ready.reason == "check web: GET /healthz answered 500"
    with pytest.raises(DeadlineExceeded, match="check web: GET /healthz answered 500"):
        await flyd.worker.wait("m1", STARTED, 0.01, ready=True)


async def test_a_machine_with_nothing_to_probe_is_ready_once_it_keeps_running(
    setup: tuple[Flyd, ManualClock, Probes],
) -> None:
    flyd, clock, probes = setup
    machine = await create(flyd, config())
    assert machine.ready.reason == "starting: no services; ready once it keeps running"
    await advance_until(flyd, clock, ready_is(flyd, "m1", True))
    assert flyd.worker.rows["m1"].machine.ready.reason == NO_SERVICES
    assert probes.calls == 0


async def test_a_crash_loop_says_so_with_its_last_log_line_then_fails(
    setup: tuple[Flyd, ManualClock, Probes],
) -> None:
    flyd, clock, _ = setup
    await create(flyd, config(max_retries=2))
    for restarts in (1, 2):
        flyd.driver.write_log("m1", "Traceback (most recent call last):")
        flyd.driver.write_log("m1", "KeyError: 'PORT'")
        flyd.driver.exit("m1", ExitStatus(exit_code=1, signal=None))
        await until(flyd.worker, lambda: flyd.worker.rows["m1"].state == RESTARTING)
        row = flyd.worker.rows["m1"].machine
        s = "" if restarts == 1 else "s"
        assert row.ready.reason == (
            f"crash-looping: exit 1, {restarts} restart{s}; last log: KeyError: 'PORT'"
        )
        assert list(row.log_tail)[-1] == "KeyError: 'PORT'"
        with pytest.raises(DeadlineExceeded, match=r"is restarting, not ready .*crash-looping"):
            await flyd.worker.wait("m1", STARTED, 0.01, ready=True)
        # Back up after its backoff: still not ready, still says it crash-loops.
        await advance_until(flyd, clock, lambda: flyd.worker.rows["m1"].state == STARTED)
        assert flyd.worker.rows["m1"].machine.ready.reason.startswith(conditions.CRASH_LOOP)
    flyd.driver.write_log("m1", "KeyError: 'PORT'")
    flyd.driver.exit("m1", ExitStatus(exit_code=1, signal=None))
    await until(flyd.worker, lambda: flyd.worker.rows["m1"].state == FAILED)
    with pytest.raises(FailedPrecondition, match="failed; it will not be ready: failed: exited"):
        await flyd.worker.wait("m1", STARTED, 5.0, ready=True)
    assert flyd.worker.rows["m1"].machine.ready.reason.endswith("last log: KeyError: 'PORT'")


async def test_a_stopped_machine_has_no_condition(setup: tuple[Flyd, ManualClock, Probes]) -> None:
    flyd, _, _ = setup
    await create(flyd, config(services=1))
    await flyd.worker.stop("m1", None, 1.0)
    await until(flyd.worker, lambda: flyd.worker.rows["m1"].state == pb.MACHINE_STATE_STOPPED)
    assert not flyd.worker.rows["m1"].machine.HasField("ready")


@pytest.mark.parametrize("state", [pb.MACHINE_STATE_STOPPED, pb.MACHINE_STATE_DESTROYED])
async def test_ready_is_only_for_waiting_for_started(
    setup: tuple[Flyd, ManualClock, Probes], state: int
) -> None:
    flyd, _, _ = setup
    await create(flyd, config())
    seq = flyd.worker.store.last_seq()
    with pytest.raises(InvalidArgument, match="ready"):
        await flyd.worker.wait("m1", state, 1.0, ready=True)
    assert flyd.worker.store.last_seq() == seq  # changed nothing


async def test_a_change_to_one_machine_looks_at_that_machine_only(node: Node) -> None:
    # A worker with 1,000 ready machines, each checked every 5s.
    machines = 1000
    capacity = CapacitySettings(
        cpu_millicores=100 * (machines + 1),
        memory_mib=128 * (machines + 1),
        disk_mib=DEFAULT_DISK_MIB * (machines + 1),
        machines=machines + 1,
    )
    async with running(node, capacity=capacity, ports=range(20000, 21100)) as setup:
        flyd, clock, probes = setup
        readiness = flyd.worker.readiness
        cfg = config(services=1)
        cfg.checks.add(name="web", port=8080, tcp=pb.TcpCheck(), interval=Duration(seconds=5))
        probes.answers[8080] = None
        await asyncio.gather(*(create(flyd, cfg, f"m{i}") for i in range(machines)))
        rows = flyd.worker.rows
        await eventually(lambda: all(row.machine.ready.ready for row in rows.values()))
        assert probes.calls == machines
        await eventually(lambda: readiness.pending == 0)  # it looked at their last commits
        # Their 1,000 next rounds wait under one timer.
        assert clock.sleepers == 1
        examined, calls = readiness.examined, probes.calls
        # One machine stops and another starts: the loop looks at those two, probes the new one.
        await flyd.worker.stop("m7", None, 1.0)
        await until(flyd.worker, lambda: rows["m7"].state == pb.MACHINE_STATE_STOPPED)
        await create(flyd, cfg, "new")
        await eventually(ready_is(flyd, "new", True))
        await eventually(lambda: readiness.pending == 0)
        assert probes.calls == calls + 1
        # At most once per commit of theirs (stopping, stopped; created, ready), no other row.
        assert readiness.examined - examined <= 4, readiness.examined - examined
        # At the next interval every started machine is probed once, the stopped one not.
        clock.advance(5.0)
        await eventually(lambda: probes.calls == calls + 1 + machines)
        # Then again, under one timer again.
        await eventually(lambda: clock.sleepers == 1)
        clock.advance(5.0)
        await eventually(lambda: probes.calls == calls + 1 + 2 * machines)


def test_probes_go_to_addresses_of_this_host_only() -> None:
    """Where the machines' ports are, when that is an address of this host (an OCI worker
    binds them there alone); else loopback. Never beyond the host."""
    assert probe_host("127.0.0.2") == "127.0.0.2"
    assert probe_host("localhost") == "127.0.0.1"
    assert probe_host("10.0.0.1") == "127.0.0.1"  # (not an address of this host)
    assert probe_host("worker.example") == "127.0.0.1"
    own = host_address()
    if own is not None:
        assert probe_host(own) == own
    with pytest.raises(ValueError, match="addresses of this host"):
        Readiness(rows={}, runner=None, clock=ManualClock(), host="10.0.0.1")  # type: ignore[arg-type]
