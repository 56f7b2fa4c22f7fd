"""A whole cluster in one World, composed by the services' own wiring: flaps places a machine
on a simulated flyd over the simulated network; a flyd killed and booted again recovers it,
and flaps sees it again; the same seed makes the same cluster."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from flaps.v1 import machines_pb2, machines_pb2_grpc
from flyd.v1 import machine_pb2 as pb
from sim.cluster import IMAGE, Cluster, cluster

CONFIG = pb.MachineConfig(image=IMAGE, guest=pb.GuestConfig(cpu_millicores=100, memory_mib=64))


@pytest.fixture
def three(tmp_path: Path) -> Iterator[Cluster]:
    """A flaps and two workers in ams."""
    with cluster(seed=21, root=tmp_path) as made:
        made.boot_flaps()
        for name in ("w1", "w2"):
            made.boot_flyd(made.add_host(name))
        yield made


def machines(made: Cluster) -> machines_pb2_grpc.MachinesServiceStub:
    return made.stub(machines_pb2_grpc.MachinesServiceStub, made.flaps["flaps-1"].address)


def create(made: Cluster, key: str = "") -> machines_pb2.CreateMachineResponse | grpc.StatusCode:
    async def call() -> machines_pb2.CreateMachineResponse | grpc.StatusCode:
        request = machines_pb2.CreateMachineRequest(
            app="web", region="ams", config=CONFIG, idempotency_key=key
        )
        try:
            answer: machines_pb2.CreateMachineResponse = await machines(made).CreateMachine(
                request, timeout=10.0
            )
            return answer
        except grpc.aio.AioRpcError as err:
            return err.code()

    return made.world.run(made.user(), call())


def listed(made: Cluster) -> dict[str, int]:
    async def call() -> dict[str, int]:
        answer = await machines(made).ListMachines(
            machines_pb2.ListMachinesRequest(app="web"), timeout=10.0
        )
        return {m.id: m.state for m in answer.machines}

    return made.world.run(made.user(), call())


def test_flaps_places_a_machine_on_a_simulated_worker_that_recovers_it_after_a_kill(
    three: Cluster,
) -> None:
    made = three
    made.settle(lambda: len(made.workers_seen()) == 2, what="flaps follows both workers")
    answer = create(made)
    assert not isinstance(answer, grpc.StatusCode), answer
    machine = answer.machine
    host = made.hosts[machine.worker_id]
    assert host.flyd is not None
    assert host.flyd.worker.get(machine.id).machine.state == pb.MACHINE_STATE_STARTED
    assert machine.id in host.machines.processes  # its process runs on the host
    made.settle(lambda: listed(made).get(machine.id) == pb.MACHINE_STATE_STARTED)

    made.kill_flyd(host)
    made.world.run_for(1.0)
    flyd = made.boot_flyd(host)
    assert flyd.worker.get(machine.id).machine.state == pb.MACHINE_STATE_STARTED
    assert list(host.machines.processes) == [machine.id]  # the same process: not started again
    # flaps follows the worker again (its announcement) and lists the machine as before.
    made.settle(lambda: listed(made).get(machine.id) == pb.MACHINE_STATE_STARTED)


def test_the_same_seed_makes_the_same_cluster_and_machine_ids(tmp_path: Path) -> None:
    def run(root: Path) -> tuple[str, str]:
        with cluster(seed=8, root=root) as made:
            made.boot_flaps()
            for name in ("w1", "w2", "w3"):
                made.boot_flyd(made.add_host(name))
            made.settle(lambda: len(made.workers_seen()) == 3)
            answer = create(made, key="k1")
            assert not isinstance(answer, grpc.StatusCode), answer
            made.world.run_for(5.0)
            return answer.machine.id, made.world.trace_hash()

    first = run(tmp_path / "a")
    assert run(tmp_path / "b") == first
