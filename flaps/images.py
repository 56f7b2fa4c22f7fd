"""Who may run an image, as flaps can tell before it claims on any worker.

The workers check every create and update against the image's owners (model.images.owners),
and they are the commit point. flaps refuses earlier what it knows for sure: given the
workers' image source (`flaps --image-source`, the same directory or a copy of it), it reads
an image's owners from its manifest, as a worker would, and a create, an update or a
simulated placement of an image the app may not run is PERMISSION_DENIED before a worker is
asked anything. What it cannot tell (no source given, an image its copy lacks, a layout it
cannot read) it leaves to the workers, which answer the same way.

Owners are remembered by digest (the manifest holds them, so a digest's never change) and a
tag's digest while the source's index of it is unchanged (its signature, as the workers'
cache does): a create of a known image costs a stat, no read. Both memories are bounded.
"""

from __future__ import annotations

import asyncio

import structlog

from flaps.errors import ImageDenied
from model.errors import FlydError
from model.images.owners import Owners
from model.images.reference import ImageRef, parse_reference
from model.images.source import ImageSource

__all__ = ["ImageOwners"]

log = structlog.get_logger("flaps.images")
# Images remembered at most; past it the memory starts over (a re-read costs ~0.1 ms).
MAX_REMEMBERED = 4096


class ImageOwners:
    """The owners of the images in `source`, read from their manifests and remembered."""

    def __init__(self, source: ImageSource) -> None:
        self.source = source
        self._tags: dict[str, tuple[tuple[int, int, int], str]] = {}
        self._owners: dict[str, Owners] = {}

    async def check(self, app: str, image: str) -> None:
        """Raise ImageDenied when the source says a machine of `app` may not run `image` (a
        reference already checked by `check_config`); return when it may, or when the source
        cannot say."""
        try:
            ref = parse_reference(image)
        except FlydError:
            return  # check_config refuses it, naming the field
        owners = self._remembered(ref)
        if owners is None:
            try:
                owners = await asyncio.to_thread(self._read, ref)
            except (FlydError, OSError) as err:  # not here, or unreadable: the worker will say
                log.debug("image_owners_unknown", image=str(ref), reason=str(err))
                return
        why = owners.refusal(app, str(ref))
        if why is not None:
            log.info("image_denied", image=str(ref), app=app, owner=owners.app)
            raise ImageDenied(str(ref), owners.app, why)

    def _remembered(self, ref: ImageRef) -> Owners | None:
        if ref.digest is not None:
            return self._owners.get(ref.digest)
        known = self._tags.get(str(ref))
        if known is None or known[0] != self.source.signature(ref):
            return None
        return self._owners.get(known[1])

    def _read(self, ref: ImageRef) -> Owners:
        """Resolve `ref` in the source and read its manifest's owners (blocking I/O)."""
        signature = self.source.signature(ref)  # before the read: a change after it is seen
        resolved = self.source.resolve(ref)
        owners = resolved.owners()
        if len(self._owners) >= MAX_REMEMBERED or len(self._tags) >= MAX_REMEMBERED:
            self._owners.clear()
            self._tags.clear()
        self._owners[resolved.digest] = owners
        if ref.digest is None and signature is not None:
            self._tags[str(ref)] = (signature, resolved.digest)
        return owners
