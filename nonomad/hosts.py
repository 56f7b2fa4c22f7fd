"""Hosts on one machine: a nonomad cluster whose every part runs on a host of its own.

Each host is a network namespace with one address on a private link the harness makes (a
bridge in a *fabric* namespace, `FABRIC`, one veth per host), and runs the same command line an
operator would run on a real host: the `ExecStart` of the unit files under `deploy/`, with the
variables of that role's environment file (`deploy/<role>.env`, the values of this layout put
in place of the example's), held to the limits of its unit's [Service] section as systemd
would hold it (LimitNOFILE; MemoryMax, a v1 memory cgroup of its own). So the unit files and
docs/deploy.md cannot rot: this runs them.

- flaps, the registry and the proxy each on a host of their own; flyd on one host per worker,
  with `--route-machines`: each worker's machine prefix is routed by every other host to that
  worker's address, and the proxy dials machines at their own addresses.
- Nothing is routed out of the fabric: the private addresses exist only in these namespaces.
  The user reaches a host's port only through `forward()`: a port on 127.0.0.1 in the main
  namespace that a thread of this process, inside the host's namespace, forwards (userspace).
- `partition(host)` cuts a host off from all others (its port on the bridge goes down; its
  own link stays up, so nothing of its own configuration changes), `heal(host)` restores it.
- `close()` tears everything down; `sweep()` (run first by `up()`) removes what a crashed
  earlier run left: its namespaces, processes, cgroups. Every name starts with `nnh<pid>s<n>-`
  (the harness's pid): a run whose pid is gone is a leftover. Processes are found by the
  `NNHOSTS_RUN` variable each one the harness starts carries, and machines by their cgroups.

Services are entered with `nsenter --net=/var/run/netns/NAME` (not `ip netns exec`, which
mounts a /sys of its own and hides the cgroups flyd needs).
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import json
import os
import re
import resource
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from flyd.drivers.cgroups import joining, limit_memory, remove_tree
from flyd.drivers.namespaces import CLONE_NEWNET, setns
from flyd.drivers.rundir import kill_all
from nonomad.cli_workers import set_cut
from nonomad.security import ClusterSecurity, provision
from runtime import CLUSTER_PREFIX, READY_PREFIX, read_announcements

__all__ = [
    "DEPLOY",
    "Host",
    "Hosts",
    "HostsError",
    "UnitLimits",
    "netns_unavailable",
    "read_limits",
    "read_unit",
    "set_cut",
    "sweep",
]

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
PREFIX = "nnh"
RUN_MARK = "NNHOSTS_RUN"
FABRIC = "fabric"
NETNS_DIR = Path("/var/run/netns")
CGROUP_ROOT = Path("/sys/fs/cgroup")
NETWORK = ipaddress.IPv4Network("10.200.0.0/24")
"""The hosts' private link: flaps .2, registry .3, proxy .4, worker n .10+n."""
ROLE_HOST = {"flaps": 2, "registry": 3, "proxy": 4}
PORTS = {"flaps": 4280, "flaps_cluster": 4281, "proxy": 4282, "registry": 4283, "flyd": 4290}
HTTP_PORT = 80
UNITS = {
    "flyd": "nonomad-flyd.service",
    "flaps": "nonomad-flaps.service",
    "proxy": "nonomad-proxy.service",
    "registry": "nonomad-registry.service",
}
READY_TIMEOUT = 30.0
_runs = itertools.count(1)


class HostsError(RuntimeError):
    """The hosts could not be made or a service did not start (the message says which)."""


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    try:
        from pyroute2 import netns
    except ImportError as e:  # pragma: no cover - a dependency
        return f"pyroute2 is missing: {e}"
    name = f"{PREFIX}{os.getpid()}probe"
    try:
        netns.create(name)
    except OSError as e:
        return f"cannot make a network namespace: {e}"
    netns.remove(name)
    return None


# -- the unit files, as systemd reads them ---------------------------------------------------


def read_env(path: Path) -> dict[str, str]:
    """An EnvironmentFile: KEY=VALUE lines; blank lines and # comments skipped."""
    env: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise HostsError(f"{path}: {line!r} is not KEY=VALUE")
        env[key.strip()] = value.strip().strip('"')
    return env


def read_unit(path: Path) -> list[str]:
    """The words of a unit file's ExecStart line, unexpanded."""
    for line in path.read_text().splitlines():
        if line.startswith("ExecStart="):
            return shlex.split(line.removeprefix("ExecStart="))
    raise HostsError(f"{path} has no ExecStart line")


@dataclass(frozen=True)
class UnitLimits:
    """What a unit's [Service] section holds its service to, as systemd would: `nofile` its
    descriptor limit (soft, hard: LimitNOFILE), `memory_max` its cgroup's memory (MemoryMax,
    bytes). None: the unit sets none."""

    nofile: tuple[int, int] | None = None
    memory_max: int | None = None


_SIZE = re.compile(r"(\d+)([KMGT]?)")
_SCALE = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def read_limits(path: Path) -> UnitLimits:
    """The LimitNOFILE (`N` or `SOFT:HARD`) and MemoryMax (`N`, with K, M, G or T, base 1024;
    `infinity`: none) of a unit file's [Service] section. A form systemd takes but this does
    not (a percentage, an infinite descriptor limit) is an error naming the key."""
    section, nofile, memory_max = "", None, None
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        if section != "Service" or not sep:
            continue
        if key == "LimitNOFILE":
            soft, _, hard = value.partition(":")
            if not (soft.isdigit() and (hard or soft).isdigit()):
                raise HostsError(f"{path}: LimitNOFILE={value} is not N or SOFT:HARD")
            nofile = (int(soft), int(hard or soft))
        elif key == "MemoryMax" and value != "infinity":
            size = _SIZE.fullmatch(value)
            if size is None:
                raise HostsError(f"{path}: MemoryMax={value} is not bytes, K, M, G or T")
            memory_max = int(size.group(1)) * _SCALE[size.group(2)]
    return UnitLimits(nofile, memory_max)


_CAP_SYS_RESOURCE = 24


def applicable(limits: UnitLimits) -> UnitLimits:
    """`limits` as this process can apply them: systemd (root, every capability) may raise a
    descriptor limit past its own hard one; a harness without CAP_SYS_RESOURCE (a container)
    cannot, and gives its services its own hard limit instead, saying so on stderr."""
    if limits.nofile is None:
        return limits
    hard_now = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard_now == resource.RLIM_INFINITY or limits.nofile[1] <= hard_now or _may_raise():
        return limits
    soft, hard = (min(n, hard_now) for n in limits.nofile)
    print(
        f"nonomad.hosts: LimitNOFILE {limits.nofile[1]} is past this process's hard limit "
        f"({hard_now}), which it may not raise: services get {hard}",
        file=sys.stderr,
    )
    return replace(limits, nofile=(soft, hard))


def _may_raise() -> bool:
    """Whether this process holds CAP_SYS_RESOURCE (raises hard resource limits)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> _CAP_SYS_RESOURCE & 1)
    return False


_VAR = re.compile(r"\$\{(\w+)\}")


def expand(words: Sequence[str], env: dict[str, str]) -> list[str]:
    """systemd's expansion: `${VAR}` stays one word, a word that is `$VAR` splits on spaces
    (an empty one is no word). A variable the environment lacks is an error."""

    def value(name: str) -> str:
        if name not in env:
            raise HostsError(f"the unit names ${name}, which its environment file lacks")
        return env[name]

    out: list[str] = []
    for word in words:
        if re.fullmatch(r"\$\w+", word):
            out += value(word[1:]).split()
        else:
            out.append(_VAR.sub(lambda m: value(m.group(1)), word))
    return out


def command(role: str, env: dict[str, str]) -> list[str]:
    """The role's ExecStart with `env`, its program taken from this Python's environment
    (where the unit file says /opt/nonomad/.venv/bin)."""
    argv = expand(read_unit(DEPLOY / UNITS[role]), env)
    return [str(Path(sys.executable).parent / Path(argv[0]).name), *argv[1:]]


def role_env(role: str, values: dict[str, str]) -> dict[str, str]:
    """The example environment file of `role` with `values` in place of its own; a value the
    example does not name is an error (the docs name every variable the harness sets)."""
    example = read_env(DEPLOY / f"{role}.env")
    unknown = sorted(set(values) - set(example))
    if unknown:
        raise HostsError(f"deploy/{role}.env does not name {', '.join(unknown)}")
    return {**example, **values}


# -- namespaces ------------------------------------------------------------------------------


@contextlib.contextmanager
def _entered(name: str) -> Iterator[None]:
    """This thread inside the network namespace `name` (sockets made now stay in it)."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    target = os.open(NETNS_DIR / name, os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns(target, CLONE_NEWNET)
        try:
            yield
        finally:
            setns(own, CLONE_NEWNET)
    finally:
        os.close(own)
        os.close(target)


def _sysctl(netns: str, key: str, value: str) -> None:
    with _entered(netns), open(f"/proc/sys/{key}", "w") as f:
        f.write(value)


# -- leftovers -------------------------------------------------------------------------------

_TAGGED = re.compile(rf"^{PREFIX}(\d+)s(\d+)-")


def _pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _marked(tag: str) -> list[int]:
    """Processes whose environment carries this run's mark."""
    mark = f"{RUN_MARK}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if mark in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
    return found


def _cgroups(start: str) -> list[Path]:
    """The cgroups (of every v1 controller flyd uses) whose names begin with `start`: a run's
    machines', and its services' memory cgroups (`Hosts.memory_cgroup`)."""
    out = []
    for controller in ("memory", "cpu", "cpuacct", "pids", "cpu,cpuacct"):
        base = CGROUP_ROOT / controller
        if base.is_dir() and not base.is_symlink():
            out += [p for p in base.iterdir() if p.is_dir() and p.name.startswith(start)]
    return out


def _await_deaths(pids: list[int], deadline: float = 30.0) -> None:
    """Wait until each of `pids` is gone or a zombie: SIGKILL is delivered, not awaited, and a
    process that still runs holds its cgroup and its namespaces. A process left alive after
    `deadline` (stuck in the kernel) is logged and left."""
    end = time.monotonic() + deadline
    alive = [pid for pid in pids if _pid_alive(pid)]
    while alive and time.monotonic() < end:
        time.sleep(0.01)
        alive = [pid for pid in alive if _pid_alive(pid)]
    if alive:
        print(f"nonomad.hosts: still alive after SIGKILL: {alive}", file=sys.stderr)


def remove_run(tag: str) -> None:
    """Everything of run `tag`: its processes, its machines' cgroups, its namespaces (and
    with them every link, bridge and route it made)."""
    from pyroute2 import netns

    killed = _marked(tag)
    for pid in killed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _await_deaths(killed)
    for cg in _cgroups(f"{PREFIX}{tag}-"):
        remove_tree(cg)
    for name in netns.listnetns():
        if name.startswith(f"{PREFIX}{tag}-"):
            with contextlib.suppress(OSError):
                netns.remove(name)


def sweep() -> list[str]:
    """Remove what crashed runs left (their harness's pid is gone); the runs swept."""
    from pyroute2 import netns

    names = [*netns.listnetns(), *(cg.name for cg in _cgroups(PREFIX))]
    tags = {m.group(1) + "s" + m.group(2) for n in names if (m := _TAGGED.match(n))}
    dead = sorted(t for t in tags if not _pid_alive(int(t.split("s")[0])))
    for tag in dead:
        remove_run(tag)
    return dead


# -- forwarding a port of the main namespace's loopback into a host --------------------------


class Forward:
    """127.0.0.1:`port` in the main namespace, forwarded to `target` inside the host's
    namespace: an accepting thread that lives there (the sockets it makes are made there), and
    two copying threads per connection, at most `MAX_FORWARDED` connections at once."""

    MAX_FORWARDED = 256

    def __init__(self, netns: str, target: tuple[str, int], port: int = 0) -> None:
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", port))
        self.listener.listen(128)
        self.listener.settimeout(0.1)  # how soon the accepting thread sees a close
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.netns, self.target = netns, target
        self._stop = threading.Event()
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        target = os.open(NETNS_DIR / self.netns, os.O_RDONLY | os.O_CLOEXEC)
        setns(target, CLONE_NEWNET)  # this thread only, for good: it ends with the forward
        os.close(target)
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                conn.close()
                continue
            with self._lock:
                if len(self._open) >= 2 * self.MAX_FORWARDED:
                    conn.close()
                    upstream.close()
                    continue
                self._open.update((conn, upstream))
            for src, dst in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._copy, args=(src, dst), daemon=True).start()

    def _copy(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        with self._lock:  # the second copier of the pair to finish closes both
            done = src not in self._open or dst not in self._open
            self._open.discard(src)
            if done:
                self._open.discard(dst)
        if done:
            src.close()
            dst.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.listener.close()
        with self._lock:
            left, self._open = list(self._open), set()
        for sock in left:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


# -- the hosts -------------------------------------------------------------------------------


@dataclass
class Host:
    """One host: its namespace, address, role and the service it runs."""

    name: str
    role: str
    address: str
    netns: str
    link: str  # its port on the fabric's bridge
    env: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    announced: dict[str, str] = field(default_factory=dict)
    log: Path = Path()
    network: str = ""  # a worker's machine prefix
    limits: UnitLimits = field(default_factory=UnitLimits)  # its unit's, as applied

    @property
    def grpc(self) -> str:
        return self.announced.get(READY_PREFIX, "")


class Hosts:
    """A cluster on hosts of their own under `root` (see the module docstring).

    `workers`: (worker id, region) per worker host. `options`: more flags per role (the
    `$FLYD_OPTS`, ... of its environment file). `image_source`: the workers' images.
    """

    def __init__(
        self,
        root: Path,
        workers: Sequence[tuple[str, str]],
        *,
        image_source: Path,
        options: dict[str, str] | None = None,
        region: str = "ams",
        domain: str = "nonomad.localhost",
    ) -> None:
        from nonomad.cli_local import MAX_LOCAL_WORKERS, worker_sandbox_args

        if not 1 <= len(workers) <= MAX_LOCAL_WORKERS:
            raise HostsError(f"1 to {MAX_LOCAL_WORKERS} worker hosts, not {len(workers)}")
        self.root = root.absolute()
        self.image_source = image_source.absolute()
        self.options = dict(options or {})
        self.region, self.domain = region, domain
        self.tag = f"{os.getpid()}s{next(_runs)}"
        self.security: ClusterSecurity | None = None
        self.forwards: list[Forward] = []
        self.hosts: dict[str, Host] = {}
        for i, name in enumerate(["flaps", "registry", "proxy"]):
            self._add(name, name, ROLE_HOST[name], i)
        for n, (worker_id, worker_region) in enumerate(workers, start=1):
            host = self._add(worker_id, "flyd", 10 + n, 2 + n)
            sandbox = worker_sandbox_args(n)
            host.network = sandbox[1]
            host.env = {"REGION": worker_region, "UID_BASE": sandbox[3]}

    def _add(self, name: str, role: str, octet: int, index: int) -> Host:
        host = Host(
            name,
            role,
            str(NETWORK.network_address + octet),
            f"{PREFIX}{self.tag}-{index}",
            f"h{index}",
        )
        self.hosts[name] = host
        return host

    @property
    def fabric(self) -> str:
        return f"{PREFIX}{self.tag}-{FABRIC}"

    @property
    def workers(self) -> list[Host]:
        return [h for h in self.hosts.values() if h.role == "flyd"]

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    # -- up ------------------------------------------------------------------------------------

    def up(self) -> Hosts:
        """Sweep leftovers, make the hosts and their link, start every service; on a failure
        everything made so far is torn down."""
        sweep()
        try:
            self._network()
            self._start_all()
            self._save()
        except BaseException:
            self.close()
            raise
        return self

    def _network(self) -> None:
        from pyroute2 import NetNS, netns

        netns.create(self.fabric)
        with NetNS(self.fabric) as fab:
            fab.link("add", ifname="br0", kind="bridge")
            bridge = fab.link_lookup(ifname="br0")[0]
            fab.link("set", index=bridge, state="up")
            for host in self.hosts.values():
                netns.create(host.netns)
                fab.link(
                    "add",
                    ifname=host.link,
                    kind="veth",
                    peer={"ifname": "eth0", "net_ns_fd": host.netns},
                )
                index = fab.link_lookup(ifname=host.link)[0]
                fab.link("set", index=index, master=bridge, state="up")
        for host in self.hosts.values():
            with NetNS(host.netns) as ns:
                for ifname in ("lo", "eth0"):
                    ns.link("set", index=ns.link_lookup(ifname=ifname)[0], state="up")
                eth0 = ns.link_lookup(ifname="eth0")[0]
                ns.addr("add", index=eth0, address=host.address, prefixlen=NETWORK.prefixlen)
                # Each worker's machines, through that worker (its own are routed by its netd).
                for worker in self.workers:
                    if worker is not host:
                        ns.route("add", dst=worker.network, gateway=worker.address, oif=eth0)
            if host.role == "flyd":  # forwards the other hosts' packets into its hub
                _sysctl(host.netns, "net/ipv4/ip_forward", "1")

    def _values(self, host: Host) -> dict[str, str]:
        assert self.security is not None
        sec = self.security
        part = f"flyd-{host.name}" if host.role == "flyd" else host.role
        cert = sec.cert(part)
        data = self.root / "hosts" / host.name
        data.mkdir(parents=True, exist_ok=True)
        # A worker's data where `nonomad up` keeps it: `workers kill --with-machines` finds its
        # machines there.
        flyd_data = self.root / "workers" / host.name
        values = {"ADDRESS": host.address, "TLS_CERT": str(cert.cert), "TLS_KEY": str(cert.key)}
        values["CA"] = str(sec.ca)
        flaps = f"{self['flaps'].address}:{PORTS['flaps_cluster']}"
        opts = self.options.get(host.role, "")
        if host.role == "flaps":
            values.update(
                TOKEN_KEYS=str(sec.token_keys), IMAGES=str(self.image_source), FLAPS_OPTS=opts
            )
        elif host.role == "proxy":
            values.update(
                FLAPS_CLUSTER=flaps,
                HTTP_PORT=str(HTTP_PORT),
                REGION=self.region,
                DOMAIN=self.domain,
                PROXY_OPTS=opts,
            )
        elif host.role == "registry":
            values.update(REGISTRY_OPTS=opts)
        else:
            values.update(
                WORKER_ID=host.name,
                NETWORK=host.network,
                CGROUP_PREFIX=f"{PREFIX}{self.tag}-{host.name}",
                DATA_DIR=str(flyd_data),
                IMAGES=str(self.image_source),
                FLAPS_CLUSTER=flaps,
                PROXY=f"{self['proxy'].address}:{PORTS['proxy']}",
                REGISTRY=f"{self['registry'].address}:{PORTS['registry']}",
                FLYD_OPTS=opts,
            )
        return values

    def _start_all(self) -> None:
        parts = ["flaps", "proxy", "registry", *(f"flyd-{w.name}" for w in self.workers)]
        self.security = provision(self.root, parts)
        for name in ("flaps", "registry", "proxy"):
            self.start(name)
        with ThreadPoolExecutor(len(self.workers)) as pool:
            list(pool.map(lambda w: self.start(w.name), self.workers))

    def start(self, name: str) -> Host:
        """Start the host's service (again: on its data dir and address) and wait until it
        says it is ready."""
        host = self.hosts[name]
        if host.proc is not None:
            if host.proc.poll() is None:
                raise HostsError(f"{name} runs already")
            if host.proc.stdout is not None:
                host.proc.stdout.close()
        host.env = role_env(host.role, {**host.env, **self._values(host)})
        (self.root / "hosts" / name / f"{host.role}.env").write_text(
            "".join(f"{k}={v}\n" for k, v in host.env.items())
        )
        host.argv = command(host.role, host.env)
        host.log = self.root / "hosts" / name / f"{host.role}.log"
        host.limits = applicable(read_limits(DEPLOY / UNITS[host.role]))
        with open(host.log, "ab") as err:
            host.proc = self.popen(name, host.argv, limits=host.limits, stderr=err)
        try:
            host.announced = read_announcements(host.proc, READY_TIMEOUT)
        except RuntimeError as e:
            tail = host.log.read_text(errors="replace").splitlines()[-20:]
            raise HostsError(f"{name} did not start: {e}\n" + "\n".join(tail)) from None
        return host

    def popen(
        self,
        name: str,
        argv: Sequence[str],
        *,
        limits: UnitLimits = UnitLimits(),
        **kwargs: Any,
    ) -> subprocess.Popen[bytes]:
        """`argv` started inside host `name` (stdout on a pipe, its own session), held to
        `limits` as systemd holds a unit's service (its descriptor limit; a memory cgroup of its
        own, `memory_cgroup`), marked as this run's so that a sweep finds it; `kwargs` go to
        Popen (stderr, say)."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("OTEL_", "NONOMAD_", "FLYD_", "FLAPS_", "PROXY_", "REGISTRY_"))
        }
        env[RUN_MARK] = self.tag
        command = ["nsenter", f"--net={NETNS_DIR / self.hosts[name].netns}", "--", *argv]
        if limits.nofile is not None:
            command = ["prlimit", "--nofile={}:{}".format(*limits.nofile), "--", *command]
        if limits.memory_max is not None:
            cgroup = self.memory_cgroup(name)
            try:
                limit_memory(cgroup, limits.memory_max)
            except OSError as e:
                raise HostsError(f"{name}: its unit's MemoryMax cannot be set: {e}") from None
            command = joining(cgroup, command)
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,
            **kwargs,
        )

    def memory_cgroup(self, name: str) -> Path:
        """The v1 memory cgroup host `name`'s service runs in when its unit sets MemoryMax:
        beside a worker's machines' cgroups (its `--cgroup-prefix`), never above them, named as
        this run's so that `remove_run` and a sweep find it."""
        return CGROUP_ROOT / "memory" / f"{PREFIX}{self.tag}-{name}.service"

    def _save(self) -> None:
        """hosts.json: what `nonomad workers partition|heal` needs to find the hosts."""
        record = {
            "tag": self.tag,
            "fabric": self.fabric,
            "hosts": {
                h.name: {"role": h.role, "address": h.address, "netns": h.netns, "link": h.link}
                for h in self.hosts.values()
            },
        }
        (self.root / "hosts.json").write_text(json.dumps(record, indent=2))

    # -- what a test or the CLI does with them -------------------------------------------------

    @property
    def flaps_cluster(self) -> str:
        return self["flaps"].announced[CLUSTER_PREFIX]

    def forward(self, name: str, port: int, local_port: int = 0) -> str:
        """A 127.0.0.1 address in the main namespace forwarded to `port` of host `name`."""
        host = self.hosts[name]
        fwd = Forward(host.netns, (host.address, port), local_port)
        self.forwards.append(fwd)
        return fwd.address

    def partition(self, name: str) -> None:
        """Cut the host off from every other host."""
        set_cut(self.fabric, self.hosts[name].link, True)

    def heal(self, name: str) -> None:
        set_cut(self.fabric, self.hosts[name].link, False)

    def block(self, name: str, other: str) -> None:
        """Host `name` can no longer reach host `other` (nor hear from it): a blackhole route
        to its address in `name`'s namespace, and back; `unblock` removes both."""
        self._blackhole(name, other, "add")

    def unblock(self, name: str, other: str) -> None:
        self._blackhole(name, other, "del")

    def _blackhole(self, name: str, other: str, op: str) -> None:
        from pyroute2 import NetNS

        for here, there in ((name, other), (other, name)):
            with NetNS(self.hosts[here].netns) as ns:
                ns.route(op, dst=f"{self.hosts[there].address}/32", type="blackhole")

    def kill(self, name: str, *, machines: bool = False) -> None:
        """SIGKILL the host's service; with `machines`, a worker's machines too (the host died)."""
        host = self.hosts[name]
        if host.proc is not None and host.proc.poll() is None:
            host.proc.kill()
            host.proc.wait(10)
        if machines and host.role == "flyd":
            kill_all(Path(host.env["DATA_DIR"]) / "machines")

    def in_host(self, name: str, work: Callable[[], Any]) -> Any:
        """Run `work` in a thread inside host `name`'s namespace (its sockets are made there)."""
        result: list[Any] = []

        def run() -> None:
            with _entered(self.hosts[name].netns):
                result.append(work())

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        return result[0] if result else None

    # -- down ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every service (SIGTERM, then SIGKILL), every machine, every forward; remove
        every namespace (links, bridge, routes go with them) and cgroup of this run."""
        for fwd in self.forwards:
            fwd.close()
        self.forwards.clear()
        procs = [h.proc for h in self.hosts.values() if h.proc is not None]
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGCONT)
                    proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            if proc.stdout is not None:
                proc.stdout.close()
        for worker in self.workers:
            if "DATA_DIR" in worker.env:
                with contextlib.suppress(OSError):
                    kill_all(Path(worker.env["DATA_DIR"]) / "machines")
        remove_run(self.tag)
        with contextlib.suppress(FileNotFoundError):
            (self.root / "hosts.json").unlink()
