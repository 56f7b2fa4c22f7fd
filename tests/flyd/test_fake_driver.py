"""The fake driver keeps the real drivers' contract: scripted machines that outlive it."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from flyd.drivers.base import ExitStatus, LogTail
from flyd.fakes import FakeDriver, FakeHost, FakeScript
from model.errors import Unavailable
from runtime.clock import ManualClock
from tests.flyd.driver_support import DEADLINE, Exits, run_machine, spec


async def test_fake_driver_runs_scripted_machines() -> None:
    exits, clock = Exits(), ManualClock()
    fake = FakeDriver(on_exit=exits, host=FakeHost(clock))
    cwd = Path("/")

    await run_machine(fake, spec("m1", ["app", "fake:run_for=5", "fake:exit_code=3"], cwd))
    clock.advance(4.9)
    await asyncio.sleep(0)
    assert fake.is_running("m1")
    clock.advance(0.1)
    assert await exits.wait("m1") == ExitStatus(3, None)
    assert fake.last_exit("m1") == ExitStatus(3, None)

    with pytest.raises(Unavailable, match="no room"):
        await run_machine(fake, spec("m2", ["app", "fake:start_error=no room"], cwd))

    fake.script("m3", FakeScript(ignore_stop=True))
    await run_machine(fake, spec("m3", ["app"], cwd))
    await fake.signal("m3", signal.SIGUSR1)
    assert await fake.stop("m3", signal.SIGTERM, timeout=1) == ExitStatus(None, signal.SIGKILL)
    assert fake.signals == [("m3", signal.SIGUSR1), ("m3", signal.SIGTERM)]

    await run_machine(fake, spec("m4", ["app"], cwd))
    fake.exit("m4", ExitStatus(None, signal.SIGKILL, oom_killed=True))
    assert exits.of("m4") == [ExitStatus(None, signal.SIGKILL, oom_killed=True)]


async def test_fake_machines_outlive_the_driver() -> None:
    clock = ManualClock()
    host = FakeHost(clock)
    old = FakeDriver(on_exit=Exits(), host=host)
    running = await run_machine(old, spec("m1", ["app"], Path("/")))
    done = await run_machine(
        old, spec("m2", ["app", "fake:run_for=1", "fake:exit_code=7"], Path("/"))
    )
    await old.close()
    clock.advance(2)  # m2 exits while flyd is down
    await asyncio.sleep(0)

    exits = Exits()
    new = FakeDriver(on_exit=exits, host=host)
    assert new.attach("m1", running) is True
    assert new.attach("m2", done) is False
    assert await exits.wait("m2") == ExitStatus(7, None)
    assert await new.stop("m1", signal.SIGTERM, timeout=1) == ExitStatus(None, signal.SIGTERM)


async def test_fake_logs() -> None:
    fake = FakeDriver(on_exit=Exits())
    await run_machine(fake, spec("m1", ["app"], Path("/")))
    fake.write_log("m1", "before")
    shutdown = asyncio.Event()
    lines = fake.follow_logs("m1", shutdown=shutdown)
    fake.write_log("m1", "after")
    assert await asyncio.wait_for(anext(lines), DEADLINE) == "after"
    tail = await asyncio.to_thread(fake.read_logs, "m1", 5, 1 << 20)
    assert tail == LogTail(["before", "after"], follow_from=2)  # a line index, here
    shutdown.set()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(lines), DEADLINE)


@pytest.mark.parametrize(
    ("tail_lines", "max_bytes", "tail"),
    [
        (5, 1 << 20, LogTail(["one", "two", "three"], follow_from=3)),
        (2, 1 << 20, LogTail(["two", "three"], follow_from=3)),
        (5, 10, LogTail(["two", "three"], 4, 3)),  # "one\n" is left out
        (5, 9, LogTail(["three"], 8, 3)),
        (5, 3, LogTail([], 14, 3)),
        (0, 1 << 20, LogTail([], follow_from=3)),
    ],
)
async def test_fake_log_reads_keep_to_their_byte_budget(
    tail_lines: int, max_bytes: int, tail: LogTail
) -> None:
    fake = FakeDriver(on_exit=Exits())
    await run_machine(fake, spec("m1", ["app"], Path("/")))
    for line in ("one", "two", "three"):
        fake.write_log("m1", line)
    assert await asyncio.to_thread(fake.read_logs, "m1", tail_lines, max_bytes) == tail


async def test_a_fake_log_read_refuses_to_block_the_event_loop() -> None:
    # The real read blocks on the disk: called on the loop, every other call would wait.
    fake = FakeDriver(on_exit=Exits())
    await run_machine(fake, spec("m1", ["app"], Path("/")))
    with pytest.raises(RuntimeError, match="off the event loop"):
        fake.read_logs("m1", 5, 1 << 20)
