"""flaps refuses a create, an update or a simulated placement of an image the app may not run
before it claims on any worker, when its view of the image source says so (flaps.images);
what it cannot tell, the worker refuses the same way (tests/flyd/test_image_owners.py).

On the fake fleet of tests/flaps/support.py. The workers' image source and flaps' copy of it
differ in one image, `trap:v1`: public at the workers, app demo's in flaps' copy. A create of
it that fails with nothing made anywhere was refused by flaps alone, since every worker
would have taken it.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from flaps import placement
from flaps.errors import DOMAIN as FLAPS
from flaps.errors import map_error
from flaps.images import ImageOwners
from flaps.service import LIMITS, Exchange, PlatformServicer, Workers
from flaps.v1 import machines_pb2 as m
from flaps.v1 import machines_pb2_grpc, platform_pb2, platform_pb2_grpc
from flyd.images.build import build_image
from flyd.v1 import machine_pb2 as pb
from model.errors import DOMAIN as FLYD
from model.images.owners import PUBLIC, Owners
from model.images.source import ImageSource
from tests.flaps.servicer_support import MachinesServer
from tests.flaps.support import FakeFleet, fake_fleet
from tests.flyd.support import config
from tests.servicers import T, info_of, refused, registered

REGIONS = {"w1": "ams", "w2": "ams"}
DENIED = grpc.StatusCode.PERMISSION_DENIED
Machines = machines_pb2_grpc.MachinesServiceStub
Platform = platform_pb2_grpc.PlatformServiceStub
DEMO = Owners.of("demo")


def build(root: Path, name: str, owners: Owners) -> str:
    src = root.parent / f"{name}-src"
    src.mkdir(exist_ok=True)
    (src / "app").write_text("#!/bin/sh\n")
    return build_image(src, root, name=name, tag="v1", entrypoint=["app"], owners=owners)


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[FakeFleet]:
    async with fake_fleet(tmp_path, REGIONS) as fleet:
        source = tmp_path / "source"  # the workers' (beside their public app:v1)
        build(source, "demo", DEMO)
        build(source, "shared", Owners.of("demo", ["web"]))
        build(source, "pub", PUBLIC)
        shutil.copytree(source, tmp_path / "flaps-source")
        build(source, "trap", PUBLIC)
        build(tmp_path / "flaps-source", "trap", DEMO)
        yield fleet


@pytest.fixture
def with_source() -> bool:
    """Whether flaps is given its copy of the image source (`flaps --image-source`)."""
    return True


@pytest.fixture
async def exchange(fleet: FakeFleet, tmp_path: Path, with_source: bool) -> AsyncIterator[Exchange]:
    workers = Workers(fleet.replica)
    images = ImageOwners(ImageSource(tmp_path / "flaps-source")) if with_source else None
    yield Exchange(fleet.replica, workers, placement.Pipeline(), images)
    await workers.close()


def bid(app: str, image: str) -> m.CreateMachineRequest:
    cfg = config()
    cfg.image = image
    return m.CreateMachineRequest(app=app, region="ams", config=cfg)


class TestMachinesService(MachinesServer):
    @pytest.mark.parametrize(
        ("app", "image", "owner"),
        [
            ("bapp", "demo:v1", "demo"),  # attack 11: bapp runs the demo's image
            ("bapp", "shared:v1", "demo"),
            ("bapp", "trap:v1", "demo"),  # every worker would take it: flaps refused alone
        ],
    )
    async def test_a_create_of_another_apps_image_is_refused_before_any_claim(
        self, servicer_stub: Machines, fleet: FakeFleet, app: str, image: str, owner: str
    ) -> None:
        err = await refused(servicer_stub.CreateMachine(bid(app, image), timeout=T), DENIED)
        assert (err.details() or "").startswith(
            f"config.image: image '{image}' is app {owner}'s and not shared with app {app}"
        )
        info = info_of(err)
        assert (info.domain, info.reason) == (FLAPS, "IMAGE_DENIED")
        assert dict(info.metadata) == {"field": "config.image", "image": image, "owner": owner}
        assert fleet.machine_ids() == set()

    @pytest.mark.parametrize("with_source", [False])
    async def test_what_flaps_cannot_tell_the_worker_refuses_and_nothing_is_made(
        self, servicer_stub: Machines, fleet: FakeFleet
    ) -> None:
        err = await refused(
            servicer_stub.CreateMachine(bid("bapp", "demo:v1"), timeout=T), DENIED, "config.image"
        )
        assert (info_of(err).domain, info_of(err).reason) == (FLYD, "IMAGE_DENIED")
        assert fleet.machine_ids() == set()  # final: no other worker was tried

    @pytest.mark.parametrize(
        ("app", "image"), [("demo", "demo:v1"), ("web", "shared:v1"), ("bapp", "pub:v1")]
    )
    async def test_a_create_of_an_image_the_app_may_run_is_placed(
        self, servicer_stub: Machines, app: str, image: str
    ) -> None:
        machine = (await servicer_stub.CreateMachine(bid(app, image), timeout=T)).machine
        assert (machine.app, machine.config.image) == (app, image)

    async def test_an_update_to_another_apps_image_is_refused_and_changes_nothing(
        self, servicer_stub: Machines, fleet: FakeFleet
    ) -> None:
        created = (await servicer_stub.CreateMachine(bid("web", "pub:v1"), timeout=T)).machine
        before = fleet.owner_of(created.id).worker.rows[created.id].machine
        for image in ("demo:v1", "trap:v1"):  # the second one only flaps' copy refuses
            cfg = pb.MachineConfig()
            cfg.CopyFrom(created.config)
            cfg.image = image
            request = m.UpdateMachineRequest(machine_id=created.id, config=cfg)
            err = await refused(servicer_stub.UpdateMachine(request, timeout=T), DENIED)
            assert info_of(err).domain == FLAPS
        assert fleet.owner_of(created.id).worker.rows[created.id].machine == before

    async def test_a_change_of_owners_in_the_source_is_seen_at_once(
        self, servicer_stub: Machines, tmp_path: Path
    ) -> None:
        await refused(servicer_stub.CreateMachine(bid("bapp", "trap:v1"), timeout=T), DENIED)
        build(tmp_path / "flaps-source", "trap", PUBLIC)  # the operator makes it public
        machine = (await servicer_stub.CreateMachine(bid("bapp", "trap:v1"), timeout=T)).machine
        assert machine.config.image == "trap:v1"


class TestPlatformService:
    @pytest.fixture
    def grpc_add_to_server(self) -> Callable[[Any, Any], None]:
        return registered(
            platform_pb2_grpc.add_PlatformServiceServicer_to_server,
            platform_pb2.DESCRIPTOR.services_by_name["PlatformService"],
            map_error,
            LIMITS,
        )

    @pytest.fixture
    def grpc_stub_cls(self) -> type[Platform]:
        return Platform

    @pytest.fixture
    def grpc_servicer(self, exchange: Exchange) -> PlatformServicer:
        return PlatformServicer(exchange)

    async def test_a_simulated_placement_of_another_apps_image_is_refused(
        self, servicer_stub: Platform
    ) -> None:
        bad = bid("bapp", "demo:v1")
        request = platform_pb2.SimulatePlacementRequest(
            app=bad.app, region="ams", config=bad.config
        )
        err = await refused(servicer_stub.SimulatePlacement(request, timeout=T), DENIED)
        assert info_of(err).reason == "IMAGE_DENIED"
        good = platform_pb2.SimulatePlacementRequest(app="demo", region="ams", config=bad.config)
        assert (await servicer_stub.SimulatePlacement(good, timeout=T)).fits > 0
