"""The process driver against real processes, and the fake driver's contract.

Nothing here sleeps to let time pass: tests wait on conditions (on_exit, a file appearing) with
deadlines. cgroup tests skip, with the reason, where cgroup v1 controllers are not writable.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import json
import os
import pwd
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import structlog

from flyd.drivers.base import Driver, ExitStatus, Handle, Limits, ProcessSpec
from flyd.drivers.process import ProcessDriver
from flyd.drivers.spares import SPARES
from flyd.errors import CorruptLog, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from flyd.fakes import FakeDriver, FakeHost, FakeScript
from runtime.clock import ManualClock

CGROUP_ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("memory", "cpu", "pids")
PATH = "/usr/local/bin:/usr/bin:/bin"
DEADLINE = 10.0
LIMITS = Limits(cpu_millicores=500, memory_mib=256, pids=256)


def _cgroups_unavailable() -> str | None:
    """Why cgroup v1 tests cannot run here, or None."""
    probe = f"nonomad-probe-{uuid.uuid4().hex[:8]}"
    for controller in CONTROLLERS:
        path = CGROUP_ROOT / controller / probe
        try:
            path.mkdir()
            path.rmdir()
        except OSError as e:
            return f"cgroup v1 {controller} controller not writable at {path.parent}: {e.strerror}"
    return None


CGROUPS_UNAVAILABLE = _cgroups_unavailable()


def needs_cgroups(test: Callable[..., object]) -> Callable[..., object]:
    skip = pytest.mark.skipif(CGROUPS_UNAVAILABLE is not None, reason=str(CGROUPS_UNAVAILABLE))
    return pytest.mark.cgroups(skip(test))


class Exits:
    """Collects on_exit calls; `wait` returns a machine's next one."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ExitStatus]] = []
        self._changed = asyncio.Event()

    def __call__(self, machine_id: str, handle: Handle, status: ExitStatus) -> None:
        self.calls.append((machine_id, status))
        self._changed.set()

    def of(self, machine_id: str) -> list[ExitStatus]:
        return [status for mid, status in self.calls if mid == machine_id]

    async def wait(self, machine_id: str, count: int = 1) -> ExitStatus:
        async def reached() -> None:
            while len(self.of(machine_id)) < count:
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(reached(), DEADLINE)
        return self.of(machine_id)[count - 1]


async def run_machine(driver: Driver, process: ProcessSpec) -> Handle:
    """Start and release: the machine runs its command."""
    handle = await driver.start(process)
    driver.release(process.machine_id)
    return handle


async def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Poll a condition until a deadline (for effects no callback announces)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while not condition():
        if loop.time() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


async def open_writer(fifo: Path) -> int:
    """Open a FIFO for writing once the machine has opened it for reading."""
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ENXIO:  # ENXIO: no reader yet
                raise
        await asyncio.sleep(0.005)


def file_sizes(log: Path) -> list[int | None]:
    """Sizes of machine.log, .1, .2, .3 (None: absent)."""
    paths = [log, *(Path(f"{log}.{k}") for k in (1, 2, 3))]
    return [p.stat().st_size if p.exists() else None for p in paths]


def gone(pid: int) -> bool:
    """The process no longer runs (or is a zombie nobody reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        return True
    return stat[stat.rindex(b")") + 2 :].startswith(b"Z")


def spec(machine_id: str, argv: list[str], cwd: Path, /, **changes: object) -> ProcessSpec:
    base = ProcessSpec(machine_id=machine_id, argv=argv, cwd=cwd, env={"PATH": PATH}, limits=LIMITS)
    return dataclasses.replace(base, **changes)


def sh(script: str) -> list[str]:
    return ["sh", "-c", script]


@pytest.fixture
def prefix() -> Iterator[str]:
    """A cgroup prefix of this test's own, removed with everything in it afterwards."""
    name = f"nonomad-test-{uuid.uuid4().hex[:12]}"
    yield name
    for controller in CONTROLLERS:
        parent = CGROUP_ROOT / controller / name
        if parent.is_dir():
            for cg in [p for p in parent.iterdir() if p.is_dir()] + [parent]:
                _remove_cgroup(cg)


def _remove_cgroup(cg: Path) -> None:
    for _ in range(200):
        with contextlib.suppress(OSError):
            for pid in (cg / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        try:
            cg.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
        time.sleep(0.01)  # killed processes take a moment to leave
    raise AssertionError(f"cgroup {cg} stays busy")


@pytest.fixture
def run_root(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture
async def make_driver(run_root: Path, prefix: str) -> AsyncIterator[Callable[..., ProcessDriver]]:
    """Makes drivers on one run root; afterwards kills and reaps any machine left running."""
    drivers: list[ProcessDriver] = []

    def make(on_exit: Callable[[str, Handle, ExitStatus], None], **kwargs: object) -> ProcessDriver:
        options: dict[str, object] = {"cgroup_prefix": prefix, **kwargs}
        driver = ProcessDriver(run_root, on_exit=on_exit, **options)  # type: ignore[arg-type]
        drivers.append(driver)
        return driver

    yield make
    for driver in drivers:
        await driver.close()
    _kill_and_reap(run_root)


def _kill_and_reap(run_root: Path) -> None:
    # Wrappers are this process's children (a real flyd restart leaves them to init): reap
    # them, or their zombies would keep their cgroups busy.
    for handle_file in run_root.glob("*/handle.json"):
        handle = Handle.from_dict(json.loads(handle_file.read_text()))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(handle.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(handle.pid, 0)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    path = tmp_path / "work"
    path.mkdir()
    return path


# -- values ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "text"),
    [
        (ExitStatus(3, None), "exited with code 3"),
        (ExitStatus(0, None), "exited with code 0"),
        (ExitStatus(None, signal.SIGTERM), "killed by SIGTERM"),
        (ExitStatus(None, signal.SIGKILL, oom_killed=True), "killed by SIGKILL (out of memory)"),
    ],
)
def test_exit_status_describes_itself(status: ExitStatus, text: str) -> None:
    assert status.describe() == text


def test_exit_status_has_exactly_one_cause() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        ExitStatus(1, signal.SIGKILL)


def test_handle_round_trips_and_rejects_garbage() -> None:
    handle = Handle(pid=42, start_time=123456, boot_id="b00t")
    assert Handle.from_dict(json.loads(json.dumps(handle.to_dict()))) == handle
    with pytest.raises(CorruptLog):
        Handle.from_dict({"pid": "42", "start_time": 1, "boot_id": "b"})


# -- running and exiting -----------------------------------------------------------------------


async def test_exit_code_and_output_are_reported(make_driver, workdir: Path) -> None:
    exits = Exits()
    driver = make_driver(exits)
    await run_machine(driver, spec("m1", sh("echo hi; echo oops >&2; exit 3"), workdir))

    status = await exits.wait("m1")

    assert status == ExitStatus(exit_code=3, signal=None)
    assert driver.read_logs("m1", 10) == ["hi", "oops"]
    assert driver.last_exit("m1") == status
    assert not driver.is_running("m1")
    await asyncio.sleep(0)
    assert exits.of("m1") == [status]  # exactly once


async def test_env_and_cwd_are_passed_exactly(make_driver, workdir: Path) -> None:
    exits = Exits()
    driver = make_driver(exits)
    env = {"PATH": PATH, "GREETING": "hello world"}
    await run_machine(driver, spec("m1", ["env"], workdir, env=env))
    await exits.wait("m1")
    assert sorted(driver.read_logs("m1", 10)) == sorted(f"{k}={v}" for k, v in env.items())

    await run_machine(driver, spec("m1", sh("pwd"), workdir))
    await exits.wait("m1", count=2)
    assert driver.read_logs("m1", 1) == [str(workdir)]


async def test_machine_sees_default_signal_dispositions(make_driver, workdir: Path) -> None:
    exits = Exits()
    driver = make_driver(exits)
    await run_machine(driver, spec("m1", ["cat", "/proc/self/status"], workdir))
    await exits.wait("m1")
    fields = dict(line.split(":\t", 1) for line in driver.read_logs("m1", 100) if ":\t" in line)
    # The wrapper's traps must not leak as ignored or caught signals. What this test process
    # itself ignores (some libraries ignore glibc-reserved signals) is inherited by design;
    # Python's own SIGPIPE and SIGXFSZ ignores are restored by subprocess.
    ours = dict(
        line.split(":\t", 1)
        for line in Path("/proc/self/status").read_text().splitlines()
        if ":\t" in line
    )
    restored = (1 << (signal.SIGPIPE - 1)) | (1 << (signal.SIGXFSZ - 1))
    assert int(fields["SigIgn"], 16) == int(ours["SigIgn"], 16) & ~restored
    assert int(fields["SigCgt"], 16) == 0


def spare_dirs(run_root: Path) -> list[Path]:
    """The spare run dirs (none while a driver has not made its first)."""
    spare = run_root / ".spare"
    return list(spare.iterdir()) if spare.is_dir() else []


def spares(run_root: Path, prefix: str) -> tuple[int, list[int]]:
    """How many spare run dirs there are, and spare cgroups per controller."""
    dirs = len(spare_dirs(run_root))
    cgroups = [len(list((CGROUP_ROOT / c / prefix).glob(".spare-*"))) for c in CONTROLLERS]
    return dirs, cgroups


async def test_first_starts_take_run_dirs_and_cgroups_made_ahead(
    make_driver, run_root: Path, prefix: str, workdir: Path
) -> None:
    exits = Exits()
    driver = make_driver(exits)
    await run_machine(driver, spec("m1", ["sleep", "1000"], workdir))  # none are ready yet
    full = (SPARES, [SPARES] * len(CONTROLLERS))
    await wait_until(lambda: spares(run_root, prefix) == full, "the spares to be made")

    await run_machine(driver, spec("m2", sh("echo hi; sleep 1000"), workdir))
    assert (run_root / "m2" / "status").is_dir()
    await wait_until(lambda: driver.read_logs("m2", 1) == ["hi"], "m2 to run")
    for controller in CONTROLLERS:
        procs = (CGROUP_ROOT / controller / prefix / "m2" / "cgroup.procs").read_text().split()
        assert procs  # the wrapper joined the cgroups it was given
    await wait_until(lambda: spares(run_root, prefix) == full, "the spare taken to be replaced")

    for mid in ("m1", "m2"):
        await driver.stop(mid, signal.SIGKILL, timeout=1)
    await driver.close()
    assert spares(run_root, prefix) == (0, [0] * len(CONTROLLERS))


async def test_a_new_driver_replaces_the_spares_a_dead_one_left(
    make_driver, run_root: Path, prefix: str, workdir: Path
) -> None:
    exits = Exits()
    first = make_driver(exits)
    await run_machine(first, spec("m1", ["sleep", "1000"], workdir))
    full = (SPARES, [SPARES] * len(CONTROLLERS))
    await wait_until(lambda: spares(run_root, prefix) == full, "the spares to be made")
    left = set((run_root / ".spare").iterdir())
    await first.stop("m1", signal.SIGKILL, timeout=1)
    # flyd dies (its driver never closes); the next one makes its own spares at its first start
    second = make_driver(exits)
    await run_machine(second, spec("m2", ["sleep", "1000"], workdir))
    # The dead driver's spares are swept in the new one's worker thread, its own made there too.
    await wait_until(
        lambda: spares(run_root, prefix) == full and not left & set(spare_dirs(run_root)),
        "the old spares to be swept and new ones made",
    )
    await second.stop("m2", signal.SIGKILL, timeout=1)


async def test_a_discarded_start_never_runs_and_says_so(make_driver, workdir: Path) -> None:
    exits = Exits()
    driver = make_driver(exits)
    marker = workdir / "ran"
    await driver.start(spec("m1", sh(f"touch {marker}; sleep 1000"), workdir))
    driver.discard("m1")  # flyd could not record the handle
    status = await exits.wait("m1")
    assert (status.released, status.describe()) == (False, "ended before it was released")
    assert not marker.exists()
    driver.release("m1")  # too late: a no-op
    assert not driver.is_running("m1")


async def test_start_holds_the_process_until_released(make_driver, workdir: Path) -> None:
    exits = Exits()
    first = make_driver(exits)
    marker = workdir / "ran"
    machine = spec("m1", sh(f"touch {marker}; sleep 1000"), workdir)
    handle = await first.start(machine)
    assert await first.start(machine) == handle  # the same process while watched
    assert not marker.exists()  # held: it has run nothing yet

    # flyd dies before releasing: the held process sees EOF and exits without running.
    await first.close()
    await wait_until(
        lambda: (
            not Path(f"/proc/{handle.pid}").exists()
            or Path(f"/proc/{handle.pid}/stat").read_text().split()[2] == "Z"
        ),
        "the held process to exit",
    )
    assert not marker.exists()

    second = make_driver(exits)
    # Its exit file says it was never released, so a later flyd does not count it as run.
    assert second.last_exit("m1") == ExitStatus(125, None, released=False)
    new = await second.start(machine)
    assert new != handle
    second.release("m1")
    await wait_until(marker.exists, "the released machine to run")
    await second.stop("m1", signal.SIGKILL, timeout=1)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"argv": []}, "argv"),
        ({"cwd": Path("relative")}, "cwd"),
        ({"cwd": Path("/nonexistent/dir")}, "cwd"),
        ({"machine_id": "../escape"}, "machine_id"),
        ({"limits": Limits(cpu_millicores=0, memory_mib=64)}, "limits.cpu_millicores"),
        ({"env": {"A=B": "c"}}, "env"),
    ],
)
async def test_start_rejects_bad_specs(make_driver, workdir: Path, changes, field) -> None:
    driver = make_driver(Exits())
    with pytest.raises(InvalidArgument) as raised:
        await run_machine(driver, spec("m1", ["true"], workdir, **changes))
    assert raised.value.field == field


async def test_operations_on_a_machine_without_process_say_why(make_driver, workdir) -> None:
    driver = make_driver(Exits())
    with pytest.raises(FailedPrecondition):
        await driver.stop("never", signal.SIGTERM, timeout=1)
    with pytest.raises(FailedPrecondition):
        await driver.signal("never", signal.SIGUSR1)
    with pytest.raises(NotFound):
        driver.read_logs("never", 10)


# -- stopping and signals ----------------------------------------------------------------------


async def test_stop_with_a_signal_the_machine_dies_of(make_driver, workdir: Path) -> None:
    exits = Exits()
    driver = make_driver(exits)
    await run_machine(driver, spec("m1", ["sleep", "1000"], workdir))

    status = await driver.stop("m1", signal.SIGTERM, timeout=DEADLINE)

    # The wrapper survived the group-wide SIGTERM and recorded how its child died.
    assert status == ExitStatus(exit_code=None, signal=signal.SIGTERM)
    assert driver.last_exit("m1") == status
    assert exits.of("m1") == [status]


async def test_stop_right_after_start_is_not_lost(make_driver, workdir: Path) -> None:
    driver = make_driver(Exits())
    for _ in range(20):  # the wrapper may still be setting up, or forking the machine
        await run_machine(driver, spec("m1", ["sleep", "1000"], workdir))
        status = await driver.stop("m1", signal.SIGTERM, timeout=DEADLINE)
        assert status == ExitStatus(exit_code=None, signal=signal.SIGTERM)


async def test_stop_with_a_signal_the_machine_handles(make_driver, workdir: Path) -> None:
    exits = Exits()
    driver = make_driver(exits)
    ready = workdir / "ready"
    await run_machine(
        driver, spec("m1", sh(f"trap 'exit 0' TERM; touch {ready}; sleep 1000 & wait"), workdir)
    )
    await wait_until(ready.exists, "the trap to be set")

    assert await driver.stop("m1", signal.SIGTERM, timeout=DEADLINE) == ExitStatus(0, None)


async def test_stop_escalates_to_sigkill_for_the_whole_tree(make_driver, workdir: Path) -> None:
    exits = Exits()
    driver = make_driver(exits)
    pids, ready = workdir / "pids", workdir / "ready"
    # The machine and its children ignore SIGTERM; one grandchild even leaves the process
    # group, which only the cgroup still holds.
    escapee = "setsid sleep 1000 & echo $! >> pids;" if driver.limits_enforced else ""
    script = (
        f"trap '' TERM; sleep 1000 & echo $! >> pids; {escapee} echo $$ >> pids; touch ready; wait"
    )
    handle = await run_machine(driver, spec("m1", sh(script), workdir))
    await wait_until(ready.exists, "the machine to start its children")
    tree = [handle.pid, *(int(p) for p in pids.read_text().split())]
    assert not any(gone(pid) for pid in tree)

    status = await driver.stop("m1", signal.SIGTERM, timeout=0.2)

    assert status == ExitStatus(exit_code=None, signal=signal.SIGKILL, oom_killed=False)
    await wait_until(lambda: all(gone(pid) for pid in tree), "the whole tree to be gone")
    assert exits.of("m1") == [status]


async def test_signal_reaches_the_main_process(make_driver, workdir: Path) -> None:
    exits = Exits()
    driver = make_driver(exits)
    got, ready = workdir / "got", workdir / "ready"
    script = f"trap 'echo usr1 > {got}; exit 0' USR1; touch {ready}; sleep 1000 & wait"
    await run_machine(driver, spec("m1", sh(script), workdir))
    await wait_until(ready.exists, "the trap to be set")

    await driver.signal("m1", signal.SIGUSR1)

    assert await exits.wait("m1") == ExitStatus(exit_code=0, signal=None)
    assert got.read_text() == "usr1\n"


# -- flyd restarts -----------------------------------------------------------------------------


async def test_reattach_after_flyd_restart(make_driver, workdir: Path) -> None:
    old_exits, exits = Exits(), Exits()
    old = make_driver(old_exits)
    handle = await run_machine(old, spec("m1", ["sleep", "1000"], workdir))
    await old.close()  # flyd goes away; the machine does not
    assert not gone(handle.pid)

    new = make_driver(exits)
    assert new.attach("m1", handle) is True
    assert new.is_running("m1")
    status = await new.stop("m1", signal.SIGTERM, timeout=DEADLINE)

    assert status == ExitStatus(exit_code=None, signal=signal.SIGTERM)
    assert exits.of("m1") == [status]
    assert old_exits.calls == []


async def test_exit_while_flyd_is_down_is_reported_on_attach(make_driver, workdir) -> None:
    old = make_driver(Exits())
    fifo = workdir / "fifo"
    os.mkfifo(fifo)
    handle = await run_machine(old, spec("m1", sh("read code < fifo; exit $code"), workdir))
    await old.close()

    # The machine exits with 7 while no driver watches it.
    fd = await asyncio.wait_for(open_writer(fifo), DEADLINE)
    os.write(fd, b"7\n")
    os.close(fd)
    exit_file = old._run_dirs.root / "m1" / "status" / "exit"
    await wait_until(exit_file.exists, "the machine to exit")
    # The wrapper writes the exit file, then exits: wait for that too (it is our zombie).
    await wait_until(lambda: gone(handle.pid), "the wrapper to exit")

    exits = Exits()
    new = make_driver(exits)
    assert new.attach("m1", handle) is False
    assert await exits.wait("m1") == ExitStatus(exit_code=7, signal=None)
    assert new.attach("m1", handle) is False
    await asyncio.sleep(0)
    assert len(exits.of("m1")) == 1  # reported once, however often flyd asks


async def test_recycled_pid_is_not_mistaken_for_the_machine(make_driver, workdir) -> None:
    old = make_driver(Exits())
    handle = await run_machine(old, spec("m1", ["sleep", "1000"], workdir))
    await old.close()

    exits = Exits()
    new = make_driver(exits)
    # Same pid, but another process (different start time), or the host rebooted.
    assert new.attach("m1", dataclasses.replace(handle, start_time=handle.start_time + 1)) is False
    assert await exits.wait("m1") == ExitStatus(exit_code=None, signal=signal.SIGKILL)
    assert new.attach("m2", dataclasses.replace(handle, boot_id="another-boot")) is False
    assert not new.is_running("m1")


# -- cgroups -----------------------------------------------------------------------------------


@needs_cgroups
async def test_memory_limit_oom_kills(make_driver, workdir: Path) -> None:
    exits = Exits()
    driver = make_driver(exits)
    assert driver.limits_enforced
    hog = [sys.executable, "-c", "b = b'x' * (200 << 20)"]
    await run_machine(driver, spec("m1", hog, workdir, limits=Limits(500, memory_mib=64)))

    status = await exits.wait("m1")

    assert status == ExitStatus(exit_code=None, signal=signal.SIGKILL, oom_killed=True)
    assert status.describe() == "killed by SIGKILL (out of memory)"
    assert driver.last_exit("m1") == status


@needs_cgroups
async def test_pids_limit_and_leftovers_killed_on_exit(make_driver, workdir, prefix) -> None:
    exits = Exits()
    driver = make_driver(exits)
    forker = (
        "import os, signal\n"
        "n = 0\n"
        "for _ in range(20):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        "        signal.pause()\n"
        "    n += 1\n"
        "print('forked', n)\n"
    )
    await run_machine(
        driver, spec("m1", [sys.executable, "-c", forker], workdir, limits=Limits(500, 256, pids=5))
    )

    assert await exits.wait("m1") == ExitStatus(exit_code=0, signal=None)
    # 5 pids: the wrapper, python, and 3 children.
    assert driver.read_logs("m1", 1) == ["forked 3"]
    # The children outlived the machine's main process; the driver killed them.
    procs = CGROUP_ROOT / "pids" / prefix / "m1" / "cgroup.procs"
    await wait_until(lambda: procs.read_text() == "", "the leftover children to be killed")


@needs_cgroups
async def test_cpu_and_memory_limits_are_written(make_driver, workdir: Path, prefix) -> None:
    driver = make_driver(Exits())
    await run_machine(
        driver, spec("m1", ["sleep", "1000"], workdir, limits=Limits(250, 96, pids=10))
    )
    cg = {c: CGROUP_ROOT / c / prefix / "m1" for c in CONTROLLERS}
    assert (cg["cpu"] / "cpu.cfs_quota_us").read_text() == "25000\n"
    assert (cg["cpu"] / "cpu.cfs_period_us").read_text() == "100000\n"
    assert int((cg["memory"] / "memory.limit_in_bytes").read_text()) == 96 << 20
    assert (cg["pids"] / "pids.max").read_text() == "10\n"
    await driver.stop("m1", signal.SIGKILL, timeout=1)

    await driver.cleanup("m1")
    assert not any(path.exists() for path in cg.values())
    assert not (driver._run_dirs.root / "m1").exists()


async def test_without_cgroups_machines_run_with_one_warning(run_root, workdir, tmp_path) -> None:
    exits = Exits()
    with structlog.testing.capture_logs() as logs:
        driver = ProcessDriver(run_root, on_exit=exits, cgroup_root=tmp_path / "no-cgroups")
    try:
        assert driver.limits_enforced is False
        warnings = [e for e in logs if e["log_level"] == "warning"]
        assert len(warnings) == 1
        assert warnings[0]["event"] == "cgroup_limits_not_enforced"
        assert "no cgroup v1 memory controller" in warnings[0]["reason"]
        await run_machine(driver, spec("m1", sh("exit 0"), workdir))
        assert await exits.wait("m1") == ExitStatus(0, None)
    finally:
        await driver.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="running machines as another user needs root")
async def test_run_as_unprivileged_user(prefix: str) -> None:
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user named nobody")
    base = Path(tempfile.mkdtemp(prefix="nonomad-test-"))  # pytest's tmp dirs are 0700
    os.chmod(base, 0o711)
    exits = Exits()
    driver = ProcessDriver(base / "run", on_exit=exits, cgroup_prefix=prefix, run_as="nobody")
    try:
        await run_machine(driver, spec("m1", sh("id -u; id -G"), base))
        status = await exits.wait("m1")
        logs = driver.read_logs("m1", 10)
        assert status == ExitStatus(0, None), logs  # 125: it could not join its cgroups
        assert logs == [str(nobody.pw_uid), str(nobody.pw_gid)]  # none of flyd's groups
    finally:
        await driver.close()
        shutil.rmtree(base)


# -- logs --------------------------------------------------------------------------------------


async def test_log_rotation_keeps_files_bounded(make_driver, workdir: Path) -> None:
    exits = Exits()
    driver = make_driver(exits, max_log_bytes=1000, log_backups=2)
    log = driver._run_dirs.root / "m1" / "machine.log"
    for run in range(4):
        # Each run prints 30 numbered lines of 99 bytes.
        script = (
            f'i=0; while [ $i -lt 30 ]; do printf "run{run}-%02d-%090d\\n" $i 0; i=$((i+1)); done'
        )
        await run_machine(driver, spec("m1", sh(script), workdir))
        await exits.wait("m1", count=run + 1)
        driver.rotate_logs()

        current, first, second, third = file_sizes(log)
        assert current == 0
        assert first is not None
        assert first <= 1000
        assert (second is None) if run == 0 else (second is not None and second <= 1000)
        assert third is None

    # 99-byte lines: each rotated file holds the last 10 lines of a run.
    tail = driver.read_logs("m1", 12)  # spans machine.log.2 and machine.log.1
    assert [line[:7] for line in tail] == ["run2-28", "run2-29"] + [
        f"run3-{i}" for i in range(20, 30)
    ]


async def test_follow_logs_yields_new_lines_across_rotation(make_driver, workdir: Path) -> None:
    exits = Exits()
    driver = make_driver(exits, max_log_bytes=4, log_backups=1)
    fifo = workdir / "fifo"
    os.mkfifo(fifo)
    await run_machine(driver, spec("m1", ["cat", str(fifo)], workdir))
    shutdown = asyncio.Event()
    lines = driver.follow_logs("m1", shutdown=shutdown, poll_interval=0.005)
    log = driver._run_dirs.root / "m1" / "machine.log"

    fd = await asyncio.wait_for(open_writer(fifo), DEADLINE)
    try:
        os.write(fd, b"one\n")
        assert await asyncio.wait_for(anext(lines), DEADLINE) == "one"

        # The follower is not polling while "two" is written and the log rotated under it.
        os.write(fd, b"two\n")
        await wait_until(lambda: log.stat().st_size == 8, "cat to copy the line")
        driver.rotate_logs()
        assert log.stat().st_size == 0
        os.write(fd, b"three\n")
        assert await asyncio.wait_for(anext(lines), DEADLINE) == "two"
        assert await asyncio.wait_for(anext(lines), DEADLINE) == "three"
    finally:
        os.close(fd)
    assert await exits.wait("m1") == ExitStatus(0, None)

    shutdown.set()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(lines), DEADLINE)


# -- the fake ----------------------------------------------------------------------------------


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
    assert fake.read_logs("m1", 5) == ["before", "after"]
    shutdown.set()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(lines), DEADLINE)
