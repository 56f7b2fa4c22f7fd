"""Helpers of the image tests: hostile image layouts and the builder's test app.

`write_layout` puts arbitrary tar members (`file`, `symlink`, `hardlink`, ...) into an OCI
image layout, bypassing the (well-behaved) builder; `build` builds the app of the `app_dir`
fixture (tests/flyd/images/conftest.py) with the real builder.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import stat
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flyd.images.build import build_image
from model.images.oci import (
    MEDIA_TYPE_CONFIG,
    MEDIA_TYPE_INDEX,
    MEDIA_TYPE_LAYER_GZIP,
    MEDIA_TYPE_MANIFEST,
    REF_NAME_ANNOTATION,
)

HEX = "0123456789abcdef" * 4


DIGEST = f"sha256:{HEX}"


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
    run: dict[str, Any] | None = None,
) -> str:
    """Write an image with the given layers (tar members, lowest layer first); returns its digest.

    `trailing` is appended to every uncompressed layer, after the end-of-archive marker. `run`
    is the image config's run config (default: Entrypoint /bin/app).
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
        "config": run if run is not None else {"Entrypoint": ["/bin/app"]},
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
