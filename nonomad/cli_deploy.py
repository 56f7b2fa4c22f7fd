"""`nonomad deploy APP_TOML`: make an app's machines match its spec (see nonomad.deploy; the
flags and help text are in nonomad.cli_args.add_deploy)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import structlog

from nonomad.client import ApiError, Client
from nonomad.deploy import (
    CREATE,
    REPLACE,
    STANDBY,
    DeployEvent,
    DeployReport,
    SlotPlan,
    deploy,
    plan,
    room,
)
from nonomad.spec import AppSpec, SpecError, load_spec
from runtime.logs import configure_logging

__all__ = ["cmd_deploy", "run"]

PROG = "nonomad deploy"


def cmd_deploy(args: argparse.Namespace) -> int:
    """The `nonomad deploy` command: connect to flaps (the shared flags), then `run`."""
    from nonomad.cli_common import run as with_client

    return with_client(args, lambda client: run(args, client))


async def run(args: argparse.Namespace, client: Client) -> int:
    """Run `deploy` (or `deploy --dry-run`) with `client`; returns the exit status.

    Progress goes to stdout as it happens (or the report as JSON at the end); the library's
    own log lines go to stderr (warnings only, unless the caller configured logging), so they
    never mix into `--json` output."""
    if not structlog.is_configured():
        configure_logging("nonomad-deploy", "warning")
    try:
        spec = load_spec(args.app_toml)
    except SpecError as err:
        for problem in err.problems:
            print(f"{PROG}: {problem}", file=sys.stderr)
        return 2
    if args.wait_timeout <= 0:
        print(f"{PROG}: --wait-timeout must be > 0", file=sys.stderr)
        return 2
    try:
        if args.dry_run:
            return await _dry_run(client, spec, as_json=args.json)
    except ApiError as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 1
    events: list[DeployEvent] = []

    def on_event(event: DeployEvent) -> None:
        events.append(event)
        if not args.json:
            print(event_line(event), flush=True)

    report = await deploy(
        client, spec, on_event=on_event, wait_timeout=args.wait_timeout, keep_created=args.keep
    )
    if args.json:
        out = report.to_dict()
        out["events"] = [e.to_dict() for e in events]
        print(json.dumps(out, indent=2))
    else:
        print()
        print(_summary(report))
    if not report.ok:
        print(f"{PROG}: failed: {report.reason}", file=sys.stderr)
        return 1
    return 0


def event_line(event: DeployEvent) -> str:
    return (
        f"  {event.kind:<12} {event.slot or '-':<28} {event.machine_id or '-':<22} {event.detail}"
    )


def _table(rows: list[list[str]], header: list[str]) -> str:
    from nonomad.cli_common import table

    return table(rows, header)


def _summary(report: DeployReport) -> str:
    rows = [[m.slot, m.role, m.machine_id, m.region, m.worker_id, m.state] for m in report.machines]
    lines = []
    if rows:
        lines += [_table(rows, ["SLOT", "ROLE", "MACHINE", "REGION", "WORKER", "STATE"]), ""]
    lines.append(
        f"{report.app} ({report.digest}): {len(report.created)} created, "
        f"{len(report.updated)} updated, {len(report.destroyed)} destroyed, "
        f"{len(report.unchanged)} unchanged"
        + (f", {len(report.rolled_back)} rolled back" if report.rolled_back else "")
        + (f", {len(report.undone)} created and destroyed again" if report.undone else "")
    )
    lines += [f"warning: {w}" for w in report.warnings]
    return "\n".join(lines)


async def _placement(
    client: Client, spec: AppSpec, p: SlotPlan, slots: list[SlotPlan], targets: dict[str, str]
) -> str:
    """Where flaps would put the slot's new machine now. Each is simulated on its own, except
    that a standby of a new primary avoids the worker that primary would get."""
    standby_for, avoid = "", ""
    if p.role == STANDBY:
        primary = next(s for s in slots if s.slot == spec.slot(p.region, p.index))
        if primary.action == CREATE:
            avoid = targets.get(primary.slot, "")
        else:
            standby_for = primary.machine_id
    config = spec.machine_config(p.region, p.slot, standby_for=standby_for)
    sim = await client.simulate_placement(
        spec.app, config, region=p.region, standby_for=[standby_for] if standby_for else []
    )
    candidates = [c for c in sim.candidates if c.worker_id != avoid]
    if candidates:
        targets[p.slot] = candidates[0].worker_id
        return f"on {candidates[0].worker_id}"
    counts = dict(sim.rejections_by_reason)
    if sim.candidates:  # only the new primary's worker would have it
        counts["standby_conflict"] = counts.get("standby_conflict", 0) + len(sim.candidates)
    reasons = ", ".join(f"{r}: {n}" for r, n in sorted(counts.items()))
    return f"no room ({reasons or 'no workers'})"


async def _dry_run(client: Client, spec: AppSpec, *, as_json: bool) -> int:
    the_plan = await plan(client, spec)
    placements: dict[str, str] = {}
    targets: dict[str, str] = {}
    for p in the_plan.slots:
        if p.action in (CREATE, REPLACE):
            placements[p.slot] = await _placement(client, spec, p, the_plan.slots, targets)
    no_room = [
        f"{p.slot} in {p.region}"
        for p in the_plan.slots
        if placements.get(p.slot, "").startswith("no room") and p.role != STANDBY
    ]
    short = [r for r in await room(client, spec, the_plan) if r.short]
    if as_json:
        out: dict[str, Any] = {
            "app": the_plan.app,
            "digest": the_plan.digest,
            "dry_run": True,
            "counts": the_plan.counts(),
            "short": [{"region": r.region, "creates": r.creates, "fits": r.fits} for r in short],
            "slots": [
                {**p.to_dict(), "placement": placements.get(p.slot, "")} for p in the_plan.slots
            ],
        }
        print(json.dumps(out, indent=2))
    else:
        rows = [
            [
                p.slot,
                p.role,
                p.region,
                p.action,
                p.machine_id or "-",
                placements.get(p.slot) or p.reason or "-",
            ]
            for p in the_plan.slots
        ]
        print(_table(rows, ["SLOT", "ROLE", "REGION", "ACTION", "MACHINE", "WHERE / WHY"]))
        counts = the_plan.counts()
        print(
            f"\n{the_plan.app} ({the_plan.digest}): "
            + ", ".join(f"{n} {a}" for a, n in sorted(counts.items()))
            + "; dry run, nothing changed"
        )
    if short:
        print(f"{PROG}: would fail: no room: {'; '.join(map(str, short))}", file=sys.stderr)
        return 1
    if no_room:
        print(f"{PROG}: would fail: no room for {', '.join(no_room)}", file=sys.stderr)
        return 1
    return 0
