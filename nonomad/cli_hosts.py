"""`nonomad up --hosts N`: the local cluster on hosts of their own (nonomad.hosts).

flaps, the registry and the proxy each on a network-namespace host, and N worker hosts (spread
over `--regions` in order), each running its deploy/ unit file's command line. From this
machine's own namespace the cluster is reached only on 127.0.0.1: the edge at `--proxy-port`
and flaps at a port of its own, both forwarded into their hosts; `nonomad machines ...` finds
flaps there. `nonomad workers partition|heal ID` cuts a worker's host off and joins it again;
`kill|pause|resume|restart ID` act on its flyd as with `up`.

The demo's deploy runs inside the proxy's host (a process of its own there, calling flaps at
its own address). A deploy now talks to flaps alone (it gates on the workers' readiness and
never dials a machine), so it could run from here through the forwarded port; it stays there
because that was how its first version kept machine addresses, which exist only between the
hosts, from being dialled from this machine's own namespace, and nothing tests the other way.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import threading
from pathlib import Path

from nonomad.cli_common import CLUSTER_FILE, CliError, LocalCluster, table
from nonomad.cli_local import (
    PROXY_DOMAIN,
    StopSignals,
    _deploy_demo,
    _destroy_all,
    _until_alive,
    build_demo,
    free_pid_file,
)
from nonomad.cli_workers import WORKERS_FILE, process_state, request_done, restart_requests
from nonomad.hosts import HTTP_PORT, PORTS, Hosts, HostsError, netns_unavailable
from nonomad.security import ClusterSecurity
from runtime.tracing import CLUSTER_NAME, ChannelTLS

DEMO_TIMEOUT = 180.0
"""The demo's deploy as a whole (each of its waits has a deadline of its own)."""
DEMO_MARK = "NONOMAD_DEMO "


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


def _save_workers(state: Path, hosts: Hosts, forwards: dict[str, str]) -> None:
    """workers.json, as `nonomad up` writes it: what `nonomad workers ID` acts on and where
    `nonomad status` reaches each worker (`forwards`: its 127.0.0.1 port)."""
    rows = [
        {
            "worker_id": h.name,
            "region": h.env["REGION"],
            "address": forwards[h.name],
            "pid": h.proc.pid if h.proc else 0,
            "log": str(h.log),
        }
        for h in hosts.workers
    ]
    (state / WORKERS_FILE).write_text(json.dumps(rows, indent=2))


def _demo_regions(workers: list[tuple[str, str]]) -> list[str]:
    """The regions where the demo's standby has another worker host than its primary."""
    counts: dict[str, int] = {}
    for _, region in workers:
        counts[region] = counts.get(region, 0) + 1
    regions = [r for r, n in counts.items() if n >= 2]
    if not regions:
        raise CliError("--demo needs 2 worker hosts in a region (its standby's); --hosts 2 or more")
    return regions


def deploy_demo_in(hosts: Hosts, regions: list[str]) -> list[dict[str, str]]:
    """Deploy the demo from inside the proxy's host (see the module docstring); its steps are
    printed as they happen. One row per machine: id, worker, address, standby_for."""
    argv = [sys.executable, "-m", "nonomad.cli_hosts", hosts["flaps"].grpc, str(hosts.root)]
    proc = hosts.popen("proxy", [*argv, ",".join(regions)])
    assert proc.stdout is not None
    timer = threading.Timer(DEMO_TIMEOUT, proc.kill)
    timer.start()
    rows: list[dict[str, str]] = []
    try:
        for raw in proc.stdout:
            line = raw.decode(errors="replace")
            if line.startswith(DEMO_MARK):
                rows = json.loads(line.removeprefix(DEMO_MARK))
            else:
                print(line, end="", flush=True)
        code = proc.wait()
    finally:
        timer.cancel()
        proc.stdout.close()
    if code != 0 or not rows:
        raise CliError(f"the demo deploy failed (exit {code}); see above")
    return rows


def _demo_here(flaps: str, root: str, regions: str) -> int:
    """The demo's deploy, run inside the proxy's host by `deploy_demo_in`: flaps at its own
    address (verified as the cluster's, it has no certificate for the address)."""
    security = ClusterSecurity(Path(root))
    tls = ChannelTLS(ca=security.ca, server_name=CLUSTER_NAME)
    try:
        deployed = asyncio.run(_deploy_demo(flaps, security, regions.split(","), tls))
    except CliError as err:
        print(f"nonomad: {err}", file=sys.stderr)
        return 1
    rows = []
    for primary, standby in deployed:
        rows.append({"id": primary.id, "worker": primary.worker_id, "address": primary.address})
        if standby is not None:
            rows.append({"id": standby.id, "worker": standby.worker_id, "standby_for": primary.id})
    print(DEMO_MARK + json.dumps(rows), flush=True)
    return 0


class _Watch:
    """What `up --hosts` does while the cluster runs: say when a worker's flyd exits or is
    paused, and carry out `nonomad workers restart` (on its data dir and address)."""

    def __init__(self, state: Path, hosts: Hosts, forwards: dict[str, str]) -> None:
        self.state, self.hosts, self.forwards = state, hosts, forwards
        self.seen = {h.name: "running" for h in hosts.workers}

    def step(self) -> bool:
        """Look once; False when the cluster must stop (flaps, the registry or the proxy
        exited)."""
        for host in self.hosts.hosts.values():
            code = host.proc.poll() if host.proc is not None else -1
            if host.role != "flyd":
                if code is not None:
                    print(f"{host.name} exited (code {code}); stopping", file=sys.stderr)
                    return False
                continue
            assert host.proc is not None
            now = "exited" if code is not None else "running"
            if now == "running" and process_state(host.proc.pid) == "T":
                now = "paused"
            if now != self.seen[host.name]:
                self.seen[host.name] = now
                print(f"{host.name}: {now}", flush=True)
        for worker_id in restart_requests(self.state):
            if worker_id in self.seen:
                self._restart(worker_id)
            request_done(self.state, worker_id)
        return True

    def _restart(self, worker_id: str) -> None:
        host = self.hosts[worker_id]
        if host.proc is not None and host.proc.poll() is None:
            self.hosts.kill(worker_id)
        try:
            self.hosts.start(worker_id)
        except HostsError as err:
            print(f"restart of {worker_id} failed: {err}", file=sys.stderr, flush=True)
            return
        _save_workers(self.state, self.hosts, self.forwards)
        self.seen[worker_id] = "running"
        print(f"{worker_id} started again on its data dir ({host.grpc})", flush=True)


def cmd_up_hosts(args: argparse.Namespace) -> int:
    state = args.state_dir.absolute()
    pid_file = free_pid_file(state)
    problem = netns_unavailable()
    if problem is not None:
        raise CliError(f"--hosts needs network namespaces: {problem}")
    regions = [r for r in args.regions.split(",") if r]
    workers = spread(args.hosts, regions)
    demo_regions = _demo_regions(workers) if args.demo else []
    state.mkdir(parents=True, exist_ok=True)
    build_demo(state / "images")
    hosts = Hosts(state, workers, image_source=state / "images", region=regions[0])
    stop = StopSignals()
    machine_ids: list[str] = []
    flaps = ""
    try:
        hosts.up()
        security = hosts.security
        assert security is not None
        flaps = hosts.forward("flaps", PORTS["flaps"])
        http = hosts.forward("proxy", HTTP_PORT, args.proxy_port)
        # Each worker's flyd on 127.0.0.1 too: `nonomad status` asks them there.
        forwards = {w.name: hosts.forward(w.name, PORTS["flyd"]) for w in hosts.workers}
        _save_workers(state, hosts, forwards)
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
        print(table(rows, ["HOST", "RUNS", "ADDRESS", "NAMESPACE", "LOG"]), flush=True)
        if demo_regions:
            deployed = deploy_demo_in(hosts, demo_regions)
            machine_ids += [row["id"] for row in deployed]
            print()
            print(
                table(
                    [
                        [
                            r["id"],
                            r["worker"],
                            r.get("address") or f"standby for {r.get('standby_for')}",
                        ]
                        for r in deployed
                    ],
                    ["MACHINE", "WORKER", "ADDRESS"],
                )
            )
        print(f"\nflaps (forwarded): {flaps}; the edge (forwarded): http://{http}/")
        print(f"  curl -H 'Host: demo.{PROXY_DOMAIN}' http://{http}/")
        here = f" --state-dir {args.state_dir}"
        print(f"  nonomad{here} machines list demo")
        stop.run(
            _Watch(state, hosts, forwards).step,
            f"Cut a worker's host off: nonomad{here} workers partition|heal WORKER "
            "(kill|pause|resume|restart as with up)",
        )
    finally:
        print("stopping...", flush=True)
        if flaps and machine_ids and hosts.security is not None:
            with contextlib.suppress(Exception):
                asyncio.run(_destroy_all(flaps, hosts.security, machine_ids))
        hosts.close()
        pid_file.unlink(missing_ok=True)
        (state / CLUSTER_FILE).unlink(missing_ok=True)
        print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    # `python -m nonomad.cli_hosts FLAPS ROOT REGIONS`: the demo's deploy inside a host.
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(_demo_here(*sys.argv[1:4]))
