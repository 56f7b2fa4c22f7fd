"""Building an image: a directory tree becomes a one-layer OCI image in a source's layout.

Used by the CLI (`nonomad image build`, local clusters), the benchmarks and the tests to make
images a worker can pull; flyd itself never builds one.
"""

from __future__ import annotations

import dataclasses
import fcntl
import gzip
import hashlib
import os
import platform
import secrets
import stat
import tarfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, cast

from flyd.images.base import read_base
from model.errors import ImageError, InvalidArgument
from model.images.oci import (
    HOST_RUNTIME_LABEL,
    MEDIA_TYPE_CONFIG,
    MEDIA_TYPE_INDEX,
    MEDIA_TYPE_LAYER_GZIP,
    MEDIA_TYPE_MANIFEST,
    REF_NAME_ANNOTATION,
    Descriptor,
    canonical_json,
    parse_index,
    write_atomic,
)
from model.images.owners import NO_OWNER, Owners
from model.images.reference import check_image_name, check_image_tag

__all__ = ["build_image"]


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
    workdir: str | None = None,
    base: Path | None = None,
    ports: Sequence[int] = (),
    owners: Owners = NO_OWNER,
) -> str:
    """Turn `src_dir` into an OCI image tagged `name:tag` under `source_root`.

    Without `base`, a one-layer image labelled as naming no base (a sandboxing driver lends
    it the host's runtime directories). With one (see `flyd.images.base`), the directory's
    layer goes on top of the base's layers, and the image inherits the base's run config
    (Env, which `env` extends, User, WorkingDir unless `workdir` is given): it runs on its
    own rootfs. `ports` are the TCP ports its command serves on: they become ExposedPorts, and
    the first is the image's `PORT` unless `env` sets one (a worker sets PORT itself when it
    starts a machine: the service's port, or with the process driver the host port).
    `owners` say which apps may run it (model.images.owners): recorded in its manifest, so
    the same tree built for another app is another image, of another digest. By default it
    records none, and no app may run it.

    The layout is `source_root/<name>` (a name's path components become nested directories);
    other tags already in it are kept and an earlier image with this tag is replaced. The
    build is deterministic: the same tree, base and arguments always give the same digest
    (entries sorted, owners and mtimes zeroed, no gzip timestamp). File modes and symlinks
    are kept. Returns the manifest digest, `sha256:<hex>`.
    """
    ref = f"{name}:{tag}"
    check_image_name(name, ref)
    check_image_tag(tag, ref)
    env = dict(env or {})
    if workdir is not None and not workdir.startswith("/"):
        raise InvalidArgument("workdir", f"{workdir!r} is not an absolute path")
    for key in env:
        if not key or "=" in key:
            raise InvalidArgument("env", f"variable name {key!r} is empty or contains '='")
    for port in ports:
        if not 0 < port < 65536:
            raise InvalidArgument("port", f"{port} is not a TCP port (1-65535)")
    if ports:
        env.setdefault("PORT", str(ports[0]))
    src_dir = Path(src_dir)
    if not src_dir.is_dir():
        raise ImageError(f"cannot build {ref}: {src_dir} is not a directory")

    layout = Path(source_root).joinpath(*name.split("/"))
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)
    write_atomic(layout / "oci-layout", canonical_json({"imageLayoutVersion": "1.0.0"}))

    below: list[tuple[Descriptor, str]] = []
    run: dict[str, object] = {}
    if base is not None:
        found = read_base(base)
        below = found.copy_layers(blobs)
        run = {k: v for k, v in found.run_config.items() if k in _INHERITED}
        inherited = run.get("Env")
        if isinstance(inherited, list):
            env = {**dict(e.partition("=")[::2] for e in inherited if isinstance(e, str)), **env}
    else:
        # No base: a sandboxing driver lends it the host's runtime directories.
        run["Labels"] = {HOST_RUNTIME_LABEL: "true"}
    layer, diff_id = _write_layer(src_dir, blobs)
    run.update(
        Entrypoint=list(entrypoint),
        Cmd=list(cmd),
        # Sorted so that equal mappings give equal digests whatever their insertion order.
        Env=[f"{k}={v}" for k, v in sorted(env.items())],
        WorkingDir=workdir or str(run.get("WorkingDir") or "/"),
    )
    if ports:
        run["ExposedPorts"] = {f"{p}/tcp": {} for p in sorted(set(ports))}
    config = {
        "architecture": _host_architecture(),
        "os": "linux",
        "config": run,
        "rootfs": {"type": "layers", "diff_ids": [*(d for _, d in below), diff_id]},
    }
    config_desc = _write_blob(blobs, canonical_json(config), MEDIA_TYPE_CONFIG)
    manifest = {
        "schemaVersion": 2,
        "mediaType": MEDIA_TYPE_MANIFEST,
        "config": config_desc.to_json(),
        "layers": [*(d.to_json() for d, _ in below), layer.to_json()],
    }
    if recorded := owners.annotations():
        manifest["annotations"] = recorded
    manifest_desc = dataclasses.replace(
        _write_blob(blobs, canonical_json(manifest), MEDIA_TYPE_MANIFEST),
        annotations={REF_NAME_ANNOTATION: tag},
    )
    _add_to_index(layout, manifest_desc, tag)
    return manifest_desc.digest


# What an image inherits from its base's run config (its command is the build's own).
_INHERITED = ("Env", "User", "WorkingDir", "ExposedPorts", "StopSignal", "Labels")


def _write_layer(src_dir: Path, blobs: Path) -> tuple[Descriptor, str]:
    tmp = blobs / f".tmp-{secrets.token_hex(8)}"
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
        write_atomic(path, data)
    return Descriptor(media_type, f"sha256:{hex_digest}", len(data))


def _add_to_index(layout: Path, manifest: Descriptor, tag: str) -> None:
    # Two builds of different tags of one name must not lose each other's entry, so the
    # read-modify-write holds a lock on the layout directory itself (no stray lock file).
    fd = os.open(layout, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        index_path = layout / "index.json"
        manifests: list[Descriptor] = []
        if index_path.exists():
            manifests = parse_index(index_path.read_bytes(), str(index_path))
        manifests = [m for m in manifests if m.annotations.get(REF_NAME_ANNOTATION) != tag]
        manifests.append(manifest)
        manifests.sort(key=lambda m: (m.annotations.get(REF_NAME_ANNOTATION, ""), m.digest))
        index = {
            "schemaVersion": 2,
            "mediaType": MEDIA_TYPE_INDEX,
            "manifests": [m.to_json() for m in manifests],
        }
        write_atomic(index_path, canonical_json(index))
    finally:
        os.close(fd)
