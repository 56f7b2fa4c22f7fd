"""`python -m sim`: run simulated schedules of the whole cluster and check every invariant.

    python -m sim --seeds 500          the CI run: 500 seeds from one derived from the commit
    python -m sim --seed 1234          replay one seed, with every node's log in virtual time
    python -m sim --seed 1234 --faults 3,8
                                       replay it with only those of its faults (a shrunk run)
    python -m sim --hours 2            run seeds until 2 simulated hours have passed
    python -m sim --bench              schedules per minute (4 flyd, 1 flaps) and
                                       simulated-to-real time of an idle cluster

Exit 0 when no seed broke an invariant, 1 when one did (each printed with the command that
replays it, and the first few shrunk: the fewest of their faults found to break it still),
2 on bad flags.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import structlog

from sim.cluster import cluster
from sim.schedule import FAULT_KINDS, Report, Schedule, describe, shrink

SHRUNK = 3  # failing seeds shrunk after a run (each takes up to SHRINK_RUNS runs)
SHRINK_RUNS = 60


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The services' logs off, and their NONOMAD_READY lines (a thousand runs of them say
    nothing a summary does not)."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        yield


def _run(seed: int, workers: int = 3) -> Report:
    with _quiet():
        return Schedule(workers=workers).run(seed)


def _run_bench(seed: int) -> Report:
    return _run(seed, workers=4)


def idle_ratio(seconds: float = 600.0) -> float:
    """Simulated seconds per real second of an idle cluster: 4 flyd and a flaps, heartbeats
    and follow streams only."""
    with (
        _quiet(),
        tempfile.TemporaryDirectory(prefix="nonomad-sim-idle-") as tmp,
        cluster(1, Path(tmp)) as made,
    ):
        made.boot_flaps()
        for i in range(4):
            made.boot_flyd(made.add_host(f"w{i + 1}"))
        began, start = time.perf_counter(), made.world.now
        made.world.run_for(seconds)
        return (made.world.now - start) / (time.perf_counter() - began)


def commit_seed() -> int:
    """A first seed derived from the checked-out commit: each commit runs other seeds, and a
    rerun of one commit the same."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        head = "no-commit"
    return int(hashlib.sha256(head.encode()).hexdigest()[:8], 16)


def _reports(seeds: list[int], jobs: int, run: Callable[[int], Report] = _run) -> Iterator[Report]:
    if jobs <= 1:
        yield from map(run, seeds)
        return
    with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
        yield from pool.map(run, seeds, chunksize=4)


def summarize(reports: list[Report], real: float) -> str:
    faults: collections.Counter[str] = collections.Counter()
    for report in reports:
        faults.update(report.faults)
    simulated = sum(r.simulated for r in reports)
    failed = [r for r in reports if r.violations]
    rows = [
        ("schedules run", f"{len(reports)}"),
        ("simulated hours", f"{simulated / 3600:.2f}"),
        ("real seconds", f"{real:.1f}"),
        ("simulated / real", f"{simulated / real:.0f}x" if real else "-"),
        *((f"faults: {kind}", f"{faults[kind]}") for kind in FAULT_KINDS),
        ("calls", f"{sum(sum(r.calls.values()) for r in reports)}"),
        ("seeds with violations", f"{len(failed)}"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value:>10}" for name, value in rows)


def _same_hashes(argv: list[str]) -> None:
    """Run again with string hashing fixed, once: sets of ids iterate in an order that
    depends on it, and a seed must replay the same in every process."""
    if os.environ.get("PYTHONHASHSEED") != "0":
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        os.execve(sys.executable, [sys.executable, "-m", "sim", *argv], env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim", description=__doc__.split("\n")[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--seeds", type=int, help="how many seeds to run (default 500)")
    which.add_argument("--seed", type=int, help="replay one seed, with the nodes' logs")
    which.add_argument("--hours", type=float, help="run seeds until this many simulated hours")
    which.add_argument("--bench", action="store_true", help="measure schedules per minute")
    parser.add_argument("--start", type=int, help="the first seed (default: from the commit)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes")
    parser.add_argument(
        "--faults", help="with --seed: only these of its faults strike (comma-separated places)"
    )
    parser.add_argument(
        "--no-shrink", action="store_true", help="do not shrink the seeds that fail"
    )
    args = parser.parse_args(argv)
    only: list[int] | None = None
    if args.faults is not None:
        if args.seed is None:
            parser.error("--faults goes with --seed")
        try:
            only = [int(place) for place in args.faults.split(",") if place.strip()]
        except ValueError:
            parser.error(f"--faults must be comma-separated numbers, not {args.faults!r}")
    if args.seeds is not None and args.seeds < 1:
        parser.error("--seeds must be at least 1")
    if args.hours is not None and args.hours <= 0:
        parser.error("--hours must be > 0")
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")

    if args.seed is not None:
        report = Schedule().run(args.seed, only=only)  # the logs on: this is the replay
        print(describe(report))
        for place, fault in sorted(report.struck.items()):
            print(f"  fault {place}: {fault}")
        print(f"trace {report.trace}")
        for violation in report.violations:
            print(f"  violation: {violation}")
        return 1 if report.violations else 0

    start = commit_seed() if args.start is None else args.start
    began = time.perf_counter()
    reports: list[Report] = []
    if args.hours is not None:
        seed = start
        while sum(r.simulated for r in reports) < args.hours * 3600:
            batch = list(range(seed, seed + 4 * args.jobs))
            reports += _reports(batch, args.jobs)
            seed += len(batch)
    elif args.bench:
        reports = list(_reports(list(range(start, start + 60)), args.jobs, _run_bench))
    else:
        reports = list(_reports(list(range(start, start + (args.seeds or 500))), args.jobs))
    real = time.perf_counter() - began
    print(summarize(reports, real))
    if args.bench:
        per_minute = len(reports) / real * 60
        print(f"{'schedules per minute':<21}  {per_minute:>10.0f}")
        print(f"{'idle cluster, sim/real':<21}  {idle_ratio():>9.0f}x")
    failed = [r for r in reports if r.violations]
    for i, report in enumerate(failed):
        print(f"\n{describe(report)}")
        for violation in report.violations:
            print(f"  violation: {violation}")
        print(f"  replay: python -m sim --seed {report.seed}")
        if i < SHRUNK and not args.no_shrink and report.struck:
            with _quiet():
                small, kept = shrink(Schedule(), report, budget=SHRINK_RUNS)
            print(f"  shrunk to {len(kept)} of its {len(report.struck)} faults:")
            for place in kept:
                print(f"    fault {place}: {small.struck.get(place, report.struck[place])}")
            for violation in small.violations:
                print(f"    violation: {violation}")
            places = ",".join(map(str, kept))
            print(f"  replay: python -m sim --seed {report.seed} --faults {places}")
    return 1 if failed else 0


if __name__ == "__main__":
    _same_hashes(sys.argv[1:])
    sys.exit(main())
