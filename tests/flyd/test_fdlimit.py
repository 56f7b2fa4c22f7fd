"""flyd's descriptor limit (issue 27, item 6): raised at start as far as the host allows, and
no more machines taken than it holds. Each case runs in a child process: a lowered hard limit
could not be raised again in this one."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest

from flyd.drivers.fdlimit import FDS_BASE, FDS_PER_MACHINE, machines_within

CHILD = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), int(sys.argv[3])))
from flyd.main import descriptor_budget
from flyd.settings import FlydSettings
settings = FlydSettings.model_validate({"capacity": {"machines": int(sys.argv[1])}})
descriptor_budget(settings)
print(json.dumps([resource.getrlimit(resource.RLIMIT_NOFILE)[0], settings.capacity.machines]))
"""


def in_child(soft: int, hard: int, machines: int) -> subprocess.CompletedProcess[str]:
    # The child lowers its own limits before it imports anything: a preexec_fn would fork this
    # process, whose gRPC threads' fork handlers can abort the child (seen once in CI).
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(machines), str(soft), str(hard)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_flyd_raises_its_soft_limit_to_the_hard_one_and_keeps_its_capacity() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < FDS_BASE + 10 * (FDS_PER_MACHINE + 16):
        pytest.skip(f"this host's hard limit ({hard}) holds fewer than 10 machines")
    done = in_child(256, hard, 10)
    assert done.returncode == 0, done.stderr
    soft, machines = json.loads(done.stdout.splitlines()[-1])  # after flyd's log lines
    assert soft == hard or hard == resource.RLIM_INFINITY
    assert machines == 10


def test_a_limit_that_holds_fewer_machines_lowers_the_capacity_saying_why() -> None:
    done = in_child(1024, 1024, 1000)
    assert done.returncode == 0, done.stderr
    soft, machines = json.loads(done.stdout.splitlines()[-1])  # after flyd's log lines
    assert (soft, machines) == (1024, machines_within(1024, 1000, ports=16))
    assert machines == (1024 - FDS_BASE) // (FDS_PER_MACHINE + 16) == 28
    assert "capacity_machines_lowered" in done.stdout + done.stderr


def test_a_limit_that_holds_no_machine_stops_flyd() -> None:
    done = in_child(FDS_BASE, FDS_BASE, 1000)
    assert done.returncode != 0
    assert f"a descriptor limit of {FDS_BASE} holds no machine" in done.stderr


@pytest.mark.parametrize(
    ("limit", "machines", "ports", "fit"),
    [
        (1 << 20, 1000, 16, 1000),
        (FDS_BASE + 18 * 10, 1000, 16, 10),
        (FDS_BASE + 3 * 10, 1000, 1, 10),
        (FDS_BASE - 1, 1000, 16, 0),
    ],
)
def test_machines_within_a_limit(limit: int, machines: int, ports: int, fit: int) -> None:
    assert machines_within(limit, machines, ports=ports) == fit
