"""`make test-under-load` (tests/under_load.py): what it runs; its hogs never outlive it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests import under_load
from tests.harness import REPO_ROOT

DEADLINE = 60.0


def test_the_parts_run_exist_and_include_every_process_level_module() -> None:
    parts = under_load.parts()
    assert all((REPO_ROOT / part).exists() for part in parts), parts
    process_modules = {
        str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "tests").rglob("*_process.py")
    }
    assert process_modules
    assert process_modules <= set(parts)
    assert "tests/e2e" in parts


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie is gone too: it spins no more (this test is not its parent, init reaps it).
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "Z"


def test_a_hog_stops_by_itself_once_the_run_that_started_it_is_gone() -> None:
    # A parent that starts one hog and dies without stopping it (as a SIGKILLed run would).
    parent = subprocess.run(
        [
            sys.executable,
            "-c",
            "from tests import under_load; print(under_load.start_hogs(1)[0].pid)",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        check=True,
    )
    hog = int(parent.stdout)
    deadline = time.monotonic() + DEADLINE
    while not _gone(hog):
        if time.monotonic() > deadline:
            os.kill(hog, 9)
            raise AssertionError(f"the hog {hog} outlived its run by {DEADLINE:g} s")
        time.sleep(0.05)


def test_bad_arguments_are_refused_before_any_hog_starts() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "tests.under_load", "--runs", "0"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        check=False,
    )
    assert run.returncode == 2
    assert "--runs must be >= 1" in run.stderr
