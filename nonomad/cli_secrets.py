"""`nonomad secrets set|unset|list APP`: an app's secrets, set on every one of its machines.

`set` and `unset` update each machine of the app (standbys too) with its config as flaps
returns it, secrets redacted: a redacted value keeps what the machine has, so only the names
given change. A started machine restarts with the new config, and is waited for (--timeout)
until it has started again; others stay as they are.
Nothing printed here holds a value.

Secrets are kept per machine, by its worker: there is no store of the app's own. So an app
with no machines has nowhere to keep them (`set` says so, and how to go on), and a machine
made later has only what it is given: `machines run --secret`, or `deploy`, which copies
them from one of the app's machines.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable

from flyd.v1 import machine_pb2 as pb
from model.validate import REDACTED
from nonomad.cli_common import CliError, describe, emit, run, table, wait_budget, wait_state
from nonomad.client import ApiError, Client, Machine, MachineConfig, state_name

BUSY_RETRY = 0.2
BUSY_FOR = 30.0  # how long a machine busy with another operation is waited for


async def _update(flaps: Client, machine: Machine, config: MachineConfig) -> Machine:
    """Update, waiting out MACHINE_BUSY (an operation under way) for a while."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + BUSY_FOR
    while True:
        try:
            started = machine.state == pb.MACHINE_STATE_STARTED
            return await flaps.update_machine(machine.id, config, skip_launch=not started)
        except ApiError as err:
            if err.reason != "MACHINE_BUSY" or loop.time() > deadline:
                raise
            await asyncio.sleep(BUSY_RETRY)


def no_machines(app: str) -> str:
    """Why secrets cannot be set on an app without machines, and what to do instead."""
    return (
        f"app {app} has no machines, and secrets are kept on machines (there is no store for "
        f"the app itself): create one with them, `nonomad machines run {app} --image IMAGE "
        f"--secret NAME=VALUE ...`, or run `nonomad deploy` first, then `nonomad secrets set "
        f"{app}`"
    )


def _apply(args: argparse.Namespace, change: Callable[[MachineConfig], bool]) -> int:
    async def body(flaps: Client) -> int:
        machines = await flaps.list_machines(args.app)
        if not machines:
            raise CliError(no_machines(args.app))
        rows: list[list[str]] = []
        report: list[dict[str, str]] = []
        for listed in sorted(machines, key=lambda m: m.id):
            machine = await flaps.get_machine(listed.id)
            config = MachineConfig()
            config.CopyFrom(machine.config)
            if not change(config):
                result = "unchanged"
            else:
                was_started = machine.state == pb.MACHINE_STATE_STARTED
                try:
                    machine = await _update(flaps, machine, config)
                    result = "updated"
                    if was_started:  # it restarts with them: wait until it serves again
                        machine = await wait_state(
                            flaps, machine.id, "started", wait_budget(args), machine.instance_id
                        )
                except ApiError as err:
                    result = f"failed: {describe(err, flaps.address)}"
            rows.append([machine.id, state_name(machine.state), result])
            report.append({"machine_id": machine.id, "state": rows[-1][1], "result": result})
        emit(args, report, lambda: table(rows, ["MACHINE", "STATE", "RESULT"]))
        return 1 if any(r["result"].startswith("failed") for r in report) else 0

    return run(args, body)


def cmd_set(args: argparse.Namespace) -> int:
    values = dict(args.pairs)

    def change(config: MachineConfig) -> bool:
        for name in config.secrets:  # as read: kept as they are
            config.secrets[name] = REDACTED
        config.secrets.update(values)
        return True

    return _apply(args, change)


def cmd_unset(args: argparse.Namespace) -> int:
    def change(config: MachineConfig) -> bool:
        gone = [name for name in args.names if name in config.secrets]
        for name in gone:
            del config.secrets[name]
        return bool(gone)

    return _apply(args, change)


def cmd_list(args: argparse.Namespace) -> int:
    async def body(flaps: Client) -> int:
        machines = sorted(await flaps.list_machines(args.app), key=lambda m: m.id)
        names = sorted({name for m in machines for name in m.config.secrets})
        report = {name: [m.id for m in machines if name in m.config.secrets] for name in names}
        rows = [
            [name, f"{len(ids)}/{len(machines)}", ", ".join(ids)] for name, ids in report.items()
        ]
        emit(
            args,
            report,
            lambda: table(rows, ["NAME", "MACHINES", "IDS"]) if rows else "no secrets",
        )
        return 0

    return run(args, body)
