"""The OCI image format as nonomad reads and writes it (flyd, flaps and the CLI): media types,
digests, descriptors, and the index, manifest and config JSON.

Parsing checks every field flyd relies on and names the offending blob in its ImageError;
digests are sha256 only, since a digest becomes a file name under `blobs/`. JSON flyd writes
is canonical (the same structure always hashes to the same digest) and written atomically.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model.errors import ImageError

__all__ = [
    "DIGEST_RE",
    "GZIP_LAYER_TYPES",
    "HOST_RUNTIME_LABEL",
    "INDEX_TYPES",
    "MANIFEST_TYPES",
    "MEDIA_TYPE_CONFIG",
    "MEDIA_TYPE_INDEX",
    "MEDIA_TYPE_LAYER_GZIP",
    "MEDIA_TYPE_LAYER_TAR",
    "MEDIA_TYPE_MANIFEST",
    "REF_NAME_ANNOTATION",
    "Descriptor",
    "ImageConfig",
    "Manifest",
    "canonical_json",
    "digest_hex",
    "load_json",
    "parse_config",
    "parse_index",
    "parse_manifest",
    "write_atomic",
]

MEDIA_TYPE_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_TYPE_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_TYPE_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_TYPE_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
MEDIA_TYPE_LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
REF_NAME_ANNOTATION = "org.opencontainers.image.ref.name"

# `docker save` and older registries speak Docker's media types for the same structures.
MANIFEST_TYPES = {MEDIA_TYPE_MANIFEST, "application/vnd.docker.distribution.manifest.v2+json"}
INDEX_TYPES = {MEDIA_TYPE_INDEX, "application/vnd.docker.distribution.manifest.list.v2+json"}
_CONFIG_TYPES = {MEDIA_TYPE_CONFIG, "application/vnd.docker.container.image.v1+json"}
GZIP_LAYER_TYPES = {MEDIA_TYPE_LAYER_GZIP, "application/vnd.docker.image.rootfs.diff.tar.gzip"}
_TAR_LAYER_TYPES = {MEDIA_TYPE_LAYER_TAR, "application/vnd.docker.image.rootfs.diff.tar"}

DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class Descriptor:
    """An OCI content descriptor: what a blob is, its digest and its size."""

    media_type: str
    digest: str
    size: int
    annotations: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, obj: object, where: str) -> Descriptor:
        """Validate a descriptor read from JSON; `where` names it in errors."""
        if not isinstance(obj, dict):
            raise ImageError(f"{where}: descriptor is not a JSON object")
        media_type = obj.get("mediaType", "")
        digest = obj.get("digest")
        size = obj.get("size")
        annotations = _annotations(obj, where)
        if not isinstance(media_type, str):
            raise ImageError(f"{where}: mediaType is not a string")
        # The digest becomes a file name under blobs/, so anything but sha256 hex is refused
        # before it gets near a path.
        if not isinstance(digest, str) or not DIGEST_RE.fullmatch(digest):
            raise ImageError(f"{where}: unsupported digest {digest!r} (only sha256 is supported)")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ImageError(f"{where}: size {size!r} is not a non-negative integer")
        return cls(media_type=media_type, digest=digest, size=size, annotations=annotations)

    def to_json(self) -> dict[str, Any]:
        """The descriptor as it appears in an index or manifest."""
        obj: dict[str, Any] = {
            "mediaType": self.media_type,
            "digest": self.digest,
            "size": self.size,
        }
        if self.annotations:
            obj["annotations"] = dict(self.annotations)
        return obj


def _annotations(obj: dict[str, Any], where: str) -> dict[str, str]:
    """The `annotations` of a descriptor or manifest: a map of strings, or none."""
    annotations = obj.get("annotations") or {}
    if not isinstance(annotations, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in annotations.items()
    ):
        raise ImageError(f"{where}: annotations are not a map of strings")
    return annotations


# The label `nonomad image build` puts on an image built from a directory with no base.
HOST_RUNTIME_LABEL = "dev.nonomad.host-runtime"


@dataclass(frozen=True)
class Manifest:
    """An image manifest: its config blob and its layers, lowest first."""

    config: Descriptor
    layers: tuple[Descriptor, ...]
    # Who may run the image is recorded here (model.images.owners), among whatever else.
    annotations: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ImageConfig:
    """The parts of an image config a worker needs to run the image."""

    entrypoint: list[str]
    cmd: list[str]
    env: dict[str, str]
    workdir: str
    diff_ids: tuple[str, ...]
    user: str = ""
    # Built from a bare directory (no base): it needs the host's runtime to run anything.
    host_runtime: bool = False
    # The TCP ports its command serves on (ExposedPorts): what a machine of it publishes
    # when its config names no services (`nonomad machines run`).
    ports: tuple[int, ...] = ()


def digest_hex(digest: str) -> str:
    """The hex part of a sha256 digest: the name of its blob and of its cache entry."""
    if not DIGEST_RE.fullmatch(digest):
        raise ImageError(f"unsupported digest {digest!r} (only sha256 is supported)")
    return digest.removeprefix("sha256:")


def canonical_json(obj: object) -> bytes:
    """Sorted keys and no whitespace: the same structure always hashes to the same digest."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def load_json(data: bytes, what: str) -> dict[str, Any]:
    """Parse a JSON object; ImageError names `what` if it is not one."""
    try:
        obj = json.loads(data)
    except ValueError as exc:
        raise ImageError(f"{what} is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise ImageError(f"{what} is not a JSON object")
    return obj


def parse_manifest(data: bytes, descriptor: Descriptor) -> Manifest:
    """Parse a single-platform image manifest whose layers are tar or tar+gzip."""
    what = f"manifest {descriptor.digest}"
    obj = load_json(data, what)
    if obj.get("schemaVersion") != 2:
        raise ImageError(f"{what}: schemaVersion is {obj.get('schemaVersion')!r}, not 2")
    media_type = obj.get("mediaType") or descriptor.media_type
    if media_type in INDEX_TYPES:
        raise ImageError(f"{what} is an image index; multi-platform images are not supported")
    if media_type and media_type not in MANIFEST_TYPES:
        raise ImageError(f"{what} has unsupported media type {media_type!r}")
    config = Descriptor.parse(obj.get("config"), f"{what} config")
    if config.media_type and config.media_type not in _CONFIG_TYPES:
        raise ImageError(f"{what}: config has unsupported media type {config.media_type!r}")
    raw_layers = obj.get("layers")
    if not isinstance(raw_layers, list):
        raise ImageError(f"{what}: layers is not a list")
    layers = tuple(
        Descriptor.parse(layer, f"{what} layer {i}") for i, layer in enumerate(raw_layers)
    )
    for layer in layers:
        if layer.media_type not in GZIP_LAYER_TYPES | _TAR_LAYER_TYPES:
            raise ImageError(
                f"layer {layer.digest} has media type {layer.media_type!r}; flyd unpacks "
                "only tar and tar+gzip layers",
            )
    return Manifest(config=config, layers=layers, annotations=_annotations(obj, what))


def _string_list(value: object, what: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ImageError(f"image config {what} is not a list of strings")
    return list(value)


def _exposed_tcp(value: object, what: str) -> tuple[int, ...]:
    """ExposedPorts' TCP ports ({"8000/tcp": {}, "53/udp": {}} -> (8000,)), sorted."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ImageError(f"{what}: ExposedPorts is not a JSON object")
    ports = set()
    for key in value:
        number, _, proto = str(key).partition("/")
        if (proto or "tcp") != "tcp":
            continue
        if not number.isdigit() or not 0 < int(number) < 65536:
            raise ImageError(f"{what}: ExposedPorts: {str(key)[:32]!r} is not PORT[/tcp|/udp]")
        ports.add(int(number))
    return tuple(sorted(ports))


def parse_config(data: bytes, descriptor: Descriptor) -> ImageConfig:
    """Parse the run config and layer diff_ids out of an image config."""
    what = f"image config {descriptor.digest}"
    obj = load_json(data, what)
    run = obj.get("config") or {}
    if not isinstance(run, dict):
        raise ImageError(f"{what}: config is not a JSON object")
    env: dict[str, str] = {}
    for item in _string_list(run.get("Env"), "Env"):
        key, _, value = item.partition("=")
        env[key] = value
    workdir = run.get("WorkingDir") or "/"
    if not isinstance(workdir, str):
        raise ImageError(f"{what}: WorkingDir is not a string")
    rootfs = obj.get("rootfs")
    if not isinstance(rootfs, dict) or rootfs.get("type") != "layers":
        raise ImageError(f"{what}: rootfs is not of type 'layers'")
    diff_ids = _string_list(rootfs.get("diff_ids"), "rootfs.diff_ids")
    for diff_id in diff_ids:
        if not DIGEST_RE.fullmatch(diff_id):
            raise ImageError(f"{what}: unsupported diff_id {diff_id!r}")
    user = run.get("User") or ""
    if not isinstance(user, str):
        raise ImageError(f"{what}: User is not a string")
    labels = run.get("Labels") or {}
    if not isinstance(labels, dict):
        raise ImageError(f"{what}: Labels is not a JSON object")
    return ImageConfig(
        ports=_exposed_tcp(run.get("ExposedPorts"), what),
        entrypoint=_string_list(run.get("Entrypoint"), "Entrypoint"),
        cmd=_string_list(run.get("Cmd"), "Cmd"),
        env=env,
        workdir=workdir,
        diff_ids=tuple(diff_ids),
        user=user,
        host_runtime=labels.get(HOST_RUNTIME_LABEL) == "true",
    )


def parse_index(data: bytes, where: str) -> list[Descriptor]:
    """The manifest descriptors of an image layout's index.json."""
    obj = load_json(data, where)
    manifests = obj.get("manifests")
    if not isinstance(manifests, list):
        raise ImageError(f"{where}: manifests is not a list")
    return [Descriptor.parse(m, f"{where} manifest {i}") for i, m in enumerate(manifests)]


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data`: a reader sees the old file or the new one, never a part."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
