"""flaps' MachinesService in-process on a fake fleet (tests/flaps/support.py), as
test_servicer.py and test_hostile.py serve it: workers w1, w2 (ams) and s1 (syd), the
exchange flaps.main builds over them, and a valid create request (`bid`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from flaps import placement
from flaps.errors import map_error
from flaps.service import LIMITS, Exchange, MachinesServicer, Workers
from flaps.v1 import machines_pb2 as m
from flaps.v1 import machines_pb2_grpc
from model.validate import EGRESS_LABEL
from tests.flaps.support import FakeFleet, fake_fleet
from tests.flyd.support import config
from tests.servicers import registered

REGIONS = {"w1": "ams", "w2": "ams", "s1": "syd"}
LABELS = {"w1": {EGRESS_LABEL: "true"}}  # as flyd labels a worker whose machines can get out
Machines = machines_pb2_grpc.MachinesServiceStub


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[FakeFleet]:
    async with fake_fleet(tmp_path, REGIONS, LABELS) as fleet:
        yield fleet


@pytest.fixture
async def exchange(fleet: FakeFleet) -> AsyncIterator[Exchange]:
    """What flaps.main builds: the replica, channels to the workers, the default placement."""
    workers = Workers(fleet.replica)
    yield Exchange(fleet.replica, workers, placement.Pipeline())
    await workers.close()


def bid(**fields: Any) -> dict[str, Any]:
    return {"app": "web", "region": "ams", "config": config(), **fields}


class MachinesServer:
    """pytest-grpc-aio's fixtures for MachinesService, registered as flaps.main registers it
    (wrapped with map_error, its limits) over the `exchange` fixture: a test class that
    derives from it gets `servicer_stub`, a Machines stub of that servicer."""

    @pytest.fixture
    def grpc_add_to_server(self) -> Callable[[Any, Any], None]:
        return registered(
            machines_pb2_grpc.add_MachinesServiceServicer_to_server,
            m.DESCRIPTOR.services_by_name["MachinesService"],
            map_error,
            LIMITS,
        )

    @pytest.fixture
    def grpc_stub_cls(self) -> type[Machines]:
        return Machines

    @pytest.fixture
    def grpc_servicer(self, exchange: Exchange) -> MachinesServicer:
        return MachinesServicer(exchange)
