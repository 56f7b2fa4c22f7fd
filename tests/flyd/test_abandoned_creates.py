"""An abandoned create leaves the worker as it was (issue 27, attack 12): creates whose caller
left (their deadline passed, the call was cancelled) at every point a create can be cancelled
at, on a worker with the real OCI driver and netd, then plain creates that all succeed; and
the attack itself against a real flyd: creates with deadlines of a few milliseconds.

Skipped, with the reason, where crun cannot run. Traffic only to 127.0.0.1; waits are on
conditions with deadlines.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from flyd.images.build import build_image
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from flyd.v1 import worker_pb2_grpc
from model.images.owners import PUBLIC
from model.images.source import ImageSource
from tests import host_ports
from tests.flyd.driver_support import (
    OCI_UNAVAILABLE,
    Exits,
    logged,
    netd_hello,
    run_machine,
    sh,
    spec,
    wait_until,
)
from tests.flyd.process_support import http_get_soon
from tests.flyd.support import STARTED, Flyd, Node, cancel_at_step
from tests.harness import ServiceProcess

pytestmark = pytest.mark.skipif(
    OCI_UNAVAILABLE is not None, reason=f"crun cannot run here: {OCI_UNAVAILABLE}"
)

DEADLINE = 30.0
SLEEPER = pb.MachineConfig(
    image="sleeper:v1",
    guest=pb.GuestConfig(cpu_millicores=100, memory_mib=64),
    services=[pb.ServiceConfig(internal_port=8080)],
)


@pytest.fixture
def kind() -> str:
    """Only the OCI driver here (tests/flyd/conftest.py's `make_driver` builds what this says)."""
    return "oci"


@pytest.fixture
def source(tmp_path: Path) -> ImageSource:
    """`sleeper:v1`, a machine that sleeps."""
    src = tmp_path / "sleeper-src"
    src.mkdir()
    (src / "README").write_text("a machine that sleeps\n")
    build_image(
        src, tmp_path / "source", name="sleeper", tag="v1",
        entrypoint=["sh", "-c", "echo up; exec sleep 600"], owners=PUBLIC,
    )  # fmt: skip
    return ImageSource(tmp_path / "source")


@pytest.fixture
async def oci_flyd(make_driver: Callable[..., Any], node: Node) -> AsyncIterator[Flyd]:
    """A recovered worker in-process, on the OCI driver (its run root the fixture's)."""
    yield node.boot(ports=host_ports.block(), make_driver=make_driver)
    await node.kill_all()  # before make_driver's fixture kills what is left on its run root


def worker_state(flyd: Flyd) -> dict[str, object]:
    """Everything an abandoned create could leave behind, on the worker and on the host."""
    worker, driver = flyd.worker, flyd.driver
    run_root = driver._run_dirs.root
    netd_pid = json.loads((run_root / ".netd.json").read_text())["pid"]
    prefix = driver._cgroups._prefix
    return {
        "rows": sorted(worker.rows),
        "pending": sorted(worker.reservations.pending),
        "reserved": worker.reserved().SerializeToString(),
        "slots": dict(driver._slots),
        "netd, as flyd knows it": {m: dict(s) for m, s in driver._nets.machines.items()},
        "published": dict(driver._published),
        "ports held": {m: driver._ports.holds(m) for m in driver._published},
        "watched": sorted(driver._watched),
        "preparing": sorted(driver._preparing),
        "run dirs": sorted(driver.leftovers()),
        "cgroups": sorted(
            p.name
            for p in (Path("/sys/fs/cgroup/pids") / prefix).iterdir()
            if p.is_dir() and not p.name.startswith(".spare")
        ),
        "netd machines": sorted(netd_hello(run_root)["machines"]),
        "netd alive": Path(f"/proc/{netd_pid}").exists(),
    }


def netd_descriptors(flyd: Flyd) -> int:
    pid = json.loads((flyd.driver._run_dirs.root / ".netd.json").read_text())["pid"]
    return len(os.listdir(f"/proc/{pid}/fd"))


async def back_to(flyd: Flyd, before: dict[str, object]) -> None:
    """Wait (bounded) until the worker is as `before` says: an abandoned create's clean-up
    runs in the background, as the caller has gone."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while (now := worker_state(flyd)) != before:
        if loop.time() > deadline:
            changed = {key: (before[key], now[key]) for key in now if now[key] != before[key]}
            pytest.fail(f"left behind (before, now): {changed}")
        await asyncio.sleep(0.02)


async def create(flyd: Flyd, machine_id: str) -> pb.Machine:
    return await flyd.worker.create(
        machine_id=machine_id, name="", app="a", config=SLEEPER, skip_launch=False
    )


@pytest.mark.timeout(600)
async def test_a_create_cancelled_at_any_await_leaves_the_worker_as_it_was(
    oci_flyd: Flyd,
) -> None:
    flyd = oci_flyd
    # Warm: netd runs, the image is cached, spares are made; one machine runs.
    assert (await create(flyd, "warm")).state == STARTED
    before = worker_state(flyd)
    descriptors = netd_descriptors(flyd)
    k = 1
    while await cancel_at_step(create(flyd, f"c{k}"), k):
        # The caller left at its k-th await: nothing of the create is left, anywhere.
        await back_to(flyd, before)
        k += 1
    # How many of its awaits suspend depends on what is ready (spares, the disk thread), so
    # on the machine's load: only that some did, and each was cancelled at, is certain.
    assert k > 1, "the create never suspended: nothing was cancelled"
    # The one that was never cancelled made a machine; netd holds no more than spares more.
    assert flyd.worker.rows[f"c{k}"].state == STARTED
    assert netd_descriptors(flyd) <= descriptors + 2 * 2 + 2  # spares (user, net) and c{k}'s
    # And plain creates after all that each get a machine that runs.
    for mid in ("p1", "p2", "p3"):
        made = await create(flyd, mid)
        assert made.state == STARTED
        assert flyd.driver.is_running(mid)


async def test_a_restart_cancelled_at_any_await_leaves_netd_and_the_slots_as_they_were(
    make_driver: Callable[..., Any], image: Path
) -> None:
    """The driver's own part, for a machine that exists (no clean-up follows its start): its
    namespaces go down again, its slot stays its own, nothing of the run is left."""
    exits = Exits()
    driver = make_driver(exits)
    machine = spec("m1", sh("echo up; exec sleep 600"), image)
    await run_machine(driver, machine)
    await driver.stop("m1", signal.SIGTERM, DEADLINE)
    slots = dict(driver._slots)
    down = {"m1": {"up": False, "ports": []}}

    def as_it_was() -> bool:
        return (
            not driver.is_running("m1")
            and not driver._preparing
            and driver._slots == slots
            and {m: {"up": s["up"], "ports": s["ports"]} for m, s in driver._nets.machines.items()}
            == down
            and not netd_hello(driver._run_dirs.root)["machines"]["m1"]["up"]
            and not (driver._crun_root / "m1").exists()
        )

    k = 1
    while await cancel_at_step(driver.start(machine), k):
        await wait_until(as_it_was, f"the start cancelled at step {k} to leave nothing")
        k += 1
    assert k > 2  # netd, the disk thread (unless done by then), the hold hook
    driver.release("m1")  # the start never cancelled runs as any other
    await logged(driver, "m1", "up")
    assert driver._slots == slots
    await driver.stop("m1", signal.SIGTERM, DEADLINE)


async def test_creates_with_deadlines_of_milliseconds_leave_a_real_flyd_as_it_was(
    flyd_factory: Callable[..., ServiceProcess],
    stub_for: Callable[[str], worker_pb2_grpc.WorkerServiceStub],
    tmp_path: Path,
) -> None:
    """The attack: creates with a 2-6 ms deadline at flyd, then plain creates. Each of the
    first is DEADLINE_EXCEEDED and leaves nothing (no run dir, no machine in netd); every
    plain create after them makes a machine that answers on its port."""
    flyd = flyd_factory("--driver", "oci")
    stub = stub_for(flyd.address)
    demo = pb.MachineConfig(
        image="demo:v1",
        guest=pb.GuestConfig(cpu_millicores=100, memory_mib=64),
        services=[pb.ServiceConfig(internal_port=8080)],
    )
    request = w.CreateMachineRequest(app="d", config=demo)
    await stub.CreateMachine(request, timeout=DEADLINE)  # warm: netd, the image, spares
    for ms in [2, 3, 4, 5, 6] * 4:
        try:
            await stub.CreateMachine(request, timeout=ms / 1000)
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    machines = tmp_path / "flyd-w1" / "machines"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while True:
        listed = await stub.ListMachines(w.ListMachinesRequest(), timeout=DEADLINE)
        rows = {m.id for m in listed.machines}
        run_dirs = {p.name for p in machines.iterdir() if not p.name.startswith(".")}
        in_netd = set(netd_hello(machines)["machines"])
        if run_dirs == rows == in_netd:
            break
        assert loop.time() < deadline, f"left behind: {run_dirs - rows}, {in_netd - rows}"
        await asyncio.sleep(0.05)
    for _ in range(3):
        made = (await stub.CreateMachine(request, timeout=DEADLINE)).machine
        assert made.state == STARTED
        assert await http_get_soon(made.ports[0].host_port) == f"hello from {made.id}\n"
