"""A real flyd against huge machine logs (issue 27, attack 8): a 4 TiB sparse log (what
`ftruncate(1, 1 << 42)` did when a machine held its log file) and 256 MiB without a newline.

flyd's memory is read from /proc/<pid>/status: VmHWM, the most it ever had resident, so a read
that swelled and shrank again still shows. Before the fix flyd went from 78 MiB to 1.9 GiB and
was OOM-killed, and again on each restart (recovery reads a machine's last words).
"""

from __future__ import annotations

import asyncio
import json
import signal
import uuid
from collections.abc import Callable
from pathlib import Path

from flyd.drivers.logs import COPIER_HANDLE, LOG_NAME
from flyd.settings import LOG_READ_BYTES
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from flyd.v1 import worker_pb2_grpc
from tests.flyd.process_support import (
    DEADLINE,
    config,
    exits_on_usr1,
    gone_soon,
    signal_machine,
    wait_log,
    wait_state,
)
from tests.harness import ServiceProcess

S = pb.MachineState
Stub = worker_pb2_grpc.WorkerServiceStub
MIB = 1 << 20
HEADROOM = 64 * MIB  # what a few log reads in flight may add to flyd, at their most


def resident_peak(flyd: ServiceProcess) -> int:
    """The most memory the flyd process ever had resident (VmHWM), in bytes."""
    assert flyd.proc is not None
    for line in Path(f"/proc/{flyd.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


async def create(stub: Stub, script: str) -> pb.Machine:
    cfg = config(script, restart=pb.RESTART_MODE_NO)
    request = w.CreateMachineRequest(app="demo", config=cfg)
    return (await stub.CreateMachine(request, timeout=DEADLINE)).machine


async def tail(stub: Stub, machine_id: str) -> list[w.GetMachineLogsResponse]:
    request = w.GetMachineLogsRequest(machine_id=machine_id, tail_lines=10_000)
    return [item async for item in stub.GetMachineLogs(request, timeout=DEADLINE)]


async def test_a_huge_log_costs_flyd_one_bounded_read_even_after_a_restart(
    flyd_factory: Callable[..., ServiceProcess], stub_for: Callable[[str], Stub], tmp_path: Path
) -> None:
    flyd = flyd_factory()
    stub = stub_for(flyd.address)
    run = tmp_path / "flyd-w1" / "machines"
    sparse = await create(stub, "echo hello")
    newline_free = await create(stub, "echo hello")
    for machine in (sparse, newline_free):
        await wait_state(stub, machine.id, S.MACHINE_STATE_STOPPED)
    await tail(stub, sparse.id)  # warm: the baseline has its threads and buffers
    baseline = resident_peak(flyd)

    # The logs as a machine that held its own log file could leave them.
    with open(run / sparse.id / LOG_NAME, "r+b") as f:
        f.truncate(1 << 42)
    with open(run / newline_free.id / LOG_NAME, "ab") as f:
        for _ in range(256):
            f.write(b"x" * MIB)

    # A follow stream stays open on the 4 TiB log while tails are read and the worker asked
    # what it has: every call answers.
    follow = stub.GetMachineLogs(
        w.GetMachineLogsRequest(machine_id=sparse.id, tail_lines=10, follow=True),
        timeout=DEADLINE,
    )
    try:
        assert (await follow.read()).truncated_bytes == (1 << 42) - 64 * 1024
        reads = [tail(stub, m.id) for m in (sparse, newline_free) * 4]
        *tails, capacity = await asyncio.gather(
            *reads, stub.GetCapacity(w.GetCapacityRequest(), timeout=DEADLINE)
        )
    finally:
        follow.cancel()
    assert capacity.worker.id == "w1"
    for items, size in zip(tails, [1 << 42, 6 + 256 * MIB] * 4, strict=True):
        # The newest 1 MiB at most, one line cut to 64 KiB; the first line says what is left.
        assert [len(item.line) for item in items] == [64 * 1024]
        assert items[0].truncated_bytes == size - 64 * 1024
        assert sum(len(item.line) for item in items) <= LOG_READ_BYTES
    assert resident_peak(flyd) - baseline < HEADROOM

    # Second act: a machine ends while flyd is down, and its log is 4 TiB when flyd comes back.
    token = f"huge-{uuid.uuid4().hex[:8]}"
    last = await create(stub, exits_on_usr1(token))
    await wait_log(stub, last.id, "waiting")
    flyd.kill()
    await gone_soon(signal_machine(token, signal.SIGUSR1))
    copier = json.loads((run / last.id / COPIER_HANDLE).read_text())["pid"]
    await gone_soon(copier)  # it wrote what the machine said, and ended
    with open(run / last.id / LOG_NAME, "r+b") as f:
        f.truncate(1 << 42)
    flyd = flyd_factory(data_dir=tmp_path / "flyd-w1")
    stub = stub_for(flyd.address)
    stopped = await wait_state(stub, last.id, S.MACHINE_STATE_STOPPED)  # its exit, recovered
    assert stopped.last_exit.exit_code == 7
    assert (await stub.GetCapacity(w.GetCapacityRequest(), timeout=DEADLINE)).worker.id == "w1"
    assert resident_peak(flyd) - baseline < HEADROOM
