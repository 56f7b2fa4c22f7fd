"""flyd as a real process: real machines, a real SIGKILL of flyd, real cgroups."""

from __future__ import annotations

import asyncio
import signal
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from flyd.v1 import worker_pb2_grpc
from tests.flyd.process_support import (
    DEADLINE,
    config,
    exits_on_usr1,
    gone_soon,
    http_get,
    http_get_soon,
    signal_machine,
    wait_log,
    wait_state,
)
from tests.harness import ServiceProcess, error_info

S = pb.MachineState
Stub = worker_pb2_grpc.WorkerServiceStub


async def test_machines_outlive_a_killed_flyd_and_are_reattached(
    flyd_factory: Callable[..., ServiceProcess], stub_for: Callable[[str], Stub], tmp_path: Path
) -> None:
    flyd = flyd_factory()
    stub = stub_for(flyd.address)
    created = (
        await stub.CreateMachine(
            w.CreateMachineRequest(app="demo", config=config(services=True)), timeout=DEADLINE
        )
    ).machine
    assert created.state == S.MACHINE_STATE_STARTED
    port = created.ports[0].host_port
    assert await http_get_soon(port) == f"hello from {created.id}\n"

    # flyd dies; the machine does not.
    flyd.kill()
    assert await asyncio.to_thread(http_get, port) == f"hello from {created.id}\n"

    flyd = flyd_factory(data_dir=tmp_path / "flyd-w1")
    stub = stub_for(flyd.address)
    machine = (await stub.GetMachine(w.GetMachineRequest(machine_id=created.id))).machine
    assert machine.state == S.MACHINE_STATE_STARTED
    assert machine.instance_id == created.instance_id
    # Re-attached for real: stop reaches the same process.
    await stub.StopMachine(w.StopMachineRequest(machine_id=created.id), timeout=DEADLINE)
    stopped = await wait_state(stub, created.id, S.MACHINE_STATE_STOPPED)
    assert stopped.last_exit.signal == "SIGTERM"
    # Refused (process driver), or reset: netd still holds a stopped machine's port.
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        await asyncio.to_thread(http_get, port)

    # A stopped machine keeps its reservation and port; destroy releases them.
    cap = (await stub.GetCapacity(w.GetCapacityRequest())).capacity
    assert cap.free.memory_mib == cap.total.memory_mib - 64
    await stub.DestroyMachine(w.DestroyMachineRequest(machine_id=created.id), timeout=DEADLINE)
    await wait_state(stub, created.id, S.MACHINE_STATE_DESTROYED)
    cap = (await stub.GetCapacity(w.GetCapacityRequest())).capacity
    assert cap.free == cap.total


async def test_an_exit_while_flyd_is_down_gets_its_real_status_and_policy(
    flyd_factory: Callable[..., ServiceProcess], stub_for: Callable[[str], Stub], tmp_path: Path
) -> None:
    token = f"once-{uuid.uuid4().hex[:8]}"
    flyd = flyd_factory()
    stub = stub_for(flyd.address)
    once = (
        await stub.CreateMachine(
            w.CreateMachineRequest(
                app="demo", config=config(exits_on_usr1(token), restart=pb.RESTART_MODE_NO)
            ),
            timeout=DEADLINE,
        )
    ).machine
    await wait_log(stub, once.id, "waiting")
    flyd.kill()

    await gone_soon(signal_machine(token, signal.SIGUSR1))  # it exits while nobody watches
    # Whether flyd finds it still exiting or long gone, it learns the real status.
    flyd = flyd_factory(data_dir=tmp_path / "flyd-w1")
    stub = stub_for(flyd.address)
    stopped = await wait_state(stub, once.id, S.MACHINE_STATE_STOPPED)
    assert stopped.last_exit.has_exit_code
    assert stopped.last_exit.exit_code == 7

    # The same story with on-failure: flyd restarts it when it finds it dead.
    token = f"retried-{uuid.uuid4().hex[:8]}"
    retried = (
        await stub.CreateMachine(
            w.CreateMachineRequest(
                app="demo",
                config=config(exits_on_usr1(token), restart=pb.RESTART_MODE_ON_FAILURE),
            ),
            timeout=DEADLINE,
        )
    ).machine
    await wait_log(stub, retried.id, "waiting")
    flyd.kill()
    await gone_soon(signal_machine(token, signal.SIGUSR1))
    flyd = flyd_factory(data_dir=tmp_path / "flyd-w1")
    stub = stub_for(flyd.address)
    await wait_state(stub, retried.id, S.MACHINE_STATE_RESTARTING)
    restarted = await wait_state(stub, retried.id, S.MACHINE_STATE_STARTED)
    assert restarted.restart_count == 1
    assert restarted.last_exit.exit_code == 7


async def test_a_crash_loop_ends_failed_with_exit_code_and_log_tail(
    flyd_factory: Callable[..., ServiceProcess], stub_for: Callable[[str], Stub]
) -> None:
    flyd = flyd_factory()
    stub = stub_for(flyd.address)
    machine = (
        await stub.CreateMachine(
            w.CreateMachineRequest(
                app="demo",
                config=config(
                    "echo cannot open database >&2; exit 3",
                    restart=pb.RESTART_MODE_ON_FAILURE,
                    max_retries=2,
                ),
            ),
            timeout=DEADLINE,
        )
    ).machine
    failed = await wait_state(stub, machine.id, S.MACHINE_STATE_FAILED)
    assert failed.last_exit.exit_code == 3
    assert "cannot open database" in failed.log_tail
    assert failed.events[-1].to_state == S.MACHINE_STATE_FAILED
    assert "gave up after 2 restarts" in failed.events[-1].reason


async def test_stop_escalates_to_sigkill_for_a_machine_that_ignores_sigterm(
    flyd_factory: Callable[..., ServiceProcess], stub_for: Callable[[str], Stub]
) -> None:
    flyd = flyd_factory()
    stub = stub_for(flyd.address)
    machine = (
        await stub.CreateMachine(
            w.CreateMachineRequest(
                app="demo",
                config=config(
                    "trap '' TERM; echo trapping; while true; do sleep 0.05; done",
                    stop_timeout=0.3,
                ),
            ),
            timeout=DEADLINE,
        )
    ).machine
    await wait_log(stub, machine.id, "trapping")
    await stub.StopMachine(w.StopMachineRequest(machine_id=machine.id), timeout=DEADLINE)
    stopped = await wait_state(stub, machine.id, S.MACHINE_STATE_STOPPED)
    assert stopped.last_exit.signal == "SIGKILL"


async def test_logs_are_streamed_and_followed(
    flyd_factory: Callable[..., ServiceProcess], stub_for: Callable[[str], Stub]
) -> None:
    flyd = flyd_factory()
    stub = stub_for(flyd.address)
    machine = (
        await stub.CreateMachine(
            w.CreateMachineRequest(
                app="demo",
                config=config(
                    "trap 'echo third; exec sleep 1000' USR1; echo first; echo second >&2; "
                    "while :; do sleep 1000 & wait; done"
                ),
            ),
            timeout=DEADLINE,
        )
    ).machine
    stream = stub.GetMachineLogs(
        w.GetMachineLogsRequest(machine_id=machine.id, follow=True, tail_lines=10),
        timeout=DEADLINE,
    )
    lines = []
    async for item in stream:
        lines.append(item.line)
        if lines == ["first", "second"]:
            await stub.SignalMachine(
                w.SignalMachineRequest(machine_id=machine.id, signal="SIGUSR1"),
                timeout=DEADLINE,
            )
        if "third" in lines:
            break
    stream.cancel()
    assert lines == ["first", "second", "third"]


@pytest.mark.skipif(
    not Path("/sys/fs/cgroup/memory").is_dir(), reason="no cgroup v1 memory controller here"
)
async def test_a_machine_over_its_memory_limit_is_oom_killed(
    flyd_factory: Callable[..., ServiceProcess], stub_for: Callable[[str], Stub]
) -> None:
    flyd = flyd_factory()
    stub = stub_for(flyd.address)
    hog = "python3 -c 'b = bytearray(256 * 1024 * 1024); print(len(b))'"
    machine = (
        await stub.CreateMachine(
            w.CreateMachineRequest(
                app="demo", config=config(hog, memory_mib=32, restart=pb.RESTART_MODE_NO)
            ),
            timeout=DEADLINE,
        )
    ).machine
    stopped = await wait_state(stub, machine.id, S.MACHINE_STATE_STOPPED)
    assert stopped.last_exit.oom_killed
    assert stopped.last_exit.signal == "SIGKILL"


async def test_a_full_worker_refuses_at_once_naming_the_resource(
    flyd_factory: Callable[..., ServiceProcess], stub_for: Callable[[str], Stub]
) -> None:
    flyd = flyd_factory("--capacity.memory-mib", "100")
    stub = stub_for(flyd.address)
    await stub.CreateMachine(
        w.CreateMachineRequest(app="demo", config=config("exec sleep 1000"), skip_launch=True),
        timeout=DEADLINE,
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.CreateMachine(
            w.CreateMachineRequest(app="demo", config=config("exec sleep 1000")), timeout=DEADLINE
        )
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "memory" in (err.value.details() or "")
    assert error_info(err.value) == ("NO_ROOM", "flyd.nonomad", {"resource": "memory"})
    listed = (await stub.ListMachines(w.ListMachinesRequest())).machines
    assert len(listed) == 1

    # Cordoned: new machines are refused, the existing one still starts.
    await stub.CordonWorker(w.CordonWorkerRequest(cordoned=True))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.CreateMachine(
            w.CreateMachineRequest(app="demo", config=config("exec sleep 1000", memory_mib=1)),
            timeout=DEADLINE,
        )
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    started = (await stub.StartMachine(w.StartMachineRequest(machine_id=listed[0].id))).machine
    assert started.state == S.MACHINE_STATE_STARTED
    cap = (await stub.GetCapacity(w.GetCapacityRequest())).capacity
    assert cap.cordoned
