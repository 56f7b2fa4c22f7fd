"""`make test-under-load`: the parts of the suite that wait on real processes, run beside a CPU
hog on every core, several times in a row (issue 28: a suite that holds on a busy machine).

    python -m tests.under_load [--runs 3] [--hogs N] [--workers 2] [-- pytest args]

The hog is N busy Python processes (default: one per CPU), started before the first run and
stopped after the last; each also stops by itself when this process is gone or after
`HOG_LIMIT` seconds, whichever comes first, so none outlives the run. The parts run are the
ones that start processes, clusters and real binaries and wait on them (`PARTS`): the end-to-end
tests, every `*_process.py` module, the CLI's and the README's. A run that fails stops the
series (there is no point in a second pass over a known flake): the exit status is pytest's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = (
    "tests/e2e",
    "tests/cli",
    "tests/deploy",
    "tests/test_cli.py",
    "tests/test_readme.py",
    "tests/test_grpcurl.py",
    "tests/test_secure_grpcurl.py",
)
"""The parts that wait on the system; with every `tests/**/*_process.py` (found, not listed)."""
HOG_LIMIT = 4 * 3600
"""Seconds a hog spins at most, whatever happens to this process."""

_HOG = """
import os, sys, time
parent, end = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
n = 0
while True:
    n += 1
    if n % 2_000_000 == 0 and (os.getppid() != parent or time.monotonic() > end):
        break
"""


def parts() -> list[str]:
    """The paths to run, relative to the project's root."""
    found = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("tests/**/*_process.py"))
    return [*PARTS, *found]


def start_hogs(count: int) -> list[subprocess.Popen[bytes]]:
    return [
        subprocess.Popen([sys.executable, "-c", _HOG, str(os.getpid()), str(HOG_LIMIT)])
        for _ in range(count)
    ]


def stop(hogs: list[subprocess.Popen[bytes]]) -> None:
    for hog in hogs:
        hog.kill()
    for hog in hogs:
        hog.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.under_load", description=__doc__)
    parser.add_argument("--runs", type=int, default=3, help="passes in a row (default 3)")
    parser.add_argument(
        "--hogs", type=int, default=os.cpu_count() or 2, help="busy processes (default: CPUs)"
    )
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (0: none)")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.hogs < 0 or args.workers < 0:
        parser.error("--runs must be >= 1, --hogs and --workers >= 0")
    command = [sys.executable, "-m", "pytest", "-q", "--durations=20"]
    if args.workers:
        command += ["-n", str(args.workers), "--dist", "loadgroup"]
    command += [*parts(), *args.pytest_args]
    hogs = start_hogs(args.hogs)
    took: list[float] = []
    status = 0
    try:
        for run in range(1, args.runs + 1):
            print(f"under load ({args.hogs} busy processes): run {run} of {args.runs}", flush=True)
            t0 = time.monotonic()
            status = subprocess.call(command, cwd=ROOT)
            took.append(time.monotonic() - t0)
            print(f"run {run}: exit {status} after {took[-1]:.0f} s", flush=True)
            if status != 0:
                break
    finally:
        stop(hogs)
    passed = len(took) if status == 0 else len(took) - 1
    times = ", ".join(f"{t:.0f} s" for t in took)
    print(f"under load: {passed} of {args.runs} runs passed in a row ({times})")
    return status


if __name__ == "__main__":
    sys.exit(main())
