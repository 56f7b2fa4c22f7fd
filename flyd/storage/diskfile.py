"""A disk file: a sparse file holding an ext4 filesystem of its own, so its size is a hard
limit on what is written into it (ENOSPC past it, for root too: no blocks are reserved).

What a disk file is and costs here:

- made by `create`: `ftruncate` to the size (sparse: nothing is allocated) and `mkfs.ext4`
  with no blocks reserved for root (`-m 0`), lazy inode tables never zeroed (mkfs writes
  ~0.2 MiB for 16 MiB, ~0.7 MiB for 1 GiB, ~16 MiB for 1 TiB; 5-12 ms up to 64 GiB, ~60 ms at
  1 TiB) and, by default, no journal (the writable layer of a machine is scratch: a host crash
  costs an `e2fsck` at its next mount, not data a journal would have kept; a volume asks for
  one). Made under a temporary name and renamed into place: a file at `path` is always whole.
- mounted by `mount`: bound to a loop device (direct I/O, autoclear) and mounted *detached*
  (`flyd.storage.kernel`): in no mount namespace, the host's included; the mount goes when
  the last descriptor or mount using it does, and the loop device with it. ~1 ms. A caller
  gets a descriptor; `/proc/self/fd/N/...` reaches the filesystem (an overlay's upper layer,
  a bind mount in a namespace of its own, or `namespaces.idmapped_tree` for an ID-mapped copy).
  Mounted `discard`: what is deleted in it is given back to the host's disk.
- grown by `grow`, offline only (an online resize needs CAP_SYS_RESOURCE, which flyd need not
  have): `e2fsck` and `resize2fs`, ~60 ms. Never shrunk.
- removed by `remove`: an unlink; a mount still using it keeps the blocks until it goes.

Crash safety: nothing is ever left mounted or bound by a process that died. On disk, the
filesystem says whether it was unmounted cleanly (ext4 clears the "valid" state while it is
mounted): `mount` finds one that is not either still going away (an earlier mount of it not yet
released: a detached mount is put after its last process exits, a moment later) and waits for
its loop device to let go, or left mounted by a host that crashed, and repairs it first.

The caller keeps a file to one mount at a time (a machine's disk is mounted by its one run).
The tools are e2fsprogs' (`mkfs.ext4`, `e2fsck`, `resize2fs`), looked up in PATH and the
sbin directories.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import shutil
import struct
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flyd.storage.kernel import MOUNT_ATTR_NODEV, MOUNT_ATTR_NOSUID, attach_loop, mount_detached

__all__ = [
    "SETTLE_S",
    "Superblock",
    "create",
    "grow",
    "loops_of",
    "mount",
    "problem",
    "read_superblock",
    "remove",
]

_SBIN = ("/usr/sbin", "/sbin")
_TOOL_TIMEOUT_S = 120.0  # e2fsck of a large, damaged filesystem takes its time
SETTLE_S = 10.0
"""How long `mount` waits for an earlier mount of the file to go."""
_SETTLE_POLL_S = 0.002
# Lazy inode tables that the kernel never zeroes either (`noinit_itable`): a sparse file stays
# sparse. `errors=remount-ro`: a damaged filesystem stops taking writes rather than spread it.
_OPTIONS: dict[str, str | None] = {"noinit_itable": None, "discard": None, "errors": "remount-ro"}
_ATTRIBUTES = MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV
_TMP_SUFFIX = ".new"
_STAGE_DIR = "/dev/shm"

# The ext4 superblock: 1024 bytes at offset 1024 (<linux/ext4_fs.h> / e2fsprogs' ext2_fs.h).
_SB_OFFSET = 1024
_SB_MAGIC = 0xEF53
_VALID_FS = 0x1  # s_state: unmounted cleanly
_ERROR_FS = 0x2  # s_state: errors were found


@dataclass(frozen=True)
class Superblock:
    """What a disk file's filesystem says of itself."""

    size_mib: int
    clean: bool
    """Unmounted cleanly: not mounted now, nor left mounted by a crash, and no errors."""


def problem() -> str | None:
    """None when this host can make and mount disk files, else why not."""
    if os.geteuid() != 0:
        return "disk files need root (loop devices and mounts)"
    if not os.path.exists("/dev/loop-control"):
        return "no /dev/loop-control (the loop driver)"
    for tool in ("mkfs.ext4", "e2fsck", "resize2fs"):
        if _find(tool) is None:
            return f"no {tool} (e2fsprogs)"
    with contextlib.suppress(OSError):
        if "ext4" not in Path("/proc/filesystems").read_text():
            return "the kernel has no ext4"
    return None


def create(
    path: Path,
    size_mib: int,
    *,
    journal: bool = False,
    contents: Path | None = None,
    background: bool = False,
    durable: bool = True,
) -> None:
    """Make `path` a disk file of `size_mib` MiB: an ext4 filesystem whose root belongs to
    host root, empty or holding a copy of the directory `contents` (owners and modes kept).
    Replaces what is at `path`. Raises OSError (mkfs's own message in it).

    `background`: made ahead of need, mkfs runs at the lowest CPU priority (nice 19), so it
    yields to whatever is being waited for. `durable=False`: for a file nobody needs after a
    host crash (a spare, a machine's scratch layer): mkfs fsyncs what it wrote four times,
    each a journal commit of the host's filesystem that every other fsync there (flyd's log)
    queues behind, so it makes the filesystem in a nameless file on /dev/shm (tmpfs,
    O_TMPFILE: nothing to leave behind whoever dies), and what it wrote (~0.2-0.7 MiB, the
    rest is holes) is copied into place unsynced.
    """
    if size_mib <= 0:
        raise ValueError(f"a disk file needs a positive size, not {size_mib} MiB")
    tmp = _tmp(path)
    _sized(tmp, size_mib)
    stage = None if durable else _stage(size_mib)
    try:
        if stage is None:
            _mkfs(str(tmp), journal, contents, background)
        else:
            _mkfs(f"/proc/self/fd/{stage}", journal, contents, background, pass_fds=(stage,))
            _copy_extents(stage, tmp)
    finally:
        if stage is not None:
            os.close(stage)
    os.rename(tmp, path)


def _sized(path: Path, size_mib: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, size_mib << 20)
    finally:
        os.close(fd)


def _stage(size_mib: int) -> int | None:
    """A nameless sparse file of that size on /dev/shm to mkfs in (its descriptor), if that
    can be had."""
    try:
        fd = os.open(_STAGE_DIR, os.O_TMPFILE | os.O_RDWR, 0o600)
    except OSError:
        return None
    try:
        os.ftruncate(fd, size_mib << 20)
    except OSError:
        os.close(fd)
        return None
    return fd


def _copy_extents(src: int, dst: Path) -> None:
    """Copy what the file `src` holds (its data extents, not its holes) into `dst`."""
    fd = os.open(dst, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        end, offset = os.fstat(src).st_size, 0
        while offset < end:
            try:
                data = os.lseek(src, offset, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:
                    return  # only holes from here on
                raise
            hole = os.lseek(src, data, os.SEEK_HOLE)
            while data < hole:
                chunk = os.pread(src, min(hole - data, 1 << 20), data)
                os.pwrite(fd, chunk, data)
                data += len(chunk)
            offset = hole
    finally:
        os.close(fd)


def _mkfs(
    target: str,
    journal: bool,
    contents: Path | None,
    background: bool,
    pass_fds: tuple[int, ...] = (),
) -> None:
    features = "has_journal" if journal else "^has_journal"
    _run(
        "mkfs.ext4",
        "-q",
        "-F",
        "-b",
        "4096",
        "-T",
        "default",
        "-m",
        "0",
        "-O",
        features,
        "-E",
        "lazy_itable_init=1,lazy_journal_init=1,nodiscard,root_owner=0:0",
        *(["-d", str(contents)] if contents is not None else []),
        target,
        nice=19 if background else 0,
        pass_fds=pass_fds,
    )


def read_superblock(path: Path) -> Superblock | None:
    """The filesystem's own account of itself; None if `path` holds no ext4 filesystem (or
    does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(_SB_OFFSET)
            raw = f.read(1024)
    except FileNotFoundError:
        return None
    if len(raw) < 1024 or struct.unpack_from("<H", raw, 0x38)[0] != _SB_MAGIC:
        return None
    (blocks_lo,) = struct.unpack_from("<I", raw, 0x04)
    (log_block,) = struct.unpack_from("<I", raw, 0x18)
    (state,) = struct.unpack_from("<H", raw, 0x3A)
    (incompat,) = struct.unpack_from("<I", raw, 0x60)
    blocks_hi = struct.unpack_from("<I", raw, 0x150)[0] if incompat & 0x80 else 0  # 64bit
    size = ((blocks_hi << 32) | blocks_lo) * (1024 << log_block)
    return Superblock(size_mib=size >> 20, clean=state & (_VALID_FS | _ERROR_FS) == _VALID_FS)


def mount(
    path: Path, *, settle: float = SETTLE_S, sleep: Callable[[float], None] = time.sleep
) -> int:
    """Mount the disk file at `path`, detached; returns an O_CLOEXEC descriptor of the mount.

    An earlier mount of it still going away is waited for, up to `settle` seconds; one that a
    crash left is repaired (`e2fsck -y`) first. Raises OSError: EBUSY if the earlier mount
    stays, EIO if the filesystem cannot be repaired. Blocking: call it from a thread.
    """
    sb = read_superblock(path)
    if sb is None:
        raise OSError(errno.EINVAL, f"{path} holds no ext4 filesystem")
    if not sb.clean:
        _settle(path, settle, sleep)
        sb = read_superblock(path)
        if sb is None or not sb.clean:
            _repair(path)
    backing = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        number, device = attach_loop(backing)
    finally:
        os.close(backing)
    try:
        return mount_detached("ext4", f"/dev/loop{number}", _OPTIONS, _ATTRIBUTES)
    finally:
        os.close(device)  # the mount holds the device now; without one, autoclear lets it go


def grow(path: Path, size_mib: int) -> bool:
    """Grow the (unmounted) disk file at `path` to `size_mib` MiB; False when it is that size
    or larger already (it never shrinks). Idempotent: a grow cut short is finished by the
    next. Raises OSError.
    """
    sb = read_superblock(path)
    if sb is None:
        raise OSError(errno.EINVAL, f"{path} holds no ext4 filesystem")
    if sb.size_mib >= size_mib:
        return False
    _repair(path)  # resize2fs works only on a filesystem just checked
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        if os.fstat(fd).st_size < size_mib << 20:
            os.ftruncate(fd, size_mib << 20)
    finally:
        os.close(fd)
    _run("resize2fs", str(path), f"{size_mib}M")
    return True


def remove(path: Path) -> None:
    """Remove the disk file at `path` (and a temporary `create` left). Idempotent."""
    for p in (path, _tmp(path)):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def loops_of(path: Path) -> list[int]:
    """The loop devices bound to the file at `path` (from sysfs: one read per loop device)."""
    target = str(path.resolve())
    found = []
    with contextlib.suppress(FileNotFoundError), os.scandir("/sys/block") as entries:
        for entry in entries:
            if not entry.name.startswith("loop"):
                continue
            try:
                backing = Path(entry.path, "loop", "backing_file").read_text().strip()
            except OSError:
                continue  # not bound
            if backing == target:
                found.append(int(entry.name.removeprefix("loop")))
    return sorted(found)


def _settle(path: Path, settle: float, sleep: Callable[[float], None]) -> None:
    deadline = time.monotonic() + settle
    while loops := loops_of(path):
        if time.monotonic() >= deadline:
            raise OSError(errno.EBUSY, f"{path} is still in use by /dev/loop{loops[0]}")
        sleep(_SETTLE_POLL_S)


def _repair(path: Path) -> None:
    """`e2fsck -fy`: check it all, fix what it finds. Exit codes 1 and 2 are "fixed"."""
    tool = _find("e2fsck")
    assert tool is not None, "problem() checks the tools"
    done = subprocess.run(
        [tool, "-f", "-y", str(path)], capture_output=True, text=True, timeout=_TOOL_TIMEOUT_S
    )
    if done.returncode >= 4:
        raise OSError(errno.EIO, f"{path}: e2fsck could not repair it: {_tail(done)}")


def _run(name: str, *args: str, nice: int = 0, pass_fds: tuple[int, ...] = ()) -> None:
    tool = _find(name)
    if tool is None:
        raise OSError(errno.ENOENT, f"no {name} (e2fsprogs)")
    with subprocess.Popen(
        [tool, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        pass_fds=pass_fds,
    ) as proc:
        if nice:  # from its first moments on (no preexec_fn: this process has threads)
            with contextlib.suppress(ProcessLookupError):
                os.setpriority(os.PRIO_PROCESS, proc.pid, nice)
        try:
            out, err = proc.communicate(timeout=_TOOL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise OSError(errno.ETIMEDOUT, f"{name} took over {_TOOL_TIMEOUT_S:g}s") from None
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if done.returncode != 0:
        raise OSError(errno.EIO, f"{name} failed ({done.returncode}): {_tail(done)}")


def _tail(done: subprocess.CompletedProcess[str]) -> str:
    return " ".join((done.stderr or done.stdout).split())[-300:]


@functools.cache
def _find(name: str) -> str | None:
    path = os.pathsep.join([os.environ.get("PATH", ""), *_SBIN])
    return shutil.which(name, path=path)


def _tmp(path: Path) -> Path:
    return path.with_name(path.name + _TMP_SUFFIX)
