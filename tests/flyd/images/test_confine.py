"""An image's config checked at import against its own rootfs (issue 19, defect 3): a machine
never starts outside its image, whatever its WorkingDir, Entrypoint or User say."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from flyd import fsm
from flyd.images import confine
from flyd.images.cache import ImageCache
from flyd.spec import process_spec
from flyd.v1 import machine_pb2 as pb
from model.errors import UnsafeImage
from tests.flyd.images.support import directory, file, images_dir_entries, symlink, write_layout

APP = [directory("bin"), file("bin/app", b"#!/bin/sh\n", 0o755)]


@pytest.mark.parametrize(
    ("layers", "run", "message"),
    [
        pytest.param(
            [APP],
            {"Entrypoint": ["/bin/app"], "WorkingDir": "/../../../../etc"},
            "WorkingDir '/../../../../etc' leads outside its rootfs",
            id="workdir climbs out",
        ),
        pytest.param(
            [[*APP, directory("a"), symlink("a/up", "..")]],
            {"Entrypoint": ["/bin/app"], "WorkingDir": "/a/up/../.."},
            "WorkingDir '/a/up/../..' leads outside its rootfs",
            id="workdir climbs out through a symlink",
        ),
        pytest.param(
            [APP],
            {"Entrypoint": ["/../../bin/sh"]},
            "Entrypoint '/../../bin/sh' leads outside its rootfs",
            id="entrypoint climbs out",
        ),
        pytest.param(
            [APP],
            {"Cmd": ["/../../bin/sh"]},
            "Cmd '/../../bin/sh' leads outside its rootfs",
            id="cmd climbs out, without an entrypoint",
        ),
        pytest.param(
            [APP],
            {"Entrypoint": ["../../../bin/sh"], "WorkingDir": "/bin"},
            "Entrypoint '/bin/../../../bin/sh' leads outside its rootfs",
            id="relative entrypoint climbs out of its workdir",
        ),
        pytest.param(
            [[*APP, directory("etc"), file("etc/passwd", b"root:x:0:0::/:/bin/sh\n")]],
            {"Entrypoint": ["/bin/app"], "User": "mallory"},
            "no user 'mallory' in its /etc/passwd",
            id="unknown user",
        ),
        pytest.param(
            [APP],
            {"Entrypoint": ["/bin/app"], "User": "../etc"},
            "is not a valid name",
            id="user that is a path",
        ),
    ],
)
async def test_an_image_whose_config_leads_outside_its_rootfs_is_refused(
    source: Path,
    make_cache: Callable[..., ImageCache],
    layers: list[Any],
    run: dict[str, Any],
    message: str,
) -> None:
    write_layout(source, "evil", layers, run=run)
    cache = make_cache()

    with pytest.raises(UnsafeImage, match=re.escape(message)):
        await cache.pull("evil")

    assert images_dir_entries(cache.root) == []


async def test_a_workdir_through_a_symlink_to_root_stays_inside_the_rootfs(
    source: Path, make_cache: Callable[..., ImageCache]
) -> None:
    """The issue's repro: `host -> /` and WorkingDir /host ran the machine in the host's `/`.
    Resolved as in a chroot, /host is the image's own root."""
    write_layout(
        source,
        "evil",
        [[*APP, symlink("host", "/")]],
        run={"Entrypoint": ["/bin/app"], "WorkingDir": "/host/bin"},
    )
    image = await make_cache().pull("evil")

    assert image.workdir == "/bin"
    spec = process_spec(_row(image.digest), _Images(image))
    assert (spec.rootfs, spec.workdir, spec.argv) == (image.rootfs, "/bin", ["/bin/app"])
    # Where the process driver (no chroot) runs it: inside the rootfs too.
    assert confine.host_path(spec.rootfs, spec.workdir, "WorkingDir") == image.rootfs / "bin"
    assert confine.host_path(spec.rootfs, spec.argv[0], "entrypoint") == (
        image.rootfs / "bin" / "app"
    )


async def test_a_named_user_of_the_image_is_accepted(
    source: Path, make_cache: Callable[..., ImageCache]
) -> None:
    passwd = file("etc/passwd", b"root:x:0:0::/:/bin/sh\napp:x:1000:1000::/:/bin/sh\n")
    group = file("etc/group", b"app:x:1000:\n")
    write_layout(
        source,
        "good",
        [[*APP, directory("etc"), passwd, group]],
        run={"Entrypoint": ["/bin/app"], "User": "app:app", "WorkingDir": "/bin"},
    )
    image = await make_cache().pull("good")
    assert image.workdir == "/bin"


def test_the_process_driver_refuses_a_path_the_host_leads_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Resolved inside the rootfs, a path goes through no symlink; if one appears under it
    before the spawn (the rootfs changed), the host's own resolution leaves the rootfs, and
    the spawn is refused rather than run there."""
    rootfs = tmp_path / "rootfs"
    (rootfs / "bin").mkdir(parents=True)
    assert confine.host_path(rootfs, "/bin", "WorkingDir") == rootfs / "bin"
    outside = tmp_path / "outside"
    outside.mkdir()
    (rootfs / "bin").rmdir()
    (rootfs / "bin").symlink_to(outside)
    # Resolved as in a chroot, the link's absolute target stays inside the rootfs:
    assert confine.inside(rootfs, "/bin", "WorkingDir") == str(outside)
    monkeypatch.setattr(confine, "inside", lambda rootfs, path, what: "/bin")  # the race
    with pytest.raises(UnsafeImage, match="resolves outside its rootfs on the host"):
        confine.host_path(rootfs, "/bin", "WorkingDir")


def _row(digest: str) -> fsm.Row:
    machine = pb.Machine(
        id="m1", app="web", config=pb.MachineConfig(image="evil", guest=pb.GuestConfig())
    )
    return fsm.Row(machine=machine, image_digest=digest)


class _Images:
    def __init__(self, image: Any) -> None:
        self.image = image

    def get(self, digest: str) -> Any:
        return self.image
