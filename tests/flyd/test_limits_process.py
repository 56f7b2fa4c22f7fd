"""A real flyd's own limits (issue 27, item 6): it raises its descriptor limit at start as far
as the host allows, and the netd it starts has the same (it inherits flyd's); and the flags that
bound what a caller may cost it (--streams-per-caller, --log-read-bytes) are the ones it uses."""

from __future__ import annotations

import contextlib
import json
import resource
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from flyd.drivers.netclient import NETD_HANDLE
from flyd.v1 import worker_pb2 as w
from flyd.v1 import worker_pb2_grpc
from tests.flyd.process_support import DEADLINE, config, wait_log
from tests.harness import ServiceProcess

Stub = worker_pb2_grpc.WorkerServiceStub


def nofile(pid: int) -> tuple[int, int]:
    """The soft and hard RLIMIT_NOFILE of a process, from /proc/<pid>/limits."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open files limit")


@contextlib.contextmanager
def soft_nofile(soft: int) -> Iterator[int]:
    """This process's soft limit lowered (its children start with it) while the block runs;
    yields the hard limit, which stays."""
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, before[1]))
    try:
        yield before[1]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)


def test_flyd_and_its_netd_raise_their_descriptor_limit_to_the_hosts(
    flyd_factory: Callable[..., ServiceProcess], tmp_path: Path
) -> None:
    with soft_nofile(1024) as hard:
        flyd = flyd_factory()  # started with the common default of 1024
    assert flyd.proc is not None
    assert nofile(flyd.proc.pid) == (hard, hard)
    netd = tmp_path / "flyd-w1" / "machines" / NETD_HANDLE
    if netd.exists():  # the OCI driver: netd holds the machines' ports and connections
        assert nofile(json.loads(netd.read_text())["pid"]) == (hard, hard)


async def test_a_flyd_holds_each_caller_and_each_tail_to_its_flags(
    flyd_factory: Callable[..., ServiceProcess], stub_for: Callable[[str], Stub]
) -> None:
    flyd = flyd_factory("--streams-per-caller", "1", "--log-read-bytes", "4096")
    stub = stub_for(flyd.address)
    cfg = config("seq 1 10000; echo done; while :; do sleep 1000 & wait; done")
    request = w.CreateMachineRequest(app="demo", config=cfg)
    machine = (await stub.CreateMachine(request, timeout=DEADLINE)).machine
    await wait_log(stub, machine.id, "done")

    # A tail of 10000 lines reads 4 KiB of the log at most, and says what it left out.
    tail = w.GetMachineLogsRequest(machine_id=machine.id, tail_lines=10_000)
    items = [item async for item in stub.GetMachineLogs(tail, timeout=DEADLINE)]
    shown = sum(len(item.line) + 1 for item in items)
    written = sum(len(f"{n}\n") for n in range(1, 10_001)) + len("done\n")
    assert (shown <= 4096, items[-1].line) == (True, "done")
    assert items[0].truncated_bytes == written - shown

    # One follow stream is this caller's cap: a second is refused, naming it.
    follow = w.GetMachineLogsRequest(machine_id=machine.id, tail_lines=1, follow=True)
    first = stub.GetMachineLogs(follow, timeout=DEADLINE)
    try:
        assert (await first.read()).line == "done"
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.GetMachineLogs(follow, timeout=DEADLINE).read()
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--streams-per-caller 1" in (refused.value.details() or "")
    finally:
        first.cancel()
