"""Replicas following real flyd processes: crashes, restarts, announcements, chains of replicas."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from flyd.v1 import worker_pb2_grpc
from registry.replica import Replica
from registry.v1 import registry_pb2 as r
from registry.v1 import registry_pb2_grpc
from registry.view import ALIVE, DEAD, SUSPECT
from runtime import aio_channel
from tests.harness import ServiceProcess, clean_env, grpcurl
from tests.registry.support import (
    DEADLINE,
    eventually,
    running,
    served,
    status_is,
    statuses_until,
    view_of,
)

S = pb.MachineState
Stub = worker_pb2_grpc.WorkerServiceStub
StartFlyd = Callable[..., ServiceProcess]
CONFIG = pb.MachineConfig(image="demo:v1", guest=pb.GuestConfig(cpu_millicores=100, memory_mib=64))


def fast_replica(upstream: str | None = None) -> Replica:
    """Small timeouts keep the crash stories short; flyd_factory's workers beat every 0.1 s."""
    return Replica(suspect_after=0.3, dead_after=0.6, retry_max=0.2, upstream=upstream)


async def create(stub: Stub, app: str = "web") -> pb.Machine:
    """The machine as the replica keeps it: without the event tail (read from the worker)."""
    resp = await stub.CreateMachine(
        w.CreateMachineRequest(app=app, config=CONFIG, skip_launch=True), timeout=30
    )
    resp.machine.ClearField("events")
    return resp.machine


def visible(replica: Replica, machine: pb.Machine) -> Callable[[], bool]:
    def check() -> bool:
        row = replica.machine(machine.id)
        return row is not None and row.state == machine.state

    return check


async def test_a_replica_follows_two_workers_through_a_crash_and_restart(
    flyd_factory: StartFlyd, stub_for: Callable[[str], Stub]
) -> None:
    w1 = flyd_factory(worker_id="w1")
    w2 = flyd_factory(worker_id="w2")
    replica = fast_replica()
    replica.add_address(w1.address)
    replica.add_address(w2.address)
    async with running(replica):
        for worker_id in ("w1", "w2"):
            await eventually(replica, status_is(replica, worker_id, ALIVE), f"{worker_id} alive")
        first = await create(stub_for(w1.address))
        await eventually(replica, visible(replica, first), "the machine created on w1")
        assert replica.machines(app="web") == [first]
        assert [m.worker_id for m in replica.machines(app="web")] == ["w1"]

        sub = replica.subscribe()
        # flyd on w1 is killed here
        w1.kill()
        statuses = await statuses_until(sub, "w1", DEAD)
        assert [s for s in statuses if s != ALIVE] == [SUSPECT, DEAD]
        assert view_of(replica, "w2").status == ALIVE

        # it comes back on the same data dir and port, and is followed from where we were
        w1 = flyd_factory("--listen", w1.address, worker_id="w1")
        await eventually(replica, status_is(replica, "w1", ALIVE), "w1 alive again")
        second = await create(stub_for(w1.address))
        await eventually(replica, visible(replica, second), "the machine created after restart")
        view = replica.worker("w1")
        assert view is not None
        assert view.snapshots == 1  # resumed from the last seq: never needed a second snapshot
        rows = replica.machines(worker_id="w1")
        assert sorted(m.id for m in rows) == sorted([first.id, second.id])
        assert replica.machine(first.id) == first


async def test_a_worker_whose_data_dir_was_wiped_has_its_rows_replaced_not_merged(
    flyd_factory: StartFlyd, stub_for: Callable[[str], Stub], tmp_path: Path
) -> None:
    w1 = flyd_factory(worker_id="w1")
    replica = fast_replica()
    replica.add_address(w1.address)
    async with running(replica):
        old = [await create(stub_for(w1.address)) for _ in range(2)]
        await eventually(replica, visible(replica, old[-1]), "the first log's machines")
        w1.kill()
        await eventually(replica, status_is(replica, "w1", DEAD), "w1 dead")
        # The same worker, its data dir wiped: a new log, which grows past the position the
        # replica resumes from (elsewhere, before it is back on its address).
        address, wiped = w1.address, tmp_path / "wiped"
        elsewhere = flyd_factory(worker_id="w1", data_dir=wiped)
        new = [await create(stub_for(elsewhere.address)) for _ in range(4)]
        elsewhere.kill()
        w1 = flyd_factory("--listen", address, worker_id="w1", data_dir=wiped)
        await eventually(replica, status_is(replica, "w1", ALIVE), "w1 back")
        await eventually(replica, visible(replica, new[-1]), "the new log's machines")
        rows = replica.machines(worker_id="w1")
        assert sorted(m.id for m in rows) == sorted(m.id for m in new)
        assert all(replica.machine(m.id) is None for m in old)


async def test_an_announced_worker_is_followed_here_and_by_a_downstream_replica(
    flyd_factory: StartFlyd, stub_for: Callable[[str], Stub]
) -> None:
    upstream = fast_replica()
    async with running(upstream), served(upstream) as address:
        downstream = fast_replica(upstream=address)
        async with running(downstream):
            w3 = flyd_factory(worker_id="w3")
            # w3 announces itself at runtime, as flyd --announce does
            async with aio_channel(address) as channel:
                resp = await registry_pb2_grpc.RegistryServiceStub(channel).Announce(
                    r.AnnounceRequest(
                        worker=pb.WorkerInfo(id="w3", region="ams", address=w3.address)
                    ),
                    timeout=5,
                )
            assert [info.id for info in resp.workers] == ["w3"]
            await eventually(upstream, status_is(upstream, "w3", ALIVE), "w3 alive upstream")

            machine = await create(stub_for(w3.address), app="api")
            await eventually(upstream, visible(upstream, machine), "the machine upstream")
            await eventually(downstream, visible(downstream, machine), "the machine downstream")
            assert downstream.machines() == upstream.machines()
            await eventually(downstream, status_is(downstream, "w3", ALIVE), "w3 alive below")
            assert view_of(downstream, "w3").seq == view_of(upstream, "w3").seq

            # the worker dies: the downstream learns it from its upstream
            w3.kill()
            await eventually(downstream, status_is(downstream, "w3", DEAD), "w3 dead below")

            # a worker started with --announce joins without anyone calling anything
            flyd_factory("--announce", address, worker_id="w4")
            await eventually(downstream, status_is(downstream, "w4", ALIVE), "w4 alive below")


def test_the_standalone_registry_process_serves_grpcurl(
    flyd_factory: StartFlyd, tmp_path: Path
) -> None:
    w1 = flyd_factory(worker_id="w1")
    env = {k: v for k, v in clean_env().items() if not k.startswith("REGISTRY_")}
    registry = ServiceProcess(
        "registry",
        ["--listen", "127.0.0.1:0", "--workers", w1.address, "--grace-period", "2"],
        tmp_path / "registry.log",
        env=env,
    ).start()
    try:
        listed = grpcurl("-plaintext", registry.address, "list")
        assert listed.returncode == 0, listed.stderr
        assert {
            "registry.v1.RegistryService",
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
        } <= set(listed.stdout.split())

        # the seed worker is asked who it is, then followed: poll until it is alive
        deadline = time.monotonic() + DEADLINE
        members: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            called = grpcurl(
                "-plaintext", registry.address, "registry.v1.RegistryService/ListMembers"
            )
            assert called.returncode == 0, called.stderr
            members = json.loads(called.stdout).get("members", [])
            if members and members[0].get("status") == "MEMBER_STATUS_ALIVE":
                break
            time.sleep(0.05)
        assert [m["worker"]["id"] for m in members] == ["w1"]
        assert members[0]["status"] == "MEMBER_STATUS_ALIVE"

        bad = grpcurl(
            "-plaintext",
            "-d",
            json.dumps({"worker": {"id": "w9", "region": "ams", "address": "nowhere"}}),
            registry.address,
            "registry.v1.RegistryService/Announce",
        )
        assert bad.returncode != 0
        assert "InvalidArgument" in bad.stderr
        assert "worker.address" in bad.stderr
        assert registry.terminate() == 0
    finally:
        registry.kill()
