"""The systemd units of deploy/: systemd takes them as written, and flyd's holds it to bounds.

`nonomad.hosts` runs each unit's ExecStart with its [Service] limits (`read_limits`,
tests/e2e/test_hosts.py checks the running services); here the limits are read, and the units
checked by systemd itself (`systemd-analyze verify`, where it is installed), with ExecStart
pointed at this tree's programs and EnvironmentFile at deploy/'s examples.
"""

from __future__ import annotations

import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flyd.drivers.fdlimit import machines_within
from flyd.settings import CapacitySettings
from model.validate import CONFIG_LIMITS
from nonomad.hosts import (
    DEPLOY,
    UNITS,
    HostsError,
    UnitLimits,
    _may_raise,
    applicable,
    read_limits,
)

ANALYZE = shutil.which("systemd-analyze")


def unit(tmp_path: Path, service: str, other: str = "") -> Path:
    path = tmp_path / "x.service"
    path.write_text(f"[Unit]\nDescription=x\n{other}\n[Service]\nExecStart=/bin/true\n{service}\n")
    return path


@pytest.mark.parametrize(
    ("service", "limits"),
    [
        ("", UnitLimits()),
        ("LimitNOFILE=65536\nMemoryMax=2G", UnitLimits((65536, 65536), 2 << 30)),
        ("LimitNOFILE=1024:524288\nMemoryMax=512M", UnitLimits((1024, 524288), 512 << 20)),
        ("MemoryMax=1048576", UnitLimits(None, 1 << 20)),
        ("MemoryMax=infinity", UnitLimits()),
    ],
)
def test_a_unit_s_limits_read_as_systemd_reads_them(
    tmp_path: Path, service: str, limits: UnitLimits
) -> None:
    # A key of the same name in another section is not the service's.
    assert read_limits(unit(tmp_path, service, other="MemoryMax=1K")) == limits


@pytest.mark.parametrize(
    "service", ["LimitNOFILE=infinity", "LimitNOFILE=1:x", "MemoryMax=50%", "MemoryMax=2GB"]
)
def test_a_limit_the_harness_cannot_apply_is_refused_naming_the_key(
    tmp_path: Path, service: str
) -> None:
    with pytest.raises(HostsError, match=rf"x\.service: {service.split('=')[0]}="):
        read_limits(unit(tmp_path, service))


def test_a_harness_that_may_not_raise_its_hard_limit_gives_what_it_has(
    capsys: pytest.CaptureFixture[str],
) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no hard descriptor limit here")
    assert applicable(UnitLimits()) == UnitLimits()
    within = UnitLimits((64, 128), 1 << 30)
    assert applicable(within) == within
    past = UnitLimits((1024, hard + 1), 1 << 30)
    if _may_raise():  # as systemd: the unit's, whatever this process's own
        assert applicable(past) == past
    else:
        assert applicable(past) == UnitLimits((1024, hard), 1 << 30)
        assert f"services get {hard}" in capsys.readouterr().err


def test_flyd_s_unit_bounds_its_memory_and_holds_a_full_worker_s_descriptors() -> None:
    limits = read_limits(DEPLOY / UNITS["flyd"])
    assert limits.memory_max is not None
    assert limits.nofile is not None
    # flyd raises its soft limit to the hard one; at that, the default capacity fits whole.
    machines = CapacitySettings().machines
    ports = CONFIG_LIMITS.counts["flyd.v1.MachineConfig.services"]
    assert machines_within(limits.nofile[1], machines, ports=ports) == machines


@pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("role", sorted(UNITS))
def test_systemd_takes_each_unit_as_written(tmp_path: Path, role: str) -> None:
    assert ANALYZE is not None
    text = (DEPLOY / UNITS[role]).read_text()
    text = text.replace("/opt/nonomad/.venv/bin/", f"{Path(sys.executable).parent}/")
    text = text.replace("/etc/nonomad/", f"{DEPLOY}/")
    path = tmp_path / UNITS[role]
    path.write_text(text)
    verify = subprocess.run(
        [ANALYZE, "verify", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    # systemd answers 0 even for a key it ignores: anything it says is a problem of the unit.
    assert (verify.returncode, verify.stdout + verify.stderr) == (0, "")
