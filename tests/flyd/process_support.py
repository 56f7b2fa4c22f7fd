"""What the tests of flyd as a real process share: machine configs of `demo:v1`, waits on a
machine's state and log, HTTP to a machine's published port, signals to a machine's shell."""

from __future__ import annotations

import asyncio
import os
import urllib.request
from pathlib import Path

from google.protobuf.duration_pb2 import Duration

from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from flyd.v1 import worker_pb2_grpc
from tests.flyd.driver_support import gone

Stub = worker_pb2_grpc.WorkerServiceStub
DEADLINE = 30.0


def config(
    *cmd: str,
    memory_mib: int = 64,
    restart: int = pb.RESTART_MODE_NO,
    max_retries: int = 0,
    services: bool = False,
    stop_timeout: float | None = None,
) -> pb.MachineConfig:
    cfg = pb.MachineConfig(
        image="demo:v1",
        guest=pb.GuestConfig(cpu_millicores=100, memory_mib=memory_mib),
        cmd=list(cmd),
        restart=pb.RestartPolicy(mode=restart, max_retries=max_retries),  # type: ignore[arg-type]
    )
    if cmd:
        cfg.entrypoint.append("sh")
        cfg.cmd[:] = ["-c", *cmd]
    if services:
        cfg.services.add(internal_port=8080)
    if stop_timeout is not None:
        cfg.stop.timeout.CopyFrom(Duration(nanos=int(stop_timeout * 1e9)))
    return cfg


async def wait_state(stub: Stub, machine_id: str, state: int, timeout: int = 30) -> pb.Machine:
    resp = await stub.WaitMachine(
        w.WaitMachineRequest(
            machine_id=machine_id,
            state=state,  # type: ignore[arg-type]
            timeout=Duration(seconds=timeout),
        ),
        timeout=timeout + 5,
    )
    return resp.machine


def http_get(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as resp:
        return str(resp.read().decode())


async def http_get_soon(port: int) -> str:
    """The machine is started; its server may need a moment to listen."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while True:
        try:
            return await asyncio.to_thread(http_get, port)
        except OSError:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.05)


async def wait_log(stub: Stub, machine_id: str, line: str) -> None:
    """Wait until the machine has printed `line`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while True:
        stream = stub.GetMachineLogs(
            w.GetMachineLogsRequest(machine_id=machine_id, tail_lines=50), timeout=DEADLINE
        )
        if line in [item.line async for item in stream]:
            return
        assert loop.time() < deadline, f"{machine_id} never printed {line!r}"
        await asyncio.sleep(0.02)


def signal_machine(token: str, sig: int) -> int:
    """Send `sig` to the machine's shell (its command line holds `token`) from outside flyd."""
    shells: dict[int, int] = {}  # pid -> parent
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
            comm = (entry / "comm").read_text().strip()
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if token.encode() in cmdline and comm == "sh" and b"nonomad-wrapper" not in cmdline:
            shells[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    # The shell itself, not a fork of it that has not exec'd its child yet.
    (main,) = [pid for pid, parent in shells.items() if parent not in shells]
    os.kill(main, sig)
    return main


async def gone_soon(pid: int) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while not gone(pid):
        assert loop.time() < deadline, f"process {pid} is still there"
        await asyncio.sleep(0.02)


def exits_on_usr1(token: str) -> str:
    """Exits with 7 on SIGUSR1; when restarted it stays up (its first run leaves a file)."""
    return (
        f"[ -f ./ran-$MACHINE_ID ] && exec sleep 1000; touch ./ran-$MACHINE_ID; "
        f"trap 'exit 7' USR1; echo waiting; while :; do sleep 1000 & wait; done # {token}"
    )


def machine_address(machines: Path, machine_id: str) -> str:
    """The machine's own address, as its run dir's /etc/hosts names it."""
    for line in (machines / machine_id / "etc" / "hosts").read_text().splitlines():
        address, _, name = line.partition("\t")
        if name == machine_id:
            return address
    raise AssertionError(f"{machine_id} has no address in its /etc/hosts")
