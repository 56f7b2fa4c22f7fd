"""Attack 11 of issue 27 against real processes, over TLS with tokens as `nonomad up` runs
them: a token for app `bapp` runs a machine of `demo:v1`, the demo's, and reads its code.

Refused at flaps before any worker is claimed on, and refused at the worker when called
directly as flaps calls it (the `flaps` certificate); an update to it and a deploy naming it
are refused too, and nothing changes. The image's owner, an app it is shared with, and any
app for a public image run theirs.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from flyd.images.build import build_image
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from flyd.v1 import worker_pb2_grpc
from model.images.owners import PUBLIC, Owners
from nonomad.client import PermissionDenied, state_name
from nonomad.deploy import deploy
from nonomad.security import ClusterSecurity
from tests.conftest import DEMO_APP
from tests.deploy.support import make_spec
from tests.flaps.conftest import Fleet
from tests.harness import channel, error_info

T = 30  # RPC deadline, s


def config(image: str) -> pb.MachineConfig:
    return pb.MachineConfig(
        image=image,
        guest=pb.GuestConfig(cpu_millicores=100, memory_mib=64),
        services=[pb.ServiceConfig(internal_port=8080)],
    )


@pytest.fixture
def images(tmp_path: Path) -> Path:
    """demo:v1, the demo app's (as `nonomad up` builds it); shared:v1, demo's shared with
    web; pub:v1, public. All three the demo's HTTP server."""
    src = tmp_path / "demo-src"
    src.mkdir()
    (src / "app.py").write_text(DEMO_APP)
    root = tmp_path / "images"
    for name, owners in [
        ("demo", Owners.of("demo")),
        ("shared", Owners.of("demo", ["web"])),
        ("pub", PUBLIC),
    ]:
        entrypoint = ["python3", "-u", "app.py"]
        build_image(src, root, name=name, tag="v1", entrypoint=entrypoint, owners=owners)
    return root


async def test_a_token_for_bapp_runs_no_machine_of_the_demos_image(
    tmp_path: Path, images: Path, security: ClusterSecurity
) -> None:
    fleet = Fleet(tmp_path, images, security=security)
    try:
        fleet.add_worker("ams-1", "ams")
        fleet.add_flaps()
        await fleet.until_alive()
        worker = fleet.worker("ams-1")

        async def on_the_worker() -> dict[str, str]:
            listed = await worker.ListMachines(w.ListMachinesRequest(), timeout=T)
            return {m.id: m.config.image for m in listed.machines}

        bapp = security.keyring().mint(["apps = bapp", "ops = deploy"])
        async with fleet.client(token=bapp) as client:
            # At flaps: before any claim.
            with pytest.raises(PermissionDenied) as caught:
                await client.create_machine("bapp", config("demo:v1"), region="ams")
            denied = caught.value
            assert denied.message.startswith(
                "config.image: image 'demo:v1' is app demo's and not shared with app bapp"
            )
            assert (denied.reason, denied.metadata) == (
                "IMAGE_DENIED",
                {"field": "config.image", "image": "demo:v1", "owner": "demo"},
            )
            assert await on_the_worker() == {}

            # A public image is bapp's to run; an update of it to the demo's is refused.
            mine = await client.create_machine("bapp", config("pub:v1"), region="ams")
            before = await client.get_machine(mine.id)
            with pytest.raises(PermissionDenied) as caught:
                await client.update_machine(mine.id, config("demo:v1"))
            assert caught.value.reason == "IMAGE_DENIED"
            after = await client.get_machine(mine.id)
            assert (after.config, after.instance_id) == (before.config, before.instance_id)

            # A deploy naming it fails before it changes anything.
            report = await deploy(
                client, make_spec(app="bapp", image="demo:v1", regions={"ams": 1}, standbys=0)
            )
            assert not report.ok
            assert "config.image: image 'demo:v1' is app demo's" in report.reason, report.reason
            assert (report.created, report.updated, report.undone) == ([], [], [])
            assert await on_the_worker() == {mine.id: "pub:v1"}

        # At the worker, called directly as flaps calls it: the commit point refuses too.
        as_flaps = channel(fleet.workers["ams-1"].address, security.member_tls("flaps"))
        try:
            direct = worker_pb2_grpc.WorkerServiceStub(as_flaps)
            request = w.CreateMachineRequest(app="bapp", config=config("demo:v1"))
            with pytest.raises(grpc.aio.AioRpcError) as rpc:
                await direct.CreateMachine(request, timeout=T)
        finally:
            await as_flaps.close()
        assert rpc.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert error_info(rpc.value) == (
            "IMAGE_DENIED",
            "flyd.nonomad",
            {"field": "config.image", "image": "demo:v1", "owner": "demo"},
        )
        assert await on_the_worker() == {mine.id: "pub:v1"}

        # Whose it is, and whom it is shared with, run it.
        async with fleet.client() as admin:  # the admin's token: any app, but each app's images
            for app, image in [("demo", "demo:v1"), ("web", "shared:v1")]:
                made = await admin.create_machine(app, config(image), region="ams")
                started = await admin.wait_machine(made.id, "started", wait=T)
                assert (started.app, state_name(started.state)) == (app, "started")
            with pytest.raises(PermissionDenied):
                await admin.create_machine("bapp", config("shared:v1"), region="ams")
    finally:
        await fleet.close()
