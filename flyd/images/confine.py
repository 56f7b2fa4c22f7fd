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

from flyd.images.unpack import Escape, resolve
from model.errors import ImageError, UnsafeImage
from model.images.oci import ImageConfig

__all__ = ["DEFAULT_PATH", "check_config", "host_path", "host_program", "inside"]

_USER_RE = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.-]{0,31}")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""Where a program named without a path is looked for when the image sets no PATH."""


def _in_workdir(workdir: str, path: str) -> str:
    return path if path.startswith("/") else f"{workdir.rstrip('/')}/{path}"


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

    UnsafeImage when the WorkingDir, or the path of the program it runs (its Entrypoint's
    first word, or its Cmd's without an Entrypoint; relative to the WorkingDir), leads outside
    the rootfs, or the User names no user or group of the image's own /etc/passwd and
    /etc/group. A bare program name is looked up on the PATH when a machine starts.
    """
    workdir = inside(rootfs, config.workdir or "/", "WorkingDir")
    # The program the image runs: its Entrypoint's, or without one its Cmd's.
    run = config.entrypoint or config.cmd
    if run and "/" in run[0]:
        inside(rootfs, _in_workdir(workdir, run[0]), "Entrypoint" if config.entrypoint else "Cmd")
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


def host_program(rootfs: Path, program: str, workdir: str, search_path: str) -> Path | None:
    """The host path of the executable file the image at `rootfs` runs as `program`: a path
    (absolute, or relative to `workdir`), or a name looked up in the directories of
    `search_path` (a PATH), each inside the rootfs. None when the image has no such file.

    UnsafeImage when the path leads outside the rootfs; a PATH directory that does, or
    loops, is passed over (the program is not there).
    """
    if "/" in program:
        return _executable(host_path(rootfs, _in_workdir(workdir, program), "entrypoint"))
    for directory in search_path.split(":"):
        if not directory.startswith("/"):
            continue  # relative PATH entries name the host's working directory, not the image
        try:
            found = _executable(host_path(rootfs, f"{directory}/{program}", "entrypoint"))
        except ImageError:  # (UnsafeImage, a symlink loop)
            continue
        if found is not None:
            return found
    return None


def _executable(path: Path) -> Path | None:
    return path if path.is_file() and os.access(path, os.X_OK) else None
