"""An OCI machine's writable layer on a disk file of its own (`flyd.drivers.writable`), through
the driver: sized by `Limits.disk_mib`, made ahead in the spares, grown with its config, kept
across restarts, and a layer from before disks moved into one.

Real containers on real loop devices (skipped, with the reason, where crun cannot run); nothing
waits on wall-clock time.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path

import pytest

from flyd.drivers.base import ExitStatus, Limits
from flyd.drivers.oci import UIDS_PER_MACHINE
from flyd.drivers.spares import SPARES
from flyd.drivers.writable import DISK_FILE
from flyd.storage import diskfile
from model.validate import DEFAULT_DISK_MIB
from tests.flyd.driver_support import (
    LIMITS,
    OCI_UNAVAILABLE,
    Exits,
    log_lines,
    logged,
    loops_under,
    run_machine,
    sh,
    spec,
    wait_until,
)

UID_BASE = 1 << 30  # OciDriver's default
# What a machine says of its disk: how big its rootfs is, and how much it could write.
DF = "df -k / | tail -1 | awk '{print \"size_k\", $2}'"


def sized(mib: int) -> Limits:
    return dataclasses.replace(LIMITS, disk_mib=mib)


def size_k(lines: list[str]) -> int:
    return int([line for line in lines if line.startswith("size_k")][-1].split()[1])


@pytest.fixture
def kind() -> str:
    """Only OCI drivers here (tests/flyd/conftest.py's `make_driver` builds what this says)."""
    if OCI_UNAVAILABLE is not None:
        pytest.skip(f"crun cannot run here: {OCI_UNAVAILABLE}")
    return "oci"


def _any_loop_under(root: Path) -> bool:
    """Any loop device bound to a file under `root`, spares' included."""
    prefix = str(root.resolve()) + "/"
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            if backing.read_text().startswith(prefix):
                return True
        except OSError:
            continue
    return False


def spare_disks(run_root: Path) -> dict[int, int]:
    """The spares' disk files: inode -> size in MiB."""
    out = {}
    for path in (run_root / ".spare").glob(f"*/{DISK_FILE}"):
        sb = diskfile.read_superblock(path)
        if sb is not None:
            out[path.stat().st_ino] = sb.size_mib
    return out


async def test_a_first_start_takes_a_spare_disk_and_spares_follow_the_sizes_asked(
    make_driver, image: Path, run_root: Path
) -> None:
    exits = Exits()
    driver = make_driver(exits)
    await run_machine(driver, spec("warm", sh("exec sleep 600"), image))
    await wait_until(lambda: len(spare_disks(run_root)) == SPARES, "the spares' disks")
    assert set(spare_disks(run_root).values()) == {DEFAULT_DISK_MIB}
    made_ahead = spare_disks(run_root)

    # Mounted ahead too, by the driver (a loop device each), once each file is made.
    def mounted() -> bool:
        spare_files = list((run_root / ".spare").glob(f"*/{DISK_FILE}"))
        return len(spare_files) == SPARES and all(map(diskfile.loops_of, spare_files))

    await wait_until(mounted, "the spares' disks mounted")

    await run_machine(driver, spec("m-default", sh(f"{DF}; echo said; exec sleep 600"), image))
    disk = run_root / "m-default" / DISK_FILE
    assert disk.stat().st_ino in made_ahead  # renamed into place with its spare run dir
    await logged(driver, "m-default", "said")
    size = size_k(log_lines(driver, "m-default", 5))
    assert DEFAULT_DISK_MIB * 1024 * 0.9 <= size <= DEFAULT_DISK_MIB * 1024

    # Another size: made on the spot; once most first starts ask for it, spares are made at
    # it, and (the older ones taken) a first start of that size takes one.
    taken_ahead = None
    for i in range(SPARES + 4):
        ahead = {ino for ino, mib in spare_disks(run_root).items() if mib == 64}
        mid = f"m-64-{i}"
        await run_machine(driver, spec(mid, ["true"], image, limits=sized(64)))
        assert await exits.wait(mid) == ExitStatus(0, None)
        assert diskfile.read_superblock(run_root / mid / DISK_FILE).size_mib == 64
        if (run_root / mid / DISK_FILE).stat().st_ino in ahead:
            taken_ahead = i
            break
        await wait_until(lambda: len(spare_disks(run_root)) == SPARES, "the spares made again")
    assert taken_ahead is not None, "no first start of 64 MiB took a spare disk made ahead"
    assert taken_ahead >= 2  # the first ones, while 256 MiB was the size most asked for
    for mid in ("warm", "m-default"):
        await driver.stop(mid, signal.SIGKILL, timeout=5)
    # A driver that closes lets go of its spares' mounts with the spares.
    await driver.close()
    await wait_until(lambda: not _any_loop_under(run_root), "no loop device under the run root")


async def test_the_layer_stays_across_restarts_and_grows_with_its_config(
    make_driver, image: Path, run_root: Path
) -> None:
    exits = Exits()
    driver = make_driver(exits)
    write = sh(f"[ -f /kept ] && echo found; echo kept > /kept; {DF}; echo done")
    await run_machine(driver, spec("m1", write, image, limits=sized(16)))
    assert await exits.wait("m1") == ExitStatus(0, None)
    first = log_lines(driver, "m1", 5)
    assert "found" not in first
    assert size_k(first) <= 16 * 1024
    # Its disk is let go of as its wrapper goes: nothing holds it while it is stopped.
    await wait_until(lambda: not loops_under(run_root), "its disk to be let go")

    await run_machine(driver, spec("m1", write, image, limits=sized(48)))  # its config grew
    assert await exits.wait("m1", 2) == ExitStatus(0, None)
    second = log_lines(driver, "m1", 5)
    assert "found" in second  # what it wrote is still there
    assert 40 * 1024 <= size_k(second) <= 48 * 1024
    assert diskfile.read_superblock(run_root / "m1" / DISK_FILE).size_mib == 48

    # A smaller size (flyd refuses such updates) keeps the disk as it is: it never shrinks.
    await run_machine(driver, spec("m1", write, image, limits=sized(16)))
    assert await exits.wait("m1", 3) == ExitStatus(0, None)
    assert 40 * 1024 <= size_k(log_lines(driver, "m1", 5)) <= 48 * 1024

    await driver.cleanup("m1")
    assert not (run_root / "m1").exists()
    await wait_until(lambda: not loops_under(run_root), "no loop device of it")


async def test_a_layer_on_the_host_from_before_disks_moves_into_one(
    make_driver, image: Path, run_root: Path
) -> None:
    """A machine made before machines had disks of their own keeps what it wrote: its next
    start moves the upper layer from its run dir into a disk file, owners and all."""
    exits = Exits()
    driver = make_driver(exits)
    await run_machine(driver, spec("m1", sh("echo first"), image, limits=sized(32)))
    assert await exits.wait("m1") == ExitStatus(0, None)
    await wait_until(lambda: not loops_under(run_root), "its disk to be let go")
    # As a flyd of before left it: upper/ and work/ in the run dir, no disk file.
    run_dir = run_root / "m1"
    os.unlink(run_dir / DISK_FILE)
    root_uid = UID_BASE + int((run_dir / "slot").read_text()) * UIDS_PER_MACHINE
    os.mkdir(run_dir / "upper", 0o755)
    os.mkdir(run_dir / "work", 0o700)
    (run_dir / "upper" / "written-before").write_text("from the old layer\n")
    for path in (run_dir / "upper", run_dir / "upper" / "written-before"):
        os.chown(path, root_uid, root_uid)

    read = sh("cat /written-before; stat -c '%u' /written-before; echo more > /written-before")
    await run_machine(driver, spec("m1", read, image, limits=sized(32)))
    assert await exits.wait("m1", 2) == ExitStatus(0, None)
    assert log_lines(driver, "m1", 3)[-2:] == ["from the old layer", "0"]  # its root's
    assert not (run_dir / "upper").exists()
    assert not (run_dir / "work").exists()
    assert diskfile.read_superblock(run_dir / DISK_FILE).size_mib == 32
