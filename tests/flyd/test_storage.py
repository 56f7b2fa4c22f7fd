"""Disk files (`flyd.storage.diskfile`): a sparse file with an ext4 filesystem of its own, on
real loop devices. Its size is a hard limit; it is mounted in no mount namespace; whoever is
SIGKILLed at whatever step, no loop device, mount or file is left that nobody holds.

Skipped, with the reason, where this host cannot make them (`diskfile.problem`).
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flyd.storage import diskfile
from tests.flyd.driver_support import loops_under

PROBLEM = diskfile.problem()
pytestmark = pytest.mark.skipif(PROBLEM is not None, reason=f"no disk files here: {PROBLEM}")
DEADLINE = 10.0
MIB = 1 << 20


def mounts_of_loops() -> set[str]:
    """The lines of this namespace's mount table that mount a loop device."""
    return {line for line in Path("/proc/self/mounts").read_text().splitlines() if "loop" in line}


def until(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def write_until_full(directory: str, name: str = "fill") -> tuple[int, int]:
    """Write 1 MiB chunks into `directory/name` until the filesystem refuses: (bytes written,
    the errno that stopped it)."""
    written = 0
    chunk = b"x" * MIB
    fd = os.open(f"{directory}/{name}", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while written < 1024 * MIB:
            try:
                written += os.write(fd, chunk)
            except OSError as e:
                return written, e.errno
            try:
                os.fsync(fd)
            except OSError as e:
                return written, e.errno
    finally:
        os.close(fd)
    return written, 0


def test_a_new_disk_file_is_sparse_clean_and_its_size(tmp_path: Path) -> None:
    path = tmp_path / "d.ext4"
    diskfile.create(path, 64)
    assert diskfile.read_superblock(path) == diskfile.Superblock(size_mib=64, clean=True)
    st = path.stat()
    assert st.st_size == 64 * MIB
    assert st.st_blocks * 512 < 2 * MIB  # mkfs wrote its metadata, nothing else
    assert st.st_mode & 0o777 == 0o600  # the host's root alone reads what is in it
    assert diskfile.read_superblock(tmp_path / "missing") is None
    (tmp_path / "not-ext4").write_bytes(b"\0" * 4096)
    assert diskfile.read_superblock(tmp_path / "not-ext4") is None


def test_a_scratch_disk_file_is_made_on_tmpfs_and_leaves_nothing_there(tmp_path: Path) -> None:
    """durable=False: mkfs runs in a nameless file on /dev/shm (its fsyncs cost the host's
    journal nothing), and what it wrote is copied into place: the same filesystem."""
    shm = set(os.listdir("/dev/shm"))
    path = tmp_path / "d.ext4"
    diskfile.create(path, 64, durable=False)
    assert set(os.listdir("/dev/shm")) == shm  # nothing named, nothing left
    assert diskfile.read_superblock(path) == diskfile.Superblock(size_mib=64, clean=True)
    assert path.stat().st_blocks * 512 < 2 * MIB
    fd = diskfile.mount(path)
    try:
        written, err = write_until_full(f"/proc/self/fd/{fd}")
        assert (err, 60 * MIB <= written <= 64 * MIB) == (errno.ENOSPC, True)
    finally:
        os.close(fd)


def test_a_create_cut_short_leaves_no_disk_file_and_is_done_again(tmp_path: Path) -> None:
    path = tmp_path / "d.ext4"
    # What a create killed before its rename leaves: a temporary, never the file itself.
    (tmp_path / "d.ext4.new").write_bytes(b"half a filesystem")
    assert diskfile.read_superblock(path) is None
    diskfile.create(path, 32)
    assert diskfile.read_superblock(path) == diskfile.Superblock(32, True)
    assert not (tmp_path / "d.ext4.new").exists()
    diskfile.remove(path)
    diskfile.remove(path)  # idempotent
    assert not any(tmp_path.iterdir())


def test_writing_past_the_size_is_enospc_and_the_host_file_stays_within_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "d.ext4"
    diskfile.create(path, 16)
    before = mounts_of_loops()
    fd = diskfile.mount(path)
    try:
        # Mounted, in no namespace: the mount table does not show it, sysfs shows its loop.
        assert mounts_of_loops() == before
        assert diskfile.loops_of(path)
        assert diskfile.read_superblock(path) == diskfile.Superblock(16, clean=False)
        written, err = write_until_full(f"/proc/self/fd/{fd}")
        assert err == errno.ENOSPC
        assert 13 * MIB <= written <= 16 * MIB  # all of it but the filesystem's own metadata
        # Root (this test) cannot go past it either: no blocks are reserved for it.
        with pytest.raises(OSError, match="No space left") as full:
            Path(f"/proc/self/fd/{fd}/more").write_bytes(b"y" * MIB)
        assert full.value.errno == errno.ENOSPC
        assert path.stat().st_blocks * 512 <= 16 * MIB
        os.unlink(f"/proc/self/fd/{fd}/fill")
        os.unlink(f"/proc/self/fd/{fd}/more")
        os.sync()
        # Deleted is given back to the host's disk (mounted `discard`).
        assert path.stat().st_blocks * 512 < 4 * MIB
    finally:
        os.close(fd)
    until(lambda: not diskfile.loops_of(path), "the loop device to let go")
    assert diskfile.read_superblock(path) == diskfile.Superblock(16, clean=True)


def test_grow_keeps_what_is_written_and_never_shrinks(tmp_path: Path) -> None:
    path = tmp_path / "d.ext4"
    diskfile.create(path, 16)
    fd = diskfile.mount(path)
    Path(f"/proc/self/fd/{fd}/kept").write_text("still here\n")
    os.close(fd)
    until(lambda: not diskfile.loops_of(path), "the loop device to let go")
    assert diskfile.grow(path, 48) is True
    assert diskfile.read_superblock(path) == diskfile.Superblock(48, True)
    assert diskfile.grow(path, 48) is False  # that size already
    assert diskfile.grow(path, 32) is False  # never shrinks
    assert path.stat().st_size == 48 * MIB
    fd = diskfile.mount(path)
    try:
        assert Path(f"/proc/self/fd/{fd}/kept").read_text() == "still here\n"
        written, err = write_until_full(f"/proc/self/fd/{fd}")
        assert (err, written > 40 * MIB) == (errno.ENOSPC, True)
    finally:
        os.close(fd)


def test_a_grow_cut_short_after_the_truncate_is_finished_by_the_next(tmp_path: Path) -> None:
    path = tmp_path / "d.ext4"
    diskfile.create(path, 16)
    os.truncate(path, 40 * MIB)  # the grow died before resize2fs
    assert diskfile.read_superblock(path) == diskfile.Superblock(16, True)
    assert diskfile.grow(path, 40) is True
    assert diskfile.read_superblock(path) == diskfile.Superblock(40, True)


def test_a_mount_waits_for_an_earlier_one_to_go_and_repairs_what_a_crash_left(
    tmp_path: Path,
) -> None:
    path = tmp_path / "d.ext4"
    diskfile.create(path, 16)
    held = diskfile.mount(path)
    # Still mounted (a wrapper's namespace on its way out, say): a second mount waits, then
    # refuses rather than mount one filesystem twice.
    with pytest.raises(OSError, match="still in use") as busy:
        diskfile.mount(path, settle=0)
    assert busy.value.errno == errno.EBUSY
    waits: list[float] = []

    def first_one_goes(seconds: float) -> None:  # the earlier mount goes while it waits
        if not waits:
            os.close(held)
        waits.append(seconds)

    fd = diskfile.mount(path, sleep=first_one_goes)
    assert waits  # it waited
    Path(f"/proc/self/fd/{fd}/after").write_text("ok")
    os.close(fd)
    until(lambda: not diskfile.loops_of(path), "the loop device to let go")

    # A host that crashed with it mounted leaves it marked in use, and no loop device.
    debugfs = shutil.which("debugfs", path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")
    assert debugfs is not None
    subprocess.run([debugfs, "-w", "-R", "ssv state 0", str(path)], check=True, capture_output=True)
    assert diskfile.read_superblock(path) == diskfile.Superblock(16, clean=False)
    fd = diskfile.mount(path)  # e2fsck first
    try:
        assert Path(f"/proc/self/fd/{fd}/after").read_text() == "ok"
    finally:
        os.close(fd)
    until(lambda: not diskfile.loops_of(path), "the loop device to let go")
    assert diskfile.read_superblock(path) == diskfile.Superblock(16, clean=True)


# A process that makes and mounts a disk file step by step, saying each step on stdout and
# waiting for a line on stdin before the next: the test SIGKILLs it at the step it wants.
_STEPPER = """
import os, sys
from pathlib import Path
from flyd.storage import diskfile, kernel

path = Path(sys.argv[1])
def step(name):
    print(name, flush=True)
    sys.stdin.readline()

diskfile.create(path, 16)
step("created")
backing = os.open(path, os.O_RDWR)
number, device = kernel.attach_loop(backing)
os.close(backing)
step("attached")
mount = kernel.mount_detached("ext4", f"/dev/loop{number}", {})
step("mounted, the device still open")
os.close(device)
step("mounted")
fd = os.open(f"/proc/self/fd/{mount}/busy", os.O_WRONLY | os.O_CREAT)
os.write(fd, b"x" * 65536)
step("writing in it")
"""


@pytest.mark.parametrize(
    "step", ["created", "attached", "mounted, the device still open", "mounted", "writing in it"]
)
def test_sigkill_at_any_step_leaves_no_loop_device_or_mount(tmp_path: Path, step: str) -> None:
    path = tmp_path / "d.ext4"
    before = mounts_of_loops()
    proc = subprocess.Popen(
        [sys.executable, "-c", _STEPPER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None
    assert proc.stdout is not None
    try:
        while (said := proc.stdout.readline().strip()) != step:
            assert said, f"the stepper ended before {step!r}"
            proc.stdin.write("\n")
            proc.stdin.flush()
        if step != "created":
            assert diskfile.loops_of(path)  # it holds a loop device now
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(DEADLINE)
        proc.stdin.close()
        proc.stdout.close()
    until(lambda: not loops_under(tmp_path), "the dead process's loop device to let go")
    assert mounts_of_loops() == before
    # The filesystem was unmounted as its holder died: clean, and mounts again.
    assert diskfile.read_superblock(path) == diskfile.Superblock(16, clean=True)
    fd = diskfile.mount(path)
    os.close(fd)
    diskfile.remove(path)
    assert not path.exists()
