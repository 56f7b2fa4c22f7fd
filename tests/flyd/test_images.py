"""OCI images: reference parsing, the builder, sources, and the worker's cache.

Everything runs on real files. Hostile layers are written by `write_layout`, which puts
arbitrary tar members into an image layout, bypassing the (well-behaved) builder.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gzip
import hashlib
import io
import json
import os
import random
import re
import shutil
import stat
import tarfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import structlog

from flyd.errors import (
    ImageError,
    ImageNotFound,
    InvalidArgument,
    InvalidImageReference,
    UnsafeImage,
)
from flyd.images.build import build_image
from flyd.images.cache import ImageCache
from flyd.images.oci import (
    MEDIA_TYPE_CONFIG,
    MEDIA_TYPE_INDEX,
    MEDIA_TYPE_LAYER_GZIP,
    MEDIA_TYPE_MANIFEST,
    REF_NAME_ANNOTATION,
)
from flyd.images.reference import ImageRef, parse_reference
from flyd.images.source import ImageSource

HEX = "0123456789abcdef" * 4
DIGEST = f"sha256:{HEX}"

# --- helpers -----------------------------------------------------------------------------------

Member = tuple[tarfile.TarInfo, bytes | None]


def member(
    name: str,
    kind: bytes = tarfile.REGTYPE,
    *,
    data: bytes = b"",
    mode: int = 0o644,
    linkname: str = "",
) -> Member:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.linkname = linkname
    if kind == tarfile.REGTYPE:
        info.size = len(data)
        return info, data
    return info, None


def file(name: str, data: bytes = b"data", mode: int = 0o644) -> Member:
    return member(name, data=data, mode=mode)


def directory(name: str, mode: int = 0o755) -> Member:
    return member(name, tarfile.DIRTYPE, mode=mode)


def symlink(name: str, target: str) -> Member:
    return member(name, tarfile.SYMTYPE, mode=0o777, linkname=target)


def hardlink(name: str, target: str) -> Member:
    return member(name, tarfile.LNKTYPE, linkname=target)


def huge_pax_header(name: str) -> Member:
    info, data = file(name)
    info.pax_headers = {"comment": "x" * (2 << 20)}
    return info, data


def tar_bytes(members: Sequence[Member]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for info, data in members:
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def put_blob(layout: Path, data: bytes) -> dict[str, Any]:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def write_layout(
    source_root: Path,
    name: str,
    layers: Sequence[Sequence[Member]],
    *,
    tag: str = "latest",
    trailing: bytes = b"",
) -> str:
    """Write an image with the given layers (tar members, lowest layer first); returns its digest.

    `trailing` is appended to every uncompressed layer, after the end-of-archive marker.
    """
    layout = source_root / name
    layout.mkdir(parents=True, exist_ok=True)
    (layout / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    layer_descs, diff_ids = [], []
    for members in layers:
        tar = tar_bytes(members) + trailing
        diff_ids.append(f"sha256:{hashlib.sha256(tar).hexdigest()}")
        layer_descs.append(
            {"mediaType": MEDIA_TYPE_LAYER_GZIP, **put_blob(layout, gzip.compress(tar, mtime=0))}
        )
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": ["/bin/app"]},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }
    manifest = {
        "schemaVersion": 2,
        "mediaType": MEDIA_TYPE_MANIFEST,
        "config": {"mediaType": MEDIA_TYPE_CONFIG, **put_blob(layout, json.dumps(config).encode())},
        "layers": layer_descs,
    }
    manifest_desc = put_blob(layout, json.dumps(manifest).encode())
    index = {
        "schemaVersion": 2,
        "mediaType": MEDIA_TYPE_INDEX,
        "manifests": [
            {
                "mediaType": MEDIA_TYPE_MANIFEST,
                **manifest_desc,
                "annotations": {REF_NAME_ANNOTATION: tag},
            }
        ],
    }
    (layout / "index.json").write_text(json.dumps(index))
    return str(manifest_desc["digest"])


def blob_path(layout: Path, digest: str) -> Path:
    return layout / "blobs" / "sha256" / digest.removeprefix("sha256:")


def blob_json(layout: Path, digest: str) -> dict[str, Any]:
    return dict(json.loads(blob_path(layout, digest).read_bytes()))


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


class FakeClock:
    """Time that moves one second per reading, so every use has its own instant."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1
        return self.now


@pytest.fixture
def source(tmp_path: Path) -> Path:
    root = tmp_path / "source"
    root.mkdir()
    return root


@pytest.fixture
def cache_root(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def make_cache(source: Path, cache_root: Path) -> Callable[..., ImageCache]:
    def make(**kwargs: Any) -> ImageCache:
        kwargs.setdefault("max_bytes", 1 << 30)
        return ImageCache(cache_root, ImageSource(source), **kwargs)

    return make


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    src = tmp_path / "app"
    (src / "bin").mkdir(parents=True)
    (src / "bin" / "app").write_text("#!/bin/sh\necho hello\n")
    (src / "bin" / "app").chmod(0o755)
    (src / "bin" / "run").symlink_to("app")
    (src / "bin" / "privileged").write_text("#!/bin/sh\n")
    (src / "bin" / "privileged").chmod(0o4755)
    (src / "etc").mkdir()
    (src / "etc" / "app.conf").write_text("port=8080\n")
    (src / "etc" / "app.conf").chmod(0o640)
    (src / "shell").symlink_to("/bin/sh")
    (src / "empty").mkdir()
    return src


def build(app_dir: Path, source: Path, *, name: str = "acme/app", tag: str = "v1") -> str:
    return build_image(
        app_dir,
        source,
        name=name,
        tag=tag,
        entrypoint=["/bin/app"],
        cmd=["--port", "8080"],
        env={"MODE": "prod", "A": "1"},
        workdir="/srv",
    )


def listdir(path: Path) -> list[str]:
    return sorted(os.listdir(path))


def images_dir_entries(cache_root: Path) -> list[str]:
    return listdir(cache_root / "images")


# --- references --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ref", "expected", "text"),
    [
        ("app", ImageRef("app", tag="latest"), "app:latest"),
        ("app:v1", ImageRef("app", tag="v1"), "app:v1"),
        ("acme/app:1.2.3", ImageRef("acme/app", tag="1.2.3"), "acme/app:1.2.3"),
        ("a.b_c-d/e0/f:_Tag-9.x", ImageRef("a.b_c-d/e0/f", tag="_Tag-9.x"), None),
        ("app:" + "t" * 128, ImageRef("app", tag="t" * 128), None),
        (f"acme/app@{DIGEST}", ImageRef("acme/app", digest=DIGEST), None),
    ],
)
def test_parse_valid_reference(ref: str, expected: ImageRef, text: str | None) -> None:
    parsed = parse_reference(ref)
    assert parsed == expected
    assert str(parsed) == (text or ref)


@pytest.mark.parametrize(
    ("ref", "complaint"),
    [
        ("", "empty"),
        (":v1", "name is empty"),
        ("App", "component 'App'"),
        ("acme//app", "empty path component"),
        ("/app", "empty path component"),
        ("app/", "empty path component"),
        ("app..x", "component 'app..x'"),
        ("-app", "component '-app'"),
        ("app_", "component 'app_'"),
        (" app", "component ' app'"),
        ("a" * 256, "longer than 255"),
        ("app:", "tag is empty"),
        ("app:-v1", "tag '-v1'"),
        ("app:.v1", "tag '.v1'"),
        ("app:v1:v2", "tag 'v1:v2'"),
        ("app:" + "t" * 129, "tag 'ttt"),
        ("app:v/1", "tag 'v/1'"),
        ("app@sha256:abc", "digest 'sha256:abc'"),
        (f"app@md5:{HEX}", "digest 'md5:"),
        (f"app@sha256:{HEX.upper()}", "lowercase hex"),
        (f"app:v1@{DIGEST}", "either a tag or a digest"),
        ("localhost:5000/app", "tag '5000/app'"),
    ],
)
def test_parse_invalid_reference(ref: str, complaint: str) -> None:
    with pytest.raises(InvalidImageReference, match=r"config\.image: ") as caught:
        parse_reference(ref)
    assert complaint in str(caught.value)
    assert isinstance(caught.value, InvalidArgument)
    assert caught.value.field == "config.image"


# --- building ----------------------------------------------------------------------------------


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


# --- sources -----------------------------------------------------------------------------------


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


# --- pulling -----------------------------------------------------------------------------------


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


# --- unpacking safely --------------------------------------------------------------------------

UNSAFE_LAYERS: list[tuple[str, list[list[Member]], str]] = [
    ("dotdot", [[file("../escaped")]], "'../escaped' escapes the rootfs"),
    ("nested dotdot", [[file("a/../../escaped")]], "escapes the rootfs"),
    ("absolute path", [[file("/escaped")]], "'/escaped' is an absolute path"),
    ("escaping symlink", [[symlink("evil", "../..")]], "symlink 'evil' -> '../..' points outside"),
    (
        "escaping nested symlink",
        [[directory("a"), symlink("a/evil", "../../x")]],
        "symlink 'a/evil' -> '../../x' points outside",
    ),
    (
        "symlink escaping through another symlink",
        [[symlink("up", "/"), symlink("evil", "up/..")]],
        "symlink 'evil' -> 'up/..' points outside",
    ),
    (
        # x is fine when written; the second layer turns a/b into a link to the root, which
        # makes x lead above it, and then writes through x.
        "write through a symlink",
        [
            [directory("a/b"), symlink("x", "a/b/../..")],
            [symlink("a/b", "/"), file("x/escaped")],
        ],
        "entry 'x/escaped' writes through a symlink that points outside",
    ),
    (
        "symlink made to escape by a later layer",
        [[directory("a/b"), symlink("x", "a/b/../..")], [symlink("a/b", "/")]],
        "symlink 'x' -> 'a/b/../..' points outside",
    ),
    ("hardlink escape", [[hardlink("h", "../../etc/passwd")]], "escapes the rootfs"),
    ("absolute hardlink", [[hardlink("h", "/etc/passwd")]], "is an absolute path"),
    (
        "hardlink through an escaping symlink",
        [
            [directory("a/b"), symlink("x", "a/b/../..")],
            [symlink("a/b", "/"), hardlink("h", "x/etc")],
        ],
        "hardlink 'h' -> 'x/etc' points outside",
    ),
    ("char device", [[member("dev/null", tarfile.CHRTYPE)]], "'dev/null' is a device node"),
    ("block device", [[member("dev/sda", tarfile.BLKTYPE)]], "'dev/sda' is a device node"),
    ("fifo", [[member("pipe", tarfile.FIFOTYPE)]], "'pipe' is a fifo"),
    (
        "device in a later layer",
        [[file("ok")], [file("fine"), member("dev/null", tarfile.CHRTYPE)]],
        "device node",
    ),
    ("whiteout escape", [[file("a/.wh...")]], "does not name a file"),
]


@pytest.mark.parametrize(
    ("layers", "message"),
    [pytest.param(layers, message, id=case) for case, layers, message in UNSAFE_LAYERS],
)
async def test_unsafe_layer_is_rejected_and_leaves_nothing(
    source: Path,
    tmp_path: Path,
    make_cache: Callable[..., ImageCache],
    layers: list[list[Member]],
    message: str,
) -> None:
    write_layout(source, "evil", layers)
    cache = make_cache()

    with pytest.raises(UnsafeImage, match=re.escape(message)):
        await cache.pull("evil")

    assert images_dir_entries(cache.root) == []
    assert cache.cached() == []
    assert cache.pulls == 0
    assert not (tmp_path / "escaped").exists()
    assert not (cache.root / "escaped").exists()


@pytest.mark.parametrize(
    ("layers", "trailing", "limits", "message"),
    [
        pytest.param(
            [[file(f"f{i}") for i in range(5)]],
            b"",
            {"max_entries_per_image": 4},
            "over 4 entries",
            id="too many entries",
        ),
        pytest.param(
            [[file("a"), file("b")], [file("c"), file("d"), file("e")]],
            b"",
            {"max_entries_per_image": 4},
            "over 4 entries",
            id="too many entries over layers",
        ),
        pytest.param(
            [[file("big", b"x" * 200_000)]],
            b"",
            {"max_unpacked_bytes_per_image": 100_000},
            "'big' .200000 bytes. takes the image over",
            id="too many bytes",
        ),
        pytest.param(
            [[huge_pax_header("f")]],
            b"",
            {},
            "-byte extended tar header",
            id="huge pax header",
        ),
        pytest.param(
            # A few KiB of gzip that inflate to 8 MiB of zeros after the end-of-archive marker:
            # no header ever mentions those bytes.
            [[file("small")]],
            bytes(8 << 20),
            {"max_unpacked_bytes_per_image": 1 << 20},
            "decompresses to more than",
            id="gzip bomb",
        ),
    ],
)
async def test_oversized_layer_is_rejected_and_leaves_nothing(
    source: Path,
    make_cache: Callable[..., ImageCache],
    layers: list[list[Member]],
    trailing: bytes,
    limits: dict[str, int],
    message: str,
) -> None:
    write_layout(source, "big", layers, trailing=trailing)
    cache = make_cache(**limits)

    with pytest.raises(UnsafeImage, match=message):
        await cache.pull("big")
    assert images_dir_entries(cache.root) == []


async def test_links_inside_the_rootfs_are_fine(
    source: Path, tmp_path: Path, make_cache: Callable[..., ImageCache]
) -> None:
    write_layout(
        source,
        "links",
        [
            [
                directory("data"),
                # Absolute targets mean the rootfs's root, so writing through this link lands
                # in rootfs/data, not in the host's /data.
                symlink("cfg", "/data"),
                file("cfg/app.conf", b"conf"),
                symlink("bin/sh", "/bin/busybox"),
                file("bin/busybox", b"bb", mode=0o755),
                hardlink("bin/ls", "bin/busybox"),
                file("sub/../top", b"top"),
                symlink("loop-a", "loop-b"),
                symlink("loop-b", "loop-a"),
            ]
        ],
    )

    image = await make_cache().pull("links")

    rootfs = image.rootfs
    assert (rootfs / "data" / "app.conf").read_bytes() == b"conf"
    assert os.readlink(rootfs / "cfg") == "/data"
    assert os.readlink(rootfs / "bin" / "sh") == "/bin/busybox"
    assert (rootfs / "bin" / "ls").stat().st_ino == (rootfs / "bin" / "busybox").stat().st_ino
    assert (rootfs / "top").read_bytes() == b"top"
    # The hardlinked file counts once.
    assert image.size_bytes == len(b"conf") + len(b"bb") + len(b"top") + sum(
        len(t) for t in ["/data", "/bin/busybox", "loop-b", "loop-a"]
    )


async def test_modes_are_applied_after_unpacking(
    source: Path, make_cache: Callable[..., ImageCache]
) -> None:
    write_layout(
        source,
        "modes",
        [
            [directory("ro", mode=0o555), file("ro/inside", b"x", mode=0o444)],
            [file("ro/later", b"y"), file("tool", b"t", mode=0o6755), directory("tmp", 0o1777)],
        ],
    )

    image = await make_cache().pull("modes")

    rootfs = image.rootfs
    assert mode_of(rootfs / "ro") == 0o555
    assert mode_of(rootfs / "ro" / "inside") == 0o444
    assert (rootfs / "ro" / "later").read_bytes() == b"y"
    assert mode_of(rootfs / "tool") == 0o755
    assert mode_of(rootfs / "tmp") == 0o1777


async def test_whiteouts_hide_lower_layers(
    source: Path, make_cache: Callable[..., ImageCache]
) -> None:
    write_layout(
        source,
        "layered",
        [
            [
                file("a/keep"),
                file("a/gone"),
                file("b/old"),
                file("b/sub/deep"),
                file("c/x"),
                file("replaced"),
            ],
            [
                file("a/.wh.gone"),
                # An opaque directory keeps only what this layer puts in it, before or after
                # the marker.
                file("b/early"),
                file("b/.wh..wh..opq"),
                file("b/late"),
                file(".wh.c"),
                file(".wh.never-existed"),
                directory("replaced"),
            ],
            [file("c/again")],
        ],
    )

    image = await make_cache().pull("layered")

    tree = sorted(str(p.relative_to(image.rootfs)) for p in image.rootfs.rglob("*"))
    assert tree == ["a", "a/keep", "b", "b/early", "b/late", "c", "c/again", "replaced"]
    assert (image.rootfs / "replaced").is_dir()


# --- the cache: eviction and restarts ----------------------------------------------------------


def write_sized_images(source: Path, names: Sequence[str], size: int = 10_000) -> dict[str, str]:
    """One image per name, each holding one file of `size` bytes; returns name -> digest."""
    return {
        name: write_layout(source, name, [[file("blob", name.encode() * size)]]) for name in names
    }


def size_of(name: str, size: int = 10_000) -> int:
    return len(name.encode()) * size


async def test_eviction_drops_least_recently_used_first(
    source: Path, make_cache: Callable[..., ImageCache]
) -> None:
    digests = write_sized_images(source, ["aa", "bb", "cc"])
    cache = make_cache(max_bytes=2 * size_of("aa"), clock=FakeClock())

    await cache.pull("aa")
    await cache.pull("bb")
    await cache.pull("aa")  # aa is now more recent than bb
    await cache.pull("cc")

    assert [c.ref for c in cache.cached()] == ["cc:latest", "aa:latest"]
    assert cache.get(digests["bb"]) is None
    assert images_dir_entries(cache.root) == sorted(
        digests[n].removeprefix("sha256:") for n in ["aa", "cc"]
    )
    assert cache.total_bytes <= cache.max_bytes


async def test_eviction_never_drops_a_referenced_image(
    source: Path, make_cache: Callable[..., ImageCache]
) -> None:
    digests = write_sized_images(source, ["aa", "bb", "cc", "dd"])
    cache = make_cache(max_bytes=2 * size_of("aa"), clock=FakeClock())

    await cache.pull("aa")
    cache.use(digests["aa"])  # a machine runs aa
    await cache.pull("bb")
    await cache.pull("cc")  # aa is the oldest but held: bb goes
    assert {c.digest for c in cache.cached()} == {digests["aa"], digests["cc"]}

    cache.release(digests["aa"])  # the machine stops: aa is now the most recent
    await cache.pull("dd")  # so cc goes
    assert {c.digest for c in cache.cached()} == {digests["aa"], digests["dd"]}


async def test_cache_stays_over_its_bound_when_everything_is_in_use(
    source: Path, make_cache: Callable[..., ImageCache]
) -> None:
    digests = write_sized_images(source, ["aa", "bb", "cc"])
    cache = make_cache(max_bytes=size_of("aa"), clock=FakeClock())

    for name in ["aa", "bb"]:
        await cache.pull(name)
        cache.use(digests[name])
    with structlog.testing.capture_logs() as logs:
        image = await cache.pull("cc")

    # The new image itself is kept even though it alone fills the cache: its caller is about
    # to use it.
    assert {c.digest for c in cache.cached()} == set(digests.values())
    assert image.rootfs.is_dir()
    assert cache.total_bytes > cache.max_bytes
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["image_cache_over_bound"]
    assert [(c.digest, c.refs) for c in cache.cached() if c.refs] == [
        (digests["bb"], 1),
        (digests["aa"], 1),
    ]


async def test_use_of_an_unknown_image_fails(make_cache: Callable[..., ImageCache]) -> None:
    cache = make_cache()
    with pytest.raises(ImageNotFound):
        cache.use(DIGEST)
    cache.release(DIGEST)  # harmless
    assert cache.get(DIGEST) is None


async def test_restart_keeps_the_cache(
    source: Path, cache_root: Path, tmp_path: Path, make_cache: Callable[..., ImageCache]
) -> None:
    digests = write_sized_images(source, ["aa", "bb", "cc"])
    clock = FakeClock()
    cache = make_cache(max_bytes=2 * size_of("aa"), clock=clock)
    await cache.pull("aa")
    await cache.pull("bb")
    await cache.pull("aa")
    before = cache.cached()
    cache.flush()  # as flyd does periodically and on shutdown: recency is only a hint
    # A crash mid-unpack left a scratch directory behind.
    scratch = cache_root / "images" / f".tmp-{HEX}-dead"
    (scratch / "rootfs").mkdir(parents=True)

    # flyd restarts; the source is now somewhere else entirely.
    empty = tmp_path / "empty"
    empty.mkdir()
    restarted = ImageCache(cache_root, ImageSource(empty), max_bytes=2 * size_of("aa"), clock=clock)

    assert restarted.cached() == before
    assert not scratch.exists()
    image = restarted.get(digests["aa"])
    assert image is not None
    assert (image.rootfs / "blob").read_bytes() == b"aa" * 10_000
    again = await restarted.pull("aa")
    assert (again.digest, again.pulled) == (digests["aa"], False)

    # Recency survived too: bb is still the least recently used.
    restarted.source = ImageSource(source)
    await restarted.pull("cc")
    assert {c.digest for c in restarted.cached()} == {digests["aa"], digests["cc"]}


async def test_recency_is_saved_by_flush_not_by_every_use(
    source: Path, cache_root: Path, make_cache: Callable[..., ImageCache]
) -> None:
    digests = write_sized_images(source, ["aa"])
    cache = make_cache(max_bytes=10 * size_of("aa"))
    await cache.pull("aa")
    saved = (cache_root / "index.json").read_bytes()
    cache.use(digests["aa"])
    cache.release(digests["aa"])
    await cache.pull("aa")  # a hit
    assert (cache_root / "index.json").read_bytes() == saved
    cache.flush()
    assert (cache_root / "index.json").read_bytes() != saved


async def test_a_rebuilt_tag_is_seen_without_rereading_an_unchanged_source(
    source: Path, make_cache: Callable[..., ImageCache], tmp_path: Path
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("one")
    first = build_image(src, source, name="app", tag="v1", entrypoint=["x"])
    cache = make_cache(max_bytes=1 << 30)
    assert (await cache.pull("app:v1")).digest == first
    assert (await cache.pull("app:v1")).digest == first
    (src / "f").write_text("two")
    second = build_image(src, source, name="app", tag="v1", entrypoint=["x"])
    assert second != first
    assert (await cache.pull("app:v1")).digest == second
