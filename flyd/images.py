"""OCI images for flyd: references, a small builder, image sources and the worker's image cache.

An image lives in an *image source* as an OCI image layout (a directory with `oci-layout`,
`index.json` and `blobs/sha256/...`) or as a tar of one. A worker pulls it into its
content-addressed `ImageCache`: every blob is checked against its digest, the layers are
unpacked (in a scratch directory, renamed into place only when complete) into a rootfs that
machines share, and the least recently used images nobody holds are evicted when the cache
grows past its bound.

Layers are untrusted input. Unpacking never lets an entry land outside the rootfs (absolute
paths, `..`, symlinks and hardlinks pointing out, writes through such symlinks), refuses
device nodes and fifos, strips setuid/setgid bits and stops as soon as an image unpacks to
more bytes or entries than allowed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import gzip
import hashlib
import json
import os
import platform
import re
import secrets
import shutil
import stat
import tarfile
import time
import zlib
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol, Self, cast

import structlog

from flyd.errors import (
    ImageError,
    ImageNotFound,
    InvalidArgument,
    InvalidImageReference,
    UnsafeImage,
)

__all__ = [
    "MEDIA_TYPE_CONFIG",
    "MEDIA_TYPE_INDEX",
    "MEDIA_TYPE_LAYER_GZIP",
    "MEDIA_TYPE_MANIFEST",
    "REF_NAME_ANNOTATION",
    "BlobReader",
    "CachedImage",
    "Descriptor",
    "Image",
    "ImageCache",
    "ImageConfig",
    "ImageRef",
    "ImageSource",
    "Manifest",
    "ResolvedImage",
    "build_image",
    "parse_reference",
]

_log = structlog.get_logger(__name__)

MEDIA_TYPE_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_TYPE_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_TYPE_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_TYPE_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
MEDIA_TYPE_LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
REF_NAME_ANNOTATION = "org.opencontainers.image.ref.name"

# `docker save` and older registries speak Docker's media types for the same structures.
_MANIFEST_TYPES = {MEDIA_TYPE_MANIFEST, "application/vnd.docker.distribution.manifest.v2+json"}
_INDEX_TYPES = {MEDIA_TYPE_INDEX, "application/vnd.docker.distribution.manifest.list.v2+json"}
_CONFIG_TYPES = {MEDIA_TYPE_CONFIG, "application/vnd.docker.container.image.v1+json"}
_GZIP_LAYER_TYPES = {MEDIA_TYPE_LAYER_GZIP, "application/vnd.docker.image.rootfs.diff.tar.gzip"}
_TAR_LAYER_TYPES = {MEDIA_TYPE_LAYER_TAR, "application/vnd.docker.image.rootfs.diff.tar"}

_GIB = 1024**3
# index.json, manifests and configs are read whole into memory; registries cap manifests at
# 4 MiB, and nothing legitimate comes close.
_MAX_JSON_BYTES = 4 * 1024**2
_CHUNK = 1024**2
# Linux follows at most 40 symlinks per lookup; following more than that ourselves means we
# check at least every path the kernel could reach, while a symlink loop still ends.
_MAX_SYMLINK_HOPS = 255
# Pax and GNU long-name headers are read whole into memory by tarfile; real ones hold a path
# or a few attributes.
_MAX_EXTENDED_HEADER_BYTES = 1024**2
_EXTENDED_HEADER_TYPES = {
    tarfile.XHDTYPE,
    tarfile.XGLTYPE,
    tarfile.SOLARIS_XHDTYPE,
    tarfile.GNUTYPE_LONGNAME,
    tarfile.GNUTYPE_LONGLINK,
}

_NAME_COMPONENT_RE = re.compile(r"[a-z0-9]+(?:[._-][a-z0-9]+)*")
_TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
_HEX64_RE = re.compile(r"[0-9a-f]{64}")
_MAX_NAME_LENGTH = 255

_WHITEOUT_PREFIX = ".wh."
_OPAQUE_WHITEOUT = ".wh..wh..opq"

# Scratch entries in the cache's images/ directory start with a dot, so a scan after a crash
# can tell them from finished images (named by bare digest hex) and drop them.
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"


# --- references ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImageRef:
    """A parsed image reference: a name and either a tag or a manifest digest."""

    name: str
    tag: str | None = None
    digest: str | None = None

    def __str__(self) -> str:
        if self.digest is not None:
            return f"{self.name}@{self.digest}"
        return f"{self.name}:{self.tag or 'latest'}"


def parse_reference(ref: str) -> ImageRef:
    """Parse `name:tag`, `name` (tag `latest`) or `name@sha256:<64 hex>`.

    Raises InvalidImageReference saying what is wrong.
    """
    if not ref:
        raise InvalidImageReference("image reference is empty")
    if "@" in ref:
        name, digest = ref.split("@", 1)
        if ":" in name:
            raise InvalidImageReference(
                f"{ref!r}: give either a tag or a digest, not both",
            )
        _check_name(name, ref)
        if not _DIGEST_RE.fullmatch(digest):
            raise InvalidImageReference(
                f"{ref!r}: digest {digest!r} is not 'sha256:' followed by 64 lowercase hex digits",
            )
        return ImageRef(name=name, digest=digest)
    name, sep, tag = ref.partition(":")
    _check_name(name, ref)
    if not sep:
        return ImageRef(name=name, tag="latest")
    _check_tag(tag, ref)
    return ImageRef(name=name, tag=tag)


def _check_name(name: str, ref: str) -> None:
    if not name:
        raise InvalidImageReference(f"{ref!r}: image name is empty")
    if len(name) > _MAX_NAME_LENGTH:
        raise InvalidImageReference(
            f"{ref!r}: image name is longer than {_MAX_NAME_LENGTH} characters",
        )
    for component in name.split("/"):
        if not component:
            raise InvalidImageReference(
                f"{ref!r}: image name {name!r} has an empty path component",
            )
        if not _NAME_COMPONENT_RE.fullmatch(component):
            raise InvalidImageReference(
                f"{ref!r}: image name component {component!r} must be lowercase letters and "
                "digits, optionally separated by single '.', '_' or '-'",
            )


def _check_tag(tag: str, ref: str) -> None:
    if not tag:
        raise InvalidImageReference(f"{ref!r}: tag is empty")
    if not _TAG_RE.fullmatch(tag):
        raise InvalidImageReference(
            f"{ref!r}: tag {tag!r} must be 1 to 128 letters, digits, '_', '.' or '-', "
            "not starting with '.' or '-'",
        )


# --- OCI structures ---------------------------------------------------------------------------


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
        annotations = obj.get("annotations") or {}
        if not isinstance(media_type, str):
            raise ImageError(f"{where}: mediaType is not a string")
        # The digest becomes a file name under blobs/, so anything but sha256 hex is refused
        # before it gets near a path.
        if not isinstance(digest, str) or not _DIGEST_RE.fullmatch(digest):
            raise ImageError(f"{where}: unsupported digest {digest!r} (only sha256 is supported)")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ImageError(f"{where}: size {size!r} is not a non-negative integer")
        if not isinstance(annotations, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in annotations.items()
        ):
            raise ImageError(f"{where}: annotations are not a map of strings")
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


@dataclass(frozen=True)
class Manifest:
    """An image manifest: its config blob and its layers, lowest first."""

    config: Descriptor
    layers: tuple[Descriptor, ...]


@dataclass(frozen=True)
class ImageConfig:
    """The parts of an image config a worker needs to run the image."""

    entrypoint: list[str]
    cmd: list[str]
    env: dict[str, str]
    workdir: str
    diff_ids: tuple[str, ...]


def _digest_hex(digest: str) -> str:
    if not _DIGEST_RE.fullmatch(digest):
        raise ImageError(f"unsupported digest {digest!r} (only sha256 is supported)")
    return digest.removeprefix("sha256:")


def _canonical_json(obj: object) -> bytes:
    # Sorted keys and no whitespace: the same structure always hashes to the same digest.
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _load_json(data: bytes, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except ValueError as exc:
        raise ImageError(f"{what} is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise ImageError(f"{what} is not a JSON object")
    return obj


def _parse_manifest(data: bytes, descriptor: Descriptor) -> Manifest:
    what = f"manifest {descriptor.digest}"
    obj = _load_json(data, what)
    if obj.get("schemaVersion") != 2:
        raise ImageError(f"{what}: schemaVersion is {obj.get('schemaVersion')!r}, not 2")
    media_type = obj.get("mediaType") or descriptor.media_type
    if media_type in _INDEX_TYPES:
        raise ImageError(f"{what} is an image index; multi-platform images are not supported")
    if media_type and media_type not in _MANIFEST_TYPES:
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
        if layer.media_type not in _GZIP_LAYER_TYPES | _TAR_LAYER_TYPES:
            raise ImageError(
                f"layer {layer.digest} has media type {layer.media_type!r}; flyd unpacks "
                "only tar and tar+gzip layers",
            )
    return Manifest(config=config, layers=layers)


def _string_list(value: object, what: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ImageError(f"image config {what} is not a list of strings")
    return list(value)


def _parse_config(data: bytes, descriptor: Descriptor) -> ImageConfig:
    what = f"image config {descriptor.digest}"
    obj = _load_json(data, what)
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
        if not _DIGEST_RE.fullmatch(diff_id):
            raise ImageError(f"{what}: unsupported diff_id {diff_id!r}")
    return ImageConfig(
        entrypoint=_string_list(run.get("Entrypoint"), "Entrypoint"),
        cmd=_string_list(run.get("Cmd"), "Cmd"),
        env=env,
        workdir=workdir,
        diff_ids=tuple(diff_ids),
    )


# --- building ---------------------------------------------------------------------------------


class _HashingWriter:
    """Passes writes through while hashing and counting them."""

    def __init__(self, out: IO[bytes] | gzip.GzipFile) -> None:
        self._out = out
        self.hash = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.hash.update(data)
        self.size += len(data)
        self._out.write(data)
        return len(data)

    def flush(self) -> None:
        self._out.flush()

    @property
    def digest(self) -> str:
        return f"sha256:{self.hash.hexdigest()}"


def _host_architecture() -> str:
    machine = platform.machine().lower()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def build_image(
    src_dir: Path,
    source_root: Path,
    *,
    name: str,
    tag: str,
    entrypoint: Sequence[str],
    cmd: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    workdir: str = "/",
) -> str:
    """Turn `src_dir` into a one-layer OCI image tagged `name:tag` under `source_root`.

    The layout is `source_root/<name>` (a name's path components become nested directories);
    other tags already in it are kept and an earlier image with this tag is replaced. The
    build is deterministic: the same tree and arguments always give the same digest (entries
    sorted, owners and mtimes zeroed, no gzip timestamp). File modes and symlinks are kept.
    Returns the manifest digest, `sha256:<hex>`.
    """
    ref = f"{name}:{tag}"
    _check_name(name, ref)
    _check_tag(tag, ref)
    env = dict(env or {})
    if not workdir.startswith("/"):
        raise InvalidArgument("workdir", f"{workdir!r} is not an absolute path")
    for key in env:
        if not key or "=" in key:
            raise InvalidArgument("env", f"variable name {key!r} is empty or contains '='")
    src_dir = Path(src_dir)
    if not src_dir.is_dir():
        raise ImageError(f"cannot build {ref}: {src_dir} is not a directory")

    layout = Path(source_root).joinpath(*name.split("/"))
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)
    _write_atomic(layout / "oci-layout", _canonical_json({"imageLayoutVersion": "1.0.0"}))

    layer, diff_id = _write_layer(src_dir, blobs)
    config = {
        "architecture": _host_architecture(),
        "os": "linux",
        "config": {
            "Entrypoint": list(entrypoint),
            "Cmd": list(cmd),
            # Sorted so that equal mappings give equal digests whatever their insertion order.
            "Env": [f"{k}={v}" for k, v in sorted(env.items())],
            "WorkingDir": workdir,
        },
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }
    config_desc = _write_blob(blobs, _canonical_json(config), MEDIA_TYPE_CONFIG)
    manifest = {
        "schemaVersion": 2,
        "mediaType": MEDIA_TYPE_MANIFEST,
        "config": config_desc.to_json(),
        "layers": [layer.to_json()],
    }
    manifest_desc = dataclasses.replace(
        _write_blob(blobs, _canonical_json(manifest), MEDIA_TYPE_MANIFEST),
        annotations={REF_NAME_ANNOTATION: tag},
    )
    _add_to_index(layout, manifest_desc, tag)
    return manifest_desc.digest


def _write_layer(src_dir: Path, blobs: Path) -> tuple[Descriptor, str]:
    tmp = blobs / f"{_TMP_PREFIX}{secrets.token_hex(8)}"
    try:
        with tmp.open("wb") as out:
            compressed = _HashingWriter(out)
            # filename="" and mtime=0 keep the build time and host path out of the header.
            with gzip.GzipFile(
                filename="", mode="wb", fileobj=compressed, mtime=0, compresslevel=6
            ) as gz:
                uncompressed = _HashingWriter(gz)
                stream = cast(IO[bytes], uncompressed)
                with tarfile.open(fileobj=stream, mode="w|", format=tarfile.PAX_FORMAT) as tf:
                    _add_tree(tf, src_dir, "")
        os.replace(tmp, blobs / compressed.hash.hexdigest())
    finally:
        tmp.unlink(missing_ok=True)
    layer = Descriptor(MEDIA_TYPE_LAYER_GZIP, compressed.digest, compressed.size)
    return layer, uncompressed.digest


def _add_tree(tf: tarfile.TarFile, directory: Path | str, prefix: str) -> None:
    with os.scandir(directory) as scan:
        entries = sorted(scan, key=lambda e: e.name)
    for entry in entries:
        info = tarfile.TarInfo(prefix + entry.name)
        st = entry.stat(follow_symlinks=False)
        info.mode = stat.S_IMODE(st.st_mode)
        info.mtime = 0
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        if stat.S_ISLNK(st.st_mode):
            info.type = tarfile.SYMTYPE
            info.linkname = os.readlink(entry.path)
            tf.addfile(info)
        elif stat.S_ISDIR(st.st_mode):
            info.type = tarfile.DIRTYPE
            tf.addfile(info)
            _add_tree(tf, entry.path, f"{info.name}/")
        elif stat.S_ISREG(st.st_mode):
            info.size = st.st_size
            with open(entry.path, "rb") as f:
                tf.addfile(info, f)
        else:
            raise ImageError(f"cannot put {entry.path} in an image: not a file, dir or symlink")


def _write_blob(blobs: Path, data: bytes, media_type: str) -> Descriptor:
    hex_digest = hashlib.sha256(data).hexdigest()
    path = blobs / hex_digest
    if not path.exists():
        _write_atomic(path, data)
    return Descriptor(media_type, f"sha256:{hex_digest}", len(data))


def _write_atomic(path: Path, data: bytes) -> None:
    # A reader sees the old file or the new one, never a partial write.
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _add_to_index(layout: Path, manifest: Descriptor, tag: str) -> None:
    # Two builds of different tags of one name must not lose each other's entry, so the
    # read-modify-write holds a lock on the layout directory itself (no stray lock file).
    fd = os.open(layout, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        index_path = layout / "index.json"
        manifests: list[Descriptor] = []
        if index_path.exists():
            manifests = _parse_index(index_path.read_bytes(), str(index_path))
        manifests = [m for m in manifests if m.annotations.get(REF_NAME_ANNOTATION) != tag]
        manifests.append(manifest)
        manifests.sort(key=lambda m: (m.annotations.get(REF_NAME_ANNOTATION, ""), m.digest))
        index = {
            "schemaVersion": 2,
            "mediaType": MEDIA_TYPE_INDEX,
            "manifests": [m.to_json() for m in manifests],
        }
        _write_atomic(index_path, _canonical_json(index))
    finally:
        os.close(fd)


def _parse_index(data: bytes, where: str) -> list[Descriptor]:
    obj = _load_json(data, where)
    manifests = obj.get("manifests")
    if not isinstance(manifests, list):
        raise ImageError(f"{where}: manifests is not a list")
    return [Descriptor.parse(m, f"{where} manifest {i}") for i, m in enumerate(manifests)]


# --- sources ----------------------------------------------------------------------------------


class _Layout(Protocol):
    description: str

    def read_index(self) -> bytes: ...

    def blob(self, hex_digest: str) -> contextlib.AbstractContextManager[tuple[IO[bytes], int]]:
        """Open a blob; yields the stream and the blob's actual size."""
        ...


class _DirLayout:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.description = str(path)

    def read_index(self) -> bytes:
        with (self.path / "index.json").open("rb") as f:
            data = f.read(_MAX_JSON_BYTES + 1)
        if len(data) > _MAX_JSON_BYTES:
            raise ImageError(f"{self.path}/index.json is larger than {_MAX_JSON_BYTES} bytes")
        return data

    @contextlib.contextmanager
    def blob(self, hex_digest: str) -> Iterator[tuple[IO[bytes], int]]:
        try:
            f = (self.path / "blobs" / "sha256" / hex_digest).open("rb")
        except FileNotFoundError:
            raise ImageError(f"blob sha256:{hex_digest} is missing from {self.path}") from None
        with f:
            yield f, os.fstat(f.fileno()).st_size


class _TarLayout:
    """An image layout inside a tar, read in place: only the members asked for are read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.description = str(path)
        self._members: dict[str, tarfile.TarInfo] = {}
        try:
            with tarfile.open(path, "r:*") as tf:
                # Reads headers only (the data is skipped), so listing a big tar is cheap.
                for member in tf:
                    if member.isreg():
                        self._members[_normalize_member_name(member.name)] = member
        except (tarfile.TarError, EOFError, zlib.error) as exc:
            raise ImageError(f"{path} is not a readable tar: {exc}") from exc

    def read_index(self) -> bytes:
        member = self._members.get("index.json")
        if member is None:
            raise ImageNotFound(f"{self.path} has no index.json")
        if member.size > _MAX_JSON_BYTES:
            raise ImageError(f"{self.path}: index.json is larger than {_MAX_JSON_BYTES} bytes")
        with self._open(member) as f:
            return f.read()

    @contextlib.contextmanager
    def blob(self, hex_digest: str) -> Iterator[tuple[IO[bytes], int]]:
        member = self._members.get(f"blobs/sha256/{hex_digest}")
        if member is None:
            raise ImageError(f"blob sha256:{hex_digest} is missing from {self.path}")
        with self._open(member) as f:
            yield f, member.size

    @contextlib.contextmanager
    def _open(self, member: tarfile.TarInfo) -> Iterator[IO[bytes]]:
        # A fresh TarFile per read keeps no file open between calls (a source may hold many
        # images) and lets threads read one tar at once; the member header was found already,
        # so this seeks straight to its data.
        with tarfile.open(self.path, "r:*") as tf:
            f = tf.extractfile(member)
            if f is None:
                raise ImageError(f"{self.path}: {member.name} is not a regular file")
            with f:
                yield f


def _normalize_member_name(name: str) -> str:
    parts = [p for p in name.split("/") if p not in ("", ".")]
    return "/".join(parts)


class BlobReader:
    """Reads one blob, checking its size and sha256 digest against its descriptor.

    The check runs as soon as the last byte is read; `verify()` reads whatever is left and
    checks. A mismatch raises ImageError("digest mismatch for blob ...").
    """

    def __init__(self, stream: IO[bytes], descriptor: Descriptor) -> None:
        self.descriptor = descriptor
        self._stream = stream
        self._hash = hashlib.sha256()
        self._remaining = descriptor.size
        self._verified = False
        self._error: ImageError | None = None

    def read(self, size: int = -1) -> bytes:
        """Read up to `size` bytes (all that is left if negative), never past the declared size."""
        if self._error is not None:
            raise self._error
        if size < 0 or size > self._remaining:
            size = self._remaining
        if size == 0:
            self._check()
            return b""
        data = self._stream.read(size)
        if not data:
            self._fail(f"it ended after {self.descriptor.size - self._remaining} bytes")
        self._hash.update(data)
        self._remaining -= len(data)
        if self._remaining == 0:
            self._check()
        return data

    def verify(self) -> None:
        """Read the rest of the blob and raise ImageError unless it matches its descriptor."""
        while not self._verified:
            self.read(_CHUNK)

    def blame(self) -> None:
        """After a consumer of this blob failed: raise a digest mismatch if the blob is corrupt.

        A corrupt layer usually breaks gzip or tar parsing before its last byte is hashed;
        reporting the mismatch says what is actually wrong. Does nothing if the blob is fine
        or cannot be read further.
        """
        with contextlib.suppress(OSError, EOFError):
            self.verify()

    def _check(self) -> None:
        if self._verified:
            return
        if self._stream.read(1):
            self._fail(f"it is longer than {self.descriptor.size} bytes")
        actual = self._hash.hexdigest()
        if f"sha256:{actual}" != self.descriptor.digest:
            self._fail(f"its content hashes to sha256:{actual}")
        self._verified = True

    def _fail(self, why: str) -> None:
        self._error = ImageError(f"digest mismatch for blob {self.descriptor.digest}: {why}")
        raise self._error


@dataclass(frozen=True)
class ResolvedImage:
    """An image found in a source: its reference and manifest descriptor, ready to be read."""

    ref: ImageRef
    manifest: Descriptor
    source: str
    _layout: _Layout = field(repr=False, compare=False)

    @property
    def digest(self) -> str:
        """The manifest digest, which names the image in the cache."""
        return self.manifest.digest

    @contextlib.contextmanager
    def open_blob(self, descriptor: Descriptor) -> Iterator[BlobReader]:
        """Open a blob of this image for reading; the reader verifies digest and size."""
        with self._layout.blob(_digest_hex(descriptor.digest)) as (stream, actual_size):
            if actual_size != descriptor.size:
                raise ImageError(
                    f"digest mismatch for blob {descriptor.digest}: it is {actual_size} bytes, "
                    f"its descriptor says {descriptor.size}",
                )
            yield BlobReader(stream, descriptor)

    def read_blob(self, descriptor: Descriptor) -> bytes:
        """Read a small (JSON) blob whole, verified."""
        if descriptor.size > _MAX_JSON_BYTES:
            raise ImageError(
                f"blob {descriptor.digest} is {descriptor.size} bytes; manifests and configs "
                f"may be at most {_MAX_JSON_BYTES}",
            )
        chunks: list[bytes] = []
        with self.open_blob(descriptor) as blob:
            while chunk := blob.read(_CHUNK):
                chunks.append(chunk)
            blob.verify()
        return b"".join(chunks)

    def read_manifest(self) -> Manifest:
        """Read and verify the manifest."""
        return _parse_manifest(self.read_blob(self.manifest), self.manifest)

    def read_config(self, manifest: Manifest) -> ImageConfig:
        """Read and verify the image config the manifest names."""
        return _parse_config(self.read_blob(manifest.config), manifest.config)


class ImageSource:
    """Where a worker pulls images from.

    An image named `n` is an OCI image layout directory `root/n/` or a tar of one at
    `root/n.tar`.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def resolve(self, ref: str | ImageRef) -> ResolvedImage:
        """Find the manifest for `ref` by tag annotation or manifest digest.

        Raises ImageNotFound naming the image and the tags the source has, or ImageError if
        the layout is malformed. Blocks on file I/O: call it from a thread in async code.
        """
        image_ref = parse_reference(ref) if isinstance(ref, str) else ref
        layout = self._open_layout(image_ref)
        try:
            manifests = _parse_index(layout.read_index(), f"{layout.description}/index.json")
        except FileNotFoundError:
            raise ImageNotFound(
                f"image {str(image_ref)!r} not found: {layout.description} has no index.json",
            ) from None
        if image_ref.digest is not None:
            matches = [m for m in manifests if m.digest == image_ref.digest]
        else:
            matches = [
                m for m in manifests if m.annotations.get(REF_NAME_ANNOTATION) == image_ref.tag
            ]
        if not matches:
            tags = sorted(
                {
                    m.annotations[REF_NAME_ANNOTATION]
                    for m in manifests
                    if REF_NAME_ANNOTATION in m.annotations
                },
            )
            raise ImageNotFound(
                f"image {str(image_ref)!r} not found in {layout.description}; "
                f"available tags: {', '.join(tags) or 'none'}",
            )
        # A tag names one manifest; if a layout repeats it, the last entry is the newest.
        manifest = matches[-1]
        if manifest.media_type in _INDEX_TYPES:
            raise ImageError(
                f"image {str(image_ref)!r} is a multi-platform image index; flyd needs a "
                "single-platform manifest",
            )
        if manifest.media_type and manifest.media_type not in _MANIFEST_TYPES:
            raise ImageError(
                f"image {str(image_ref)!r}: unsupported media type {manifest.media_type!r}",
            )
        return ResolvedImage(
            ref=image_ref, manifest=manifest, source=layout.description, _layout=layout
        )

    def signature(self, ref: ImageRef) -> tuple[int, int, int] | None:
        """A cheap fingerprint of where the ref's tags live (its index.json or tar), or None.

        When it is unchanged, a tag still names the digest it named before: the cache can skip
        reading and parsing the index on every pull of a cached image.
        """
        directory = self.root.joinpath(*ref.name.split("/"))
        for path in (directory / "index.json", directory.with_name(directory.name + ".tar")):
            try:
                st = path.stat()
            except OSError:
                continue
            return (st.st_ino, st.st_mtime_ns, st.st_size)
        return None

    def _open_layout(self, ref: ImageRef) -> _Layout:
        directory = self.root.joinpath(*ref.name.split("/"))
        if (directory / "index.json").is_file():
            return _DirLayout(directory)
        archive = directory.with_name(directory.name + ".tar")
        if archive.is_file():
            return _TarLayout(archive)
        raise ImageNotFound(
            f"image {ref.name!r} not found: no {directory} layout or {archive} in the source",
        )


# --- unpacking --------------------------------------------------------------------------------


class _Escape(Exception):
    """A path resolution left the rootfs."""


class _Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


def _archive_path(name: str, what: str) -> list[str]:
    """Split an archive path into components, resolving `.` and `..` lexically."""
    if name.startswith("/"):
        raise UnsafeImage(f"{what} {name!r} is an absolute path")
    parts: list[str] = []
    for part in name.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                raise UnsafeImage(f"{what} {name!r} escapes the rootfs with '..'")
            parts.pop()
        else:
            parts.append(part)
    return parts


def _resolve(root: str, start: Sequence[str], path: str, *, follow_last: bool) -> list[str]:
    """Resolve `path` from directory `start` (components under `root`) like a chrooted kernel.

    Symlinks are followed by reading them here, never by the kernel, with absolute targets
    taken relative to `root`. Returns the real components, none of which is a symlink
    (except the last when not `follow_last`). Raises _Escape if `..` climbs above `root`.
    """
    resolved = [] if path.startswith("/") else list(start)
    pending = [p for p in reversed(path.split("/")) if p not in ("", ".")]
    hops = 0
    while pending:
        part = pending.pop()
        if part == "..":
            if not resolved:
                raise _Escape
            resolved.pop()
            continue
        if pending or follow_last:
            candidate = os.path.join(root, *resolved, part)
            try:
                st = os.lstat(candidate)
            except (FileNotFoundError, NotADirectoryError):
                resolved.append(part)
                continue
            if stat.S_ISLNK(st.st_mode):
                hops += 1
                if hops > _MAX_SYMLINK_HOPS:
                    raise ImageError(f"too many levels of symbolic links at {candidate}")
                target = os.readlink(candidate)
                if target.startswith("/"):
                    resolved = []
                pending.extend(p for p in reversed(target.split("/")) if p not in ("", "."))
                continue
        resolved.append(part)
    return resolved


class _BoundedTarInfo(tarfile.TarInfo):
    """A TarInfo that refuses oversized extended headers before tarfile reads them."""

    @classmethod
    def frombuf(cls, buf: bytes | bytearray, encoding: str, errors: str) -> Self:
        info = super().frombuf(buf, encoding, errors)
        if info.type in _EXTENDED_HEADER_TYPES and info.size > _MAX_EXTENDED_HEADER_BYTES:
            raise UnsafeImage(
                f"layer has a {info.size}-byte extended tar header; at most "
                f"{_MAX_EXTENDED_HEADER_BYTES} are allowed",
            )
        return info


class _CountingReader:
    """The uncompressed tar stream of a layer: hashed for its diff_id and bounded in size."""

    def __init__(self, inner: _Readable, unpacker: _Unpacker, layer: Descriptor) -> None:
        self._inner = inner
        self._unpacker = unpacker
        self._layer = layer
        self.hash = hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        # Bounded reads only: an unbounded read of a gzip bomb would fill memory before any
        # count could stop it.
        if size < 0 or size > _CHUNK:
            size = _CHUNK
        data = self._inner.read(size)
        self.hash.update(data)
        self._unpacker.count_stream(len(data), self._layer)
        return data

    def drain(self) -> None:
        # Padding and anything after the end-of-archive marker still belong to the diff_id,
        # and still count against the size limit.
        while self.read(_CHUNK):
            pass


class _Unpacker:
    """Applies layers, in order, to one rootfs directory, refusing anything unsafe."""

    def __init__(self, rootfs: Path, *, max_bytes: int, max_entries: int) -> None:
        self.root = str(rootfs)
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.entries = 0
        self.stream_bytes = 0
        self.written_bytes = 0
        os.mkdir(self.root, 0o755)
        # Directory modes are applied at the end: a read-only directory must stay writable
        # while later entries and layers land in it.
        self._dir_modes: dict[tuple[str, ...], int] = {}
        # Paths (and their parents) the current layer wrote, which an opaque whiteout keeps.
        self._layer_paths: set[tuple[str, ...]] = set()

    def count_stream(self, n: int, layer: Descriptor) -> None:
        # Headers alone cannot be trusted with the size of a gzip bomb (zero blocks after the
        # end-of-archive marker, huge pax headers), so the decompressed stream is counted too.
        self.stream_bytes += n
        if self.stream_bytes > self.max_bytes:
            raise UnsafeImage(
                f"layer {layer.digest} decompresses to more than the "
                f"{self.max_bytes} bytes an image may unpack to",
            )

    def apply_layer(self, blob: BlobReader, layer: Descriptor) -> str:
        """Unpack one layer from `blob`; returns the digest of its uncompressed tar (diff_id)."""
        self._layer_paths = set()
        gz = None
        source: _Readable = blob
        if layer.media_type in _GZIP_LAYER_TYPES:
            # GzipFile only reads forward here; it never seeks the blob.
            gz = gzip.GzipFile(fileobj=cast(IO[bytes], blob), mode="rb")
            source = gz
        stream = _CountingReader(source, self, layer)
        try:
            with tarfile.open(
                fileobj=cast(IO[bytes], stream), mode="r|", tarinfo=_BoundedTarInfo
            ) as tf:
                for member in tf:
                    self._apply_member(tf, member, layer)
            stream.drain()
        except (tarfile.TarError, zlib.error, EOFError) as exc:
            raise ImageError(f"layer {layer.digest} is not a valid tar archive: {exc}") from exc
        except gzip.BadGzipFile as exc:
            raise ImageError(f"layer {layer.digest} is not valid gzip: {exc}") from exc
        finally:
            if gz is not None:
                gz.close()
        return f"sha256:{stream.hash.hexdigest()}"

    def finish(self) -> int:
        """Check every symlink of the final tree, apply directory modes; returns the size."""
        size = 0
        seen: set[tuple[int, int]] = set()
        for dirpath, dirnames, filenames in os.walk(self.root):
            rel = os.path.relpath(dirpath, self.root)
            parent = [] if rel == "." else rel.split(os.sep)
            for name in dirnames + filenames:
                path = os.path.join(dirpath, name)
                st = os.lstat(path)
                if stat.S_ISLNK(st.st_mode):
                    # A later layer can turn a directory a symlink passes through into another
                    # symlink; only the final tree says where each one really leads.
                    target = os.readlink(path)
                    self._check_symlink("/".join([*parent, name]), parent, target)
                    size += st.st_size
                elif stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    size += st.st_size
        for parts in sorted(self._dir_modes, key=len, reverse=True):
            path = self._path(parts)
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISDIR(os.lstat(path).st_mode):
                    os.chmod(path, self._dir_modes[parts])
        return size

    def _path(self, parts: Sequence[str]) -> str:
        return os.path.join(self.root, *parts)

    def _apply_member(
        self, tf: tarfile.TarFile, member: tarfile.TarInfo, layer: Descriptor
    ) -> None:
        self.entries += 1
        if self.entries > self.max_entries:
            raise UnsafeImage(
                f"layer {layer.digest} takes the image over {self.max_entries} entries",
            )
        name = member.name
        parts = _archive_path(name, "entry")
        if parts and parts[-1].startswith(_WHITEOUT_PREFIX):
            self._whiteout(name, parts)
            return
        if member.ischr() or member.isblk():
            raise UnsafeImage(f"entry {name!r} is a device node, which images may not contain")
        if member.isfifo():
            raise UnsafeImage(f"entry {name!r} is a fifo, which images may not contain")
        if not parts:
            if member.isdir():
                return  # the rootfs itself
            raise UnsafeImage(f"entry {name!r} would replace the rootfs itself")
        parent = self._parent_dir(name, parts[:-1])
        dest_parts = (*parent, parts[-1])
        self._mark_written(dest_parts)
        dest = self._path(dest_parts)
        if member.isdir():
            self._make_dir(dest, dest_parts, member.mode)
        elif member.issym():
            self._check_symlink(name, parent, member.linkname)
            self._remove(dest)
            os.symlink(member.linkname, dest)
        elif member.islnk():
            self._make_hardlink(name, dest, member.linkname)
        elif member.isreg():
            self._write_file(tf, member, dest)
        else:
            raise ImageError(f"entry {name!r} has unsupported tar type {member.type!r}")

    def _parent_dir(self, name: str, parts: list[str]) -> list[str]:
        try:
            real = _resolve(self.root, [], "/".join(parts), follow_last=True)
        except _Escape:
            raise UnsafeImage(
                f"entry {name!r} writes through a symlink that points outside the rootfs",
            ) from None
        for i in range(1, len(real) + 1):
            prefix = real[:i]
            path = self._path(prefix)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                os.mkdir(path, 0o755)
                self._mark_written(tuple(prefix))
                continue
            if not stat.S_ISDIR(st.st_mode):
                raise ImageError(f"entry {name!r}: {'/'.join(prefix)!r} is not a directory")
        return real

    def _check_symlink(self, name: str, parent: Sequence[str], target: str) -> None:
        if not target:
            raise ImageError(f"symlink {name!r} has an empty target")
        try:
            _resolve(self.root, parent, target, follow_last=True)
        except _Escape:
            raise UnsafeImage(
                f"symlink {name!r} -> {target!r} points outside the rootfs",
            ) from None
        except ImageError:
            pass  # a symlink loop: the kernel refuses to follow it, so it leads nowhere

    def _mark_written(self, parts: tuple[str, ...]) -> None:
        for i in range(1, len(parts) + 1):
            self._layer_paths.add(parts[:i])

    def _make_dir(self, dest: str, parts: tuple[str, ...], mode: int) -> None:
        try:
            st = os.lstat(dest)
        except FileNotFoundError:
            st = None
        if st is None or not stat.S_ISDIR(st.st_mode):
            self._remove(dest)
            os.mkdir(dest, 0o755)
        self._dir_modes[parts] = _safe_mode(mode)

    def _make_hardlink(self, name: str, dest: str, linkname: str) -> None:
        what = f"hardlink {name!r} target"
        link_parts = _archive_path(linkname, what)
        if not link_parts:
            raise UnsafeImage(f"{what} {linkname!r} is the rootfs itself")
        try:
            parent = _resolve(self.root, [], "/".join(link_parts[:-1]), follow_last=True)
        except _Escape:
            raise UnsafeImage(
                f"hardlink {name!r} -> {linkname!r} points outside the rootfs",
            ) from None
        source = self._path([*parent, link_parts[-1]])
        try:
            st = os.lstat(source)
        except FileNotFoundError:
            raise ImageError(f"{what} {linkname!r} does not exist") from None
        if stat.S_ISDIR(st.st_mode):
            raise ImageError(f"{what} {linkname!r} is a directory")
        if source == dest:
            return
        self._remove(dest)
        # follow_symlinks=False links a symlink itself, never what it points at.
        os.link(source, dest, follow_symlinks=False)

    def _write_file(self, tf: tarfile.TarFile, member: tarfile.TarInfo, dest: str) -> None:
        if member.size > self.max_bytes - self.written_bytes:
            raise UnsafeImage(
                f"entry {member.name!r} ({member.size} bytes) takes the image over the "
                f"{self.max_bytes} bytes it may unpack to",
            )
        source = tf.extractfile(member)
        if source is None:
            raise ImageError(f"entry {member.name!r} has no data")
        self._remove(dest)
        # O_EXCL|O_NOFOLLOW: the file is new, so nothing is written through an old link.
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with os.fdopen(os.open(dest, flags, 0o600), "wb") as out:
            # Counted as written rather than trusted from the header.
            while chunk := source.read(_CHUNK):
                self.written_bytes += len(chunk)
                if self.written_bytes > self.max_bytes:
                    raise UnsafeImage(
                        f"entry {member.name!r} takes the image over the {self.max_bytes} "
                        "bytes it may unpack to",
                    )
                out.write(chunk)
            os.fchmod(out.fileno(), _safe_mode(member.mode))
        with contextlib.suppress(OverflowError, ValueError, OSError):
            os.utime(dest, (member.mtime, member.mtime))

    def _whiteout(self, name: str, parts: list[str]) -> None:
        try:
            parent = _resolve(self.root, [], "/".join(parts[:-1]), follow_last=True)
        except _Escape:
            raise UnsafeImage(
                f"whiteout {name!r} reaches through a symlink that points outside the rootfs",
            ) from None
        base = parts[-1]
        if base == _OPAQUE_WHITEOUT:
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISDIR(os.lstat(self._path(parent)).st_mode):
                    self._prune(tuple(parent))
            return
        victim = base.removeprefix(_WHITEOUT_PREFIX)
        if victim in ("", ".", ".."):
            raise UnsafeImage(f"whiteout {name!r} does not name a file")
        self._remove(self._path([*parent, victim]))

    def _prune(self, directory: tuple[str, ...]) -> None:
        # An opaque whiteout hides everything lower layers put in the directory; what this
        # layer wrote there (before or after the marker) stays.
        with os.scandir(self._path(directory)) as scan:
            children = list(scan)
        for child in children:
            parts = (*directory, child.name)
            if parts not in self._layer_paths:
                self._remove(child.path)
            elif child.is_dir(follow_symlinks=False):
                self._prune(parts)

    def _remove(self, path: str) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            _rmtree(path)
            prefix = tuple(os.path.relpath(path, self.root).split(os.sep))
            for parts in [p for p in self._dir_modes if p[: len(prefix)] == prefix]:
                del self._dir_modes[parts]
        else:
            os.unlink(path)


def _safe_mode(mode: int) -> int:
    # Setuid and setgid are stripped: an image must not hand privileges to whoever runs it.
    return stat.S_IMODE(mode) & ~(stat.S_ISUID | stat.S_ISGID)


def _rmtree(path: str | Path) -> None:
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        return
    except PermissionError:
        # An unpacked read-only directory (mode 0555) cannot lose its entries until it is
        # writable again; only directories are touched, never what a symlink points at.
        for dirpath, dirnames, _ in os.walk(path):
            for name in dirnames:
                child = os.path.join(dirpath, name)
                if stat.S_ISDIR(os.lstat(child).st_mode):
                    os.chmod(child, 0o700)
        os.chmod(path, 0o700)
        shutil.rmtree(path)


# --- the cache --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Image:
    """An unpacked image in the cache, ready to run.

    `pulled` is True when this call unpacked it, False when it was already cached.
    """

    ref: str
    digest: str
    rootfs: Path
    entrypoint: list[str]
    cmd: list[str]
    env: dict[str, str]
    workdir: str
    size_bytes: int
    pulled: bool


@dataclass(frozen=True)
class CachedImage:
    """One cache entry as reported in a worker's capacity."""

    ref: str
    digest: str
    size_bytes: int
    last_used: float
    refs: int


@dataclass
class _Entry:
    image: Image
    last_used: float
    refs: int = 0


@dataclass
class _DigestLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class ImageCache:
    """A worker's content-addressed image cache, shared by its machines.

    Images live in `root/images/<digest hex>/rootfs` with their run config beside it in
    `image.json`; a directory with that name is complete, since unpacking happens in a scratch
    directory renamed into place at the end. `root/index.json` keeps recency and tags across
    restarts. A machine using an image holds a reference (`use`/`release`); references live in
    memory, so after a restart flyd takes them again for the machines it re-attaches to.
    After each pull the least recently used unreferenced images are evicted until the cache
    fits in `max_bytes`.

    One ImageCache (one process) owns `root`: construction deletes scratch directories a
    crash left behind.
    """

    def __init__(
        self,
        root: Path,
        source: ImageSource,
        *,
        max_bytes: int,
        max_unpacked_bytes_per_image: int = 2 * _GIB,
        max_entries_per_image: int = 200_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if max_bytes <= 0 or max_unpacked_bytes_per_image <= 0 or max_entries_per_image <= 0:
            raise ValueError("cache limits must be positive")
        self.root = Path(root).absolute()
        self.source = source
        self.max_bytes = max_bytes
        self.max_unpacked_bytes_per_image = max_unpacked_bytes_per_image
        self.max_entries_per_image = max_entries_per_image
        self.pulls = 0
        """How many pulls unpacked an image (cache misses)."""
        self._clock = clock
        self._images_dir = self.root / "images"
        self._index_path = self.root / "index.json"
        self._entries: dict[str, _Entry] = {}
        self._tags: dict[str, str] = {}
        self._dirty = False
        # Tag resolutions, keyed by ref, with the source signature they were read under.
        self._resolved: dict[str, tuple[tuple[int, int, int], str]] = {}
        self._locks: dict[str, _DigestLock] = {}
        self._images_dir.mkdir(parents=True, exist_ok=True)
        self._load()

    @property
    def total_bytes(self) -> int:
        """Bytes of all cached images."""
        return sum(e.image.size_bytes for e in self._entries.values())

    async def pull(self, ref: str) -> Image:
        """Make the image `ref` available locally and return it.

        A cached digest returns at once without reading any blob. A tag is looked up in the
        source (so a moved tag is followed); if the source no longer has it, the cached image
        last pulled under that tag is used. Otherwise every blob is verified and the layers
        are unpacked. Concurrent pulls of one digest share one unpack. Raises
        InvalidImageReference, ImageNotFound, ImageError or UnsafeImage.

        Call `use()` before awaiting anything else if the image must not be evicted.
        """
        image_ref = parse_reference(ref)
        resolved: ResolvedImage | None = None
        digest = image_ref.digest
        signature = self.source.signature(image_ref) if digest is None else None
        known = self._resolved.get(str(image_ref))
        if digest is None and signature is not None and known and known[0] == signature:
            digest = known[1]  # the source's index has not changed since this tag was resolved
        if digest is None:
            try:
                resolved = await asyncio.to_thread(self.source.resolve, image_ref)
            except ImageError:
                digest = self._tags.get(str(image_ref))
                if digest is None or digest not in self._entries:
                    raise
                _log.warning(
                    "image_source_unavailable_using_cache", ref=str(image_ref), digest=digest
                )
            else:
                digest = resolved.digest
                if signature is not None:
                    self._resolved[str(image_ref)] = (signature, digest)
        hit = self._hit(digest, image_ref)
        if hit is not None:
            return dataclasses.replace(hit, ref=str(image_ref))
        async with self._digest_lock(digest):
            # Another pull of this digest may have finished while this one waited.
            hit = self._hit(digest, image_ref)
            if hit is not None:
                return dataclasses.replace(hit, ref=str(image_ref))
            if resolved is None:
                resolved = await asyncio.to_thread(self.source.resolve, image_ref)
            image = await asyncio.to_thread(self._adopt_or_unpack, resolved)
            self.pulls += 1
            self._entries[digest] = _Entry(image=image, last_used=self._clock())
            if image_ref.tag is not None:
                self._tags[str(image_ref)] = digest
            self._save_index()
            _log.info("image_pulled", ref=image.ref, digest=digest, size_bytes=image.size_bytes)
            await self._evict(keep=digest)
            return dataclasses.replace(image, ref=str(image_ref), pulled=True)

    def get(self, digest: str) -> Image | None:
        """The cached image with this manifest digest, or None; never reads the source."""
        entry = self._entries.get(digest)
        return None if entry is None else entry.image

    def use(self, digest: str) -> None:
        """Take a reference: a referenced image is never evicted. Raises ImageNotFound."""
        entry = self._entries.get(digest)
        if entry is None:
            raise ImageNotFound(f"image {digest} is not in the cache")
        entry.refs += 1
        entry.last_used = self._clock()
        self._dirty = True

    def release(self, digest: str) -> None:
        """Drop a reference taken with `use`; the image counts as used until now."""
        entry = self._entries.get(digest)
        if entry is None or entry.refs == 0:
            # Releasing twice must not make another holder's image evictable.
            _log.warning("image_release_without_use", digest=digest)
            return
        entry.refs -= 1
        entry.last_used = self._clock()
        self._dirty = True

    def cached(self) -> list[CachedImage]:
        """Every cached image, most recently used first."""
        return [
            CachedImage(
                ref=e.image.ref,
                digest=e.image.digest,
                size_bytes=e.image.size_bytes,
                last_used=e.last_used,
                refs=e.refs,
            )
            for e in sorted(self._entries.values(), key=lambda e: e.last_used, reverse=True)
        ]

    def _hit(self, digest: str, ref: ImageRef) -> Image | None:
        entry = self._entries.get(digest)
        if entry is None:
            return None
        entry.last_used = self._clock()
        if ref.tag is not None:
            # The ref reported for an image is the tag it was last pulled by.
            self._tags[str(ref)] = digest
            entry.image = dataclasses.replace(entry.image, ref=str(ref))
        self._dirty = True
        return entry.image

    @contextlib.asynccontextmanager
    async def _digest_lock(self, digest: str) -> AsyncIterator[None]:
        holder = self._locks.setdefault(digest, _DigestLock())
        holder.users += 1
        try:
            async with holder.lock:
                yield
        finally:
            holder.users -= 1
            if holder.users == 0:
                del self._locks[digest]

    def _adopt_or_unpack(self, resolved: ResolvedImage) -> Image:
        # A pull cancelled while its thread kept unpacking leaves a finished image that was
        # never registered; take it rather than unpacking again.
        existing = _read_image_meta(self._images_dir / _digest_hex(resolved.digest))
        if existing is not None:
            return existing
        return self._unpack(resolved)

    def _unpack(self, resolved: ResolvedImage) -> Image:
        hex_digest = _digest_hex(resolved.digest)
        manifest = resolved.read_manifest()
        config = resolved.read_config(manifest)
        if len(config.diff_ids) != len(manifest.layers):
            raise ImageError(
                f"image {resolved.digest}: manifest has {len(manifest.layers)} layers but "
                f"the config lists {len(config.diff_ids)} diff_ids",
            )
        scratch = self._images_dir / f"{_TMP_PREFIX}{hex_digest}-{secrets.token_hex(4)}"
        final = self._images_dir / hex_digest
        scratch.mkdir()
        try:
            unpacker = _Unpacker(
                scratch / "rootfs",
                max_bytes=self.max_unpacked_bytes_per_image,
                max_entries=self.max_entries_per_image,
            )
            for layer, diff_id in zip(manifest.layers, config.diff_ids, strict=True):
                with resolved.open_blob(layer) as blob:
                    try:
                        actual = unpacker.apply_layer(blob, layer)
                        blob.verify()
                    except Exception:
                        blob.blame()
                        raise
                if actual != diff_id:
                    raise ImageError(
                        f"layer {layer.digest} unpacks to {actual}, but the config says {diff_id}",
                    )
            size_bytes = unpacker.finish()
            image = Image(
                ref=str(resolved.ref),
                digest=resolved.digest,
                rootfs=final / "rootfs",
                entrypoint=config.entrypoint,
                cmd=config.cmd,
                env=config.env,
                workdir=config.workdir,
                size_bytes=size_bytes,
                pulled=False,
            )
            _write_image_meta(scratch, image)
            try:
                os.rename(scratch, final)
            except OSError:
                # Another unpack of the same digest got there first; its copy is as good.
                if _read_image_meta(final) is None:
                    raise
                _rmtree(scratch)
                return cast(Image, _read_image_meta(final))
            return image
        except OSError as exc:
            _rmtree(scratch)
            raise ImageError(f"cannot unpack image {resolved.ref}: {exc}") from exc
        except BaseException:
            _rmtree(scratch)
            raise

    async def _evict(self, *, keep: str) -> None:
        total = self.total_bytes
        if total <= self.max_bytes:
            return
        candidates = sorted(
            ((d, e) for d, e in self._entries.items() if e.refs == 0 and d != keep),
            key=lambda item: (item[1].last_used, item[0]),
        )
        trash: list[Path] = []
        for digest, entry in candidates:
            if total <= self.max_bytes:
                break
            hex_digest = _digest_hex(digest)
            # Renamed first so the image stops existing at once; the slow delete follows.
            dest = self._images_dir / f"{_TRASH_PREFIX}{hex_digest}-{secrets.token_hex(4)}"
            with contextlib.suppress(FileNotFoundError):
                os.rename(self._images_dir / hex_digest, dest)
                trash.append(dest)
            del self._entries[digest]
            self._tags = {ref: d for ref, d in self._tags.items() if d != digest}
            total -= entry.image.size_bytes
            _log.info("image_evicted", digest=digest, ref=entry.image.ref)
        self._save_index()
        if total > self.max_bytes:
            _log.warning(
                "image_cache_over_bound",
                total_bytes=total,
                max_bytes=self.max_bytes,
                reason="every remaining image is in use",
            )
        for path in trash:
            await asyncio.to_thread(_rmtree, path)

    def _load(self) -> None:
        index = self._read_index()
        recency = index.get("images")
        if not isinstance(recency, dict):
            recency = {}
        for child in sorted(self._images_dir.iterdir()):
            if child.name.startswith("."):
                _log.info("image_scratch_dropped", path=str(child))
                _rmtree(child)
                continue
            if not _HEX64_RE.fullmatch(child.name):
                continue
            image = _read_image_meta(child)
            if image is None:
                _log.warning("image_unreadable_dropped", path=str(child))
                _rmtree(child)
                continue
            record = recency.get(child.name)
            if isinstance(record, dict):
                last_used = record.get("last_used")
                ref = record.get("ref")
                if isinstance(ref, str):
                    image = dataclasses.replace(image, ref=ref)
            else:
                last_used = None
            if not isinstance(last_used, int | float):
                last_used = child.stat().st_mtime
            self._entries[image.digest] = _Entry(image=image, last_used=float(last_used))
        tags = index.get("tags", {})
        if isinstance(tags, dict):
            self._tags = {
                r: d for r, d in tags.items() if isinstance(r, str) and d in self._entries
            }
        self._save_index()

    def _read_index(self) -> dict[str, Any]:
        try:
            return _load_json(self._index_path.read_bytes(), str(self._index_path))
        except FileNotFoundError:
            return {}
        except ImageError:
            # Only a hint (recency and tags): the images themselves are rediscovered.
            _log.warning("image_cache_index_unreadable", path=str(self._index_path))
            return {}

    def flush(self) -> None:
        """Persist recency and tags if they changed since the last save.

        Uses and hits only mark the index dirty: it is a hint (for LRU order after a
        restart), not worth a file write on every machine start. flyd flushes it
        periodically and on shutdown; pulls and evictions save at once.
        """
        if self._dirty:
            self._save_index()

    def _save_index(self) -> None:
        self._dirty = False
        index = {
            "version": 1,
            "images": {
                _digest_hex(d): {"ref": e.image.ref, "last_used": e.last_used}
                for d, e in sorted(self._entries.items())
            },
            "tags": dict(sorted(self._tags.items())),
        }
        _write_atomic(self._index_path, _canonical_json(index))


def _write_image_meta(directory: Path, image: Image) -> None:
    meta = {
        "version": 1,
        "ref": image.ref,
        "digest": image.digest,
        "entrypoint": image.entrypoint,
        "cmd": image.cmd,
        "env": image.env,
        "workdir": image.workdir,
        "size_bytes": image.size_bytes,
    }
    _write_atomic(directory / "image.json", _canonical_json(meta))


def _read_image_meta(directory: Path) -> Image | None:
    try:
        meta = json.loads((directory / "image.json").read_bytes())
        image = Image(
            ref=meta["ref"],
            digest=meta["digest"],
            rootfs=directory / "rootfs",
            entrypoint=list(meta["entrypoint"]),
            cmd=list(meta["cmd"]),
            env=dict(meta["env"]),
            workdir=meta["workdir"],
            size_bytes=int(meta["size_bytes"]),
            pulled=False,
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if image.digest != f"sha256:{directory.name}" or not image.rootfs.is_dir():
        return None
    return image
