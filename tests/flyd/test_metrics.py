"""flyd's Prometheus metrics, scraped over HTTP from a real flyd process."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from flyd.v1 import worker_pb2_grpc
from tests.flyd.process_support import DEADLINE, config, wait_state
from tests.harness import ServiceProcess

S = pb.MachineState
Stub = worker_pb2_grpc.WorkerServiceStub
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(address: str) -> Samples:
    """Every sample at /metrics: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_metrics_count_transitions_machines_and_reservations(
    flyd_factory: Callable[..., ServiceProcess], stub_for: Callable[[str], Stub]
) -> None:
    flyd = flyd_factory("--metrics-listen", "127.0.0.1:0", "--capacity.cpu-millicores", "4000")
    metrics = flyd.announced["NONOMAD_METRICS"]
    stub = stub_for(flyd.address)

    before = await asyncio.to_thread(scrape, metrics)
    assert value(before, "nonomad_flyd_machines", state="started") == 0
    assert value(before, "nonomad_flyd_capacity", resource="cpu_millicores") == 4000
    assert value(before, "nonomad_flyd_reserved", resource="cpu_millicores") == 0

    created = (
        await stub.CreateMachine(
            w.CreateMachineRequest(app="demo", config=config(), skip_launch=True),
            timeout=DEADLINE,
        )
    ).machine
    await stub.StartMachine(w.StartMachineRequest(machine_id=created.id), timeout=DEADLINE)
    await wait_state(stub, created.id, S.MACHINE_STATE_STARTED)

    after = await asyncio.to_thread(scrape, metrics)
    transitions = "nonomad_flyd_state_transitions_total"
    for from_state, to_state in [
        ("unspecified", "created"),
        ("created", "starting"),
        ("starting", "started"),
    ]:
        assert value(after, transitions, from_state=from_state, to_state=to_state) == 1
    assert value(after, "nonomad_flyd_machines", state="started") == 1
    assert value(after, "nonomad_flyd_machines", state="created") == 0
    assert value(after, "nonomad_flyd_reserved", resource="cpu_millicores") == 100
    assert value(after, "nonomad_flyd_reserved", resource="memory_mib") == 64
    assert value(after, "nonomad_flyd_reserved", resource="machines") == 1
    assert value(after, "nonomad_flyd_cordoned") == 0
    assert value(after, "nonomad_flyd_create_seconds_count") == 1

    await stub.StopMachine(w.StopMachineRequest(machine_id=created.id), timeout=DEADLINE)
    await wait_state(stub, created.id, S.MACHINE_STATE_STOPPED)
    stopped = await asyncio.to_thread(scrape, metrics)
    assert value(stopped, "nonomad_flyd_machines", state="stopped") == 1
    assert value(stopped, "nonomad_flyd_machines", state="started") == 0
    assert value(stopped, transitions, from_state="stopping", to_state="stopped") == 1
    # A stopped machine keeps its reservation.
    assert value(stopped, "nonomad_flyd_reserved", resource="cpu_millicores") == 100
