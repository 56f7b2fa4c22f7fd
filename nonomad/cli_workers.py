"""`nonomad workers cordon|uncordon ID` through flaps, on any cluster; `nonomad workers
kill|pause|resume|restart ID`: faults on the local cluster `nonomad up` runs, to watch a
failover and the return (docs/fencing.md).

`cordon` asks flaps (PlatformService.CordonWorker, a token allowed the admin operation
`cordon`) to cordon the worker: it takes no new machines while its machines keep running.

`kill` SIGKILLs the worker's flyd (its machines run on, as after a daemon crash; with
`--with-machines` they die too, as with the host), `pause` and `resume` SIGSTOP and SIGCONT it
(a hang), `restart` asks `up` to start the worker again on its data dir and address (`up` owns
the worker processes: it writes a request file under the state dir that `up` acts on, then
reports the new pid in workers.json). `up` says what becomes of each worker as it happens.
`partition` and `heal` cut the worker's host off from every other host and join it again, on
a cluster of hosts of their own (`nonomad up --hosts N`, nonomad.hosts).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

from nonomad.cli_common import PID_FILE, CliError, emit, pid_alive, run

if TYPE_CHECKING:
    from nonomad.client import Client

REQUESTS = "requests"
WORKERS_FILE = "workers.json"
RESTART_TIMEOUT = 45.0


def process_state(pid: int) -> str:
    """The kernel's one-letter state of `pid` (R, S, T: stopped, Z, ...); "" when gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # ESRCH: it died while being read
        return ""
    return stat[stat.rindex(")") + 2]


def restart_requests(state: Path) -> list[str]:
    """Workers `nonomad workers restart` asked `up` to start again, oldest first."""
    folder = state / REQUESTS
    if not folder.is_dir():
        return []
    found = sorted(folder.glob("*.restart"), key=lambda p: p.stat().st_mtime)
    return [p.stem for p in found]


def request_done(state: Path, worker_id: str) -> None:
    (state / REQUESTS / f"{worker_id}.restart").unlink(missing_ok=True)


def _worker(state: Path, worker_id: str) -> dict[str, object]:
    path = state / WORKERS_FILE
    pid_file = state / PID_FILE
    if not path.exists() or not pid_file.exists() or not pid_alive(int(pid_file.read_text())):
        raise CliError(f"no cluster runs from {state}; start one with `nonomad up`")
    workers = {str(w["worker_id"]): w for w in json.loads(path.read_text())}
    if worker_id not in workers:
        raise CliError(
            f"the local cluster has no worker {worker_id} (it has {', '.join(sorted(workers))})"
        )
    return workers[worker_id]


def cmd_cordon(args: argparse.Namespace) -> int:
    """cordon or uncordon one worker, through flaps."""
    worker_id: str = args.worker_id
    wanted = args.action == "cordon"

    async def body(flaps: Client) -> int:
        cordoned = await flaps.cordon_worker(worker_id, wanted)
        if cordoned:
            said = f"{worker_id} cordoned: it takes no new machines; its machines keep running"
        else:
            said = f"{worker_id} uncordoned: it takes new machines again"
        emit(args, {"worker_id": worker_id, "cordoned": cordoned}, lambda: said)
        return 0

    return run(args, body)


def cmd_fault(args: argparse.Namespace) -> int:
    """kill, pause, resume or restart one worker of the local cluster."""
    state: Path = args.state_dir.absolute()
    worker_id: str = args.worker_id
    worker = _worker(state, worker_id)
    pid = int(str(worker["pid"]))
    if args.action == "restart":
        return _restart(state, worker_id, pid)
    if args.action in ("partition", "heal"):
        return _cut(state, worker_id, args.action == "partition")
    sig = {"kill": signal.SIGKILL, "pause": signal.SIGSTOP, "resume": signal.SIGCONT}[args.action]
    if not pid_alive(pid):
        raise CliError(
            f"{worker_id} is not running (pid {pid}); `nonomad workers restart {worker_id}`"
        )
    os.kill(pid, sig)
    if args.action == "kill":
        machines = ""
        if args.with_machines:
            from flyd.drivers.rundir import kill_all

            killed = kill_all(state / "workers" / worker_id / "machines")
            machines = f" and its {killed} machine(s), as if the host died"
        else:
            machines = "; its machines keep running"
        print(f"{worker_id} killed (SIGKILL, pid {pid}){machines}")
    elif args.action == "pause":
        print(f"{worker_id} paused (SIGSTOP, pid {pid}); `nonomad workers resume {worker_id}`")
    else:
        print(f"{worker_id} resumed (SIGCONT, pid {pid})")
    return 0


def set_cut(fabric: str, link: str, cut: bool) -> None:
    """Cut a host off the link (its port on the fabric's bridge down) or join it again."""
    from pyroute2 import NetNS

    with NetNS(fabric) as ns:
        found = ns.link_lookup(ifname=link)
        if not found:
            raise CliError(f"no link {link} in {fabric}")
        ns.link("set", index=found[0], state="down" if cut else "up")


def _cut(state: Path, worker_id: str, cut: bool) -> int:
    """Cut the worker's host off from every other host, or join it again: a cluster `nonomad
    up --hosts` runs (its hosts.json names the fabric namespace and each host's link)."""
    path = state / "hosts.json"
    if not path.exists():
        raise CliError("partition and heal need hosts of their own: `nonomad up --hosts N`")
    record = json.loads(path.read_text())
    set_cut(record["fabric"], record["hosts"][worker_id]["link"], cut)
    if cut:
        print(f"{worker_id} cut off from every other host; `nonomad workers heal {worker_id}`")
    else:
        print(f"{worker_id} joined the other hosts again")
    return 0


def _restart(state: Path, worker_id: str, pid: int) -> int:
    folder = state / REQUESTS
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{worker_id}.restart").touch()
    deadline = time.monotonic() + RESTART_TIMEOUT
    while time.monotonic() < deadline:
        if not (folder / f"{worker_id}.restart").exists():
            worker = _worker(state, worker_id)
            if int(str(worker["pid"])) != pid and pid_alive(int(str(worker["pid"]))):
                print(
                    f"{worker_id} restarted on its data dir (pid {worker['pid']}, "
                    f"{worker['address']})"
                )
                return 0
            raise CliError(f"{worker_id} did not come back; see {worker['log']}")
        time.sleep(0.1)
    request_done(state, worker_id)
    raise CliError(f"`nonomad up` did not restart {worker_id} within {RESTART_TIMEOUT:g}s")
