"""`nonomad machines`, `regions` and `workers` against a real fleet, human and --json."""

from __future__ import annotations

import asyncio
import json
import re
import signal

from nonomad.client import Client
from tests.cli.conftest import NONOMAD, CliFleet, nonomad
from tests.cli.support import one_line_error
from tests.flaps.conftest import eventually
from tests.harness import REPO_ROOT

# It serves $PORT too (quietly), so that it is ready: started means serving.
TICKER = (
    "python3 -m http.server --bind 127.0.0.1 $PORT >/dev/null 2>&1 & "
    "echo hello-$GREETING; i=0; while true; do i=$((i+1)); echo tick-$i; sleep 0.2; done"
)


async def listed(flaps: Client, app: str, ids: set[str], include_destroyed: bool = False) -> bool:
    machines = await flaps.list_machines(app, include_destroyed=include_destroyed)
    return {m.id for m in machines} == ids


async def test_the_fleet_as_regions_and_workers(cli_fleet: CliFleet) -> None:
    regions, sized, workers, workers_table = await asyncio.gather(
        cli_fleet("regions", "--json"),
        cli_fleet("regions", "--cpu", "100", "--memory", "64"),
        cli_fleet("workers", "--json", "--region", "ams"),
        cli_fleet("workers"),
    )
    [ams] = regions.json()
    assert (ams["name"], ams["workers"], ams["alive_workers"]) == ("ams", 2, 2)
    assert ams["total"]["memory_mib"] == 1024  # a number, not ProtoJSON's int64 string

    assert sized.code == 0, sized.err
    assert sized.out.splitlines()[0].split()[-1] == "FITS"
    # 512 MiB / 64 MiB = 8 machines on each of the two workers.
    assert re.search(r"^ams\s+2/2\s+8000/8000\s+1024/1024\s+16$", sized.out, re.M), sized.out

    by_id = {w["info"]["id"]: w for w in workers.json()}
    assert sorted(by_id) == ["ams-1", "ams-2"]
    assert {w["status"] for w in by_id.values()} == {"WORKER_STATUS_ALIVE"}
    assert workers_table.code == 0, workers_table.err
    lines = workers_table.out.splitlines()
    assert lines[0].split()[:3] == ["WORKER", "REGION", "STATUS"]
    assert [line.split()[:3] for line in lines[1:]] == [
        ["ams-1", "ams", "alive"],
        ["ams-2", "ams", "alive"],
    ]


async def test_a_machine_from_run_to_destroy(cli_fleet: CliFleet) -> None:
    created = (
        await cli_fleet(
            "machines", "run", "web", "--image", "demo:v1", "--region", "ams",
            "--cpu", "100", "--memory", "64", "--env", "GREETING=hi", "--port", "8080",
            "--name", "ticker", "--json", "--", "sh", "-c", TICKER,
        )
    ).json()  # fmt: skip
    mid = created["id"]
    assert created["state"] == "MACHINE_STATE_STARTED"
    assert created["name"] == "ticker"
    assert created["config"]["env"] == {"GREETING": "hi"}
    assert created["config"]["entrypoint"] == ["sh", "-c", TICKER]
    assert [p["internal_port"] for p in created["ports"]] == [8080]

    async with cli_fleet.client() as flaps:
        await eventually(lambda: listed(flaps, "web", {mid}), 10, "the machine listed")

        async def ticked() -> bool:
            return "tick-3" in [line async for line in flaps.machine_logs(mid, tail_lines=1000)]

        await eventually(ticked, 15, "three ticks logged")
        await flaps.wait_machine(mid, "started", ready=True)

    table, as_json, started, show, show_json, logs, logs_json, why, why_json = await asyncio.gather(
        cli_fleet("machines", "list", "web"),
        cli_fleet("machines", "list", "web", "--json"),
        cli_fleet("machines", "list", "web", "--state", "started", "--region", "ams", "--json"),
        cli_fleet("machines", "show", mid),
        cli_fleet("machines", "show", mid, "--json"),
        cli_fleet("machines", "logs", mid, "--tail", "1000"),
        cli_fleet("machines", "logs", mid, "--tail", "1000", "--json"),
        cli_fleet("machines", "why", mid),
        cli_fleet("machines", "why", mid, "--json"),
    )
    assert table.code == 0, table.err
    header, row = table.out.splitlines()
    assert header.split()[:4] == ["ID", "NAME", "STATE", "ROLE"]
    assert row.split()[:8] == [mid, "ticker", "started", "primary", "ams", created["worker_id"],
                               "demo:v1", "100m/64MiB"]  # fmt: skip
    assert [m["id"] for m in as_json.json()] == [m["id"] for m in started.json()] == [mid]

    assert show.code == 0, show.err
    assert re.search(r"^state\s+started$", show.out, re.M), show.out
    assert re.search(r"^env\s+GREETING=hi$", show.out, re.M), show.out
    assert re.search(r"^8080\s+127\.0\.0\.1:\d+$", show.out, re.M), show.out
    assert re.search(r"^EVENTS\n(.*\n)*\d+\s.*\screate\s", show.out, re.M), show.out
    detail = show_json.json()
    assert detail["id"] == mid
    assert "create" in [e["type"] for e in detail["events"]]

    # Why here: the decision that placed it, as its worker keeps it.
    worker = created["worker_id"]
    assert why.code == 0, why.err
    assert why.out.startswith(f"{mid} is on {worker}: placed "), why.out
    assert re.search(r"^region ams: placed \(2 examined\)$", why.out, re.M), why.out
    assert re.search(r"^\s*WORKER\s+SCORE\s+CPU\s+MEMORY\s+IMAGE_CACHED$", why.out, re.M)
    assert re.search(rf"^\* {worker}\s+\d\.\d{{3}}\s", why.out, re.M), why.out
    decision = why_json.json()
    assert decision["worker_id"] == worker
    [ams] = decision["regions"]
    assert (ams["region"], ams["outcome"], ams["examined"]) == ("ams", "placed", 2)
    assert {c["worker_id"] for c in ams["candidates"]} == {"ams-1", "ams-2"}

    assert logs.code == 0, logs.err
    assert logs.out.splitlines()[:2] == ["hello-hi", "tick-1"]
    assert [json.loads(line)["line"] for line in logs_json.out.splitlines()][:2] == [
        "hello-hi",
        "tick-1",
    ]

    await follow_then_ctrl_c(cli_fleet, mid)

    stop = await cli_fleet("machines", "stop", mid, "--wait")
    assert (stop.code, stop.out) == (0, f"{mid}: stopped\n"), stop.err
    waited = (
        await cli_fleet("machines", "wait", mid, "stopped", "--json", "--timeout", "5")
    ).json()
    assert waited["state"] == "MACHINE_STATE_STOPPED"
    start = (await cli_fleet("machines", "start", mid, "--wait", "--json")).json()
    assert start["state"] == "MACHINE_STATE_STARTED"
    restart = await cli_fleet("machines", "restart", mid, "--signal", "SIGKILL", "--wait")
    assert (restart.code, restart.out) == (0, f"{mid}: started\n"), restart.err

    # A standby on the other worker, and what the platform refuses, side by side.
    results = await asyncio.gather(
        cli_fleet(
            "machines", "run", "web", "--image", "demo:v1", "--region", "ams", "--memory", "64",
            "--standby-for", mid, "--json", "--", "sleep", "1000",
        ),
        cli_fleet("machines", "run", "idle", "--image", "demo:v1", "--region", "ams",
                  "--memory", "64", "--no-start", "--json"),
        cli_fleet("machines", "destroy", mid),
        cli_fleet("machines", "show", "ams-1-000000000000"),
        cli_fleet("machines", "run", "web", "--image", "demo:v1", "--region", "ams",
                  "--memory", "4096"),
        cli_fleet("machines", "run", "web", "--image", "demo:v1", "--region", "nowhere"),
        nonomad("machines", "list", "web", *cli_fleet.tls, env=cli_fleet.env),  # no token
        cli_fleet("machines", "wait", mid, "stopped", "--timeout", "0.5"),
        cli_fleet("machines", "why", "ams-1-000000000000"),
    )  # fmt: skip
    standby, idle, not_forced, unknown, no_room, no_region, anonymous, too_soon, no_why = results
    spare = standby.json()
    assert spare["worker_id"] != created["worker_id"]
    assert spare["state"] == "MACHINE_STATE_CREATED"
    assert spare["config"]["standbys"] == [mid]
    assert idle.json()["state"] == "MACHINE_STATE_CREATED"
    one_line_error(not_forced, 1, "FAILED_PRECONDITION")
    one_line_error(unknown, 1, "NOT_FOUND", "ams-1-000000000000")
    one_line_error(no_room, 1, "RESOURCE_EXHAUSTED", "2 insufficient_memory")
    one_line_error(no_region, 1, "INVALID_ARGUMENT", "nowhere")
    one_line_error(anonymous, 1, "UNAUTHENTICATED")
    one_line_error(too_soon, 1, "DEADLINE_EXCEEDED", "started, not stopped")
    one_line_error(no_why, 1, "NOT_FOUND", "ams-1-000000000000")

    destroyed, spare_gone = await asyncio.gather(
        cli_fleet("machines", "destroy", mid, "--force", "--wait", "--json"),
        cli_fleet("machines", "destroy", spare["id"], "--force", "--wait"),
    )
    assert destroyed.json()["state"] == "MACHINE_STATE_DESTROYED"
    assert (spare_gone.code, spare_gone.out) == (0, f"{spare['id']}: destroyed\n"), spare_gone.err
    async with cli_fleet.client() as flaps:

        async def both_gone() -> bool:
            return await listed(flaps, "web", {mid, spare["id"]}, include_destroyed=True) and (
                await listed(flaps, "web", set())
            )

        await eventually(both_gone, 10, "both destroyed in the registry")
    everything, nothing = await asyncio.gather(
        cli_fleet("machines", "list", "web", "--all", "--json"),
        cli_fleet("machines", "list", "web"),
    )
    assert {(m["id"], m["state"]) for m in everything.json()} == {
        (mid, "MACHINE_STATE_DESTROYED"),
        (spare["id"], "MACHINE_STATE_DESTROYED"),
    }
    assert (nothing.code, nothing.out) == (0, "no machines in app web\n")


async def follow_then_ctrl_c(cli_fleet: CliFleet, mid: str) -> None:
    """`logs --follow` prints new lines as they come; Ctrl-C ends it quietly with exit 0."""
    proc = await asyncio.create_subprocess_exec(
        *NONOMAD, "machines", "logs", mid, "--follow", "--tail", "1",
        "--token-file", str(cli_fleet.token_file), *cli_fleet.tls,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        cwd=REPO_ROOT, env=cli_fleet.env,
    )  # fmt: skip
    assert proc.stdout is not None
    assert proc.stderr is not None
    try:
        ticks: list[int] = []
        async with asyncio.timeout(30):
            while len(ticks) < 3:
                line = (await proc.stdout.readline()).decode()
                assert line, (await proc.stderr.read()).decode()
                ticks.append(int(line.strip().removeprefix("tick-")))
        # New lines, in order, as the machine writes them.
        assert ticks == list(range(ticks[0], ticks[0] + 3))
        proc.send_signal(signal.SIGINT)
        async with asyncio.timeout(20):
            code = await proc.wait()
        assert (code, (await proc.stderr.read()).decode()) == (0, "")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
