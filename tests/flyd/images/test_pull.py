"""Sources and pulls: resolving references, unpacking into the cache once, damage detected.

Everything runs on real files.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import shutil
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from flyd.images.cache import ImageCache
from model.errors import (
    ImageError,
    ImageNotFound,
)
from model.images.source import ImageSource
from tests.flyd.images.support import (
    DIGEST,
    blob_json,
    blob_path,
    build,
    file,
    images_dir_entries,
    listdir,
    mode_of,
    put_blob,
    write_layout,
)


@pytest.mark.parametrize("arcname", [".", ""])
async def test_pull_from_a_tar_of_a_layout(
    app_dir: Path,
    source: Path,
    tmp_path: Path,
    make_cache: Callable[..., ImageCache],
    arcname: str,
) -> None:
    digest = build(app_dir, tmp_path / "built", name="app", tag="v1")
    with tarfile.open(source / "app.tar", "w") as tf:
        tf.add(tmp_path / "built" / "app", arcname=arcname)

    assert ImageSource(source).resolve("app:v1").digest == digest
    image = await make_cache().pull("app:v1")
    assert image.digest == digest
    assert (image.rootfs / "bin" / "app").read_text() == "#!/bin/sh\necho hello\n"
    # Reading the tar extracted nothing beside it.
    assert listdir(source) == ["app.tar"]


def test_resolve_by_tag_and_by_digest(app_dir: Path, source: Path) -> None:
    digest = build(app_dir, source, tag="v1")
    images = ImageSource(source)
    by_tag = images.resolve("acme/app:v1")
    by_digest = images.resolve(f"acme/app@{digest}")
    assert by_tag.digest == by_digest.digest == digest
    assert by_tag.read_manifest().layers == by_digest.read_manifest().layers


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("other:v1", "image 'other' not found"),
        ("acme/app:v9", "image 'acme/app:v9' not found .*available tags: v1, v2"),
        ("acme/app", "image 'acme/app:latest' not found .*available tags: v1, v2"),
        (f"acme/app@{DIGEST}", f"image 'acme/app@{DIGEST}' not found"),
        ("acme:v1", "image 'acme' not found"),
    ],
)
def test_resolve_unknown_image(app_dir: Path, source: Path, ref: str, message: str) -> None:
    build(app_dir, source, tag="v1")
    build(app_dir, source, tag="v2")
    with pytest.raises(ImageNotFound, match=message):
        ImageSource(source).resolve(ref)


async def test_pull_unpacks_files_with_modes_and_links(
    app_dir: Path, source: Path, make_cache: Callable[..., ImageCache]
) -> None:
    digest = build(app_dir, source)
    cache = make_cache()

    image = await cache.pull("acme/app:v1")

    assert (image.ref, image.digest, image.pulled) == ("acme/app:v1", digest, True)
    assert (image.entrypoint, image.cmd, image.workdir) == (
        ["/bin/app"],
        ["--port", "8080"],
        "/srv",
    )
    assert image.env == {"A": "1", "MODE": "prod"}
    rootfs = image.rootfs
    assert rootfs == cache.root / "images" / digest.removeprefix("sha256:") / "rootfs"
    assert (rootfs / "bin" / "app").read_text() == "#!/bin/sh\necho hello\n"
    assert mode_of(rootfs / "bin" / "app") == 0o755
    assert mode_of(rootfs / "etc" / "app.conf") == 0o640
    assert mode_of(rootfs / "bin" / "privileged") == 0o755  # setuid stripped
    assert os.readlink(rootfs / "bin" / "run") == "app"
    assert os.readlink(rootfs / "shell") == "/bin/sh"
    assert (rootfs / "empty").is_dir()
    files = [p for p in rootfs.rglob("*") if p.is_file() and not p.is_symlink()]
    links = [p for p in rootfs.rglob("*") if p.is_symlink()]
    assert image.size_bytes == sum(p.stat().st_size for p in files) + sum(
        len(os.readlink(p)) for p in links
    )
    assert cache.pulls == 1
    assert cache.get(digest) == dataclasses.replace(image, pulled=False)


async def test_second_pull_does_not_touch_the_source(
    app_dir: Path, source: Path, make_cache: Callable[..., ImageCache]
) -> None:
    digest = build(app_dir, source)
    cache = make_cache()
    await cache.pull("acme/app:v1")

    # The source is gone; the cache still serves the tag and the digest.
    shutil.rmtree(source)
    by_tag = await cache.pull("acme/app:v1")
    by_digest = await cache.pull(f"acme/app@{digest}")

    assert (by_tag.digest, by_tag.pulled) == (digest, False)
    assert (by_digest.digest, by_digest.pulled) == (digest, False)
    assert cache.pulls == 1
    with pytest.raises(ImageNotFound):
        await cache.pull("acme/app:v2")


async def test_a_moved_tag_is_pulled_again(
    app_dir: Path, source: Path, make_cache: Callable[..., ImageCache]
) -> None:
    first = build(app_dir, source)
    cache = make_cache()
    await cache.pull("acme/app:v1")

    (app_dir / "etc" / "app.conf").write_text("port=9090\n")
    second = build(app_dir, source)
    image = await cache.pull("acme/app:v1")

    assert (image.digest, image.pulled) == (second, True)
    assert (image.rootfs / "etc" / "app.conf").read_text() == "port=9090\n"
    assert {c.digest for c in cache.cached()} == {first, second}


async def test_concurrent_pulls_share_one_unpack(
    app_dir: Path, source: Path, make_cache: Callable[..., ImageCache]
) -> None:
    digest = build(app_dir, source)
    cache = make_cache()

    images = await asyncio.gather(*(cache.pull("acme/app:v1") for _ in range(5)))

    assert {image.digest for image in images} == {digest}
    assert sorted(image.pulled for image in images) == [False] * 4 + [True]
    assert cache.pulls == 1
    assert images_dir_entries(cache.root) == [digest.removeprefix("sha256:")]


def corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-10])


@pytest.mark.parametrize(
    ("blob", "damage"),
    [
        ("layer", corrupt),
        ("layer", truncate),
        ("config", corrupt),
        ("manifest", corrupt),
    ],
)
async def test_pull_detects_a_damaged_blob(
    app_dir: Path,
    source: Path,
    make_cache: Callable[..., ImageCache],
    blob: str,
    damage: Callable[[Path], None],
) -> None:
    digest = build(app_dir, source)
    layout = source / "acme" / "app"
    manifest = blob_json(layout, digest)
    target = {
        "manifest": digest,
        "config": manifest["config"]["digest"],
        "layer": manifest["layers"][0]["digest"],
    }[blob]
    damage(blob_path(layout, target))
    cache = make_cache()

    with pytest.raises(ImageError, match=f"digest mismatch for blob {target}"):
        await cache.pull("acme/app:v1")
    assert images_dir_entries(cache.root) == []
    assert cache.cached() == []


async def test_corruption_that_breaks_gzip_early_is_reported_as_a_digest_mismatch(
    source: Path, make_cache: Callable[..., ImageCache]
) -> None:
    # Big enough that decompression fails long before the last byte of the blob is read.
    payload = random.Random(0).randbytes(4 << 20)
    digest = write_layout(source, "app", [[file("noise", payload)]])
    layer = blob_json(source / "app", digest)["layers"][0]["digest"]
    path = blob_path(source / "app", layer)
    data = bytearray(path.read_bytes())
    data[20:40] = bytes(20)
    path.write_bytes(bytes(data))
    cache = make_cache()

    with pytest.raises(ImageError, match=f"digest mismatch for blob {layer}"):
        await cache.pull("app")
    assert images_dir_entries(cache.root) == []


async def test_pull_detects_a_wrong_diff_id(
    source: Path, make_cache: Callable[..., ImageCache]
) -> None:
    digest = write_layout(source, "app", [[file("a")]])
    layout = source / "app"
    manifest = blob_json(layout, digest)
    config = blob_json(layout, manifest["config"]["digest"])
    config["rootfs"]["diff_ids"] = [DIGEST]
    manifest["config"].update(put_blob(layout, json.dumps(config).encode()))
    new_manifest = put_blob(layout, json.dumps(manifest).encode())
    index = json.loads((layout / "index.json").read_text())
    index["manifests"][0].update(new_manifest)
    (layout / "index.json").write_text(json.dumps(index))

    with pytest.raises(ImageError, match=f"config says {DIGEST}"):
        await make_cache().pull("app")
