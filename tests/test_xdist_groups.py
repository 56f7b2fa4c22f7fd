"""`tests/xdist_groups.py`, as `make test` runs it: a little suite of its own under two xdist
workers, whose tests write down which worker ran them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.harness import REPO_ROOT

PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]

RECORD = """
import os
from pathlib import Path

import pytest


def ran(request):
    out = Path(os.environ["RAN_DIR"]) / request.node.name
    out.write_text(request.module.__name__ + " " + os.environ["PYTEST_XDIST_WORKER"])
"""

SUITE = {
    "conftest.py": 'pytest_plugins = ["tests.xdist_groups"]\n',
    "pytest.ini": "[pytest]\n",
    # Ten tests sharing a module-scoped fixture: one worker makes it, and runs them all.
    "test_shared.py": RECORD
    + """
@pytest.fixture(scope="module")
def cluster():
    return object()


@pytest.mark.parametrize("n", range(10))
def test_shared(cluster, request, n):
    ran(request)
""",
    # Two modules of one named group: never at the same time, so on one worker.
    **{
        f"test_apart_{side}.py": RECORD
        + f"""
pytestmark = pytest.mark.xdist_group("one-at-a-time")


@pytest.mark.parametrize("n", range(3))
def test_apart_{side}(request, n):
    ran(request)
"""
        for side in "ab"
    },
    # Twenty that share nothing: handed out one by one, to whichever worker is free.
    "test_free.py": RECORD
    + """
import time


@pytest.mark.parametrize("n", range(20))
def test_free(request, n):
    time.sleep(0.2)
    ran(request)
""",
}


def test_shared_fixtures_and_named_groups_keep_their_tests_on_one_worker(tmp_path: Path) -> None:
    suite, ran = tmp_path / "suite", tmp_path / "ran"
    suite.mkdir()
    ran.mkdir()
    for name, text in SUITE.items():
        (suite / name).write_text(text)
    # The inner run is a controller of its own, not one of this run's workers.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "NONOMAD_"))}
    # Only xdist: the plugins installed beside it (hypothesis, timeout, grpc, ...) would cost
    # each of the three interpreters their imports and are not what is tested.
    env.update(PYTHONPATH=str(REPO_ROOT), RAN_DIR=str(ran), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    run = subprocess.run(
        [*PYTEST, "-p", "xdist.plugin", "-n", "2", "--dist", "loadgroup", str(suite)],
        cwd=suite,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    workers: dict[str, set[str]] = {}
    for record in ran.iterdir():
        module, worker = record.read_text().split()
        workers.setdefault(module.split("_")[1], set()).add(worker)  # test_apart_a: apart
    assert len(list(ran.iterdir())) == 10 + 3 + 3 + 20
    assert len(workers["shared"]) == 1
    assert len(workers["apart"]) == 1
    assert workers["free"] == {"gw0", "gw1"}
