"""The driver suite: every test runs against the process driver and the OCI driver alike.

Real processes and containers, a run root and cgroups of the test's own. Nothing here sleeps
to let time pass: tests wait on conditions (on_exit, a line in the log, a file appearing) with
deadlines. cgroup tests skip, with the reason, where cgroup v1 controllers are not writable;
OCI runs skip where crun cannot run. What only one driver does is in test_driver_process.py
and test_sandbox.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import socket
import uuid
from pathlib import Path

import pytest

from flyd.drivers.base import ExitStatus, Handle, Limits, PortMapping
from flyd.drivers.cgroups import cpu_shares
from flyd.drivers.spares import SPARES
from model.errors import CorruptLog, FailedPrecondition, InvalidArgument, NotFound
from tests import host_ports
from tests.flyd.driver_support import (
    CGROUP_ROOT,
    CONTROLLERS,
    DEADLINE,
    PATH,
    Exits,
    cgroup_pids,
    gone,
    log_lines,
    logged,
    machine_wrote,
    needs_cgroups,
    pids_running,
    run_machine,
    sh,
    spec,
    wait_until,
)

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


async def test_exit_code_and_output_are_reported(make_driver, image: Path) -> None:
    exits = Exits()
    driver = make_driver(exits)
    await run_machine(driver, spec("m1", sh("echo hi; echo oops >&2; exit 3"), image))

    status = await exits.wait("m1")

    assert status == ExitStatus(exit_code=3, signal=None)
    assert log_lines(driver, "m1", 10) == ["hi", "oops"]
    assert driver.last_exit("m1") == status
    assert not driver.is_running("m1")
    await asyncio.sleep(0)
    assert exits.of("m1") == [status]  # exactly once


async def test_env_workdir_and_port_are_passed_exactly(make_driver, image: Path) -> None:
    exits = Exits()
    driver = make_driver(exits)
    (image / "srv").mkdir()
    env = {"PATH": PATH, "GREETING": "hello world"}
    (host_port,) = host_ports.block(1)
    port = PortMapping(host_port=host_port, internal_port=8080)
    await run_machine(driver, spec("m1", ["env"], image, env=env, ports=(port,)))
    await exits.wait("m1")
    # The port a service listens on: the host's own, or its own port in its own namespace.
    listen = "8080" if driver.name == "oci" else str(host_port)
    expected = {**env, "PORT": listen, "PORT_8080": listen}
    if driver.name == "oci":
        expected["HOME"] = "/root"  # crun's, as any OCI runtime's, when the image sets none
    assert sorted(log_lines(driver, "m1", 10)) == sorted(f"{k}={v}" for k, v in expected.items())

    await run_machine(driver, spec("m1", sh("pwd"), image, workdir="/srv"))
    await exits.wait("m1", count=2)
    inside = "/srv" if driver.name == "oci" else str(image / "srv")
    assert log_lines(driver, "m1", 1) == [inside]


async def test_machine_sees_default_signal_dispositions(make_driver, image: Path) -> None:
    exits = Exits()
    driver = make_driver(exits)
    await run_machine(driver, spec("m1", ["cat", "/proc/self/status"], image))
    await exits.wait("m1")
    fields = dict(line.split(":\t", 1) for line in log_lines(driver, "m1", 100) if ":\t" in line)
    # The wrapper's traps must not leak as ignored or caught signals. What this test process
    # itself ignores (some libraries ignore glibc-reserved signals) may be inherited;
    # Python's own SIGPIPE and SIGXFSZ ignores are restored by subprocess.
    ours = dict(
        line.split(":\t", 1)
        for line in Path("/proc/self/status").read_text().splitlines()
        if ":\t" in line
    )
    restored = (1 << (signal.SIGPIPE - 1)) | (1 << (signal.SIGXFSZ - 1))
    assert int(fields["SigIgn"], 16) & ~(int(ours["SigIgn"], 16) & ~restored) == 0
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


@needs_cgroups
async def test_first_starts_take_run_dirs_and_cgroups_made_ahead(
    make_driver, run_root: Path, prefix: str, image: Path
) -> None:
    exits = Exits()
    driver = make_driver(exits)
    await run_machine(driver, spec("m1", ["sleep", "1000"], image))  # none are ready yet
    full = (SPARES, [SPARES] * len(CONTROLLERS))
    await wait_until(lambda: spares(run_root, prefix) == full, "the spares to be made")

    await run_machine(driver, spec("m2", sh("echo hi; sleep 1000"), image))
    assert (run_root / "m2" / "status").is_dir()
    await logged(driver, "m2", "hi")
    for controller in CONTROLLERS:
        procs = (CGROUP_ROOT / controller / prefix / "m2" / "cgroup.procs").read_text().split()
        assert procs  # the wrapper joined the cgroups it was given
    await wait_until(lambda: spares(run_root, prefix) == full, "the spare taken to be replaced")

    for mid in ("m1", "m2"):
        await driver.stop(mid, signal.SIGKILL, timeout=1)
    await driver.close()
    assert spares(run_root, prefix) == (0, [0] * len(CONTROLLERS))


@needs_cgroups
async def test_a_new_driver_replaces_the_spares_a_dead_one_left(
    make_driver, run_root: Path, prefix: str, image: Path
) -> None:
    exits = Exits()
    first = make_driver(exits)
    await run_machine(first, spec("m1", ["sleep", "1000"], image))
    full = (SPARES, [SPARES] * len(CONTROLLERS))
    await wait_until(lambda: spares(run_root, prefix) == full, "the spares to be made")
    left = set((run_root / ".spare").iterdir())
    await first.stop("m1", signal.SIGKILL, timeout=1)
    # flyd dies (its driver never closes); the next one makes its own spares at its first start
    second = make_driver(exits)
    await run_machine(second, spec("m2", ["sleep", "1000"], image))
    # The dead driver's spares are swept in the new one's worker thread, its own made there too.
    await wait_until(
        lambda: spares(run_root, prefix) == full and not left & set(spare_dirs(run_root)),
        "the old spares to be swept and new ones made",
    )
    await second.stop("m2", signal.SIGKILL, timeout=1)


async def test_a_discarded_start_never_runs_and_says_so(make_driver, image: Path) -> None:
    exits = Exits()
    driver = make_driver(exits)
    await driver.start(spec("m1", sh("touch ran; sleep 1000"), image))
    driver.discard("m1")  # flyd could not record the handle
    status = await exits.wait("m1")
    assert (status.released, status.describe()) == (False, "ended before it was released")
    assert not machine_wrote(driver, "m1", "ran")
    driver.release("m1")  # too late: a no-op
    assert not driver.is_running("m1")


async def test_start_holds_the_machine_until_released(make_driver, image: Path) -> None:
    exits = Exits()
    first = make_driver(exits)
    machine = spec("m1", sh("touch ran; sleep 1000"), image)
    handle = await first.start(machine)
    assert await first.start(machine) == handle  # the same process while watched
    assert not machine_wrote(first, "m1", "ran")  # held: it has run nothing yet

    # flyd dies before releasing: the held machine exits without running anything.
    await first.close()
    await wait_until(lambda: gone(handle.pid), "the held machine to end")
    assert not machine_wrote(first, "m1", "ran")

    second = make_driver(exits)
    # Its exit file says it was never released, so a later flyd does not count it as run.
    assert second.last_exit("m1") == ExitStatus(125, None, released=False)
    new = await second.start(machine)
    assert new != handle
    second.release("m1")
    await wait_until(lambda: machine_wrote(second, "m1", "ran"), "the released machine to run")
    await second.stop("m1", signal.SIGKILL, timeout=1)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"argv": []}, "argv"),
        ({"rootfs": Path("relative")}, "rootfs"),
        ({"rootfs": Path("/nonexistent/dir")}, "rootfs"),
        ({"workdir": "relative"}, "workdir"),
        ({"machine_id": "../escape"}, "machine_id"),
        ({"limits": Limits(cpu_millicores=0, memory_mib=64)}, "limits.cpu_millicores"),
        ({"env": {"A=B": "c"}}, "env"),
    ],
)
async def test_start_rejects_bad_specs(make_driver, image: Path, changes, field) -> None:
    driver = make_driver(Exits())
    with pytest.raises(InvalidArgument) as raised:
        await run_machine(driver, spec("m1", ["true"], image, **changes))
    assert raised.value.field == field


async def test_operations_on_a_machine_without_process_say_why(make_driver, image) -> None:
    driver = make_driver(Exits())
    with pytest.raises(FailedPrecondition):
        await driver.stop("never", signal.SIGTERM, timeout=1)
    with pytest.raises(FailedPrecondition):
        await driver.signal("never", signal.SIGUSR1)
    with pytest.raises(NotFound):
        log_lines(driver, "never", 10)


# -- stopping and signals ----------------------------------------------------------------------


async def test_stop_with_a_signal_the_machine_dies_of(make_driver, image: Path) -> None:
    exits = Exits()
    driver = make_driver(exits)
    await run_machine(driver, spec("m1", ["sleep", "1000"], image))

    status = await driver.stop("m1", signal.SIGTERM, timeout=DEADLINE)

    # The wrapper survived the SIGTERM and recorded how the machine died.
    assert status == ExitStatus(exit_code=None, signal=signal.SIGTERM)
    assert driver.last_exit("m1") == status
    assert exits.of("m1") == [status]


async def test_stop_right_after_start_is_not_lost(make_driver, image: Path) -> None:
    driver = make_driver(Exits())
    for _ in range(5):  # the wrapper may still be setting up, or starting the machine
        await run_machine(driver, spec("m1", ["sleep", "1000"], image))
        status = await driver.stop("m1", signal.SIGTERM, timeout=DEADLINE)
        assert status == ExitStatus(exit_code=None, signal=signal.SIGTERM)


async def test_stop_with_a_signal_the_machine_handles(make_driver, image: Path) -> None:
    driver = make_driver(Exits())
    await run_machine(
        driver, spec("m1", sh("trap 'exit 0' TERM; echo ready; sleep 1000 & wait"), image)
    )
    await logged(driver, "m1", "ready")

    assert await driver.stop("m1", signal.SIGTERM, timeout=DEADLINE) == ExitStatus(0, None)


@needs_cgroups
async def test_stop_escalates_to_sigkill_for_the_whole_tree(
    make_driver, image: Path, prefix: str
) -> None:
    exits = Exits()
    driver = make_driver(exits)
    # The machine and its children ignore SIGTERM; one grandchild even leaves the session.
    script = "trap '' TERM; sleep 1000 & setsid sleep 1000 & echo ready; wait"
    await run_machine(driver, spec("m1", sh(script), image))
    await logged(driver, "m1", "ready")
    await wait_until(lambda: len(cgroup_pids(prefix, "m1")) >= 4, "the children to start")
    tree = cgroup_pids(prefix, "m1")

    status = await driver.stop("m1", signal.SIGTERM, timeout=0.2)

    assert status == ExitStatus(exit_code=None, signal=signal.SIGKILL, oom_killed=False)
    await wait_until(lambda: all(gone(pid) for pid in tree), "the whole tree to be gone")
    assert exits.of("m1") == [status]


async def test_signal_reaches_the_main_process(make_driver, image: Path) -> None:
    exits = Exits()
    driver = make_driver(exits)
    script = "trap 'echo got usr1; exit 0' USR1; echo ready; sleep 1000 & wait"
    await run_machine(driver, spec("m1", sh(script), image))
    await logged(driver, "m1", "ready")

    await driver.signal("m1", signal.SIGUSR1)

    assert await exits.wait("m1") == ExitStatus(exit_code=0, signal=None)
    assert log_lines(driver, "m1", 1) == ["got usr1"]


# -- flyd restarts -----------------------------------------------------------------------------


async def test_reattach_after_flyd_restart(make_driver, image: Path) -> None:
    old_exits, exits = Exits(), Exits()
    old = make_driver(old_exits)
    handle = await run_machine(old, spec("m1", ["sleep", "1000"], image))
    await old.close()  # flyd goes away; the machine does not
    assert not gone(handle.pid)

    new = make_driver(exits)
    assert new.attach("m1", handle) is True
    assert new.is_running("m1")
    status = await new.stop("m1", signal.SIGTERM, timeout=DEADLINE)

    assert status == ExitStatus(exit_code=None, signal=signal.SIGTERM)
    assert exits.of("m1") == [status]
    assert old_exits.calls == []


async def test_exit_while_flyd_is_down_is_reported_on_attach(make_driver, image) -> None:
    old = make_driver(Exits())
    token = f"marker-{uuid.uuid4().hex[:8]}"
    script = f"trap 'exit 7' USR1; echo ready; sleep 1000 & wait # {token}"
    handle = await run_machine(old, spec("m1", sh(script), image))
    await logged(old, "m1", "ready")
    await old.close()

    # The machine exits with 7 while no driver watches it.
    shells = {pid for pid in pids_running(token) if comm(pid) == "sh" and pid != handle.pid}
    # Not a child of another (a fork of it that has not exec'd `sleep` yet).
    (main,) = [pid for pid in shells if ppid(pid) not in shells]
    os.kill(main, signal.SIGUSR1)
    await wait_until(lambda: gone(handle.pid), "the machine to exit")

    exits = Exits()
    new = make_driver(exits)
    assert new.attach("m1", handle) is False
    assert await exits.wait("m1") == ExitStatus(exit_code=7, signal=None)
    assert new.attach("m1", handle) is False
    await asyncio.sleep(0)
    assert len(exits.of("m1")) == 1  # reported once, however often flyd asks


async def test_recycled_pid_is_not_mistaken_for_the_machine(make_driver, image) -> None:
    old = make_driver(Exits())
    handle = await run_machine(old, spec("m1", ["sleep", "1000"], image))
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
async def test_memory_limit_oom_kills(make_driver, image: Path) -> None:
    exits = Exits()
    driver = make_driver(exits)
    assert driver.limits_enforced
    hog = ["python3", "-c", "b = b'x' * (200 << 20)"]
    await run_machine(driver, spec("m1", hog, image, limits=Limits(500, memory_mib=64)))

    status = await exits.wait("m1")

    assert status == ExitStatus(exit_code=None, signal=signal.SIGKILL, oom_killed=True)
    assert status.describe() == "killed by SIGKILL (out of memory)"
    assert driver.last_exit("m1") == status


FORKER = """\
import os, signal
n = 0
for _ in range(100):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        signal.pause()
        os._exit(0)
    n += 1
print('forked', n, flush=True)
"""


@needs_cgroups
async def test_pids_limit_and_leftovers_killed_on_exit(make_driver, image, prefix) -> None:
    exits = Exits()
    driver = make_driver(exits)
    limits = Limits(500, 256, pids=12)
    await run_machine(driver, spec("m1", ["python3", "-c", FORKER], image, limits=limits))

    assert await exits.wait("m1") == ExitStatus(exit_code=0, signal=None)
    # 12 pids for everything: the wrapper (and crun and the init) count, python forks the rest.
    (line,) = log_lines(driver, "m1", 1)
    assert line.startswith("forked ")
    assert 0 < int(line.split()[1]) < 12
    # The children outlived the machine's main process; the driver killed them.
    await wait_until(lambda: cgroup_pids(prefix, "m1") == [], "the leftover children to die")


@needs_cgroups
async def test_cpu_memory_and_pids_limits_are_written(make_driver, image: Path, prefix) -> None:
    driver = make_driver(Exits())
    await run_machine(driver, spec("m1", ["sleep", "1000"], image, limits=Limits(250, 96, pids=10)))
    cg = {c: CGROUP_ROOT / c / prefix / "m1" for c in CONTROLLERS}
    assert (cg["cpu"] / "cpu.cfs_quota_us").read_text() == "25000\n"
    assert (cg["cpu"] / "cpu.cfs_period_us").read_text() == "100000\n"
    assert (cg["cpu"] / "cpu.shares").read_text() == "256\n"  # a quarter core: 1024 / 4
    assert int((cg["memory"] / "memory.limit_in_bytes").read_text()) == 96 << 20
    assert (cg["pids"] / "pids.max").read_text() == "10\n"
    await driver.stop("m1", signal.SIGKILL, timeout=1)

    await driver.cleanup("m1")
    assert not any(path.exists() for path in cg.values())
    assert not (driver._run_dirs.root / "m1").exists()


@pytest.mark.parametrize(
    ("millicores", "shares"), [(1, 2), (250, 256), (1000, 1024), (64000, 65536)]
)
def test_cpu_shares_are_in_proportion_to_the_cpu_within_the_kernel_s_bounds(
    millicores: int, shares: int
) -> None:
    assert cpu_shares(millicores) == shares


# -- logs --------------------------------------------------------------------------------------


def comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def ppid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def file_sizes(log: Path) -> list[int | None]:
    """Sizes of machine.log, .1, .2, .3 (None: absent)."""
    paths = [log, *(Path(f"{log}.{k}") for k in (1, 2, 3))]
    return [p.stat().st_size if p.exists() else None for p in paths]


async def test_the_copier_keeps_each_log_file_to_its_bound_and_loses_no_line(
    make_driver, image: Path
) -> None:
    exits = Exits()
    driver = make_driver(exits, max_log_bytes=1000, log_backups=2)
    log = driver._run_dirs.root / "m1" / "machine.log"
    written = 0
    for run in range(4):
        # Each run prints 30 numbered lines of 99 bytes; the log goes on across runs.
        script = (
            f'i=0; while [ $i -lt 30 ]; do printf "run{run}-%02d-%090d\\n" $i 0; i=$((i+1)); done'
        )
        await run_machine(driver, spec("m1", sh(script), image))
        await exits.wait("m1", count=run + 1)  # reported once the copier wrote it all
        written += 30 * 99
        # Rotated every 1000 bytes of output, by rename: the oldest beyond two is gone.
        assert file_sizes(log) == [written % 1000, 1000, 1000, None]

    driver.rotate_logs()  # the safety net leaves a log its copier bounds alone
    assert file_sizes(log) == [880, 1000, 1000, None]
    # The last 29 lines span machine.log.2, .1 and machine.log; those a rotation cut in two
    # are read back whole.
    assert log_lines(driver, "m1", 29) == [f"run3-{i:02d}-{0:090d}" for i in range(1, 30)]


async def test_follow_logs_yields_new_lines_across_rotation(make_driver, image: Path) -> None:
    exits = Exits()
    driver = make_driver(exits, max_log_bytes=10, log_backups=1)
    # Each USR1 prints the next word; USR2 ends it.
    script = (
        "n=0; trap 'n=$((n+1)); set -- aaaa bbbb cccc; eval echo \\${$n}' USR1; "
        "trap 'exit 0' USR2; echo ready; while :; do sleep 1000 & wait; done"
    )
    await run_machine(driver, spec("m1", sh(script), image))
    await logged(driver, "m1", "ready")
    shutdown = asyncio.Event()
    lines = driver.follow_logs("m1", shutdown=shutdown, poll_interval=0.005)
    log = driver._run_dirs.root / "m1" / "machine.log"

    def files() -> tuple[bytes, bytes] | None:
        try:
            return log.read_bytes(), Path(f"{log}.1").read_bytes()
        except FileNotFoundError:  # between the copier's rename and its next write
            return None

    await driver.signal("m1", signal.SIGUSR1)
    assert await asyncio.wait_for(anext(lines), DEADLINE) == "aaaa"  # "ready\naaaa" filled one

    # The follower is not polling while "bbbb" and "cccc" are written and the log rotates
    # under it: the rest of the file it was reading is machine.log.1 now.
    await driver.signal("m1", signal.SIGUSR1)
    await logged(driver, "m1", "bbbb")
    await driver.signal("m1", signal.SIGUSR1)
    await wait_until(lambda: files() == (b"\n", b"\nbbbb\ncccc"), "the log to rotate again")
    assert await asyncio.wait_for(anext(lines), DEADLINE) == "bbbb"
    assert await asyncio.wait_for(anext(lines), DEADLINE) == "cccc"
    await driver.signal("m1", signal.SIGUSR2)
    assert await exits.wait("m1") == ExitStatus(0, None)

    shutdown.set()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(lines), DEADLINE)


# -- published ports ---------------------------------------------------------------------------

SERVE = """\
import os, socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(os.environ["PORT"])))
s.listen()
print("serving", flush=True)
while True:
    conn, _ = s.accept()
    conn.sendall(b"hello")
    conn.close()
"""


def taken(port: int) -> bool:
    """Whether binding the port on the host fails (SO_REUSEADDR or not)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


async def hello(port: int) -> bytes:
    """What the machine's service says once it serves (it may still be starting)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
                data = conn.recv(16)
                if data:
                    return data
        except OSError:
            pass
        assert loop.time() < deadline, f"port {port} never served"
        await asyncio.sleep(0.02)


async def test_a_published_port_is_held_for_its_machine_and_serves_only_it(
    make_driver, image: Path
) -> None:
    driver = make_driver(Exits())
    (port,) = driver.hold_ports("m1", host_ports.block(100), 1)
    published = (PortMapping(port, 8080),)
    await driver.publish("m1", published)
    # Not running, as a stopped standby: nobody else can have its port; nothing answers.
    assert taken(port)
    assert refused(port)
    for _ in range(2):  # a second run serves as the first did
        await run_machine(driver, spec("m1", ["python3", "-c", SERVE], image, ports=published))
        assert await hello(port) == b"hello"
        await driver.stop("m1", signal.SIGTERM, timeout=DEADLINE)
        assert taken(port)  # still its machine's
        assert refused(port)
    await driver.cleanup("m1")
    assert not taken(port)  # destroyed: let go
