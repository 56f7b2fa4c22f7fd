"""Unpacking layers into a rootfs, treating every layer as hostile input.

An entry never lands outside the rootfs (absolute paths, `..`, symlinks and hardlinks pointing
out, writes through such symlinks are refused); device nodes and fifos are refused; setuid and
setgid bits are stripped; unpacking stops as soon as an image unpacks to more bytes or entries
than allowed. Whiteouts of later layers remove what earlier ones put down.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import os
import shutil
import stat
import tarfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Protocol, Self, cast

from model.errors import ImageError, UnsafeImage
from model.images.oci import GZIP_LAYER_TYPES, Descriptor
from model.images.source import CHUNK, BlobReader

__all__ = ["Escape", "Unpacker", "resolve", "rmtree"]

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

_WHITEOUT_PREFIX = ".wh."
_OPAQUE_WHITEOUT = ".wh..wh..opq"


class Escape(Exception):
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


def resolve(root: str, start: Sequence[str], path: str, *, follow_last: bool) -> list[str]:
    """Resolve `path` from directory `start` (components under `root`) like a chrooted kernel.

    Symlinks are followed by reading them here, never by the kernel, with absolute targets
    taken relative to `root`. Returns the real components, none of which is a symlink
    (except the last when not `follow_last`). Raises Escape if `..` climbs above `root`.
    """
    resolved = [] if path.startswith("/") else list(start)
    pending = [p for p in reversed(path.split("/")) if p not in ("", ".")]
    hops = 0
    while pending:
        part = pending.pop()
        if part == "..":
            if not resolved:
                raise Escape
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

    def __init__(self, inner: _Readable, unpacker: Unpacker, layer: Descriptor) -> None:
        self._inner = inner
        self._unpacker = unpacker
        self._layer = layer
        self.hash = hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        # Bounded reads only: an unbounded read of a gzip bomb would fill memory before any
        # count could stop it.
        if size < 0 or size > CHUNK:
            size = CHUNK
        data = self._inner.read(size)
        self.hash.update(data)
        self._unpacker.count_stream(len(data), self._layer)
        return data

    def drain(self) -> None:
        # Padding and anything after the end-of-archive marker still belong to the diff_id,
        # and still count against the size limit.
        while self.read(CHUNK):
            pass


class Unpacker:
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
        """Count `n` decompressed bytes of `layer`; UnsafeImage past the image's bound.

        Headers alone cannot be trusted with the size of a gzip bomb (zero blocks after the
        end-of-archive marker, huge pax headers), so the decompressed stream is counted too.
        """
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
        if layer.media_type in GZIP_LAYER_TYPES:
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
            real = resolve(self.root, [], "/".join(parts), follow_last=True)
        except Escape:
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
            resolve(self.root, parent, target, follow_last=True)
        except Escape:
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
            parent = resolve(self.root, [], "/".join(link_parts[:-1]), follow_last=True)
        except Escape:
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
            while chunk := source.read(CHUNK):
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
            parent = resolve(self.root, [], "/".join(parts[:-1]), follow_last=True)
        except Escape:
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
            rmtree(path)
            prefix = tuple(os.path.relpath(path, self.root).split(os.sep))
            for parts in [p for p in self._dir_modes if p[: len(prefix)] == prefix]:
                del self._dir_modes[parts]
        else:
            os.unlink(path)


def _safe_mode(mode: int) -> int:
    # Setuid and setgid are stripped: an image must not hand privileges to whoever runs it.
    return stat.S_IMODE(mode) & ~(stat.S_ISUID | stat.S_ISGID)


def rmtree(path: str | Path) -> None:
    """Remove an unpacked tree, read-only directories included; a missing one is no error."""
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
