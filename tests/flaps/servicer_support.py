"""flaps' MachinesService in-process on a fake fleet (tests/flaps/support.py), as
test_servicer.py and test_hostile.py serve it: workers w1, w2 (ams) and s1 (syd), the
exchange flaps.main builds over them, and a valid create request (`bid`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from flaps import placement
from flaps.service import Exchange, Workers
from flaps.v1 import machines_pb2_grpc
from model.validate import EGRESS_LABEL
from tests.flaps.support import FakeFleet, fake_fleet
from tests.flyd.support import config

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
