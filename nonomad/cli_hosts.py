"""`nonomad up --hosts N`: the local cluster on hosts of their own (nonomad.hosts).

flaps, the registry and the proxy each on a network-namespace host, and N worker hosts (spread
over `--regions` in order), each running its deploy/ unit file's command line. From this
machine's own namespace the cluster is reached only on 127.0.0.1: the edge at `--proxy-port`
and flaps at a port of its own, both forwarded into their hosts; `nonomad machines ...` finds
flaps there. `nonomad workers partition|heal ID` cuts a worker's host off and joins it again;
`kill|pause|resume ID` act on its flyd as with `up`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import time

from flyd.images.build import build_image
from nonomad.cli_common import CLUSTER_FILE, PID_FILE, CliError, LocalCluster, pid_alive, table
from nonomad.cli_local import DEMO_SOURCE, PROXY_DOMAIN, _deploy_demo, _destroy_all, _until_alive
from nonomad.cli_workers import WORKERS_FILE
from nonomad.hosts import HTTP_PORT, PORTS, Hosts, netns_unavailable


def spread(count: int, regions: list[str]) -> list[tuple[str, str]]:
    """(worker id, region) of `count` worker hosts over `regions`, in order: 4 over ams,syd
    are ams-1, ams-2, syd-1, syd-2."""
    if count < 1 or not regions:
        raise CliError(f"--hosts: at least 1 worker host in at least one region, not {count}")
    out: list[tuple[str, str]] = []
    for j in range(count):
        region = regions[j * len(regions) // count]
        out.append((f"{region}-{sum(r == region for _, r in out) + 1}", region))
    return out


def cmd_up(args: argparse.Namespace) -> int:
    """`nonomad up`: on hosts of their own with `--hosts N`, else as `cli_local.cmd_up`."""
    if args.hosts:
        return cmd_up_hosts(args)
    from nonomad.cli_local import cmd_up as up_here

    return up_here(args)


def cmd_up_hosts(args: argparse.Namespace) -> int:
    state = args.state_dir.absolute()
    pid_file = state / PID_FILE
    if pid_file.exists() and pid_alive(int(pid_file.read_text())):
        raise CliError(f"a cluster already runs from {state}; run `nonomad down` first")
    problem = netns_unavailable()
    if problem is not None:
        raise CliError(f"--hosts needs network namespaces: {problem}")
    regions = [r for r in args.regions.split(",") if r]
    workers = spread(args.hosts, regions)
    state.mkdir(parents=True, exist_ok=True)
    build_image(
        DEMO_SOURCE, state / "images", name="demo", tag="v1", entrypoint=["python3", "-u", "app.py"]
    )
    hosts = Hosts(state, workers, image_source=state / "images", region=regions[0])
    stopping = False

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    machine_ids: list[str] = []
    flaps = ""
    try:
        hosts.up()
        security = hosts.security
        assert security is not None
        flaps = hosts.forward("flaps", PORTS["flaps"])
        http = hosts.forward("proxy", HTTP_PORT, args.proxy_port)
        (state / WORKERS_FILE).write_text(
            json.dumps(
                [
                    {
                        "worker_id": h.name,
                        "region": h.env["REGION"],
                        "address": h.grpc,
                        "pid": h.proc.pid if h.proc else 0,
                        "log": str(h.log),
                    }
                    for h in hosts.workers
                ],
                indent=2,
            )
        )
        LocalCluster(
            flaps=flaps,
            proxy="",
            http=http,
            image_source=str(state / "images"),
            ca=str(security.ca),
            token_file=str(security.admin_token),
        ).save(state)
        pid_file.write_text(str(os.getpid()))
        asyncio.run(_until_alive(flaps, security, len(workers)))
        rows = [[h.name, h.role, h.address, h.netns, str(h.log)] for h in hosts.hosts.values()]
        print(table(rows, ["HOST", "RUNS", "ADDRESS", "NAMESPACE", "LOG"]))
        if args.demo:
            deployed = asyncio.run(_deploy_demo(flaps, security, list(dict.fromkeys(regions))))
            for primary, standby in deployed:
                machine_ids += [primary.id] + ([standby.id] if standby else [])
                print(f"{primary.id} on {primary.worker_id}, at {primary.address}:8080")
        print(f"\nflaps (forwarded): {flaps}; the edge (forwarded): http://{http}/")
        print(f"  curl -H 'Host: demo.{PROXY_DOMAIN}' http://{http}/")
        print(
            "\nrunning; Ctrl-C stops everything. Cut a worker's host off: "
            "nonomad workers partition|heal WORKER",
            flush=True,
        )
        while not stopping:
            time.sleep(0.2)
    finally:
        print("stopping...", flush=True)
        if flaps and machine_ids and hosts.security is not None:
            with contextlib.suppress(Exception):
                asyncio.run(_destroy_all(flaps, hosts.security, machine_ids))
        hosts.close()
        pid_file.unlink(missing_ok=True)
        (state / CLUSTER_FILE).unlink(missing_ok=True)
        print("stopped")
    return 0
