"""`nonomad machines ...`: list, show, why, run, start/stop/restart/destroy, logs and wait, via
flaps."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
from pathlib import Path

from model.errors import FlydError
from model.images.source import ImageSource
from model.slots import slot_of
from model.validate import DISK_LABEL, guest_disk_mib
from nonomad.cli_common import (
    FLAPS_ENV,
    CliError,
    UsageError,
    emit,
    key_values,
    local_cluster,
    run,
    state_dir,
    table,
    wait_budget,
    wait_state,
    when,
)
from nonomad.client import (
    ApiError,
    Client,
    GuestConfig,
    Machine,
    MachineConfig,
    PlacementDecision,
    state_name,
)
from nonomad.client import MachineEvent as Event
from nonomad.console.model import score_parts

# -- human output ------------------------------------------------------------------------------


def size(guest: GuestConfig) -> str:
    return f"{guest.cpu_millicores}m/{guest.memory_mib}MiB"


def display_name(machine: Machine) -> str:
    """The name given at create; a machine without one is named by its id."""
    return machine.name if machine.name and machine.name != machine.id else "-"


def ports(machine: Machine) -> str:
    return ", ".join(f"{p.internal_port}->{p.host}:{p.host_port}" for p in machine.ports) or "-"


def role(machine: Machine) -> str:
    """Its place in its slot: primary or standby, the generation once promoted, fenced."""
    slot = slot_of(machine)
    text = "primary" if slot.primary == machine.id else "standby"
    if slot.generation:
        text += f" g{slot.generation}"
    return text + (" fenced" if slot.fenced else "")


# The longest reason a table cell shows (`machines show` has all of it).
REASON_CELL = 100
# Worker statuses (flaps.v1.WorkerStatus) that `machines list` marks: its heartbeats stopped.
WORKER_MARKS = {2: "worker suspect", 3: "worker dead"}


def state_text(machine: Machine, worker_status: int = 0, *, cut: int = 0) -> str:
    """The state with its readiness: `started`, `started, not ready: nothing listening on
    8080 after 10s`, `restarting: crash-looping: exit 1, 3 restarts; last log: ...`, and
    `(worker dead)` when flaps has lost its worker. `cut`: the most characters of the reason."""
    text = state_name(machine.state)
    cond = machine.ready
    reason = cond.reason if not cut or len(cond.reason) <= cut else cond.reason[: cut - 3] + "..."
    if not machine.HasField("ready") or reason in ("", text):
        pass
    elif cond.ready:
        text += f" ({reason})"
    elif text == "started":
        text += f", not ready: {reason}"
    else:
        text += f": {reason}"
    mark = WORKER_MARKS.get(worker_status)
    return f"{text} ({mark})" if mark else text


def machines_table(machines: list[Machine], workers: dict[str, int] | None = None) -> str:
    """`workers`: each worker's status (flaps.v1.WorkerStatus) by id, to mark the lost."""
    statuses = workers or {}
    rows = [
        [
            m.id,
            display_name(m),
            state_text(m, statuses.get(m.worker_id, 0), cut=REASON_CELL),
            role(m),
            m.region,
            m.worker_id,
            m.config.image,
            size(m.config.guest),
            ports(m),
            when(m.created_at).partition(" (")[2].rstrip(")") or "-",
        ]
        for m in machines
    ]
    header = [
        "ID",
        "NAME",
        "STATE",
        "ROLE",
        "REGION",
        "WORKER",
        "IMAGE",
        "SIZE",
        "PORTS",
        "CREATED",
    ]
    return table(rows, header)


def command_line(config: MachineConfig) -> str:
    argv = [*config.entrypoint, *config.cmd]
    if not argv:
        return "(the image's)"
    text = shlex.join(argv)
    return text if config.entrypoint else f"(the image's entrypoint) {text}"


def last_exit(machine: Machine) -> str:
    ex = machine.last_exit
    if not machine.HasField("last_exit"):
        return "-"
    parts = []
    if ex.has_exit_code:
        parts.append(f"code {ex.exit_code}")
    if ex.signal:
        parts.append(f"signal {ex.signal}")
    if ex.oom_killed:
        parts.append("out of memory")
    return f"{', '.join(parts) or 'unknown'} at {when(ex.exited_at)}"


def show_text(machine: Machine) -> str:
    c = machine.config
    lease = machine.lease
    fields: list[tuple[str, object]] = [
        ("id", machine.id),
        ("name", display_name(machine)),
        ("app", machine.app),
        ("state", state_text(machine)),
        ("region", machine.region),
        ("worker", machine.worker_id),
        ("instance", machine.instance_id),
        ("image", c.image),
        ("command", command_line(c)),
        ("guest", f"{c.guest.cpu_millicores} millicores, {c.guest.memory_mib} MiB"),
        ("disk", f"{guest_disk_mib(c.guest)} MiB"),
        ("env", ", ".join(f"{k}={v}" for k, v in sorted(c.env.items())) or "-"),
        ("secrets", ", ".join(sorted(c.secrets)) or "-"),  # names: values never leave workers
        ("services", ", ".join(str(s.internal_port) for s in c.services) or "-"),
        ("standby for", ", ".join(c.standbys) or "-"),
        ("slot", slot_text(machine)),
        ("restarts", machine.restart_count),
        ("last exit", last_exit(machine)),
        ("lease", f"{lease.owner or '?'} until {when(lease.expires_at)}" if lease.nonce else "-"),
        ("created", when(machine.created_at)),
        ("updated", when(machine.updated_at)),
    ]
    out = [key_values(fields)]
    if machine.ports:
        rows = [[p.internal_port, f"{p.host}:{p.host_port}"] for p in machine.ports]
        out += ["", "PORTS", table(rows, ["INTERNAL", "HOST"])]
    out += ["", "EVENTS", events_table(list(machine.events))]
    return "\n".join(out)


def slot_text(machine: Machine) -> str:
    slot = slot_of(machine)
    text = f"{slot.id}, generation {slot.generation}, served by {slot.primary}"
    return text + (" (fenced: its worker is confirming it)" if slot.fenced else "")


def events_table(events: list[Event]) -> str:
    rows = [
        [
            e.seq,
            when(e.time),
            e.type,
            f"{state_name(e.from_state)} -> {state_name(e.to_state)}",
            e.reason or "-",
        ]
        for e in events
    ]
    return table(rows, ["SEQ", "TIME", "TYPE", "STATE", "REASON"])


def why_text(machine_id: str, why: PlacementDecision) -> str:
    """A placement decision, region by region: the candidates ranked with their sub-scores
    (the winner starred; "(key)": the worker the create's idempotency key picks, tried
    first), the rejections counted by reason, and the named ones."""
    out = [
        f"{machine_id} is on {why.worker_id}: placed {when(why.decided_at)}, "
        f"ranking a sample of up to {why.sample_size} workers per region"
    ]
    for region in why.regions:
        out += ["", f"region {region.region}: {region.outcome} ({region.examined} examined)"]
        parts = score_parts(c.sub_scores for c in region.candidates)
        rows = [
            [
                ("* " if c.worker_id == why.worker_id else "  ")
                + c.worker_id
                + (" (key)" if c.worker_id == region.keyed_worker_id else ""),
                f"{c.score:.3f}",
                *(f"{c.sub_scores[k]:.3f}" if k in c.sub_scores else "-" for k in parts),
            ]
            for c in region.candidates
        ]
        if rows:
            out.append(table(rows, ["  WORKER", "SCORE", *(k.upper() for k in parts)]))
        else:
            out.append("no worker could take it")
        counted = sorted(region.rejections_by_reason.items(), key=lambda kv: (-kv[1], kv[0]))
        if counted:
            out.append("rejected: " + ", ".join(f"{n} {reason}" for reason, n in counted))
        if region.rejections:
            named = [[r.worker_id, r.reason, r.detail or "-"] for r in region.rejections]
            out.append(table(named, ["WORKER", "REASON", "DETAIL"]))
    return "\n".join(out)


# -- commands ----------------------------------------------------------------------------------


def cmd_list(args: argparse.Namespace) -> int:
    async def body(flaps: Client) -> int:
        machines = await flaps.list_machines(
            args.app, region=args.region or "", state=args.state, include_destroyed=args.all
        )
        workers: dict[str, int] = {}
        if machines and not args.json:
            # A token that may not list workers gets the machines without the marks.
            with contextlib.suppress(ApiError):
                workers = {w.info.id: int(w.status) for w in await flaps.list_workers()}
        emit(
            args,
            machines,
            lambda: (
                machines_table(machines, workers) if machines else f"no machines in app {args.app}"
            ),
        )
        return 0

    return run(args, body)


def cmd_show(args: argparse.Namespace) -> int:
    async def body(flaps: Client) -> int:
        machine = await flaps.get_machine(args.id)
        events = await flaps.list_machine_events(args.id)
        del machine.events[:]
        machine.events.extend(events)
        emit(args, machine, lambda: show_text(machine))
        return 0

    return run(args, body)


def cmd_why(args: argparse.Namespace) -> int:
    async def body(flaps: Client) -> int:
        why = await flaps.get_placement(args.id)
        if why is None:
            raise CliError(
                f"no placement decision is kept for {args.id}: it was created straight on "
                "its worker, or is destroyed"
            )
        emit(args, why, lambda: why_text(args.id, why))
        return 0

    return run(args, body)


def image_ports(args: argparse.Namespace) -> list[int]:
    """The ports the image says its command serves on (`image build --port`), when the CLI
    talks to the local cluster and the image is in its image source; else none."""
    if getattr(args, "flaps", None) or os.environ.get(FLAPS_ENV):
        return []
    cluster = local_cluster(state_dir(args))
    if cluster is None:
        return []
    try:
        image = ImageSource(Path(cluster.image_source)).resolve(args.image)
        return list(image.read_config(image.read_manifest()).ports)
    except (FlydError, OSError):
        return []  # not built here: the workers pull it, and it publishes what --port names


def cmd_run(args: argparse.Namespace) -> int:
    if args.wait and args.no_start:
        raise UsageError(
            "--wait and --no-start: a machine that is not started has nothing to wait for"
        )
    config = MachineConfig(
        image=args.image,
        guest=GuestConfig(cpu_millicores=args.cpu, memory_mib=args.memory, disk_mib=args.disk),
        entrypoint=args.cmd_argv,
        env=dict(args.env),
        secrets=dict(args.secret),
    )
    for internal in args.port or image_ports(args):
        config.services.add(internal_port=internal)

    async def body(flaps: Client) -> int:
        machine = await flaps.create_machine(
            args.app,
            config,
            region=args.region,
            name=args.name or "",
            skip_launch=args.no_start,
            standby_for=args.standby_for,
            idempotency_key=args.idempotency_key or "",
        )
        standby = bool(args.standby_for)
        if args.wait and not standby:
            machine = await wait_state(flaps, machine.id, "started", wait_budget(args), ready=True)
        unlimited = False  # its worker does not bound what it writes (the process driver)
        if not args.json:
            with contextlib.suppress(ApiError):  # a token that may not list workers: unsaid
                unlimited = any(
                    w.info.id == machine.worker_id and DISK_LABEL not in w.info.labels
                    for w in await flaps.list_workers(region=machine.region)
                )

        def human() -> str:
            what = f"standby for {', '.join(args.standby_for)}" if standby else ""
            line = f"{machine.id} in {machine.region} on {machine.worker_id}: "
            line += state_text(machine) + (f" ({what})" if what else "")
            if unlimited:
                line += (
                    f"\ndisk: {guest_disk_mib(machine.config.guest)} MiB reserved, not limited: "
                    f"worker {machine.worker_id} runs machines as host processes"
                )
            return line + (f"\nports: {ports(machine)}" if machine.ports else "")

        emit(args, machine, human)
        return 0

    return run(args, body)


def cmd_lifecycle(args: argparse.Namespace) -> int:
    """start, stop, restart and destroy: one call, then with --wait the state it leads to."""

    async def body(flaps: Client) -> int:
        if args.action == "start":
            machine = await flaps.start_machine(args.id)
            target = "started"
        elif args.action == "stop":
            machine = await flaps.stop_machine(
                args.id, signal=args.signal or "", kill_timeout=args.kill_timeout
            )
            target = "stopped"
        elif args.action == "restart":
            machine = await flaps.restart_machine(
                args.id, signal=args.signal or "", kill_timeout=args.kill_timeout
            )
            target = "started"
        else:
            machine = await flaps.destroy_machine(args.id, force=args.force)
            target = "destroyed"
        if args.wait:
            ready = target == "started"  # started means serving: its ports and checks answer
            machine = await wait_state(flaps, args.id, target, wait_budget(args), ready=ready)
        emit(args, machine, lambda: f"{machine.id}: {state_text(machine)}")
        return 0

    return run(args, body)


def cmd_wait(args: argparse.Namespace) -> int:
    async def body(flaps: Client) -> int:
        ready = args.state == "started"  # started means serving: its ports and checks answer
        machine = await wait_state(flaps, args.id, args.state, wait_budget(args), ready=ready)
        emit(args, machine, lambda: f"{machine.id}: {state_text(machine)}")
        return 0

    return run(args, body)


def cmd_logs(args: argparse.Namespace) -> int:
    """Print the log tail; with --follow keep printing until Ctrl-C (or SIGTERM), exit 0."""

    async def body(flaps: Client) -> int:
        async def pump() -> None:
            # Cancelling this task ends the stream: the SDK's generator cancels its call.
            lines = flaps.machine_logs(args.id, tail_lines=args.tail, follow=args.follow)
            async for line in lines:
                print(json.dumps({"line": line}) if args.json else line, flush=args.follow)

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        reader = asyncio.create_task(pump())
        stopper = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({reader, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)
        if not reader.done():
            reader.cancel()  # Ctrl-C: the stream is cancelled, which ends it on flaps too
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            return 0
        reader.result()  # an error of the stream (ApiError) goes up from here
        return 0

    return run(args, body)
