"""A machine's disk is a hard limit: real flyd processes with the OCI driver, real crun
machines writing into their rootfs, each on a filesystem of its own (`flyd.drivers.writable`).

A tenant that writes past its `guest.disk_mib` gets ENOSPC; its worker answers, another
machine writes, the host's filesystem holds at most what was reserved. flyd SIGKILLed in the
middle of a create or a destroy leaves no loop device, mount or disk file behind once it is
back. Skipped, with the reason, where crun cannot run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from flyd.drivers.writable import DISK_FILE
from flyd.images.build import build_image
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from flyd.v1 import worker_pb2_grpc
from model.images.owners import PUBLIC
from model.validate import DEFAULT_DISK_MIB, DISK_LABEL
from tests.flyd.driver_support import OCI_UNAVAILABLE, gone, loops_under
from tests.flyd.process_support import wait_state
from tests.harness import ServiceProcess

pytestmark = pytest.mark.skipif(
    OCI_UNAVAILABLE is not None, reason=f"crun cannot run here: {OCI_UNAVAILABLE}"
)

S = pb.MachineState
Stub = worker_pb2_grpc.WorkerServiceStub
DEADLINE = 30.0
MIB = 1 << 20
# What the tenant of attack 9 ran: 300 MiB into a 16 MiB disk, then says how it went.
FILL = (
    'dd if=/dev/zero of=/big bs=1M count=300 2>/tmp/dd.err; echo "dd $?"; '
    "grep -o 'No space left on device' /tmp/dd.err; sync; "
    "df -k / | tail -1 | awk '{print \"size_k\", $2}'; echo filled; exec sleep 1000"
)


@pytest.fixture(scope="module")
def image_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`disk:v1`: an image that names no base (the host lends its runtime: sh, dd, df)."""
    root = tmp_path_factory.mktemp("disk-images")
    src = tmp_path_factory.mktemp("disk-src")
    (src / "README").write_text("a machine that writes\n")
    build_image(src, root, name="disk", tag="v1", entrypoint=["sh"], owners=PUBLIC)
    return root


def config(script: str, disk_mib: int = 0) -> pb.MachineConfig:
    return pb.MachineConfig(
        image="disk:v1",
        guest=pb.GuestConfig(cpu_millicores=200, memory_mib=64, disk_mib=disk_mib),
        entrypoint=["sh", "-c", script],
        restart=pb.RestartPolicy(mode=pb.RESTART_MODE_NO),
    )


def machines_dir(tmp_path: Path) -> Path:
    return tmp_path / "flyd-w1" / "machines"


async def logs(stub: Stub, machine_id: str, until_line: str) -> list[str]:
    """The machine's output once it has printed `until_line`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while True:
        stream = stub.GetMachineLogs(
            w.GetMachineLogsRequest(machine_id=machine_id, tail_lines=100), timeout=DEADLINE
        )
        lines = [item.line async for item in stream]
        if until_line in lines:
            return lines
        assert loop.time() < deadline, f"{machine_id} never printed {until_line!r}: {lines}"
        await asyncio.sleep(0.05)


async def nothing_left(machines: Path, machine_id: str) -> None:
    """No run dir (so no disk file) of the machine, and no loop device bound to any disk
    file of the worker's: nothing has one mounted, in any mount namespace; and the host's
    mount table never had one."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while (machines / machine_id).exists() or loops_under(machines):
        assert loop.time() < deadline, (
            f"left behind: run dir {(machines / machine_id).exists()}, "
            f"loop devices {loops_under(machines)}"
        )
        await asyncio.sleep(0.02)
    host_mounts = Path("/proc/self/mounts").read_text()
    assert str(machines) not in host_mounts
    assert "/dev/loop" not in host_mounts


def host_bytes(root: Path, *, but: str = DISK_FILE) -> int:
    """What the files under `root` hold on the host's disk, less the disk files."""
    total = 0
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            if name != but:
                try:
                    total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
                except FileNotFoundError:
                    continue
    return total


async def test_a_machine_writing_past_its_disk_gets_enospc_and_its_worker_stays_healthy(
    flyd_factory: Callable[..., ServiceProcess], stub_for: Callable[[str], Stub], tmp_path: Path
) -> None:
    flyd = flyd_factory("--driver", "oci")
    stub = stub_for(flyd.address)
    machines = machines_dir(tmp_path)
    info = (await stub.GetCapacity(w.GetCapacityRequest(), timeout=DEADLINE)).worker
    assert info.labels[DISK_LABEL] == "limited"  # what a `machines run` looks at
    log_before = host_bytes(tmp_path / "flyd-w1")

    tenant = (
        await stub.CreateMachine(
            w.CreateMachineRequest(app="t", config=config(FILL, disk_mib=16)), timeout=DEADLINE
        )
    ).machine
    lines = await logs(stub, tenant.id, "filled")
    assert "dd 1" in lines  # dd failed...
    assert "No space left on device" in lines  # ... because its disk is full
    size_k = int(next(line for line in lines if line.startswith("size_k")).split()[1])
    assert 12 * 1024 <= size_k <= 16 * 1024  # what its rootfs says it holds
    disk = machines / tenant.id / DISK_FILE
    assert disk.stat().st_blocks * 512 <= 16 * MIB  # the host holds no more than its size

    # The worker answers, commits, and another machine writes what it reserved.
    cap = (await stub.GetCapacity(w.GetCapacityRequest(), timeout=DEADLINE)).capacity
    assert cap.total.disk_mib - cap.free.disk_mib == 16
    other = (
        await stub.CreateMachine(
            w.CreateMachineRequest(
                app="o",
                config=config(
                    "dd if=/dev/zero of=/data bs=1M count=20 2>/dev/null && echo wrote 20; "
                    "exec sleep 1000"
                ),
            ),
            timeout=DEADLINE,
        )
    ).machine
    await logs(stub, other.id, "wrote 20")
    cap = (await stub.GetCapacity(w.GetCapacityRequest(), timeout=DEADLINE)).capacity
    assert cap.total.disk_mib - cap.free.disk_mib == 16 + DEFAULT_DISK_MIB
    got = (await stub.GetMachine(w.GetMachineRequest(machine_id=tenant.id))).machine
    assert got.state == S.MACHINE_STATE_STARTED  # full, and still running
    # Nothing they wrote reached the worker's own files (its log, run dirs, image cache).
    assert host_bytes(tmp_path / "flyd-w1") - log_before < 8 * MIB

    # Destroyed, each disk file goes with its run dir, and its loop device lets go.
    for machine in (tenant, other):
        await stub.DestroyMachine(w.DestroyMachineRequest(machine_id=machine.id, force=True))
        await wait_state(stub, machine.id, S.MACHINE_STATE_DESTROYED)
    for machine in (tenant, other):
        await nothing_left(machines, machine.id)


def kill_when(condition: Callable[[], bool], pid: int) -> bool:
    """SIGKILL `pid` (flyd) the moment `condition` holds (polled, for at most DEADLINE);
    whether it did."""
    end = time.monotonic() + DEADLINE
    try:
        while not condition():
            if time.monotonic() > end:
                return False
            time.sleep(0.0002)
        return True
    finally:
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(
    "moment",
    [
        "its disk is mounted",  # by flyd's thread, detached, before the wrapper has it
        "its wrapper is spawned",  # the wrapper holds the disk's mount
    ],
)
async def test_flyd_killed_mid_create_leaves_no_disk_behind(
    flyd_factory: Callable[..., ServiceProcess],
    stub_for: Callable[[str], Stub],
    tmp_path: Path,
    moment: str,
) -> None:
    flyd = flyd_factory("--driver", "oci")
    stub = stub_for(flyd.address)
    machines = machines_dir(tmp_path)
    run_dir = machines / "m-crash"
    conditions = {
        "its disk is mounted": lambda: bool(loops_under(run_dir)),
        "its wrapper is spawned": (run_dir / "handle.json").exists,
    }
    assert flyd.proc is not None
    killer = asyncio.ensure_future(asyncio.to_thread(kill_when, conditions[moment], flyd.proc.pid))
    create = stub.CreateMachine(
        w.CreateMachineRequest(machine_id="m-crash", app="d", config=config("exec sleep 1000")),
        timeout=DEADLINE,
    )
    with pytest.raises(grpc.aio.AioRpcError):
        await create
    assert await killer, f"flyd was never seen at the moment {moment}"
    flyd.kill()

    # Back: the create never committed, so the machine is not there, and neither is its disk.
    flyd = flyd_factory("--driver", "oci", data_dir=tmp_path / "flyd-w1")
    stub = stub_for(flyd.address)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.GetMachine(w.GetMachineRequest(machine_id="m-crash"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    await nothing_left(machines, "m-crash")
    again = (
        await stub.CreateMachine(
            w.CreateMachineRequest(
                machine_id="m-crash", app="d", config=config("echo up; exec sleep 1000")
            ),
            timeout=DEADLINE,
        )
    ).machine
    await logs(stub, again.id, "up")
    await stub.DestroyMachine(w.DestroyMachineRequest(machine_id=again.id, force=True))
    await wait_state(stub, again.id, S.MACHINE_STATE_DESTROYED)
    await nothing_left(machines, again.id)


@pytest.mark.parametrize(
    "moment",
    [
        "the destroy is asked",  # frozen before or after its commit, whichever comes
        "its wrapper is gone",  # killed, its disk let go; the run dir not yet removed
    ],
)
async def test_flyd_killed_mid_destroy_leaves_no_disk_behind(
    flyd_factory: Callable[..., ServiceProcess],
    stub_for: Callable[[str], Stub],
    tmp_path: Path,
    moment: str,
) -> None:
    flyd = flyd_factory("--driver", "oci")
    stub = stub_for(flyd.address)
    machines = machines_dir(tmp_path)
    machine = (
        await stub.CreateMachine(
            w.CreateMachineRequest(app="d", config=config("echo up; exec sleep 1000")),
            timeout=DEADLINE,
        )
    ).machine
    await logs(stub, machine.id, "up")
    wrapper = json.loads((machines / machine.id / "handle.json").read_text())["pid"]
    conditions = {
        "the destroy is asked": lambda: True,
        "its wrapper is gone": lambda: gone(wrapper),
    }
    assert flyd.proc is not None
    destroy = asyncio.ensure_future(
        stub.DestroyMachine(
            w.DestroyMachineRequest(machine_id=machine.id, force=True), timeout=DEADLINE
        )
    )
    await asyncio.sleep(0)  # the request is on its way
    assert await asyncio.to_thread(kill_when, conditions[moment], flyd.proc.pid)
    flyd.kill()
    with contextlib.suppress(grpc.aio.AioRpcError):  # flyd died before it answered
        await destroy

    flyd = flyd_factory("--driver", "oci", data_dir=tmp_path / "flyd-w1")
    stub = stub_for(flyd.address)
    # Back: the destroy goes on (or, asked of a flyd that died first, is asked again).
    got = (await stub.GetMachine(w.GetMachineRequest(machine_id=machine.id))).machine
    if got.state != S.MACHINE_STATE_DESTROYED:
        await stub.DestroyMachine(w.DestroyMachineRequest(machine_id=machine.id, force=True))
        await wait_state(stub, machine.id, S.MACHINE_STATE_DESTROYED)
    await nothing_left(machines, machine.id)


async def test_a_process_driver_worker_does_not_say_its_disks_are_limited(
    flyd_factory: Callable[..., ServiceProcess], stub_for: Callable[[str], Stub]
) -> None:
    """A process driver's machines write to the host's filesystem (their working directory
    is the image's); the worker has no `nonomad.disk` label, so `machines run` says so."""
    flyd = flyd_factory("--driver", "process")
    stub = stub_for(flyd.address)
    info = (await stub.GetCapacity(w.GetCapacityRequest(), timeout=DEADLINE)).worker
    assert DISK_LABEL not in info.labels
    # Reserved all the same: placement counts it, and a worker never promises more.
    machine = (
        await stub.CreateMachine(
            w.CreateMachineRequest(app="p", config=config("exec sleep 1000", disk_mib=64)),
            timeout=DEADLINE,
        )
    ).machine
    cap = (await stub.GetCapacity(w.GetCapacityRequest(), timeout=DEADLINE)).capacity
    assert cap.total.disk_mib - cap.free.disk_mib == 64
    await stub.DestroyMachine(w.DestroyMachineRequest(machine_id=machine.id, force=True))
    await wait_state(stub, machine.id, S.MACHINE_STATE_DESTROYED)
