"""Whole simulated runs: the same seed plays the same run; every fault kind happens; a bug
planted in flyd is caught within the seeds CI runs; `python -m sim` reports and replays."""

from __future__ import annotations

import collections
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import structlog

from flyd.commits import GroupCommit
from sim import __main__ as cli
from sim.schedule import FAULT_KINDS, Schedule, shrink

SHORT = Schedule(chaos=15.0, calm=15.0)
# For the planted disk bug: no proxies nor slots, whose replicas churn through the resyncs a
# lying disk causes (a run takes seconds, not half of one) and play no part in catching it.
PLAIN = Schedule(proxies=0, slots=0)
PLAIN_SHORT = Schedule(chaos=15.0, calm=15.0, proxies=0, slots=0)


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    """The services' own logs off: a run holds thousands of lines of them."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    return


def test_the_same_seed_plays_the_same_run() -> None:
    first, again, other = SHORT.run(12), SHORT.run(12), SHORT.run(13)
    assert first.trace == again.trace
    assert (first.faults, first.calls, first.violations) == (
        again.faults,
        again.calls,
        again.violations,
    )
    assert other.trace != first.trace


def test_every_fault_kind_happens_within_a_few_seeds() -> None:
    seen: collections.Counter[str] = collections.Counter()
    for seed in range(12):
        seen.update(SHORT.run(seed).faults)
        if all(seen[kind] for kind in FAULT_KINDS):
            break
    assert {kind: seen[kind] for kind in FAULT_KINDS} == {
        kind: seen[kind] for kind in FAULT_KINDS if seen[kind]
    }, f"never happened: {[k for k in FAULT_KINDS if not seen[k]]}"


def test_a_run_of_fewer_faults_draws_the_same_ones_at_the_same_times() -> None:
    """What shrinking stands on: the faults a seed draws never depend on what they did."""
    full = SHORT.run(21)
    assert len(full.struck) > 4, full.struck
    some = sorted(full.struck)[::2]
    fewer = SHORT.run(21, only=some)
    assert set(fewer.struck) <= set(some)
    assert all(fewer.struck[place] == full.struck[place] for place in fewer.struck)
    assert fewer.trace != full.trace
    assert SHORT.run(21, only=[]).struck == {}


_write_next = GroupCommit._write_next


def _lying_write_next(self: GroupCommit) -> None:
    """The planted bug: a batch's committers are told it is durable as soon as it is handed
    to the disk, not once it is synced (what the disk says of it later is dropped)."""
    writer, seq = self._writer, self._assigned  # (a batch takes every queued commit)
    if writer is None:
        _write_next(self)
        return

    class Lying:
        def call(self, fn: Any, args: Any, then: Any) -> None:
            writer.call(fn, args, lambda result, error: None)
            then(seq, None)

    self._writer = Lying()  # type: ignore[assignment]
    try:
        _write_next(self)
    finally:
        self._writer = writer


def test_a_flyd_that_acknowledges_before_its_disk_syncs_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(GroupCommit, "_write_next", _lying_write_next)
    schedule = PLAIN
    for seed in range(100):
        report = schedule.run(seed)
        if report.violations:
            break
    assert report.violations, "100 seeds and the planted bug never showed"
    monkeypatch.undo()  # and it is the plant that seed found: without it, the seed is clean
    assert schedule.run(seed).violations == []


def test_a_failing_run_shrinks_to_a_few_of_its_faults_that_still_break_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(GroupCommit, "_write_next", _lying_write_next)
    report = PLAIN_SHORT.run(0)
    assert report.violations, "the planted bug did not show in seed 0"
    small, kept = shrink(PLAIN_SHORT, report, budget=10)
    assert small.violations
    assert 0 < len(kept) < len(report.struck)
    assert PLAIN_SHORT.run(0, only=kept).violations == small.violations  # a replay of those
    # python -m sim shrinks the seeds that fail, and prints how to replay the shrunk run.
    monkeypatch.setattr(
        cli,
        "Schedule",
        lambda **kw: Schedule(chaos=15.0, calm=15.0, proxies=0, slots=0, **kw),
    )
    monkeypatch.setattr(cli, "SHRINK_RUNS", 3)
    assert cli.main(["--seeds", "1", "--start", "0", "--jobs", "1"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"shrunk to \d+ of its \d+ faults:", out), out
    [replay] = re.findall(r"python -m sim --seed 0 --faults ([0-9,]+)", out)
    assert cli.main(["--seed", "0", "--faults", replay]) == 1


def test_python_m_sim_reports_its_runs_and_exits_0_when_none_broke_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["--seeds", "2", "--start", "40", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    for line in ("schedules run", "simulated hours", "faults: kill", "seeds with violations"):
        assert line in out, out
    assert re.search(r"^schedules run +2$", out, re.MULTILINE), out


def test_python_m_sim_replays_one_seed() -> None:
    assert cli.main(["--seed", "40"]) == 0


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--seeds", "0"], "--seeds must be at least 1"),
        (["--hours", "-1"], "--hours must be > 0"),
        (["--jobs", "0"], "--jobs must be at least 1"),
        (["--seed", "1", "--seeds", "2"], "not allowed with argument"),
        (["--seeds", "2", "--faults", "1"], "--faults goes with --seed"),
        (["--seed", "1", "--faults", "1,x"], "--faults must be comma-separated numbers"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(flags)
    assert exited.value.code == 2
    assert says in capsys.readouterr().err


def test_a_seed_replays_the_same_in_another_process_whatever_its_hash_seed() -> None:
    """`python -m sim` fixes string hashing (sets of ids iterate by it) before it runs."""
    traces = set()
    for hash_seed in ("1", "random"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        done = subprocess.run(
            [sys.executable, "-m", "sim", "--seed", "7"],
            capture_output=True, text=True, env=env, timeout=300, check=True,
        )  # fmt: skip
        traces |= {line for line in done.stdout.splitlines() if line.startswith("trace ")}
    assert len(traces) == 1, traces
