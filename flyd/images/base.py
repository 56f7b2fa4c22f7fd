"""Base images for `nonomad image build --base`: what a directory's layer is stacked on.

A base is a file or directory on the building host, in one of three forms:

- an OCI image layout (a directory, or a tar of one): its single manifest, or the one tagged
  `latest`;
- a `docker save` archive (`manifest.json`, a config and one tar per layer);
- a bare rootfs tar, such as `mmdebstrap --variant=minbase bookworm debian.tar` writes:
  one layer (gzip, xz and bzip2 tars are stored uncompressed).

`read_base` checks it and says what it has; `copy_layers` writes its layers into a layout's
blob store (verifying each against its digest, or computing the digest of one that has
none yet). The image built on it runs on its own rootfs: the host lends it nothing.
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import hashlib
import json
import lzma
import os
import secrets
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

from model.errors import ImageError
from model.images.oci import (
    GZIP_LAYER_TYPES,
    MEDIA_TYPE_LAYER_GZIP,
    MEDIA_TYPE_LAYER_TAR,
    Descriptor,
    load_json,
)
from model.images.source import CHUNK, ResolvedImage, open_layout

__all__ = ["Base", "read_base"]

_MAX_JSON_BYTES = 4 * 1024**2


@dataclass
class _Layer:
    """One layer of a base: how to read its blob, and what it is once copied."""

    open: Callable[[], contextlib.AbstractContextManager[IO[bytes]]]
    media_type: str
    descriptor: Descriptor | None = None  # known up front (layouts), else computed on copy
    diff_id: str | None = None
    decompress: Callable[[IO[bytes]], IO[bytes]] | None = None  # stored uncompressed


@dataclass
class Base:
    """A base image: its run config (Env, User, WorkingDir, ...) and its layers."""

    description: str
    run_config: dict[str, Any]
    _layers: list[_Layer] = field(repr=False)

    def copy_layers(self, blobs: Path) -> list[tuple[Descriptor, str]]:
        """Write every layer into `blobs` (a layout's blobs/sha256); their descriptors and
        diff_ids, lowest first.
        """
        return [_copy(layer, blobs, self.description) for layer in self._layers]


def read_base(path: Path) -> Base:
    """The base image at `path` (see the module docstring); ImageError when it is none."""
    path = Path(path)
    if path.is_dir():
        if not (path / "index.json").is_file():
            raise ImageError(f"base {path}: a directory base must be an OCI image layout")
        return _from_layout(open_layout(path, tag=None))
    if not path.is_file():
        raise ImageError(f"base {path}: no such file or directory")
    names = _tar_names(path)
    if "index.json" in names and "oci-layout" in names:
        return _from_layout(open_layout(path, tag=None))
    if "manifest.json" in names:
        return _from_docker_archive(path)
    return _from_rootfs_tar(path)


def _tar_names(path: Path) -> set[str]:
    try:
        with tarfile.open(path, "r:*") as tf:
            return {m.name.removeprefix("./").strip("/") for m in tf if m.isreg()}
    except (tarfile.TarError, EOFError, OSError, lzma.LZMAError, gzip.BadGzipFile) as e:
        raise ImageError(f"base {path} is not a readable tar: {e}") from e


def _from_layout(image: ResolvedImage) -> Base:
    manifest = image.read_manifest()
    config = load_json(image.read_blob(manifest.config), f"base {image.source} config")
    diff_ids = image.read_config(manifest).diff_ids
    layers = []
    for descriptor, diff_id in zip(manifest.layers, diff_ids, strict=True):

        @contextlib.contextmanager
        def reader(d: Descriptor = descriptor) -> Iterator[IO[bytes]]:
            with image.open_blob(d) as blob:
                yield cast(IO[bytes], blob)

        media = (
            MEDIA_TYPE_LAYER_GZIP
            if descriptor.media_type in GZIP_LAYER_TYPES
            else MEDIA_TYPE_LAYER_TAR
        )
        layers.append(_Layer(reader, media, descriptor=descriptor, diff_id=diff_id))
    return Base(image.source, _run_config(config, image.source), layers)


def _from_docker_archive(path: Path) -> Base:
    with tarfile.open(path, "r:*") as tf:
        members = {m.name.removeprefix("./"): m for m in tf if m.isreg()}
        manifest = json.loads(_read_member(tf, members, "manifest.json", path))
        if (
            not isinstance(manifest, list)
            or len(manifest) != 1
            or not isinstance(manifest[0], dict)
        ):
            raise ImageError(f"base {path}: manifest.json must describe exactly one image")
        entry = manifest[0]
        config = load_json(
            _read_member(tf, members, str(entry.get("Config")), path), f"base {path}"
        )
    layer_names = entry.get("Layers")
    if not isinstance(layer_names, list) or not all(isinstance(n, str) for n in layer_names):
        raise ImageError(f"base {path}: manifest.json has no list of Layers")
    diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
    if len(diff_ids) != len(layer_names):
        raise ImageError(f"base {path}: {len(layer_names)} layers but {len(diff_ids)} diff_ids")
    layers = []
    for name, diff_id in zip(layer_names, diff_ids, strict=True):
        if name not in members:
            raise ImageError(f"base {path}: layer {name} is missing")

        @contextlib.contextmanager
        def reader(member: tarfile.TarInfo = members[name]) -> Iterator[IO[bytes]]:
            with tarfile.open(path, "r:*") as archive:
                f = archive.extractfile(member)
                assert f is not None
                with f:
                    yield f

        # `docker save` layers are plain tars: the blob's digest is the diff_id.
        layers.append(_Layer(reader, MEDIA_TYPE_LAYER_TAR, diff_id=str(diff_id)))
    return Base(str(path), _run_config(config, str(path)), layers)


def _read_member(
    tf: tarfile.TarFile, members: dict[str, tarfile.TarInfo], name: str, path: Path
) -> bytes:
    member = members.get(name)
    if member is None or member.size > _MAX_JSON_BYTES:
        raise ImageError(f"base {path}: {name} is missing or too large")
    f = tf.extractfile(member)
    assert f is not None
    with f:
        return f.read()


def _from_rootfs_tar(path: Path) -> Base:
    with open(path, "rb") as f:
        magic = f.read(6)

    @contextlib.contextmanager
    def reader() -> Iterator[IO[bytes]]:
        with open(path, "rb") as f:
            yield f

    if magic[:2] == b"\x1f\x8b":
        layer = _Layer(reader, MEDIA_TYPE_LAYER_GZIP)
    elif magic.startswith(b"\xfd7zXZ"):
        layer = _Layer(reader, MEDIA_TYPE_LAYER_TAR, decompress=_xz)
    elif magic[:3] == b"BZh":
        layer = _Layer(reader, MEDIA_TYPE_LAYER_TAR, decompress=_bz2)
    else:
        layer = _Layer(reader, MEDIA_TYPE_LAYER_TAR)
    # A bare rootfs says nothing of how to run it: a shell's PATH, the root directory.
    run_config = {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]}
    return Base(str(path), run_config, [layer])


def _xz(f: IO[bytes]) -> IO[bytes]:
    return cast(IO[bytes], lzma.open(f))


def _bz2(f: IO[bytes]) -> IO[bytes]:
    return cast(IO[bytes], bz2.open(f))


def _run_config(config: dict[str, Any], where: str) -> dict[str, Any]:
    run = config.get("config") or {}
    if not isinstance(run, dict):
        raise ImageError(f"base {where}: config is not a JSON object")
    return dict(run)


def _copy(layer: _Layer, blobs: Path, where: str) -> tuple[Descriptor, str]:
    """Stream one layer into the blob store; its descriptor and diff_id."""
    tmp = blobs / f".tmp-{secrets.token_hex(8)}"
    digest, uncompressed, size = hashlib.sha256(), hashlib.sha256(), 0
    try:
        with layer.open() as raw, tmp.open("wb") as out:
            source = layer.decompress(raw) if layer.decompress is not None else raw
            gunzip = (
                gzip.GzipFile(fileobj=cast(IO[bytes], _Tee(source, out, digest)), mode="rb")
                if layer.media_type == MEDIA_TYPE_LAYER_GZIP and layer.diff_id is None
                else None
            )
            if gunzip is not None:  # the diff_id is the digest of the tar inside
                while chunk := gunzip.read(CHUNK):
                    uncompressed.update(chunk)
                size = out.tell()
            else:
                while chunk := source.read(CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
        hex_digest = digest.hexdigest()
        if layer.descriptor is not None and layer.descriptor.digest != f"sha256:{hex_digest}":
            raise ImageError(f"base {where}: layer {layer.descriptor.digest} does not match it")
        os.replace(tmp, blobs / hex_digest)
    finally:
        tmp.unlink(missing_ok=True)
    if layer.diff_id is not None:
        diff_id = layer.diff_id
    elif layer.media_type == MEDIA_TYPE_LAYER_GZIP:
        diff_id = f"sha256:{uncompressed.hexdigest()}"
    else:
        diff_id = f"sha256:{hex_digest}"
    if layer.media_type == MEDIA_TYPE_LAYER_TAR and diff_id != f"sha256:{hex_digest}":
        raise ImageError(f"base {where}: a tar layer's digest is not its diff_id {diff_id}")
    return Descriptor(layer.media_type, f"sha256:{hex_digest}", size), diff_id


class _Tee:
    """Reads pass through to `out` and a hash: gzip reads the compressed blob through it."""

    def __init__(self, source: IO[bytes], out: IO[bytes], digest: Any) -> None:
        self._source, self._out, self._digest = source, out, digest

    def read(self, size: int = -1) -> bytes:
        chunk = self._source.read(size)
        self._digest.update(chunk)
        self._out.write(chunk)
        return chunk
