"""A whole cluster in one World, composed by the services' own wiring: flaps places a machine
on a simulated flyd over the simulated network; a flyd killed and booted again recovers it,
and flaps sees it again; the same seed makes the same cluster."""

from __future__ import annotations

from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

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


async def calling(
    made: Cluster, key: str = "", *, standby_for: str = "", timeout: float = 10.0
) -> machines_pb2.CreateMachineResponse | grpc.StatusCode:
    """A CreateMachine through flaps (on the node it runs on): its answer, or its status."""
    request = machines_pb2.CreateMachineRequest(
        app="web",
        region="ams",
        config=CONFIG,
        idempotency_key=key,
        standby_for=[standby_for] if standby_for else [],
    )
    try:
        answer: machines_pb2.CreateMachineResponse = await machines(made).CreateMachine(
            request, timeout=timeout
        )
        return answer
    except grpc.aio.AioRpcError as err:
        return err.code()


def create(
    made: Cluster, key: str = "", *, standby_for: str = ""
) -> machines_pb2.CreateMachineResponse | grpc.StatusCode:
    return made.world.run(made.user(), calling(made, key, standby_for=standby_for))


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


def test_a_keyed_create_retried_while_its_worker_is_cut_off_is_not_made_elsewhere(
    three: Cluster,
) -> None:
    """The worker that took the first claim makes the machine, but its answer (and its event
    stream) is held in a partition: flaps gives up on the claim. A retry must not place the key
    on the other worker meanwhile; once the partition heals it finds the first machine."""
    made = three
    made.settle(lambda: len(made.workers_seen()) == 2, what="flaps follows both workers")
    user, hosts = made.user(), list(made.hosts.values())

    def attempt() -> Coroutine[Any, Any, machines_pb2.CreateMachineResponse | grpc.StatusCode]:
        return calling(made, "k1", timeout=4.0)

    first = user.spawn(attempt())

    def took_it() -> bool:
        return any(h.flyd is not None and h.flyd.worker.heartbeat().creating for h in hosts)

    made.world.run_until(made.world.now + 4.0, took_it)
    [taker] = [h for h in hosts if h.flyd is not None and h.flyd.worker.heartbeat().creating]
    assert taker.flyd is not None
    node = taker.flyd.node.name
    made.net.block(node, "flaps-1", both=False)  # its answer, and its stream, are held
    made.world.run_until(made.world.now + 10.0, first.done)
    assert first.result() == grpc.StatusCode.DEADLINE_EXCEEDED
    [held] = taker.flyd.worker.rows  # it made the machine all the same
    # Retries while it is cut off: none lands on the other worker.
    for _ in range(3):
        assert made.world.run(user, attempt()) == grpc.StatusCode.UNAVAILABLE
        made.world.run_for(1.0)
    others = [h for h in hosts if h is not taker]
    assert all(h.flyd is not None and not h.flyd.worker.rows for h in others)

    made.net.unblock(node, "flaps-1", both=False)
    answer = made.world.run(user, attempt())
    assert not isinstance(answer, grpc.StatusCode), answer
    assert answer.machine.id == held
    assert all(h.flyd is not None and not h.flyd.worker.rows for h in others)


def test_a_proxy_promotes_the_standby_of_a_dead_workers_primary_which_stands_down_on_return(
    tmp_path: Path,
) -> None:
    with cluster(seed=8, root=tmp_path) as made:
        made.boot_flaps()
        for name in ("w1", "w2"):
            made.boot_flyd(made.add_host(name))
        made.boot_proxy()
        made.settle(lambda: len(made.workers_seen()) == 2, what="flaps follows both workers")
        primary = create(made, key="db")
        assert not isinstance(primary, grpc.StatusCode), primary

        standby = create(made, key="db/standby", standby_for=primary.machine.id)
        assert not isinstance(standby, grpc.StatusCode), standby
        stand = standby.machine
        assert stand.state == pb.MACHINE_STATE_CREATED
        lost, other = made.hosts[primary.machine.worker_id], made.hosts[stand.worker_id]

        def row(host_name: str, machine_id: str) -> pb.Machine:
            flyd = made.hosts[host_name].flyd
            assert flyd is not None
            return flyd.worker.get(machine_id).machine

        made.kill_flyd(lost)  # its machine runs on, unreachable
        made.settle(
            lambda: row(other.name, stand.id).state == pb.MACHINE_STATE_STARTED,
            what="the proxy promotes the standby",
        )
        promoted = row(other.name, stand.id).slot
        assert (promoted.generation, promoted.primary) == (1, stand.id)

        made.boot_flyd(lost)  # back: its copy is fenced, then superseded
        made.settle(
            lambda: row(lost.name, primary.machine.id).state == pb.MACHINE_STATE_STOPPED,
            what="the returning copy stands down",
        )
        old = row(lost.name, primary.machine.id).slot
        assert (old.generation, old.primary, old.fenced) == (1, stand.id, False)
