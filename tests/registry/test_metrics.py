"""The replica's Prometheus metrics, read from the default registry as a scrape would see them.

The default registry is shared by the whole test process, so every test reads differences
and uses worker ids and regions of its own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from prometheus_client import REGISTRY

from flyd.v1 import machine_pb2 as pb
from registry.fakes import FakeWorker
from registry.replica import Replica
from registry.view import ALIVE, DEAD
from runtime.clock import ManualClock
from tests.registry.support import eventually, on_fake, running, served, status_is

S = pb.MachineState


def sample(name: str, **labels: str) -> float:
    value = REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else value


def applied() -> dict[str, float]:
    return {
        kind: sample("nonomad_registry_events_applied_total", kind=kind)
        for kind in ("snapshot", "change", "heartbeat")
    }


def lag_count() -> float:
    return sample("nonomad_registry_replication_lag_seconds_count")


@pytest.fixture
async def fake(request: pytest.FixtureRequest) -> AsyncIterator[FakeWorker]:
    # A name of its own: the gauges are labelled by worker and region, process-wide.
    name = request.node.name.replace("_", "-")[-40:].strip("-")
    worker = FakeWorker(f"m-{name}", f"r-{name}", heartbeat_interval=None)
    await worker.serve()
    yield worker
    await worker.stop()


async def test_applied_items_lag_and_liveness(fake: FakeWorker) -> None:
    worker, region = fake.info.id, fake.info.region
    clock = ManualClock()
    replica = Replica(clock=clock, suspect_after=0.6, dead_after=1.0)
    replica.add_worker(fake.info)
    before, lags_before = applied(), lag_count()
    async with running(replica):
        await on_fake(fake, lambda: fake.streams > 0, "the replica to follow")
        assert sample("nonomad_registry_workers", region=region, status="unknown") == 1
        fake.beat()
        await eventually(replica, status_is(replica, worker, ALIVE), "alive")
        assert sample("nonomad_registry_workers", region=region, status="alive") == 1
        assert sample("nonomad_registry_workers", region=region, status="unknown") == 0

        # Stamped 0.25 s before the replica's clock reads: that is the lag it must report.
        fake.change("m1", S.MACHINE_STATE_STARTED, at=clock.now() - 0.25)
        await eventually(replica, lambda: replica.machine("m1") is not None, "m1 applied")
        assert sample(
            "nonomad_registry_replication_lag_last_seconds", worker=worker
        ) == pytest.approx(0.25, abs=1e-6)
        # A worker clock ahead of ours is skew, not negative lag.
        fake.change("m2", at=clock.now() + 5)
        await eventually(replica, lambda: replica.machine("m2") is not None, "m2 applied")
        assert sample("nonomad_registry_replication_lag_last_seconds", worker=worker) == 0

        clock.advance(1.1)
        await eventually(replica, status_is(replica, worker, DEAD), "dead")
        assert sample("nonomad_registry_workers", region=region, status="dead") == 1
        assert sample("nonomad_registry_workers", region=region, status="alive") == 0
    after = applied()
    assert {kind: after[kind] - before[kind] for kind in after} == {
        "snapshot": 1,
        "change": 2,
        "heartbeat": 1,
    }
    assert lag_count() - lags_before == 2
    # A stopped replica no longer counts its workers.
    assert sample("nonomad_registry_workers", region=region, status="dead") == 0


async def test_repeats_are_not_counted_and_lag_spans_an_upstream(fake: FakeWorker) -> None:
    worker = fake.info.id
    fake.change("m1")
    clock = ManualClock()
    direct = Replica(clock=clock)
    direct.add_worker(fake.info)
    async with running(direct), served(direct) as address:
        await eventually(direct, lambda: direct.machine("m1") is not None, "the snapshot")
        downstream = Replica(clock=clock, upstream=address)
        before = applied()
        async with running(downstream):
            await eventually(downstream, lambda: downstream.machine("m1") is not None, "relayed")
            fake.change("m2", at=clock.now() - 0.5)
            await eventually(downstream, lambda: downstream.machine("m2") is not None, "m2")
            # Both replicas applied m2 with the same clock: the lag is from the worker's stamp.
            assert sample(
                "nonomad_registry_replication_lag_last_seconds", worker=worker
            ) == pytest.approx(0.5, abs=1e-6)
        after = applied()
    # The downstream's snapshot of m1, and m2 once in each replica; nothing twice.
    assert after["snapshot"] - before["snapshot"] == 1
    assert after["change"] - before["change"] == 2
