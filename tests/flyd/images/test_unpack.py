"""Unpacking safely: hostile layers are refused and leave nothing; links, modes and whiteouts.

Hostile layers are written by `write_layout`, bypassing the (well-behaved) builder.
"""

from __future__ import annotations

import os
import re
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from flyd.images.cache import ImageCache
from model.errors import UnsafeImage
from tests.flyd.images.support import (
    Member,
    directory,
    file,
    hardlink,
    huge_pax_header,
    images_dir_entries,
    member,
    mode_of,
    symlink,
    write_layout,
)

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
