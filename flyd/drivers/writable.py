"""An OCI machine's writable layer: the overlay's upper and work directories, on a disk file of
the machine's own (`flyd.storage.diskfile`) sized by its `guest.disk_mib`.

Whatever the machine writes into its rootfs lands in the upper directory, so a machine that
writes past its size gets ENOSPC, and nothing it writes reaches the worker's filesystem (flyd's
log, the image cache, other machines' layers). The layer stays across restarts and goes on
destroy, with the run dir that holds its file (`disk.ext4`).

Layout of the filesystem: `upper/` (owned by the machine's root, its host uid), `work/`
(host root's, 0700: overlayfs' own). The overlay is mounted by host root in the wrapper's
namespace, which is why the upper layer is chowned, not ID-mapped: overlayfs makes its work
files as its mounter, and host root has no uid in an ID-mapping to the machine's range.

Every disk file is made with those two directories in it, and in `upper/` the mount points crun
would make there for an image that names no base (`bundle.skeleton`), copied by mkfs from a
template in the run root (`.layer/`): on such a machine's first start they are its own, owned
by its root, less any the image has itself (whose own would otherwise be hidden); any other
image's first start drops them. Made ahead, they cost the start nothing, and their modes are
the usual ones (crun makes its mount points 01755 and 0700).

A first start takes the disk file of a spare run dir when its size is the machine's, already
mounted: spares are made (mkfs at the lowest CPU priority, so it yields to the starts it is
made for) and mounted ahead (a descriptor this driver holds: 8 loop devices and mounts per
worker, gone with flyd), at the size most first starts asked for lately (`spare_mib`). A fleet
of one size pays neither mkfs nor mount on the start path; a size no spare has costs a mkfs
(5-12 ms) and a mount in the thread that prepares the run while netd makes the namespaces.
Later starts mount the file there (~1 ms idle, 2-4 ms on a busy host). The mount lives in the
wrapper's namespace only, held by the descriptor the wrapper keeps and by the overlay, and goes
with them, whoever dies first.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import shutil
import subprocess
import threading
from pathlib import Path

import structlog

from flyd.drivers.base import ProcessSpec
from flyd.storage import diskfile
from model.validate import DEFAULT_DISK_MIB

__all__ = ["DISK_FILE", "WritableLayers", "overlay_options"]

log = structlog.get_logger(__name__)

DISK_FILE = "disk.ext4"
_TEMPLATE = ".layer"  # in the run root: what every disk file is made with
_RECENT = 32  # first starts whose sizes decide the spares'


class WritableLayers:
    """Makes and mounts the writable layers of the OCI machines under `run_root`; see the
    module docstring. `skeleton`: crun's mount points, as `bundle.skeleton` lists them."""

    def __init__(self, run_root: Path, skeleton: list[tuple[str, bool]]) -> None:
        self._template = run_root / _TEMPLATE
        self._skeleton = skeleton
        self._made_template = False
        self._lock = threading.Lock()
        self._recent: collections.deque[int] = collections.deque(maxlen=_RECENT)
        # Spare run dir (its name, the spare's token) -> its disk's inode, size and mount.
        self._mounted: dict[str, tuple[int, int, int]] = {}

    @property
    def spare_mib(self) -> int:
        """The size spares are made at: the commonest of the recent first starts' sizes (the
        latest of those tied), the default before any. Spares made at another size are still
        taken first (the oldest first): each costs its first start a mkfs."""
        if not self._recent:
            return DEFAULT_DISK_MIB
        counts = collections.Counter(self._recent)
        top = max(counts.values())
        return next(size for size in reversed(self._recent) if counts[size] == top)

    def make_spare(self, run_dir: Path) -> None:
        """In the spare thread: a disk file at `spare_mib` in a spare run dir, mounted."""
        path, size = run_dir / DISK_FILE, self.spare_mib
        self._create(path, size, background=True)
        fd = diskfile.mount(path)
        self._mounted[run_dir.name] = (os.stat(path).st_ino, size, fd)

    def close(self) -> None:
        """Let go of the spares' mounts (once the spares are removed)."""
        while self._mounted:
            *_, fd = self._mounted.popitem()[1]
            os.close(fd)

    def mount(
        self,
        run_dir: Path,
        spec: ProcessSpec,
        root_uid: int,
        *,
        first_start: bool,
        spare: str | None = None,
    ) -> int:
        """The machine's writable layer, mounted (detached); returns the mount's descriptor,
        the caller's to close once the wrapper has its copy. Blocking: call it in a thread.

        `spare`: the spare set this start took, if any: its disk, of the right size, is mounted
        already. On a first start a disk file of another size than `spec.limits.disk_mib` is
        made anew; on a later one a smaller file (its config grew) is grown first, a larger
        one is kept (a disk never shrinks: updates that would shrink it are refused). Raises
        OSError.
        """
        path, size = run_dir / DISK_FILE, spec.limits.disk_mib
        if first_start:
            self._recent.append(size)
        fd = self._take_mounted(path, spare, size) if first_start else None
        if fd is None:
            sb = diskfile.read_superblock(path)
            older = (run_dir / "upper").is_dir()  # a layer from before disks: moved in below
            if sb is None or (first_start and sb.size_mib != size):
                self._create(path, size, skeleton=not older)
            elif sb.size_mib < size:
                diskfile.grow(path, size)
                log.info("machine_disk_grown", machine_id=spec.machine_id, to_mib=size)
            elif sb.size_mib > size:
                log.warning("machine_disk_larger", machine_id=spec.machine_id, disk_mib=sb.size_mib)
            fd = diskfile.mount(path)
        try:
            root = f"/proc/self/fd/{fd}"
            for name, mode in (("upper", 0o755), ("work", 0o700)):  # in the template, but a
                with contextlib.suppress(FileExistsError):  # layer moved in has no template
                    os.mkdir(f"{root}/{name}", mode)
            if first_start:
                self._take_skeleton(f"{root}/upper", spec, root_uid)
            if os.stat(f"{root}/upper").st_uid != root_uid:
                os.chown(f"{root}/upper", root_uid, root_uid)
            if (run_dir / "upper").is_dir():
                _move_in(run_dir, fd, size)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _take_mounted(self, path: Path, spare: str | None, size_mib: int) -> int | None:
        """The mount of the spare disk now at `path`, if this start took one of `size_mib`."""
        if spare is None or (held := self._mounted.pop(spare, None)) is None:
            return None
        ino, size, fd = held
        try:
            ours = os.stat(path).st_ino == ino
        except OSError:
            ours = False
        if ours and size == size_mib:
            return fd
        if not ours:  # the spare went back (the machine had a run dir)
            self._mounted[spare] = held
        else:
            os.close(fd)  # another size: its file is made anew
        return None

    def _take_skeleton(self, upper: str, spec: ProcessSpec, root_uid: int) -> None:
        """The mount points made ahead become the machine's (see the module docstring).
        Idempotent: a first start cut short does it again."""
        for rel, is_dir in reversed(self._skeleton):  # children first
            path = f"{upper}/{rel}"
            if spec.host_runtime and not os.path.lexists(spec.rootfs / rel):
                with contextlib.suppress(FileNotFoundError):
                    os.chown(path, root_uid, root_uid, follow_symlinks=False)
            elif is_dir:
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    def _create(
        self, path: Path, size_mib: int, *, skeleton: bool = True, background: bool = False
    ) -> None:
        # Scratch: a host crash has its spares swept and costs a machine's layer an e2fsck.
        if not skeleton:
            diskfile.create(path, size_mib, durable=False)
            return
        with self._lock:
            if not self._made_template:
                self._make_template()
                self._made_template = True
        diskfile.create(
            path, size_mib, contents=self._template, background=background, durable=False
        )

    def _make_template(self) -> None:
        """`.layer/`: `upper/` with the skeleton, `work/`; made anew by each driver (made
        aside and renamed into place, so a crash never leaves half of one in use)."""
        tmp = self._template.with_name(_TEMPLATE + ".new")
        for stale in (tmp, self._template):
            shutil.rmtree(stale, ignore_errors=True)
        os.mkdir(tmp, 0o755)
        os.mkdir(tmp / "upper", 0o755)
        os.mkdir(tmp / "work", 0o700)
        for rel, is_dir in self._skeleton:
            if is_dir:
                os.mkdir(tmp / "upper" / rel, 0o755)
            else:
                os.close(os.open(tmp / "upper" / rel, os.O_WRONLY | os.O_CREAT, 0o644))
        os.rename(tmp, self._template)


def overlay_options(disk_fd: int) -> str:
    """The upper and work options of the overlay whose writable layer is mounted at `disk_fd`
    (as the wrapper, which keeps that descriptor, sees it)."""
    return f"upperdir=/proc/self/fd/{disk_fd}/upper,workdir=/proc/self/fd/{disk_fd}/work"


def _move_in(run_dir: Path, fd: int, size_mib: int) -> None:
    """Move an upper layer of the host's filesystem (what a machine made before machines had
    disks of their own wrote there) into its disk: copied whole (owners, overlayfs' xattrs and
    whiteouts), then removed; one that does not fit stays where it is, and the start fails."""
    old = run_dir / "upper"
    done = subprocess.run(
        ["cp", "-a", f"{old}/.", f"/proc/self/fd/{fd}/upper/"],
        pass_fds=(fd,),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise OSError(
            errno.ENOSPC if "No space" in done.stderr else errno.EIO,
            f"its writable layer on the host ({old}) does not move into its disk of "
            f"{size_mib} MiB (guest.disk_mib): {' '.join(done.stderr.split())[-200:]}",
        )
    shutil.rmtree(old)
    shutil.rmtree(run_dir / "work", ignore_errors=True)
    log.info("machine_layer_moved_to_disk", machine_id=run_dir.name, disk_mib=size_mib)
