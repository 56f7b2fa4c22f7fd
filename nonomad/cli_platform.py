"""`nonomad regions` and `nonomad workers`: the fleet as flaps sees it."""

from __future__ import annotations

import argparse

from flaps.v1 import platform_pb2
from nonomad.cli_common import UsageError, ago, emit, run, table
from nonomad.client import Client, GuestConfig, Region, Worker


def worker_status(worker: Worker) -> str:
    name = platform_pb2.WorkerStatus.Name(worker.status).removeprefix("WORKER_STATUS_").lower()
    return f"{name}, cordoned" if worker.capacity.cordoned else name


def regions_table(regions: list[Region], sized: bool) -> str:
    rows = []
    for r in regions:
        row = [
            r.name,
            f"{r.alive_workers}/{r.workers}",
            f"{r.free.cpu_millicores}/{r.total.cpu_millicores}",
            f"{r.free.memory_mib}/{r.total.memory_mib}",
        ]
        rows.append([*row, r.fits] if sized else row)
    header = ["REGION", "WORKERS ALIVE", "CPU FREE (m)", "MEM FREE (MiB)"]
    return table(rows, [*header, "FITS"] if sized else header)


def workers_table(workers: list[Worker]) -> str:
    rows = [
        [
            w.info.id,
            w.info.region,
            worker_status(w),
            w.info.address,
            f"{w.capacity.free.cpu_millicores}/{w.capacity.total.cpu_millicores}",
            f"{w.capacity.free.memory_mib}/{w.capacity.total.memory_mib}",
            ", ".join(f"{k}={v}" for k, v in sorted(w.capacity.machines_by_state.items())) or "-",
            ago(w.last_heartbeat),
        ]
        for w in workers
    ]
    header = ["WORKER", "REGION", "STATUS", "GRPC", "CPU FREE (m)", "MEM FREE (MiB)"]
    return table(rows, [*header, "MACHINES", "HEARTBEAT"])


def cmd_regions(args: argparse.Namespace) -> int:
    sized = args.cpu is not None or args.memory is not None
    if sized and (args.cpu is None or args.memory is None):
        raise UsageError("--cpu and --memory go together: how many machines of that size fit")
    guest = GuestConfig(cpu_millicores=args.cpu, memory_mib=args.memory) if sized else None

    async def body(flaps: Client) -> int:
        regions = await flaps.list_regions(guest=guest)
        emit(args, regions, lambda: regions_table(regions, sized) if regions else "no regions")
        return 0

    return run(args, body)


def cmd_workers(args: argparse.Namespace) -> int:
    if args.action is not None:
        if args.worker_id is None:
            raise UsageError(f"workers {args.action} needs a worker ID")
        if args.action in ("cordon", "uncordon"):
            from nonomad.cli_workers import cmd_cordon

            return cmd_cordon(args)
        from nonomad.cli_workers import cmd_fault

        return cmd_fault(args)
    if args.with_machines:
        raise UsageError("--with-machines goes with `workers kill ID`")

    async def body(flaps: Client) -> int:
        workers = await flaps.list_workers(region=args.region or "")
        emit(args, workers, lambda: workers_table(workers) if workers else "no workers")
        return 0

    return run(args, body)
