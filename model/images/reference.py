"""Image references: `name:tag`, `name` (tag `latest`) or `name@sha256:<64 hex>`.

What a client may name an image by, checked before anything touches a source or the cache; the
builder applies the same name and tag rules to what it writes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from model.errors import InvalidImageReference
from model.images.oci import DIGEST_RE

__all__ = ["ImageRef", "check_image_name", "check_image_tag", "parse_reference"]

_NAME_COMPONENT_RE = re.compile(r"[a-z0-9]+(?:[._-][a-z0-9]+)*")
_TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_MAX_NAME_LENGTH = 255


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
        check_image_name(name, ref)
        if not DIGEST_RE.fullmatch(digest):
            raise InvalidImageReference(
                f"{ref!r}: digest {digest!r} is not 'sha256:' followed by 64 lowercase hex digits",
            )
        return ImageRef(name=name, digest=digest)
    name, sep, tag = ref.partition(":")
    check_image_name(name, ref)
    if not sep:
        return ImageRef(name=name, tag="latest")
    check_image_tag(tag, ref)
    return ImageRef(name=name, tag=tag)


def check_image_name(name: str, ref: str) -> None:
    """Raise InvalidImageReference (quoting `ref`) unless `name` is a valid image name."""
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


def check_image_tag(tag: str, ref: str) -> None:
    """Raise InvalidImageReference (quoting `ref`) unless `tag` is a valid tag."""
    if not tag:
        raise InvalidImageReference(f"{ref!r}: tag is empty")
    if not _TAG_RE.fullmatch(tag):
        raise InvalidImageReference(
            f"{ref!r}: tag {tag!r} must be 1 to 128 letters, digits, '_', '.' or '-', "
            "not starting with '.' or '-'",
        )
