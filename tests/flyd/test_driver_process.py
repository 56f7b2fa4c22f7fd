"""What only the process driver does: machines without cgroups, and as another host user."""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
from pathlib import Path

import pytest
import structlog

from flyd.drivers.base import ExitStatus
from flyd.drivers.process import ProcessDriver
from model.errors import UnsafeImage
from tests.flyd.driver_support import Exits, log_lines, run_machine, sh, spec


async def test_without_cgroups_machines_run_with_one_warning(run_root, image, tmp_path) -> None:
    exits = Exits()
    with structlog.testing.capture_logs() as logs:
        driver = ProcessDriver(run_root, on_exit=exits, cgroup_root=tmp_path / "no-cgroups")
    try:
        assert driver.limits_enforced is False
        # (An xdist worker runs with SIGINT ignored, which the driver warns about too: that
        # warning is the test runner's, not this driver's setup.)
        warnings = [
            e
            for e in logs
            if e["log_level"] == "warning" and e["event"] != "machines_inherit_ignored_signals"
        ]
        assert len(warnings) == 1
        assert warnings[0]["event"] == "cgroup_limits_not_enforced"
        assert "no cgroup v1 memory controller" in warnings[0]["reason"]
        await run_machine(driver, spec("m1", sh("exit 0"), image))
        assert await exits.wait("m1") == ExitStatus(0, None)
    finally:
        await driver.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="running machines as another user needs root")
async def test_run_as_unprivileged_user(prefix: str) -> None:
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user named nobody")
    base = Path(tempfile.mkdtemp(prefix="nonomad-test-"))  # pytest's tmp dirs are 0700
    os.chmod(base, 0o711)
    exits = Exits()
    driver = ProcessDriver(base / "run", on_exit=exits, cgroup_prefix=prefix, run_as="nobody")
    try:
        await run_machine(driver, spec("m1", sh("id -u; id -G"), base))
        status = await exits.wait("m1")
        logs = log_lines(driver, "m1", 10)
        assert status == ExitStatus(0, None), logs  # 125: it could not join its cgroups
        assert logs == [str(nobody.pw_uid), str(nobody.pw_gid)]  # none of flyd's groups
    finally:
        await driver.close()
        shutil.rmtree(base)


# -- a program the image does not have ---------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [["/bin/true"], ["true"], ["./true"]],
    ids=["absolute", "on the PATH", "relative"],
)
async def test_an_image_without_its_program_is_refused(
    run_root: Path, image: Path, tmp_path: Path, argv: list[str]
) -> None:
    """Issue 19, defect 3: a program the image lacks ran as the host's program of that name
    (/bin/true, or `true` on the host's PATH). An image with a base of its own is refused."""
    exits = Exits()
    driver = ProcessDriver(run_root, on_exit=exits, cgroup_root=tmp_path / "no-cgroups")
    try:
        with pytest.raises(UnsafeImage, match="image has no program"):
            await driver.start(spec("m1", argv, image, host_runtime=False))
        assert driver.leftovers() == []  # refused before anything was prepared
        # An image that names no base may borrow the host's program: it has no other.
        await run_machine(driver, spec("m2", ["true"], image, host_runtime=True))
        assert await exits.wait("m2") == ExitStatus(0, None)
    finally:
        await driver.close()


@pytest.mark.parametrize("program", ["/bin/hello", "hello", "./bin/hello"])
async def test_the_program_of_the_image_runs_not_the_hosts(
    run_root: Path, image: Path, tmp_path: Path, program: str
) -> None:
    (image / "bin").mkdir()
    hello = image / "bin" / "hello"
    hello.write_text("#!/bin/sh\necho from the image\n")
    hello.chmod(0o755)
    (image / "usr").mkdir()
    (image / "usr" / "bin").symlink_to("/bin")  # the image's own /bin, as in a chroot
    exits = Exits()
    driver = ProcessDriver(run_root, on_exit=exits, cgroup_root=tmp_path / "no-cgroups")
    try:
        machine = spec("m1", [program], image, host_runtime=False, env={"PATH": "/usr/bin:/bin"})
        await run_machine(driver, machine)
        assert await exits.wait("m1") == ExitStatus(0, None)
        assert log_lines(driver, "m1", 10) == ["from the image"]
        # The host's /usr/bin has `env`; the image's /usr/bin (its /bin) has not.
        with pytest.raises(UnsafeImage, match="image has no program 'env'"):
            await driver.start(spec("m2", ["env"], image, host_runtime=False))
    finally:
        await driver.close()
