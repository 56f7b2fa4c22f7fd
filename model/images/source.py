"""Image sources: where a worker pulls images from, and reading them with every blob verified.

An image named `n` lives in the source root as an OCI image layout directory `n/` (with
`oci-layout`, `index.json` and `blobs/sha256/...`) or as a tar of one, `n.tar`, read in place.
A reference resolves to a manifest by tag annotation or digest; each blob read is checked
against its descriptor's size and sha256 digest. Who may run an image is in its manifest
(`ResolvedImage.owners`, model.images.owners).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

from model.errors import ImageError, ImageNotFound
from model.images.oci import (
    INDEX_TYPES,
    MANIFEST_TYPES,
    REF_NAME_ANNOTATION,
    Descriptor,
    ImageConfig,
    Manifest,
    digest_hex,
    parse_config,
    parse_index,
    parse_manifest,
)
from model.images.owners import Owners
from model.images.reference import ImageRef, check_image_name, parse_reference

__all__ = ["CHUNK", "BlobReader", "ImageSource", "ResolvedImage", "open_layout", "owners_of"]

# index.json, manifests and configs are read whole into memory; registries cap manifests at
# 4 MiB, and nothing legitimate comes close.
_MAX_JSON_BYTES = 4 * 1024**2
# How much of a blob (or of a layer's decompressed stream) is read at once.
CHUNK = 1024**2


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
            self.read(CHUNK)

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
        with self._layout.blob(digest_hex(descriptor.digest)) as (stream, actual_size):
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
            while chunk := blob.read(CHUNK):
                chunks.append(chunk)
            blob.verify()
        return b"".join(chunks)

    def read_manifest(self) -> Manifest:
        """Read and verify the manifest."""
        return parse_manifest(self.read_blob(self.manifest), self.manifest)

    def owners(self) -> Owners:
        """Who may run the image, as its manifest records (model.images.owners): read and
        verified, as every blob is, so an image cannot claim owners its digest does not name."""
        return owners_of(self.read_manifest(), self.manifest.digest)

    def read_config(self, manifest: Manifest) -> ImageConfig:
        """Read and verify the image config the manifest names."""
        return parse_config(self.read_blob(manifest.config), manifest.config)


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
            manifests = parse_index(layout.read_index(), f"{layout.description}/index.json")
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
        if manifest.media_type in INDEX_TYPES:
            raise ImageError(
                f"image {str(image_ref)!r} is a multi-platform image index; flyd needs a "
                "single-platform manifest",
            )
        if manifest.media_type and manifest.media_type not in MANIFEST_TYPES:
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

    def tagged(self) -> list[str]:
        """Every `name:tag` the source holds, sorted: the tags of each layout directory and
        tar under the root, and the bare name of one whose index cannot be read (for an
        operator's listing; a worker never walks the source)."""
        out: list[str] = []
        for parent, dirs, files in os.walk(self.root):
            here = Path(parent).relative_to(self.root)
            if "index.json" in files:
                dirs.clear()  # a layout: its blobs are not images
                names = [here.as_posix()]
            else:
                names = [
                    (here / f.removesuffix(".tar")).as_posix() for f in files if f.endswith(".tar")
                ]
            for name in names:
                try:
                    check_image_name(name, name)
                except ImageError:
                    continue  # no reference names it: not an image of this source
                try:
                    layout = self._open_layout(ImageRef(name=name))
                    index = parse_index(layout.read_index(), f"{layout.description}/index.json")
                except (ImageError, OSError):
                    out.append(name)  # listed, so that resolving it says what is wrong
                    continue
                tags = {m.annotations.get(REF_NAME_ANNOTATION) for m in index} - {None}
                out += [f"{name}:{tag}" for tag in tags]
        return sorted(out)

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


def open_layout(path: Path, tag: str | None) -> ResolvedImage:
    """The image in the OCI layout at `path` (a directory, or a tar of one): the manifest
    tagged `tag`; without one, the only manifest, or else the one tagged `latest`.
    """
    layout: _Layout = _DirLayout(path) if path.is_dir() else _TarLayout(path)
    manifests = parse_index(layout.read_index(), f"{layout.description}/index.json")
    tags = {m.annotations.get(REF_NAME_ANNOTATION): m for m in manifests}
    wanted = tag if tag is not None else (None if len(manifests) == 1 else "latest")
    manifest = manifests[0] if wanted is None and manifests else tags.get(wanted)
    if manifest is None:
        named = ", ".join(sorted(t for t in tags if t)) or "none"
        raise ImageNotFound(f"{path}: no image tagged {wanted!r} (tags: {named})")
    if manifest.media_type and manifest.media_type not in MANIFEST_TYPES:
        raise ImageError(f"{path}: unsupported media type {manifest.media_type!r}")
    name = path.name.removesuffix(".tar") or "base"
    ref = parse_reference(
        f"{_ref_name(name)}:{manifest.annotations.get(REF_NAME_ANNOTATION) or 'latest'}"
    )
    return ResolvedImage(ref=ref, manifest=manifest, source=layout.description, _layout=layout)


def owners_of(manifest: Manifest, digest: str) -> Owners:
    """The owners the manifest of digest `digest` records (ImageError when malformed)."""
    return Owners.parse(manifest.annotations, f"manifest {digest}")


def _ref_name(name: str) -> str:
    """A file name as an image name (lowercase letters, digits, separators)."""
    cleaned = "".join(c if c.isalnum() or c in "._-" else "-" for c in name.lower()).strip("._-")
    return cleaned or "base"
