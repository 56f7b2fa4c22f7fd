"""Each service runs as `python -m <package>` exactly as its console script does."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
DEADLINE = 60.0  # a cold interpreter importing grpc on a busy machine


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=DEADLINE, cwd=ROOT
    )


def package_of(entry: str) -> str:
    """`flaps.main:main` -> `flaps`; `nonomad.console.main:main` -> `nonomad.console`."""
    module = entry.partition(":")[0]
    return module.removesuffix(".main").removesuffix(".cli")


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_python_dash_m_prints_the_console_scripts_usage(script: str) -> None:
    package = package_of(SCRIPTS[script])
    by_module = run("-m", package, "--help")
    by_script = subprocess.run(
        [str(Path(sys.executable).parent / script), "--help"],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert by_module.returncode == 0, by_module.stderr
    assert by_module.stdout.startswith("usage: ")
    assert by_module.stdout == by_script.stdout


@pytest.mark.parametrize("module", ["flyd.main", "flaps.main", "registry.main", "proxy.main"])
def test_a_main_module_run_directly_is_the_service_too(module: str) -> None:
    """`python -m flaps.main` used to import and exit 0, doing nothing."""
    out = run("-m", module, "--no-such-flag")
    assert out.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in out.stderr


def test_a_setting_error_names_what_the_user_passed() -> None:
    out = run("-m", "flaps", "--dead-after", "600")
    assert out.returncode == 2
    assert out.stderr.startswith(
        "flaps: dead_after must be less than forget_after: --dead-after 600 is not below "
        "forget_after 600s (its default)"
    )
    assert "--forget-after" in out.stderr
