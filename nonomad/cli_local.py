"""`nonomad up`, `status` and `down`: a local cluster of flaps, a proxy and workers.

`up` runs it in the foreground under one state directory (logs, worker data, images) and
records where its services listen (`cluster.json`), so that the other commands find its flaps
and `image build` its image source by default.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import structlog

from flaps.v1 import platform_pb2
from flyd.drivers.cgroups import CONTROLLERS, joining, limit_memory, remove_tree
from flyd.drivers.rundir import kill_all
from flyd.images.build import build_image
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from flyd.v1 import worker_pb2_grpc
from model.images.owners import Owners
from model.tokens import read_token
from nonomad.cli_common import (
    CLUSTER_FILE,
    DEFAULT_STATE_DIR,
    PID_FILE,
    CliError,
    LocalCluster,
    emit,
    pid_alive,
    table,
)
from nonomad.cli_workers import WORKERS_FILE, process_state, request_done, restart_requests
from nonomad.client import ApiError, Client, state_name
from nonomad.console.login import login_url
from nonomad.console.sessions import CODE_TTL
from nonomad.security import ClusterSecurity, provision
from runtime import CLUSTER_PREFIX, READY_PREFIX, ChannelTLS, aio_channel, read_announcements
from runtime.logs import configure_logging

DEMO_SOURCE = Path(__file__).parent / "demo"
DEMO_OWNERS = Owners.of("demo")
"""The demo image is the demo app's: another app's machine of it is refused."""
READY_TIMEOUT = 30.0
PROXY_DOMAIN = "nonomad.localhost"  # the proxy's default: <app>.nonomad.localhost
RPC_TIMEOUT = 10.0


MAX_LOCAL_WORKERS = 12
"""How many workers `nonomad up` gives a sandbox range of their own (see worker_sandbox_args)."""
_UIDS_PER_WORKER = 1 << 28  # 4096 machines of 65536 uids: a /20 holds 4093


def worker_sandbox_args(n: int) -> list[str]:
    """The flyd flags of the n-th worker (from 1) of a local cluster that keep its OCI machines
    apart from every other worker's on this host: a /20 of 10.87.0.0/16 for their addresses and
    a range of 2**28 host uids from 2**30 on for their users. Two workers with the same range
    would map the machines of their first slots to the same host uids.
    """
    if not 1 <= n <= MAX_LOCAL_WORKERS:
        raise CliError(f"a local cluster has at most {MAX_LOCAL_WORKERS} workers, not {n}")
    return [
        "--network",
        f"10.87.{16 * (n - 1)}.0/20",
        "--uid-base",
        str((1 << 30) + (n - 1) * _UIDS_PER_WORKER),
    ]


@dataclass
class WorkerProc:
    worker_id: str
    region: str
    address: str
    pid: int
    log: str


def build_demo(image_source: Path, owners: Owners = DEMO_OWNERS) -> str:
    """Build the demo's image, `demo:v1`, into `image_source` (for the demo app, unless
    `owners` say otherwise); its digest."""
    return build_image(
        DEMO_SOURCE,
        image_source,
        name="demo",
        tag="v1",
        entrypoint=["python3", "-u", "app.py"],
        owners=owners,
    )


def _start(
    state: Path,
    name: str,
    module: str,
    *args: str,
    listen: str = "127.0.0.1:0",
    memory_cgroup: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start one service of the cluster with its log under the state dir; in `memory_cgroup`
    (a v1 memory cgroup's directory) from before its first instruction, when given."""
    logs = state / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-c", f"from {module}.main import main; main()", "--listen", listen]
    argv += args
    if memory_cgroup is not None:  # all it ever takes is charged there
        argv = joining(memory_cgroup, argv)
    with open(logs / f"{name}.log", "ab") as err:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            start_new_session=True,  # Ctrl-C goes to `up`, which stops everything in order
        )


def worker_memory_cgroup(state: Path, worker_id: str) -> Path:
    """The memory cgroup of a local worker's flyd: beside its machines' (`cgroup_prefix`),
    never above them, so what they use is never flyd's."""
    return CGROUP_ROOT / "memory" / f"{cgroup_prefix(state, worker_id)}.flyd"


def _worker_memory(state: Path, worker_id: str, mib: int) -> Path | None:
    """The worker's flyd's memory cgroup, limited to `mib` (made now); None, said once on
    stderr, where cgroup v1 memory limits cannot be set (no limit asked for: None)."""
    if mib <= 0:
        return None
    cg = worker_memory_cgroup(state, worker_id)
    try:
        limit_memory(cg, mib << 20)
    except OSError as e:
        print(f"warning: {worker_id}'s flyd runs without a memory limit: {e}", file=sys.stderr)
        return None
    return cg


def _read_ready(
    proc: subprocess.Popen[bytes], worker_id: str, seen: dict[str, str] | None = None
) -> str:
    """The gRPC address a service announces; other NONOMAD_* lines go into `seen`."""
    try:
        announced = read_announcements(proc, READY_TIMEOUT)
    except RuntimeError:
        raise CliError(f"{worker_id} did not start (exit {proc.poll()}); see its log") from None
    if seen is not None:
        seen.update(announced)
    return announced[READY_PREFIX]


def _client(flaps: str, security: ClusterSecurity, tls: ChannelTLS | None = None) -> Client:
    """The admin's client to the cluster's flaps: TLS checked with its CA (or as `tls` says),
    the admin token."""
    return Client(
        flaps,
        tls=tls or security.client_tls(),
        token_file=security.admin_token,
        timeout=RPC_TIMEOUT,
    )


async def _until_alive(
    flaps: str, security: ClusterSecurity, count: int, timeout: float = READY_TIMEOUT
) -> None:
    """Wait until flaps sees `count` workers alive (they announce themselves to it)."""
    async with _client(flaps, security) as client:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            workers = await client.list_workers()
            if sum(w.status == platform_pb2.WORKER_STATUS_ALIVE for w in workers) >= count:
                return
            await asyncio.sleep(0.1)
    raise CliError(f"flaps did not see {count} workers within {timeout:g}s; see the logs")


DEMO_SPEC = DEMO_SOURCE / "app.toml"


async def _deploy_demo(
    flaps: str, security: ClusterSecurity, regions: list[str], tls: ChannelTLS | None = None
) -> list[tuple[pb.Machine, pb.Machine | None]]:
    """Deploy nonomad/demo/app.toml (one machine per region, each with a standby on another
    worker of its region), the way `nonomad deploy` does, and return (primary, standby) pairs.
    `tls`: how flaps is verified, when not as `security.client_tls()`."""
    from nonomad.cli_deploy import event_line
    from nonomad.deploy import PRIMARY, deploy
    from nonomad.spec import STANDBY_SUFFIX, AppSpec, load_spec

    spec = load_spec(DEMO_SPEC)
    spec = AppSpec.model_validate({**spec.model_dump(), "regions": dict.fromkeys(regions, 1)})
    print(f"deploying {DEMO_SPEC.name} ({spec.app}: 1 machine + 1 standby per region)")
    # Its steps are printed as they happen, once: the library's own log lines only when they
    # warn (as `nonomad deploy` does).
    if not structlog.is_configured():
        configure_logging("nonomad-up", "warning")
    async with _client(flaps, security, tls) as client:
        report = await deploy(client, spec, on_event=lambda e: print(event_line(e), flush=True))
        for warning in report.warnings:
            print(f"note: {warning}", file=sys.stderr)
        if not report.ok:
            raise CliError(f"the demo deploy failed: {report.reason}")
        rows = {row.slot: row for row in report.machines}
        out: list[tuple[pb.Machine, pb.Machine | None]] = []
        for row in report.machines:
            if row.role != PRIMARY:
                continue
            primary = await client.get_machine(row.machine_id)
            standby_row = rows.get(f"{row.slot}{STANDBY_SUFFIX}")
            standby = await client.get_machine(standby_row.machine_id) if standby_row else None
            out.append((primary, standby))
    return out


async def _destroy_all(flaps: str, security: ClusterSecurity, ids: list[str]) -> None:
    async with _client(flaps, security) as client:
        for machine_id in ids:
            with contextlib.suppress(ApiError):
                await client.destroy_machine(machine_id, force=True)


def _wait_listening(port: int, timeout: float = READY_TIMEOUT) -> bool:
    """Whether the machine accepts connections on its port within the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return True
        time.sleep(0.05)
    return False


def free_pid_file(state: Path) -> Path:
    """The pid file of a cluster run from `state`, once no running cluster holds it."""
    pid_file = state / PID_FILE
    if pid_file.exists() and pid_alive(int(pid_file.read_text())):
        raise CliError(
            f"a cluster already runs from {state} (pid {pid_file.read_text()}); "
            "run `nonomad down` first"
        )
    return pid_file


class StopSignals:
    """SIGINT (Ctrl-C) and SIGTERM (`nonomad down`) from now on only set `requested`: `up`
    sees it in its loop and stops everything in order."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGINT, self._request)
        signal.signal(signal.SIGTERM, self._request)

    def _request(self, signum: int, frame: object) -> None:
        self.requested = True

    def run(self, step: Callable[[], bool], hint: str) -> None:
        """Say that the cluster runs (and `hint`), then call `step` every 0.2 s until a stop
        signal comes or it returns False."""
        print(f"\nrunning; Ctrl-C stops everything. {hint}", flush=True)
        while not self.requested and step():
            time.sleep(0.2)


def _console_login(console_url: str, security: ClusterSecurity) -> str:
    """The line that logs the operator in to the console: a one-time URL (the console keeps
    the admin token behind its code; the token is in no URL), or how to log in without."""
    try:
        url = login_url(console_url, read_token(security.admin_token))
    except ValueError as err:
        return f"  log in with the token in {_shown(security.admin_token)} ({err})"
    return f"  log in (the link works once, for {CODE_TTL / 60:.0f} minutes): {url}"


def cmd_up(args: argparse.Namespace) -> int:
    state: Path = args.state_dir.absolute()
    pid_file = free_pid_file(state)
    state.mkdir(parents=True, exist_ok=True)
    regions = [r for r in args.regions.split(",") if r]
    worker_ids = [f"{r}-{i + 1}" for r in regions for i in range(args.workers_per_region)]
    if len(worker_ids) > MAX_LOCAL_WORKERS:
        raise CliError(
            f"{len(worker_ids)} workers asked for; a local cluster has at most "
            f"{MAX_LOCAL_WORKERS} (each gets address and uid ranges of its own)"
        )
    # Secure by default: a CA and a certificate per part, token root keys, an admin token.
    security = provision(state, ["flaps", "proxy", "console", *(f"flyd-{w}" for w in worker_ids)])
    digest = build_demo(state / "images")
    print(f"built image demo:v1 ({digest[:19]}) for app demo")

    procs: list[tuple[WorkerProc, subprocess.Popen[bytes]]] = []
    console: subprocess.Popen[bytes] | None = None  # read-only: the cluster runs on without it
    worker_args: dict[str, list[str]] = {}
    worker_memory: dict[str, Path | None] = {}  # each flyd's own memory cgroup
    machine_ids: list[str] = []
    flaps_address = ""
    stop = StopSignals()
    try:
        # flaps first: workers announce themselves to it and are followed from then on.
        # flaps reads the workers' image source too: another app's image is refused at once.
        flaps = _start(
            state, "flaps", "flaps", "--image-source", str(state / "images"), *security.flaps_args()
        )
        flaps_seen: dict[str, str] = {}
        flaps_address = _read_ready(flaps, "flaps", flaps_seen)
        # The cluster's parts (the proxy, workers announcing) call its mutual-TLS port.
        flaps_cluster = flaps_seen[CLUSTER_PREFIX]
        procs.append(
            (
                WorkerProc(
                    "flaps", "-", flaps_address, flaps.pid, str(state / "logs" / "flaps.log")
                ),
                flaps,
            )
        )
        # The edge, which also follows the workers (they announce to it too).
        http: dict[str, str] = {}
        proxy = _start(
            state,
            "proxy",
            "proxy",
            "--http-listen",
            f"127.0.0.1:{args.proxy_port}",
            "--flaps",
            flaps_cluster,
            "--region",
            regions[0] if regions else "local",
            *security.proxy_args(),
        )
        proxy_address = _read_ready(proxy, "proxy", http)
        procs.append(
            (
                WorkerProc(
                    "proxy", "-", proxy_address, proxy.pid, str(state / "logs" / "proxy.log")
                ),
                proxy,
            )
        )
        # The web console: its own replica follows flaps', it reads with a read-only token.
        console = _start(
            state,
            "console",
            "nonomad.console",
            *("--flaps", flaps_address, "--upstream", flaps_cluster, "--proxy", proxy_address),
            *security.console_args(),
            listen=f"127.0.0.1:{args.console_port}",
        )
        console_url = f"http://{_read_ready(console, 'console')}/"
        n = 0
        for region in regions:
            for i in range(args.workers_per_region):
                worker_id = f"{region}-{i + 1}"
                base = args.base_port + 100 * n
                n += 1
                worker_args[worker_id] = [
                    "--worker-id",
                    worker_id,
                    "--region",
                    region,
                    "--data-dir",
                    str(state / "workers" / worker_id),
                    "--image-source",
                    str(state / "images"),
                    "--ports",
                    f"{base}-{base + 99}",
                    "--cgroup-prefix",
                    cgroup_prefix(state, worker_id),
                    *worker_sandbox_args(n),
                    "--announce",
                    flaps_cluster,
                    "--announce",
                    proxy_address,
                    "--announce-interval",
                    "2",
                    *security.worker_args(worker_id),
                ]
                memory = _worker_memory(state, worker_id, args.worker_memory)
                worker_memory[worker_id] = memory
                proc = _start(
                    state, worker_id, "flyd", *worker_args[worker_id], memory_cgroup=memory
                )
                address = _read_ready(proc, worker_id)
                procs.append(
                    (
                        WorkerProc(
                            worker_id,
                            region,
                            address,
                            proc.pid,
                            str(state / "logs" / f"{worker_id}.log"),
                        ),
                        proc,
                    )
                )
        _save_workers(state, procs)
        # Where `nonomad machines ...` and `image build` find this cluster by default.
        LocalCluster(
            flaps=flaps_address,
            proxy=proxy_address,
            http=http.get("NONOMAD_HTTP", ""),
            image_source=str(state / "images"),
            ca=str(security.ca),
            token_file=str(security.admin_token),
        ).save(state)
        pid_file.write_text(str(os.getpid()))
        asyncio.run(_until_alive(flaps_address, security, len(worker_args)))
        print(
            table(
                [[p.worker_id, p.region, p.address, p.log] for p, _ in procs],
                ["SERVICE", "REGION", "GRPC", "LOG"],
            )
        )
        if args.demo:
            deployed = asyncio.run(_deploy_demo(flaps_address, security, regions))
            rows = []
            for primary, standby in deployed:
                machine_ids.append(primary.id)
                url = f"http://127.0.0.1:{primary.ports[0].host_port}/"
                if not _wait_listening(primary.ports[0].host_port):
                    print(f"warning: {primary.id} does not accept connections yet", file=sys.stderr)
                rows.append([primary.id, primary.region, primary.worker_id, "started", url])
                if standby is not None:
                    machine_ids.append(standby.id)
                    rows.append(
                        [
                            standby.id,
                            standby.region,
                            standby.worker_id,
                            f"{state_name(standby.state)}, standby for {primary.id}",
                            "-",
                        ]
                    )
            print()
            print(table(rows, ["MACHINE", "REGION", "WORKER", "STATE", "URL"]))
            first = deployed[0][0]
            f, g = flaps_address, _grpcurl()
            edge = http.get("NONOMAD_HTTP", "")
            print("\nthrough the proxy (scale from zero, failover to the standby):")
            print(f"  curl -H 'Host: demo.{PROXY_DOMAIN}' http://{edge}/")
            print(
                f"\nstraight to the machine:\n  curl http://127.0.0.1:{first.ports[0].host_port}/"
            )
            here = "" if args.state_dir == DEFAULT_STATE_DIR else f" --state-dir {args.state_dir}"
            print("\nthe CLI (it finds this cluster's flaps from its state dir):")
            activate = _activate_hint()
            if activate:
                print(f"  {activate}")
            for command in ("machines list demo", f"machines show {first.id}", "regions"):
                print(f"  nonomad{here} {command}")
            ca, token = _shown(security.ca), _shown(security.admin_token)
            print("\nthe exchange with grpcurl (TLS checked with the cluster's CA, a token):")
            print(f"  {g} -cacert {ca} {f} list")
            auth = f'-cacert {ca} -H "authorization: Bearer $(cat {token})"'
            for body, rpc in [
                ("{}", "flaps.v1.PlatformService/ListRegions"),
                ('{"app": "demo"}', "flaps.v1.MachinesService/ListMachines"),
                (f'{{"machine_id": "{first.id}"}}', "flaps.v1.MachinesService/GetMachine"),
            ]:
                print(f"  {g} {auth} -d '{body}' {f} {rpc}")
            print(f"\ntokens for one app: nonomad{here} tokens create --app demo --ops read")
        print(f"\nthe web console: {console_url}")
        print(_console_login(console_url, security))
        watch = _Watch(state, procs, worker_args, worker_memory)
        stop.run(watch.step, "Try a failover: nonomad workers kill|pause|resume|restart WORKER")
    finally:
        print("stopping...", flush=True)
        if flaps_address and machine_ids:
            asyncio.run(_destroy_all(flaps_address, security, machine_ids))
        if console is not None:  # stopped first, with the rest
            procs.append((WorkerProc("console", "-", "", console.pid, ""), console))
        for _, proc in reversed(procs):
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        for _, proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        # Whatever a worker could not destroy does not outlive the cluster, nor do its
        # cgroups: each cluster's are named for its state dir, so none is used again.
        for wp, _ in procs:
            kill_all(state / "workers" / wp.worker_id / "machines")
        for worker_id in worker_args:
            for controller in CONTROLLERS:
                remove_tree(CGROUP_ROOT / controller / cgroup_prefix(state, worker_id))
            if worker_memory.get(worker_id) is not None:
                remove_tree(worker_memory_cgroup(state, worker_id))
        pid_file.unlink(missing_ok=True)
        (state / CLUSTER_FILE).unlink(missing_ok=True)
        print("stopped")
    return 0


def _save_workers(state: Path, procs: list[tuple[WorkerProc, subprocess.Popen[bytes]]]) -> None:
    workers = [p for p, _ in procs if p.region != "-"]
    (state / WORKERS_FILE).write_text(json.dumps([asdict(p) for p in workers], indent=2))


def _how(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


class _Watch:
    """What `up` does while the cluster runs: say what becomes of each worker (exited, paused,
    resumed) and carry out `nonomad workers restart`. A worker that dies leaves the cluster
    running (its machines fail over to their standbys); flaps or the proxy dying stops it."""

    def __init__(
        self,
        state: Path,
        procs: list[tuple[WorkerProc, subprocess.Popen[bytes]]],
        worker_args: dict[str, list[str]],
        worker_memory: dict[str, Path | None],
    ) -> None:
        self.state = state
        self.procs = procs
        self.worker_args = worker_args
        self.worker_memory = worker_memory
        self.seen: dict[str, str] = {wp.worker_id: "running" for wp, _ in procs}

    def step(self) -> bool:
        """Look once; False when the cluster must stop (flaps or the proxy exited)."""
        for wp, proc in self.procs:
            code = proc.poll()
            if wp.region == "-":
                if code is not None:
                    print(f"{wp.worker_id} exited ({_how(code)}); stopping", file=sys.stderr)
                    return False
                continue
            now = (
                "exited"
                if code is not None
                else ("paused" if process_state(proc.pid) == "T" else "running")
            )
            if now != self.seen[wp.worker_id]:
                self._say(wp, now, code)
                self.seen[wp.worker_id] = now
        for worker_id in restart_requests(self.state):
            self._restart(worker_id)
            request_done(self.state, worker_id)
        return True

    def _say(self, wp: WorkerProc, now: str, code: int | None) -> None:
        name = wp.worker_id
        if now == "exited":
            print(
                f"{name} exited ({_how(code or 0)}); the cluster keeps running without it "
                f"(its machines fail over to their standbys): `nonomad workers restart {name}`",
                flush=True,
            )
        elif now == "paused":
            print(f"{name} is paused (SIGSTOP): `nonomad workers resume {name}`", flush=True)
        else:
            print(f"{name} runs again", flush=True)

    def _restart(self, worker_id: str) -> None:
        at = next((i for i, (wp, _) in enumerate(self.procs) if wp.worker_id == worker_id), None)
        if at is None or worker_id not in self.worker_args:
            return
        wp, old = self.procs[at]
        if old.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                old.send_signal(signal.SIGCONT)  # (a paused one cannot stop)
                old.send_signal(signal.SIGTERM)
            try:
                old.wait(15)
            except subprocess.TimeoutExpired:
                old.kill()
                old.wait()
        if old.stdout is not None:
            old.stdout.close()
        proc = _start(
            self.state,
            worker_id,
            "flyd",
            *self.worker_args[worker_id],
            listen=wp.address,
            memory_cgroup=self.worker_memory.get(worker_id),  # the same limit, again
        )
        try:
            address = _read_ready(proc, worker_id)
        except CliError as err:
            print(f"restart of {worker_id} failed: {err}", file=sys.stderr, flush=True)
            self.procs[at] = (wp, proc)
            return
        self.procs[at] = (WorkerProc(worker_id, wp.region, address, proc.pid, wp.log), proc)
        _save_workers(self.state, self.procs)
        self.seen[worker_id] = "running"
        print(
            f"{worker_id} started again on its data dir (pid {proc.pid}, {address}): it fences "
            "its machines until their standbys confirm who serves",
            flush=True,
        )


CGROUP_ROOT = Path("/sys/fs/cgroup")  # flyd's default --cgroup-root, which up keeps


def cgroup_prefix(state: Path, worker_id: str) -> str:
    """The cgroups of a worker of the cluster run from `state`: named for the state dir's
    whole path, not its last part, so that two clusters on one host (`.nonomad/cluster` in two
    checkouts, a test's beside yours) never share a worker's cgroups, nor kill each other's
    machines when one cleans up."""
    tag = hashlib.sha256(str(state.absolute()).encode()).hexdigest()[:10]
    return f"nonomad-{tag}-{worker_id}"


def _shown(path: Path) -> str:
    """A path as a user types it from here: relative below the working directory."""
    rel = os.path.relpath(path)
    return str(path) if rel.startswith("..") else rel


def _activate_hint() -> str:
    """How to put `nonomad` and `grpcurl` on the PATH of another terminal, when they live in
    a virtual environment (`make up` runs from .venv): the commands printed here are typed
    as `nonomad ...`."""
    if sys.prefix == sys.base_prefix:
        return ""
    activate = Path(sys.prefix) / "bin" / "activate"
    return f"source {_shown(activate)}   # in a new terminal: puts nonomad and grpcurl on PATH"


def _grpcurl() -> str:
    """How to run grpcurl here: from PATH (the venv's, once activated as `up` says), or the
    one the project installs in its venv."""
    if shutil.which("grpcurl") or _activate_hint():
        return "grpcurl"
    bundled = Path(sys.executable).parent / "grpcurl"
    return os.path.relpath(bundled) if bundled.exists() else "grpcurl"


def _workers(state: Path) -> list[WorkerProc]:
    path = state / WORKERS_FILE
    pid_file = state / PID_FILE
    if not path.exists() or not pid_file.exists():
        raise CliError(f"no cluster runs from {state}; start one with `nonomad up`")
    return [WorkerProc(**item) for item in json.loads(path.read_text())]


async def _capacities(
    workers: list[WorkerProc], tls: ChannelTLS
) -> list[w.GetCapacityResponse | Exception]:
    """Each worker's capacity, asked with the CLI's cluster certificate (workers answer only
    the cluster's certificates)."""

    async def one(address: str) -> w.GetCapacityResponse | Exception:
        try:
            async with aio_channel(address, tls=tls) as channel:
                stub = worker_pb2_grpc.WorkerServiceStub(channel)
                return await stub.GetCapacity(w.GetCapacityRequest(), timeout=RPC_TIMEOUT)
        except grpc.RpcError as err:
            return err

    return list(await asyncio.gather(*(one(wp.address) for wp in workers)))


def cmd_status(args: argparse.Namespace) -> int:
    state = args.state_dir.absolute()
    workers = _workers(state)
    results = asyncio.run(_capacities(workers, ClusterSecurity(state).member_tls()))
    rows: list[list[str]] = []
    report: list[dict[str, object]] = []
    for worker, result in zip(workers, results, strict=True):
        if isinstance(result, Exception):
            rows.append(
                [worker.worker_id, worker.region, worker.address, "unreachable", "", "", ""]
            )
            report.append({"worker": worker.worker_id, "status": "unreachable"})
            continue
        cap = result.capacity
        rows.append(
            [
                worker.worker_id,
                worker.region,
                worker.address,
                "cordoned" if cap.cordoned else "up",
                f"{cap.free.cpu_millicores}/{cap.total.cpu_millicores}",
                f"{cap.free.memory_mib}/{cap.total.memory_mib}",
                ", ".join(f"{k}={v}" for k, v in sorted(cap.machines_by_state.items())) or "-",
            ]
        )
        report.append(
            {
                "worker": worker.worker_id,
                "region": worker.region,
                "address": worker.address,
                "cordoned": cap.cordoned,
                "free_cpu_millicores": cap.free.cpu_millicores,
                "free_memory_mib": cap.free.memory_mib,
                "machines": dict(cap.machines_by_state),
            }
        )
    header = ["WORKER", "REGION", "GRPC", "STATUS", "CPU FREE", "MEM FREE (MiB)", "MACHINES"]
    emit(args, report, lambda: table(rows, header))
    return 0 if all(not isinstance(r, Exception) for r in results) else 1


def cmd_down(args: argparse.Namespace) -> int:
    state = args.state_dir.absolute()
    pid_file = state / PID_FILE
    if not pid_file.exists():
        raise CliError(f"no cluster runs from {state}")
    pid = int(pid_file.read_text())
    if not pid_alive(pid):
        pid_file.unlink()
        raise CliError(f"the cluster of {state} is not running (stale pid {pid} removed)")
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if pid_alive(pid):
        raise CliError(f"`nonomad up` (pid {pid}) did not stop within 60s")
    print("stopped")
    return 0
