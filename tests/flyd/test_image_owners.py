"""flyd runs a machine only of an image its app may run (model.images.owners): a create or an
update naming another app's image is PERMISSION_DENIED naming `config.image`, before anything
is pulled or reserved, and changes nothing. flyd is the commit point: whatever flaps checked,
this is what holds for any caller of the worker (the attack: a token for app `bapp` runs
`demo:v1`, the demo's, and reads its code).

In process, on the servicer and worker of tests/flyd/test_servicer.py.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from flyd.images.build import build_image
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from model.errors import DOMAIN
from model.images.owners import NO_OWNER, PUBLIC, Owners
from tests.flyd.servicer_support import (  # the servicer tests' fixtures, used by name
    Stub,
    create,
    draining,
    flyd,
    grpc_add_to_server,
    grpc_servicer,
    grpc_stub_cls,
    heartbeat_interval,
    log_read_bytes,
    streams_per_caller,
)
from tests.flyd.support import STARTED, Flyd, config
from tests.servicers import T, info_of, refused

__all__ = [
    "draining",
    "flyd",
    "grpc_add_to_server",
    "grpc_servicer",
    "grpc_stub_cls",
    "heartbeat_interval",
    "log_read_bytes",
    "streams_per_caller",
]

DENIED = grpc.StatusCode.PERMISSION_DENIED
OWNED = {
    "demo": Owners.of("demo"),
    "shared": Owners.of("demo", ["web"]),
    "pub": PUBLIC,
    "stray": NO_OWNER,
}


@pytest.fixture(autouse=True)
def owned_images(tmp_path: Path, flyd: Flyd) -> None:
    """Beside the worker's public app:v1 (tests/flyd/support.py): demo:v1, app demo's;
    shared:v1, demo's shared with web; pub:v1, public; stray:v1, recording no owner."""
    src = tmp_path / "owned-src"
    src.mkdir()
    (src / "app").write_text("#!/bin/sh\n")
    for name, owners in OWNED.items():
        build_image(
            src, tmp_path / "source", name=name, tag="v1", entrypoint=["app"], owners=owners
        )


def of(image: str, **kw: int) -> pb.MachineConfig:
    cfg = config(**kw)
    cfg.image = image
    return cfg


@pytest.mark.parametrize(
    ("app", "image"),
    [("demo", "demo:v1"), ("web", "shared:v1"), ("bapp", "pub:v1"), ("demo", "shared:v1")],
)
async def test_a_machine_of_an_image_its_app_may_run_starts(
    servicer_stub: Stub, app: str, image: str
) -> None:
    machine = await create(servicer_stub, cfg=of(image), app=app)
    assert (machine.state, machine.config.image) == (STARTED, image)


@pytest.mark.parametrize(
    ("app", "image", "owner"),
    [
        ("bapp", "demo:v1", "demo"),  # attack 11
        ("bapp", "shared:v1", "demo"),
        ("demo", "stray:v1", ""),
        ("bapp", "demo@IMAGE_DIGEST", "demo"),  # by digest: the manifest still says whose
    ],
)
async def test_a_create_of_another_apps_image_is_denied_and_changes_nothing(
    servicer_stub: Stub, flyd: Flyd, app: str, image: str, owner: str
) -> None:
    if "IMAGE_DIGEST" in image:
        image = image.replace("IMAGE_DIGEST", flyd.worker.images.source.resolve("demo:v1").digest)
    capacity = await servicer_stub.GetCapacity(w.GetCapacityRequest(), timeout=T)
    err = await refused(create(servicer_stub, cfg=of(image), app=app), DENIED, "config.image")
    info = info_of(err)
    assert (info.domain, info.reason) == (DOMAIN, "IMAGE_DENIED")
    assert dict(info.metadata) == {"field": "config.image", "image": image, "owner": owner}
    assert f"image '{image}' " in (err.details() or "")
    # Nothing changed: no row, no log record, no image pulled, the same room.
    assert (flyd.worker.rows, flyd.store.last_seq()) == ({}, 0)
    assert (flyd.worker.images.pulls, flyd.worker.images.cached()) == (0, [])
    assert await servicer_stub.GetCapacity(w.GetCapacityRequest(), timeout=T) == capacity


async def test_an_image_cached_for_its_owner_is_still_denied_to_another_app(
    servicer_stub: Stub, flyd: Flyd
) -> None:
    await create(servicer_stub, "m1", of("demo:v1"), app="demo")  # on this worker, cached
    await refused(create(servicer_stub, "m2", of("demo:v1"), app="bapp"), DENIED, "config.image")
    assert set(flyd.worker.rows) == {"m1"}
    assert [i.refs for i in flyd.worker.images.cached() if i.ref == "demo:v1"] == [1]


@pytest.mark.parametrize("image", ["demo:v1", "stray:v1"])
async def test_an_update_to_another_apps_image_is_denied_and_changes_nothing(
    servicer_stub: Stub, flyd: Flyd, image: str
) -> None:
    await create(servicer_stub, "m1", of("shared:v1"), app="web")
    before = flyd.worker.rows["m1"].machine
    seq = flyd.store.last_seq()
    request = w.UpdateMachineRequest(machine_id="m1", config=of(image, memory=64))
    err = await refused(servicer_stub.UpdateMachine(request, timeout=T), DENIED, "config.image")
    assert info_of(err).reason == "IMAGE_DENIED"
    assert (flyd.worker.rows["m1"].machine, flyd.store.last_seq()) == (before, seq)
    assert {i.ref: i.refs for i in flyd.worker.images.cached()} == {"shared:v1": 1}


async def test_an_update_to_an_image_shared_with_the_app_replaces_it(
    servicer_stub: Stub, flyd: Flyd
) -> None:
    await create(servicer_stub, "m1", of("pub:v1"), app="web")
    request = w.UpdateMachineRequest(machine_id="m1", config=of("shared:v1"))
    machine = (await servicer_stub.UpdateMachine(request, timeout=T)).machine
    assert machine.config.image == "shared:v1"
