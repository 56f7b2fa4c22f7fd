"""Paths an image's config names, resolved inside its rootfs and never outside it.

An image config names paths a runtime uses before the machine's command runs: its working
directory, its entrypoint and, through its user, entries of its own `/etc/passwd`. Each is
resolved here as the unpacker resolves the image's symlinks (`flyd.images.unpack`): as in a
chroot, absolute symlink targets start at the rootfs, and a `..` that would climb above the
rootfs is refused (`UnsafeImage`). `check_config` runs at import, so an image whose WorkingDir
is `/../../etc`, or `/host` beside a symlink `host -> /`, is refused or its path made real
before any machine runs it. `host_path` is what a driver that does not chroot (the process
driver) uses to turn such a path into a host path: the real path inside the rootfs, checked
again against the host's own resolution, so it refuses what it cannot confine.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from flyd.errors import UnsafeImage
from flyd.images.oci import ImageConfig
from flyd.images.unpack import Escape, resolve

__all__ = ["check_config", "host_path", "inside"]

_USER_RE = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.-]{0,31}")


def inside(rootfs: Path, path: str, what: str) -> str:
    """`path` (absolute, or relative to the root) resolved inside `rootfs` with the chroot
    rules: the real absolute path in the image ("/usr/bin/sh"), through no symlink."""
    try:
        parts = resolve(str(rootfs), [], path, follow_last=True)
    except Escape:
        raise UnsafeImage(f"image {what} {path[:200]!r} leads outside its rootfs") from None
    return "/" + "/".join(parts)


def check_config(rootfs: Path, config: ImageConfig) -> str:
    """Check what `config` names against the unpacked `rootfs`; returns its working directory
    resolved inside the rootfs (what a machine of the image runs in).

    UnsafeImage when the WorkingDir or an absolute Entrypoint leads outside the rootfs, or the
    User names no user or group of the image's own /etc/passwd and /etc/group.
    """
    workdir = inside(rootfs, config.workdir or "/", "WorkingDir")
    if config.entrypoint and config.entrypoint[0].startswith("/"):
        inside(rootfs, config.entrypoint[0], "Entrypoint")
    user = getattr(config, "user", "")
    if user:
        name, _, group = user.partition(":")
        _check_principal(rootfs, name, "/etc/passwd", "user", user)
        if group:
            _check_principal(rootfs, group, "/etc/group", "group", user)
    return workdir


def _check_principal(rootfs: Path, name: str, table: str, what: str, user: str) -> None:
    if name.isdigit():
        return
    if not _USER_RE.fullmatch(name):
        raise UnsafeImage(f"image User {user[:64]!r}: {what} {name[:64]!r} is not a valid name")
    real = rootfs / inside(rootfs, table, "User").lstrip("/")
    try:
        lines = real.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    if not any(line.split(":", 1)[0] == name for line in lines):
        raise UnsafeImage(f"image User {user[:64]!r}: no {what} {name!r} in its {table}")


def host_path(rootfs: Path, path: str, what: str) -> Path:
    """The host path of `path` of the image at `rootfs`, for a driver that does not chroot.

    Resolved inside the rootfs (`inside`), then by the host's kernel: when that lands
    elsewhere than the rootfs (a symlink changed under it), UnsafeImage: such a driver cannot
    confine the machine there.
    """
    real = rootfs / inside(rootfs, path, what).lstrip("/")
    root = os.path.realpath(rootfs)
    host = os.path.realpath(real)
    if host != root and not host.startswith(root + os.sep):
        raise UnsafeImage(f"image {what} {path[:200]!r} resolves outside its rootfs on the host")
    return real
