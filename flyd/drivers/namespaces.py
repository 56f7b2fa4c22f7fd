"""Linux namespace and mount primitives the OCI driver needs that Python 3.11 does not offer.

Through libc (ctypes): `unshare`, `setns`, and the new mount API's `open_tree` and
`mount_setattr`, with which `idmapped_tree` makes a detached, ID-mapped copy of a directory
tree: a machine's user namespace sees the image cache's root-owned files as its own root's,
while on disk they stay owned by host root and no machine's host uid can write them.
`new_user_namespace` makes a user namespace with one mapping and returns a descriptor for it
(through a short-lived child: a process can enter a new user namespace only when it has a
single thread, and can never leave it). `network_namespace_problem` says why a path does not
name a network namespace other than the caller's.

Every call raises OSError with the errno on failure.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
from typing import Any

__all__ = [
    "CLONE_NEWCGROUP",
    "CLONE_NEWNET",
    "CLONE_NEWUSER",
    "idmapped_tree",
    "network_namespace_problem",
    "new_user_and_network_namespaces",
    "new_user_namespace",
    "setns",
    "unshare",
]

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000

# x86_64 and aarch64 share the numbers of the new mount API (they came after the unified table).
_SYS_OPEN_TREE = 428
_SYS_MOUNT_SETATTR = 442
_OPEN_TREE_CLONE = 1
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_AT_RECURSIVE = 0x8000
_MOUNT_ATTR_IDMAP = 0x00100000
_NS_GET_NSTYPE = 0xB703  # ioctl on a namespace file: its CLONE_NEW* type

_libc: Any = ctypes.CDLL(None, use_errno=True)


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def unshare(flags: int) -> None:
    """unshare(2) for the calling thread."""
    _check(_libc.unshare(flags), "unshare")


def setns(fd: int, nstype: int) -> None:
    """setns(2): move the calling thread into the namespace `fd` refers to."""
    _check(_libc.setns(fd, nstype), "setns")


def idmapped_tree(path: str, userns_fd: int) -> int:
    """A detached copy of the mount tree at `path`, ID-mapped through `userns_fd`.

    Returns an O_CLOEXEC descriptor; the copy lives as long as something refers to it (this
    descriptor, or a mount such as an overlay that uses `/proc/self/fd/N` as a layer).
    """
    flags = _OPEN_TREE_CLONE | os.O_CLOEXEC | _AT_RECURSIVE
    fd = _check(_libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, path.encode(), flags), "open_tree")
    attr = _MountAttr(_MOUNT_ATTR_IDMAP, 0, 0, userns_fd)
    try:
        _check(
            _libc.syscall(
                _SYS_MOUNT_SETATTR,
                fd,
                b"",
                _AT_EMPTY_PATH | _AT_RECURSIVE,
                ctypes.byref(attr),
                ctypes.sizeof(attr),
            ),
            "mount_setattr",
        )
    except OSError:
        os.close(fd)
        raise
    return fd


def new_user_namespace(host_id: int, count: int) -> int:
    """A user namespace whose ids 0..count-1 are host ids host_id..host_id+count-1 (uids and
    gids alike); returns an O_CLOEXEC descriptor for it.

    A child enters the namespace, the parent writes its maps, opens it and lets the child go.
    Call only from a process with a single thread (the child is a plain fork).
    """
    userns, _ = _namespaces_of_a_child(CLONE_NEWUSER, host_id, count)
    return userns


def new_user_and_network_namespaces(host_id: int, count: int) -> tuple[int, int]:
    """A user namespace as `new_user_namespace` makes, and a network namespace it owns (made
    in the same unshare); O_CLOEXEC descriptors of both, user first.

    The network namespace's owner is what a sandbox's view of the host turns on: the kernel
    lets a process mount a fresh sysfs, showing that namespace's devices alone, only with
    CAP_SYS_ADMIN over the owner of its network namespace (else crun falls back to a bind of
    the host's /sys, every host device listed and writable but for permissions), and it sends
    the host's kernel uevents only to network namespaces the initial user namespace owns.
    """
    userns, netns = _namespaces_of_a_child(CLONE_NEWUSER | CLONE_NEWNET, host_id, count)
    assert netns is not None
    return userns, netns


def _namespaces_of_a_child(flags: int, host_id: int, count: int) -> tuple[int, int | None]:
    ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
    done_r, done_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:  # the child: nothing here may raise into the parent's code
        code = 0
        try:
            os.close(ready_r)
            os.close(done_w)  # else its own copy would keep the parent's EOF from reaching it
            unshare(flags)
            os.write(ready_w, b"1")
            os.read(done_r, 1)
        except BaseException:
            code = 1
        os._exit(code)
    os.close(ready_w)
    os.close(done_r)
    userns = -1
    try:
        if os.read(ready_r, 1) != b"1":
            raise OSError(0, "the namespace helper failed")
        mapping = f"0 {host_id} {count}\n"
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{pid}/{name}", "w") as f:
                f.write(mapping)
        userns = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        if not flags & CLONE_NEWNET:
            return userns, None
        return userns, os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    except BaseException:
        if userns >= 0:
            os.close(userns)
        raise
    finally:
        os.close(ready_r)
        os.close(done_w)
        os.waitpid(pid, 0)


def network_namespace_problem(path: str) -> str | None:
    """None if `path` names a network namespace (`/run/netns/NAME`, `/proc/PID/ns/net`) other
    than the calling thread's own, else why not."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        return f"cannot open {path}: {e.strerror}"
    try:
        try:
            kind = fcntl.ioctl(fd, _NS_GET_NSTYPE)
        except OSError:
            return f"{path} is not a namespace (`ip netns add NAME` makes /run/netns/NAME)"
        if kind != CLONE_NEWNET:
            return f"{path} is a namespace, but not a network namespace"
        mine = os.stat("/proc/thread-self/ns/net")
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
            return f"{path} is this process's own network namespace (the host's)"
    finally:
        os.close(fd)
    return None
