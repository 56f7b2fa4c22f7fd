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
from tests.flyd.driver_support import Exits, run_machine, sh, spec


async def test_without_cgroups_machines_run_with_one_warning(run_root, image, tmp_path) -> None:
    exits = Exits()
    with structlog.testing.capture_logs() as logs:
        driver = ProcessDriver(run_root, on_exit=exits, cgroup_root=tmp_path / "no-cgroups")
    try:
        assert driver.limits_enforced is False
        warnings = [e for e in logs if e["log_level"] == "warning"]
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
        logs = driver.read_logs("m1", 10)
        assert status == ExitStatus(0, None), logs  # 125: it could not join its cgroups
        assert logs == [str(nobody.pw_uid), str(nobody.pw_gid)]  # none of flyd's groups
    finally:
        await driver.close()
        shutil.rmtree(base)
