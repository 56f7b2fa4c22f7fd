"""The image builder: an OCI layout, built the same every time, tags added and replaced,
bad arguments refused.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import pytest

from flyd.images.build import build_image
from model.errors import (
    InvalidArgument,
    InvalidImageReference,
)
from model.images.oci import (
    MEDIA_TYPE_INDEX,
    MEDIA_TYPE_LAYER_GZIP,
    MEDIA_TYPE_MANIFEST,
    REF_NAME_ANNOTATION,
)
from model.images.source import ImageSource
from tests.flyd.images.support import (
    blob_json,
    blob_path,
    build,
)


def test_build_writes_an_oci_layout(app_dir: Path, source: Path) -> None:
    digest = build(app_dir, source)

    layout = source / "acme" / "app"
    assert json.loads((layout / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads((layout / "index.json").read_text())
    assert index["mediaType"] == MEDIA_TYPE_INDEX
    [entry] = index["manifests"]
    assert (entry["digest"], entry["annotations"]) == (digest, {REF_NAME_ANNOTATION: "v1"})
    manifest = blob_json(layout, digest)
    assert manifest["mediaType"] == MEDIA_TYPE_MANIFEST
    [layer] = manifest["layers"]
    assert layer["mediaType"] == MEDIA_TYPE_LAYER_GZIP
    config = blob_json(layout, manifest["config"]["digest"])
    assert config["config"] == {
        "Entrypoint": ["/bin/app"],
        "Cmd": ["--port", "8080"],
        "Env": ["A=1", "MODE=prod"],
        "WorkingDir": "/srv",
        # No base: the OCI driver lends it the host's runtime.
        "Labels": {"dev.nonomad.host-runtime": "true"},
    }
    tar = gzip.decompress(blob_path(layout, layer["digest"]).read_bytes())
    assert config["rootfs"]["diff_ids"] == [f"sha256:{hashlib.sha256(tar).hexdigest()}"]
    with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
        members = {m.name: m for m in tf}
    assert list(members) == sorted(members)
    assert {(m.uid, m.gid, m.mtime) for m in members.values()} == {(0, 0, 0)}
    assert members["shell"].linkname == "/bin/sh"


def test_build_is_deterministic(app_dir: Path, tmp_path: Path) -> None:
    first = build(app_dir, tmp_path / "one")
    # Touching every file changes nothing the image records.
    for path in [app_dir, *app_dir.rglob("*")]:
        os.utime(path, (1_700_000_000, 1_700_000_000), follow_symlinks=False)
    second = build(app_dir, tmp_path / "two")

    assert first == second
    blobs_one = tmp_path / "one" / "acme" / "app" / "blobs" / "sha256"
    blobs_two = tmp_path / "two" / "acme" / "app" / "blobs" / "sha256"
    assert sorted(p.name for p in blobs_one.iterdir()) == sorted(
        p.name for p in blobs_two.iterdir()
    )

    (app_dir / "etc" / "app.conf").write_text("port=9090\n")
    assert build(app_dir, tmp_path / "three") != first


def test_build_adds_and_replaces_tags(app_dir: Path, source: Path) -> None:
    v1 = build(app_dir, source, tag="v1")
    (app_dir / "etc" / "app.conf").write_text("port=9090\n")
    v2 = build(app_dir, source, tag="v2")
    (app_dir / "etc" / "app.conf").write_text("port=7070\n")
    v1_again = build(app_dir, source, tag="v1")

    layout = source / "acme" / "app"
    index = json.loads((layout / "index.json").read_text())
    tags = {m["annotations"][REF_NAME_ANNOTATION]: m["digest"] for m in index["manifests"]}
    assert tags == {"v1": v1_again, "v2": v2}
    assert v1 != v1_again
    assert ImageSource(source).resolve("acme/app:v1").digest == v1_again
    # Scratch files from the atomic writes are all gone.
    leftovers = [p for p in layout.rglob("*") if p.name.startswith(".")]
    assert leftovers == []


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"name": "Acme"}, InvalidImageReference),
        ({"tag": "-x"}, InvalidImageReference),
        ({"workdir": "srv"}, InvalidArgument),
        ({"env": {"A=B": "1"}}, InvalidArgument),
    ],
)
def test_build_rejects_bad_arguments(
    app_dir: Path, source: Path, kwargs: dict[str, Any], error: type[Exception]
) -> None:
    args: dict[str, Any] = {"name": "app", "tag": "v1", "entrypoint": ["/bin/app"], **kwargs}
    with pytest.raises(error):
        build_image(app_dir, source, **args)
    assert list(source.iterdir()) == []


@pytest.mark.parametrize(
    ("ports", "env", "exposed", "port_env"),
    [
        ([8000], {}, {"8000/tcp": {}}, "8000"),
        ([9000, 8000], {}, {"8000/tcp": {}, "9000/tcp": {}}, "9000"),  # the first is $PORT
        ([8000], {"PORT": "7000"}, {"8000/tcp": {}}, "7000"),  # the caller's PORT wins
    ],
)
def test_ports_become_exposed_ports_and_the_image_port(
    app_dir: Path,
    source: Path,
    ports: list[int],
    env: dict[str, str],
    exposed: dict[str, Any],
    port_env: str,
) -> None:
    build_image(
        app_dir, source, name="site", tag="v1", entrypoint=["python3"], env=env, ports=ports
    )
    image = ImageSource(source).resolve("site:v1")
    config = image.read_config(image.read_manifest())
    assert config.ports == tuple(sorted(ports))
    assert config.env["PORT"] == port_env
    raw = blob_json(source / "site", image.read_manifest().config.digest)
    assert raw["config"]["ExposedPorts"] == exposed


def test_a_port_out_of_range_is_refused_and_nothing_is_written(app_dir: Path, source: Path) -> None:
    with pytest.raises(InvalidArgument) as err:
        build_image(app_dir, source, name="site", tag="v1", entrypoint=["x"], ports=[0])
    assert err.value.field == "port"
    assert not (source / "site").exists()
