"""A fake fleet for flaps' in-process tests: flyd workers on fake drivers, each served over gRPC
on loopback as flyd.main serves it, and a registry replica following them all.

flaps talks to these workers exactly as to real ones (it claims on them, forwards to them, and
reads the replica's view of them); only the machines are fakes, and time is one ManualClock
(lease expiry, replica liveness) that the test owns.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from flyd.fakes import FakeHost
from flyd.service import LIMITS as FLYD_LIMITS
from flyd.service import WorkerServicer
from flyd.service import map_error as flyd_map_error
from flyd.store import MemoryMachineLog
from flyd.v1 import worker_pb2, worker_pb2_grpc
from flyd.worker import Identity
from registry.replica import Replica
from registry.view import ALIVE
from runtime import Service, ServiceSettings
from runtime.clock import ManualClock
from tests.flyd.support import Flyd, boot, image_cache, image_source
from tests.registry.support import eventually, running
from tests.servicers import DEADLINE, serving

# Real seconds between a worker's heartbeats: the replica learns capacity from them.
HEARTBEAT = 0.1


@dataclass
class FakeFleet:
    """The workers by id, the replica that follows them, and the clock they all share."""

    workers: dict[str, Flyd]
    services: dict[str, Service]
    replica: Replica
    clock: ManualClock

    async def cut(self, worker_id: str) -> None:
        """The worker stops answering: its server is gone (its machines are left as they are)."""
        service = self.services[worker_id]
        service.request_shutdown()
        async with asyncio.timeout(DEADLINE):
            await service.shutdown_event.wait()

    def owner_of(self, machine_id: str) -> Flyd:
        """The worker that holds the machine: the one flyd whose rows have it."""
        [owner] = [f for f in self.workers.values() if machine_id in f.worker.rows]
        return owner

    def machine_ids(self) -> set[str]:
        """Every machine on every worker, whatever the replica has seen."""
        return {mid for f in self.workers.values() for mid in f.worker.rows}

    def free(self, worker_id: str) -> int:
        """Free memory (MiB) of a worker, as the replica last heard it."""
        view = self.replica.worker(worker_id)
        assert view is not None, f"the replica does not know {worker_id}"
        return view.capacity.free.memory_mib

    async def until(self, predicate: Callable[[], bool], what: str) -> None:
        """Wait until `predicate()` about the replica's view holds (checked as it changes)."""
        await eventually(self.replica, predicate, what)

    async def seen(self, machine_id: str, state: int | None = None) -> None:
        """Wait until the replica has the machine (in `state`, when given)."""

        def check() -> bool:
            row = self.replica.machine(machine_id)
            return row is not None and (state is None or row.state == state)

        await self.until(check, f"{machine_id} in the replica")


@contextlib.asynccontextmanager
async def fake_fleet(
    root: Path, regions: Mapping[str, str], labels: Mapping[str, dict[str, str]] | None = None
) -> AsyncIterator[FakeFleet]:
    """Workers (`regions`: worker id -> region; `labels`: worker id -> its labels) served on
    loopback, followed by a running replica; yields once the replica sees every worker alive."""
    clock = ManualClock()
    source = image_source(root)
    replica = Replica(clock=clock)
    async with contextlib.AsyncExitStack() as stack:
        workers: dict[str, Flyd] = {}
        services: dict[str, Service] = {}
        for worker_id, region in regions.items():
            flyd = boot(
                store=MemoryMachineLog(),
                host=FakeHost(clock),
                clock=clock,
                images=image_cache(root / worker_id, source),
                identity=Identity(
                    worker_id,
                    region,
                    "",
                    dict((labels or {}).get(worker_id, {})),
                    f"boot-{worker_id}",
                ),
            )
            flyd.worker.recover()
            stack.push_async_callback(flyd.kill)
            service = Service(worker_id, ServiceSettings(listen="127.0.0.1:0", grace_period=1))
            service.add(
                WorkerServicer(
                    flyd.worker, heartbeat_interval=HEARTBEAT, draining=service.draining
                ),
                worker_pb2_grpc.add_WorkerServiceServicer_to_server,
                worker_pb2.DESCRIPTOR.services_by_name["WorkerService"],
                flyd_map_error,
                FLYD_LIMITS,
            )
            flyd.worker.identity.address = await stack.enter_async_context(serving(service))
            replica.add_worker(flyd.worker.info())
            workers[worker_id] = flyd
            services[worker_id] = service
        # Entered last, so it stops first: the workers' streams end before their servers stop.
        await stack.enter_async_context(running(replica))

        def all_alive() -> bool:
            views = [replica.worker(worker_id) for worker_id in regions]
            return all(view is not None and view.status == ALIVE for view in views)

        await eventually(replica, all_alive, "every worker alive in the replica")
        yield FakeFleet(workers, services, replica, clock)
