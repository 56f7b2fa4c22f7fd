"""The worker's content-addressed image cache, shared by its machines.

A pull resolves a reference in the image source, checks that the app asking may run the image
(model.images.owners), verifies every blob against its digest and unpacks the layers (in a
scratch directory, renamed into place only when complete) into a rootfs that machines share.
Machines hold references to the images they use; the least recently used images nobody holds
are evicted when the cache grows past its bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import structlog

from flyd.images import confine
from flyd.images.unpack import Unpacker, rmtree
from model.errors import ImageDenied, ImageError, ImageNotFound
from model.images.oci import canonical_json, digest_hex, load_json, write_atomic
from model.images.owners import Owners
from model.images.reference import ImageRef, parse_reference
from model.images.source import ImageSource, ResolvedImage, owners_of

__all__ = ["CachedImage", "Image", "ImageCache"]

_log = structlog.get_logger(__name__)

_GIB = 1024**3
_HEX64_RE = re.compile(r"[0-9a-f]{64}")

# Scratch entries in the cache's images/ directory start with a dot, so a scan after a crash
# can tell them from finished images (named by bare digest hex) and drop them.
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"


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
    user: str = ""
    host_runtime: bool = False  # it names no base (see model.images.oci.HOST_RUNTIME_LABEL)
    # Who may run it, from its manifest; None for an entry cached before owners were kept,
    # read from the source the next time an app asks for it.
    owners: Owners | None = None


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

    async def pull(self, ref: str, *, app: str | None = None) -> Image:
        """Make the image `ref` available locally and return it.

        A cached digest returns at once without reading any blob. A tag is looked up in the
        source (so a moved tag is followed); if the source no longer has it, the cached image
        last pulled under that tag is used. Otherwise every blob is verified and the layers
        are unpacked. Concurrent pulls of one digest share one unpack. Raises
        InvalidImageReference, ImageNotFound, ImageError or UnsafeImage.

        With `app`, a machine of that app is to run it: ImageDenied unless its owners allow
        that, checked once the reference names a digest and before anything is unpacked or
        the cache changes (a cached image's owners are known without reading the source).

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
        if app is not None:
            resolved = await self._check_owners(app, digest, image_ref, resolved)
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

    async def _check_owners(
        self, app: str, digest: str, ref: ImageRef, resolved: ResolvedImage | None
    ) -> ResolvedImage | None:
        """Raise ImageDenied unless a machine of `app` may run the image of `digest`; returns
        the image as resolved, if this had to resolve it (so the pull need not again)."""
        entry = self._entries.get(digest)
        owners = entry.image.owners if entry is not None else None
        if owners is None:
            # Not cached (or cached before owners were kept): its manifest says. A source
            # that cannot say is an error: nothing is run on an owner it cannot establish.
            if resolved is None:
                resolved = await asyncio.to_thread(self.source.resolve, ref)
            owners = await asyncio.to_thread(resolved.owners)
            if entry is not None and entry.image.owners is None:
                entry.image = dataclasses.replace(entry.image, owners=owners)
                await asyncio.to_thread(
                    _write_image_meta, self._images_dir / digest_hex(digest), entry.image
                )
        why = owners.refusal(app, str(ref))
        if why is not None:
            _log.info("image_denied", ref=str(ref), digest=digest, app=app, owner=owners.app)
            raise ImageDenied(str(ref), owners.app, why)
        return resolved

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
        existing = _read_image_meta(self._images_dir / digest_hex(resolved.digest))
        if existing is not None:
            return existing
        return self._unpack(resolved)

    def _unpack(self, resolved: ResolvedImage) -> Image:
        hex_digest = digest_hex(resolved.digest)
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
            unpacker = Unpacker(
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
            # WorkingDir, Entrypoint and User, resolved inside the rootfs as its symlinks were.
            workdir = confine.check_config(scratch / "rootfs", config)
            image = Image(
                ref=str(resolved.ref),
                digest=resolved.digest,
                rootfs=final / "rootfs",
                entrypoint=config.entrypoint,
                cmd=config.cmd,
                env=config.env,
                workdir=workdir,
                size_bytes=size_bytes,
                pulled=False,
                user=config.user,
                host_runtime=config.host_runtime,
                owners=owners_of(manifest, resolved.digest),
            )
            _write_image_meta(scratch, image)
            try:
                os.rename(scratch, final)
            except OSError:
                # Another unpack of the same digest got there first; its copy is as good.
                if _read_image_meta(final) is None:
                    raise
                rmtree(scratch)
                return cast(Image, _read_image_meta(final))
            return image
        except OSError as exc:
            rmtree(scratch)
            raise ImageError(f"cannot unpack image {resolved.ref}: {exc}") from exc
        except BaseException:
            rmtree(scratch)
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
            hex_digest = digest_hex(digest)
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
            await asyncio.to_thread(rmtree, path)

    def _load(self) -> None:
        index = self._read_index()
        recency = index.get("images")
        if not isinstance(recency, dict):
            recency = {}
        for child in sorted(self._images_dir.iterdir()):
            if child.name.startswith("."):
                _log.info("image_scratch_dropped", path=str(child))
                rmtree(child)
                continue
            if not _HEX64_RE.fullmatch(child.name):
                continue
            image = _read_image_meta(child)
            if image is None:
                _log.warning("image_unreadable_dropped", path=str(child))
                rmtree(child)
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
            return load_json(self._index_path.read_bytes(), str(self._index_path))
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
                digest_hex(d): {"ref": e.image.ref, "last_used": e.last_used}
                for d, e in sorted(self._entries.items())
            },
            "tags": dict(sorted(self._tags.items())),
        }
        write_atomic(self._index_path, canonical_json(index))


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
        "user": image.user,
        "host_runtime": image.host_runtime,
    }
    if image.owners is not None:
        meta["owners"] = {
            "app": image.owners.app,
            "shared_with": sorted(image.owners.shared_with),
            "public": image.owners.public,
        }
    write_atomic(directory / "image.json", canonical_json(meta))


def _owners_meta(recorded: Any) -> Owners | None:
    """The owners image.json keeps; None when it keeps none (an entry from before them)."""
    if recorded is None:
        return None
    return Owners.of(
        str(recorded["app"]),
        [str(a) for a in recorded["shared_with"]],
        public=recorded["public"] is True,
    )


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
            user=str(meta["user"]),
            host_runtime=bool(meta["host_runtime"]),  # entries from before it: pulled again
            owners=_owners_meta(meta.get("owners")),  # entries from before them: None
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if image.digest != f"sha256:{directory.name}" or not image.rootfs.is_dir():
        return None
    return image
